"""How well a rendered image follows a shapes prompt ("a red circle on a blue background"): two simple scores.

- colour: the share of pixels whose nearest palette colour (data.synthetic.COLOURS) is one the prompt names, the
  shape's or the background's. An image in other colours scores near 0; a two-colour image in the named colours
  near 1. Eight colours, two named: a model that ignores the colour words scores about 0.25 on average; more when
  one named colour is the white background of `shapes-on-white`, which most pictures hold anyway (the demo's base
  scores about 0.5), so a column is read against the base model's.
- shape: the intersection over union of the pixels in the shape's colour with the named shape, drawn as the dataset
  draws it (data.synthetic) into the square around those pixels. 0 when no pixel has the shape's colour.

Used on the demo's sample grid (steps/sample_images.py) to show, in numbers as well as pictures, that the fine-tune
follows the prompts where the base model does not. numpy and Pillow only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
from PIL import Image, ImageDraw

from rangefinder.data.synthetic import COLOURS, SHAPES

_PALETTE = np.array(list(COLOURS.values()), dtype=np.float64)  # (8, 3)
_NAMES = list(COLOURS)
_PROMPT = re.compile(
    rf"\b(?:a|an)\s+({'|'.join(_NAMES)})\s+({'|'.join(SHAPES)})\b(?:\s+on\s+(?:a|an)\s+({'|'.join(_NAMES)})\s+background)?"
)


@dataclass(frozen=True)
class ShapePrompt:
    colour: str
    shape: str
    background: Optional[str]


def parse_prompt(prompt: str) -> Optional[ShapePrompt]:
    """The colour, shape and background a shapes prompt names; None for any other prompt."""
    m = _PROMPT.search(prompt.lower())
    return ShapePrompt(m.group(1), m.group(2), m.group(3)) if m else None


def palette_labels(img: Image.Image) -> np.ndarray:
    """(H, W) index into COLOURS of each pixel's nearest palette colour (Euclidean RGB)."""
    rgb = np.asarray(img.convert("RGB"), dtype=np.float64)
    d = ((rgb[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1)
    return d.argmin(-1)


def _shape_mask(shape: str, box: tuple[float, float, float, float], size: tuple[int, int]) -> np.ndarray:
    ss = 4  # drawn 4x larger and averaged down, as the dataset does
    w, h = size
    canvas = Image.new("L", (w * ss, h * ss), 0)
    draw = ImageDraw.Draw(canvas)
    x0, y0, x1, y1 = (v * ss for v in box)
    cx, cy, half = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2
    if shape == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=255)
    elif shape == "square":
        draw.rectangle((x0, y0, x1, y1), fill=255)
    elif shape == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=255)
    else:  # diamond
        draw.polygon([(cx, cy - half), (cx + half, cy), (cx, cy + half), (cx - half, cy)], fill=255)
    return np.asarray(canvas.resize((w, h), Image.Resampling.BOX)) >= 128


def score_image(img: Image.Image, prompt: str) -> Optional[dict[str, float]]:
    """{"colour", "shape"} in [0, 1] for a shapes prompt (see the module docstring); None for any other prompt."""
    p = parse_prompt(prompt)
    if p is None:
        return None
    labels = palette_labels(img)
    fg = labels == _NAMES.index(p.colour)
    named = fg | (labels == _NAMES.index(p.background)) if p.background else fg
    colour = float(named.mean())
    shape = 0.0
    if fg.any():
        ys, xs = np.nonzero(fg)
        cx, cy = (xs.min() + xs.max() + 1) / 2, (ys.min() + ys.max() + 1) / 2
        half = max(xs.max() + 1 - xs.min(), ys.max() + 1 - ys.min()) / 2
        ideal = _shape_mask(p.shape, (cx - half, cy - half, cx + half, cy + half), (fg.shape[1], fg.shape[0]))
        union = (ideal | fg).sum()
        shape = float((ideal & fg).sum() / union) if union else 0.0
    return {"colour": colour, "shape": shape}


def score_images(images: list[Image.Image], prompts: list[str]) -> Optional[dict[str, float]]:
    """The mean scores over (image, prompt) pairs whose prompt is a shapes prompt; None when none is."""
    scores = [s for s in (score_image(i, p) for i, p in zip(images, prompts, strict=True)) if s is not None]
    if not scores:
        return None
    return {k: float(np.mean([s[k] for s in scores])) for k in ("colour", "shape")}
