"""The rectified-flow objective (Esser et al. 2024, arXiv:2403.03206): what SD3 and Flux share behind the family seam.

The forward process is the straight line x_t = (1 - sigma) x_0 + sigma * noise, sigma in [0, 1]; the model is fed
sigma * 1000 as its timestep and trained to output the velocity noise - x_0 (the same objective as diffusers'
train_dreambooth_lora_sd3.py and sd-scripts' sd3_train.py / flux_train.py, written here from the paper).

- Training sigma (`sample_timesteps`): drawn from `training.flow.timestep_sampling`'s density (uniform,
  logit-normal, or mode sampling with scale s; paper sec. 3.1), then shifted towards noise by `shift_sigmas`:
  sigma' = shift * sigma / (1 + (shift - 1) * sigma), the shift of the model's FlowMatchEulerDiscreteScheduler
  (SD3: 3.0) unless training.flow.shift sets one. Flux overrides `shift_sigmas` with its resolution-dependent
  shift (the hook takes the latents' (h, w)). Sigma stays continuous (diffusers indexes its scheduler's 1000
  discrete sigmas; the difference is below the discretisation).
- Loss weights (`loss_weights`): none, sigma ** -2 (`sigma_sqrt`) or cosmap 2 / (pi (1 - 2 sigma + 2 sigma^2)), the
  weightings diffusers' compute_loss_weighting_for_sd3 names.
- Deterministic validation (`fixed_timestep`): bucket k of K is the sigma at the middle quantile (k + 1/2) / K of
  the training density, shifted: the same fixed grid for every item, so each bucket's column is one sigma's loss.
  The K buckets are equal-probability parts of what training samples, so their plain mean (val_loss) is a K-point
  estimate of the expected unweighted training loss; no weighting by sigma is applied, and the losses at different
  sigma differ in scale, so the largest dominate the mean (the report states this, `validation_weighting`).
- DDPM's settings mean nothing here and are refused (family_rules.refuse_ddpm_settings): min-SNR (defined through
  the DDPM SNR), epsilon / v prediction, and the DDPM noise offset.

A flow family subclasses FlowFamily and provides the conditioning (tokenize, encode_prompt, ...), `predict` (its
transformer's call on `noised(...)`), `patch_size` and the sampling pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING

import torch

from rangefinder.config import FlowSettings
from rangefinder.training.family import ValidationWeighting
from rangefinder.training.family_rules import FlowRules

if TYPE_CHECKING:
    from rangefinder.models.loading import SDComponents

# The model's timestep is sigma times this (FlowMatchEulerDiscreteScheduler's num_train_timesteps).
TIMESTEP_SCALE = 1000


def flow_shift(sd: SDComponents, settings: FlowSettings) -> float:
    """training.flow.shift, else the base model's scheduler config's `shift` (1.0 when it has none)."""
    return FlowRules.constant_shift(settings, sd.noise_scheduler.config)


@dataclass
class FlowFamily(FlowRules):
    """The flow objective; subclasses add the conditioning and the transformer's call. Its rules told from the
    configs alone are FlowRules' (family_rules.py)."""

    flow: FlowSettings
    shift: float
    prediction_type: str = "flow"  # recorded in run_summary.json: the velocity noise - x0

    @property
    def num_timesteps(self) -> int:
        return TIMESTEP_SCALE

    # --- sigma --------------------------------------------------------------------------------------------------

    def shift_sigmas(self, sigmas: torch.Tensor, latent_hw: tuple[int, int]) -> torch.Tensor:
        """Sigmas moved towards noise by the constant shift (SD3); Flux overrides this with its
        resolution-dependent shift. Monotone increasing, so it keeps quantiles."""
        s = self.shift
        return s * sigmas / (1 + (s - 1) * sigmas)

    def shift_words(self, latent_hw: tuple[int, int]) -> str:
        """The shift `shift_sigmas` applies at latents of `latent_hw`, in the words of the validation statement."""
        return f"shift {self.shift:g}"

    def _from_uniform(self, u: torch.Tensor) -> torch.Tensor:
        """Sigma (before the shift) at uniform u, through the inverse CDF of the sampling density; float64."""
        f = self.flow
        if f.timestep_sampling == "uniform":
            return u
        if f.timestep_sampling == "logit_normal":
            normal = NormalDist(f.logit_mean, f.logit_std)
            z = torch.tensor([normal.inv_cdf(min(max(float(x), 1e-12), 1 - 1e-12)) for x in u.flatten()],
                             dtype=torch.float64).view(u.shape)
            return torch.sigmoid(z)
        # mode sampling (paper eq. 20) is f(v) = 1 - v - s (cos^2(pi v / 2) - 1 + v) for uniform v; f decreases in
        # v (for s in [-1, 2 / (pi - 2)]), so the u-quantile of sigma is f(1 - u).
        v = 1 - u
        return 1 - v - f.mode_scale * (torch.cos(math.pi * v / 2) ** 2 - 1 + v)

    def sample_timesteps(self, n: int, generator: torch.Generator, latent_hw: tuple[int, int]) -> torch.Tensor:
        """(n,) training sigmas in [0, 1] (float32), drawn from `generator`."""
        f = self.flow
        if f.timestep_sampling == "logit_normal":
            u = torch.sigmoid(f.logit_mean + f.logit_std * torch.randn(n, generator=generator, dtype=torch.float64))
        elif f.timestep_sampling == "mode":
            v = torch.rand(n, generator=generator, dtype=torch.float64)
            u = 1 - v - f.mode_scale * (torch.cos(math.pi * v / 2) ** 2 - 1 + v)
        else:
            u = torch.rand(n, generator=generator, dtype=torch.float64)
        return self.shift_sigmas(u, latent_hw).clamp(0.0, 1.0).float()

    def fixed_timestep(self, k: int, num_buckets: int, generator: torch.Generator,
                       latent_hw: tuple[int, int]) -> float:
        """Bucket k's sigma: the training density's (k + 1/2) / K quantile, shifted; draws nothing from
        `generator` (the item's noise is the only draw)."""
        return float(self.validation_sigmas(num_buckets, latent_hw)[k])

    def validation_sigmas(self, num_buckets: int, latent_hw: tuple[int, int]) -> list[float]:
        u = torch.tensor([(k + 0.5) / num_buckets for k in range(num_buckets)], dtype=torch.float64)
        sigmas = self.shift_sigmas(self._from_uniform(u), latent_hw).clamp(0.0, 1.0)
        # rounded through float32, as the validation pass feeds them
        return [float(x) for x in sigmas.float()]

    def validation_weighting(self, num_buckets: int, latent_hw: tuple[int, int]) -> ValidationWeighting:
        sigmas = self.validation_sigmas(num_buckets, latent_hw)
        f = self.flow
        return ValidationWeighting(
            f"val_loss is the plain mean of the {num_buckets} per-sigma losses val_loss_b0..b{num_buckets - 1}; "
            f"bucket k scores every image at the one sigma of the grid (the (k + 1/2)/{num_buckets} quantile of the "
            f"training density, {f.timestep_sampling}, {self.shift_words(latent_hw)}) with noise fixed by "
            "(seed, item, k): equal-probability parts of what training samples, so the mean estimates the expected "
            "unweighted training loss; the MSE against the velocity noise - x0, unweighted "
            f"(training.flow.loss_weighting {f.loss_weighting} weights training only); the losses at different "
            "sigma differ in scale and the largest dominate the mean: read the per-sigma columns for where the "
            "model changes",
            tuple(sigmas))

    # --- the objective ------------------------------------------------------------------------------------------

    def noised(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """x_t = (1 - sigma) x_0 + sigma * noise, `timesteps` the (B,) sigmas."""
        sigma = timesteps.to(latents.dtype).view(-1, *([1] * (latents.dim() - 1)))
        return (1 - sigma) * latents + sigma * noise

    def target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The velocity the model should output: noise - x_0."""
        return noise - latents

    def loss_weights(self, timesteps: torch.Tensor, min_snr_gamma: object = None) -> torch.Tensor:
        """(B,) per-image weights of training.flow.loss_weighting (min_snr_gamma is refused for flow models)."""
        sigma = timesteps.float()
        if self.flow.loss_weighting == "sigma_sqrt":
            return sigma.clamp(min=1e-4) ** -2.0  # clamped: a drawn sigma of exactly 0 would weigh infinitely
        if self.flow.loss_weighting == "cosmap":
            return 2 / (math.pi * (1 - 2 * sigma + 2 * sigma ** 2))
        return torch.ones(timesteps.shape, device=timesteps.device)
