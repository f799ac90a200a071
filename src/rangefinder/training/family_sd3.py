"""Stable Diffusion 3 / 3.5 (Esser et al. 2024, arXiv:2403.03206): the MMDiT family, on the flow objective.

Three text encoders: CLIP ViT-L (`text_encoder`), OpenCLIP bigG (`text_encoder_2`), both with projection, and
T5-XXL (`text_encoder_3`), which is never trained (its output is always the frozen encoder's). The transformer
attends to the CLIPs' penultimate hidden states side by side, zero-padded to T5's width, followed along the
sequence by T5's last hidden state, and takes the two CLIPs' pooled, projected outputs side by side as its pooled
input: what diffusers' StableDiffusion3Pipeline.encode_prompt computes (and its train_dreambooth_lora_sd3.py
trains). The objective is training/family_flow.py's.

Conditioning layout (read only here): encoded, (N, 77 + L3 + 1, D3): rows 0..77 + L3 - 1 the hidden states, the
last row the pooled vector (first P columns; P = P1 + P2 <= D3, as 2048 <= 4096 in SD3). As token ids, (N, 3, L),
L = max(77, L3): CLIP-L's ids, CLIP-G's ids (each in the first 77 columns) and T5's (first L3 columns).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from rangefinder.errors import ConfigError
from rangefinder.models.tiny_sd3 import sd3_conditioning
from rangefinder.training.caching import tokenize
from rangefinder.training.family import ImageGeometry
from rangefinder.training.family_detection import t5_sequence_length
from rangefinder.training.family_flow import FlowFamily, flow_shift
from rangefinder.training.family_rules import Sd3Rules

if TYPE_CHECKING:
    from rangefinder.config import TrainingConfig
    from rangefinder.models.loading import SDComponents

CLIP_LENGTH = 77


@dataclass
class Sd3Family(Sd3Rules, FlowFamily):
    """Its rules told from the configs alone are Sd3Rules' (family_rules.py)."""

    tokenizer: Any = None  # CLIP ViT-L's
    tokenizer_2: Any = None  # OpenCLIP bigG's
    tokenizer_3: Any = None  # T5's
    pooled_dim: int = 0  # P1 + P2
    # L3, T5 tokens per caption: set by for_model from family_detection.t5_sequence_length (the pipeline's too).
    t5_length: int = 0

    @classmethod
    def for_model(cls, sd: SDComponents, cfg: TrainingConfig) -> Sd3Family:
        cls.check_settings(cfg, sd.noise_scheduler.config, sd.unet.config)
        pooled = int(sd.text_encoder.config.projection_dim) + int(sd.text_encoder_2.config.projection_dim)
        width = int(sd.text_encoder_3.config.d_model)
        if pooled > width:
            raise ConfigError(f"model.base_model: an SD3 model whose pooled width ({pooled}) exceeds T5's width "
                              f"({width}) is not supported")
        return cls(cfg.flow, flow_shift(sd, cfg.flow), tokenizer=sd.tokenizer, tokenizer_2=sd.tokenizer_2,
                   tokenizer_3=sd.tokenizer_3, pooled_dim=pooled, t5_length=t5_sequence_length("sd3", sd))

    def text_encoder_names(self) -> tuple[str, ...]:
        return ("text_encoder", "text_encoder_2", "text_encoder_3")

    # --- conditioning -------------------------------------------------------------------------------------------

    def tokenize(self, captions: Sequence[str]) -> torch.Tensor:
        """(N, 3, max(77, L3)): each tokenizer's ids, zero-padded at the end to one length."""
        t5 = self.tokenizer_3(list(captions), padding="max_length", max_length=self.t5_length, truncation=True,
                              return_tensors="pt").input_ids
        rows = [tokenize(self.tokenizer, captions), tokenize(self.tokenizer_2, captions), t5]
        length = max(r.shape[1] for r in rows)
        return torch.stack([torch.nn.functional.pad(r, (0, length - r.shape[1])) for r in rows], dim=1)

    def encode_prompt(self, text_encoders: Sequence[torch.nn.Module], input_ids: torch.Tensor) -> torch.Tensor:
        """(B, 3, L) ids -> (B, 77 + L3 + 1, D3): the hidden states, then the pooled row."""
        hidden, pooled = sd3_conditioning(text_encoders, input_ids[:, 0, :CLIP_LENGTH],
                                          input_ids[:, 1, :CLIP_LENGTH], input_ids[:, 2, : self.t5_length])
        row = torch.zeros((hidden.shape[0], 1, hidden.shape[2]), dtype=hidden.dtype, device=hidden.device)
        row[:, 0, : pooled.shape[1]] = pooled.to(hidden.dtype)
        return torch.cat([hidden, row], dim=1)

    def with_images(self, cond: torch.Tensor, geometry: Sequence[ImageGeometry]) -> torch.Tensor:
        return cond  # SD3 has no size conditioning

    def drop_captions(self, cond: torch.Tensor, empty: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
        """The dropped items get the empty caption's hidden states and pooled vector."""
        return torch.where(drop.view(-1, *([1] * (cond.dim() - 1))), empty.expand_as(cond), cond)

    def conditioning(self, text_encoders: Optional[Sequence[torch.nn.Module]], cond: torch.Tensor) -> torch.Tensor:
        return cond if text_encoders is None else self.encode_prompt(text_encoders, cond)

    def predict(self, unet: torch.nn.Module, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                cond: torch.Tensor) -> torch.Tensor:
        """The transformer's velocity for the latents noised to the (B,) sigmas, fed sigma * 1000 as its timestep."""
        noisy = self.noised(latents, noise, timesteps)
        cond = cond.to(noisy.dtype)
        hidden, pooled = cond[:, :-1], cond[:, -1, : self.pooled_dim]
        return unet(hidden_states=noisy, timestep=timesteps.to(noisy.dtype) * self.num_timesteps,
                    encoder_hidden_states=hidden, pooled_projections=pooled, return_dict=False)[0]

    def sampling_pipeline(self, sd: SDComponents, scheduler: Any) -> Any:
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline(
            transformer=sd.unet, scheduler=scheduler, vae=sd.vae, text_encoder=sd.text_encoder,
            tokenizer=sd.tokenizer, text_encoder_2=sd.text_encoder_2, tokenizer_2=sd.tokenizer_2,
            text_encoder_3=sd.text_encoder_3, tokenizer_3=sd.tokenizer_3)
