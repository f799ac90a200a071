"""The divergence checks the loop makes after each update and before each save: a run whose loss, LR, gradient
norm or weights are no longer finite has diverged (it stops, and its non-finite weights are never saved). The
ramp's stop on a validation curve that climbs is validation.diverged."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rangefinder.training.run import Run


def trainable_finite(run: Run) -> bool:
    """Whether every trained tensor is finite (a NaN or inf weight means the run diverged)."""
    with torch.no_grad():
        return all(bool(torch.isfinite(p).all()) for p in run.trainable)


def update_finite(run: Run, row: dict[str, Any]) -> bool:
    """Whether an update's loss and LR, and its gradient norm, are finite. With a grad scaler (fp16) an inf norm is
    how an overflowing step is skipped, not a divergence."""
    norm_ok = run.accelerator.scaler is not None or math.isfinite(row["grad_norm"])
    return math.isfinite(row["train_loss"]) and math.isfinite(row["lr"]) and norm_ok
