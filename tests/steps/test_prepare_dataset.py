"""The prepare step: a real dataset folder in, a split folder (and its report) out."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rangefinder.config import demo_config
from rangefinder.data.split import read_split
from rangefinder.errors import DataError
from rangefinder.steps.prepare_dataset import run_prepare_dataset


def test_dataset_dir_is_split_in_place(tmp_path, shapes_dataset_dir):
    cfg = demo_config(data={"dataset_dir": str(shapes_dataset_dir)})
    r = run_prepare_dataset(cfg, out_dir=tmp_path / "split", report_path=tmp_path / "report.md")
    split = read_split(r.split_dir)
    assert (r.train_images, r.val_images) == (16, 4) == (len(split.train), len(split.val))
    assert split.root == Path(shapes_dataset_dir).resolve()
    assert all(split.path_of(it).is_file() for it in split.train + split.val)
    assert "training images: 16" in (tmp_path / "report.md").read_text()


def test_imported_artifact_is_copied_into_the_split(tmp_path, shapes_dataset_dir):
    r = run_prepare_dataset(demo_config(), out_dir=tmp_path / "split", dataset_dir=Path(shapes_dataset_dir))
    split = read_split(r.split_dir)
    assert split.root == (tmp_path / "split" / "dataset").resolve()
    assert all(split.path_of(it).is_file() for it in split.train)


def test_an_imported_dataset_s_broken_link_is_listed_as_in_place_not_fatal(tmp_path, shapes_dataset_dir):
    """A link to nothing in an imported dataset failed the step with shutil's Error, a list naming the copy's
    temporary folder, where the same folder split in place lists it among the skipped files; links that resolve are
    copied as the files they name, so every later pod has the images."""
    data = tmp_path / "data"
    data.mkdir()
    for f in Path(shapes_dataset_dir).iterdir():
        (data / f.name).symlink_to(f)
    (data / "gone.png").symlink_to(tmp_path / "nowhere.png")
    r = run_prepare_dataset(demo_config(), out_dir=tmp_path / "split", dataset_dir=data, report_path=tmp_path / "r.md")
    assert (r.train_images, r.val_images, r.skipped) == (16, 4, 1)
    assert "`gone.png`: broken symbolic link" in (tmp_path / "r.md").read_text()
    split = read_split(r.split_dir)
    assert not any(split.path_of(it).is_symlink() for it in split.train + split.val)


def test_an_imported_dataset_s_link_back_into_itself_is_listed_as_in_place_not_copied_without_end(
        tmp_path, shapes_dataset_dir):
    """A link to a folder of the imported dataset (here its own root: a loop) was followed by the copy into the split,
    which copied the whole dataset again at each of 40 levels before the system refused the path, and failed with
    shutil's Error; the same folder split in place lists the loop among the skipped files, as it now does."""
    data = tmp_path / "data"
    (data / "shapes").mkdir(parents=True)
    for f in Path(shapes_dataset_dir).iterdir():
        (data / "shapes" / f.name).symlink_to(f)
    (data / "loop").symlink_to(data)
    (data / "again").symlink_to(data / "shapes")  # a second way to a folder: its images count once
    # A loop under a hidden folder, which the scan never walks (a tool's thumbnails, a .git): made a link too.
    (data / ".thumbs").mkdir()
    (data / ".thumbs" / "up").symlink_to(data)
    r = run_prepare_dataset(demo_config(), out_dir=tmp_path / "split", dataset_dir=data, report_path=tmp_path / "r.md")
    assert (r.train_images, r.val_images) == (16, 4)
    report = (tmp_path / "r.md").read_text()
    assert "`loop`: symbolic link loop (points back to .)" in report, report
    assert "`again`: symbolic link to" in report and "a folder already included" in report, report
    copied = tmp_path / "split" / "dataset"
    assert os.readlink(copied / "loop") == "." and os.readlink(copied / "again") == "shapes"
    assert os.readlink(copied / ".thumbs" / "up") == ".."


def test_an_imported_dataset_s_two_links_to_one_outside_folder_count_its_images_once_as_in_place(
        tmp_path, shapes_dataset_dir):
    """Two links to one folder outside an imported dataset were copied into the split as two real folders, whose
    scan counted each image twice (20 images trained and validated as 40, each at double weight: identical images
    stay on one side), where the same folder split in place counts them once and lists the second link. The copy
    makes it a link again, so the two agree to the file."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "b").symlink_to(shapes_dataset_dir)
    (data / "a").symlink_to(shapes_dataset_dir)
    copied = run_prepare_dataset(demo_config(), out_dir=tmp_path / "copied", dataset_dir=data,
                                 report_path=tmp_path / "copied.md")
    in_place = run_prepare_dataset(demo_config(data={"dataset_dir": str(data)}), out_dir=tmp_path / "in_place")
    assert (copied.train_images, copied.val_images, copied.skipped) == (16, 4, 1)
    assert (in_place.train_images, in_place.val_images, in_place.skipped) == (16, 4, 1)
    ours, theirs = read_split(copied.split_dir), read_split(in_place.split_dir)
    assert [it.file_name for it in ours.train + ours.val] == [it.file_name for it in theirs.train + theirs.val]
    assert "`b`: symbolic link to" in (tmp_path / "copied.md").read_text()
    assert os.readlink(tmp_path / "copied" / "dataset" / "b") == "a"


def test_a_link_to_a_folder_above_one_another_link_reached_counts_its_images_once_in_place_and_copied(
        tmp_path, shapes_dataset_dir):
    """`a` -> ext/sub, then `b` -> ext: the scan walked ext/sub twice, as `a` and as `b/sub` (its second way was a
    real folder of a link's, not a link, which alone was checked), and counted its images twice, in place and in an
    imported copy alike."""
    ext = tmp_path / "ext"
    (ext / "sub").mkdir(parents=True)
    files = sorted(Path(shapes_dataset_dir).iterdir())
    for i, f in enumerate(f for f in files if f.suffix == ".png"):
        where = ext / "sub" if i % 2 else ext
        for part in (f, f.with_suffix(".txt")):
            shutil.copy(part, where / part.name)
    data = tmp_path / "data"
    data.mkdir()
    (data / "a").symlink_to(ext / "sub")
    (data / "b").symlink_to(ext)
    in_place = run_prepare_dataset(demo_config(data={"dataset_dir": str(data)}), out_dir=tmp_path / "in_place",
                                   report_path=tmp_path / "in_place.md")
    copied = run_prepare_dataset(demo_config(), out_dir=tmp_path / "copied", dataset_dir=data)
    assert (in_place.train_images, in_place.val_images, in_place.skipped) == (16, 4, 1)
    assert (copied.train_images, copied.val_images, copied.skipped) == (16, 4, 1)
    assert "`b/sub`: folder already included as a" in (tmp_path / "in_place.md").read_text()
    ours, theirs = read_split(copied.split_dir), read_split(in_place.split_dir)
    assert [it.file_name for it in ours.train + ours.val] == [it.file_name for it in theirs.train + theirs.val]


def test_an_imported_dataset_that_fails_its_split_leaves_no_earlier_split_naming_the_replaced_images(
        tmp_path, shapes_dataset_dir):
    """Prepared again into the same folder, a new dataset's copy replaces the earlier one before its images are
    split: one with too few usable images (or a kill while they are read) left the earlier split.json, which named
    the images of the copy replaced, and read_split took it as finished. A copy that fails (a full disk) keeps it."""
    import shutil

    run_prepare_dataset(demo_config(), out_dir=tmp_path / "split", dataset_dir=Path(shapes_dataset_dir))
    data = tmp_path / "data"
    data.mkdir()
    for name in ("00000.png", "00000.txt"):
        shutil.copy(Path(shapes_dataset_dir) / name, data / f"new-{name}")
    with pytest.raises(DataError, match="usable image"):
        run_prepare_dataset(demo_config(), out_dir=tmp_path / "split", dataset_dir=data)
    with pytest.raises(DataError, match="is not a finished split folder"):
        read_split(tmp_path / "split")


def test_an_imported_dataset_prepared_again_on_a_disk_with_room_for_one_copy_keeps_the_split_made_before(
        tmp_path, shapes_dataset_dir, capsys):
    """The copy is made beside the earlier one and swapped in when whole, so for a moment the split's disk holds two:
    on a disk with room for one (a tmpfs of 256 KiB; the split with its copy takes 184 KiB), the step ends with its
    one line on the full disk, and the split made before is whole and still reads, its images all there."""
    import subprocess

    from kfp.dsl import Dataset, Markdown

    from rangefinder.pipelines import kfp_components as c

    task = tmp_path / "prepare-dataset"
    task.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(task)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN), which CI has")
    try:
        def prepare() -> object:
            return c.prepare_dataset.python_func(config_json=demo_config().model_dump_json(),
                                                 dataset=Dataset(name="dataset", uri=str(shapes_dataset_dir)),
                                                 split=Dataset(name="split", uri=str(task / "split")),
                                                 report=Markdown(name="report", uri=str(task / "report")))

        prepare()
        before = {p.name: p.read_bytes() for p in (task / "split" / "dataset").iterdir()}
        capsys.readouterr()
        with pytest.raises(SystemExit):
            prepare()
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert f"error: RangefinderError: cannot write the prepare-dataset step's outputs under {task}: disk full" \
               in line, line
        assert {p.name: p.read_bytes() for p in (task / "split" / "dataset").iterdir()} == before
        assert sorted(p.name for p in (task / "split").iterdir()) == ["dataset", "split.json", "stabilize.jsonl",
                                                                      "train.jsonl", "val.jsonl"]
        split = read_split(task / "split")
        assert (len(split.train), len(split.val)) == (16, 4)
        assert all(split.path_of(it).is_file() for it in split.train + split.val)
    finally:
        subprocess.run(["umount", str(task)], check=True)


def test_bad_files_are_listed_not_fatal(tmp_path, shapes_dataset_dir):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(shapes_dataset_dir, data)
    (data / "broken.png").write_bytes(b"not a png")
    (data / "broken.txt").write_text("a broken image")
    r = run_prepare_dataset(demo_config(data={"dataset_dir": str(data)}), out_dir=tmp_path / "split",
                            report_path=tmp_path / "r.md")
    assert r.skipped == 1 and r.train_images + r.val_images == 20
    assert "broken.png" in (tmp_path / "r.md").read_text()


def test_missing_folder_is_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="nope does not exist; give the folder of images"):
        run_prepare_dataset(demo_config(data={"dataset_dir": str(tmp_path / "nope")}), out_dir=tmp_path / "s")
    # A relative path, run from another folder than the config's: it said only "nope is not a folder".
    monkeypatch.chdir(tmp_path / "s")
    with pytest.raises(DataError) as e:
        run_prepare_dataset(demo_config(data={"dataset_dir": "nope"}), out_dir=tmp_path / "s")
    assert str(e.value).startswith(f"data.dataset_dir nope (read as {tmp_path / 's' / 'nope'}, from the folder "
                                   "rangefinder runs in) does not exist")


def test_a_dataset_dir_given_that_is_no_folder_is_one_clear_error_and_the_split_made_before_stays(
        tmp_path, shapes_dataset_dir, monkeypatch):
    """The dataset_dir argument (an imported artifact's folder; a notebook's own folder): a folder that does not exist
    ended in shutil's FileNotFoundError, after the split's earlier copy of the images was deleted, so the split.json
    left behind named images that were gone. A folder under ~ is read there."""
    monkeypatch.setenv("HOME", str(tmp_path))
    first = run_prepare_dataset(demo_config(), out_dir=tmp_path / "split", dataset_dir=str(shapes_dataset_dir))
    for bad, what in ((tmp_path / "nope", "does not exist"), (tmp_path / "split" / "split.json", "is a file")):
        with pytest.raises(DataError, match=rf"^dataset_dir {bad} {what}"):
            run_prepare_dataset(demo_config(), out_dir=tmp_path / "split", dataset_dir=bad)
    split = read_split(first.split_dir)
    assert all(split.path_of(it).is_file() for it in split.train + split.val)
    (tmp_path / "data").symlink_to(shapes_dataset_dir)
    # A copy killed mid-way (an evicted pod, a notebook's kernel) left its half-filled folder, a copy of the dataset
    # hidden in the split, where the copy retried beside it under another name left it for good.
    killed = tmp_path / "split" / ".dataset.99999.tmpab12cd"
    (killed / "sub").mkdir(parents=True)
    (killed / "sub" / "img.png").write_bytes(b"half")
    again = run_prepare_dataset(demo_config(), out_dir=tmp_path / "split", dataset_dir="~/data")
    assert (again.train_images, again.val_images) == (16, 4)
    assert not killed.exists()


def test_the_report_lists_the_aspect_ratio_buckets(tmp_path, mixed_aspect_dataset_dir):
    cfg = demo_config(data={"dataset_dir": str(mixed_aspect_dataset_dir)})  # 32 px, bucketing on
    run_prepare_dataset(cfg, out_dir=tmp_path / "split", report_path=tmp_path / "report.md")
    report = (tmp_path / "report.md").read_text()
    assert "## Aspect-ratio buckets (32 px, sides in steps of 8 px, at most 2:1)" in report
    table = read_split(tmp_path / "split").summary["buckets"]["table"]
    assert [b["bucket"] for b in table] == ["24x40", "32x32", "40x24"]
    for b in table:
        assert f"| {b['bucket']} | {b['train']} | {b['val']} | {b['stabilize']} |" in report
    off = demo_config(data={"dataset_dir": str(mixed_aspect_dataset_dir), "bucketing": False})
    run_prepare_dataset(off, out_dir=tmp_path / "square", report_path=tmp_path / "square.md")
    assert "Aspect-ratio buckets" not in (tmp_path / "square.md").read_text()
    assert read_split(tmp_path / "square").summary["buckets"] is None


def test_the_report_lists_long_captions_duplicates_and_the_size_floor(tmp_path, shapes_dataset_dir, tiny_model_dir,
                                                                      capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(shapes_dataset_dir, data)
    shutil.copy(data / "00000.png", data / "again.png")
    (data / "again.txt").write_text(", ".join(["a red circle on a blue background"] * 12))
    cfg = demo_config(data={"dataset_dir": str(data)}, model={"resolved_dir": str(tiny_model_dir)})
    capsys.readouterr()
    run_prepare_dataset(cfg, out_dir=tmp_path / "split", report_path=tmp_path / "r.md")
    # Said on the step's output too, once for the dataset: the report alone went unread, and training cut the tail.
    assert capsys.readouterr().err == (
        "rangefinder: warning: 1 caption(s) are longer than the 75 tokens the text encoder reads, and train with their "
        "tail cut off: again.png (95); shorten them, or put what matters first (the dataset report lists them all)\n")
    report = (tmp_path / "r.md").read_text()
    assert "captions longer than the text encoder reads (75 tokens; the rest is cut off): 1" in report
    assert "  - `again.png`: 95 tokens" in report
    assert "identical images (kept in one subset): 1 groups\n  - `00000.png` = `again.png`" in report
    assert f"minimum short side: {cfg.data.effective_min_image_size()} px" in report


def test_textual_inversion_splits_a_folder_of_images_without_captions(tmp_path, shapes_dataset_dir):
    """The pipeline keeps captionless images for textual inversion (its prompt templates fill them) and for no other
    method, where they are skipped and listed as before."""
    import shutil

    data = tmp_path / "data"
    data.mkdir()
    for png in sorted(Path(shapes_dataset_dir).glob("*.png"))[:6]:
        shutil.copy(png, data / png.name)
    ti = demo_config(data={"dataset_dir": str(data)}, training={"method": "textual_inversion"})
    r = run_prepare_dataset(ti, out_dir=tmp_path / "ti", report_path=tmp_path / "ti.md")
    assert r.train_images + r.val_images == 6 and r.skipped == 0
    assert "images without a caption: 6" in (tmp_path / "ti.md").read_text()
    with pytest.raises(DataError, match="missing caption"):
        run_prepare_dataset(demo_config(data={"dataset_dir": str(data)}), out_dir=tmp_path / "full")


def test_file_and_folder_names_show_in_the_report_as_text_never_as_markup(tmp_path, shapes_dataset_dir):
    """The KFP UI renders the report's Markdown, raw HTML included. Whoever can write the dataset names its files:
    a name that closed the report's code span (a backtick) or its list item (blank lines) made an <img onerror> or a
    <script> of the report page. Rendered by a CommonMark renderer, every element is one the report writes itself,
    and each name reads as it is."""
    import shutil
    from html.parser import HTMLParser

    from markdown_it import MarkdownIt

    data = tmp_path / "data"
    shutil.copytree(shapes_dataset_dir, data)
    names = ["a`<img src=x onerror=alert(1)>`.png", "b\n\n<script>alert(2)\n.png", "<img src=y onerror=alert(3)>.png",
             "[run](javascript:alert(4)).png"]
    for name in names:  # copies, uncaptioned (listed as skipped) but the third (listed as identical to 00000.png)
        shutil.copy(data / "00000.png", data / name)
    (data / names[2]).with_suffix(".txt").write_text("a shape")
    (data / "10_<img src=z onerror=alert(5)>").mkdir()  # kohya's repeat folder: a note naming its caption
    shutil.copy(data / "00001.png", data / "10_<img src=z onerror=alert(5)>" / "c.png")
    (data / "10_<img src=z onerror=alert(5)>" / "c.txt").write_text("a shape")
    run_prepare_dataset(demo_config(data={"dataset_dir": str(data)}), out_dir=tmp_path / "split",
                        report_path=tmp_path / "r.md")

    class Page(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tags: set[str] = set()
            self.attributes: list[str] = []
            self.text = ""

        def handle_starttag(self, tag, attrs):
            self.tags.add(tag)
            self.attributes += [k for k, _ in attrs]

        def handle_data(self, data):
            self.text += data

    page = Page()
    page.feed(MarkdownIt("commonmark").render((tmp_path / "r.md").read_text()))
    assert page.tags <= {"h1", "h2", "ul", "li", "code", "p", "table", "thead", "tbody", "tr", "th", "td"}
    assert page.attributes == []
    for shown in ("a`<img src=x onerror=alert(1)>`.png", "b\\n\\n<script>alert(2)\\n.png",
                  "<img src=y onerror=alert(3)>.png", "[run](javascript:alert(4)).png", "<img src=z onerror=alert(5)>"):
        assert shown in page.text


def test_the_split_section_s_settings_reach_the_split_and_its_report(tmp_path, shapes_dataset_dir):
    """split.val_split, stabilize_split, seed and val_dir are the step's, and the report counts each subset."""
    import shutil

    data = shapes_dataset_dir
    settings = {"val_split": 0.25, "stabilize_split": 0.5, "seed": 7}
    r = run_prepare_dataset(demo_config(data={"dataset_dir": str(data)}, split=settings), out_dir=tmp_path / "s7",
                            report_path=tmp_path / "r.md")
    split = read_split(r.split_dir)
    assert (r.train_images, r.val_images, len(split.stabilize)) == (15, 5, 8)  # ceil(0.25 x 20), half of 15 rounded up
    report = (tmp_path / "r.md").read_text()
    assert "- training images: 15\n- validation images: 5\n- stabilize subset: 8\n" in report
    other = run_prepare_dataset(demo_config(data={"dataset_dir": str(data)}, split={**settings, "seed": 8}),
                                out_dir=tmp_path / "s8")
    assert {it.file_name for it in read_split(other.split_dir).val} != {it.file_name for it in split.val}
    # A hand-chosen validation folder replaces val_split.
    train, val = tmp_path / "train", tmp_path / "val"
    shutil.copytree(data, train)
    val.mkdir()
    for name in ("00000", "00001", "00002"):
        for ext in (".png", ".txt"):
            shutil.move(train / f"{name}{ext}", val / f"{name}{ext}")
    by_hand = run_prepare_dataset(demo_config(data={"dataset_dir": str(train)}, split={"val_dir": str(val)}),
                                  out_dir=tmp_path / "by_hand")
    assert (by_hand.train_images, by_hand.val_images) == (17, 3)


def test_a_notebook_s_dict_is_taken_as_a_config_and_its_bad_key_named(tmp_path, shapes_dataset_dir):
    """A dict handed to a step (a notebook's, a YAML file read with yaml.safe_load) was an AttributeError from inside
    the step ('dict' object has no attribute 'data'); it is validated as a config file is, a bad key named in one
    line, and anything else is a TypeError saying what to pass."""
    from rangefinder.errors import ConfigError

    r = run_prepare_dataset({"data": {"dataset_dir": str(shapes_dataset_dir), "resolution": 32}},
                            out_dir=tmp_path / "split")
    assert (r.train_images, r.val_images) == (16, 4)
    with pytest.raises(ConfigError, match="data.resolutoin") as bad:
        run_prepare_dataset({"data": {"resolutoin": 64}}, out_dir=tmp_path / "bad")
    assert "\n" not in str(bad.value) and not (tmp_path / "bad").exists()
    with pytest.raises(TypeError, match="cfg is a str; pass a RangefinderConfig"):
        run_prepare_dataset("config.yaml", out_dir=tmp_path / "bad")  # type: ignore[arg-type]
