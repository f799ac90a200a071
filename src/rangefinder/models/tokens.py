"""How many tokens a caption takes in a model's tokenizer, for the split report's count of captions cut off, and
whether textual inversion's initializer word is the one token it must be.

CLIP's text encoder (SD 1.x/2.x) reads 77 positions: a start token, 75 of text and an end token; longer captions are
truncated, their last tags silently unseen by the model (docs/design.md, "Long captions").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rangefinder.errors import ConfigError


def caption_token_counter(model_or_tokenizer_dir: str | Path) -> tuple[Callable[[str], int], int]:
    """(text -> its number of text tokens, how many text tokens fit) for a diffusers model folder (its
    `tokenizer/`) or a tokenizer folder."""
    folder = Path(model_or_tokenizer_dir).expanduser()
    if (folder / "tokenizer").is_dir():
        folder = folder / "tokenizer"
    fast = _from_tokenizer_json(folder)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"no tokenizer in {folder} ({str(e).splitlines()[0]}); give a diffusers model folder (with tokenizer/) "
            "or a tokenizer folder"
        ) from None
    # A tokenizer saved without its length reports a huge sentinel; CLIP's context is 77 tokens (as caching.tokenize).
    length = tokenizer.model_max_length if tokenizer.model_max_length < 100_000 else 77
    special = tokenizer.num_special_tokens_to_add(pair=False)
    backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: fast, and no per-call warning
    if backend is not None:
        backend.no_padding()  # a saved tokenizer.json may pad (or cut) to 77: count the text's own tokens
        backend.no_truncation()
        return (lambda text: len(backend.encode(text, add_special_tokens=False).ids)), length - special
    # The Python tokenizer warns (once) about sequences longer than the model: here that is what is being counted.
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return (lambda text: len(tokenizer.tokenize(text))), length - special


def check_initializer_token(initializer: str, count_tokens: Callable[[str], int]) -> None:
    """ConfigError unless `initializer` (training.textual_inversion.initializer_token) is a single token of the
    tokenizer `count_tokens` counts text tokens with: each new embedding row starts as that one token's row. What the
    engine checks on the tokenizer it loaded (methods/textual_inversion.py) and the checks before a run on the base
    model's folder (check_initializer_in_model), in the same words."""
    pieces = count_tokens(initializer)
    if pieces != 1:
        raise ConfigError(
            f"training.textual_inversion.initializer_token: {initializer!r} is {pieces} tokens for the base model's "
            "tokenizer; pick a word that is a single token (e.g. 'object', 'style')"
        )


def check_initializer_in_model(model_dir: str | Path, initializer: str) -> None:
    """check_initializer_token with each tokenizer of a diffusers model folder whose encoder textual inversion trains
    (tokenizer/, and SDXL's tokenizer_2/), read from its files without loading any weights: so that a word it splits
    stops a run before it trains (it stopped the pipeline's first training step, after its dataset was prepared)."""
    folder = Path(model_dir).expanduser()
    for part in ("tokenizer", "tokenizer_2"):
        if (folder / part).is_dir():
            count_tokens, _ = caption_token_counter(folder / part)
            check_initializer_token(initializer, count_tokens)


def _from_tokenizer_json(folder: Path) -> tuple[Callable[[str], int], int] | None:
    """The count from a saved fast tokenizer's tokenizer.json with the `tokenizers` library alone, the Rust tokenizer
    transformers' fast tokenizer wraps (the same count), without importing transformers and torch: about 4 s of CPU
    in every prepare-dataset step. None: no tokenizer.json (a slow tokenizer's vocab and merges), for transformers."""
    import json

    from tokenizers import Tokenizer

    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        settings = json.loads((folder / "tokenizer_config.json").read_text()) \
            if (folder / "tokenizer_config.json").is_file() else {}
    except Exception as e:  # noqa: BLE001  (tokenizers raises a plain Exception on a file it cannot parse)
        raise ConfigError(f"no tokenizer in {folder} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                          "give a diffusers model folder (with tokenizer/) or a tokenizer folder") from None
    backend.no_padding()  # a saved tokenizer.json may pad (or cut) to 77: count the text's own tokens
    backend.no_truncation()
    # As transformers reads it: a length saved as a huge sentinel (or none) is CLIP's context of 77 tokens.
    saved = settings.get("model_max_length") if isinstance(settings, dict) else None
    length = saved if isinstance(saved, int) and saved < 100_000 else 77
    special = backend.post_processor.num_special_tokens_to_add(False) if backend.post_processor is not None else 0
    return (lambda text: len(backend.encode(text, add_special_tokens=False).ids)), length - special
