"""Flux.1-dev (Black Forest Labs): the rectified-flow objective (family_flow.py) on Flux's transformer.

What Flux adds to the flow objective, as diffusers' FluxPipeline runs the model and its train_dreambooth_lora_flux.py
and sd-scripts' flux_train_network.py (library/flux_train_utils.py) train it (written here from those, not copied):
- conditioning: CLIP ViT-L's pooled output only (`pooled_projections`) and T5's last hidden state, padded to a fixed
  length (`encoder_hidden_states`); T5 is never trained, its output always cached;
- packed latents: the transformer reads 2x2 latent patches as tokens (`FluxPipeline._pack_latents`), with a position
  id (0, row, column) per image token and zeros per text token; its output is unpacked back to (C, h, w);
- the guidance embedding: Flux.1-dev is guidance-distilled, its transformer takes the guidance scale as an input.
  Training feeds `training.flow.guidance` (3.5 unless set: diffusers' and sd-scripts' default). So there is no
  unconditional branch: caption dropout is refused, and samples use `sampling.guidance_scale` as that input, not as
  classifier-free guidance;
- the resolution-dependent shift: sigma' = e^mu / (e^mu + 1/sigma - 1), mu linear in the image's token count between
  the scheduler's (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift) (diffusers'
  `calculate_shift` and FlowMatchEulerDiscreteScheduler's exponential time shift; sd-scripts' `flux_shift`), unless
  `training.flow.shift` sets a constant one;
- image sides a multiple of the VAE's downscale times 2 (the packing): 16 px for Flux.1, 8 px for the tiny model.

Conditioning layout (read only here): encoded, (N, L + 1, D) with D = max(T5 width, pooled width): rows 0..L-1 the
T5 hidden states (first T5-width columns), row L the pooled CLIP vector (first P columns). As token ids, (N, 2, W):
CLIP's 77 ids and T5's L ids, each padded with its tokenizer's pad id to W = max(77, L).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from rangefinder.errors import ConfigError
from rangefinder.training.caching import tokenize
from rangefinder.training.family import ImageGeometry
from rangefinder.training.family_detection import t5_sequence_length
from rangefinder.training.family_flow import FlowFamily, flow_shift
from rangefinder.training.family_rules import DEFAULT_GUIDANCE, FluxRules

if TYPE_CHECKING:
    from rangefinder.config import TrainingConfig
    from rangefinder.models.loading import SDComponents

CLIP_LENGTH = 77


@dataclass
class FluxFamily(FluxRules, FlowFamily):
    """Its rules told from the configs alone (check_settings: DDPM's settings, what a guidance-distilled model with
    a frozen T5 does not do, a training guidance without the guidance embedding; its sizes) are FluxRules'
    (family_rules.py)."""

    tokenizer: Any = None  # CLIP's
    tokenizer_2: Any = None  # T5's
    # T5's sequence length: Flux.1-dev's 512, or the tokenizer's own limit when shorter (the tiny model's 64 bytes).
    # Set by for_model from family_detection.t5_sequence_length, the one source the pipeline's calls read too.
    t5_length: int = 0
    t5_width: int = 0
    pooled_width: int = 0
    guidance: Optional[float] = DEFAULT_GUIDANCE  # None: a model without the guidance embedding (schnell)
    dynamic_shift: Optional[dict[str, float]] = None  # the scheduler's resolution-dependent shift; None: constant

    @classmethod
    def for_model(cls, sd: SDComponents, cfg: TrainingConfig) -> FluxFamily:
        cls.check_settings(cfg, sd.noise_scheduler.config, sd.unet.config)
        return cls(cfg.flow, flow_shift(sd, cfg.flow), tokenizer=sd.tokenizer, tokenizer_2=sd.tokenizer_2,
                   t5_length=t5_sequence_length("flux", sd), t5_width=int(sd.text_encoder_2.config.d_model),
                   pooled_width=int(sd.text_encoder.config.hidden_size),
                   guidance=cls.training_guidance(cfg.flow, sd.unet.config),
                   dynamic_shift=cls.dynamic_shift_of(cfg.flow, sd.noise_scheduler.config))

    def text_encoder_names(self) -> tuple[str, ...]:
        return ("text_encoder", "text_encoder_2")

    # --- sigma --------------------------------------------------------------------------------------------------

    def shift_sigmas(self, sigmas: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
        if self.dynamic_shift is None:
            return super().shift_sigmas(sigmas, latent_hw)
        mu = self._mu(latent_hw)
        s = sigmas.double().clamp(1e-12, 1.0)
        return (math.exp(mu) / (math.exp(mu) + (1 / s - 1))).to(sigmas.dtype)

    def shift_words(self, latent_hw: tuple[int, int]) -> str:
        # the scheduler config's `shift` is not what is applied when its dynamic shifting is
        if self.dynamic_shift is None:
            return super().shift_words(latent_hw)
        return (f"the scheduler's resolution-dependent shift, mu {self._mu(latent_hw):.4g} at "
                f"{_image_tokens(latent_hw)} image tokens (latents {latent_hw[0]}x{latent_hw[1]}; each image size "
                "has its own grid)")

    def _mu(self, latent_hw: tuple[int, int]) -> float:
        """The exponential shift's mu at latents of `latent_hw`: linear in the packed image's token count."""
        d = self.dynamic_shift or {}
        slope = (d["max_shift"] - d["base_shift"]) / (d["max_image_seq_len"] - d["base_image_seq_len"])
        return d["base_shift"] + slope * (_image_tokens(latent_hw) - d["base_image_seq_len"])

    # --- conditioning -------------------------------------------------------------------------------------------

    def tokenize(self, captions: Sequence[str]) -> torch.Tensor:
        """(N, 2, W): CLIP's and T5's ids, each padded to W with its own pad id."""
        clip = tokenize(self.tokenizer, captions)
        t5 = self.tokenizer_2(list(captions), padding="max_length", max_length=self.t5_length, truncation=True,
                              return_tensors="pt").input_ids
        width = max(clip.shape[1], t5.shape[1])
        out = torch.empty((len(captions), 2, width), dtype=torch.long)
        out[:, 0] = int(self.tokenizer.pad_token_id)
        out[:, 1] = int(self.tokenizer_2.pad_token_id)
        out[:, 0, : clip.shape[1]] = clip
        out[:, 1, : t5.shape[1]] = t5
        return out

    def encode_prompt(self, text_encoders: Sequence[torch.nn.Module], input_ids: torch.Tensor) -> torch.Tensor:
        """(B, 2, W) ids -> (B, L + 1, D): T5's last hidden state, then CLIP's pooled row."""
        clip, t5 = text_encoders
        pooled = clip(input_ids[:, 0, :CLIP_LENGTH]).pooler_output
        hidden = t5(input_ids[:, 1, : self.t5_length])[0]
        width = max(self.t5_width, self.pooled_width)
        out = torch.zeros((hidden.shape[0], self.t5_length + 1, width), dtype=hidden.dtype, device=hidden.device)
        out[:, : self.t5_length, : hidden.shape[2]] = hidden
        out[:, self.t5_length, : pooled.shape[1]] = pooled.to(hidden.dtype)
        return out

    def with_images(self, cond: torch.Tensor, geometry: Sequence[ImageGeometry]) -> torch.Tensor:
        return cond

    def drop_captions(self, cond: torch.Tensor, empty: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
        raise ConfigError("training.cond_dropout: Flux.1-dev has no unconditional branch; set it to 0")

    def conditioning(self, text_encoders: Optional[Sequence[torch.nn.Module]], cond: torch.Tensor) -> torch.Tensor:
        return cond if text_encoders is None else self.encode_prompt(text_encoders, cond)

    # --- the transformer ----------------------------------------------------------------------------------------

    def predict(self, unet: torch.nn.Module, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                cond: torch.Tensor) -> torch.Tensor:
        """The transformer's velocity, (B, C, h, w), for the latents noised to the (B,) sigmas `timesteps`."""
        from diffusers import FluxPipeline

        noisy = self.noised(latents, noise, timesteps)
        b, c, h, w = noisy.shape
        cond = cond.to(noisy.dtype)
        hidden, pooled = cond[:, : self.t5_length, : self.t5_width], cond[:, self.t5_length, : self.pooled_width]
        img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, noisy.device, noisy.dtype)
        txt_ids = torch.zeros((self.t5_length, 3), device=noisy.device, dtype=noisy.dtype)
        guidance = None if self.guidance is None else torch.full((b,), self.guidance, device=noisy.device,
                                                                 dtype=noisy.dtype)
        packed = unet(hidden_states=FluxPipeline._pack_latents(noisy, b, c, h, w),
                      timestep=timesteps.to(noisy.dtype),  # the transformer scales sigma by 1000 itself
                      guidance=guidance, pooled_projections=pooled, encoder_hidden_states=hidden,
                      txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return unpack_latents(packed, c, h, w)

    def sampling_pipeline(self, sd: SDComponents, scheduler: Any) -> Any:
        """FluxPipeline over the run's modules; samples pass `sampling.guidance_scale` as the distilled guidance."""
        from diffusers import FluxPipeline

        return FluxPipeline(scheduler=scheduler, vae=sd.vae, text_encoder=sd.text_encoder, tokenizer=sd.tokenizer,
                            text_encoder_2=sd.text_encoder_2, tokenizer_2=sd.tokenizer_2, transformer=sd.unet)


def _image_tokens(latent_hw: tuple[int, int]) -> int:
    """The transformer's image tokens for latents of (h, w): one per 2x2 patch."""
    return (latent_hw[0] // 2) * (latent_hw[1] // 2)


def unpack_latents(packed: torch.Tensor, channels: int, height: int, width: int) -> torch.Tensor:
    """(B, h/2 * w/2, 4C) tokens -> (B, C, h, w) latents: the inverse of FluxPipeline._pack_latents."""
    b = packed.shape[0]
    x = packed.view(b, height // 2, width // 2, channels, 2, 2)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, channels, height, width)
