"""Writing a run's checkpoint and resuming from one. The folder layout and the reader are in
rangefinder/formats/checkpoints.py; this module decides what goes in: the method's trained tensors, the optimizer,
EMA and grad-scaler states, every process's RNG states, and the RunState.

It also guards the output folder: one run at a time holds it (`OutDirLock`), a save that cannot be written (full
disk, unwritable folder) stops the run with one clear error and leaves the previous checkpoint as it was, and a run
whose loss or weights are no longer finite is stopped as diverged without saving them."""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import math
import os
import random
import re
import shutil
import socket
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from safetensors import SafetensorError

from rangefinder.config import TrainingConfig, migrate_training
from rangefinder.errors import ConfigError, RangefinderError
from rangefinder.formats import checkpoints

if TYPE_CHECKING:
    from rangefinder.training.run import Run
    from rangefinder.training.state import RunState

_log = logging.getLogger(__name__)

# Settings a resume may change: they do not change what the run computes (compile: the same maths, other kernels).
RESUMABLE_CHANGES = {"resume", "checkpoint_every_updates", "keep_checkpoints", "cache_dir", "compile"}
LOCK_NAME = ".rangefinder.lock"


def save_checkpoint(run: Run, state: RunState) -> None:
    """The checkpoint of `state.update` (every process writes its RNG states; the main process the rest).

    Weights that are no longer finite are not saved: the run is marked diverged and the last checkpoint stays the
    newest. A write that fails (full disk, unwritable folder) removes the partial folder and raises a clear error.
    """
    if not trainable_finite(run):
        state.status = "diverged"
        return
    accelerator, root, update = run.accelerator, run.settings.ckpt_root, state.update
    tmp = checkpoints.tmp_folder(root, update)
    parts = _main_parts(run, state) if accelerator.is_main_process else None
    rng = _rng_states(state.train_gen)
    # Only writing happens in here. torch.save and safetensors report a failed write (ENOSPC, EFBIG) as a
    # RuntimeError or SafetensorError rather than OSError; in this block nothing else raises those.
    try:
        if accelerator.is_main_process:
            checkpoints.begin(root, update)
        accelerator.wait_for_everyone()
        checkpoints.write_rng(tmp, accelerator.process_index, rng)
        accelerator.wait_for_everyone()
        if parts is not None:
            checkpoints.write_main(tmp, **parts)
            checkpoints.commit(tmp, run.cfg.keep_checkpoints)
    except Exception as e:
        if not isinstance(e, (OSError, RuntimeError, SafetensorError)):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_error(f"checkpoint {tmp.name.removesuffix('.tmp')}", root, e) from None
    accelerator.wait_for_everyone()


def _main_parts(run: Run, state: RunState) -> dict[str, Any]:
    """What the main process writes, gathered (and copied to the CPU) before anything is written."""
    accelerator, update = run.accelerator, state.update
    return dict(
        weights={k: v.cpu() for k, v in run.method.trainable_state_dict().items()},
        optimizer=run.optimizer.state_dict(),
        ema=run.ema.state_dict() if run.ema is not None else None,
        scaler=accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
        state={
            "update": update,
            "micro_batches_done": state.micro_batches_done,
            "total_updates": run.settings.plan.total_updates,
            "train_images": len(run.settings.train_items),
            "train_buckets": _train_buckets(run),
            "loss_since_row": [state.loss_sum, state.loss_count],
            "status": state.status,
            "family": run.family.name,
            "training": run.cfg.model_dump(mode="json"),
            "written_by": {"rank": accelerator.process_index, "world_size": accelerator.num_processes},
            "metrics_rows": state.log.metrics_rows,
            "update_rows": state.log.update_rows,
        },
    )


def disk_error(what: str, path: Path, e: Exception) -> RangefinderError:
    """One sentence for a write that failed: what, where, why, the free space there, and what to do."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = f"{shutil.disk_usage(probe).free / 2**30:.2f} GiB free"
    except OSError:
        free = "free space unknown"
    previous = checkpoints.latest_checkpoint(path) if Path(path).is_dir() else None
    kept = f"; the previous checkpoint {previous} is intact" if previous else ""
    return RangefinderError(
        f"cannot write {what} under {path}: {getattr(e, 'strerror', None) or e} ({free} on {probe}){kept}; "
        "free some space or "
        "make the folder writable (or choose another --out), then run again with --resume"
    )


# A write that failed for lack of room or rights (full disk, quota, read-only, file too large), not for a missing
# or unreadable input: those say what to fix about the data.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES, errno.EPERM}


@contextlib.contextmanager
def outputs_written(out_dir: Path) -> Iterator[None]:
    """The run's other outputs (the curve CSVs, final/, run_summary.json): a failed write is one sentence naming
    the folder and its free space, like a failed checkpoint, instead of a traceback."""
    try:
        yield
    except (OSError, SafetensorError, RuntimeError) as e:
        if _write_errno(e) not in _WRITE_ERRNOS:
            raise
        raise disk_error("the run's outputs", out_dir, e) from None


def _write_errno(e: BaseException) -> Optional[int]:
    """The errno of a failed write: OSError carries it; safetensors (SafetensorError) and torch.save (RuntimeError)
    only name it in their message, as "(os error 28)" and "file write failed" respectively."""
    if isinstance(e, OSError):
        return e.errno
    m = re.search(r"\(os error (\d+)\)", str(e))
    if m:
        return int(m.group(1))
    return errno.ENOSPC if "file write failed" in str(e) else None


def trainable_finite(run: Run) -> bool:
    """Whether every trained tensor is finite (a NaN or inf weight means the run diverged)."""
    with torch.no_grad():
        return all(bool(torch.isfinite(p).all()) for p in run.trainable)


def update_finite(run: Run, row: dict[str, Any]) -> bool:
    """Whether an update's loss and LR, and its gradient norm, are finite. With a grad scaler (fp16) an inf norm is
    how an overflowing step is skipped, not a divergence."""
    norm_ok = run.accelerator.scaler is not None or math.isfinite(row["grad_norm"])
    return math.isfinite(row["train_loss"]) and math.isfinite(row["lr"]) and norm_ok


def restore_checkpoint(run: Run, state: RunState) -> None:
    """When resuming, put the newest intact checkpoint under the output folder back into the run and `state`.

    Checkpoints whose files do not match their checksums are passed over with a warning naming them.
    """
    if not run.cfg.resume:
        return
    found = checkpoints.list_checkpoints(run.settings.ckpt_root)
    ckpt = None
    for candidate in reversed(found):
        problem = checkpoints.verify(candidate)
        if problem is None:
            ckpt = candidate
            break
        _log.warning("rangefinder: skipping checkpoint %s: %s; resuming from an earlier one", candidate, problem)
    if ckpt is None:
        if found:
            raise RangefinderError(
                f"cannot resume: no intact checkpoint under {run.settings.ckpt_root} (all {len(found)} fail their "
                "checksums, see the warnings above); start again in an empty folder"
            )
        return
    saved = checkpoints.load(ckpt, run.accelerator.process_index)
    _check_same_run(saved["state"], run)
    run.method.load_trainable_state_dict({k: v.to(run.device) for k, v in saved["weights"].items()})
    run.optimizer.load_state_dict(saved["optimizer"])
    if run.ema is not None and saved["ema"] is not None:
        run.ema.load_state_dict(saved["ema"])
    scaler = run.accelerator.scaler
    if saved["scaler"] is not None and scaler is not None:
        scaler.load_state_dict(saved["scaler"])
    _set_rng(saved["rng"], state.train_gen)
    st = saved["state"]
    state.update, state.micro_batches_done = st["update"], st["micro_batches_done"]
    state.loss_sum, state.loss_count = st["loss_since_row"]
    state.status = st["status"]
    state.log.restore(st["metrics_rows"], st["update_rows"])
    state.resumed_from = state.update


def _check_same_run(saved: dict[str, Any], run: Run) -> None:
    from rangefinder.models.loading import FAMILY_NAMES

    family = saved.get("family", "sd1")  # checkpoints from before families were recorded: SD 1.x/2.x
    if family != run.family.name:
        was, is_ = FAMILY_NAMES.get(family, family), FAMILY_NAMES.get(run.family.name, run.family.name)
        raise ConfigError(
            f"cannot resume: the checkpoint under {run.settings.ckpt_root} is from a {was} run but the base model "
            f"{run.sd.source} is {is_}; resume with the base model the run started from, or start in an empty folder"
        )
    now = {k: v for k, v in run.cfg.model_dump(mode="json").items() if k not in RESUMABLE_CHANGES}
    # A setting newer than the checkpoint counts as its default: the run trained as that default does.
    defaults = TrainingConfig().model_dump(mode="json")
    # Settings as written before a rename (use_8bit_adam: training.optimizer) read as today's.
    before = {k: v for k, v in migrate_training(saved["training"]).items() if k not in RESUMABLE_CHANGES}
    before.update({k: defaults[k] for k in now if k not in saved["training"] and k in defaults})
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    same_data = saved["total_updates"] == run.settings.plan.total_updates and saved["train_images"] == len(
        run.settings.train_items
    )
    same_buckets = saved.get("train_buckets") == _train_buckets(run)  # None both ways without bucketing
    if changed or not same_data or not same_buckets:
        what = ", ".join(f"training.{k}" for k in changed) or (
            "the training set" if same_data else "the training set's aspect-ratio buckets (data.*)")
        raise ConfigError(
            f"cannot resume: the checkpoint was written with different settings ({what}); "
            "resume with the same settings and data, or start in an empty folder"
        )


def _train_buckets(run: Run) -> Optional[dict[str, int]]:
    """Training images per aspect-ratio bucket ({"40x24": 5, ...}); None without bucketing."""
    settings = run.settings
    if settings.train_buckets is None or settings.train_bucket_of is None:
        return None
    names = [f"{w}x{h}" for w, h in settings.train_buckets]
    return {name: settings.train_bucket_of.count(i) for i, name in enumerate(names)}


def _rng_states(train_gen: torch.Generator) -> dict[str, Any]:
    """Every RNG state as tensors, ints and floats only, which `torch.load(weights_only=True)` reads back: Python's
    state is a tuple of ints; NumPy's legacy state is ('MT19937', (624,) uint32 keys, pos, has_gauss, gauss), whose
    key array is stored as an int64 tensor; the torch states are already uint8 tensors."""
    state = np.random.get_state(legacy=True)
    assert isinstance(state, tuple)  # legacy=True: the tuple form, not the dict
    kind, keys, pos, has_gauss, gauss = state
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "train_generator": train_gen.get_state(),
    }


def _set_rng(states: Optional[dict], train_gen: torch.Generator) -> None:
    if not states:
        return
    random.setstate(states["python"])
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    train_gen.set_state(states["train_generator"])


class OutDirLock:
    """One run at a time in an output folder: an exclusive flock on `OUT_DIR/.rangefinder.lock`, which records the
    holder's pid, host and start time for the error the next run gets. The kernel drops a flock when its process
    dies, so a run killed with SIGKILL leaves no lock that blocks its resume (the file stays; only the flock counts).
    flock works between processes of one host and, on most network file systems (NFS v4, Lustre), between hosts.
    A lock this process still holds for the folder (a train() that raised) belongs to the same owner: it is taken over.
    """

    def __init__(self, out_dir: Path, hold: bool = True) -> None:
        self.path, self._fd = Path(out_dir) / LOCK_NAME, None
        if hold:
            earlier = _held.pop(self.path.resolve(), None)
            if earlier is not None:
                earlier.release()
            self._fd = _open_lock(self.path)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(self._fd)
                self.release()
                raise _held_error(out_dir, holder) from None
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, json.dumps(info).encode(), 0)
            _held[self.path.resolve()] = self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


def check_out_dir_free(out_dir: Path) -> None:
    """Fail at once when another live run holds `out_dir` (a shared probe: processes of one run do not clash)."""
    path = Path(out_dir) / LOCK_NAME
    if path.resolve() in _held:  # this process's own, see OutDirLock
        return
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _held_error(out_dir, _holder(fd)) from None
    finally:
        os.close(fd)


_held: weakref.WeakValueDictionary[Path, OutDirLock] = weakref.WeakValueDictionary()


def _open_lock(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise disk_error("the run's lock file", path.parent, e) from None


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError):
        return "another process"


def _held_error(out_dir: Path, holder: str) -> ConfigError:
    return ConfigError(
        f"output folder {out_dir} is in use by another training run ({holder}); wait for it to finish or stop it, "
        "or choose another --out"
    )
