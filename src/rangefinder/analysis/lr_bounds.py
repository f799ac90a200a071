"""LR bounds from an LR range test: where validation loss starts to fall, where it stops, and how sure we are.

The range test follows Smith 2017 ("Cyclical Learning Rates for Training Neural Networks", arXiv 1506.01186,
section 3.3): the LR climbs from ~0 to too high while the loss is measured; the lower bound is where it starts to
fall and the upper bound where it flattens or turns up. fastai's `lr_find` and torch-lr-finder turn such a curve into
one number, the steepest slope or the minimum / 10, on a one-sided EMA of the training loss. Both picks are
noise-sensitive (the steepest point of a noisy curve is mostly the noisiest point) and the EMA lags, shifting
the curve to higher LRs. This module instead:

1. reads the rows in LR order, leaves out (and counts) a NaN/inf between finite rows, keeps the points up to a
   non-finite run at the end, and cuts a tail that has exploded (each point above
   `divergence_factor` x the best before it); when the curve dips and then climbs back above where it started,
   the bounds are read on the part up to that point if a descent is found there (`curves.rise_cut`: a rise many
   times the size of the descent otherwise drowns a small, clean descent in the permutation test);
2. smooths with a centred robust LOWESS (curves.py) in log-LR for exponential ramps and in LR for linear ones, its
   span chosen by cross-validation;
3. calls a descent real only when a seeded permutation test says the best drop of the smoothed curve below its
   start is larger than shuffled losses give (`SIGNIFICANCE`); the per-point noise is estimated from the data
   for the signal-to-noise ratio and the standard errors behind the flags;
4. puts the lower bound where the smoothed curve has fallen `LOWER_FRACTION` of its total drop below its start and
   the upper bound where it first comes within `UPPER_FRACTION` of the drop above its minimum, both interpolated
   between measurements; the midpoint lies `mid_position` of the way from the lower to the upper bound on the
   sweep's axis (log LR for an exp ramp: 0.5 would be the geometric mean), or, by the `midpoint` rule, at the
   geometric or the arithmetic mean of the bounds (all three are reported);
5. repeats 2-4 on a seeded residual bootstrap (Davison & Hinkley 1997, section 7.3): the bounds are the medians
   over resampled curves (bagging), which halves the misses at heavy noise; the replicates also give an 80%
   interval of the midpoint and the share of resampled curves that still show a descent, folded with the
   signal-to-noise, the points inside the bounds and the width into a quality score.

The classic suggestions (`lr_steepest`, `lr_min_div10`) are reported next to ours for comparison, computed the way
those tools do but on the raw validation points (an EMA over a few validation points would lag by several).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import numpy as np

from rangefinder.analysis.curves import (
    MAX_CURVE_POINTS,
    Ramp,
    bin_means,
    check_reading_settings,
    choose_span,
    crossing,
    divergence_cut,
    end_slope,
    finite_prefix,
    infer_ramp,
    lowess,
    merge_ties,
    noise_sigma,
    numbers,
    order_rows,
    reading_notes,
    rise_cut,
    trend_test,
)
from rangefinder.defaults import DIVERGENCE_FACTOR, LOW_QUALITY, MID_POSITION, MIDPOINT, MIDPOINT_RULES
from rangefinder.errors import RangefinderError

Status = Literal["ok", "no_descent", "rising_from_start", "diverged"]
Midpoint = Literal["tuned", "geometric", "arithmetic"]

# A descent (or a rise) counts when a permutation test says so at this level: the curve's best smoothed drop below
# its start is compared with the same statistic on the same losses in shuffled order, which is what pure noise
# looks like. The test is exact for any number of points and needs no noise model; a normal-theory threshold on
# the same statistic, with the noise estimated from 10 points, said "ok" on flat noise 3-5% of the time.
SIGNIFICANCE = 0.01
PERMUTATIONS = 299
# Descriptive signal-to-noise a bootstrap replicate needs to count as still showing the descent.
REPLICATE_SNR = 2.0
# Lower bound: the smoothed curve has fallen 20% of its total drop below its start ("starts to fall").
LOWER_FRACTION = 0.20
# Upper bound: the smoothed curve has come within 20% of the drop above its minimum ("flattens").
UPPER_FRACTION = 0.20
# Resampled curves for the interval and the stability score; the seed makes the same CSV give the same JSON.
BOOTSTRAP_REPLICATES = 200
# The part before the climb back above the start is read on its own only when it holds this many points: on
# shorter prefixes the permutation test has too few orderings, and the pick of the cut would bias it.
RISE_CUT_MIN_POINTS = 6

FLAG_ORDER = ["lower_censored", "upper_censored", "rose_after_min", "diverged", "low_quality"]
FLAG_ADVICE: dict[str, str] = {
    "low_quality": (
        f"Quality under {LOW_QUALITY:g}: in the bench (bench/RESULTS.md), discovery at such scores missed the best "
        "constant LR of a grid sweep by more than 3% more often than above it. Check lr_mid before a long run: "
        "re-run the range test zoomed on the bounds (lr_low / 3 to lr_high x 3, with more validation points), or "
        "train a short grid of constant LRs across the bounds (e.g. lr_low, lr_mid, lr_high) and keep the best."
    ),
    "upper_censored": (
        "Still falling at the end of the sweep: the real upper bound lies above the range tested. "
        "Raise lr_max (e.g. x10) and run the range test again."
    ),
    "lower_censored": (
        "Already falling at the start of the sweep: the descent may begin below the range tested. "
        "Lower lr_min (e.g. /10) and run the range test again."
    ),
    "rose_after_min": (
        "Validation loss rises again after its minimum: LRs above the upper bound make the model worse. "
        "Nothing to do; this is the turn the upper bound is meant to find."
    ),
    "diverged": (
        "The loss exploded (NaN, inf or more than 4x its best) near the end; those points were left out. "
        "Nothing to do if the bounds are ok; otherwise lower lr_max."
    ),
}

STATUS_ADVICE: dict[str, str] = {
    "ok": "A real descent was found; train at lr_mid, or cycle between lr_low and lr_high.",
    "no_descent": (
        "Validation loss never fell by more than its noise. Validate more often during the sweep (more points), "
        "widen it (lower lr_min, raise lr_max), or use more validation images to lower the noise."
    ),
    "rising_from_start": (
        "Validation loss rose from the very first LRs: even lr_min is too high. Lower lr_min and lr_max "
        "(e.g. /100) and run again."
    ),
    "diverged": (
        "The loss exploded before any real descent. Lower lr_max (and lr_min) by 10-100x and run again; "
        "check the data and the loss if it persists."
    ),
}


@dataclass
class LRCurveFit:
    """The curve as the analysis saw it, for plots and reports (not part of the JSON)."""

    ramp: Ramp
    lr: np.ndarray  # (n,) LRs of the points used (a baseline keeps lr 0)
    x: np.ndarray  # (n,) the smoothing axis: log(lr) (baseline one step left of the first) or lr
    val_loss: np.ndarray  # (n,) raw
    smoothed: np.ndarray  # (n,)
    dropped_lr: np.ndarray  # points after a NaN/explosion, as measured (non-finite losses kept as NaN)
    dropped_val_loss: np.ndarray
    stabilize_loss: Optional[np.ndarray] = None  # (n_all,) aligned with all_lr, raw
    all_lr: Optional[np.ndarray] = None
    dropped_label: str = "left out (NaN / exploded)"


@dataclass
class LRBounds:
    status: Status
    ramp: Ramp
    lr_low: Optional[float]
    lr_high: Optional[float]
    lr_mid: Optional[float]
    lr_mid_ci80: Optional[list[float]]
    flags: list[str]
    quality: float
    quality_label: Literal["high", "medium", "low"]
    quality_parts: dict[str, float]
    points_used: int
    points_dropped: int
    snr: float  # the drop (start minus minimum of the smoothed curve) in standard errors of that difference
    p_descent: float  # permutation p-value of the descent (small: real)
    noise_sigma: float  # per-point validation-loss noise (s.d.), from the data
    drop: float  # start minus minimum of the smoothed curve, in loss units
    lr_at_min: Optional[float]  # LR of the smoothed minimum
    lr_steepest: Optional[float]
    lr_min_div10: Optional[float]
    span: int  # LOWESS neighbours
    degree: int  # LOWESS local polynomial degree
    advice: list[str]
    mid_position: float = MID_POSITION  # where the "tuned" midpoint lies between the bounds (0: lr_low, 1: lr_high)
    midpoint: Midpoint = MIDPOINT  # the rule lr_mid follows (defaults.MIDPOINT_RULES)
    midpoints: Optional[dict[str, float]] = None  # lr_mid under each rule, for comparison
    points_non_finite: int = 0  # rows left out for a NaN/inf between finite rows (counted in points_dropped too)
    reordered: bool = False  # the rows were not in LR order and were read sorted
    rows_per_point: int = 1  # > 1: a long curve read as means of this many consecutive rows (MAX_CURVE_POINTS)
    rows_merged: int = 0  # rows read as one point with another row at the same lr (curves.merge_ties)
    reading: list[str] = field(default_factory=list)  # what was done to the rows before reading (also in advice)
    fit: Optional[LRCurveFit] = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The JSON of `rangefinder analyze-lr` (NaN becomes null)."""
        out = {}
        for k, v in self.__dict__.items():
            if k == "fit":
                continue
            out[k] = _jsonable(v)
        return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, (float, np.floating)):
        return None if not math.isfinite(float(v)) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(i) for i in v]
    if isinstance(v, dict):
        return {k: _jsonable(i) for k, i in v.items()}
    return v


# ---------------------------------------------------------------------------------------------------------------
# The decision on one smoothed curve (also run on each bootstrap replicate)


@dataclass
class _Reading:
    snr: float
    drop: float
    i_min: int
    x_low: Optional[float] = None
    x_high: Optional[float] = None
    flags: tuple[str, ...] = ()


def _contrast_se_from(kernel: np.ndarray, i: int, sigma: float) -> np.ndarray:
    """s.e. of fitted[i] - fitted[k] for every k (0 at k == i)."""
    d = kernel[i][None, :] - kernel
    return sigma * np.sqrt((d * d).sum(-1))


def _read(x: np.ndarray, f: np.ndarray, slope: np.ndarray, kernel: np.ndarray, slope_kernel: np.ndarray,
          sigma: float) -> _Reading:
    """Bounds and flags of one smoothed curve f on axis x; `kernel` gives the standard errors."""
    n = x.size
    i_min = int(np.argmin(f))
    drop = float(f[0] - f[i_min])
    se_min = _contrast_se_from(kernel, i_min, sigma)
    snr = drop / se_min[0] if se_min[0] > 0 else 0.0
    r = _Reading(snr=float(snr), drop=drop, i_min=i_min)
    if drop <= 0:
        return r
    # Noise floors on both thresholds: "has started to fall" must be more than noise below the start, and the
    # minimum of a noisy smoothed curve lies below the truth (it is the lowest of many), so "within reach of the
    # minimum" allows for two of its standard errors. On a noiseless curve only the fractions remain.
    se_start = _contrast_se_from(kernel, 0, sigma)
    fell = np.maximum(LOWER_FRACTION * drop, 2 * se_start)
    # The crossing nearest the minimum, found walking back from it: a noise dip on a long flat start must not
    # pass for the start of the descent.
    above = np.flatnonzero(f[: i_min + 1] > f[0] - fell[: i_min + 1])
    x_low = None
    if above.size and above[-1] < i_min:
        k = int(above[-1]) + 1  # first point of the final run below the level
        x_low = crossing(x, f, f[0] - fell[k], k - 1, k)
    elif not above.size:
        x_low = float(x[0])
    se_at_min = sigma * math.sqrt(float((kernel[i_min] ** 2).sum()))
    near = min(f[i_min] + max(UPPER_FRACTION * drop, 2 * se_at_min), f[0] - (fell[i_min] if i_min else 0))
    x_high = crossing(x, f, near, 0, i_min)
    if x_low is not None and x_high is not None and x_high < x_low:
        x_high = x_low
    flags = []
    # Fell a fifth of the drop within the first steps: the descent may have begun before lr_min.
    if x_low is not None and x_low <= x[min(2, n - 1) if n >= 8 else 1]:
        flags.append("lower_censored")
    # Minimum at the end and still clearly falling there: a sweep a tenth longer would lower the minimum by at
    # least half the upper threshold, moving the upper bound.
    # The slope is a straight-line fit over the last fifth of the curve: the edge slope of a narrow local fit
    # scatters as much as it measures.
    if i_min >= n - max(2, math.ceil(0.1 * n)) and x_high is not None:
        falling, se_slope = end_slope(x, f, sigma)
        falling = -falling
        if falling > 2 * se_slope and falling * 0.1 * np.ptp(x) >= 0.5 * UPPER_FRACTION * drop:
            flags.append("upper_censored")
    rise = f[n - 1] - f[i_min]
    if i_min < n - 1 and rise > UPPER_FRACTION * drop and rise > 2 * se_min[n - 1]:
        flags.append("rose_after_min")
    r.x_low, r.x_high, r.flags = x_low, x_high, tuple(flags)
    return r


# ---------------------------------------------------------------------------------------------------------------
# Public entry point


def analyze_lr_curve(
    lr: Any,
    val_loss: Any,
    *,
    ramp: Optional[Ramp] = None,
    stabilize_loss: Any = None,
    seed: int = 0,
    divergence_factor: Optional[float] = DIVERGENCE_FACTOR,
    bootstrap: int = BOOTSTRAP_REPLICATES,
    rise_cut_points: Optional[int] = RISE_CUT_MIN_POINTS,
    mid_position: float = MID_POSITION,
    midpoint: Midpoint = MIDPOINT,
    _turns_up_after: bool = False,
) -> LRBounds:
    """Read LR bounds off a range-test curve: one (lr, val_loss) per validation, read in LR order.

    `ramp` is `exp` or `linear` (None: inferred from the LR spacing). A baseline at lr 0 is used as the start.
    `rise_cut_points` None reads the whole curve even when it climbs back above its start (step 1).
    `midpoint` picks the rule for lr_mid: "tuned" places it `mid_position` of the way from lr_low to lr_high on
    the sweep's axis (0: lr_low, 1: lr_high), "geometric" at sqrt(lr_low * lr_high), "arithmetic" at their mean.
    `divergence_factor`: the multiple of the best loss past which the rest of the curve is read as diverged (above
    1; None: never). Raises RangefinderError when the arrays differ in length or hold fewer than 3 finite losses, or
    for a setting outside its range.
    """
    lr_all, y_all = numbers("lr", lr), numbers("val_loss", val_loss)
    if lr_all.shape != y_all.shape:
        raise RangefinderError(f"lr and val_loss differ in length ({lr_all.size} vs {y_all.size}); pass one per row")
    negative = np.flatnonzero(lr_all < 0)
    if negative.size:
        # A learning rate below 0 climbs the loss: no sweep sets one. Read as the start of a linear ramp it gave
        # negative bounds with status ok; on a log axis it sat with the baselines and hid the descent.
        raise RangefinderError(
            f"{negative.size} of {lr_all.size} rows {'has' if negative.size == 1 else 'have'} a negative lr (the "
            f"first: {lr_all[negative[0]]:g}); a range test's LRs are 0 (a baseline) or above; pass the metrics.csv "
            "a training run wrote"
        )
    n_finite = int(np.sum(np.isfinite(y_all) & np.isfinite(lr_all)))
    if n_finite < 3:
        blown = np.flatnonzero(np.isfinite(lr_all) & ~np.isfinite(y_all))
        # The lowest LR whose loss is not finite (the rows need not be in LR order).
        at = float(lr_all[blown].min()) if blown.size else None
        if at is not None and not np.any(np.isfinite(y_all) & (lr_all < at)):
            # Not finite where the sweep began (the baseline at lr 0, before any update): no LR diverged it, and
            # ending the sweep lower would not help.
            raise RangefinderError(
                f"the validation loss is not finite at lr {at:g}, the sweep's lowest, before any LR could make it "
                "diverge; the model gives no finite loss: check the base model, and set training.mixed_precision no "
                "where fp16 overflows"
            )
        if at is not None:
            # A sweep that diverged early: more validations would not help, and "validate more often" sent the user
            # the wrong way; the LRs it reached are the fix.
            raise RangefinderError(
                f"the sweep diverged at lr {at:g} (its validation loss stopped being finite there), "
                f"leaving {n_finite} finite (lr, val_loss) point{'' if n_finite == 1 else 's'}; a range test needs "
                f"at least 3: sweep a range that ends below {at:g} (lr_range_test.lr_max, and lr_min under it)"
            )
        raise RangefinderError(
            f"the curve has {n_finite} finite (lr, val_loss) points; a range test needs at least 3 "
            "(validate more often during the sweep)"
        )
    distinct = np.unique(lr_all[np.isfinite(lr_all) & np.isfinite(y_all)])
    if distinct.size < 3:
        # A constant-LR run's curve (the fine-tune's metrics.csv) read as a range test said "no descent: validate
        # more often", which no number of validations changes.
        raise RangefinderError(
            f"the curve has {distinct.size} distinct lr value{'s' if distinct.size != 1 else ''} "
            f"({', '.join(f'{v:g}' for v in distinct)}); a range test's LR climbs through at least 3. For a "
            "constant-LR run's curve, use select-steps"
        )
    stab_all = None
    if stabilize_loss is not None:
        stab_all = numbers("stabilize_loss", stabilize_loss)
        if stab_all.shape != lr_all.shape:
            raise RangefinderError(f"stabilize_loss has {stab_all.size} values for {lr_all.size} LRs; pass one per row")
    if ramp is None:
        ramp = infer_ramp(lr_all)
    if ramp not in ("exp", "linear"):
        raise RangefinderError(f"ramp must be 'exp' or 'linear' (got {ramp!r})")
    if not 0.0 <= mid_position <= 1.0:
        raise RangefinderError(f"mid_position must lie in [0, 1] (0: lr_low, 1: lr_high); got {mid_position!r}")
    if midpoint not in MIDPOINT_RULES:
        raise RangefinderError(f"midpoint must be one of {', '.join(MIDPOINT_RULES)} (got {midpoint!r})")
    check_reading_settings(seed, divergence_factor)

    # --- 0. the rows in LR order, without the NaN/inf ones that finite rows follow
    rows = order_rows(lr_all, y_all)
    n_rows = lr_all.size
    lr_all, y_all = lr_all[rows.index], y_all[rows.index]
    stab_all = None if stab_all is None else stab_all[rows.index]
    bounds = _read_curve(lr_all, y_all, stab_all, ramp=ramp, seed=seed, divergence_factor=divergence_factor,
                         bootstrap=bootstrap, rise_cut_points=rise_cut_points, mid_position=mid_position,
                         midpoint=midpoint, _turns_up_after=_turns_up_after)
    bounds.points_dropped = int(n_rows - bounds.points_used)
    bounds.points_non_finite, bounds.reordered = rows.non_finite, rows.reordered
    bounds.rows_merged = int(lr_all.size - np.unique(lr_all).size)
    bounds.reading = reading_notes(rows, n_rows, bounds.rows_per_point, "lr", bounds.rows_merged)
    bounds.advice = bounds.advice + bounds.reading
    return bounds


def _read_curve(lr_all: np.ndarray, y_all: np.ndarray, stab_all: Optional[np.ndarray], *, ramp: Ramp, seed: int,
                divergence_factor: Optional[float], bootstrap: int, rise_cut_points: Optional[int],
                mid_position: float, midpoint: Midpoint, _turns_up_after: bool) -> LRBounds:
    """Steps 1-5 on rows in LR order (NaN/inf ones only as a run at the end)."""
    # --- 1. cut at the non-finite run at the end and at an explosion
    n_ok = finite_prefix(lr_all, y_all)
    n_ok = divergence_cut(y_all[:n_ok], divergence_factor) if divergence_factor else n_ok
    n_rise = rise_cut(y_all[:n_ok], rise_cut_points) if rise_cut_points else n_ok
    if n_rise < n_ok:
        head = _read_curve(lr_all[:n_rise], y_all[:n_rise], None, ramp=ramp, seed=seed, divergence_factor=None,
                           bootstrap=bootstrap, rise_cut_points=None, mid_position=mid_position,
                           midpoint=midpoint, _turns_up_after=True)
        if head.status == "ok":
            return _with_tail(head, lr_all, y_all, stab_all, n_rise, exploded=n_ok < lr_all.size)
    lr_u, y = lr_all[:n_ok], y_all[:n_ok]
    if ramp == "exp":
        # Leading baseline rows (lr <= 0) sit one step left of the first LR on the log axis; a 0 LR behaves like
        # a very small one. Later non-positive LRs cannot be placed on a log axis and are left out.
        keep = np.ones(n_ok, dtype=bool)
        n_base = 0
        while n_base < n_ok and lr_u[n_base] <= 0:
            n_base += 1
        keep[n_base:] = lr_u[n_base:] > 0
        lr_u, y = lr_u[keep], y[keep]
    dropped = n_ok < lr_all.size
    fit_dropped_lr, fit_dropped_y = lr_all[n_ok:], y_all[n_ok:]

    n_used = lr_u.size
    lr_u, y = merge_ties(lr_u, y)
    x = _axis(lr_u, ramp)
    rows_per_point, (x, y) = bin_means(MAX_CURVE_POINTS, x, y)
    if rows_per_point > 1:
        lr_u = np.exp(x) if ramp == "exp" else x
    n = x.size
    flags: list[str] = ["diverged"] if dropped else []
    base: dict[str, Any] = dict(
        ramp=ramp, flags=flags, points_used=n_used, points_dropped=int(lr_all.size - n_used), span=n, degree=1,
        p_descent=1.0, lr_steepest=None, lr_min_div10=None, lr_at_min=None, mid_position=mid_position,
        midpoint=midpoint, rows_per_point=rows_per_point,
    )
    if n < 3 or np.ptp(x) <= 0:
        return _not_ok("diverged" if dropped else "no_descent", base, snr=0.0, sigma=math.nan, drop=0.0,
                       fit=LRCurveFit(ramp, lr_u, x, y, y.copy(), fit_dropped_lr, fit_dropped_y, stab_all, lr_all))

    # --- 2. smooth, 3. noise and significance
    span, degree = choose_span(x, y)
    sm = lowess(x, y, span, degree=degree)
    sigma = float(noise_sigma(x, y))
    reading = _read(x, sm.fitted, sm.slope, sm.kernel, sm.slope_kernel, sigma)
    p_down, p_up = trend_test(x, y, seed, PERMUTATIONS)
    steepest, min_div10 = _classic_suggestions(lr_u, x, y)
    base.update(span=span, degree=degree, lr_steepest=steepest, lr_min_div10=min_div10, p_descent=p_down,
                lr_at_min=float(_to_lr(x[reading.i_min], ramp)) if lr_u[reading.i_min] > 0 else None)
    fit = LRCurveFit(ramp, lr_u, x, y, sm.fitted, fit_dropped_lr, fit_dropped_y, stab_all, lr_all)

    if p_down > SIGNIFICANCE or reading.x_low is None or reading.x_high is None:
        if dropped:
            status: Status = "diverged"
        elif p_up <= SIGNIFICANCE and reading.snr < REPLICATE_SNR:
            # Only when nothing dips below the start: a valley too narrow for the test (a few points between a
            # flat start and a steep rise) is no evidence that lr_min is already too high.
            status = "rising_from_start"
        else:
            status = "no_descent"
        return _not_ok(status, base, snr=reading.snr, sigma=sigma, drop=max(reading.drop, 0.0), fit=fit)

    # --- 4. bounds
    flags.extend(reading.flags)
    if _turns_up_after or dropped:
        # The part read may end on its lowest point, but the curve goes on above its start, or explodes: it turned,
        # and the LRs above are too high, not untested.
        flags[:] = [f for f in flags if f not in ("upper_censored", "rose_after_min")] + ["rose_after_min"]
    flags.sort(key=FLAG_ORDER.index)

    # --- 5. bootstrap: interval of the midpoint, share of replicates that still descend
    found, ok_share = _bootstrap(x, y, sm, sigma, ramp, seed, bootstrap)
    ci = None
    spread = math.inf  # mean 80% interval width of the two bounds, on the x axis
    if found.shape[0] >= 10:
        # Bagging (Breiman 1996): the median over resampled curves of each crossing varies less than the crossing
        # of the one observed curve, which jumps with the noise at the knees of the descent.
        reading.x_low, reading.x_high = float(np.median(found[:, 0])), float(np.median(found[:, 1]))
        lo, hi = np.percentile(_midpoints(found[:, 0], found[:, 1], ramp, mid_position)[midpoint], [10, 90])
        ci = [float(lo), float(hi)]
        q = np.percentile(found, [10, 90], axis=0)
        spread = float(np.mean(q[1] - q[0]))
    mids = {k: float(v) for k, v in _midpoints(reading.x_low, reading.x_high, ramp, mid_position).items()}

    dx = float(np.median(np.diff(x)))
    inside = int(np.sum((x >= reading.x_low - 1e-12) & (x <= reading.x_high + 1e-12)))
    band = reading.x_high - reading.x_low
    parts = {
        # 1 - e^-1 = 0.63 at 6 standard errors, 0.95 at 18: a drop of 6 s.e. is real but places its knees loosely.
        "signal": 1.0 - math.exp(-reading.snr / 6.0),
        "points": min(1.0, inside / 6.0),
        # Bands under two steps are resolved by interpolation alone; bands that fill the sweep were not bracketed.
        "width": min(1.0, band / (2 * dx)) * float(np.clip((1.0 - band / np.ptp(x)) / 0.4, 0.25, 1.0)),
        # Share of resampled curves that still descend, times how little the bounds move among them relative to
        # the band they span.
        "stability": ok_share * float(np.clip(1.0 - spread / max(band, 1e-12), 0.0, 1.0)),
    }
    quality = float(np.prod([max(p, 1e-3) for p in parts.values()]) ** (1 / len(parts)))
    quality *= 0.8 ** sum(f in ("upper_censored", "lower_censored") for f in flags)
    if round(quality, 4) < LOW_QUALITY:
        # Advice only: the flag changes no decision of the analysis or the zoom policy.
        flags.append("low_quality")
    label: Literal["high", "medium", "low"] = "high" if quality >= 0.7 else "medium" if quality >= 0.4 else "low"
    return LRBounds(
        status="ok",
        lr_low=float(_to_lr(reading.x_low, ramp)),
        lr_high=float(_to_lr(reading.x_high, ramp)),
        lr_mid=mids[midpoint],
        lr_mid_ci80=ci,
        midpoints=mids,
        quality=round(quality, 4),
        quality_label=label,
        quality_parts={k: round(v, 4) for k, v in parts.items()},
        snr=reading.snr,
        noise_sigma=sigma,
        drop=reading.drop,
        advice=[STATUS_ADVICE["ok"]] + [FLAG_ADVICE[f] for f in flags],
        fit=fit,
        **base,
    )


def _with_tail(head: LRBounds, lr_all: np.ndarray, y_all: np.ndarray, stab_all: Optional[np.ndarray], n_head: int,
               exploded: bool) -> LRBounds:
    """The reading of the part before the climb back above the start, with the rest of the curve attached as
    left-out points (plots and reports show them; `points_dropped` counts them)."""
    fit = head.fit
    assert fit is not None
    fit.dropped_lr, fit.dropped_val_loss = lr_all[n_head:], y_all[n_head:]
    fit.stabilize_loss, fit.all_lr = stab_all, lr_all
    fit.dropped_label = "left out (past the climb above the start" + (", or exploded)" if exploded else ")")
    head.points_dropped = int(lr_all.size - head.points_used)
    if exploded:
        head.flags.append("diverged")
        head.flags.sort(key=FLAG_ORDER.index)
        head.advice = [STATUS_ADVICE[head.status]] + [FLAG_ADVICE[f] for f in head.flags]
    return head


def _not_ok(status: Status, base: dict, *, snr: float, sigma: float, drop: float, fit: LRCurveFit) -> LRBounds:
    flags = base["flags"]
    return LRBounds(
        status=status, lr_low=None, lr_high=None, lr_mid=None, lr_mid_ci80=None, quality=0.0, quality_label="low",
        quality_parts={}, snr=snr, noise_sigma=sigma, drop=drop,
        advice=[STATUS_ADVICE[status]] + [FLAG_ADVICE[f] for f in flags if status != "diverged"],
        fit=fit, **base,
    )


def _axis(lr: np.ndarray, ramp: Ramp) -> np.ndarray:
    if ramp == "linear":
        return lr.astype(float)
    pos = lr > 0
    x = np.empty_like(lr, dtype=float)
    x[pos] = np.log(lr[pos])
    n_base = int(np.sum(~pos))  # leading baselines (others were removed)
    if n_base:
        step = float(np.median(np.diff(x[pos]))) if pos.sum() >= 2 else 1.0
        first = x[pos][0] if pos.any() else 0.0
        x[:n_base] = first - step * np.arange(n_base, 0, -1)
    return x


def _to_lr(x: float, ramp: Ramp) -> float:
    return float(math.exp(x)) if ramp == "exp" else float(x)


def _midpoints(x_low, x_high, ramp: Ramp, position: float) -> dict[str, Any]:
    """lr_mid (in LR) under each rule, from the bounds on the x axis (floats or arrays of bootstrap replicates).

    "tuned" interpolates on the sweep's axis (log LR for an exp ramp, where position 0.5 is the geometric mean);
    the other two are the same on either axis.
    """
    to_lr = np.exp if ramp == "exp" else np.asarray
    lo, hi = to_lr(x_low), to_lr(x_high)
    return {
        "tuned": to_lr((1.0 - position) * np.asarray(x_low) + position * np.asarray(x_high)),
        "geometric": np.sqrt(np.maximum(lo, 0.0) * hi),  # a linear sweep's lr_low may be its baseline, 0
        "arithmetic": 0.5 * (lo + hi),
    }


def _classic_suggestions(lr: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[Optional[float], Optional[float]]:
    """fastai's `steep` (most negative d loss / d log lr, or d lr on a linear ramp) and `minimum / 10`."""
    pos = lr > 0
    if pos.sum() < 3:
        return None, None
    grad = np.gradient(y[pos], x[pos])
    return float(lr[pos][int(np.argmin(grad))]), float(lr[pos][int(np.argmin(y[pos]))] / 10.0)


def _bootstrap(x: np.ndarray, y: np.ndarray, sm, sigma: float, ramp: Ramp, seed: int,
               replicates: int) -> tuple[np.ndarray, float]:
    """Midpoints (on the x axis) of resampled curves y* = fitted + e*, and the share that still show a descent.

    Residuals are centred and inflated by sqrt(n / (n - tr L)) for the degrees of freedom the smoother used. The
    replicates reuse the observed curve's span and kernel for their standard errors.
    """
    if replicates <= 0:
        return np.empty((0, 2)), 1.0
    n = x.size
    rng = np.random.default_rng([seed, 2])
    resid = y - sm.fitted
    resid = (resid - resid.mean()) * math.sqrt(n / max(n - float(np.trace(sm.kernel)), 1.0))
    yb = sm.fitted[None, :] + resid[rng.integers(0, n, size=(replicates, n))]
    smb = lowess(x, yb, sm.span, kernels=False, degree=sm.degree)
    sig = noise_sigma(x, yb)
    found: list[tuple[float, float]] = []
    for b in range(replicates):
        r = _read(x, smb.fitted[b], smb.slope[b], sm.kernel, sm.slope_kernel, float(sig[b]))
        if r.snr >= REPLICATE_SNR and r.x_low is not None and r.x_high is not None:
            found.append((r.x_low, r.x_high))
    return np.asarray(found).reshape(-1, 2), len(found) / replicates
