import json

import pytest
from PIL import Image

from rangefinder.cli.main import main
from rangefinder.data.synthetic import COLOURS, SHAPES, make_synthetic_dataset, render_item
from rangefinder.errors import DataError


def test_same_seed_gives_byte_identical_files(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["make-dataset", "--kind", "shapes", "--out", str(tmp_path / name), "--count", "6",
                     "--seed", "7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.split("}\n")[0] + "}")
    assert out["count"] == 6 and out["reused"] is False
    files_a = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files_a == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert len([f for f in files_a if f.endswith(".png")]) == 6
    for f in files_a:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    other = make_synthetic_dataset(tmp_path / "c", count=6, seed=8)
    assert other["reused"] is False
    assert (tmp_path / "c" / "00000.png").read_bytes() != (tmp_path / "a" / "00000.png").read_bytes()


def test_captions_are_true():
    # The caption names the shape's colour and the background's colour: check both against the pixels.
    for i in range(12):
        img, caption = render_item("shapes", 0, i, 32)
        words = caption.split()
        fg, shape, bg = words[1], words[2], words[5]
        assert shape in SHAPES and caption.endswith("background")
        px = img.load()
        corners = [px[0, 0], px[31, 0], px[0, 31], px[31, 31]]
        # At least three corners show the background (the shape covers at most one).
        assert sum(max(abs(a - b) for a, b in zip(c, COLOURS[bg], strict=True)) < 12 for c in corners) >= 3, caption
        colours = [px[x, y] for x in range(32) for y in range(32)]
        assert any(max(abs(a - b) for a, b in zip(c, COLOURS[fg], strict=True)) < 12 for c in colours), caption


def test_stripes_differ_from_shapes_and_reuse(tmp_path):
    img, caption = render_item("stripes", 0, 0, 32)
    assert isinstance(img, Image.Image) and img.size == (32, 32)
    assert not any(s in caption for s in SHAPES)
    first = make_synthetic_dataset(tmp_path / "s", kind="stripes", count=3)
    again = make_synthetic_dataset(tmp_path / "s", kind="stripes", count=3)
    assert (first["reused"], again["reused"]) == (False, True)
    with pytest.raises(DataError, match="already exists"):
        make_synthetic_dataset(tmp_path / "s", kind="shapes", count=3)
    with pytest.raises(DataError, match="unknown synthetic dataset kind"):
        make_synthetic_dataset(tmp_path / "x", kind="faces")
