"""Reading images the same way everywhere: EXIF orientation applied, RGB, centre-cropped and resized to a square.

Training, validation and latent caching all go through `to_model_array`, so one image always becomes the same
array (PIL's resampling is deterministic), which the deterministic validation loss relies on.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO, Optional, Union

import numpy as np
from PIL import Image, ImageOps


def load_rgb(path: Union[str, Path, BinaryIO]) -> Image.Image:
    """Open an image fully (so a truncated file fails here, not mid-training), upright and in RGB.

    Phone photos store their rotation in EXIF instead of rotating the pixels; `exif_transpose` applies it, as every
    viewer does. Transparent pixels are composited on white rather than on whatever colour the file stored there.
    Modes PIL's own `convert("RGB")` gets wrong are rescaled first (see `_to_8bit`): a 16-bit greyscale PNG would
    otherwise clip every value above 255 to pure white. Colours in another colour space than sRGB (an embedded ICC
    profile: a phone's Display P3, Adobe RGB, a print CMYK) are converted to sRGB (see `_in_srgb`).
    """
    with Image.open(path) as im:
        im.load()
        icc = im.info.get("icc_profile")
        im = _in_srgb(ImageOps.exif_transpose(im), icc)
        im = _to_8bit(im)
        if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (im.mode == "P" and "transparency" in im.info):
            rgba = im.convert("RGBA")
            canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            canvas.alpha_composite(rgba)
            return canvas.convert("RGB")
        return im.convert("RGB")


def _in_srgb(im: Image.Image, icc: Optional[bytes]) -> Image.Image:
    """`im`'s colours in sRGB, the colour space viewers show an untagged image in and the base models' training
    images were in, where the file embeds the ICC profile `icc` of another: a phone photo in Display P3, a camera's
    Adobe RGB, a print CMYK file store other numbers for the same colour, which were read as sRGB numbers (duller or
    shifted colours, learnt as the dataset's look). Converted by littlecms (Pillow's ImageCms; perceptual intent).
    An image without a profile, with an sRGB one (its description names sRGB), in a mode other than RGB, RGBA and
    CMYK, or with a profile littlecms cannot read passes as it is: its array stays what it was, bit for bit."""
    if not icc or im.mode not in ("RGB", "RGBA", "CMYK"):
        return im
    from PIL import ImageCms

    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        if "srgb" in (ImageCms.getProfileDescription(profile) or "").lower():
            return im
        converted = ImageCms.profileToProfile(im, profile, ImageCms.createProfile("sRGB"),
                                              outputMode="RGBA" if im.mode == "RGBA" else "RGB")
    except (OSError, ImageCms.PyCMSError):  # a damaged or foreign profile: the numbers as stored, as any viewer
        return im
    return converted if converted is not None else im


def _to_8bit(im: Image.Image) -> Image.Image:
    """Greyscale modes wider than 8 bits, as "L" with the full range kept.

    PIL converts "I;16*", "I" and "F" to "L"/"RGB" by clipping values to 0..255, not by scaling. "I;16*" (what a
    16-bit greyscale PNG opens as) is 0..65535; "I" holds the same from older Pillows and other readers, so a
    maximum above 255 means 16 bits; "F" in 0..1 is a normalised float image, else it is taken as 0..255.
    """
    if not (im.mode.startswith("I") or im.mode == "F"):
        return im
    arr = np.asarray(im).astype(np.float64)
    if im.mode.startswith("I;16") or (im.mode == "I" and arr.size and arr.max() > 255):
        arr = arr / 65535.0 * 255.0
    elif im.mode == "F" and arr.size and arr.min() >= 0.0 and arr.max() <= 1.0:
        arr = arr * 255.0
    return Image.fromarray(np.clip(np.round(arr), 0, 255).astype(np.uint8), "L")


def center_crop_square(img: Image.Image) -> Image.Image:
    w, h = img.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    return img.crop((left, top, left + side, top + side))


def resize_square(img: Image.Image, resolution: int, center_crop: bool = True) -> Image.Image:
    """The square `resolution` x `resolution` image the model sees (before normalisation)."""
    if center_crop:
        img = center_crop_square(img)
    if img.size != (resolution, resolution):
        # Lanczos when shrinking (anti-aliased), bicubic when enlarging; both deterministic in Pillow.
        shrinking = min(img.size) > resolution
        img = img.resize((resolution, resolution), Image.Resampling.LANCZOS if shrinking else Image.Resampling.BICUBIC)
    return img


def to_model_array(img: Image.Image, resolution: int, center_crop: bool = True) -> np.ndarray:
    """(3, resolution, resolution) float32 in [-1, 1], the range Stable Diffusion's VAE was trained on."""
    return array_from_rgb(resize_square(img.convert("RGB"), resolution, center_crop))


def array_from_rgb(img: Image.Image) -> np.ndarray:
    """(3, H, W) float32 in [-1, 1] of an RGB image of any shape (data/buckets.py sizes it for a bucket)."""
    arr = np.asarray(img, dtype=np.float32) / 127.5 - 1.0  # (H, W, 3)
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def from_model_array(arr: np.ndarray) -> Image.Image:
    """Inverse of `to_model_array`: (3, H, W) in [-1, 1] -> RGB image (values clipped)."""
    hwc = np.clip((np.asarray(arr, dtype=np.float32).transpose(1, 2, 0) + 1.0) * 127.5, 0, 255)
    return Image.fromarray(np.round(hwc).astype(np.uint8), "RGB")
