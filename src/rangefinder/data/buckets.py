"""Aspect-ratio buckets: each image trains at the shape nearest its own, resized and cropped as little as possible.

The method is the one kohya's sd-scripts (library/model_util.py `make_bucket_resolutions`, library/train_util.py
`BucketManager.select_bucket` and `trim_and_resize_if_required`), EveryDream2 and OneTrainer use:

- **The buckets** have about `resolution`^2 pixels: for every width that is a multiple of `step`, the tallest height
  (a multiple of `step`) that keeps the area within `resolution`^2, and its transpose; those longer than
  `max_aspect` : 1 are left out. `step` must be a multiple of the model's own divisor (the VAE's downscale times the
  UNet's: SD 64 px, the tiny model 8 px) so that every latent passes the UNet's downsampling evenly.
- **An image's bucket** is the one whose aspect ratio is nearest its own, measured in log aspect so that a portrait
  and its landscape transpose are equally far from their buckets (kohya compares w/h linearly); ties go to the
  larger bucket, then to the smaller (width, height).
- **Resize and crop:** the image is scaled to cover the bucket (the smallest scale at which both sides reach it) and
  the overflow is cut evenly from both ends of the long side: the minimal, centred crop. `crop` records how many
  pixels of the resized image were cut from the left and the top, which SDXL conditions on (its
  `crops_coords_top_left` is (top, left): `crop[1], crop[0]`).

Everything here is a pure function of the image's upright size and the settings, so the split, the latent cache
and the engine always agree on where an image goes without recording it anywhere but the image's size.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
from PIL import Image

from rangefinder.data.pixels import array_from_rgb

if TYPE_CHECKING:
    from rangefinder.config import DataConfig

Size = tuple[int, int]  # (width, height) in pixels, PIL's order

# EXIF orientations that turn the picture a quarter (5-8): the upright image has width and height swapped.
_TRANSPOSING_ORIENTATIONS = {5, 6, 7, 8}


@dataclass(frozen=True)
class BucketSettings:
    resolution: int  # the square side the buckets' area is taken from, px
    step: int  # bucket sides are multiples of this, px
    max_aspect: float  # long side / short side of the most elongated bucket
    crop: bool = True  # False: squash the whole image into its bucket instead of cropping the overflow

    @classmethod
    def from_data_config(cls, data: DataConfig) -> Optional[BucketSettings]:
        """The settings of `data`, or None when `data.bucketing` is off (every image a centre-cropped square)."""
        if not data.bucketing:
            return None
        return cls(data.resolution, data.effective_bucket_step(), data.max_aspect, data.center_crop)

    def to_json(self) -> dict:
        return {"resolution": self.resolution, "step": self.step, "max_aspect": self.max_aspect, "crop": self.crop}


@dataclass(frozen=True)
class Placement:
    """Where one image goes: its bucket, the size it is resized to, and what is cut off."""

    size: Size  # the upright image, px
    bucket: Size  # what the model sees, px
    resized: Size  # the image scaled to cover the bucket, px
    crop: tuple[int, int]  # (left, top) px cut from the resized image

    def to_json(self) -> dict:
        return {"bucket": list(self.bucket), "crop": list(self.crop)}


def bucket_name(bucket: Size) -> str:
    """'WxH', the name a bucket has in reports and metric columns (val_loss_40x24)."""
    return f"{bucket[0]}x{bucket[1]}"


@lru_cache(maxsize=16)
def bucket_sizes(settings: BucketSettings) -> tuple[Size, ...]:
    """Every bucket of the settings, sorted by (width, height)."""
    area, step = settings.resolution**2, settings.step
    sides = {(settings.resolution // step * step,) * 2}  # the square is always one
    for width in range(step, area // step + 1, step):
        height = area // width // step * step
        if height >= step and max(width, height) / min(width, height) <= settings.max_aspect + 1e-9:
            sides.update({(width, height), (height, width)})
    return tuple(sorted(sides))


def nearest_bucket(size: Size, settings: BucketSettings) -> Size:
    """The bucket whose aspect ratio is nearest the image's (in log aspect; ties: larger, then smaller (w, h))."""
    target = math.log(size[0] / size[1])
    return min(bucket_sizes(settings), key=lambda b: (abs(math.log(b[0] / b[1]) - target), -b[0] * b[1], b))


def fit(size: Size, bucket: Size, crop: bool = True) -> Placement:
    """The cover-and-centre-crop of an image of `size` into `bucket` (or a squash into it, when not `crop`)."""
    w, h = size
    bw, bh = bucket
    if not crop:
        return Placement(size, bucket, bucket, (0, 0))
    scale = max(bw / w, bh / h)
    # Rounded to whole pixels, never below the bucket: the side that sets the scale lands on it exactly.
    rw, rh = max(bw, round(w * scale)), max(bh, round(h * scale))
    return Placement(size, bucket, (rw, rh), ((rw - bw) // 2, (rh - bh) // 2))


def place(size: Size, settings: BucketSettings) -> Placement:
    """Where an image of `size` goes under `settings`."""
    return fit(size, nearest_bucket(size, settings), settings.crop)


def image_size(path: str | Path) -> Size:
    """The upright (width, height) of an image file, read from its header only (EXIF orientation applied, as
    pixels.load_rgb does when it decodes it)."""
    with Image.open(path) as im:
        w, h = im.size
        orientation = im.getexif().get(0x0112)
    return (h, w) if orientation in _TRANSPOSING_ORIENTATIONS else (w, h)


def bucket_image(img: Image.Image, bucket: Size, crop: bool = True) -> tuple[Image.Image, Placement]:
    """The RGB image as the model sees it in `bucket`, and how it got there (from the image's real size)."""
    p = fit(img.size, bucket, crop)
    if img.size != p.resized:
        # As pixels.resize_square: Lanczos when shrinking (anti-aliased), bicubic when enlarging; both deterministic.
        shrinking = p.resized[0] < img.size[0]
        img = img.resize(p.resized, Image.Resampling.LANCZOS if shrinking else Image.Resampling.BICUBIC)
    left, top = p.crop
    if p.resized != bucket:
        img = img.crop((left, top, left + bucket[0], top + bucket[1]))
    return img, p


def bucket_array(img: Image.Image, bucket: Size, crop: bool = True) -> np.ndarray:
    """(3, bucket height, bucket width) float32 in [-1, 1]: what the VAE encodes."""
    return array_from_rgb(bucket_image(img.convert("RGB"), bucket, crop)[0])


def bucket_table(subsets: Mapping[str, Iterable[Placement]]) -> list[dict]:
    """One row per bucket that holds an image, sorted by (width, height): its name, size and image count per
    subset (e.g. train, val, stabilize)."""
    counts = {name: Counter(p.bucket for p in placements) for name, placements in subsets.items()}
    buckets = sorted(set().union(*counts.values())) if counts else []
    return [
        {"bucket": bucket_name(b), "width": b[0], "height": b[1], **{name: c[b] for name, c in counts.items()}}
        for b in buckets
    ]
