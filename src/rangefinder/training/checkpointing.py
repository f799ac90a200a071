"""Writing a run's checkpoint and resuming from one. The folder layout and the reader are in
rangefinder/formats/checkpoints.py; this module decides what goes in: the method's trained tensors, the optimizer,
EMA and grad-scaler states, every process's RNG states, and the RunState."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from rangefinder.errors import ConfigError
from rangefinder.formats import checkpoints

if TYPE_CHECKING:
    from rangefinder.training.setup import Run
    from rangefinder.training.state import RunState

# Settings a resume may change: they do not change what the run computes.
RESUMABLE_CHANGES = {"resume", "checkpoint_every_updates", "keep_checkpoints", "cache_dir"}


def save_checkpoint(run: Run, state: RunState) -> None:
    """The checkpoint of `state.update` (every process writes its RNG states; the main process the rest)."""
    accelerator, root, update = run.accelerator, run.settings.ckpt_root, state.update
    if accelerator.is_main_process:
        checkpoints.begin(root, update)
    accelerator.wait_for_everyone()
    tmp = checkpoints.tmp_folder(root, update)
    checkpoints.write_rng(tmp, accelerator.process_index, _rng_states(state.train_gen))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        checkpoints.write_main(
            tmp,
            weights={k: v.cpu() for k, v in run.method.trainable_state_dict().items()},
            optimizer=run.optimizer.state_dict(),
            ema=run.ema.state_dict() if run.ema is not None else None,
            scaler=accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
            state={
                "update": update,
                "micro_batches_done": state.micro_batches_done,
                "total_updates": run.settings.plan.total_updates,
                "train_images": len(run.settings.train_items),
                "loss_since_row": [state.loss_sum, state.loss_count],
                "status": state.status,
                "training": run.cfg.model_dump(mode="json"),
                "metrics_rows": state.log.metrics_rows,
                "update_rows": state.log.update_rows,
            },
        )
        checkpoints.commit(tmp, run.cfg.keep_checkpoints)
    accelerator.wait_for_everyone()


def restore_checkpoint(run: Run, state: RunState) -> None:
    """When resuming, put the newest whole checkpoint under the output folder back into the run and `state`."""
    ckpt = checkpoints.latest_checkpoint(run.settings.ckpt_root) if run.cfg.resume else None
    if ckpt is None:
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
    before = {k: v for k, v in saved["training"].items() if k not in RESUMABLE_CHANGES}
    now = {k: v for k, v in run.cfg.model_dump(mode="json").items() if k not in RESUMABLE_CHANGES}
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    same_data = saved["total_updates"] == run.settings.plan.total_updates and saved["train_images"] == len(
        run.settings.train_items
    )
    if changed or not same_data:
        what = ", ".join(f"training.{k}" for k in changed) or "the training set"
        raise ConfigError(
            f"cannot resume: the checkpoint was written with different settings ({what}); "
            "resume with the same settings and data, or start in an empty folder"
        )


def _rng_states(train_gen: torch.Generator) -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "train_generator": train_gen.get_state(),
    }


def _set_rng(states: Optional[dict], train_gen: torch.Generator) -> None:
    if not states:
        return
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    train_gen.set_state(states["train_generator"])
