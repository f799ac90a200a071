import json

import numpy as np
import pytest
from PIL import Image

from rangefinder.cli.main import main
from rangefinder.data.synthetic import (
    CAPTION_WORDS,
    COLOURS,
    EMBEDDED_KIND,
    GLYPHS,
    KINDS,
    ON_WHITE_COLOURS,
    SHAPES,
    SUBJECT_TOKEN,
    TEXTURES,
    _subject_identity,
    make_synthetic_dataset,
    render_item,
)
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
    other = make_synthetic_dataset(tmp_path / "c", kind="shapes", count=6, seed=8)
    assert other["reused"] is False
    assert (tmp_path / "c" / "00000.png").read_bytes() != (tmp_path / "a" / "00000.png").read_bytes()
    # Another seed is another dataset, of every kind (the same kind: "c" above differed from "a" by seed alone).
    for kind in KINDS:
        assert render_item(kind, 7, 0)[0].tobytes() != render_item(kind, 8, 0)[0].tobytes(), kind


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


def _near(c, name, tol=12):
    return max(abs(a - b) for a, b in zip(c, COLOURS[name], strict=True)) < tol


def _dist(c, name):
    return sum((a - b) ** 2 for a, b in zip(c, COLOURS[name], strict=True))


def test_textures_are_deterministic_and_captions_name_their_colours(tmp_path):
    a = make_synthetic_dataset(tmp_path / "a", kind="textures", count=10, seed=3)
    make_synthetic_dataset(tmp_path / "b", kind="textures", count=10, seed=3)
    assert a["kind"] == "textures"
    for f in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    seen = set()
    for i in range(40):
        img, caption = render_item("textures", 0, i, 32)
        words = caption.split()
        # "a red and white dots texture": both colours show in the pixels, the texture is one of five.
        c1, c2, texture = words[1], words[3], words[4]
        assert words[2] == "and" and words[5] == "texture" and texture in TEXTURES, caption
        seen.add(texture)
        px = np.asarray(img, dtype=float).reshape(-1, 3)
        a, b = np.asarray(COLOURS[c1], dtype=float), np.asarray(COLOURS[c2], dtype=float)
        t = np.clip((px - a) @ (b - a) / ((b - a) @ (b - a)), 0, 1)
        # Every pixel is a blend of the two colours named (up to the resampling's ringing), both of them show.
        assert np.abs(px - (a + t[:, None] * (b - a))).max() < 40, caption
        assert t.min() < 0.2 and t.max() > 0.6, caption
        # A texture, not a flat colour: many distinct pixel values.
        assert len({tuple(c) for c in px}) > 20, caption
    assert seen == set(TEXTURES)


def test_subject_is_one_identity_named_by_a_rare_token():
    # DreamBooth-like: every image of a seed shows the same subject (the same colours) on another background, and
    # the caption names it by the rare token and the background by its colour.
    for seed in (0, 1):
        ident = _subject_identity(seed)
        placements = set()
        for i in range(12):
            img, caption = render_item("subject", seed, i, 32)
            assert caption.startswith(f"a photo of {SUBJECT_TOKEN} object on ") and caption.endswith(" background")
            bg = caption.split()[-2]
            assert bg not in (ident["body"], ident["head"], ident["belt"])
            px = [img.getpixel((x, y)) for x in range(32) for y in range(32)]
            assert sum(_near(c, bg) for c in px) > 0.3 * len(px), caption  # mostly background
            for part in ("body", "head"):
                assert sum(_near(c, ident[part]) for c in px) >= 4, (seed, i, part)
            placements.add(img.tobytes())
        assert len(placements) == 12  # each image another size, place or facing
    assert _subject_identity(0) != _subject_identity(1)


def test_new_kinds_leave_the_tiny_vocabulary_as_it_was():
    # The words of textures and subject tokenize into bytes, as a rare word does in CLIP: adding a kind does not
    # change the tiny model's tokenizer (and with it the weights it is pre-trained to).
    from rangefinder.models.tiny import build_tokenizer

    words = {w for k in ("textures", "subject", "glyphs") for i in range(30)
             for w in render_item(k, 0, i, 32)[1].split()}
    assert SUBJECT_TOKEN in words and not {SUBJECT_TOKEN, *TEXTURES} & set(CAPTION_WORDS)
    tok = build_tokenizer()
    ids = tok(SUBJECT_TOKEN, add_special_tokens=False).input_ids
    assert len(ids) > 1 and tok.unk_token_id not in ids


def test_glyphs_are_stroke_letters_over_a_landscape():
    # The held-out kind of the discovery bench: the caption names the letter, its ink and the landscape's two
    # colours; the top row is nearer the sky's colour than the ground's and the bottom row the other way round
    # (leaving out the letter's pixels), and the ink shows.
    letters = set()
    for i in range(40):
        img, caption = render_item("glyphs", 3, i, 32)
        words = caption.split()
        assert words[:2] == ["the", "letter"] and words[3] == "in" and words[-1] == "landscape", caption
        letter, ink, sky, ground = words[2], words[4], words[7], words[9]
        assert letter in GLYPHS and len({ink, sky, ground}) == 3 and {ink, sky, ground} <= set(COLOURS)
        for y, near, far in ((0, sky, ground), (31, ground, sky)):
            row = [img.getpixel((x, y)) for x in range(32)]
            row = [c for c in row if _dist(c, ink) > min(_dist(c, sky), _dist(c, ground))]
            assert sum(_dist(c, near) < _dist(c, far) for c in row) > 0.9 * len(row), (caption, y)
        px = [img.getpixel((x, y)) for x in range(32) for y in range(32)]
        assert sum(_near(c, ink) for c in px) >= 8, caption
        letters.add(letter)
    assert len(letters) >= 8
    assert render_item("glyphs", 3, 0, 32)[0].tobytes() == render_item("glyphs", 3, 0, 32)[0].tobytes()


def test_make_dataset_cli_makes_the_new_kinds(tmp_path):
    for kind in ("textures", "subject", "glyphs"):
        assert main(["make-dataset", "--kind", kind, "--out", str(tmp_path / kind), "--count", "3"]) == 0
        assert sorted(p.name for p in (tmp_path / kind).glob("*.txt")) == ["00000.txt", "00001.txt", "00002.txt"]


def test_shapes_on_white_pairs_every_colour_with_every_shape_on_white():
    """The embedded default: image i has colour i mod 4 and shape (i div 4) mod 4, so 16 images in a row hold each
    pairing once; the background is white and the caption's one colour word is the shape's, as the pixels show."""
    assert EMBEDDED_KIND == "shapes-on-white" and "white" not in ON_WHITE_COLOURS
    pairs = set()
    for i in range(16):
        img, caption = render_item(EMBEDDED_KIND, 0, i, 32)
        words = caption.split()
        assert caption.endswith("on a white background") and words[2] in SHAPES, caption
        pairs.add((words[1], words[2]))
        rgb = np.asarray(img, dtype=np.int64)
        corners = [rgb[0, 0], rgb[0, 31], rgb[31, 0], rgb[31, 31]]
        assert sum(np.abs(c - COLOURS["white"]).max() < 12 for c in corners) >= 3, caption
        near_fg = (np.abs(rgb - np.array(COLOURS[words[1]])).max(-1) < 12).mean()
        assert near_fg > 0.1, (caption, near_fg)  # the shape covers at least a tenth of the image
    assert pairs == {(c, s) for c in ON_WHITE_COLOURS for s in SHAPES}


def test_make_dataset_cli_offers_every_kind_and_defaults_to_the_embedded_one(tmp_path, capsys):
    import argparse

    from rangefinder.cli.commands import make_dataset

    sub = argparse.ArgumentParser().add_subparsers()
    make_dataset.register(sub)
    kind = next(a for a in sub.choices["make-dataset"]._actions if a.dest == "kind")
    assert set(kind.choices) == set(KINDS) and kind.default == EMBEDDED_KIND
    assert main(["make-dataset", "--out", str(tmp_path / "d"), "--count", "2", "--json"]) == 0
    assert (tmp_path / "d" / "00000.txt").read_text() == "a red circle on a white background\n"
