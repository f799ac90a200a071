import json
import math
import zlib

import pytest
from PIL import Image

from rangefinder.cli.main import main
from rangefinder.data.split import make_split, read_split, seeded_shuffle, split_dataset
from rangefinder.errors import DataError


def _dataset(folder, n, green=0):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (8, 8), (i, green, 0)).save(folder / f"img{i:03d}.png")
        (folder / f"img{i:03d}.txt").write_text(f"caption {i}")
    return folder


def test_shuffle_is_pinned():
    # The split must be the same on every machine and Python version: pin one shuffle.
    assert seeded_shuffle(list(range(10)), 555) == [5, 8, 3, 7, 2, 0, 6, 4, 9, 1]


@pytest.mark.parametrize("n,p", [(5, 0.2), (20, 0.2), (21, 0.2), (7, 0.5), (10, 0.01), (3, 0.9)])
def test_counts_are_ceil_p_n_and_subsets_disjoint(tmp_path, n, p, capsys):
    data = _dataset(tmp_path / "data", n)
    args = ["split", str(data), "--out", str(tmp_path / "s"), "--val-split", str(p), "--resolution", "16", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    expected_val = min(max(1, math.ceil(p * n)), n - 1)
    assert out["val_images"] == expected_val and out["train_images"] == n - expected_val
    assert out["stabilize_images"] == min(out["train_images"], max(1, math.ceil(0.2 * out["train_images"])))
    split = read_split(tmp_path / "s")
    train, val, stab = ({it.file_name for it in s} for s in (split.train, split.val, split.stabilize))
    assert not train & val and stab <= train and len(train | val) == n
    for it in split.train + split.val:
        assert it.id == zlib.crc32(it.file_name.encode())
        assert split.path_of(it).is_file()


def test_two_runs_give_byte_identical_manifests(tmp_path):
    data = _dataset(tmp_path / "data", 12)
    split_dataset(data, tmp_path / "a", seed=3)
    split_dataset(data, tmp_path / "b", seed=3)
    split_dataset(data, tmp_path / "c", seed=4)
    names = ["train.jsonl", "val.jsonl", "stabilize.jsonl", "split.json"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "val.jsonl").read_bytes() != (tmp_path / "c" / "val.jsonl").read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(names)  # no temporary files left
    first = json.loads((tmp_path / "a" / "train.jsonl").read_text().splitlines()[0])
    assert list(first) == ["id", "file_name", "text", "size", "sha256"]


def test_bad_files_are_listed_in_the_summary_and_skipped(tmp_path, capsys):
    data = _dataset(tmp_path / "data", 6)
    (data / "broken.png").write_bytes(b"junk")
    (data / "broken.txt").write_text("x")
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--resolution", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["images"] == 6 and out["val_images"] == 2
    assert out["skipped"] == [
        "broken.png: unreadable image: not a file format Pillow recognises (corrupt or not an image)"
    ]
    summary = json.loads((tmp_path / "s" / "split.json").read_text())
    assert summary["skipped"][0]["file_name"] == "broken.png" and summary["root"] == str(data.resolve())


def test_manual_validation_folder(tmp_path):
    data = _dataset(tmp_path / "data", 6)
    _dataset(data / "val", 2, green=9)  # inside the dataset: its images must not also be trained on
    split = split_dataset(data, tmp_path / "s", val_dir=data / "val")
    assert [it.file_name for it in split.val] == ["val/img000.png", "val/img001.png"]
    assert len(split.train) == 6 and not any(it.file_name.startswith("val/") for it in split.train)
    # Left out of the scan, not met as copies of the validation images (which the leak guard would list).
    assert split.summary["skipped"] == [] and split.summary["duplicates"] == []
    outside = _dataset(tmp_path / "heldout", 1, green=9)
    split = split_dataset(data, tmp_path / "s2", val_dir=outside)
    assert [it.file_name for it in split.val] == ["../heldout/img000.png"]
    assert read_split(tmp_path / "s2").path_of(split.val[0]) == (outside / "img000.png").resolve()


def test_val_split_with_val_dir_is_refused(tmp_path, capsys):
    # --val-split was dropped without a word when --val-dir was given too.
    data = _dataset(tmp_path / "data", 4)
    held = _dataset(tmp_path / "held", 1, green=9)
    with pytest.raises(SystemExit) as e:
        main(["split", str(data), "--out", str(tmp_path / "s"), "--val-dir", str(held), "--val-split", "0.5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --val-split: not allowed with argument --val-dir" in err and err.count("\n") == 1
    assert not (tmp_path / "s").exists()
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--val-dir", str(held), "--resolution", "16"]) == 0


def test_errors(tmp_path, capsys):
    data = _dataset(tmp_path / "data", 1)
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--resolution", "16"]) == 2
    assert "only 1 usable image" in capsys.readouterr().err
    with pytest.raises(DataError, match="val_split"):
        make_split(data, val_split=1.0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a finished split folder"):
        read_split(tmp_path / "empty")


def test_too_few_images_says_what_the_floor_is_for(tmp_path, capsys):
    # The bracket once always read "at least one to train and one to validate", also for --min-images 100.
    data = _dataset(tmp_path / "data", 3)
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--resolution", "16", "--min-images", "100"]) == 2
    err = capsys.readouterr().err
    assert "fewer than the 100 needed (the floor set by data.min_images, or split --min-images)" in err
    assert "one to train and one to validate" not in err
    one = _dataset(tmp_path / "one", 1)
    assert main(["split", str(one), "--out", str(tmp_path / "s1"), "--resolution", "16"]) == 2
    assert "fewer than the 2 needed (at least one to train and one to validate)" in capsys.readouterr().err
    empty_val = tmp_path / "val"
    (empty_val / "broken.png").parent.mkdir()
    (empty_val / "broken.png").write_bytes(b"junk")
    (empty_val / "broken.txt").write_text("x")
    with pytest.raises(DataError, match=r"fewer than the 1 needed \(at least one to validate, in --val-dir"):
        split_dataset(data, tmp_path / "s2", val_dir=empty_val)
    with pytest.raises(DataError, match=r"fewer than the 4 needed \(the floor .* less one for --val-dir"):
        split_dataset(data, tmp_path / "s3", val_dir=_dataset(tmp_path / "val2", 1, green=9), min_images=5)


def test_split_moved_with_its_data_still_finds_the_images(tmp_path):
    import shutil

    data = _dataset(tmp_path / "job" / "data", 4)
    split_dataset(data, tmp_path / "job" / "split")
    shutil.move(tmp_path / "job", tmp_path / "elsewhere")
    split = read_split(tmp_path / "elsewhere" / "split")
    assert split.root == (tmp_path / "elsewhere" / "data").resolve()
    assert all(split.path_of(it).is_file() for it in split.train + split.val)
    other = read_split(tmp_path / "elsewhere" / "split", root=tmp_path / "elsewhere" / "data")
    assert other.root == split.root


def test_identical_images_stay_in_one_subset_and_are_reported(tmp_path):
    import shutil

    data = _dataset(tmp_path / "data", 10)
    # The same picture twice under different captions, and three copies of another: the probe's validation leak.
    shutil.copy(data / "img003.png", data / "copy_of_3.png")
    (data / "copy_of_3.txt").write_text("the same picture, another caption")
    for name in ("again_7a", "again_7b"):
        shutil.copy(data / "img007.png", data / f"{name}.png")
        (data / f"{name}.txt").write_text(name)
    for seed in range(12):  # whichever side each group is drawn to, it is drawn whole
        split = make_split(data, seed=seed, val_split=0.3)
        val = {it.file_name for it in split.val}
        train = {it.file_name for it in split.train}
        assert len(val) + len(train) == 13 and len(val) >= 4
        for group in ({"img003.png", "copy_of_3.png"}, {"img007.png", "again_7a.png", "again_7b.png"}):
            assert group <= val or group <= train
        assert split.summary["duplicates"] == [["again_7a.png", "again_7b.png", "img007.png"],
                                               ["copy_of_3.png", "img003.png"]]
    # Without duplicates the split is the plain shuffle of the items, as before.
    plain = make_split(_dataset(tmp_path / "plain", 10), seed=555)
    drawn = seeded_shuffle(list(range(10)), 555)[:2]
    assert [it.file_name for it in plain.val] == sorted(f"img{i:03d}.png" for i in drawn)


def test_a_training_image_identical_to_a_hand_picked_validation_image_is_left_out(tmp_path):
    import shutil

    data = _dataset(tmp_path / "data", 5)
    val = _dataset(tmp_path / "val", 2, green=9)
    shutil.copy(val / "img001.png", data / "leak.png")
    (data / "leak.txt").write_text("a copy of a validation image")
    split = make_split(data, val_dir=val)
    assert "leak.png" not in {it.file_name for it in split.train} and len(split.train) == 5
    assert split.summary["duplicates"] == [["../val/img001.png", "leak.png"]]
    assert "the same image as validation image ../val/img001.png" in {
        s["file_name"]: s["reason"] for s in split.summary["skipped"]}["leak.png"]


def test_every_file_left_out_carries_its_kind_of_those_the_skipped_files_summary_names(tmp_path):
    """One file of each kind the split leaves out, from each of the three modules that write the reasons (the scan,
    the validation, the split's copy of a split.val_dir image): each carries its SkipKind, of which SKIPPED_KINDS
    (prepare-dataset's skipped_files and report) is made. The summary was written by hand beside those modules, and a
    new kind of skip there would not have reached it."""
    import os
    import shutil

    from rangefinder.data.dataset import SkipKind
    from rangefinder.data.split import SKIPPED_KINDS

    data = _dataset(tmp_path / "data", 3)
    val = _dataset(tmp_path / "val", 2, green=9)
    (data / "broken.png").write_bytes(b"junk")
    (data / "broken.txt").write_text("a broken image")
    Image.new("RGB", (8, 8), (0, 0, 9)).save(data / "uncaptioned.png")
    (data / "notes.md").write_text("not an image")
    os.symlink(data / "gone.png", data / "dangling.png")
    (data / "metadata.jsonl").write_text('{"file_name": "missing.png", "text": "no such image"}\n')
    shutil.copy(val / "img001.png", data / "leak.png")
    (data / "leak.txt").write_text("a copy of a validation image")
    split = split_dataset(data, tmp_path / "split", val_dir=val, min_image_size=1)
    kinds = {s["file_name"]: s["kind"] for s in split.summary["skipped"]}
    assert kinds == {"broken.png": "image", "uncaptioned.png": "caption", "notes.md": "not_trained",
                     "dangling.png": "link", "missing.png": "metadata", "leak.png": "val_copy"}
    assert sorted(kinds.values()) == sorted(kind.name.lower() for kind in SkipKind)  # every kind met here
    assert all(SkipKind[kind.upper()].value in SKIPPED_KINDS for kind in kinds.values())


def test_min_image_size_defaults_to_half_the_training_resolution_and_lists_what_it_skips(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for name, side in (("big_a", 256), ("big_b", 300), ("small", 255)):
        Image.new("RGB", (side, side + 7), (side % 250, 0, 0)).save(data / f"{name}.png")
        (data / f"{name}.txt").write_text(name)
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--json"]) == 0  # resolution 512 by default
    out = json.loads(capsys.readouterr().out)
    assert out["min_image_size"] == 256 and out["images"] == 2
    assert out["skipped"] == ["small.png: too small: 255x262 px, the short side must be at least 256 px"]
    assert json.loads((tmp_path / "s" / "split.json").read_text())["min_image_size"] == 256
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--resolution", "1024", "--json"]) == 2
    assert "only 0 usable images" in capsys.readouterr().err
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--resolution", "100"]) == 2
    assert "multiple of 8" in capsys.readouterr().err
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--min-image-size", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["images"] == 3


def test_captionless_images_are_kept_only_when_asked_for_textual_inversion(tmp_path, capsys):
    """A textual inversion folder is often images alone (diffusers' example trains it so): `--captionless` keeps the
    images with no caption, or an empty one, with an empty caption, which the method fills with a prompt template;
    without it they are skipped and listed, and a folder of nothing else is too few images."""
    data = _dataset(tmp_path / "data", 3)
    for i in range(3, 7):
        Image.new("RGB", (8, 8), (i, 9, 0)).save(data / f"bare{i}.png")
    (data / "bare6.txt").write_text("  \n")  # an empty caption file counts as none
    split = make_split(data, captionless=False)
    assert len(split.train) + len(split.val) == 3 and len(split.summary["skipped"]) == 4
    assert split.summary["captionless"] == 0
    split = make_split(data, captionless=True)
    assert len(split.train) + len(split.val) == 7 and split.summary["skipped"] == []
    texts = {it.file_name: it.text for it in split.train + split.val}
    assert split.summary["captionless"] == 4 and all(texts[f"bare{i}.png"] == "" for i in range(3, 7))
    assert texts["img000.png"] == "caption 0"
    for p in data.glob("img*"):
        p.unlink()
    with pytest.raises(DataError):
        make_split(data)
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--captionless", "--resolution", "8",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["captionless"] == 4


def test_the_stabilize_subset_is_pinned_too(tmp_path):
    # The same files and seed give the same stabilize subset on any machine and release, as the validation draw:
    # a seeded draw (seed + 1) from the training items in their drawn order, with --val-dir as without.
    plain = make_split(_dataset(tmp_path / "plain", 10), seed=555, stabilize_split=0.5)
    assert [it.file_name for it in plain.val] == ["img005.png", "img008.png"]
    assert [it.file_name for it in plain.stabilize] == ["img002.png", "img003.png", "img006.png", "img009.png"]
    assert plain.summary["stabilize_split"] == 0.5 and plain.summary["val_split"] == 0.2
    manual = make_split(_dataset(tmp_path / "data", 6), val_dir=_dataset(tmp_path / "val", 2, green=9), seed=555,
                        stabilize_split=0.5)
    assert [it.file_name for it in manual.stabilize] == ["img001.png", "img002.png", "img004.png"]
    whole = make_split(_dataset(tmp_path / "plain", 10), seed=555, stabilize_split=1)  # all of training, allowed
    assert whole.stabilize == whole.train


def test_a_group_of_identical_images_never_takes_the_last_training_place(tmp_path):
    import shutil

    # Two pictures, one of them twice: validation wants 2 of 3 images, but whichever group is drawn second trains.
    data = _dataset(tmp_path / "data", 2)
    shutil.copy(data / "img000.png", data / "copy.png")
    (data / "copy.txt").write_text("the same picture again")
    for seed in range(6):
        split = make_split(data, seed=seed, val_split=0.5)
        assert split.train and split.val and len(split.train) + len(split.val) == 3, seed


def test_each_image_is_recorded_with_the_sha256_of_its_whole_file(tmp_path):
    import hashlib

    import numpy as np

    data = _dataset(tmp_path / "data", 2)
    # Noise compresses badly: a PNG of several KiB, whose bytes past the first KiB differ from a copy's below.
    noise = np.random.default_rng(0).integers(0, 256, (48, 48, 3), dtype=np.uint8)
    Image.fromarray(noise).save(data / "noise_a.png")
    noise[-1, -1] = 255 - noise[-1, -1]
    Image.fromarray(noise).save(data / "noise_b.png")
    for name in ("noise_a", "noise_b"):
        (data / f"{name}.txt").write_text(name)
    split = make_split(data, seed=1)
    for it in split.train + split.val:
        assert it.sha256 == hashlib.sha256((data / it.file_name).read_bytes()).hexdigest(), it.file_name
    assert split.summary["duplicates"] == []


def test_a_growing_dataset_keeps_its_validation_set_only_in_a_folder_of_its_own(tmp_path):
    """The README's recipe for a schedule on a dataset that grows: the seeded draw picks other validation images once
    images are added (so no two weeks' val_loss compare, and last week's validation images train), while a first
    split's validation images copied into a split.val_dir (their copies left in the dataset folder) make every week's
    val.jsonl the same file, and keep those images out of training."""
    import shutil

    from rangefinder.tracking import folder_digest

    data = _dataset(tmp_path / "data", 20)
    first = split_dataset(data, tmp_path / "drawn1", val_split=0.2, seed=555)
    val_dir = tmp_path / "val"
    val_dir.mkdir()
    for it in first.val:
        for path in (data / it.file_name, (data / it.file_name).with_suffix(".txt")):
            shutil.copy(path, val_dir / path.name)
    week1 = split_dataset(data, tmp_path / "week1", val_dir=val_dir, seed=555)

    _dataset(tmp_path / "more", 26)  # 6 more images (img020..img025), added to the folder
    for src in sorted((tmp_path / "more").glob("img02[0-5].*")):
        shutil.copy(src, data / src.name)
    drawn = split_dataset(data, tmp_path / "drawn2", val_split=0.2, seed=555)
    assert {it.file_name for it in first.val} & {it.file_name for it in drawn.train}  # last week's val images train
    week2 = split_dataset(data, tmp_path / "week2", val_dir=val_dir, seed=555)

    assert folder_digest(tmp_path / "week1", "val.jsonl") == folder_digest(tmp_path / "week2", "val.jsonl")
    assert len(week2.train) == len(week1.train) + 6
    assert not {it.sha256 for it in first.val} & {it.sha256 for it in week1.train + week2.train}
