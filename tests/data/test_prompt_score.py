"""The prompt-following scores on images whose truth is known: the synthetic dataset's own images and captions."""

from __future__ import annotations

import numpy as np
from PIL import Image

from rangefinder.data.prompt_score import parse_prompt, score_image, score_images
from rangefinder.data.synthetic import COLOURS, render_item


def _items(n: int = 24):
    return [render_item("shapes", 7, i, 32) for i in range(n)]


def test_the_dataset_follows_its_own_captions_and_not_others():
    items = _items()
    own = score_images([img for img, _ in items], [cap for _, cap in items])
    assert own is not None and own["colour"] > 0.95 and own["shape"] > 0.85, own
    # The same images under the next image's caption: other colours (mostly) and other shapes.
    shifted = [cap for _, cap in items[1:] + items[:1]]
    other = score_images([img for img, _ in items], shifted)
    assert other is not None and other["colour"] < 0.5 and other["shape"] < own["shape"] - 0.15, (own, other)


def test_a_flat_image_of_another_colour_scores_nothing():
    img = Image.new("RGB", (32, 32), COLOURS["green"])
    assert score_image(img, "a red circle on a blue background") == {"colour": 0.0, "shape": 0.0}
    assert score_image(img, "a red circle on a green background") == {"colour": 1.0, "shape": 0.0}


def test_random_pixels_score_near_chance():
    rng = np.random.default_rng(0)
    imgs = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(8)]
    s = score_images(imgs, ["a red circle on a blue background"] * 8)
    assert s is not None and s["colour"] < 0.4 and s["shape"] < 0.3, s


def test_only_shapes_prompts_are_scored():
    assert parse_prompt("a photo of a cat") is None
    assert parse_prompt("A Red circle") == parse_prompt("a red circle")
    assert parse_prompt("an orange diamond on a white background").background == "white"  # type: ignore[union-attr]
    assert score_images([Image.new("RGB", (8, 8))], ["a photo of a cat"]) is None


def test_a_shape_drawn_as_the_dataset_draws_it_scores_its_overlap_with_the_named_shape():
    from PIL import ImageDraw

    from rangefinder.data.synthetic import _draw_shape_at

    # Drawn 4x larger and resized, as data.synthetic does: the shape's pixels are those it covers at least half of.
    least = {"circle": 0.95, "square": 0.99, "triangle": 0.89, "diamond": 0.94}
    for shape, floor in least.items():
        big = Image.new("RGB", (128, 128), COLOURS["blue"])
        _draw_shape_at(ImageDraw.Draw(big), shape, COLOURS["red"], 64, 64, 40)
        img = big.resize((32, 32), Image.Resampling.LANCZOS)
        s = score_image(img, f"a red {shape} on a blue background")
        assert s is not None and s["shape"] >= floor, (shape, s)
    # A bar 32 x 8 px is compared with the circle in the square around it (32 px across), not an 8 px one.
    bar = Image.new("RGB", (32, 32), COLOURS["blue"])
    bar.paste(COLOURS["red"], (0, 12, 32, 20))
    s = score_image(bar, "a red circle on a blue background")
    assert s is not None and abs(s["shape"] - 0.31) < 0.02, s


def test_the_scores_of_several_images_are_their_means():
    good = Image.new("RGB", (8, 8), COLOURS["red"])
    other = Image.new("RGB", (8, 8), COLOURS["green"])
    s = score_images([good, other, other], ["a red square"] * 3)
    assert s is not None and s["colour"] == 1 / 3 and s["shape"] == 1 / 3
