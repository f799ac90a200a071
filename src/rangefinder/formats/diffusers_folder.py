"""`full`'s diffusers folder, as transformers 4.x and 5.x, fast and slow tokenizers all load it.

`save_pipeline_folder`: `save_pretrained`, then its text encoder's weights in the `text_model.` layout that
transformers 4.x and 5.x both load, its tokenizer with `vocab.json`/`merges.txt` for slow tokenizers, and its configs
without the folder the models were loaded from (`_name_or_path`).
"""

from __future__ import annotations

import json
from pathlib import Path

from rangefinder.formats.atomic import give_usual_mode, write_json, write_text
from rangefinder.formats.weights_file import save_safetensors

CLIP_TEXT_PREFIX = "text_model."
# The key diffusers' from_pretrained registers in a model's config, and in a pipeline's when it loads one whole, the
# folder or hub id it loaded it from, and save_pretrained writes into config.json and model_index.json
# (configuration_utils.py, `ConfigMixin.to_json_string` keeps it). No loader reads it back: from_pretrained
# registers the folder it reads anew.
LOADED_FROM_KEY = "_name_or_path"


def clip_text_key(key: str) -> str:
    """A CLIPTextModel weight name in the layout every consumer knows, under `text_model.`.

    transformers 5 dropped that wrapper module (and strips the prefix when it loads: its conversion_mapping.py,
    `PrefixChange(prefix_to_remove="text_model")` for CLIPTextModel); transformers 4.x, SD 1.x single files, kohya and
    ComfyUI all name the weights under it.
    """
    return key if key.startswith(CLIP_TEXT_PREFIX) else CLIP_TEXT_PREFIX + key


def write_text_encoder_weights_with_prefix(text_encoder_dir: Path) -> None:
    """Rename the saved CLIP text encoder's weights to the `text_model.` layout, in place (one file at a time, each
    atomically). transformers 4.x loads a CLIPTextModel saved without the prefix with every weight missing: a text
    encoder left at random initialisation, with only a warning."""
    from safetensors import safe_open

    text_encoder_dir = Path(text_encoder_dir)
    config = json.loads((text_encoder_dir / "config.json").read_text())
    if "CLIPTextModel" not in config.get("architectures", []):
        return  # only CLIPTextModel has the wrapper (CLIPTextModelWithProjection keeps `text_model.` in 5.x)
    for path in sorted(text_encoder_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if all(k.startswith(CLIP_TEXT_PREFIX) for k in f.keys()):
                continue
            tensors = {clip_text_key(k): f.get_tensor(k) for k in f.keys()}
        # transformers 4.x refuses a safetensors file whose metadata lacks {"format": "pt"}.
        save_safetensors(tensors, path, {"format": "pt", **meta})
    index = text_encoder_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {clip_text_key(k): v for k, v in data["weight_map"].items()}
        write_json(index, data)


def write_slow_tokenizer_files(tokenizer, tokenizer_dir: Path) -> None:
    """`vocab.json`, `merges.txt` and (when tokens were added) `added_tokens.json` beside `tokenizer.json`, from the
    tokenizer's own BPE model.

    transformers 5 saves only `tokenizer.json` (added tokens included); the slow (pure Python) CLIPTokenizer of
    transformers 4.x and the tools built on it read these files instead. Tokens added on top of the BPE vocabulary
    (textual inversion's) go to `added_tokens.json`, `{token: id}`, the slow tokenizers' file for them.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return  # a slow tokenizer's save_pretrained writes these files itself
    spec = json.loads(backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer model {model.get('type')!r} is not BPE; cannot write vocab.json/merges.txt")
    vocab = model["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokenizer_dir = Path(tokenizer_dir)
    write_text(tokenizer_dir / "vocab.json", json.dumps(vocab, ensure_ascii=False) + "\n")
    # The header line is part of the format: CLIP's slow tokenizer skips the first line of merges.txt.
    write_text(tokenizer_dir / "merges.txt", "\n".join(["#version: 0.2", *merges]) + "\n")
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t["content"] not in vocab}
    if added:
        write_json(tokenizer_dir / "added_tokens.json", added)


def forget_where_loaded_from(folder: Path) -> None:
    """Each config of a saved pipeline folder without `_name_or_path` (LOADED_FROM_KEY), in place: it named the base
    model's folder on the machine that saved it (a home directory, a cache path) to whoever the folder is shared with,
    and the folder's revision (models/fingerprint.py, which hashes the configs) changed with that path alone."""
    folder = Path(folder)
    # model_index.json, then each part's: unet/config.json, scheduler/scheduler_config.json, ...
    for path in [folder / "model_index.json", *sorted(folder.glob("*/*config.json"))]:
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):  # OSError: no model_index.json (a folder saved part by part)
            continue  # not a JSON object diffusers wrote; nothing of ours to take out
        if isinstance(config, dict) and LOADED_FROM_KEY in config:
            del config[LOADED_FROM_KEY]
            write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")  # as diffusers writes its configs


def save_pipeline_folder(pipe, out_dir: Path) -> Path:
    """`pipe.save_pretrained` (safetensors), then the fixes above, so the folder loads under transformers 4.x and
    5.x, with fast or slow tokenizers, and names no folder of the machine that saved it; its weights files get the
    mode a usual write gives (save_pretrained's are 0600)."""
    out_dir = Path(out_dir)
    pipe.save_pretrained(str(out_dir), safe_serialization=True)
    forget_where_loaded_from(out_dir)
    for weights in out_dir.rglob("*.safetensors"):
        give_usual_mode(weights)  # save_pretrained's safetensors files are 0600
    if (out_dir / "text_encoder").is_dir():
        write_text_encoder_weights_with_prefix(out_dir / "text_encoder")
    for name in ("tokenizer", "tokenizer_2"):  # tokenizer_2: SDXL's second
        if getattr(pipe, name, None) is not None:
            write_slow_tokenizer_files(getattr(pipe, name), out_dir / name)
    return out_dir
