"""Synthetic datasets with true captions, made offline and deterministically (the embedded default).

- `shapes`: one coloured shape on a plain background, "a red circle on a blue background". 8 colours x 4 shapes x
  7 backgrounds = 224 captions, with size and position varied as well, so a few dozen images hold far more
  combinations than a tiny model can memorise: validation loss on held-out images tells learning from overfitting.
  This is the demo dataset.
- `stripes`: two-colour stripes, checkerboards and gradients, "red and white horizontal stripes". It shares the
  colour words but no shape, so the tiny base model pre-trained on it knows colours and textures; learning shapes on
  the demo dataset afterwards is fine-tuning, not training from scratch.

Every random choice comes from `random.Random(seed derived by SHA-256).random()`, the one stream Python promises to
keep stable across versions, so the same seed gives byte-identical PNG files on any machine.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from rangefinder.errors import DataError
from rangefinder.formats.atomic import atomic_dir

# Saturated, well-separated colours (RGB) whose names a caption can use without ambiguity.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
PATTERNS = ("horizontal stripes", "vertical stripes", "diagonal stripes", "checkerboard", "gradient")
KINDS = ("shapes", "stripes")

# Every word a caption of either kind can contain (the tiny model's tokenizer makes each a single token).
CAPTION_WORDS = sorted(
    set(COLOURS) | set(SHAPES) | {w for p in PATTERNS for w in p.split()}
    | {"a", "an", "on", "background", "and", "from", "to"}
)

SUPERSAMPLE = 4  # shapes are drawn at 4x and downsampled: anti-aliased edges without a non-deterministic rasteriser
MARKER = ".rangefinder-dataset.json"  # settings of a finished dataset folder; its presence means "complete"


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class _Draws:
    """Uniform draws from `random.random()` only (the part of `random` that is stable across Python versions)."""

    def __init__(self, *key: object):
        digest = hashlib.sha256(":".join(str(k) for k in ("rangefinder", *key)).encode()).digest()
        self._rng = random.Random(int.from_bytes(digest[:8], "big"))

    def uniform(self, lo: float, hi: float) -> float:
        return lo + (hi - lo) * self._rng.random()

    def index(self, n: int) -> int:
        return min(int(self._rng.random() * n), n - 1)

    def choice(self, seq):
        return seq[self.index(len(seq))]


def _shape_item(d: _Draws, resolution: int) -> tuple[Image.Image, str]:
    names = list(COLOURS)
    fg = d.choice(names)
    bg = d.choice([c for c in names if c != fg])
    shape = d.choice(SHAPES)
    big = resolution * SUPERSAMPLE
    img = Image.new("RGB", (big, big), COLOURS[bg])
    draw = ImageDraw.Draw(img)
    size = d.uniform(0.35, 0.75) * big  # side / diameter
    half = size / 2
    cx = d.uniform(half + 1, big - half - 1)
    cy = d.uniform(half + 1, big - half - 1)
    box = (cx - half, cy - half, cx + half, cy + half)
    colour = COLOURS[fg]
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=colour)
    else:  # diamond
        draw.polygon([(cx, cy - half), (cx + half, cy), (cx, cy + half), (cx - half, cy)], fill=colour)
    img = img.resize((resolution, resolution), Image.Resampling.LANCZOS)
    return img, f"{_a(fg)} {fg} {shape} on {_a(bg)} {bg} background"


def _stripes_item(d: _Draws, resolution: int) -> tuple[Image.Image, str]:
    names = list(COLOURS)
    c1 = d.choice(names)
    c2 = d.choice([c for c in names if c != c1])
    pattern = d.choice(PATTERNS)
    a = np.array(COLOURS[c1], dtype=np.float64)
    b = np.array(COLOURS[c2], dtype=np.float64)
    big = resolution * SUPERSAMPLE
    period = d.uniform(0.15, 0.5) * big  # one stripe pair, in supersampled pixels
    phase = d.uniform(0, period)
    y, x = np.mgrid[0:big, 0:big].astype(np.float64)
    if pattern == "gradient":
        t = (x / (big - 1))[..., None]  # (big, big, 1): left c1 to right c2
    else:
        if pattern == "horizontal stripes":
            on = np.floor((y + phase) / (period / 2))
        elif pattern == "vertical stripes":
            on = np.floor((x + phase) / (period / 2))
        elif pattern == "diagonal stripes":
            on = np.floor(((x + y) / np.sqrt(2) + phase) / (period / 2))
        else:  # checkerboard
            on = np.floor((x + phase) / (period / 2)) + np.floor((y + phase) / (period / 2))
        t = (on % 2)[..., None]
    pixels = np.round(a + (b - a) * t).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")
    img = img.resize((resolution, resolution), Image.Resampling.LANCZOS)
    if pattern == "gradient":
        return img, f"a gradient from {c1} to {c2}"
    if pattern == "checkerboard":
        return img, f"{_a(c1)} {c1} and {c2} checkerboard"
    return img, f"{c1} and {c2} {pattern}"


_RENDERERS: dict[str, Callable[[_Draws, int], tuple[Image.Image, str]]] = {
    "shapes": _shape_item,
    "stripes": _stripes_item,
}


def render_item(kind: str, seed: int, index: int, resolution: int = 32) -> tuple[Image.Image, str]:
    """Image number `index` of the `kind` dataset with `seed`, and its caption. Pure: no files, no global RNG."""
    if kind not in _RENDERERS:
        raise DataError(f"unknown synthetic dataset kind {kind!r}; choose one of {', '.join(KINDS)}")
    if resolution < 8:
        raise DataError(f"resolution {resolution} is too small for a synthetic image; use 8 or more (e.g. 32)")
    return _RENDERERS[kind](_Draws(kind, seed, index), resolution)


def make_synthetic_dataset(
    out_dir: str | Path, kind: str = "shapes", count: int = 20, seed: int = 0, resolution: int = 32
) -> dict:
    """Write `count` images (`00000.png` ...) with `.txt` captions into `out_dir`; return a summary.

    A folder already made with the same settings is reused as is. The folder is written under a temporary name and
    renamed when complete, so an interrupted run never leaves a dataset that looks finished.
    """
    if count < 1:
        raise DataError(f"--count must be at least 1 (got {count})")
    if kind not in _RENDERERS:
        raise DataError(f"unknown synthetic dataset kind {kind!r}; choose one of {', '.join(KINDS)}")
    out = Path(out_dir).expanduser().resolve()
    settings = {"kind": kind, "count": count, "seed": seed, "resolution": resolution, "format": 1}
    summary = {"out": str(out), **{k: settings[k] for k in ("kind", "count", "seed", "resolution")}}
    marker = out / MARKER
    if out.exists():
        if marker.is_file() and json.loads(marker.read_text()) == settings:
            return {**summary, "reused": True}
        if any(out.iterdir()):
            raise DataError(
                f"{out} already exists and is not a {kind} dataset made with these settings; "
                "pass an empty or new --out folder (nothing was overwritten)"
            )
    try:
        with atomic_dir(out, replace=False) as tmp:
            for i in range(count):
                img, caption = render_item(kind, seed, i, resolution)
                img.save(tmp / f"{i:05d}.png", format="PNG")
                (tmp / f"{i:05d}.txt").write_text(caption + "\n")
            (tmp / MARKER).write_text(json.dumps(settings, sort_keys=True) + "\n")
    except OSError:
        # Another process finished the same dataset first: use theirs.
        if marker.is_file() and json.loads(marker.read_text()) == settings:
            return {**summary, "reused": True}
        raise
    return {**summary, "reused": False}
