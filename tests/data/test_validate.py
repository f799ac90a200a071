import json
import shutil
import zlib
from pathlib import Path

import pytest
from PIL import Image

from rangefinder.data.dataset import item_id, scan_dataset
from rangefinder.data.validate import validate_dataset
from rangefinder.errors import DataError


def _good(folder, n, start=0):
    for i in range(start, start + n):
        Image.new("RGB", (32, 32), (10 * i, 100, 200)).save(folder / f"good{i:02d}.png")
        (folder / f"good{i:02d}.txt").write_text(f"a blue square number {i}\n")


@pytest.fixture
def messy_dir(tmp_path):
    d = tmp_path / "messy"
    d.mkdir()
    _good(d, 5)
    (d / "corrupt.png").write_bytes(b"not really a png" * 20)
    (d / "corrupt.txt").write_text("a corrupt file")
    whole = d / "good00.png"
    Image.new("RGB", (64, 64), (200, 10, 10)).save(d / "full.png")
    data = (d / "full.png").read_bytes()
    (d / "full.png").unlink()
    (d / "truncated.png").write_bytes(data[: len(data) // 2])
    (d / "truncated.txt").write_text("a truncated file")
    shutil.copy(whole, d / "nocaption.png")
    shutil.copy(whole, d / "emptycaption.png")
    (d / "emptycaption.txt").write_text("  \n\t")
    Image.new("RGB", (4, 4)).save(d / "tiny.png")
    (d / "tiny.txt").write_text("a tiny image")
    (d / "notes.txt").write_text("not a caption of anything")  # no image of that stem: reported, not used
    return d


def test_every_bad_item_is_reported_by_name_and_the_rest_used(messy_dir):
    result = validate_dataset(messy_dir, min_image_size=16, min_images=2)
    assert [it.file_name for it in result.items] == [f"good{i:02d}.png" for i in range(5)]
    reasons = {s.file_name: s.reason for s in result.skipped}
    assert set(reasons) == {"corrupt.png", "truncated.png", "nocaption.png", "emptycaption.png", "tiny.png",
                            "notes.txt"}
    assert reasons["notes.txt"].startswith("not used: a caption file with no image")
    assert reasons["corrupt.png"].startswith("unreadable image")
    assert reasons["truncated.png"].startswith("truncated or corrupt image")
    assert reasons["nocaption.png"].startswith("missing caption")
    assert reasons["emptycaption.png"].startswith("empty caption")
    assert reasons["tiny.png"].startswith("too small: 4x4 px")
    assert result.items[0].text == "a blue square number 0"
    assert result.items[0].id == item_id("good00.png")


def test_too_few_usable_images_fail_before_training_with_counts_and_reasons(messy_dir):
    for f in messy_dir.glob("good0[1-4].*"):
        f.unlink()
    with pytest.raises(DataError) as e:
        validate_dataset(messy_dir, min_image_size=16, min_images=2)
    msg = str(e.value)
    assert "only 1 usable image," in msg and "fewer than the 2 needed" in msg
    for name in ("corrupt.png", "truncated.png", "nocaption.png", "emptycaption.png", "tiny.png"):
        assert name in msg
    assert "fix or caption" in msg


def test_empty_and_missing_folders(tmp_path):
    with pytest.raises(DataError, match="holds no images"):
        validate_dataset(tmp_path, min_images=2)
    with pytest.raises(DataError, match="does not exist"):
        validate_dataset(tmp_path / "nowhere")


def test_metadata_jsonl_captions_subfolders_and_hidden_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".cache").mkdir()
    for name in ("b.png", "sub/a.JPG", ".cache/x.png", "c.png", "sub/b.png"):
        Image.new("RGB", (16, 16)).save(tmp_path / name, format="JPEG" if name.endswith("JPG") else "PNG")
    (tmp_path / "c.txt").write_text("from the txt file")
    (tmp_path / "b.txt").write_text("loses to metadata")
    lines = [{"file_name": "b.png", "text": "a black\nsquare"}, {"file_name": "sub/a.JPG", "text": "a photo"},
             {"file_name": "gone.png", "text": "nothing"},
             {"file_name": "sub\\b.png", "text": "listed on Windows"}]  # a backslash path names sub/b.png
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + "{broken\n")
    scan = scan_dataset(tmp_path)
    assert [c.file_name for c in scan.candidates] == ["b.png", "c.png", "sub/a.JPG", "sub/b.png"]
    result = validate_dataset(tmp_path)
    assert [(it.file_name, it.text) for it in result.items] == [
        ("b.png", "a black square"), ("c.png", "from the txt file"), ("sub/a.JPG", "a photo"),
        ("sub/b.png", "listed on Windows")]
    # Each item's id is the CRC-32 of its whole relative path: b.png and sub/b.png are two items.
    assert [it.id for it in result.items] == [zlib.crc32(it.file_name.encode()) for it in result.items]
    assert len({it.id for it in result.items}) == 4
    reasons = {s.file_name: s.reason for s in result.skipped}
    assert "no such image file" in reasons["gone.png"]
    assert "metadata.jsonl:5" in reasons


def test_a_metadata_jsonl_that_is_a_folder_is_refused(tmp_path):
    # It was taken for "no metadata.jsonl": the .txt captions were used without a word and its images trained on.
    for name in ("a", "b"):
        Image.new("RGB", (16, 16)).save(tmp_path / f"{name}.png")
        (tmp_path / f"{name}.txt").write_text("a caption")
    (tmp_path / "metadata.jsonl").mkdir()
    Image.new("RGB", (16, 16)).save(tmp_path / "metadata.jsonl" / "c.png")
    with pytest.raises(DataError, match=r"metadata.jsonl is a folder, not the captions file"):
        validate_dataset(tmp_path)


def _img(path, colour=(0, 0, 0)):
    Image.new("RGB", (16, 16), colour).save(path)


def test_a_byte_order_mark_is_not_caption_text(tmp_path):
    _img(tmp_path / "a.png")
    _img(tmp_path / "b.png", (9, 9, 9))
    (tmp_path / "a.txt").write_text("a cat", encoding="utf-8-sig")  # Notepad's "UTF-8 with BOM"
    (tmp_path / "metadata.jsonl").write_text(json.dumps({"file_name": "b.png", "text": "a dog"}) + "\n",
                                             encoding="utf-8-sig")
    result = validate_dataset(tmp_path)
    assert [(it.file_name, it.text) for it in result.items] == [("a.png", "a cat"), ("b.png", "a dog")]
    assert not result.skipped


def test_an_image_listed_twice_in_metadata_jsonl_with_different_captions_is_an_error(tmp_path):
    _img(tmp_path / "a.png")
    _img(tmp_path / "b.png", (9, 9, 9))
    rows = [{"file_name": "a.png", "text": "first"}, {"file_name": "b.png", "text": "b"},
            {"file_name": "./a.png", "text": "second"}, {"file_name": "b.png", "text": " b "}]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        validate_dataset(tmp_path)
    msg = str(e.value)
    assert "metadata.jsonl lists 1 image twice with different captions: a.png (lines 1 and 3)" in msg
    assert "keep one line per image" in msg and "b.png" not in msg.split("captions:")[1]  # same caption: harmless
    rows[2]["text"] = "first"
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [it.text for it in validate_dataset(tmp_path).items] == ["first", "b"]


def test_a_latin1_metadata_jsonl_is_one_clear_error(tmp_path, capsys):
    from rangefinder.cli.main import main

    _img(tmp_path / "a.png")
    _img(tmp_path / "b.png", (9, 9, 9))
    text = '{"file_name": "a.png", "text": "a cat"}\n{"file_name": "b.png", "text": "caf\u00e9 au lait"}\n'
    (tmp_path / "metadata.jsonl").write_bytes(text.encode("latin-1"))
    # Refused before anything is written: an --out beside the dataset, not in it (which split refuses).
    assert main(["split", str(tmp_path), "--out", str(tmp_path.with_name(tmp_path.name + "-split")), "--resolution",
                 "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{tmp_path / 'metadata.jsonl'} line 2 is not UTF-8 text (byte 0xe9" in err
    assert "save the file as UTF-8" in err and "iconv" in err


def test_captions_and_metadata_saved_as_utf16_by_windows_are_read_and_others_named_by_line_and_byte(tmp_path):
    """Windows PowerShell 5.1's `>` and Notepad's "Unicode" save UTF-16 with its byte-order mark: such a caption was
    skipped as "not UTF-8", and such a metadata.jsonl called Latin-1 (by the mark's 0xff), with `iconv -f cp1252` as
    the fix, which turns it into NULs between the letters. Read as the curve CSVs are; a Latin-1 caption names its
    line and byte, and UTF-32 (whose mark begins with UTF-16's) is not read as UTF-16."""
    for name in ("a", "b", "c", "d"):
        _img(tmp_path / f"{name}.png", (len(name), ord(name), 0))
    (tmp_path / "a.txt").write_bytes("un caf\u00e9, 中文 😀\r\n".encode("utf-16"))
    (tmp_path / "b.txt").write_bytes("a cat".encode("utf-16-be").join([b"\xfe\xff", b""]))
    (tmp_path / "c.txt").write_bytes("a dog\ncaf\u00e9".encode("latin-1"))
    (tmp_path / "d.txt").write_bytes("a cow".encode("utf-32"))
    scan = scan_dataset(tmp_path)
    assert {c.file_name: c.caption for c in scan.candidates} == {"a.png": "un café, 中文 😀\r\n", "b.png": "a cat"}
    assert {p.file_name: p.reason for p in scan.problems} == {
        "c.png": "caption file c.txt line 2 is not UTF-8 text (byte 0xe9; probably saved as Latin-1 or Windows-1252); "
                 "save it as UTF-8",
        "d.png": "caption file d.txt is UTF-32 text (it begins with UTF-32's byte-order mark); save it as UTF-8"}
    for name in ("c.txt", "d.txt", "a.txt", "b.txt"):
        (tmp_path / name).unlink()
    (tmp_path / "metadata.jsonl").write_bytes('{"file_name": "a.png", "text": "caf\u00e9"}\n'.encode("utf-16"))
    assert [(c.file_name, c.caption) for c in scan_dataset(tmp_path).candidates if c.caption] == [("a.png", "café")]
    # A UTF-32 one's fix converts from UTF-32: from cp1252 as a Latin-1 file's is, it too became NULs between letters.
    (tmp_path / "metadata.jsonl").write_bytes('{"file_name": "a.png", "text": "a cat"}\n'.encode("utf-32"))
    with pytest.raises(DataError, match=r"is UTF-32 text .*`iconv -f utf-32 -t utf-8 metadata\.jsonl > fixed\.jsonl`"):
        scan_dataset(tmp_path)


def test_symbolic_links_are_followed_once_and_loops_and_broken_links_listed(tmp_path):
    import os

    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    for i, name in enumerate(("a.png", "sub/b.png", "../elsewhere/c.png")):
        _img(data / name, (i, 0, 0))
        (data / name).with_suffix(".txt").write_text(f"image {i}")
    os.symlink(tmp_path / "elsewhere", data / "linked")  # a link to a folder outside: followed
    os.symlink(data, data / "sub" / "loop")  # back to an ancestor: would recurse forever
    os.symlink("sub", data / "again")  # a second way to a folder already walked
    os.symlink(data / "gone.png", data / "dangling.png")
    result = validate_dataset(data)
    assert [it.file_name for it in result.items] == ["a.png", "linked/c.png", "sub/b.png"]
    reasons = {s.file_name: s.reason for s in result.skipped}
    assert reasons["sub/loop"] == "symbolic link loop (points back to .); folder left out"
    assert reasons["again"].startswith(f"symbolic link to {data / 'sub'}, a folder already included")
    assert reasons["dangling.png"] == f"broken symbolic link (points to {data / 'gone.png'}, which does not exist)"
    assert len(result.skipped) == 3


def test_a_text_file_linked_from_outside_the_dataset_is_not_read_into_the_split(tmp_path):
    # Whoever can write the dataset can plant a caption that is a link to any file the step can read (a mounted
    # token, /proc/self/environ with the MLflow credentials): its text went into train.jsonl, which MLflow keeps,
    # and a linked multiply.txt's into the error message. A link within the dataset, and a linked folder's own
    # caption files (test above), are the dataset's and still read.
    import os

    from rangefinder.data.split import split_dataset

    secret = tmp_path / "environ"
    secret.write_text("MLFLOW_TRACKING_PASSWORD=hunter22-not-a-caption")
    data = tmp_path / "data"
    data.mkdir()
    _good(data, 3)
    shutil.copy(data / "good00.png", data / "planted.png")
    os.symlink(secret, data / "planted.txt")
    shutil.copy(data / "good01.png", data / "alias.png")
    os.symlink("good01.txt", data / "alias.txt")  # a link inside the dataset: its caption
    split = split_dataset(data, tmp_path / "split", min_image_size=8)
    reasons = {s["file_name"]: s["reason"] for s in split.summary["skipped"]}
    assert reasons["planted.png"] == (f"caption file planted.txt is a symbolic link to {secret}, outside the dataset "
                                      "folder, so it is not read; copy the file itself into the folder")
    assert {it.file_name: it.text for it in split.train + split.val}["alias.png"] == "a blue square number 1"
    written = "".join(p.read_text() for p in (tmp_path / "split").iterdir() if p.is_file())
    assert "hunter22" not in written

    (data / "planted.txt").unlink()
    for name in ("metadata.csv", "multiply.txt"):
        os.symlink(secret, data / name)
        with pytest.raises(DataError) as e:
            validate_dataset(data)
        assert f"is a symbolic link to {secret}, outside the dataset folder, so it is not read" in str(e.value)
        assert "hunter22" not in str(e.value)
        (data / name).unlink()


def test_captions_of_control_or_invisible_characters_are_empty_and_every_unused_file_is_reported(tmp_path):
    # Issue 36, class 4: a caption of escape and tab characters, or of zero-width spaces, carries no words: refused
    # like an empty one. A HEIC (no format rangefinder reads) and an animated WebP with captions, and a stray file,
    # each get a line.
    d = tmp_path / "data"
    d.mkdir()
    _good(d, 3)
    shutil.copy(d / "good00.png", d / "escapes.png")
    (d / "escapes.txt").write_text("\x1b\x07\t\x7f\n", encoding="utf-8")
    shutil.copy(d / "good00.png", d / "zerowidth.png")
    (d / "zerowidth.txt").write_text("\u200b \u2060\u200b", encoding="utf-8")
    shutil.copy(d / "good00.png", d / "bell.png")
    (d / "bell.txt").write_text("a red\x07 circle", encoding="utf-8")
    (d / "phone.heic").write_bytes(b"\0\0\0\x18ftypheic")
    (d / "phone.txt").write_text("a phone's photo")
    frames = [Image.new("RGB", (32, 32), (c, 0, 0)) for c in (0, 120, 240)]
    frames[0].save(d / "moving.webp", save_all=True, append_images=frames[1:], duration=100)
    (d / "moving.txt").write_text("a moving picture")
    (d / "README.md").write_text("where the images came from")
    result = validate_dataset(d)
    reasons = {s.file_name: s.reason for s in result.skipped}
    assert reasons["escapes.png"].startswith("empty caption") and reasons["zerowidth.png"].startswith("empty caption")
    assert reasons["phone.heic"].startswith("not used: .heic is not an image format")
    assert reasons["phone.txt"].startswith("not used: a caption file with no image")
    assert reasons["moving.webp"].startswith("animated (3 frames)")
    assert reasons["README.md"].startswith("not used: .md")
    assert {it.file_name: it.text for it in result.items}["bell.png"] == "a red circle"


def test_captions_in_caption_files_and_in_any_case_are_read_and_two_that_disagree_listed(tmp_path):
    # kohya's sd-scripts reads `.caption` by default (--caption_extension), and a Windows tool writes `.TXT`: both
    # images were listed as uncaptioned beside their caption. A caption in an extension not read gets a line naming
    # its image, and an image whose two caption files say different things is not trained on either one.
    for i, name in enumerate(("a.jpg", "b.png", "c.png", "d.png", "e.png")):
        _img(tmp_path / name, (i, 0, 0))
    (tmp_path / "a.caption").write_text("kohya's caption\n")
    (tmp_path / "b.TXT").write_text("an upper-case extension")
    (tmp_path / "c.txt").write_text("the same caption")
    (tmp_path / "c.caption").write_text("the same  caption\n")
    (tmp_path / "d.txt").write_text("one caption")
    (tmp_path / "d.caption").write_text("another caption")
    (tmp_path / "e.cap").write_text("a caption in kohya's --caption_extension .cap")
    (tmp_path / "f.caption").write_text("no image")
    result = validate_dataset(tmp_path)
    assert [(it.file_name, it.text) for it in result.items] == [
        ("a.jpg", "kohya's caption"), ("b.png", "an upper-case extension"), ("c.png", "the same caption")]
    reasons = {s.file_name: s.reason for s in result.skipped}
    assert reasons == {
        "d.png": "its caption files disagree (d.txt and d.caption); delete the one that is not its caption",
        "e.png": "missing caption (no e.txt or e.caption, and no metadata.jsonl or metadata.csv row)",
        "e.cap": "not used: captions are read from .txt or .caption files; if this holds e.png's caption, save it "
                 "as e.txt",
        "f.caption": "not used: a caption file with no image of the same name beside it",
    }


def test_a_captions_table_rangefinder_does_not_read_is_named_as_one(tmp_path):
    # kohya's fine-tuning layout keeps its captions in meta_cap.json (--in_json): the file was told "not an image
    # format ...; convert it to one of those", beside every image listed as uncaptioned.
    for i, name in enumerate(("a.png", "b.png")):
        _img(tmp_path / name, (i, 0, 0))
    (tmp_path / "meta_cap.json").write_text(json.dumps({"a": {"caption": "a black square"}, "b": {"caption": "red"}}))
    (tmp_path / "captions.parquet").write_bytes(b"PAR1")
    reasons = {s.file_name: s.reason for s in validate_dataset(tmp_path, min_images=0).skipped}
    assert reasons["a.png"].startswith("missing caption")
    for table in ("meta_cap.json", "captions.parquet"):
        assert reasons[table] == (
            "not used: captions are read from a .txt or .caption file beside each image, or from a metadata.jsonl or "
            "metadata.csv at the dataset folder's root (file_name and text per image); if this file holds the "
            "captions (kohya's meta_cap.json, a metadata.parquet), write them out as one of those")


def test_a_split_left_in_the_dataset_folder_is_named_as_a_split_not_a_captions_table(tmp_path):
    """A split's own files in the dataset (at its root, or in a folder of it; `split --out` there is refused now,
    but an older one or a copy leaves them) were each told they were a captions table to convert. A train.jsonl
    without a split's summary beside it may be anyone's table, and is still named as one."""
    from rangefinder.data.split import split_dataset

    data = tmp_path / "data"
    (data / "tables").mkdir(parents=True)
    for i, name in enumerate(("a.png", "b.png", "c.png")):
        _img(data / name, (40 * i, 0, 0))
        (data / name).with_suffix(".txt").write_text(f"square {i}")
    split_dataset(data, data)  # the library writes where it is told; `rangefinder split` refuses this --out
    shutil.copytree(data, data / "old-split", ignore=shutil.ignore_patterns("*.png", "*.txt", "tables"))
    (data / "tables" / "train.jsonl").write_text('{"file": "a.png", "caption": "a square"}\n')
    reasons = {s.file_name: s.reason for s in validate_dataset(data, min_images=0).skipped}
    split_files = ("train.jsonl", "val.jsonl", "stabilize.jsonl", "split.json")
    for folder in ("", "old-split/"):
        for name in split_files:
            assert reasons.pop(folder + name) == (
                "not used: a file of a split `rangefinder split` wrote into the dataset folder (train.jsonl, "
                "val.jsonl, stabilize.jsonl, split.json), not captions; move them out of the dataset folder")
    assert reasons == {"tables/train.jsonl": reasons["tables/train.jsonl"]}
    assert reasons["tables/train.jsonl"].startswith("not used: captions are read from a .txt or .caption file")


def test_the_image_formats_other_trainers_take_are_trained_and_only_true_animations_refused(tmp_path):
    # A kohya or EveryDream2 set of BMPs, OneTrainer's TIFFs, a still GIF and a camera's JPEG stored as MPO (a photo
    # with a preview after it) were each left out, the MPO as "animated"; an animated GIF and a multi-page TIFF are
    # still refused, naming what they are.
    colours = iter((10 * i, 0, 0) for i in range(20))
    for name in ("a.bmp", "b.gif", "c.tif", "d.TIFF", "e.jfif"):
        Image.new("RGB", (16, 16), next(colours)).save(tmp_path / name, format={".jfif": "JPEG"}.get(name[-5:]))
    photo, preview = Image.new("RGB", (16, 16), next(colours)), Image.new("RGB", (8, 8), next(colours))
    photo.save(tmp_path / "camera.jpg", format="MPO", save_all=True, append_images=[preview])
    frames = [Image.new("RGB", (16, 16), next(colours)) for _ in range(3)]
    frames[0].save(tmp_path / "moving.gif", save_all=True, append_images=frames[1:], duration=100)
    frames[0].save(tmp_path / "pages.tif", save_all=True, append_images=frames[1:])
    for f in list(tmp_path.iterdir()):
        f.with_suffix(".txt").write_text(f"a picture called {f.stem}")
    result = validate_dataset(tmp_path)
    assert [it.file_name for it in result.items] == ["a.bmp", "b.gif", "c.tif", "camera.jpg", "d.TIFF", "e.jfif"]
    assert {s.file_name: s.reason.split(":")[0] for s in result.skipped} == {
        "moving.gif": "animated (3 frames)", "pages.tif": "multi-page (3 frames)"}


def test_a_metadata_csv_is_read_as_metadata_jsonl_is(tmp_path):
    # Hugging Face's imagefolder takes a metadata.csv as well: it was listed as "not an image format" and every image
    # trained on its .txt caption, or was skipped as uncaptioned. Excel's UTF-8 CSV starts with a byte-order mark.
    for i, name in enumerate(("a.png", "b.png", "sub/c.png")):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        _img(tmp_path / name, (i, 0, 0))
    (tmp_path / "a.txt").write_text("loses to metadata.csv")
    rows = 'file_name,text,source\na.png,"a red square, small",web\nsub/c.png,"two\nlines",scan\n,orphan,x\n' \
           "gone.png,nothing,x\n"
    (tmp_path / "metadata.csv").write_text(rows, encoding="utf-8-sig")
    result = validate_dataset(tmp_path)
    assert [(it.file_name, it.text) for it in result.items] == [("a.png", "a red square, small"),
                                                                  ("sub/c.png", "two lines")]
    assert {s.file_name: s.reason for s in result.skipped} == {
        "b.png": "missing caption (no b.txt or b.caption, and no metadata.jsonl or metadata.csv row)",
        "metadata.csv:5": "no file_name; row ignored",
        "gone.png": "listed in metadata.csv but no such image file"}


@pytest.mark.parametrize("files, expected", [
    ({"metadata.jsonl": '{"file_name": "a.png", "caption": "a cat"}\n{"file_name": "b.png", "caption": "a dog"}\n'},
     "metadata.jsonl has no text field (its fields: caption, file_name), where rangefinder reads each image's caption; "
     "rename the field that holds it to text on every line, e.g. `sed -i 's/\"caption\":/\"text\":/' metadata.jsonl`"),
    ({"metadata.csv": "file_name,prompt,seed\na.png,a cat,1\nb.png,a dog,2\n"},
     "metadata.csv has no text column (its columns: file_name, prompt, seed), where rangefinder reads each image's "
     "caption; rename the column that holds it to text in its header line"),
    ({"metadata.csv": "image,text\na.png,a cat\n"},
     "metadata.csv has no file_name column (its columns: image, text), where rangefinder reads each image's path; "
     "rename the column that holds it to file_name in its header line"),
    ({"metadata.csv": "file_name,text\na.png,a cat\n", "metadata.jsonl": '{"file_name": "b.png", "text": "a dog"}\n'},
     "holds both metadata.jsonl and metadata.csv; keep one captions file, with the other's rows moved into it"),
    ({"train/metadata.jsonl": '{"file_name": "c.png", "text": "a bird"}\n'},
     ": train/metadata.jsonl is not read, captions being read from a metadata.jsonl or metadata.csv at the root only; "
     "pass the folder of the split to train on as the dataset folder (another split's as --val-dir)"),
], ids=["jsonl-caption-field", "csv-prompt-column", "csv-image-column", "jsonl-and-csv", "split-subfolder"])
def test_a_metadata_file_rangefinder_would_misread_is_one_clear_error(tmp_path, capsys, files, expected):
    # A caption column not named text (diffusers' --caption_column), two captions files, or an imagefolder split's
    # file in a subfolder: each image was skipped as having an "empty caption", or trained on a .txt caption
    # instead, or (a subfolder's) listed as "not an image format" among many lines.
    from rangefinder.cli.main import main

    (tmp_path / "train").mkdir()
    for name in ("a.png", "b.png", "train/c.png"):
        _img(tmp_path / name, (len(name), 0, 0))
        (tmp_path / name).with_suffix(".txt").write_text("a caption the metadata file would replace")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    # Refused before anything is written: an --out beside the dataset, not in it (which split refuses).
    assert main(["split", str(tmp_path), "--out", str(tmp_path.with_name(tmp_path.name + "-split")), "--resolution",
                 "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert expected in err


def _lay_out(data: Path, layout: dict[str, str]) -> Path:
    """A dataset folder of `layout`: each .png a distinct image with its text as its .txt caption, other files the
    text itself."""
    for i, (name, text) in enumerate(layout.items()):
        path = data / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".png"):
            _img(path, (i, 0, 0))
            path = path.with_suffix(".txt")
        path.write_text(text)
    return data


@pytest.mark.parametrize("folder, layout, expected", [
    # kohya_ss's GUI layout, passed whole: the reg/ images trained as the subject's.
    ("data", {"img/10_sks dog/a.png": "sks dog", "img/10_sks dog/b.png": "sks dog", "reg/1_dog/c.png": "a dog"},
     "data: reg is named as a folder of regularization (prior-preservation) images, kohya's --reg_data_dir or "
     "diffusers' --class_data_dir, and rangefinder trains no prior preservation, so they would train as the "
     "subject; pass the subject's folder alone (e.g. {root}/img), or rename reg if its images are the subject's"),
    # EveryDream2's multiply.txt.
    ("data", {"sub/a.png": "a", "sub/b.png": "b", "sub/multiply.txt": "2"},
     "data: sub/multiply.txt is EveryDream2's repeat count for the images beside it ('2'), and rangefinder trains "
     "each image once an epoch and reads no setting of a folder's own; delete it and multiply training.epochs by it"),
], ids=["kohya_ss-reg-folder", "everydream2-multiply"])
def test_another_trainers_repeats_or_regularization_folder_is_one_clear_error(tmp_path, capsys, folder, layout,
                                                                               expected):
    from rangefinder.cli.main import main

    data = _lay_out(tmp_path / folder, layout)
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--resolution", "16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert expected.format(root=data) in err


@pytest.mark.parametrize("folder, layout, expected", [
    # kohya's train_data_dir: each image trains once an epoch, not 10 times; said, not silent.
    ("data", {"10_sks dog/a.png": "sks dog", "10_sks dog/b.png": "sks dog", "1_style/c.png": "a style"},
     "data: 10_sks dog is named as kohya sd-scripts' repeat folders (<repeats>_<caption>: 10 repeats of \"sks dog\"), "
     "which rangefinder does not read: each image trains once an epoch and the length is measured; to keep folders' "
     "relative weights, copy a folder's images as often as its repeats"),
    # One concept's folder passed itself; a name such as "2023_trip" reads the same, so it is a warning, not a refusal.
    ("2023_trip", {"a.png": "a beach", "b.png": "a cat"},
     "2023_trip: 2023_trip is named as kohya sd-scripts' repeat folders (<repeats>_<caption>: 2023 repeats of "
     "\"trip\")"),
], ids=["kohya-repeat-folders", "numbered-folder-passed-itself"])
def test_a_folder_named_as_kohyas_repeats_trains_once_an_epoch_with_one_warning(tmp_path, capsys, folder, layout,
                                                                                 expected):
    from rangefinder.cli.main import main
    from rangefinder.config import RangefinderConfig
    from rangefinder.formats.text import markdown_text
    from rangefinder.steps.prepare_dataset import run_prepare_dataset

    data = _lay_out(tmp_path / folder, layout)
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--resolution", "16", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("rangefinder: warning: ") and expected in err
    assert json.loads(out)["train_images"] + json.loads(out)["val_images"] == len(layout)
    assert json.loads((tmp_path / "s" / "split.json").read_text())["notes"] == [err.removeprefix(
        "rangefinder: warning: ").strip()]
    # The pipeline's step says it too, in its log and its report.
    cfg = RangefinderConfig.model_validate({"data": {"dataset_dir": str(data), "resolution": 16}})
    run_prepare_dataset(cfg, out_dir=tmp_path / "p", report_path=tmp_path / "report.md")
    assert expected in capsys.readouterr().err
    report = (tmp_path / "report.md").read_text()
    assert f"- not read: {markdown_text(f'dataset folder {tmp_path}/{expected}')}" in report


def test_a_layout_other_trainers_read_as_training_once_an_epoch_is_trained(tmp_path):
    # kohya's "1_" folders (one repeat), numbered folders that read as one, and EveryDream2's multiply.txt of 1
    # train as they are; an image kohya would caption by its folder's name is listed saying so.
    for i, name in enumerate(("1_sks dog/a.png", "01_portraits/b.png", "sub/c.png", "1_sks dog/uncaptioned.png")):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        _img(tmp_path / name, (i, 0, 0))
        if "uncaptioned" not in name:
            (tmp_path / name).with_suffix(".txt").write_text(f"image {i}")
    (tmp_path / "sub" / "multiply.txt").write_text("1.0\n")
    result = validate_dataset(tmp_path)
    assert [it.file_name for it in result.items] == ["01_portraits/b.png", "1_sks dog/a.png", "sub/c.png"]
    assert {s.file_name: s.reason for s in result.skipped} == {
        "1_sks dog/uncaptioned.png": "missing caption (no 1_sks dog/uncaptioned.txt or 1_sks dog/uncaptioned.caption, "
                                     "and no metadata.jsonl or metadata.csv row; kohya's caption from its folder's "
                                     "name, \"sks dog\", is not read)",
        "sub/multiply.txt": "not used: EveryDream2's repeat count of 1, which is what rangefinder does"}


def test_onetrainers_masks_and_conditioning_images_are_listed_not_trained(tmp_path):
    # OneTrainer keeps a mask (x-masklabel.png) and a conditioning image (x-condlabel.png) beside each image:
    # textual inversion, which needs no caption, trained them as images of the concept.
    for i, name in enumerate(("a.png", "a-masklabel.png", "b.jpg", "b-condlabel.png", "c-masklabel.png")):
        _img(tmp_path / name, (i, 0, 0))
    (tmp_path / "a.txt").write_text("a photo of a <tok>")
    result = validate_dataset(tmp_path, captionless=True)
    assert [it.file_name for it in result.items] == ["a.png", "b.jpg"]
    assert {s.file_name: s.reason for s in result.skipped} == {
        "a-masklabel.png": "not used: OneTrainer's mask for masked training of a.png; rangefinder trains on the whole "
                           "image alone",
        "b-condlabel.png": "not used: OneTrainer's conditioning image of b.jpg; rangefinder trains on the whole image "
                           "alone",
        "c-masklabel.png": "not used: OneTrainer's mask for masked training of c; rangefinder trains on the whole "
                           "image alone"}
