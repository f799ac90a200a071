"""The image sizes a base model can train and sample at, judged from its configs alone: the VAE's config.json (its
downscale, 2 ** (levels - 1)) and the denoiser's (the UNet's down blocks, the transformer's patch size).

Each rule is written once, here, and applied twice: by the engine to the loaded modules' `.config` (diffusers'
FrozenDicts), and by resolve-config's preflight (families.check_family_settings) to the same config.json files read
from the resolved folder. So a size the model cannot take stops the run in the first step, before any GPU is asked
for, in the words the engine would have used when the first training step encoded or the fine-tune first sampled
(after the whole LR discovery had trained). Only data-independent rules run early: which aspect-ratio buckets a
dataset's images land in is known only once the split is placed, so the engine still checks those buckets itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rangefinder.config import FAMILY_NAMES, SAMPLING_MULTIPLE, sampling_resolution_problem
from rangefinder.errors import ConfigError

if TYPE_CHECKING:
    from rangefinder.config import DataConfig, RangefinderConfig

Size = tuple[int, int]  # (width, height) in pixels, as data/buckets.py


def vae_downscale(vae_config: Mapping[str, Any]) -> int:
    """Pixels per latent side: the VAE halves the image at every level but the last."""
    return int(2 ** (len(vae_config["block_out_channels"]) - 1))


def native_resolution(vae_config: Mapping[str, Any], denoiser_config: Mapping[str, Any]) -> int:
    """The base model's native resolution in pixels: the denoiser's sample size times the VAE's downscale; a
    transformer without a sample size (Flux) has its VAE's, which is in pixels already."""
    sample = denoiser_config.get("sample_size")
    if sample is None:
        return int(vae_config["sample_size"])
    return int(sample) * vae_downscale(vae_config)


@dataclass(frozen=True)
class ModelGeometry:
    """What the size rules read of a base model, from its configs."""

    family: str  # sd1, sdxl, sd3 or flux; messages say it as users know it (config.FAMILY_NAMES)
    patchified: bool  # a transformer cutting latents into patches: every side a multiple of side_multiple
    vae_scale: int  # the VAE's downscale
    side_multiple: int  # px each image side must be a multiple of for every latent to pass the denoiser evenly
    native: int  # px
    min_resolution: int  # px, the family's floor for this native resolution

    @classmethod
    def of(cls, family_cls: Any, vae_config: Mapping[str, Any], denoiser_config: Mapping[str, Any]) -> ModelGeometry:
        """The geometry of a model of family `family_cls` (a families.FAMILIES class, or its rules:
        families.FAMILY_RULES) from its VAE's and denoiser's configs: the loaded modules' `.config` or their
        config.json."""
        native = native_resolution(vae_config, denoiser_config)
        return cls(family=family_cls.name, patchified=bool(family_cls.patchified),
                   vae_scale=vae_downscale(vae_config),
                   side_multiple=int(family_cls.side_multiple_of(vae_config, denoiser_config)),
                   native=native, min_resolution=int(family_cls.min_resolution(native)))

    @classmethod
    def loaded(cls, family: Any, sd: Any) -> ModelGeometry:
        """The geometry of a loaded model (models.loading.SDComponents) of `family` (its family object): its VAE's
        and denoiser's `.config`, as the preflight reads them from the folder's config.json."""
        return cls.of(type(family), sd.vae.config, sd.unet.config)

    @property
    def sampling_multiple(self) -> int:
        """Pixels the sampling pipeline's sides must be a multiple of: diffusers' SD and SDXL pipelines take multiples
        of 8 px (config.SAMPLING_MULTIPLE, which the config checks on every model) and of the VAE's downscale; SD3's
        refuses a side off its patch grid and Flux's quietly renders a smaller image, so a transformer's sides are
        multiples of its side multiple too."""
        return math.lcm(SAMPLING_MULTIPLE, self.side_multiple if self.patchified else self.vae_scale)


def check_resolution(geometry: ModelGeometry, data: DataConfig) -> None:
    """A training resolution below what the model family supports is a ConfigError naming the floor; a transformer's
    off its patch grid is one naming the nearest resolution on it."""
    floor = geometry.min_resolution
    if data.resolution < floor:
        raise ConfigError(
            f"data.resolution: {data.resolution} px is below what {FAMILY_NAMES[geometry.family]} supports for this "
            f"base model (native {geometry.native} px, at least {floor} px); set data.resolution to {floor} or more"
        )
    multiple = geometry.side_multiple
    if geometry.patchified and data.resolution % multiple:
        raise ConfigError(
            f"data.resolution: {data.resolution} px is not a multiple of {multiple} px, "
            f"{FAMILY_NAMES[geometry.family]}'s patch size in pixels (the VAE's downscale times the transformer's "
            f"patch); set data.resolution to {max(multiple, data.resolution - data.resolution % multiple)}"
        )


def check_bucket_sides(geometry: ModelGeometry, buckets: Iterable[Size], data: DataConfig) -> None:
    """ConfigError unless every bucket side is a multiple of the family's side multiple (the VAE's downscale times
    the UNet's, or times the transformer's patch size), so that every latent passes the denoiser evenly."""
    vae_scale, divisor = geometry.vae_scale, geometry.side_multiple
    odd = sorted(b for b in buckets if b[0] % divisor or b[1] % divisor)
    if odd:
        raise ConfigError(
            f"data.bucket_step {data.effective_bucket_step()} px does not fit the base model: its image sides must "
            f"be multiples of {divisor} px (VAE x{vae_scale}, {'transformer patch' if geometry.patchified else 'UNet'} "
            f"x{divisor // vae_scale}), but "
            f"buckets {', '.join(f'{w}x{h}' for w, h in odd)} are not; set data.bucket_step to a multiple of "
            f"{divisor}"
        )


def check_some_bucket_fits(geometry: ModelGeometry, data: DataConfig) -> None:
    """Before any image is placed: a bucket setting none of whose buckets the model can take fails whatever the
    images are, so it is refused with check_bucket_sides' words over every bucket. A setting where only some do is
    left to the engine, which checks the buckets the images land in (a square set may never reach the odd ones)."""
    from rangefinder.data.buckets import BucketSettings, bucket_sizes

    settings = BucketSettings.from_data_config(data)
    if settings is None:
        return
    buckets = bucket_sizes(settings)
    d = geometry.side_multiple
    if not any(w % d == 0 and h % d == 0 for w, h in buckets):
        check_bucket_sides(geometry, buckets, data)


def check_sampling_resolution(geometry: ModelGeometry, resolution: int) -> None:
    """ConfigError for a sampling resolution (sampling.resolution, else data.resolution) the pipeline cannot
    render."""
    problem = sampling_resolution_problem(resolution, geometry.sampling_multiple)
    if problem:
        raise ConfigError(f"sampling.resolution: {problem}")


def check_sizes(geometry: ModelGeometry, cfg: RangefinderConfig) -> None:
    """Every size rule that holds whatever the dataset's images: what resolve-config's preflight applies to the
    resolved folder's configs, so that a size the engine would refuse anyway stops the run before any GPU is asked
    for."""
    check_resolution(geometry, cfg.data)
    check_some_bucket_fits(geometry, cfg.data)
    check_sampling_resolution(geometry, cfg.sampling.resolution or cfg.data.resolution)
