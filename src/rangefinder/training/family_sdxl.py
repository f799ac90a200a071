"""Stable Diffusion XL (Podell et al. 2023, arXiv:2307.01952): the family's conditioning.

Two text encoders (CLIP ViT-L, `text_encoder`, and OpenCLIP bigG, `text_encoder_2`); the UNet attends to their
penultimate hidden states concatenated, and its added embedding (`addition_embed_type="text_time"`) takes the second
encoder's pooled, projected output and six size numbers, `add_time_ids` = (original height, original width, crop
top, crop left, target height, target width), as diffusers' StableDiffusionXLPipeline.encode_prompt and
_get_add_time_ids compute them (and its train_text_to_image_sdxl.py example trains). The objective is SD's: epsilon
or v on the DDPM noise schedule, so `target` and `loss_weights` are Sd1Family's.

Conditioning layout (read only here): encoded, (N, L + 2, D) with D = D1 + D2: rows 0..L-1 the hidden states, row L
the pooled vector (first P columns), row L + 1 the add_time_ids (first 6 columns); what the text cache stores is the
first L + 1 rows (per caption), the size row is added per image (`with_images`). As token ids, (N, 3, L): the two
tokenizers' ids and the add_time_ids (first 6 columns; whole pixel counts, exact as integers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from rangefinder.errors import ConfigError
from rangefinder.training.caching import tokenize
from rangefinder.training.family import ImageGeometry, Sd1Family, _checked_prediction_type
from rangefinder.training.family_rules import SdxlRules

if TYPE_CHECKING:
    from rangefinder.config import TrainingConfig
    from rangefinder.models.loading import SDComponents

TIME_IDS = 6


def add_time_ids(g: ImageGeometry) -> list[int]:
    return [*g.original_hw, *g.crop_top_left, *g.target_hw]


@dataclass
class SdxlFamily(SdxlRules, Sd1Family):
    """Its rules told from the configs alone are SdxlRules' (family_rules.py)."""

    tokenizer_2: Any = None  # transformers CLIPTokenizer of the second encoder
    pooled_dim: int = 0  # P: text_encoder_2's projection width

    @classmethod
    def for_model(cls, sd: SDComponents, cfg: TrainingConfig) -> SdxlFamily:
        pooled = int(sd.text_encoder_2.config.projection_dim)
        width = int(sd.text_encoder.config.hidden_size) + int(sd.text_encoder_2.config.hidden_size)
        if pooled > width or width < TIME_IDS:
            raise ConfigError(f"model.base_model: an SDXL model whose pooled width ({pooled}) exceeds its text width "
                              f"({width}) is not supported")
        return cls(sd.tokenizer, sd.noise_scheduler, _checked_prediction_type(cls, sd, cfg),
                   tokenizer_2=sd.tokenizer_2, pooled_dim=pooled)

    def text_encoder_names(self) -> tuple[str, ...]:
        return ("text_encoder", "text_encoder_2")

    # --- conditioning -------------------------------------------------------------------------------------------

    def tokenize(self, captions: Sequence[str]) -> torch.Tensor:
        """(N, 2, 77): each tokenizer's ids."""
        return torch.stack([tokenize(self.tokenizer, captions), tokenize(self.tokenizer_2, captions)], dim=1)

    def encode_prompt(self, text_encoders: Sequence[torch.nn.Module], input_ids: torch.Tensor) -> torch.Tensor:
        """(B, 2, L) ids -> (B, L + 1, D1 + D2): penultimate hidden states of both encoders, then the pooled row."""
        te1, te2 = text_encoders
        out_1 = te1(input_ids[:, 0], output_hidden_states=True)
        out_2 = te2(input_ids[:, 1], output_hidden_states=True)
        hidden = torch.cat([out_1.hidden_states[-2], out_2.hidden_states[-2]], dim=-1)
        pooled = out_2.text_embeds  # (B, P)
        row = torch.zeros((hidden.shape[0], 1, hidden.shape[2]), dtype=hidden.dtype, device=hidden.device)
        row[:, 0, : pooled.shape[1]] = pooled.to(hidden.dtype)
        return torch.cat([hidden, row], dim=1)

    def with_images(self, cond: torch.Tensor, geometry: Sequence[ImageGeometry]) -> torch.Tensor:
        row = torch.zeros((cond.shape[0], 1, cond.shape[2]), dtype=cond.dtype)
        row[:, 0, :TIME_IDS] = torch.tensor([add_time_ids(g) for g in geometry], dtype=cond.dtype)
        return torch.cat([cond, row.to(cond.device)], dim=1)

    def drop_captions(self, cond: torch.Tensor, empty: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
        """Only the text rows are dropped: the image keeps its size conditioning."""
        text = super().drop_captions(cond[:, :-1], empty, drop)
        return torch.cat([text, cond[:, -1:]], dim=1)

    def conditioning(self, text_encoders: Optional[Sequence[torch.nn.Module]], cond: torch.Tensor) -> torch.Tensor:
        if text_encoders is None:
            return cond
        encoded = self.encode_prompt(text_encoders, cond[:, :2])
        sizes = torch.zeros((cond.shape[0], 1, encoded.shape[2]), dtype=encoded.dtype, device=encoded.device)
        sizes[:, 0, :TIME_IDS] = cond[:, 2, :TIME_IDS].to(encoded.dtype)
        return torch.cat([encoded, sizes], dim=1)

    def predict(self, unet: torch.nn.Module, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                cond: torch.Tensor) -> torch.Tensor:
        noisy = self.noised(latents, noise, timesteps)
        cond = cond.to(noisy.dtype)
        hidden, pooled, time_ids = cond[:, :-2], cond[:, -2, : self.pooled_dim], cond[:, -1, :TIME_IDS]
        added = {"text_embeds": pooled, "time_ids": time_ids}
        return unet(noisy, timesteps, hidden, added_cond_kwargs=added, return_dict=False)[0]

    def sampling_pipeline(self, sd: SDComponents, scheduler: Any) -> Any:
        """StableDiffusionXLPipeline over the run's modules; `force_zeros_for_empty_prompt` as the base model's
        model_index.json says (its default, True, otherwise), no watermark (as the final grid's pipelines)."""
        import json

        from diffusers import StableDiffusionXLPipeline

        index = sd.model_dir / "model_index.json" if sd.model_dir is not None else None
        zeros = json.loads(index.read_text()).get("force_zeros_for_empty_prompt", True) \
            if index is not None and index.is_file() else True
        return StableDiffusionXLPipeline(vae=sd.vae, text_encoder=sd.text_encoder, text_encoder_2=sd.text_encoder_2,
                                         tokenizer=sd.tokenizer, tokenizer_2=sd.tokenizer_2, unet=sd.unet,
                                         scheduler=scheduler, force_zeros_for_empty_prompt=bool(zeros),
                                         add_watermarker=False)
