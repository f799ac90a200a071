"""Writing a run's checkpoint and resuming from one. The folder layout and the reader are in
rangefinder/formats/checkpoints.py; this module decides what goes in: the method's trained tensors, the optimizer,
EMA and grad-scaler states, every process's RNG states, the RunState, and which run it is (identity.py: a resume
continues only that run).

A save that cannot be written stops the run with one clear error (disk.py's rule) and leaves the previous checkpoint
as it was; weights that are no longer finite are not saved (divergence.py). The folder lock is outdir.py."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from safetensors import SafetensorError

from rangefinder.errors import RangefinderError
from rangefinder.formats import checkpoints
from rangefinder.training.disk import disk_problem
from rangefinder.training.divergence import trainable_finite
from rangefinder.training.identity import check_same_run, run_identity

if TYPE_CHECKING:
    from rangefinder.training.run import Run
    from rangefinder.training.state import RunState

_log = logging.getLogger(__name__)


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
    except (OSError, RuntimeError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        problem = disk_problem(f"checkpoint {tmp.name.removesuffix('.tmp')}", root, e)
        if problem is None:
            raise
        raise problem from None
    accelerator.wait_for_everyone()


def _main_parts(run: Run, state: RunState) -> dict[str, Any]:
    """What the main process writes, gathered (and copied to the CPU) before anything is written."""
    accelerator, update = run.accelerator, state.update
    with run.fp32_weights():  # bf16 weights (training.weights_dtype): their fp32 masters are what is kept
        weights = {k: v.cpu() for k, v in run.method.trainable_state_dict().items()}
    return dict(
        weights=weights,
        optimizer=run.optimizer.state_dict(),
        ema=run.ema.state_dict() if run.ema is not None else None,
        scaler=accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
        state={
            "update": update,
            "micro_batches_done": state.micro_batches_done,
            "epoch": run.stream.epochs_after(state.micro_batches_done),  # what an export of this checkpoint records
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
            "identity": run_identity(run),
            "started": state.started,  # what the deliverables' model spec names (RunState), kept across a resume
            "title": state.title,
        },
    )


def check_resume(run: Run) -> None:
    """When resuming, refuse the newest intact checkpoint if another run wrote it (identity.check_same_run), before
    anything in the output folder is rewritten (the curve CSVs are, when the run starts)."""
    ckpt = _resume_point(run, warn=False)
    if ckpt is not None:
        check_same_run(checkpoints.read_state(ckpt), run, _train_buckets(run))


def _resume_point(run: Run, warn: bool = True) -> Optional[Path]:
    """The newest intact checkpoint when resuming (None: none yet, or not resuming); those whose files do not match
    their checksums are passed over, with a warning naming each when `warn`."""
    if not run.cfg.resume:
        return None
    found = checkpoints.list_checkpoints(run.settings.ckpt_root, whole=False)  # one missing a file: named below
    damaged: list[str] = []
    for candidate in reversed(found):
        problem = checkpoints.verify(candidate)
        if problem is None:
            return candidate
        damaged.append(f"{candidate.name}: {problem}")
        if warn:
            _log.warning("rangefinder: skipping checkpoint %s: %s; resuming from an earlier one", candidate, problem)
    if found:
        # The error names what is wrong itself: check_resume looks first, without warnings, so none precede it.
        shown = "; ".join(damaged[:3]) + (f"; and {len(damaged) - 3} more" if len(damaged) > 3 else "")
        raise RangefinderError(
            f"cannot resume: no intact checkpoint under {run.settings.ckpt_root} (all {len(found)} fail their "
            f"checksums: {shown}); start again in an empty folder"
        )
    return None


def restore_checkpoint(run: Run, state: RunState) -> None:
    """When resuming, put the newest intact checkpoint under the output folder back into the run and `state`.

    Checkpoints whose files do not match their checksums are passed over with a warning naming them.
    """
    ckpt = _resume_point(run)
    if ckpt is None:
        return
    saved = checkpoints.load(ckpt, run.accelerator.process_index)
    check_same_run(saved["state"], run, _train_buckets(run))
    with run.fp32_weights():  # bf16 weights: into their fp32 masters, which the weights then follow
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
    # A checkpoint of an older rangefinder recorded neither: its run's start is unknown (not this resume's clock,
    # which the deliverables would name as the run's date), and its title falls back to the output folder's name, as
    # restore._spec_facts reads such a checkpoint.
    state.started, state.title = st.get("started", ""), st.get("title", state.title)
    state.resumed_from = state.update


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
