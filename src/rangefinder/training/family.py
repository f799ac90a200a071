"""The model family's specifics behind one seam: how captions become the UNet's conditioning, and what the UNet is
trained to predict.

The loop and the validation measure never branch on the family; they call a `Family` through a `Denoiser`. A family
is one class, registered in families.py (FAMILIES) by the name `family_detection.detect_family` reads from the base
model:
- `Sd1Family` (here): Stable Diffusion 1.x and 2.x: one CLIP text encoder whose last hidden state conditions the
  UNet; epsilon or v-prediction on the DDPM noise schedule;
- `SdxlFamily` (family_sdxl.py): two text encoders, pooled embedding and `add_time_ids`.
A third family (SD3, Flux: flow matching) is one more module providing the same methods (docs/model-families.md).

The conditioning is one tensor per item whose layout only its family reads: the loop indexes it by item, asks the
family to add the images' own conditioning (`with_images`: SDXL's sizes) and to drop captions from it (caption
dropout), and moves it to the device; the text cache stores what `encode_prompt` returns. Two forms: encoded (the
frozen encoders' output, cached once) and as token ids (when a text encoder trains, so prompts are encoded every
pass); `conditioning` of the Denoiser turns the second into the first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Protocol

import torch

from rangefinder.formats.text import warn
from rangefinder.training.caching import tokenize
from rangefinder.training.family_rules import DDPM_DEFAULT_PREDICTION, Sd1Rules

if TYPE_CHECKING:
    from rangefinder.config import TrainingConfig
    from rangefinder.models.loading import SDComponents


@dataclass(frozen=True)
class ImageGeometry:
    """Where an item's training pixels came from: its original size, the crop's top-left corner in the resized
    image, and the size trained at (SDXL's size conditioning, Podell et al. 2023, arXiv:2307.01952, sec. 2.2)."""

    original_hw: tuple[int, int]
    crop_top_left: tuple[int, int]
    target_hw: tuple[int, int]


@dataclass(frozen=True)
class ValidationWeighting:
    """How the validation score combines its K per-bucket losses, for run_summary.json and the reports: the words,
    and the fixed timesteps of the buckets when they are a grid (flow families: sigmas), None when each item draws
    its own inside each bucket (DDPM families)."""

    statement: str
    grid: Optional[tuple[float, ...]] = None

    def as_dict(self) -> dict[str, Any]:
        return {"statement": self.statement, "grid": None if self.grid is None else list(self.grid)}


class Family(Protocol):
    """What the engine asks of a model family. See Sd1Family for the contract of each method."""

    name: ClassVar[str]
    # True for a transformer that cuts the latents into patches (every image side must be a multiple of
    # side_multiple); False for a UNet, which pads its upsampling for other square sizes.
    patchified: ClassVar[bool]
    prediction_type: str

    @property
    def num_timesteps(self) -> int: ...
    def text_encoder_names(self) -> tuple[str, ...]: ...
    def min_resolution(self, native: int) -> int: ...
    @classmethod
    def side_multiple_of(cls, vae_config: Mapping[str, Any], denoiser_config: Mapping[str, Any]) -> int: ...
    def tokenize(self, captions: Sequence[str]) -> torch.Tensor: ...
    def encode_prompt(self, text_encoders: Sequence[torch.nn.Module], input_ids: torch.Tensor) -> torch.Tensor: ...
    def with_images(self, cond: torch.Tensor, geometry: Sequence[ImageGeometry]) -> torch.Tensor: ...
    def drop_captions(self, cond: torch.Tensor, empty: torch.Tensor, drop: torch.Tensor) -> torch.Tensor: ...
    def conditioning(self, text_encoders: Optional[Sequence[torch.nn.Module]], cond: torch.Tensor) -> torch.Tensor: ...
    def noised(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...
    def sample_timesteps(self, n: int, generator: torch.Generator, latent_hw: tuple[int, int]) -> torch.Tensor: ...
    def fixed_timestep(self, k: int, num_buckets: int, generator: torch.Generator,
                       latent_hw: tuple[int, int]) -> float: ...
    def validation_weighting(self, num_buckets: int, latent_hw: tuple[int, int]) -> ValidationWeighting: ...
    def predict(self, unet: torch.nn.Module, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                cond: torch.Tensor) -> torch.Tensor: ...
    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor: ...
    def loss_weights(self, timesteps: torch.Tensor, min_snr_gamma: Optional[float]) -> torch.Tensor: ...
    def sampling_pipeline(self, sd: SDComponents, scheduler: Any) -> Any: ...


# The methods whose files are applied to the base model at sampling time (diffusers' load_lora_weights and
# load_textual_inversion, ComfyUI, A1111): the base model's scheduler decides what their denoiser's output is read as.
ADAPTERS_SAMPLED_ON_THE_BASE = ("lora", "textual_inversion")


def _checked_prediction_type(family: type[Sd1Family], sd: SDComponents, cfg: TrainingConfig) -> str:
    """The prediction type trained: cfg.prediction_type, which overrides the model scheduler's, or the model's own
    (None); after the family's config-only checks (`check_settings`)."""
    family.check_settings(cfg, sd.noise_scheduler.config, sd.unet.config)
    own = str(sd.noise_scheduler.config.get("prediction_type", DDPM_DEFAULT_PREDICTION))
    if cfg.prediction_type is not None and cfg.prediction_type != own and cfg.method in ADAPTERS_SAMPLED_ON_THE_BASE:
        # An adapter cannot change what the model predicts: its consumer samples it on the base model with that
        # model's own scheduler (README, "prediction type"), so it learnt a target nobody will read it as.
        warn([f"training.prediction_type {cfg.prediction_type} with method {cfg.method}, on a base model whose "
              f"scheduler predicts {own}: a {cfg.method} is sampled on its base model, with that model's scheduler, "
              f"which reads it as {own}; set training.prediction_type only where the base model's scheduler config "
              "misstates what the model predicts, or train method full to change it"])
    if cfg.prediction_type is not None:
        sd.noise_scheduler.register_to_config(prediction_type=cfg.prediction_type)
    return str(sd.noise_scheduler.config.prediction_type)


@dataclass
class Sd1Family(Sd1Rules):
    """Stable Diffusion 1.x / 2.x: conditioning is the (N, 77, D) last hidden state of one CLIP text encoder. Its
    rules told from the configs alone (check_settings, min_resolution, side_multiple_of) are Sd1Rules'
    (family_rules.py)."""

    tokenizer: Any  # transformers CLIPTokenizer
    noise_scheduler: Any  # diffusers DDPMScheduler (training)
    prediction_type: str  # "epsilon" | "v_prediction"

    @classmethod
    def for_model(cls, sd: SDComponents, cfg: TrainingConfig) -> Sd1Family:
        """The family of a loaded model; cfg.prediction_type overrides its scheduler's (None keeps the model's)."""
        return cls(sd.tokenizer, sd.noise_scheduler, _checked_prediction_type(cls, sd, cfg))

    @property
    def num_timesteps(self) -> int:
        return int(self.noise_scheduler.config.num_train_timesteps)

    def text_encoder_names(self) -> tuple[str, ...]:
        """The SDComponents parts that encode prompts, in order."""
        return ("text_encoder",)

    # --- conditioning -------------------------------------------------------------------------------------------

    def tokenize(self, captions: Sequence[str]) -> torch.Tensor:
        """(N, 77) token ids."""
        return tokenize(self.tokenizer, captions)

    def encode_prompt(self, text_encoders: Sequence[torch.nn.Module], input_ids: torch.Tensor) -> torch.Tensor:
        """(B, 77) token ids -> (B, 77, D) hidden states the UNet is conditioned on (SD 1.x: the last hidden state);
        what the text cache stores."""
        return text_encoders[0](input_ids, return_dict=False)[0]

    def with_images(self, cond: torch.Tensor, geometry: Sequence[ImageGeometry]) -> torch.Tensor:
        """The per-item conditioning from the per-caption one and the items' geometry (SD 1.x: none)."""
        return cond

    def drop_captions(self, cond: torch.Tensor, empty: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
        """`cond` with the items where `drop` (B,) is set conditioned on the empty caption `empty` (1, ...)."""
        return torch.where(drop.view(-1, *([1] * (cond.dim() - 1))), empty.expand_as(cond), cond)

    def conditioning(self, text_encoders: Optional[Sequence[torch.nn.Module]], cond: torch.Tensor) -> torch.Tensor:
        """Encoded conditioning: `cond` as is, or token ids encoded through `text_encoders` when given."""
        return cond if text_encoders is None else self.encode_prompt(text_encoders, cond)

    # --- the objective ------------------------------------------------------------------------------------------

    def noised(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """x_t: the latents noised to `timesteps` by the forward process q(x_t | x_0) (DDPM's schedule)."""
        return self.noise_scheduler.add_noise(latents, noise, timesteps)

    def sample_timesteps(self, n: int, generator: torch.Generator, latent_hw: tuple[int, int]) -> torch.Tensor:
        """(n,) training timesteps drawn from `generator`: integers uniform in [0, T)."""
        return torch.randint(0, self.num_timesteps, (n,), generator=generator)

    def fixed_timestep(self, k: int, num_buckets: int, generator: torch.Generator,
                       latent_hw: tuple[int, int]) -> float:
        """Deterministic validation's timestep of bucket k of K: one integer drawn from `generator` (seeded by (seed,
        item, k)) inside the k-th of K equal parts of [0, T), the parts of what training draws uniformly."""
        lo, hi = k * self.num_timesteps // num_buckets, (k + 1) * self.num_timesteps // num_buckets
        return lo + int(torch.randint(0, max(1, hi - lo), (1,), generator=generator))

    def validation_weighting(self, num_buckets: int, latent_hw: tuple[int, int]) -> ValidationWeighting:
        return ValidationWeighting(
            f"val_loss is the plain mean of the {num_buckets} bucket losses val_loss_b0..b{num_buckets - 1}; bucket "
            f"k holds one timestep per image drawn (seeded by seed, item, k) inside the k-th of {num_buckets} equal "
            f"parts of [0, {self.num_timesteps}), the parts training draws uniformly; the MSE against the "
            f"{self.prediction_type} target, unweighted (min-SNR, when on, weights training only)")

    def predict(self, unet: torch.nn.Module, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                cond: torch.Tensor) -> torch.Tensor:
        """The UNet's (B, 4, h, w) output for the latents noised to `timesteps` (the forward process q(x_t | x_0))."""
        noisy = self.noised(latents, noise, timesteps)
        return unet(noisy, timesteps, cond.to(noisy.dtype), return_dict=False)[0]

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

    # --- sampling -----------------------------------------------------------------------------------------------

    def sampling_pipeline(self, sd: SDComponents, scheduler: Any) -> Any:
        """A diffusers pipeline of this family over the run's own modules, as they are (no copy, nothing loaded):
        what samples during training render with (training/samples.py)."""
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline(vae=sd.vae, text_encoder=sd.text_encoder, tokenizer=sd.tokenizer, unet=sd.unet,
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)


@dataclass
class Denoiser:
    """One forward pass of the training objective, shared by the training step and the validation measure."""

    family: Family
    unet: torch.nn.Module  # as trained (DDP-wrapped when multi-process) or unwrapped (validation)
    # Set when the conditioning holds token ids (a text encoder trains, so prompts are encoded every pass): the
    # family's text encoders, in order; None when it holds the cached encoded conditioning.
    text_encoders: Optional[Sequence[torch.nn.Module]] = None
    autocast: Callable[[], AbstractContextManager[Any]] = field(default=nullcontext)  # accelerator.autocast

    def __call__(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
                 conditioning: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(prediction, target), both (B, 4, h, w), for (B, 4, h, w) latents and noise and (B,) timesteps."""
        with self.autocast():
            cond = self.family.conditioning(self.text_encoders, conditioning)
            pred = self.family.predict(self.unet, latents, noise, timesteps, cond)
        return pred, self.family.target(latents, noise, timesteps)
