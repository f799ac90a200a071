"""The zoom policy: when the first LR range test's curve cannot be read well enough, the range of a second one.

When the curve is censored (still falling at an end of the sweep) or too few measurements lie between the bounds,
the LR range test step proposes the range of a second test ("zoom"), derived from the first:

- too few points between ok bounds: the bounds widened by `ZOOM_MARGIN` on each side (more points land inside);
- still falling at the top (upper_censored): from the lower bound (less `ZOOM_MARGIN`) up to `ZOOM_EXTEND` x the
  old top;
- already falling at the bottom (lower_censored): from `1/ZOOM_EXTEND` x the old bottom up to the upper bound (plus
  `ZOOM_MARGIN`: a sweep that stops right at the old upper bound is still falling at its top, and is read as
  upper-censored);
- rising from the start: the decades below the old range, but when the lowest point lies inside the sweep (a dip
  too narrow to read, then the rise) from a decade lower to a little past that point; diverged: the range below
  where it blew up (from the bottom to a decade past the lowest point, or, when that point lies in the top decade
  and so would give the first sweep again, the decades below);
- no descent: one decade higher when the curve stayed flat (nothing was learned yet), but when the loss ended above
  where it started (the top of the sweep made the model worse, as when the base model has little left to learn) a
  decade lower, up to a little past the lowest point: widening upwards there only finds the blow-up.

A second test never asks for a third: if its curve still cannot be read the step stops with the analysis' advice.
"""

from __future__ import annotations

import math
from typing import Any, Optional

ZOOM_MARGIN = 3.0  # x/÷ around ok bounds that hold too few points
ZOOM_EXTEND = 10.0  # one decade past a censored end


def points_between(lr: Any, val_loss: Any, lr_low: Optional[float], lr_high: Optional[float]) -> int:
    """The measurements between the bounds (inclusive): rows whose validation loss is finite. A NaN or inf row is no
    point of the curve (the reading leaves it out), so it must not make a curve with too few points look read."""
    if lr_low is None or lr_high is None:
        return 0
    return sum(1 for x, y in zip(lr, val_loss, strict=True)
               if math.isfinite(float(y)) and lr_low <= float(x) <= lr_high)


def ended_above_start(val_loss: Any) -> bool:
    """The last points of the sweep (median of up to 3 finite ones) are above its first: the top LRs did harm."""
    finite = [float(v) for v in val_loss if math.isfinite(float(v))]
    if len(finite) < 3:
        return False
    tail = sorted(finite[-3:])[1]
    return tail > finite[0]


def zoom_range(status: str, flags: list[str], lr_low: Optional[float], lr_high: Optional[float],
               lr_min: float, lr_max: float, n_between: int, min_points: int,
               lr_at_min: Optional[float] = None, rose_at_top: bool = False) -> Optional[tuple[float, float]]:
    """The range of a second test, or None when the first curve is readable enough (see the module docstring)."""
    if status == "ok":
        assert lr_low is not None and lr_high is not None
        if "upper_censored" in flags:
            return lr_low / ZOOM_MARGIN, lr_max * ZOOM_EXTEND
        if "lower_censored" in flags:
            return lr_min / ZOOM_EXTEND, lr_high * ZOOM_MARGIN
        if n_between < min_points:
            return max(lr_low / ZOOM_MARGIN, lr_min / ZOOM_EXTEND), lr_high * ZOOM_MARGIN
        return None
    if status == "rising_from_start":
        if lr_at_min is not None and lr_min < lr_at_min < lr_max:
            # Its lowest point lies inside the sweep: the loss dipped before it rose, in a valley too narrow for the
            # reading. As for a no_descent that ended worse: from a decade lower to a little past that point.
            return lr_min / ZOOM_EXTEND, lr_at_min * ZOOM_MARGIN
        return lr_min / ZOOM_EXTEND ** 2, lr_min
    if status == "diverged":
        if lr_at_min is not None and lr_min < lr_at_min < lr_max / ZOOM_EXTEND:
            # It fell before it blew up: spend the second sweep on the part below the blow-up.
            return lr_min, lr_at_min * ZOOM_EXTEND
        # No lowest point a decade or more below the top (none, or one in the top decade: read as noise, since the
        # test found no real descent): the decades below. Widening from that point would be the first sweep again,
        # which is deterministic and blows up the same way (LoRA `stripes` seed 4 in bench.versus, 2026-11-27).
        return lr_min / ZOOM_EXTEND, max(lr_max / ZOOM_EXTEND ** 2, lr_min * ZOOM_EXTEND)
    if status == "no_descent":
        if not rose_at_top:
            return lr_min, lr_max * ZOOM_EXTEND
        top = lr_at_min * ZOOM_MARGIN if lr_at_min is not None and lr_min < lr_at_min < lr_max else lr_min
        return lr_min / ZOOM_EXTEND, top
    return None
