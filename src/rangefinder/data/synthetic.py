"""Synthetic datasets with true captions, made offline and deterministically (the embedded default).

- `shapes`: one coloured shape on a plain background, "a red circle on a blue background". 8 colours x 4 shapes x
  7 backgrounds = 224 captions, with size and position varied as well, so a few dozen images hold far more
  combinations than a tiny model can memorise: validation loss on held-out images tells learning from overfitting.
  The demo's dataset until 2026-11-25; the unit tests and the benches still use it.
- `shapes-on-white`: the demo's dataset: one shape in one of four colours (red, green, blue, black) on a white
  background, "a red circle on a white background"; image i has colour i mod 4 and shape (i div 4) mod 4, so any 16
  images in a row hold every pairing once. One colour word per caption, always the shape's, and a background that
  never changes: what a tiny model can learn to follow within the demo's few hundred updates (docs/demo-learning.md).
- `stripes`: two-colour stripes, checkerboards and gradients, "red and white horizontal stripes". It shares the
  colour words but no shape, so the tiny base model pre-trained on it knows colours and textures; learning shapes on
  the demo dataset afterwards is fine-tuning, not training from scratch.
- `textures`, `subject`, `glyphs`: further kinds for the discovery bench (bench/RESULTS.md): a textured style; one
  subject named by a rare token, DreamBooth-like; stroke letters over soft two-colour landscapes, "the letter k in
  white over a blue and green landscape" (added as a kind no setting of the method was chosen on).

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
TEXTURES = ("dots", "bricks", "cells", "waves", "marble")
# Capital letters drawn with straight strokes on a 4 x 6 grid (x right, y down): the `glyphs` kind's marks.
GLYPHS: dict[str, tuple[tuple[float, float, float, float], ...]] = {
    "a": ((0, 6, 2, 0), (2, 0, 4, 6), (1, 3.5, 3, 3.5)),
    "e": ((0, 0, 0, 6), (0, 0, 4, 0), (0, 3, 3, 3), (0, 6, 4, 6)),
    "f": ((0, 0, 0, 6), (0, 0, 4, 0), (0, 3, 3, 3)),
    "h": ((0, 0, 0, 6), (4, 0, 4, 6), (0, 3, 4, 3)),
    "k": ((0, 0, 0, 6), (4, 0, 0, 3.5), (1.5, 2.5, 4, 6)),
    "l": ((0, 0, 0, 6), (0, 6, 4, 6)),
    "m": ((0, 6, 0, 0), (0, 0, 2, 3.5), (2, 3.5, 4, 0), (4, 0, 4, 6)),
    "n": ((0, 6, 0, 0), (0, 0, 4, 6), (4, 6, 4, 0)),
    "t": ((0, 0, 4, 0), (2, 0, 2, 6)),
    "v": ((0, 0, 2, 6), (2, 6, 4, 0)),
    "x": ((0, 0, 4, 6), (4, 0, 0, 6)),
    "y": ((0, 0, 2, 3), (4, 0, 2, 3), (2, 3, 2, 6)),
    "z": ((0, 0, 4, 0), (4, 0, 0, 6), (0, 6, 4, 6)),
}
KINDS = ("shapes", "shapes-on-white", "stripes", "textures", "subject", "glyphs")
# The `shapes-on-white` palette: far apart from each other and from white (yellow on white came out as pale blobs the
# prompt score read as white; docs/demo-learning.md).
ON_WHITE_COLOURS = ("red", "green", "blue", "black")
EMBEDDED_KIND = "shapes-on-white"  # the embedded default's (and the demo's) dataset: 20 images of it, seed 0
SUBJECT_TOKEN = "sks"  # DreamBooth's rare identifier; not in the vocabulary, so it tokenizes into bytes

# Every word a caption of shapes or stripes can contain (the tiny model's tokenizer makes each a single token).
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
    _draw_shape(d, draw, shape, COLOURS[fg], big, d.uniform(0.35, 0.75))
    img = img.resize((resolution, resolution), Image.Resampling.LANCZOS)
    return img, f"{_a(fg)} {fg} {shape} on {_a(bg)} {bg} background"


def _draw_shape(d: _Draws, draw: ImageDraw.ImageDraw, shape: str, colour: tuple[int, int, int], big: int,
                size: float) -> None:
    """`shape` of side / diameter `size` x `big` pixels, placed at random wholly inside the `big`-pixel canvas."""
    half = size * big / 2
    cx = d.uniform(half + 1, big - half - 1)
    cy = d.uniform(half + 1, big - half - 1)
    _draw_shape_at(draw, shape, colour, cx, cy, half)


def _draw_shape_at(draw: ImageDraw.ImageDraw, shape: str, colour: tuple[int, int, int], cx: float, cy: float,
                   half: float) -> None:
    """`shape` centred on (cx, cy), `half` its half side / radius, in pixels."""
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=colour)
    else:  # diamond
        draw.polygon([(cx, cy - half), (cx + half, cy), (cx, cy + half), (cx - half, cy)], fill=colour)


def _shape_on_white_item(d: _Draws, resolution: int, index: int) -> tuple[Image.Image, str]:
    fg = ON_WHITE_COLOURS[index % len(ON_WHITE_COLOURS)]
    shape = SHAPES[(index // len(ON_WHITE_COLOURS)) % len(SHAPES)]
    big = resolution * SUPERSAMPLE
    img = Image.new("RGB", (big, big), COLOURS["white"])
    _draw_shape(d, ImageDraw.Draw(img), shape, COLOURS[fg], big, d.uniform(0.45, 0.75))
    img = img.resize((resolution, resolution), Image.Resampling.LANCZOS)
    return img, f"{_a(fg)} {fg} {shape} on a white background"


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


def _texture_item(d: _Draws, resolution: int) -> tuple[Image.Image, str]:
    names = list(COLOURS)
    c1 = d.choice(names)
    c2 = d.choice([c for c in names if c != c1])
    texture = d.choice(TEXTURES)
    big = resolution * SUPERSAMPLE
    cell = d.uniform(0.18, 0.32) * big  # the texture's scale: dot spacing, brick height, cell size, wavelength
    ox, oy = d.uniform(0, cell), d.uniform(0, cell)
    y, x = np.mgrid[0:big, 0:big].astype(np.float64)
    if texture == "dots":
        # A jittered grid of round dots of one radius.
        radius = d.uniform(0.22, 0.38) * cell
        gx, gy = np.floor((x + ox) / cell), np.floor((y + oy) / cell)
        n = int(big / cell) + 3
        jitter = np.array([[d.uniform(-0.12, 0.12) * cell for _ in range(2)] for _ in range(n * n)]).reshape(n, n, 2)
        jx = jitter[gy.astype(int) % n, gx.astype(int) % n, 0]
        jy = jitter[gy.astype(int) % n, gx.astype(int) % n, 1]
        dx = (x + ox) - (gx + 0.5) * cell - jx
        dy = (y + oy) - (gy + 0.5) * cell - jy
        t = (dx * dx + dy * dy <= radius * radius).astype(np.float64)
    elif texture == "bricks":
        # Rows of bricks, every other row shifted by half a brick; the mortar is the second colour.
        h = cell * 0.6
        row = np.floor((y + oy) / h)
        u = (x + ox + (row % 2) * cell) % cell
        v = (y + oy) % h
        mortar = max(2.0, 0.12 * h)
        t = ((u < mortar) | (v < mortar)).astype(np.float64)
    elif texture == "cells":
        # Voronoi cells of random sites, their borders drawn in the second colour.
        n = max(4, int(round((big / cell) ** 2)))
        sites = np.array([[d.uniform(0, big), d.uniform(0, big)] for _ in range(n)])
        dist = np.sqrt((x[..., None] - sites[:, 0]) ** 2 + (y[..., None] - sites[:, 1]) ** 2)
        two = np.sort(dist, axis=-1)[..., :2]
        t = (two[..., 1] - two[..., 0] < 0.1 * cell).astype(np.float64)
    elif texture == "waves":
        # Ripples: stripes bent by a slow sine, soft-edged.
        amp, freq = d.uniform(0.15, 0.35) * cell, 2 * np.pi / (d.uniform(1.5, 3.0) * cell)
        t = 0.5 + 0.5 * np.sin(2 * np.pi * (y + oy + amp * np.sin(freq * (x + ox))) / cell)
    else:  # marble: veins of a sine warped by smooth value noise
        g = 6
        grid = np.array([[d.uniform(0, 1) for _ in range(g)] for _ in range(g)])
        fy, fx = y / big * (g - 1), x / big * (g - 1)
        i0, j0 = np.minimum(fy.astype(int), g - 2), np.minimum(fx.astype(int), g - 2)
        wy, wx = fy - i0, fx - j0
        noise = ((grid[i0, j0] * (1 - wx) + grid[i0, j0 + 1] * wx) * (1 - wy)
                 + (grid[i0 + 1, j0] * (1 - wx) + grid[i0 + 1, j0 + 1] * wx) * wy)
        t = np.abs(np.sin(2 * np.pi * ((x + y + ox) / (2 * cell) + 2.5 * noise))) ** 3
    a = np.array(COLOURS[c1], dtype=np.float64)
    b = np.array(COLOURS[c2], dtype=np.float64)
    pixels = np.round(a + (b - a) * t[..., None]).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB").resize((resolution, resolution), Image.Resampling.LANCZOS)
    return img, f"{_a(c1)} {c1} and {c2} {texture} texture"


def _subject_identity(seed: int) -> dict:
    """The one subject of a `subject` dataset: fixed by the seed alone, the same in every image."""
    d = _Draws("subject-identity", seed)
    names = list(COLOURS)
    body = d.choice(names)
    head = d.choice([c for c in names if c != body])
    belt = d.choice([c for c in names if c not in (body, head)])
    eyes = "black" if head != "black" else "white"
    return {"shape": d.choice(SHAPES), "body": body, "head": head, "belt": belt, "eyes": eyes,
            "head_size": d.uniform(0.45, 0.65), "belt_at": d.uniform(0.35, 0.65)}


def _subject_item(d: _Draws, resolution: int, seed: int) -> tuple[Image.Image, str]:
    ident = _subject_identity(seed)
    used = {ident["body"], ident["head"], ident["belt"]}
    bg = d.choice([c for c in COLOURS if c not in used])
    big = resolution * SUPERSAMPLE
    img = Image.new("RGB", (big, big), COLOURS[bg])
    draw = ImageDraw.Draw(img)
    height = d.uniform(0.55, 0.9) * big  # head and body together
    hr = height * ident["head_size"] / (2 + 2 * ident["head_size"])  # head radius; the body is 2 head-sizes less
    half = (height - 2 * hr) / 2  # half the body's side
    cx = d.uniform(half + 1, big - half - 1)
    top = d.uniform(1, big - height - 1)
    cy = top + 2 * hr + half  # the body's centre
    flip = -1.0 if d.uniform(0, 1) < 0.5 else 1.0  # facing left or right
    _draw_shape_at(draw, ident["shape"], COLOURS[ident["body"]], cx, cy, half)
    by = cy - half + 2 * half * ident["belt_at"]
    draw.rectangle((cx - half * 0.8, by - half * 0.12, cx + half * 0.8, by + half * 0.12), fill=COLOURS[ident["belt"]])
    hx, hy = cx + flip * half * 0.25, top + hr
    draw.ellipse((hx - hr, hy - hr, hx + hr, hy + hr), fill=COLOURS[ident["head"]])
    er = max(hr * 0.18, 1.5)
    for ex in (hx + flip * hr * 0.15, hx + flip * hr * 0.6):  # both eyes toward the facing side
        draw.ellipse((ex - er, hy - er * 1.5, ex + er, hy + er * 0.5), fill=COLOURS[ident["eyes"]])
    img = img.resize((resolution, resolution), Image.Resampling.LANCZOS)
    return img, f"a photo of {SUBJECT_TOKEN} object on {_a(bg)} {bg} background"


def _glyph_item(d: _Draws, resolution: int) -> tuple[Image.Image, str]:
    """A stroke letter in one colour over a soft two-colour landscape (sky fading into ground at a horizon)."""
    names = list(COLOURS)
    sky = d.choice(names)
    ground = d.choice([c for c in names if c != sky])
    ink = d.choice([c for c in names if c not in (sky, ground)])
    letter = d.choice(sorted(GLYPHS))
    big = resolution * SUPERSAMPLE
    horizon, soft = d.uniform(0.35, 0.7) * big, d.uniform(0.06, 0.2) * big
    y = np.arange(big, dtype=np.float64)[:, None, None]
    t = 1.0 / (1.0 + np.exp(-(y - horizon) / soft))  # 0 in the sky, 1 on the ground
    a, b = np.array(COLOURS[sky], dtype=np.float64), np.array(COLOURS[ground], dtype=np.float64)
    pixels = np.round(np.broadcast_to(a + (b - a) * t, (big, big, 3))).astype(np.uint8)
    img = Image.fromarray(np.ascontiguousarray(pixels), "RGB")
    draw = ImageDraw.Draw(img)
    height = d.uniform(0.45, 0.75) * big
    unit = height / 6
    x0 = d.uniform(2, big - 4 * unit - 2)
    y0 = d.uniform(2, big - height - 2)
    slant = d.uniform(-0.25, 0.25)  # italic: x shifts with height
    width = max(2, int(round(d.uniform(0.5, 0.8) * unit)))
    for gx0, gy0, gx1, gy1 in GLYPHS[letter]:
        p0 = (x0 + gx0 * unit + slant * (6 - gy0) * unit, y0 + gy0 * unit)
        p1 = (x0 + gx1 * unit + slant * (6 - gy1) * unit, y0 + gy1 * unit)
        draw.line((p0, p1), fill=COLOURS[ink], width=width)
    img = img.resize((resolution, resolution), Image.Resampling.LANCZOS)
    return img, f"the letter {letter} in {ink} over {_a(sky)} {sky} and {ground} landscape"


_RENDERERS: dict[str, Callable[[_Draws, int, int, int], tuple[Image.Image, str]]] = {
    "shapes": lambda d, r, _seed, _i: _shape_item(d, r),
    "shapes-on-white": lambda d, r, _seed, i: _shape_on_white_item(d, r, i),
    "stripes": lambda d, r, _seed, _i: _stripes_item(d, r),
    "textures": lambda d, r, _seed, _i: _texture_item(d, r),
    "subject": lambda d, r, seed, _i: _subject_item(d, r, seed),
    "glyphs": lambda d, r, _seed, _i: _glyph_item(d, r),
}


def render_item(kind: str, seed: int, index: int, resolution: int = 32) -> tuple[Image.Image, str]:
    """Image number `index` of the `kind` dataset with `seed`, and its caption. Pure: no files, no global RNG."""
    if kind not in _RENDERERS:
        raise DataError(f"unknown synthetic dataset kind {kind!r}; choose one of {', '.join(KINDS)}")
    if resolution < 8:
        raise DataError(f"resolution {resolution} is too small for a synthetic image; use 8 or more (e.g. 32)")
    return _RENDERERS[kind](_Draws(kind, seed, index), resolution, seed, index)


def make_synthetic_dataset(
    out_dir: str | Path, kind: str = EMBEDDED_KIND, count: int = 20, seed: int = 0, resolution: int = 32
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
