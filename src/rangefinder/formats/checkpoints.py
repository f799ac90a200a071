"""The training checkpoint: its layout, the one reader every other part uses, and the pieces the engine writes.

A checkpoint is a folder `checkpoints/checkpoint-<update:06d>/` holding:
- `weights.safetensors`: the method's trained tensors (Method.trainable_state_dict);
- `optimizer.pt`, and `ema.pt` / `scaler.pt` when used;
- `rng-<rank>.pt`: Python, NumPy, torch CPU/CUDA RNG states and the training generator of each process;
- `state.json`: update, micro-batches done (the stream position), the settings, the metrics and per-update rows so
  far, and what the loop needs to go on exactly as if never stopped;
- `manifest.json`: the sha256 of every other file. Written last.
It is assembled under a temporary name and renamed into place, so a killed run leaves either a whole checkpoint or a
`.tmp` folder that readers ignore (and the next save removes). A save of an update already saved replaces that
checkpoint (formats/atomic.py's replace_dir); where the file system cannot swap two folders, a kill inside it can
leave the old one renamed aside, which `list_checkpoints` and the sweeps put back. Only the training engine writes
checkpoints; sampling, export and registration read them through `list_checkpoints`, `read_state`, `read_weights` and
`read_ema`, after `require_intact` has checked the files they read against the manifest (a damaged checkpoint is one
error naming it, never a silently wrong model).

Resuming must never run code found in an output folder (one may come from anyone: a shared bucket, a colleague's
run). The `.pt` files hold only tensors, numbers, strings and lists/tuples/dicts of them, and are read with
`torch.load(weights_only=True)`, which refuses anything else (a pickled object's `__reduce__` is never called);
the RNG states are converted to such values before saving (checkpointing.py). The checksums are checked before any
file is parsed: a torn write or a bad block makes a checkpoint fail `verify`, and the engine resumes from the
previous intact one.

The fine-tune keeps one checkpoint at the end: the one the step window picks (the lowest validation loss inside the
window, or of the whole run when there is no window: analysis.delivered_checkpoint). It writes that checkpoint's
model beside `final/` as `chosen/` (the same files `final/` holds), with `chosen.json` saying which update, epoch
and validation loss it is and why it was chosen; that is the model registered when there is no retrain.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rangefinder.errors import RangefinderError
from rangefinder.formats.atomic import read_written_json, replace_dir, restore_moved_aside
from rangefinder.formats.digest import file_sha256

if TYPE_CHECKING:
    import torch

WEIGHTS_NAME = "weights.safetensors"
STATE_NAME = "state.json"
OPTIMIZER_NAME = "optimizer.pt"
MANIFEST_NAME = "manifest.json"
REQUIRED = (WEIGHTS_NAME, OPTIMIZER_NAME, STATE_NAME, MANIFEST_NAME)
EMA_NAME = "ema.pt"
CHOSEN_DIR = "chosen"
RUN_DIR = "checkpoints"  # a run's checkpoints: <run folder>/checkpoints/checkpoint-<update>/
CHOSEN_INFO = "chosen.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_name(update: int) -> str:
    return f"checkpoint-{update:06d}"


def checkpoint_update(path: Path) -> Optional[int]:
    """The update a checkpoint folder was written at, from its name; None when it is not a checkpoint's name."""
    m = _NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def is_checkpoint(path: Path) -> bool:
    """A whole checkpoint: the folder holds every required file (a `.tmp` one being assembled does not count)."""
    path = Path(path)
    return path.is_dir() and all((path / f).is_file() for f in REQUIRED)


def list_checkpoints(root: Path, *, whole: bool = True) -> list[Path]:
    """Whole checkpoints under root, oldest first (one a killed save left renamed aside is put back first). With
    `whole` off, every folder with a checkpoint's name: one that lacks a file was damaged since (a save renames only
    a whole one into place), which a resume names as it passes over it."""
    if not Path(root).is_dir():
        return []
    restore_moved_aside(root, whole=is_checkpoint)
    found = [(checkpoint_update(p), p) for p in Path(root).iterdir()]
    return [p for u, p in sorted((u, p) for u, p in found if u is not None and (is_checkpoint(p) if whole
                                                                                 else p.is_dir()))]


def latest_checkpoint(root: Path) -> Optional[Path]:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_state(path: Path) -> dict[str, Any]:
    """`state.json`: the update, the training settings it ran with, its metrics rows, ..."""
    return json.loads((Path(path) / STATE_NAME).read_text())


def read_weights(path: Path) -> dict:
    """The method's trained tensors (CPU), as `Method.load_trainable_state_dict` takes them."""
    from safetensors.torch import load_file

    return load_file(str(Path(path) / WEIGHTS_NAME))


def read_ema(path: Path) -> Optional[dict]:
    """The EMA state (diffusers' EMAModel.state_dict) when the run kept an average, else None. Call
    `require_intact` (or `verify`) first."""
    ema = Path(path) / EMA_NAME
    return _load_plain(ema) if ema.is_file() else None


def read_optimizer(path: Path) -> dict:
    """The optimizer's state_dict (a schedule-free run's model needs it: restore.method_from_checkpoint). Call
    `require_intact` first."""
    return _load_plain(Path(path) / OPTIMIZER_NAME)


def checkpoints_by_update(root: Path) -> dict[int, Path]:
    """The whole checkpoints under root, by the update each was taken at (the step window picks one of them)."""
    return {u: p for p in list_checkpoints(root) if (u := checkpoint_update(p)) is not None}


def keep_only(root: Path, *kept: Path) -> None:
    """Remove every checkpoint under root but those `kept` (folders still being written included)."""
    keep = {Path(k).resolve() for k in kept}
    restore_moved_aside(root, whole=is_checkpoint)  # a checkpoint a killed save left renamed aside is one, not litter
    for p in Path(root).iterdir():
        if p.is_dir() and p.resolve() not in keep and (checkpoint_update(p) is not None or p.name.endswith(".tmp")):
            shutil.rmtree(p, ignore_errors=True)


def read_chosen(model_dir: Path) -> Optional[dict[str, Any]]:
    """`chosen.json` of a fine-tune's output folder, or None (a retrain, or a fine-tune without a validated
    checkpoint)."""
    info = Path(model_dir) / CHOSEN_INFO
    if not (info.is_file() and (Path(model_dir) / CHOSEN_DIR).is_dir()):
        return None
    return read_written_json(info, lambda chosen: isinstance(chosen, dict), "not a JSON object",
                             "the fine-tune wrote it whole, so it was damaged or changed since: run the fine-tune "
                             f"again, or use {Path(model_dir) / 'final'} (the run's final weights) instead")


def begin(root: Path, update: int) -> Path:
    """A fresh temporary folder for the checkpoint of `update` (main process)."""
    root.mkdir(parents=True, exist_ok=True)
    restore_moved_aside(root, whole=is_checkpoint)  # the checkpoint a save killed between its renames moved aside
    for stale in root.glob("*.tmp"):  # left by a run killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f"{checkpoint_name(update)}.tmp"
    tmp.mkdir()
    return tmp


def tmp_folder(root: Path, update: int) -> Path:
    return root / f"{checkpoint_name(update)}.tmp"


def write_rng(tmp: Path, rank: int, states: dict[str, Any]) -> None:
    import torch

    torch.save(states, tmp / f"rng-{rank}.pt")


def write_main(
    tmp: Path,
    *,
    weights: dict[str, torch.Tensor],
    optimizer: dict,
    state: dict[str, Any],
    ema: Optional[dict] = None,
    scaler: Optional[dict] = None,
) -> None:
    import torch
    from safetensors.torch import save_file

    save_file(weights, str(tmp / WEIGHTS_NAME))
    torch.save(optimizer, tmp / OPTIMIZER_NAME)
    if ema is not None:
        torch.save(ema, tmp / EMA_NAME)
    if scaler is not None:
        torch.save(scaler, tmp / "scaler.pt")
    (tmp / STATE_NAME).write_text(json.dumps(state, indent=1))
    # The manifest last (every process's rng file is written by now): its presence makes a checkpoint whole.
    files = sorted(p.name for p in tmp.iterdir() if p.is_file())
    (tmp / MANIFEST_NAME).write_text(json.dumps({"sha256": {f: file_sha256(tmp / f) for f in files}}, indent=1))


def verify(path: Path, only: Optional[Iterable[str]] = None) -> Optional[str]:
    """What is wrong with the checkpoint at `path` (a missing or changed file, by its checksum); None when intact.

    `only`: check just these files (those a reader is about to read), each of which must then be in the manifest
    when it is there; by default every file the manifest lists."""
    path = Path(path)
    if not (path / MANIFEST_NAME).is_file():
        return f"it has no {MANIFEST_NAME} (it was not written whole, or not by rangefinder's training engine)"
    try:
        sums = json.loads((path / MANIFEST_NAME).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its {MANIFEST_NAME} cannot be read ({e})"
    if not isinstance(sums, dict):
        return f"its {MANIFEST_NAME} holds no checksum table"
    missing = [n for n in REQUIRED if n != MANIFEST_NAME and n not in sums]
    if missing:
        return f"the manifest lists no checksum for {', '.join(missing)}"
    names = list(sums)
    if only is not None:
        wanted = set(only)
        unlisted = sorted(n for n in wanted if n not in sums and (path / n).exists())
        if unlisted:
            return f"{unlisted[0]} is not in its {MANIFEST_NAME} (added after the checkpoint was written)"
        names = [n for n in names if n in wanted]
    for name in names:
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if file_sha256(f) != sums[name]:
            return f"{name} does not match its checksum (a torn write, a bad block, or changed by hand)"
    return None


# The files a reader of the trained model uses (restore.method_from_checkpoint): not the optimizer or RNG states.
MODEL_FILES = (WEIGHTS_NAME, STATE_NAME, EMA_NAME)
# Checkpoints found intact in this process, with the (name, size, mtime) of the files checked: a grid that checks its
# columns before rendering and then loads each one hashes a multi-GB checkpoint once, not twice.
_intact: dict[tuple[str, tuple[str, ...]], tuple] = {}


def _signature(path: Path, names: tuple[str, ...]) -> tuple:
    sig: list[tuple[str, Optional[int], Optional[int]]] = []
    for name in (MANIFEST_NAME, *names):
        try:
            st = (path / name).stat()
        except OSError:
            sig.append((name, None, None))
        else:
            sig.append((name, st.st_size, st.st_mtime_ns))
    return tuple(sig)


def require_intact(path: Path, only: Iterable[str] = MODEL_FILES) -> None:
    """Raise one RangefinderError naming the checkpoint, what is wrong and the fix, unless the files a reader is about
    to read (`only`, default: those of the trained model) match the checkpoint's manifest."""
    path = Path(path)
    names = tuple(sorted(only))
    key = (str(path.resolve()), names)
    sig = _signature(path, names)
    if _intact.get(key) == sig:
        return
    problem = verify(path, names)
    if problem is not None:
        raise RangefinderError(
            f"checkpoint {path} is damaged: {problem}; its weights cannot be trusted. Use another checkpoint of the "
            "run, or run the training again to write it anew (with --resume it goes on from the newest intact one)"
        )
    _intact[key] = sig


def commit(tmp: Path, keep: int) -> Path:
    """Rename the finished temporary folder into place, then drop all but the newest `keep` checkpoints."""
    # The same update may be saved again (a resume that passed over a damaged newest checkpoint): replaced whole.
    final = replace_dir(tmp, tmp.with_name(tmp.name.removesuffix(".tmp")))
    keep_newest(final.parent, keep)
    return final


def keep_newest(root: Path, keep: int) -> None:
    """Remove all but the newest `keep` whole checkpoints under root."""
    for stale in list_checkpoints(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)


def load(path: Path, rank: int) -> dict[str, Any]:
    """Everything a checkpoint holds, as written (the engine's resume). Call `verify` first."""
    path = Path(path)
    rng = path / f"rng-{rank}.pt"
    return {
        "path": path,
        "weights": read_weights(path),
        "optimizer": _load_plain(path / OPTIMIZER_NAME),
        "state": read_state(path),
        "ema": _load_plain(path / EMA_NAME) if (path / EMA_NAME).is_file() else None,
        "scaler": _load_plain(path / "scaler.pt") if (path / "scaler.pt").is_file() else None,
        "rng": _load_plain(rng) if rng.is_file() else None,
    }


def _load_plain(path: Path) -> Any:
    """A `.pt` file of tensors, numbers, strings and containers of them; anything else is refused, never run."""
    import torch

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise RangefinderError(
            f"refusing to load {path}: it holds Python objects other than tensors and numbers, which could run "
            "code when loaded (it was not written by this version of rangefinder, or was tampered with); "
            "remove this checkpoint folder to resume from an earlier one, or start in an empty folder"
        ) from None
