"""The model family's specifics behind one seam: how captions become the UNet's conditioning, and what the UNet is
trained to predict.

The loop and the validation measure never branch on the family; they call `Sd1Family` (Stable Diffusion 1.x and
2.x: one CLIP text encoder whose last hidden state conditions the UNet; epsilon or v-prediction on the DDPM noise
schedule) through a `Denoiser`. A later family (SDXL: two text encoders, pooled embeddings and `add_time_ids`)
provides the same few methods.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from rangefinder.errors import ConfigError
from rangefinder.training.caching import tokenize

if TYPE_CHECKING:
    from rangefinder.models.loading import SDComponents

PREDICTION_TYPES = ("epsilon", "v_prediction")


@dataclass
class Sd1Family:
    """Stable Diffusion 1.x / 2.x: conditioning is the (N, 77, D) last hidden state of one CLIP text encoder."""

    tokenizer: Any  # transformers CLIPTokenizer
    noise_scheduler: Any  # diffusers DDPMScheduler (training)
    prediction_type: str  # "epsilon" | "v_prediction"

    @classmethod
    def for_model(cls, sd: SDComponents, prediction_type: Optional[str]) -> Sd1Family:
        """The family of a loaded model; `prediction_type` overrides its scheduler's (None keeps the model's)."""
        if prediction_type is not None:
            sd.noise_scheduler.register_to_config(prediction_type=prediction_type)
        predicts = sd.noise_scheduler.config.prediction_type
        if predicts not in PREDICTION_TYPES:
            raise ConfigError(
                f"training.prediction_type: the base model predicts {predicts!r}; set epsilon or v_prediction"
            )
        return cls(sd.tokenizer, sd.noise_scheduler, predicts)

    @property
    def num_timesteps(self) -> int:
        return int(self.noise_scheduler.config.num_train_timesteps)

    # --- conditioning -------------------------------------------------------------------------------------------

    def tokenize(self, captions: Sequence[str]) -> torch.Tensor:
        """(N, 77) token ids."""
        return tokenize(self.tokenizer, captions)

    def encode_prompt(self, text_encoder: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, 77) token ids -> (B, 77, D) hidden states the UNet is conditioned on (SD 1.x: the last hidden state)."""
        return text_encoder(input_ids, return_dict=False)[0]

    # --- the objective ------------------------------------------------------------------------------------------

    def predict(self, unet: torch.nn.Module, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        """The UNet's (B, 4, h, w) output for the latents noised to `timesteps` (the forward process q(x_t | x_0))."""
        noisy = self.noise_scheduler.add_noise(latents, noise, timesteps)
        return unet(noisy, timesteps, hidden.to(noisy.dtype), return_dict=False)[0]

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """What the UNet should output: the noise (epsilon), or v = alpha_t * noise - sigma_t * x_0 (Salimans & Ho
        2022, arXiv:2202.00512)."""
        if self.prediction_type == "epsilon":
            return noise
        return self.noise_scheduler.get_velocity(latents, noise, timesteps)

    def loss_weights(self, timesteps: torch.Tensor, min_snr_gamma: Optional[float]) -> torch.Tensor:
        """(B,) per-image loss weights. Min-SNR-gamma (Hang et al. 2023, arXiv:2303.09556): min(SNR, gamma) / SNR
        for epsilon, and min(SNR, gamma) / (SNR + 1) for v-prediction; 1 when off."""
        if min_snr_gamma is None:
            return torch.ones(timesteps.shape, device=timesteps.device)
        from diffusers.training_utils import compute_snr

        snr = compute_snr(self.noise_scheduler, timesteps)
        clipped = torch.clamp(snr, max=min_snr_gamma)
        return clipped / (snr + 1) if self.prediction_type == "v_prediction" else clipped / snr


@dataclass
class Denoiser:
    """One forward pass of the training objective, shared by the training step and the validation measure."""

    family: Sd1Family
    unet: torch.nn.Module  # as trained (DDP-wrapped when multi-process) or unwrapped (validation)
    # Set when the conditioning holds token ids (the text encoder trains, so prompts are encoded every pass); None
    # when it holds the cached hidden states.
    text_encoder: Optional[torch.nn.Module] = None
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext  # accelerator.autocast under mixed precision

    def __call__(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                 conditioning: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(prediction, target), both (B, 4, h, w), for (B, 4, h, w) latents and noise and (B,) timesteps."""
        with self.autocast():
            hidden = conditioning
            if self.text_encoder is not None:
                hidden = self.family.encode_prompt(self.text_encoder, conditioning)
            pred = self.family.predict(self.unet, latents, noise, timesteps, hidden)
        return pred, self.family.target(latents, noise, timesteps)
