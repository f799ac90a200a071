"""The validation pass: every bad item reported by name with its reason and skipped, before any training.

A run must never crash halfway through on a bad file, so every image is opened and fully decoded here (a truncated
file fails only when its last bytes are read), every caption is checked, and the run stops with one clear error when
too few usable images remain.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from PIL import Image, UnidentifiedImageError

from rangefinder.data.dataset import (
    IMAGE_EXTENSIONS,
    Item,
    SkipKind,
    Skipped,
    clean_caption,
    item_id,
    kohya_folder,
    scan_dataset,
)
from rangefinder.data.pixels import load_rgb
from rangefinder.errors import DataError


@dataclass
class ValidatedDataset:
    root: Path
    items: list[Item]  # usable, sorted by file_name
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # the scan's warnings (dataset.Scan.notes)

    def require(self, min_images: int = 2, why: Optional[str] = None) -> ValidatedDataset:
        """DataError unless at least `min_images` usable images remain. `why` says what they are needed for (default:
        one to train and one to validate at 2, data.min_images above it)."""
        if len(self.items) >= min_images:
            return self
        n = len(self.items)
        if not self.skipped and n == 0:
            raise DataError(
                f"dataset folder {self.root} holds no images ({', '.join(IMAGE_EXTENSIONS)}); put images there, each "
                "with its caption in a .txt or .caption file of the same stem (or a metadata.jsonl or metadata.csv)"
            )
        shown = "; ".join(str(s) for s in self.skipped[:10])
        more = f"; and {len(self.skipped) - 10} more" if len(self.skipped) > 10 else ""
        small = sum(s.reason.startswith("too small") for s in self.skipped)
        # Small images are the commonest first-run trap (a 32 px set at the default 512 px): name the two settings.
        fix = (f"; {small} are too small for the resolution: pass a lower --resolution (data.resolution) to train "
               "at their size, or a lower --min-image-size (data.min_image_size) to enlarge them") if small else ""
        raise DataError(
            f"dataset folder {self.root} has only {n} usable image{'s' if n != 1 else ''}, fewer than the "
            f"{min_images} needed ({why or _why_needed(min_images)}); skipped: {shown or 'none'}{more}; "
            f"fix or caption the skipped files, or add images{fix}"
        )


def _why_needed(min_images: int) -> str:
    # Two is what a split needs; more is the user's own floor, which the bracket must not explain as the split's.
    if min_images <= 2:
        return "at least one to train and one to validate"
    return "the floor set by data.min_images, or split --min-images"


def check_image(path: Path, min_image_size: int = 1) -> Optional[str]:
    """None if the image can be used, else why not (one short phrase)."""
    return inspect_image(path, min_image_size)[0]


def inspect_image(path: Path, min_image_size: int = 1) -> tuple[Optional[str], Optional[str]]:
    """(why the image cannot be used or None, the sha256 of its bytes or None when unreadable).

    The file is read once: hashed, then decoded from the same bytes (so the hash is of what was checked).
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"cannot be read ({e.strerror or e})", None
    sha = hashlib.sha256(data).hexdigest()
    return _problem(data, min_image_size), sha


def _problem(data: bytes, min_image_size: int) -> Optional[str]:
    try:
        img = load_rgb(io.BytesIO(data))  # decodes every pixel: truncated files fail here
    except UnidentifiedImageError:
        return "unreadable image: not a file format Pillow recognises (corrupt or not an image)"
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        msg = str(e)
        if "truncated" in msg.lower():
            return f"truncated or corrupt image ({msg})"
        return f"unreadable image ({type(e).__name__}: {msg})"
    with Image.open(io.BytesIO(data)) as probe:  # the header again: load_rgb's RGB copy has one frame
        # A camera's JPEG is often an MPO (CIPA DC-007) whose later frames are previews or a stereo pair's other
        # view: its first frame is the photo, as every viewer shows. A GIF, PNG or WebP of several frames is an
        # animation, and a TIFF of several a multi-page scan, of which no one frame is the image.
        frames = 1 if probe.format == "MPO" else getattr(probe, "n_frames", 1)
        kind = "multi-page" if probe.format == "TIFF" else "animated"
    if frames > 1:
        return f"{kind} ({frames} frames): only a still image is trained on; save the frame you mean as a PNG"
    w, h = img.size
    if min(w, h) < min_image_size:
        return f"too small: {w}x{h} px, the short side must be at least {min_image_size} px"
    return None


def validate_dataset(
    root: str | Path,
    *,
    min_image_size: int = 1,
    min_images: Optional[int] = None,
    exclude: Optional[Path] = None,
    captionless: bool = False,
) -> ValidatedDataset:
    """Scan `root`, check every item, return the usable ones and the skipped ones with reasons.

    With `min_images`, raise DataError when fewer usable images remain. With `captionless`, an image without a
    caption (or with an empty one) is kept with the empty caption, which textual inversion fills with a prompt
    template; without it, it is skipped and listed.
    """
    scan = scan_dataset(root, exclude=exclude)
    skipped = list(scan.problems)
    items: list[Item] = []
    for c in scan.candidates:
        if c.caption is None and not captionless:
            stem = Path(c.file_name).with_suffix("").as_posix()
            kohya = kohya_folder(c.file_name)  # kohya captions an image with none by its folder's name
            hint = f"; kohya's caption from its folder's name, \"{kohya[2]}\", is not read" if kohya else ""
            skipped.append(Skipped(c.file_name, f"missing caption (no {stem}.txt or {stem}.caption, and no "
                                                 f"metadata.jsonl or metadata.csv row{hint})", SkipKind.CAPTION))
            continue
        text = clean_caption(c.caption or "")
        if not text and not captionless:
            skipped.append(Skipped(c.file_name, f"empty caption in {c.caption_source}", SkipKind.CAPTION))
            continue
        problem, sha = inspect_image(scan.root / c.file_name, min_image_size)
        if problem:
            skipped.append(Skipped(c.file_name, problem, SkipKind.IMAGE))
            continue
        items.append(Item(id=item_id(c.file_name), file_name=c.file_name, text=text, sha256=sha))
    skipped.sort(key=lambda s: s.file_name)
    result = ValidatedDataset(root=scan.root, items=items, skipped=skipped, notes=scan.notes)
    if min_images is not None:
        result.require(min_images)
    return result
