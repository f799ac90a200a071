"""The dataset folder contract: images with captions, found in a fixed order.

A dataset is a folder of images (png, jpg, jpeg, webp, any case, in subfolders too) each with a caption in a sibling
`.txt` file of the same stem, the convention of EveryDream2 and kohya's sd-scripts. A `metadata.jsonl` at the root
with one `{"file_name": ..., "text": ...}` per line (Hugging Face's imagefolder convention) is also accepted; its
captions win over `.txt` files. Hidden files and folders (names starting with ".") are ignored.

Items are listed sorted by their POSIX path relative to the root, so the order, and everything seeded from it, is the
same on every machine and file system.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

from rangefinder.errors import DataError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
METADATA_FILE = "metadata.jsonl"


@dataclass(frozen=True)
class Item:
    """One training or validation example. `file_name` is relative to the dataset root, POSIX style."""

    id: int
    file_name: str
    text: str
    # The upright image's (width, height) in px, recorded by the split; the aspect-ratio bucket follows from it
    # (data/buckets.py). None in splits written before it was recorded: the engine then reads the file's header.
    size: Optional[tuple[int, int]] = None

    def to_json(self) -> dict:
        out: dict = {"id": self.id, "file_name": self.file_name, "text": self.text}
        if self.size is not None:
            out["size"] = list(self.size)
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Item:
        size = obj.get("size")
        return cls(id=int(obj["id"]), file_name=str(obj["file_name"]), text=str(obj["text"]),
                   size=None if size is None else (int(size[0]), int(size[1])))


def item_id(file_name: str) -> int:
    """Stable integer id of an item: CRC-32 of its POSIX relative path (validation noise is seeded by it)."""
    return zlib.crc32(str(PurePosixPath(file_name)).encode("utf-8"))


@dataclass(frozen=True)
class Candidate:
    """An image found in the folder, with its caption as far as the folder tells (None: none found)."""

    file_name: str  # POSIX, relative to the root
    caption: Optional[str]
    caption_source: Optional[str]  # "metadata.jsonl" or the .txt file's relative path


@dataclass
class Scan:
    root: Path
    candidates: list[Candidate]
    # Problems found while scanning, before any image is opened: (file_name, reason).
    problems: list[tuple[str, str]]


def _is_hidden(rel: PurePosixPath) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _read_metadata(root: Path) -> tuple[dict[str, str], list[tuple[str, str]]]:
    path = root / METADATA_FILE
    captions: dict[str, str] = {}
    problems: list[tuple[str, str]] = []
    if not path.is_file():
        return captions, problems
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            name, text = obj["file_name"], obj.get("text")
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            problems.append((f"{METADATA_FILE}:{lineno}", "not a JSON object with file_name and text; line ignored"))
            continue
        rel = str(PurePosixPath(str(name).replace("\\", "/")))
        captions[rel] = "" if text is None else str(text)
    return captions, problems


def scan_dataset(root: str | Path, exclude: Optional[Path] = None) -> Scan:
    """List the images under `root` (sorted by relative path) with their captions; opens no image.

    `exclude` is a folder inside `root` to leave out (a hand-made validation folder kept inside the dataset).
    """
    root = Path(root).expanduser().resolve()
    if not root.is_dir():
        raise DataError(f"dataset folder {root} does not exist or is not a folder; pass the folder holding the images")
    exclude = exclude.resolve() if exclude is not None else None
    meta, problems = _read_metadata(root)

    images: list[PurePosixPath] = []
    for p in root.rglob("*"):
        rel = PurePosixPath(p.relative_to(root).as_posix())
        if _is_hidden(rel) or not p.is_file() or p.suffix.lower() not in IMAGE_EXTENSIONS:
            continue
        if exclude is not None and (p.resolve() == exclude or exclude in p.resolve().parents):
            continue
        images.append(rel)
    images.sort(key=str)
    found = {str(r) for r in images}

    candidates = []
    for rel in images:
        name = str(rel)
        if name in meta:
            candidates.append(Candidate(name, meta[name], METADATA_FILE))
            continue
        txt = root / rel.with_suffix(".txt")
        if txt.is_file():
            try:
                caption: Optional[str] = txt.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                caption = None
                problems.append((name, f"caption file {rel.with_suffix('.txt')} is not UTF-8 text"))
                continue
            candidates.append(Candidate(name, caption, str(rel.with_suffix(".txt"))))
        else:
            candidates.append(Candidate(name, None, None))
    for name in sorted(set(meta) - found):
        problems.append((name, f"listed in {METADATA_FILE} but no such image file"))
    return Scan(root=root, candidates=candidates, problems=problems)


def clean_caption(text: str) -> str:
    """Captions are one line: surrounding whitespace trimmed, inner runs of whitespace (newlines) made one space."""
    return " ".join(text.split())
