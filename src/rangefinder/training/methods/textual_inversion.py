"""Textual inversion (Gal et al. 2022, arXiv:2208.01618): learn the embedding of a new word, nothing else.

New placeholder tokens are added to the tokenizer (`<tok>`, and `<tok>_1`, `<tok>_2`, ... for several vectors,
diffusers' naming, which its `load_textual_inversion` expands in prompts the same way); their embedding rows start
as the initializer word's. The whole token-embedding matrix is handed to the optimizer, as in diffusers'
textual_inversion example, and after every update all rows but the new ones are put back, so weight decay and Adam
cannot move them. Everything else is frozen.

Captions: a caption with the placeholder keeps it (expanded to all vectors); an empty caption becomes a prompt
template for `learnable_property` ("a photo of a <tok>" / "a painting in the style of <tok>"); any other caption
gets the token added ("<tok>, caption" / "caption, in the style of <tok>").

Outputs in `final/` (src/rangefinder/formats/embeddings.py): `learned_embeds.safetensors` (diffusers:
`{token: (vectors, dim)}`) and, for A1111, `a1111/<trigger>.safetensors` and `a1111/<trigger>.pt`, named after the
trigger word A1111 will know them by (the token, less characters file names cannot hold: `<rf-concept>` ->
`rf-concept`), the .pt with the update count and base model A1111 shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rangefinder.errors import ConfigError
from rangefinder.models.tokens import check_initializer_token
from rangefinder.training.methods.base import Method, cast_frozen

if TYPE_CHECKING:
    from rangefinder.models.loading import SDComponents

# Prompt templates in the manner of the TI paper's (which follow CLIP's ImageNet prompts): varied plain framings,
# so the token absorbs the concept rather than one sentence.
OBJECT_TEMPLATES = (
    "a photo of a {}",
    "a rendering of a {}",
    "a close up photo of the {}",
    "a bright photo of a {}",
    "a good photo of the {}",
    "a cropped photo of a {}",
    "a photo of one {}",
    "a large picture of the {}",
)
STYLE_TEMPLATES = (
    "a painting in the style of {}",
    "a rendering in the style of {}",
    "a picture in the style of {}",
    "a large painting in the style of {}",
    "a nice picture in the style of {}",
    "a small painting in the style of {}",
)


@dataclass
class _Rows:
    """One text encoder's learned rows: the encoder, the new tokens' ids, the rows to put back after each update."""

    te: Any
    token_ids: list[int]
    frozen: torch.Tensor  # (vocab, dim) the embedding matrix as set up
    keep: torch.Tensor  # (vocab,) bool: rows that must not change


def placeholder_tokens(token: str, num_vectors: int) -> list[str]:
    return [token] + [f"{token}_{i}" for i in range(1, num_vectors)]


class TextualInversion(Method):
    name = "textual_inversion"
    fills_empty_captions = True  # transform_caption: a prompt template for the learnable property

    def setup(self, sd: SDComponents, weight_dtype: torch.dtype) -> None:
        self.check_family(sd.family)
        s = self.cfg.textual_inversion
        self.tokens = placeholder_tokens(s.placeholder_token, s.num_vectors)
        sd.unet.requires_grad_(False)
        cast_frozen(sd.unet, weight_dtype)
        # One embedding per text encoder (SDXL: both, each with its own tokenizer), all starting at the
        # initializer word's row of that encoder.
        tokenizers = {"text_encoder": sd.tokenizer, "text_encoder_2": sd.tokenizer_2}
        self._encoders: dict[str, _Rows] = {}
        for name, te in sd.text_encoders().items():
            self._encoders[name] = self._add_tokens(tokenizers[name], te, s.initializer_token)
        self._te = sd.text_encoder
        self.token_ids = self._encoders["text_encoder"].token_ids
        self._template_i = 0

    def _add_tokens(self, tok: Any, te: Any, initializer: str) -> _Rows:
        # A word the tokenizer already has as one token would be shadowed in every prompt, not learned afresh.
        clash = [t for t in self.tokens if t in tok.get_vocab() or len(tok.encode(t, add_special_tokens=False)) == 1]
        if clash:
            raise ConfigError(
                f"training.textual_inversion.placeholder_token: {clash[0]!r} is already in the tokenizer's "
                "vocabulary; choose a new word, e.g. '<my-concept>'"
            )
        check_initializer_token(initializer, lambda word: len(tok.encode(word, add_special_tokens=False)))
        init_ids = tok.encode(initializer, add_special_tokens=False)
        tok.add_tokens(self.tokens)
        token_ids = tok.convert_tokens_to_ids(self.tokens)
        if len(tok) > te.get_input_embeddings().weight.shape[0]:  # never shrink: a model may have spare rows
            # mean_resizing=False: the new rows are set just below; drawing them at random would spend global RNG.
            te.resize_token_embeddings(len(tok), mean_resizing=False)
        te.requires_grad_(False)
        te.to(torch.float32)  # the trained rows live in it; the rest of CLIP is small
        emb = te.get_input_embeddings()
        with torch.no_grad():
            for i in token_ids:
                emb.weight[i] = emb.weight[init_ids[0]]
        emb.weight.requires_grad_(True)
        keep = torch.ones(emb.weight.shape[0], dtype=torch.bool)
        keep[token_ids] = False
        return _Rows(te, token_ids, emb.weight.detach().clone(), keep)

    def transform_caption(self, text: str) -> str:
        s = self.cfg.textual_inversion
        token = s.placeholder_token
        text = text.strip()
        if not text:
            templates = OBJECT_TEMPLATES if s.learnable_property == "object" else STYLE_TEMPLATES
            # Captionless items cycle through the templates (the loop asks once per item, in a fixed order).
            text = templates[self._template_i % len(templates)].format(token)
            self._template_i += 1
        elif token not in text:
            text = f"{token}, {text}" if s.learnable_property == "object" else f"{text}, in the style of {token}"
        # The pipeline expands "<tok>" to "<tok> <tok>_1 ..." at inference (diffusers' maybe_convert_prompt).
        return text.replace(token, " ".join(self.tokens))

    @property
    def text_encoder_changes(self) -> bool:
        return True

    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        return {name: rows.te for name, rows in self._encoders.items()}

    def param_groups(self) -> list[dict[str, Any]]:
        return [{"params": [rows.te.get_input_embeddings().weight for rows in self._encoders.values()]}]

    def after_optimizer_step(self) -> None:
        super().after_optimizer_step()
        for rows in self._encoders.values():
            weight = rows.te.get_input_embeddings().weight
            with torch.no_grad():
                keep = rows.keep.to(weight.device)
                weight[keep] = rows.frozen.to(weight.device, weight.dtype)[keep]

    def learned_embeds(self, encoder: str = "text_encoder") -> torch.Tensor:
        """(num_vectors, dim) the trained rows of one encoder."""
        rows = self._encoders[encoder]
        return rows.te.get_input_embeddings().weight[rows.token_ids].detach()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return self._with_updates({f"{name}.learned_embeds": self.learned_embeds(name).contiguous()
                                   for name in self._encoders})

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, enc in self._encoders.items():
            rows = state.get(f"{name}.learned_embeds")
            if rows is None or rows.shape[0] != len(enc.token_ids):
                raise ValueError(
                    "textual-inversion checkpoint does not hold "
                    f"{len(enc.token_ids)} embedding vectors for {name}; resume with the same "
                    "training.textual_inversion settings"
                )
            weight = enc.te.get_input_embeddings().weight
            with torch.no_grad():
                weight[enc.token_ids] = rows.to(weight.device, weight.dtype)
        self._restore_updates(state)

    def save_final(self, sd: SDComponents, out_dir: Path) -> None:
        from rangefinder.formats.embeddings import save_textual_inversion
        s = self.cfg.textual_inversion
        meta = self.output_metadata(sd, extra={
            "placeholder_token": s.placeholder_token,
            "initializer_token": s.initializer_token,
            "num_vectors": str(s.num_vectors),
            "learnable_property": s.learnable_property,
        })
        predicts = self.trained_prediction_type(sd)
        if "text_encoder_2" in self._encoders:  # SDXL: clip_l and clip_g
            from rangefinder.formats.embeddings import save_textual_inversion_sdxl

            save_textual_inversion_sdxl(out_dir, s.placeholder_token, self.learned_embeds().float().cpu(),
                                        self.learned_embeds("text_encoder_2").float().cpu(),
                                        metadata=meta, prediction_type=predicts,
                                        facts=self.spec_facts)
            return
        from rangefinder.formats.model_spec import sd_base_model

        # SD 1.x or 2.x, named in the files as sd-scripts names an embedding's base model.
        architecture = None if predicts is None else sd_base_model(sd.unet.config, predicts)[1]
        save_textual_inversion(out_dir, s.placeholder_token, self.learned_embeds().float().cpu(), metadata=meta,
                               architecture=architecture, prediction_type=predicts, facts=self.spec_facts)
