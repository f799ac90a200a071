"""The dataset folder contract: images with captions, found in a fixed order.

A dataset is a folder of images (png, jpg, jpeg, webp, bmp, gif, tif, tiff, jfif, any case, in subfolders too; not
an animation) each with a caption in a sibling `.txt` or `.caption` file of the same stem (any case), the conventions
of EveryDream2, OneTrainer and kohya's sd-scripts (whose `--caption_extension` defaults to `.caption`); an image with
both, saying different things, is skipped and listed. A file of another kind beside an image is listed as not used.
A `metadata.jsonl` (one `{"file_name": ..., "text": ...}` per line) or a `metadata.csv` (a header line, then
`file_name,text` rows) at the root, Hugging Face's imagefolder conventions, is also accepted; its captions win over
caption files. One without a `text` field (a caption column of another name, which diffusers reads with
`--caption_column`), both at once, or one in a subfolder (an imagefolder split's) is refused, naming the fix. Hidden
files and folders (names starting with ".") are ignored.

Every image trains once an epoch, and nothing about it is read from its folder's name. So a layout that tells another
trainer to add images or weight them is refused with the conversion, rather than trained otherwise without a word: a
folder named as regularization images (`reg`, `regularization_images`, `class_images`), and EveryDream2's
`multiply.txt` of other than 1. A folder (the dataset's own included) named as kohya's repeat folders,
`<repeats>_<caption>` with repeats other than 1 ("10_sks dog"), trains once an epoch with a warning naming it
(`Scan.notes`): a name such as "2023_trip" reads the same, and no setting of the run depends on it, the length being
measured. OneTrainer's masks and conditioning images (`x-masklabel.png`,
`x-condlabel.png`) are listed as not used, not trained as images: rangefinder trains on the whole image alone.

Items are listed sorted by their POSIX path relative to the root, so the order, and everything seeded from it, is the
same on every machine and file system.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import unicodedata
import zlib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import Optional

from rangefinder.errors import DataError
from rangefinder.formats.text import NotUtf8, decode_utf8

# What kohya's sd-scripts (bmp), EveryDream2 (bmp, jfif) and OneTrainer (bmp, tif, tiff) take besides the first four,
# and GIF, which Hugging Face's imagefolder takes. Any frame count is found here; validate.py refuses an animation.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".jfif")
# An image's caption beside it: `.txt` (EveryDream2, OneTrainer, kohya_ss's GUI) or `.caption` (kohya sd-scripts'
# default --caption_extension; EveryDream2 reads both). The first is the one named in messages.
CAPTION_EXTENSIONS = (".txt", ".caption")
# Captions listed at the root, as Hugging Face's imagefolder reads them: one row per image, its path relative to the
# root in `file_name`, its caption in `text` (the column diffusers' train_text_to_image reads unless told another).
METADATA_FILES = ("metadata.jsonl", "metadata.csv")
# Tables other trainers keep captions in (kohya sd-scripts' fine-tuning metadata, meta_cap.json; Hugging Face's
# metadata.parquet), named in the line on such a file that is not one of METADATA_FILES at the root.
CAPTION_TABLES = (".json", ".jsonl", ".csv", ".tsv", ".parquet")
CAPTION_FIELD = "text"
# What `rangefinder split` writes (data/split.py, which imports this module): a manifest per subset, `<subset>.jsonl`,
# and the summary, written last. Such files left in a dataset folder are named as a split's, not as a captions table.
SPLIT_SUBSETS = ("train", "val", "stabilize")
SPLIT_SUMMARY = "split.json"
# Other trainers' ways to weight or add images that a folder's layout carries, which rangefinder does not read: a
# dataset laid out so is refused (`_refuse_layout_not_read`) or warned of (`repeat_folder_notes`), so that none trains
# as something else without a word.
# kohya sd-scripts' "<repeats>_<caption>" folders ("10_sks dog": each image 10 times an epoch, captioned "sks dog"
# where it has no caption file; library/train_util.py, DreamBoothDataset).
KOHYA_FOLDER = re.compile(r"^(\d+)_(.+)$")
# Prior-preservation images: kohya_ss's GUI lays out img/ and reg/ (--reg_data_dir), diffusers' DreamBooth examples a
# folder of class images (--class_data_dir).
REGULARIZATION_FOLDER = re.compile(r"^(reg|regulari[sz]ation)([ _-]?(images?|imgs?|data))?$"
                                   r"|^class[ _-]?(images?|imgs?|data)$", re.IGNORECASE)
# EveryDream2's repeat count for the images of its folder (data/dataset.py, `multiply`).
MULTIPLY_FILE = "multiply.txt"
# OneTrainer's files beside an image, named after it, that are no training image of their own (its image lister
# leaves them out): a mask for masked training and a conditioning image. What each is, for the line that lists it.
ONETRAINER_LABELS = {"-masklabel.png": "mask for masked training", "-condlabel.png": "conditioning image"}


@dataclass(frozen=True)
class Item:
    """One training or validation example. `file_name` is relative to the dataset root, POSIX style."""

    id: int
    file_name: str
    text: str
    # The upright image's (width, height) in px, recorded by the split; the aspect-ratio bucket follows from it
    # (data/buckets.py). None in splits written before it was recorded: the engine then reads the file's header.
    size: Optional[tuple[int, int]] = None
    # sha256 of the file's bytes when it was split: training checks the file is still the one that was split, and
    # identical images are kept in one subset. None in manifests written before it was recorded.
    sha256: Optional[str] = None

    def to_json(self) -> dict:
        out: dict = {"id": self.id, "file_name": self.file_name, "text": self.text}
        if self.size is not None:
            out["size"] = list(self.size)
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Item:
        size, sha = obj.get("size"), obj.get("sha256")
        return cls(id=int(obj["id"]), file_name=str(obj["file_name"]), text=str(obj["text"]),
                   size=None if size is None else (int(size[0]), int(size[1])),
                   sha256=None if sha is None else str(sha))


def item_id(file_name: str) -> int:
    """Stable integer id of an item: CRC-32 of its POSIX relative path (validation noise is seeded by it)."""
    return zlib.crc32(str(PurePosixPath(file_name)).encode("utf-8"))


class SkipKind(Enum):
    """Each kind of file the split leaves out, as the summary of them names it (data.split.SKIPPED_KINDS: the skipped
    files of prepare-dataset's output and report): every skip carries one, so a new kind reaches that summary."""

    IMAGE = "unreadable, corrupt, animated or too small images"  # validate.py
    CAPTION = "images without a usable caption (none, empty, not UTF-8, or two that disagree)"
    NOT_TRAINED = "files not trained on (neither an image nor its caption, a mask, a split's manifests)"
    LINK = "broken, looping or repeated links and folders that cannot be read"
    METADATA = "metadata rows naming no image"
    VAL_COPY = "training images identical to a split.val_dir image"  # split.py


@dataclass(frozen=True)
class Skipped:
    """A file left out, with why (one phrase naming the fix) and its kind."""

    file_name: str
    reason: str
    kind: SkipKind

    def __str__(self) -> str:
        return f"{self.file_name}: {self.reason}"

    def to_json(self) -> dict:
        return {"file_name": self.file_name, "reason": self.reason, "kind": self.kind.name.lower()}


@dataclass(frozen=True)
class Candidate:
    """An image found in the folder, with its caption as far as the folder tells (None: none found)."""

    file_name: str  # POSIX, relative to the root
    caption: Optional[str]
    caption_source: Optional[str]  # "metadata.jsonl", "metadata.csv" or the caption file's relative path


@dataclass
class Scan:
    root: Path
    candidates: list[Candidate]
    # Problems found while scanning, before any image is opened.
    problems: list[Skipped]
    # What the layout says that rangefinder does not read, each a warning's line (kohya's repeat folders).
    notes: list[str] = field(default_factory=list)


def _read_metadata(root: Path) -> tuple[dict[str, str], list[Skipped], Optional[str]]:
    """Captions from the root's `metadata.jsonl` or `metadata.csv`, with the problems found and the file's name (None:
    neither is there). A file that is not UTF-8, one without a file_name or text field at all, both files at once,
    or one image listed twice with different captions stops here with a DataError (every caption in it is suspect);
    a row without a file name is listed."""
    captions: dict[str, str] = {}
    first_line: dict[str, int] = {}
    conflicts: list[str] = []
    problems: list[Skipped] = []
    for name in METADATA_FILES:
        if (root / name).is_dir():
            # Read as "no metadata.jsonl" it left every caption to .txt files without a word, and its contents were
            # walked as images of the dataset.
            raise DataError(f"{root / name} is a folder, not the captions file; remove or rename it, or put the "
                            "captions (one row with file_name and text per image) in a file of that name")
    present = [name for name in METADATA_FILES if (root / name).is_file()]
    if not present:
        return captions, problems, None
    if len(present) > 1:
        raise DataError(f"dataset folder {root} holds both {' and '.join(present)}; keep one captions file, with "
                        "the other's rows moved into it")
    name = present[0]
    path = root / name
    outside = _linked_outside(path, root)
    if outside:
        raise DataError(f"{path} is {outside}; copy the file itself into the dataset folder")
    try:
        content = decode_utf8(path.read_bytes())
    except NotUtf8 as e:
        how = (f", e.g. `iconv -f {e.encoding} -t utf-8 {name} > fixed{path.suffix}` then rename "
               f"fixed{path.suffix} to {name}") if e.encoding else ""
        raise DataError(f"{path} {e}; save the file as UTF-8{how}") from None
    rows, fields = _csv_rows(path, content) if name.endswith(".csv") else _jsonl_rows(content, problems)
    for column, holds in (("file_name", "path"), (CAPTION_FIELD, "caption")):
        if rows and column not in fields:
            raise DataError(_missing_field(path, column, holds, fields))
    for lineno, row in rows:
        file_name, text = row.get("file_name"), row.get(CAPTION_FIELD)
        if file_name is None or not str(file_name).strip():
            problems.append(Skipped(f"{name}:{lineno}", "no file_name; row ignored", SkipKind.METADATA))
            continue
        rel = str(PurePosixPath(str(file_name).replace("\\", "/")))
        text = "" if text is None else str(text)
        if rel in captions:
            if clean_caption(captions[rel]) != clean_caption(text):  # the same caption twice is harmless
                conflicts.append(f"{rel} (lines {first_line[rel]} and {lineno})")
            continue
        captions[rel], first_line[rel] = text, lineno
    if conflicts:
        shown = "; ".join(conflicts[:5]) + (f"; and {len(conflicts) - 5} more" if len(conflicts) > 5 else "")
        raise DataError(
            f"{path} lists {len(conflicts)} image{'s' if len(conflicts) != 1 else ''} twice with different captions: "
            f"{shown}; keep one line per image (to train an image under two captions, copy it under another name)"
        )
    return captions, problems, name


def _jsonl_rows(content: str, problems: list[Skipped]) -> tuple[list[tuple[int, dict]], set[str]]:
    """`metadata.jsonl`'s objects with their line numbers, and every field any of them has; a line that is not a JSON
    object is listed in `problems`."""
    rows: list[tuple[int, dict]] = []
    for lineno, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            problems.append(Skipped(f"{METADATA_FILES[0]}:{lineno}", "not a JSON object with file_name and text; "
                                    "line ignored", SkipKind.METADATA))
            continue
        rows.append((lineno, obj))
    return rows, {field for _, obj in rows for field in obj}


def _csv_rows(path: Path, content: str) -> tuple[list[tuple[int, dict]], set[str]]:
    """`metadata.csv`'s rows by its header line, with the line each ends on, and the header's columns."""
    reader = csv.DictReader(io.StringIO(content, newline=""))
    try:
        rows = [(reader.line_num, {k: v for k, v in row.items() if k is not None}) for row in reader]
    except csv.Error as e:
        raise DataError(f"{path} line {reader.line_num} is not CSV ({e}); save it as comma-separated values with a "
                        "header line of file_name,text") from None
    return rows, set(reader.fieldnames or ())


def _missing_field(path: Path, field: str, holds: str, fields: set[str]) -> str:
    """The one line for a metadata file none of whose rows has `field` (Hugging Face's imagefolder names a caption
    column freely, and diffusers reads the one --caption_column names, `text` unless told)."""
    kind = "column" if path.suffix == ".csv" else "field"
    others = sorted(fields - {"file_name", CAPTION_FIELD})
    where = "in its header line" if kind == "column" else "on every line"
    example = ""
    if kind == "field" and len(others) == 1:
        example = f", e.g. `sed -i 's/\"{others[0]}\":/\"{field}\":/' {path.name}`"
    return (f"{path} has no {field} {kind} (its {kind}s: {', '.join(sorted(fields)) or 'none'}), where rangefinder "
            f"reads each image's {holds}; rename the {kind} that holds it to {field} {where}{example}")


def _walk_images(root: Path, exclude: Optional[Path], problems: list[Skipped],
                 texts: list[PurePosixPath], others: list[PurePosixPath],
                 repeats: Optional[dict[PurePosixPath, PurePosixPath]] = None) -> list[PurePosixPath]:
    """Image files under `root`, following symbolic links to folders once each; never recursing forever.

    Real folders are walked first, links to folders after, so a folder reached both ways is listed under its real
    path. A link to a folder already walked (a loop back to an ancestor, or a second way to the same folder) and a
    broken link to an image are listed in `problems`, not silently left out. Caption files are collected in `texts`,
    and every other file but the root's metadata file in `others`, for the caller to list. `os.scandir`, not
    `Path.rglob`: one stat per entry, which matters at 100,000 images. `repeats`, when given, gets each link left out
    that way, mapped to the folder it reaches as first walked (both relative to `root`).
    """
    images: list[PurePosixPath] = []
    visited: dict[tuple[int, int], PurePosixPath] = {}  # each folder walked, by device and inode: where
    links: list[tuple[PurePosixPath, str]] = []  # links to folders, walked after the real tree

    def walk(folder: str, rel: PurePosixPath) -> None:
        st = os.stat(folder)
        first = visited.get((st.st_dev, st.st_ino))
        if first is not None:
            # A real folder of a folder a link leads to, walked before by a link straight to it (`a` -> ext/sub,
            # then `b` -> ext): its images were counted under both ways.
            problems.append(Skipped(str(rel), f"folder already included as {first} (by way of a symbolic link); "
                                              "left out so its images count once", SkipKind.LINK))
            if repeats is not None:
                repeats[rel] = first
            return
        visited[(st.st_dev, st.st_ino)] = rel
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as e:
            problems.append(Skipped(str(rel), f"folder cannot be read ({e.strerror}); left out", SkipKind.LINK))
            return
        for entry in entries:
            if entry.name.startswith("."):
                continue
            child = rel / entry.name if str(rel) != "." else PurePosixPath(entry.name)
            try:
                is_dir = entry.is_dir()  # follows links
                is_file = not is_dir and entry.is_file()
            except OSError:
                is_dir = is_file = False
            if is_dir:
                if exclude is not None and os.path.realpath(entry.path) == str(exclude):
                    continue
                if entry.is_symlink():
                    links.append((child, entry.path))
                else:
                    walk(entry.path, child)
            elif is_file:
                ext = os.path.splitext(entry.name)[1].lower()
                if ext in IMAGE_EXTENSIONS:
                    images.append(child)
                elif ext in CAPTION_EXTENSIONS:
                    texts.append(child)
                elif not (str(rel) == "." and entry.name in METADATA_FILES):
                    others.append(child)
            elif entry.is_symlink() and os.path.splitext(entry.name)[1].lower() in IMAGE_EXTENSIONS:
                target = os.readlink(entry.path)
                problems.append(Skipped(str(child), f"broken symbolic link (points to {target}, which does not "
                                                    "exist)", SkipKind.LINK))

    walk(str(root), PurePosixPath("."))
    while links:
        rel, path = links.pop(0)
        st = os.stat(path)
        if (st.st_dev, st.st_ino) in visited:
            if repeats is not None:
                repeats[rel] = visited[(st.st_dev, st.st_ino)]
            target = Path(os.path.realpath(path))
            here = Path(os.path.realpath(os.path.dirname(path)))
            if target == here or target in here.parents:
                where = target.relative_to(root).as_posix() if target.is_relative_to(root) else str(target)
                problems.append(Skipped(str(rel), f"symbolic link loop (points back to {where or '.'}); folder left "
                                                  "out", SkipKind.LINK))
            else:
                problems.append(Skipped(str(rel), f"symbolic link to {target}, a folder already included; left out "
                                                  "so its images count once", SkipKind.LINK))
            continue
        walk(path, rel)
    images.sort(key=str)
    return images


def repeated_folder_links(root: Path) -> dict[PurePosixPath, PurePosixPath]:
    """The links under `root` that `scan_dataset` leaves out as a second way to a folder it already walked (a loop
    back to an ancestor, two links to one folder inside or outside `root`), each mapped to that folder's path as the
    scan first walked it, both relative to `root`: what a copy of the dataset has to make again as links, so that
    the copy's scan counts each image once, as the scan in place does."""
    repeats: dict[PurePosixPath, PurePosixPath] = {}
    _walk_images(Path(os.path.realpath(root)), None, [], [], [], repeats)
    return repeats


def scan_dataset(root: str | Path, exclude: Optional[Path] = None) -> Scan:
    """List the images under `root` (sorted by relative path) with their captions; opens no image.

    `exclude` is a folder inside `root` to leave out (a hand-made validation folder kept inside the dataset).
    """
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise DataError(f"dataset folder {root} does not exist or is not a folder; pass the folder holding the images")
    exclude = exclude.resolve() if exclude is not None else None
    meta, problems, meta_file = _read_metadata(root)
    texts: list[PurePosixPath] = []
    others: list[PurePosixPath] = []
    images = _walk_images(root, exclude, problems, texts, others)
    labels = [r for r in images if r.name.lower().endswith(tuple(ONETRAINER_LABELS))]
    images = [r for r in images if not r.name.lower().endswith(tuple(ONETRAINER_LABELS))]
    nested = [o for o in others if o.name in METADATA_FILES]
    if nested:
        # Hugging Face's imagefolder reads one in any folder (a split's train/ and test/ each hold one): read from
        # the root, both splits' images would train; left unread, its captions were lost with one line among many.
        named = " and ".join(map(str, nested[:3])) + (f" and {len(nested) - 3} more" if len(nested) > 3 else "")
        raise DataError(f"dataset folder {root}: {named} {'is' if len(nested) == 1 else 'are'} not read, captions "
                        f"being read from a {' or '.join(METADATA_FILES)} at the root only; pass the folder of the "
                        "split to train on as the dataset folder (another split's as --val-dir), or move the rows "
                        "into one at the root with their folder before each file_name")
    _refuse_layout_not_read(root, images, texts)
    found = {str(r) for r in images}
    image_of: dict[PurePosixPath, PurePosixPath] = {}  # each stem's first image, named in lines on files beside it
    for r in images:
        image_of.setdefault(r.with_suffix(""), r)
    captions_of: dict[PurePosixPath, list[PurePosixPath]] = {}
    for t in texts:
        captions_of.setdefault(t.with_suffix(""), []).append(t)
    problems += [Skipped(str(t), "not used: EveryDream2's repeat count of 1, which is what rangefinder does"
                         if t.name == MULTIPLY_FILE else "not used: a caption file with no image of the same name "
                         "beside it", SkipKind.NOT_TRAINED)
                 for t in texts if t.with_suffix("") not in image_of]
    # A split written into the dataset (by a `split --out` it now refuses, or copied in): its manifests were each told
    # they were a captions table to convert.
    splits = {o.parent for o in others if o.name == SPLIT_SUMMARY}
    split_names = [*(f"{name}.jsonl" for name in SPLIT_SUBSETS), SPLIT_SUMMARY]
    left = [o for o in others if o.parent in splits and o.name in split_names]
    problems += [Skipped(str(o), _not_used(o, image_of.get(o.with_suffix(""))), SkipKind.NOT_TRAINED)
                 for o in others if o not in left]
    problems += [Skipped(str(o), f"not used: a file of a split `rangefinder split` wrote into the dataset folder "
                                 f"({', '.join(split_names)}), not captions; move them out of the dataset folder",
                         SkipKind.NOT_TRAINED)
                 for o in left]
    for label in labels:
        # Trained as images they taught the model black and white silhouettes (textual inversion, which needs no
        # caption, kept them); listed as uncaptioned, they read as images the user forgot to caption.
        suffix = next(x for x in ONETRAINER_LABELS if label.name.lower().endswith(x))
        of = image_of.get(label.with_name(label.name[: -len(suffix)]), label.name[: -len(suffix)])
        problems.append(Skipped(str(label), f"not used: OneTrainer's {ONETRAINER_LABELS[suffix]} of {of}; "
                                            "rangefinder trains on the whole image alone", SkipKind.NOT_TRAINED))

    candidates = []
    for rel in images:
        name = str(rel)
        if name in meta:
            candidates.append(Candidate(name, meta[name], meta_file))
            continue
        read: dict[str, str] = {}  # the caption files beside it, by relative path, with their text
        for cap in sorted(captions_of.get(rel.with_suffix(""), []), key=_caption_order):
            outside = _linked_outside(root / cap, root)
            if outside:
                problems.append(Skipped(name, f"caption file {cap} is {outside}; copy the file itself into the "
                                              "folder", SkipKind.CAPTION))
                break
            try:
                read[str(cap)] = decode_utf8((root / cap).read_bytes())  # a byte-order mark is not caption text
            except NotUtf8 as e:
                problems.append(Skipped(name, f"caption file {cap} {e}; save it as UTF-8", SkipKind.CAPTION))
                break
        else:
            if len({clean_caption(text) for text in read.values()}) > 1:
                # Which one the user means is anyone's guess: kohya reads one extension, EveryDream2 merges both.
                problems.append(Skipped(name, f"its caption files disagree ({' and '.join(read)}); delete the one "
                                              "that is not its caption", SkipKind.CAPTION))
            elif read:
                source, caption = next(iter(read.items()))
                candidates.append(Candidate(name, caption, source))
            else:
                candidates.append(Candidate(name, None, None))
    for name in sorted(set(meta) - found):
        problems.append(Skipped(name, f"listed in {meta_file} but no such image file", SkipKind.METADATA))
    return Scan(root=root, candidates=candidates, problems=problems, notes=repeat_folder_notes(root, images))


def check_out_outside_dataset(out: str | Path, dataset: str | Path, *, flag: str, setting: str,
                              outputs: str) -> None:
    """DataError when an output folder `out` (the command's `flag`) is the dataset folder (given as `setting`) or
    inside it: the next scan of the dataset walks the outputs as the dataset's own files. A local pipeline run's
    sample grids and MLflow's copies of them were trained on as images (textual inversion keeps images without
    captions); a split's manifests were listed as files of the dataset."""
    out, data = Path(out).expanduser().resolve(), Path(dataset).expanduser().resolve()
    if out == data or data in out.parents:
        where = "is the dataset folder" if out == data else f"is inside the dataset folder {data}"
        raise DataError(f"{flag} {out} {where} ({setting}), where the next run would read this one's outputs "
                        f"({outputs}) as files of the dataset; pass an {flag} outside it")


def kohya_folder(file_name: str) -> Optional[tuple[str, int, str]]:
    """The innermost folder above `file_name` named as kohya's repeat folders: (its path, repeats, caption); None."""
    parent = PurePosixPath(file_name).parent
    for folder in (parent, *parent.parents):
        m = KOHYA_FOLDER.match(folder.name)
        if m:
            return str(folder), int(m.group(1)), m.group(2)
    return None


def _refuse_layout_not_read(root: Path, images: list[PurePosixPath], texts: list[PurePosixPath]) -> None:
    """DataError where the folders add images or weight them in another trainer's way that rangefinder does not read:
    kohya's regularization folder, EveryDream2's multiply.txt. Trained on as they are, a kohya user's regularization
    images trained as the subject, an EveryDream2 user's weights were lost."""
    folders = {folder for rel in images for folder in rel.parents if str(folder) != "."}
    regularization = sorted(str(f) for f in folders if REGULARIZATION_FOLDER.match(f.name))
    if regularization:
        subject = sorted({rel.parts[0] for rel in images if len(rel.parts) > 1} - set(regularization))
        instead = f" (e.g. {root / subject[0]})" if subject else ""
        raise DataError(
            f"dataset folder {root}: {regularization[0]} is named as a folder of regularization (prior-preservation) "
            "images, kohya's --reg_data_dir or diffusers' --class_data_dir, and rangefinder trains no prior "
            f"preservation, so they would train as the subject; pass the subject's folder alone{instead}, or rename "
            f"{regularization[0]} if its images are the subject's"
        )
    stems = {rel.with_suffix("") for rel in images}
    for t in texts:
        if t.name != MULTIPLY_FILE or t.with_suffix("") in stems:  # not the caption of a multiply.png
            continue
        outside = _linked_outside(root / t, root)
        if outside:
            raise DataError(f"dataset folder {root}: {t} is {outside}; delete it (rangefinder trains each image once "
                            "an epoch and reads no repeat count)")
        value = (root / t).read_text(encoding="utf-8", errors="replace").strip()
        try:
            if float(value) == 1:
                continue
        except ValueError:
            pass
        raise DataError(
            f"dataset folder {root}: {t} is EveryDream2's repeat count for the images beside it ({value!r}), and "
            "rangefinder trains each image once an epoch and reads no setting of a folder's own; delete it and "
            "multiply training.epochs by it, or copy (or remove) that folder's images so that folders keep their "
            "weights"
        )


def repeat_folder_notes(root: Path, images: list[PurePosixPath]) -> list[str]:
    """A warning's line where folders are named as kohya sd-scripts' repeat folders with repeats other than 1: each
    image trains once an epoch here, so the folders' relative weights are not kept. A warning, not a refusal: a folder
    named "2023_trip" or "02_landscapes" reads the same, and the run's length is measured, not set by repeats."""
    # The dataset folder's own name too: a kohya user passes the concept's folder ("10_sks dog") as often as its
    # parent; the innermost name, as kohya reads only the folder the images are in.
    named = [kohya_folder(str(rel)) or kohya_folder(f"{root.name}/{rel.name}") for rel in images]
    repeated = sorted({kf for kf in named if kf is not None and kf[1] != 1})
    if not repeated:
        return []
    folder, repeats, caption = repeated[0]
    more = f" (and {len(repeated) - 1} more)" if len(repeated) > 1 else ""
    return [f"dataset folder {root}: {folder}{more} is named as kohya sd-scripts' repeat folders (<repeats>_<caption>: "
            f"{repeats} repeats of \"{caption}\"), which rangefinder does not read: each image trains once an epoch "
            "and the length is measured; to keep folders' relative weights, copy a folder's images as often as its "
            "repeats (and rename it, to silence this, if the number is no repeat count)"]


def _linked_outside(path: Path, root: Path) -> Optional[str]:
    """Where a text file of the dataset really is, said as "a symbolic link to X, outside the dataset folder", when
    it is a link to a file outside the (resolved) `root` and outside the folder the link lies in; None for the
    dataset's own files, a linked folder's included. What a caption or metadata file holds is copied into the
    split's manifests, which MLflow keeps, and a multiply.txt's into an error message: read through such a link, a
    file planted by whoever can write the dataset would carry any file the step can read there (a mounted token,
    /proc/self/environ with the MLflow credentials). Only text is held to it: an image is decoded, never copied."""
    if not os.path.islink(path):
        return None
    real = Path(os.path.realpath(path))
    if real.is_relative_to(root) or real.parent == Path(os.path.realpath(path.parent)):
        return None
    return f"a symbolic link to {real}, outside the dataset folder, so it is not read"


def _caption_order(path: PurePosixPath) -> tuple[int, str]:
    """`.txt` before `.caption` (CAPTION_EXTENSIONS' order), then by name: the caption a source line names."""
    return CAPTION_EXTENSIONS.index(path.suffix.lower()), str(path)


def _not_used(path: PurePosixPath, image: Optional[PurePosixPath]) -> str:
    """Why a file that is neither an image nor a caption file is left out, and what to do, in a few words."""
    from PIL import Image

    ext = path.suffix.lower()
    if image is not None and ext not in Image.registered_extensions():  # a picture of it is no caption
        # A caption in another extension (kohya's --caption_extension .cap, EveryDream2's .yaml): its image would
        # otherwise be listed as uncaptioned with no word on the file beside it.
        return (f"not used: captions are read from {' or '.join(CAPTION_EXTENSIONS)} files; if this holds {image}'s "
                f"caption, save it as {path.with_suffix(CAPTION_EXTENSIONS[0])}")
    if ext in CAPTION_TABLES:
        # Told to convert it to an image format, a kohya user's meta_cap.json (its fine-tuning captions, --in_json)
        # read as a file put there by mistake, beside every image listed as uncaptioned.
        return (f"not used: captions are read from a {' or '.join(CAPTION_EXTENSIONS)} file beside each image, or "
                f"from a {' or '.join(METADATA_FILES)} at the dataset folder's root (file_name and text per image); "
                "if this file holds the captions (kohya's meta_cap.json, a metadata.parquet), write them out as one "
                "of those")
    return (f"not used: {ext or 'a file without an extension'} is not an image format rangefinder trains on "
            f"({', '.join(IMAGE_EXTENSIONS)}); convert it to one of those or move it out")


def clean_caption(text: str) -> str:
    """Captions are one line: surrounding whitespace trimmed, inner runs of whitespace (newlines) made one space.

    Control characters (NUL, escape, ...; Unicode category Cc) and invisible format characters (a byte-order mark,
    zero-width spaces; Cf) count as whitespace: they carry no words for the text encoder, so a caption of nothing
    else is empty, and is refused like one.
    """
    return " ".join("".join(" " if unicodedata.category(c) in ("Cc", "Cf") else c for c in text).split())


def made_resolution(folder: str | Path) -> Optional[int]:
    """The image side a finished `make-dataset` folder was made at (the setting in its marker file,
    data.synthetic.MARKER); None for any other folder, or one whose marker cannot be read. Read here, not in
    data/synthetic.py, whose source is part of the tiny model's cache key."""
    from rangefinder.data.synthetic import MARKER

    try:
        value = json.loads((Path(folder).expanduser() / MARKER).read_text()).get("resolution")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
