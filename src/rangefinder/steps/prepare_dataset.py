"""Step `prepare_dataset`: validate the images and captions and split them into one self-contained Dataset folder.

Where the images come from, in order: an imported Dataset artifact (the pipeline's `dataset_uri`), else
`data.dataset_dir` (a folder on the data volume, or on this machine), else the embedded synthetic shapes dataset,
made here. Images from an artifact or made here are written inside the split folder (`dataset/`), because each
later step gets its own download of the split and nothing else; a `dataset_dir` on a shared volume stays in place.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rangefinder.config import ConfigLike, as_config
from rangefinder.errors import DataError
from rangefinder.formats.atomic import atomic_dir, sweep_leftovers
from rangefinder.formats.text import markdown_code, markdown_text, warn

EMBEDDED_IMAGES = 20  # the embedded dataset (synthetic.EMBEDDED_KIND): 16 train + 4 validation at the default split


@dataclass
class PreparedDataset:
    split_dir: Path
    dataset_root: Path
    train_images: int
    val_images: int
    skipped: int


def _copy_file_or_broken_link(src: str, dst: str) -> str:
    """copytree's copy of one file, links followed (every later pod needs the images), but a link to nothing copied as
    that link: the split lists it among the skipped files, as it does in a folder split in place, where copy2 failed
    the whole copy with shutil's Error."""
    if os.path.islink(src) and not os.path.exists(src):
        os.symlink(os.readlink(src), dst)
        return dst
    return shutil.copy2(src, dst)


def _copy_dataset(src: Path, dst: Path) -> None:
    """Copy the imported dataset `src` into `dst`, links to files and to folders followed (every later pod needs the
    images), but a second way to a folder the dataset's scan already walked (data.dataset.repeated_folder_links: a
    loop back to an ancestor, two links to one folder inside or outside it) made again as a link to that folder's
    copy. Followed, a loop copied the whole dataset again at each of 40 levels before the system refused the path,
    and two links to one outside folder made two real folders of the copy, whose scan counted each of its images
    twice (both copies on one side of the split, as identical images are kept: trained, or validated, at double
    weight, and the counts doubled), where the scan in place lists the second link among the skipped files and
    counts them once."""
    from rangefinder.data.dataset import repeated_folder_links

    repeats = {link.as_posix(): folder.as_posix() for link, folder in repeated_folder_links(src).items()}
    real = Path(os.path.realpath(src))

    def repeated(folder: str, names: list[str]) -> set[str]:
        here = os.path.relpath(folder, src)
        left = set()
        for name in names:
            rel = name if here == "." else f"{here}/{name}"
            path = os.path.join(folder, name)
            target = Path(os.path.realpath(path))
            if rel not in repeats and os.path.islink(path) and target.is_dir() and target.is_relative_to(real):
                # A link into the dataset where the scan never looks (under a dot-named folder, a loop there too):
                # followed, it copied the dataset again at each of 40 levels, and again inside each copy.
                repeats[rel] = target.relative_to(real).as_posix()
            if rel in repeats:
                left.add(name)
        return left

    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=repeated, copy_function=_copy_file_or_broken_link)
    for link, folder in repeats.items():
        made = dst / link
        if made.parent.is_dir() and not os.path.lexists(made):  # under a folder the copy made (not itself left out)
            os.symlink(os.path.relpath(dst / folder, made.parent), made)


def run_prepare_dataset(
    cfg: ConfigLike,
    *,
    out_dir: Path,
    dataset_dir: Optional[Path] = None,
    report_path: Optional[Path] = None,
) -> PreparedDataset:
    """Split the images into the split folder `out_dir`: those of `dataset_dir` (an imported artifact's folder,
    copied into `out_dir/dataset`), else of the config's data.dataset_dir (split in place), else the embedded
    synthetic dataset (made in `out_dir/dataset`). `report_path`: where the Markdown report of the split goes (the
    images, the files skipped and why). Returns the split's folder, its image counts and the files skipped
    (PreparedDataset); DataError for a folder that is missing or holds too few usable images.
    `cfg`: a RangefinderConfig, or a dict of its sections (a notebook's, a YAML file's) validated as a config file
    is (rangefinder.config.as_config: ConfigError naming a bad setting); anything else is a TypeError."""
    cfg = as_config(cfg)  # a dict from a notebook is validated as a config file is
    from rangefinder.data.buckets import BucketSettings
    from rangefinder.data.split import SKIPPED_KINDS, split_dataset
    from rangefinder.data.synthetic import EMBEDDED_KIND, make_synthetic_dataset

    if dataset_dir is not None:
        given = Path(dataset_dir).expanduser()
        if not given.is_dir():
            what = "is a file, not a folder" if given.exists() else "does not exist"
            raise DataError(f"dataset_dir {given} {what}; give the folder of images and captions")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if dataset_dir is not None:
        # An imported artifact: copy it into the split so every later pod has the images. The copy takes the place
        # of an earlier one only once whole: a copy that fails leaves the split made before as it was.
        root = out_dir / "dataset"
        # A copy killed mid-way left its folder (`.dataset.PID.tmp...`, as large as the dataset) in the split, which
        # every later step downloads: the step holds its output folder, so what a killed attempt left goes first.
        sweep_leftovers(out_dir)
        with atomic_dir(root) as tmp:
            _copy_dataset(given, tmp)
            # The split made before names the images of the copy now replaced: no finished split once the new copy is
            # in (a kill, or a new dataset with too few usable images, left the old split.json naming images gone or
            # others in their place, and read as finished). A copy that fails keeps both; write_split writes it last.
            from rangefinder.data.split import SUMMARY_FILE

            (out_dir / SUMMARY_FILE).unlink(missing_ok=True)
    elif cfg.data.dataset_dir:
        root = Path(cfg.data.dataset_dir).expanduser()
        if not root.is_dir():
            # A relative path is read from the folder rangefinder runs in, not the config file's: said so, with the
            # folder it looked in, where it was only "is not a folder".
            where = "" if root.is_absolute() else f" (read as {root.absolute()}, from the folder rangefinder runs in)"
            what = "is a file, not a folder" if root.exists() else "does not exist"
            raise DataError(f"data.dataset_dir {root}{where} {what}; give the folder of images and captions (an "
                            "absolute path)")
    else:
        root = out_dir / "dataset"
        make_synthetic_dataset(root, kind=EMBEDDED_KIND, count=EMBEDDED_IMAGES, seed=0,
                               resolution=max(32, cfg.data.resolution))
    count_tokens, token_limit = None, None
    if cfg.model.resolved_dir and Path(cfg.model.resolved_dir).is_dir():  # set by resolve-config: count long captions
        from rangefinder.models.tokens import caption_token_counter

        count_tokens, token_limit = caption_token_counter(cfg.model.resolved_dir)
    split = split_dataset(root, out_dir, val_split=cfg.split.val_split, stabilize_split=cfg.split.stabilize_split,
                          seed=cfg.split.seed, val_dir=cfg.split.val_dir,
                          min_image_size=cfg.data.effective_min_image_size(), min_images=cfg.data.min_images,
                          buckets=BucketSettings.from_data_config(cfg.data),
                          count_tokens=count_tokens, token_limit=token_limit,
                          # Textual inversion needs no captions: an image without one trains on a prompt template
                          # ("a photo of a <tok>"), as diffusers' textual_inversion example trains every image.
                          captionless=cfg.training.method == "textual_inversion")
    notes = list(split.summary.get("notes", []))
    long = split.summary.get("long_captions")
    cut = []
    if long and long["count"]:
        # Said once for the dataset: the captions are cut without a word (truncation=True), the report went unread.
        named = ", ".join(f"{x['file_name']} ({x['tokens']})" for x in long["files"][:3])
        more = f" and {long['count'] - 3} more" if long["count"] > 3 else ""
        cut = [f"{long['count']} caption(s) are longer than the {long['limit']} tokens the text encoder reads, and "
               f"train with their tail cut off: {named}{more}; shorten them, or put what matters first (the dataset "
               "report lists them all)"]
    warn(notes + cut)  # a local run's progress shows each such line once
    skipped_files = list(split.summary.get("skipped", []))
    skipped = len(skipped_files)
    result = PreparedDataset(split_dir=out_dir, dataset_root=root.resolve(), train_images=len(split.train),
                             val_images=len(split.val), skipped=skipped)
    if report_path is not None:
        source = dataset_dir or cfg.data.dataset_dir or f"embedded {EMBEDDED_KIND}"
        lines = ["# Dataset", "", f"- images from: {markdown_code(str(source))}",
                 f"- training images: {result.train_images}", f"- validation images: {result.val_images}",
                 f"- stabilize subset: {len(split.stabilize)}", f"- skipped files ({SKIPPED_KINDS}): {skipped}"]
        for item in skipped_files:
            lines.append(f"  - {markdown_code(str(item.get('file_name')))}: {markdown_text(str(item.get('reason')))}")
        lines += [f"- not read: {markdown_text(line)}" for line in notes]
        if long is None:
            lines.append("- captions longer than the text encoder reads: not counted (no resolved model)")
        else:
            lines.append(f"- captions longer than the text encoder reads ({long['limit']} tokens; the rest is cut "
                         f"off): {long['count']}")
            for x in long["files"]:
                lines.append(f"  - {markdown_code(x['file_name'])}: {x['tokens']} tokens")
        if split.summary.get("captionless"):
            lines.append(f"- images without a caption: {split.summary['captionless']} (each trains on one of textual "
                         "inversion's prompt templates, e.g. `a photo of a <tok>`)")
        lines.append(f"- minimum short side: {split.summary.get('min_image_size')} px")
        duplicates = split.summary.get("duplicates", [])
        lines.append(f"- identical images (kept in one subset): {len(duplicates)} groups")
        for group in duplicates:
            lines.append("  - " + " = ".join(markdown_code(name) for name in group))
        buckets = split.summary.get("buckets")
        if buckets:
            lines += ["", f"## Aspect-ratio buckets ({buckets['resolution']} px, sides in steps of "
                      f"{buckets['step']} px, at most {buckets['max_aspect']:g}:1)", "",
                      "| bucket | train | val | stabilize |", "|---|---|---|---|"]
            lines += [f"| {b['bucket']} | {b['train']} | {b['val']} | {b['stabilize']} |" for b in buckets["table"]]
        Path(report_path).write_text("\n".join(lines) + "\n")
    return result
