"""Curves built from formulas, with their true bounds: for tests, the benchmark of the analysis and the docs' plots.

An LR range-test curve here is, in u = log10(lr),

    loss(u) = base - drop * sigmoid((u - u_fall) / fall_width) + rise * softplus((u - u_rise) / rise_width)

(a descent centred at lr_fall, and from about lr_rise a rise; rise = 0 never turns up). The *true* bounds follow
the analysis' own definitions (lr_bounds.LOWER_FRACTION / UPPER_FRACTION) on the noiseless curve over the
sweep, so a test measures the estimator, not a difference of definitions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from rangefinder.analysis.lr_bounds import LOWER_FRACTION, UPPER_FRACTION


@dataclass(frozen=True)
class RangeTestShape:
    base: float = 0.20  # loss at lr -> 0 (MSE-like, as SD's noise-prediction loss)
    drop: float = 0.04
    lr_fall: float = 1e-5
    fall_width: float = 0.3  # decades
    rise: float = 0.0
    lr_rise: float = 1e-3
    rise_width: float = 0.25  # decades

    def loss(self, lr: np.ndarray) -> np.ndarray:
        lr = np.asarray(lr, dtype=float)
        with np.errstate(divide="ignore"):
            u = np.where(lr > 0, np.log10(np.maximum(lr, 1e-300)), -np.inf)
        fall = 1.0 / (1.0 + np.exp(-(u - math.log10(self.lr_fall)) / self.fall_width))
        z = (u - math.log10(self.lr_rise)) / self.rise_width
        up = np.where(z > 30, z, np.log1p(np.exp(np.minimum(z, 30))))
        return self.base - self.drop * fall + self.rise * up


def lr_sweep(
    n: int, lr_min: float = 1e-7, lr_max: float = 1e-2, ramp: str = "exp", baseline: bool = True
) -> np.ndarray:
    """The LRs at which a range test validates: n points from lr_min to lr_max, after a baseline at 0."""
    lr = np.geomspace(lr_min, lr_max, n) if ramp == "exp" else np.linspace(lr_min, lr_max, n)
    return np.concatenate([[0.0], lr]) if baseline else lr


def true_lr_bounds(shape: RangeTestShape, lr_min: float, lr_max: float, ramp: str = "exp",
                   start: Optional[float] = None) -> tuple[float, float]:
    """(lr_low, lr_high) of the noiseless curve over [lr_min, lr_max], by the analysis' definitions.

    `start` is the loss the drop is measured from (default: the curve at lr_min; a baseline at lr 0 gives
    `shape.base`)."""
    grid = np.geomspace(lr_min, lr_max, 20001) if ramp == "exp" else np.linspace(lr_min, lr_max, 20001)
    f = shape.loss(grid)
    f0 = f[0] if start is None else start
    i_min = int(np.argmin(f))
    d = f0 - f[i_min]
    low = grid[int(np.argmax(f[: i_min + 1] <= f0 - LOWER_FRACTION * d))]
    high = grid[int(np.argmax(f[: i_min + 1] <= f[i_min] + UPPER_FRACTION * d))]
    return float(low), float(high)


def noisy(clean: np.ndarray, sigma: float, seed: int, spikes: int = 0, spike_size: float = 8.0) -> np.ndarray:
    """clean + Gaussian noise of s.d. sigma, plus `spikes` upward outliers of spike_size * sigma at seeded
    positions away from both ends."""
    rng = np.random.default_rng(seed)
    y = clean + sigma * rng.standard_normal(clean.shape)
    if spikes:
        where = rng.choice(np.arange(2, clean.size - 2), size=spikes, replace=False)
        y[where] += spike_size * sigma
    return y


@dataclass(frozen=True)
class ConstantRunShape:
    """Validation loss of a constant-LR fine-tune against epochs: a fall with time constant `tau` epochs, then a
    linear overfitting rise from `overfit_from` epochs (rise 0: never rises)."""

    base: float = 0.20
    drop: float = 0.04
    tau: float = 3.0
    overfit_from: float = 12.0
    rise: float = 0.002  # loss per epoch after overfit_from

    def loss(self, epoch: np.ndarray) -> np.ndarray:
        e = np.asarray(epoch, dtype=float)
        return self.base - self.drop * (1 - np.exp(-e / self.tau)) + self.rise * np.maximum(e - self.overfit_from, 0)


def true_step_window(shape: ConstantRunShape, epochs: float, tolerance: float) -> tuple[float, float, float]:
    """(best_epoch, window_start_epoch, window_end_epoch) of the noiseless curve with a relative tolerance."""
    grid = np.linspace(0, epochs, 20001)
    f = shape.loss(grid)
    i = int(np.argmin(f))
    inside = f <= f[i] * (1 + tolerance)
    lo = i
    while lo > 0 and inside[lo - 1]:
        lo -= 1
    hi = i
    while hi < grid.size - 1 and inside[hi + 1]:
        hi += 1
    return float(grid[i]), float(grid[lo]), float(grid[hi])
