"""The deterministic split: validation, training and the stabilize subset of training.

Items are sorted by relative path, then shuffled with a seeded generator that does not depend on the platform
(Python's `random.Random(seed).random()`, the one stream Python promises to keep stable, driving a Fisher-Yates
shuffle), so the same files and seed give the same split on any machine. `ceil(p*N)` items go to validation (at
least one, and at least one left for training); a hand-made validation folder replaces that draw. The stabilize
subset, `ceil(q * train)` of the training items, is measured like validation to give a smooth training loss.

Output folder (the contract the engine reads): `train.jsonl`, `val.jsonl`, `stabilize.jsonl`, one
`{"id", "file_name", "text", "size"}` per line with `file_name` relative to the dataset root and `size` the upright
image's [width, height], and `split.json`, a summary. With aspect-ratio buckets (data/buckets.py) each line also
has the image's `bucket` [width, height] and `crop` [left, top], and the summary a table of the buckets' sizes and
image counts; the engine buckets again from `size` with its own settings, by the same function.
Every file is written under a temporary name and renamed, `split.json` last: a split folder without it is unfinished.
`split.json` records the dataset root both absolute and relative to the split folder; `read_split` falls back to the
relative one when the absolute one is gone (the split and its data moved together).
"""

from __future__ import annotations

import json
import math
import os
import random
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from rangefinder.data.buckets import BucketSettings, Placement, bucket_table, image_size, place
from rangefinder.data.captions import long_caption_report, long_captions
from rangefinder.data.dataset import IMAGE_EXTENSIONS, SPLIT_SUBSETS, SPLIT_SUMMARY, Item, SkipKind, Skipped, item_id
from rangefinder.data.validate import validate_dataset
from rangefinder.errors import DataError
from rangefinder.formats.atomic import usable_folder, write_text
from rangefinder.formats.digest import file_sha256
from rangefinder.planning import val_count

# What the summary's `skipped` holds, by kind (each file is listed with its own reason and its SkipKind): the one list
# prepare-dataset's skipped_files output and its report name, and the runs' rangefinder.skipped_files tag counts. The
# reasons are written by validate.py (images, captions), dataset.py (the folder's scan: other files, links, metadata
# rows) and split_dataset below (copies of a split.val_dir image), each with its kind, of which this is made.
SKIPPED_KINDS = "; ".join(kind.value for kind in SkipKind)

SUBSETS = SPLIT_SUBSETS
SUMMARY_FILE = SPLIT_SUMMARY
FORMAT_VERSION = 1


@dataclass
class Split:
    root: Path  # absolute dataset root; file_names are relative to it
    train: list[Item]
    val: list[Item]
    stabilize: list[Item]  # a subset of train
    summary: dict = field(default_factory=dict)
    buckets: Optional[BucketSettings] = None  # the aspect-ratio buckets the split was reported for
    folder: Optional[Path] = None  # the split folder it was read from (read_split); None: made in memory
    # sha256 of each item's file by id, once file_hashes has checked it against the manifest: a step trains several
    # runs from the split it read (the fine-tune's successive halving: three), and hashes each image once.
    checked_hashes: dict[int, str] = field(default_factory=dict, repr=False, compare=False)

    def path_of(self, item: Item) -> Path:
        return (self.root / item.file_name).resolve()

    def subset(self, name: str) -> list[Item]:
        if name not in SUBSETS:
            raise KeyError(f"unknown subset {name!r}; one of {', '.join(SUBSETS)}")
        return getattr(self, name)


def seeded_shuffle(items: list, seed: int) -> list:
    """Fisher-Yates driven only by `random.Random(seed).random()`: identical on every platform and Python 3."""
    rng = random.Random(seed)
    out = list(items)
    for i in range(len(out) - 1, 0, -1):
        j = min(int(rng.random() * (i + 1)), i)
        out[i], out[j] = out[j], out[i]
    return out


def same_image_groups(items: list[Item]) -> list[list[Item]]:
    """Items grouped by content hash, in the items' order (a group where its first item is); singletons mostly."""
    groups: dict[object, list[Item]] = {}
    for it in items:
        groups.setdefault(it.sha256 if it.sha256 is not None else ("path", it.file_name), []).append(it)
    return list(groups.values())


def stabilize_count(n_train: int, share: float) -> int:
    return 0 if share <= 0 else min(n_train, max(1, math.ceil(share * n_train - 1e-9)))


def make_split(
    data_dir: str | Path,
    *,
    val_split: float = 0.2,
    stabilize_split: float = 0.2,
    seed: int = 555,
    val_dir: str | Path | None = None,
    min_image_size: int = 1,
    min_images: int = 2,
    buckets: Optional[BucketSettings] = None,
    count_tokens: Optional[Callable[[str], int]] = None,
    token_limit: Optional[int] = None,
    captionless: bool = False,
) -> Split:
    """Validate the dataset (bad items skipped and listed) and split it; DataError when too few usable images.
    `captionless`: keep images without a caption, with an empty one (textual inversion's prompt templates fill it;
    the summary's `captionless` counts them, and full fine-tuning and LoRA refuse such a split).

    Every item gets its image's size; with `buckets`, the summary also counts the images of each bucket. With
    `count_tokens` (a tokenizer's count of a caption's text tokens) and `token_limit` (how many fit), the summary's
    `long_captions` lists the captions the text encoder will cut off.
    """
    if not 0 <= val_split < 1:
        raise DataError(f"val_split must be in [0, 1) (got {val_split}); 0.2 is usual")
    if not 0 <= stabilize_split <= 1:
        raise DataError(f"stabilize_split must be in [0, 1] (got {stabilize_split}); 0.2 is usual")
    root = Path(data_dir).expanduser().resolve()
    manual_val = Path(val_dir).expanduser().resolve() if val_dir is not None else None
    if manual_val is not None and manual_val == root:
        raise DataError(f"--val-dir {manual_val} is the dataset folder itself; pass a separate folder of images")

    exclude = manual_val if manual_val is not None and root in manual_val.parents else None
    data = validate_dataset(root, min_image_size=min_image_size, exclude=exclude, captionless=captionless)
    skipped = [s.to_json() for s in data.skipped]
    notes = list(data.notes)

    groups = same_image_groups(data.items)
    duplicates = [[it.file_name for it in g] for g in groups if len(g) > 1]
    if manual_val is None:
        data.require(min_images)
        n_val = val_count(len(data.items), val_split)
        if n_val and len(groups) < 2:
            raise DataError(
                f"dataset folder {root} holds {len(data.items)} images but all are the same picture (identical files: "
                f"{', '.join(duplicates[0][:5])}); add different images, one at least for validation"
            )
        # Whole groups of identical images are shuffled, so copies of one image never sit on both sides of the
        # split (a validation leak). Without duplicates this is exactly the shuffle of the items.
        order = seeded_shuffle(groups, seed)
        val: list[Item] = []
        train: list[Item] = []
        for k, g in enumerate(order):
            (val if len(val) < n_val and k < len(order) - 1 else train).extend(g)
    else:
        data.require(max(1, min_images - 1),
                     why="at least one to train" if min_images <= 2
                     else "the floor set by data.min_images, or split --min-images, less one for --val-dir "
                     "(split.val_dir)")
        vdata = validate_dataset(manual_val, min_image_size=min_image_size, captionless=captionless)
        vdata.require(1, why="at least one to validate, in --val-dir (split.val_dir)")
        # Validation file names relative to the dataset root (e.g. "../val/x.png"), so one root serves all subsets.
        rel = Path(os.path.relpath(manual_val, root)).as_posix()
        val = [Item(item_id(f"{rel}/{it.file_name}"), f"{rel}/{it.file_name}", it.text, sha256=it.sha256)
               for it in vdata.items]
        skipped += [replace(s, file_name=f"{rel}/{s.file_name}").to_json() for s in vdata.skipped]
        notes += vdata.notes
        # A training image identical to a hand-picked validation image would leak it: kept out of training, listed.
        val_by_sha = {it.sha256: it.file_name for it in val}
        leaks = [it for it in data.items if it.sha256 in val_by_sha]
        skipped += [Skipped(it.file_name, f"the same image as validation image {val_by_sha[it.sha256]}; left out of "
                            "training", SkipKind.VAL_COPY).to_json()
                    for it in leaks]
        duplicates += [[val_by_sha[it.sha256], it.file_name] for it in leaks]
        kept = [it for it in data.items if it.sha256 not in val_by_sha]
        if not kept:
            raise DataError(f"every image in {root} is also in --val-dir {manual_val}; give different images")
        train = seeded_shuffle(kept, seed)
        val_split = len(val) / (len(val) + len(train))

    # The stabilize subset: a seeded draw from the training items, independent of the validation draw's size.
    n_stab = stabilize_count(len(train), stabilize_split)
    stabilize = seeded_shuffle(train, seed + 1)[:n_stab]

    found = None
    if count_tokens is not None and token_limit is not None:
        found = long_captions([(it.file_name, it.text) for it in sorted(train + val, key=lambda it: it.file_name)],
                              count_tokens, token_limit)

    # Manifests list items by relative path: readable, and the order never depends on the shuffle.
    train, val, stabilize = (sorted(s, key=lambda it: it.file_name) for s in (train, val, stabilize))
    # Each image's upright size, from its header (validation has decoded it already): its bucket follows from it.
    sizes = {it.id: image_size(root / it.file_name) for it in train + val}
    train, val, stabilize = ([replace(it, size=sizes[it.id]) for it in s] for s in (train, val, stabilize))
    summary = {
        "format": FORMAT_VERSION,
        "root": str(root),
        "val_dir": str(manual_val) if manual_val is not None else None,
        "seed": seed,
        "val_split": val_split,
        "stabilize_split": stabilize_split,
        "images": len(data.items) + (len(val) if manual_val is not None else 0),
        "train_images": len(train),
        "val_images": len(val),
        "stabilize_images": len(stabilize),
        "min_image_size": min_image_size,
        # Images kept with an empty caption (`captionless`): textual inversion trains each on a prompt template.
        "captionless": sum(1 for it in train + val if not it.text),
        "skipped": sorted(skipped, key=lambda x: x["file_name"]),
        # Identical files (by sha256), each group kept in one subset: the same image under two captions, or a copy.
        "duplicates": sorted(duplicates),
        "buckets": None,
        # Captions longer than the text encoder reads ({"limit", "count", "files"}); None: no tokenizer was given.
        "long_captions": long_caption_report(found, token_limit),
    }
    if notes:  # only where there are: a split without any is byte-identical to one written before they were
        summary["notes"] = notes
    if buckets is not None:
        table = bucket_table({name: [place(it.size, buckets) for it in items if it.size is not None]
                              for name, items in (("train", train), ("val", val), ("stabilize", stabilize))})
        summary["buckets"] = {**buckets.to_json(), "table": table}
    return Split(root=root, train=train, val=val, stabilize=stabilize, summary=summary, buckets=buckets)


def file_hashes(split: Split, items: list[Item]) -> dict[int, str]:
    """The sha256 of each item's file now, by item id; DataError naming every file deleted, unreadable or changed
    since the split (its manifest recorded the hash), so a run never trains on other images than were split, nor
    stops halfway on a missing one. Each file is hashed once per Split read (`Split.checked_hashes`)."""
    hashes: dict[int, str] = {}
    gone: list[str] = []
    changed: list[str] = []
    for it in items:
        if it.id in hashes:
            continue
        if it.id in split.checked_hashes:
            hashes[it.id] = split.checked_hashes[it.id]
            continue
        try:
            hashes[it.id] = file_sha256(split.path_of(it))
        except OSError as e:
            gone.append(f"{it.file_name} ({'deleted' if isinstance(e, FileNotFoundError) else e.strerror or e})")
            continue
        if it.sha256 is not None and hashes[it.id] != it.sha256:
            changed.append(f"{it.file_name} (replaced: not the file that was split)")
    bad = gone + changed
    if bad:
        shown = "; ".join(bad[:10]) + (f"; and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise DataError(
            f"{len(bad)} image{'s' if len(bad) != 1 else ''} under {split.root} changed since the split: {shown}; "
            "put the original files back, or split the dataset again (`rangefinder split`, or the pipeline's "
            "prepare-dataset step) so the manifests match the files"
        )
    split.checked_hashes.update(hashes)
    return hashes


def place_items(split: Split, items: list[Item], buckets: BucketSettings) -> dict[int, Placement]:
    """Each item's bucket, from the size the split recorded (or, in an older split, the image file's header)."""
    out = {}
    for it in items:
        if it.id not in out:
            try:
                size = it.size or image_size(split.path_of(it))
            except OSError as e:
                raise DataError(f"cannot read image {split.path_of(it)} ({e}); restore it, or split again") from None
            out[it.id] = place(size, buckets)
    return out


def _jsonl(items: list[Item], buckets: Optional[BucketSettings] = None) -> str:
    def line(it: Item) -> dict:
        if buckets is None or it.size is None:
            return it.to_json()
        return it.to_json() | place(it.size, buckets).to_json()  # bucket and crop, for the reader's information

    return "".join(json.dumps(line(it), ensure_ascii=False) + "\n" for it in items)


def write_split(split: Split, out_dir: str | Path) -> Path:
    """Write the manifests and the summary; two runs on the same inputs give byte-identical files."""
    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / SUMMARY_FILE
    if summary_path.exists():
        summary_path.unlink()  # the folder is unfinished until the new summary lands
    for name in SUBSETS:
        write_text(out / f"{name}.jsonl", _jsonl(split.subset(name), split.buckets))
    # The root also relative to the split folder: a split handed to another machine or pod with its data beside it
    # (a KFP artifact mounted elsewhere) still finds the images.
    summary = {**split.summary, "root_relative": Path(os.path.relpath(split.root, out)).as_posix()}
    write_text(summary_path, json.dumps(summary, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    return out


def _holds_images(folder: Path) -> bool:
    """Whether `folder` (or a folder under it, as kohya's `10_name/`) holds an image file: a dataset, not a split."""
    for _, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if any(os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS for f in files if not f.startswith(".")):
            return True
    return False


def read_split(split_dir: str | Path, root: str | Path | None = None) -> Split:
    """Read a split folder written by `write_split` (`rangefinder split`).

    `root` replaces the recorded dataset root, for data mounted at another path than where it was split.
    """
    d = Path(split_dir).expanduser()
    summary_path = d / SUMMARY_FILE
    if not summary_path.is_file():
        # A split unfinished (its manifests there, the summary not yet) may hold its own copy of the images.
        if _holds_images(d) and not any((d / f"{name}.jsonl").is_file() for name in SUBSETS):
            # Told to make a split "--out" this folder, a user who passed the dataset itself wrote the split into it.
            raise DataError(
                f"{d} is a dataset folder (it holds images), not a split of one; split it first with `rangefinder "
                f"split {shlex.quote(str(d))} --out SPLIT_DIR`, then pass SPLIT_DIR"
            )
        raise DataError(
            f"{d} is not a finished split folder (no {SUMMARY_FILE}); "
            f"make one with `rangefinder split DATA_DIR --out {shlex.quote(str(d))}`"
        )
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    subsets: dict[str, list[Item]] = {}
    for name in SUBSETS:
        path = d / f"{name}.jsonl"
        if not path.is_file():
            raise DataError(f"split folder {d} lacks {path.name}; write it again with `rangefinder split`")
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        try:
            subsets[name] = [Item.from_json(json.loads(ln)) for ln in lines]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DataError(f"{path} is not a valid manifest ({e}); write it again with `rangefinder split`") from None
    if root is not None:
        data_root = Path(root).expanduser().resolve()
    else:
        data_root = Path(summary["root"])
        relative = summary.get("root_relative")
        if not data_root.is_dir() and relative is not None and (d / relative).is_dir():
            data_root = (d / relative).resolve()
    recorded = summary.get("buckets")
    buckets = None
    if recorded:
        buckets = BucketSettings(int(recorded["resolution"]), int(recorded["step"]), float(recorded["max_aspect"]),
                                 bool(recorded.get("crop", True)))
    return Split(root=data_root, train=subsets["train"], val=subsets["val"], stabilize=subsets["stabilize"],
                 summary=summary, buckets=buckets, folder=d)


def split_dataset(
    data_dir: str | Path,
    out_dir: str | Path,
    **kwargs,
) -> Split:
    """`make_split` then `write_split`: what `rangefinder split` and the pipeline's split step run."""
    usable_folder(out_dir, "the split's output folder")  # before the images are read, not after
    split = make_split(data_dir, **kwargs)
    write_split(split, out_dir)
    return split

