"""The prodigy_step LR finder's reading: the step size a Prodigy run ended on, as the LR to fine-tune at.

Prodigy (Mishchenko & Defazio 2023) estimates the distance to the solution, d, and steps with d x lr; at lr 1.0 its
final d x lr is its own estimate of the LR for this data and model. The engine logs it after each update as
`prodigy_d_lr` (updates.csv); an updates.csv written before that column existed has it as `lr_effective`, which
is now the step size the update took (the d from before it, times the bias correction). numpy only, like the rest
of `analysis`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

import numpy as np

from rangefinder.errors import RangefinderError

# Where a factor read from config.PRODIGY_STEP_FACTOR's table says it came from (config.RangefinderConfig's
# prodigy_step_factor_source starts with it); a factor the config sets says otherwise.
FACTOR_FROM_TABLE = "config.PRODIGY_STEP_FACTOR"

# prodigyopt's default d0, the estimate d starts from. d only grows, and it takes Prodigy tens of updates to move it
# (on the tiny model, the first growth comes at update 9): a run that ends on d0 has measured nothing.
PRODIGY_D0 = 1e-6


def step_size_estimates(updates: dict[str, np.ndarray]) -> np.ndarray:
    """Prodigy's d x lr after each update (updates.csv's prodigy_d_lr), the series the reading ends on; in a row
    without it (written before that column existed, when lr_effective was that same number; or by an optimizer
    without d, where lr_effective is its LR) the row's lr_effective."""
    effective = np.asarray(updates.get("lr_effective", ()), dtype=float)
    if "prodigy_d_lr" not in updates:
        return effective
    d_lr = np.asarray(updates["prodigy_d_lr"], dtype=float)
    return np.where(np.isnan(d_lr), effective, d_lr) if d_lr.shape == effective.shape else d_lr


@dataclass(frozen=True)
class ProdigyStep:
    step_size: float  # d x lr after the run's last update (prodigy_d_lr)
    lr: float  # Prodigy's lr, the multiplier of d (1.0)
    updates: int  # the updates the run took
    epochs: Optional[float]  # the epochs they came to
    base_val_loss: Optional[float]  # validation loss at update 0 (the base model)
    best_val_loss: Optional[float]  # the lowest validation loss of the run, and its update
    best_update: Optional[int]
    final_val_loss: Optional[float]  # at the last validation
    factor: float = 1.0  # the multiple of the step size the fine-tune trains at (config.prodigy_step_factor_for)
    factor_source: str = FACTOR_FROM_TABLE  # where the factor came from, in words

    @property
    def lr_trained(self) -> float:
        """The LR the fine-tune trains at: the step size times the factor."""
        return self.step_size * self.factor

    @property
    def d(self) -> float:
        """Prodigy's final estimate d (the step size over the multiplier)."""
        return self.step_size / self.lr

    def headline(self) -> str:
        """The decision in a sentence (the report's lead, the step run's description in MLflow)."""
        times = "" if self.factor == 1 else f"{self.factor:g} x "
        of = "" if self.factor == 1 else f" ({self.step_size:.3g})"
        return (f"Fine-tune at lr {self.lr_trained:.3g}: {times}the step size d x lr{of} a Prodigy run ended on after "
                f"{self.updates} updates (d = {self.d:.3g}, lr {self.lr:g}).")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "d": self.d, "lr_trained": self.lr_trained}


def read_prodigy_step(updates: dict[str, np.ndarray], curve: Optional[dict[str, np.ndarray]],
                      lr: float, factor: float = 1.0,
                      factor_source: str = FACTOR_FROM_TABLE) -> ProdigyStep:
    """The reading from the run's updates.csv (`updates`: its columns, update and prodigy_d_lr, or in an older file
    lr_effective, among them: step_size_estimates) and its validation curve (metrics.csv's columns, or None without
    validation), the fine-tune to train at `factor` times the step size (RangefinderConfig.prodigy_step_factor_for;
    `factor_source` says where it came from); RangefinderError when the last step size is not a positive number
    (no update was taken, or Prodigy's estimate broke down), or never left d0 (the run was too short for Prodigy to
    estimate anything)."""
    steps = step_size_estimates(updates)
    if steps.size == 0:
        raise RangefinderError("the Prodigy run took no update, so it has no step size to read; give the fine-tune "
                               "at least one update (finetune.epochs), or set lr_finder: range_test")
    step_size = float(steps[-1])
    if not (math.isfinite(step_size) and step_size > 0):
        raise RangefinderError(f"the Prodigy run ended on step size {step_size!r}, not a positive learning rate; "
                               "set lr_finder: range_test, or a fixed lr")
    if step_size <= PRODIGY_D0 * lr * (1 + 1e-6):
        raise RangefinderError(f"the Prodigy run's step size never grew from its starting estimate (d0 = "
                               f"{PRODIGY_D0:g}) in {steps.size} updates, so it measured no LR; lengthen the run "
                               "(finetune.epochs: Prodigy needs tens of updates to move d), or set lr_finder: "
                               "range_test")
    epoch = updates.get("epoch")
    base = best = final = None
    best_update = None
    if curve is not None and len(curve.get("val_loss", ())):
        val = np.asarray(curve["val_loss"], dtype=float)
        at = np.asarray(curve["update"], dtype=float)
        ok = np.isfinite(val)
        if ok.any():
            i = int(np.argmin(np.where(ok, val, np.inf)))
            best, best_update = float(val[i]), int(at[i])
            final = float(val[ok][-1])
            base = float(val[0]) if at[0] == 0 and ok[0] else None
    return ProdigyStep(step_size=step_size, lr=float(lr), updates=int(np.asarray(updates["update"])[-1]),
                       epochs=float(epoch[-1]) if epoch is not None and len(epoch) else None, base_val_loss=base,
                       best_val_loss=best, best_update=best_update, final_val_loss=final, factor=float(factor),
                       factor_source=factor_source)
