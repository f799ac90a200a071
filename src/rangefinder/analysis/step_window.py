"""The step window of a constant-LR fine-tune: how long to train.

Validation loss of a fine-tune falls, bottoms out and, once the model starts to memorise its images, rises. The
window is the stretch where the smoothed validation loss is within a tolerance of its minimum: relative
(`tolerance` of the minimum, FinetuneConfig.tolerance) or, when the curve is noisier than that, two standard
errors of the smoothed minimum. Smoothing, noise and the improvement test are those of the LR bounds (curves.py):
a centred robust LOWESS in updates, noise from second differences, and a seeded permutation test of "it fell".

The recommendation is the centre of the window in whole epochs: the minimum itself wanders along a flat bottom with
the noise, while both window edges sit where the curve is steeper and so are better determined. Its updates are those
whole epochs' on the run's own update-epoch line (what a run of that length trains), not the centre's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import numpy as np

from rangefinder.analysis.curves import (
    MAX_CURVE_POINTS,
    bin_means,
    check_reading_settings,
    choose_span,
    divergence_cut,
    end_slope,
    finite_prefix,
    lowess,
    merge_ties,
    noise_sigma,
    numbers,
    order_rows,
    reading_notes,
    trend_test,
)
from rangefinder.analysis.lr_bounds import PERMUTATIONS, SIGNIFICANCE, _jsonable
from rangefinder.defaults import DIVERGENCE_FACTOR, STEP_WINDOW_MIN_UPDATES
from rangefinder.errors import RangefinderError
from rangefinder.formats.text import percent

WindowStatus = Literal["ok", "still_improving", "no_improvement"]

FLAG_ADVICE: dict[str, str] = {
    "rose_after_min": (
        "Validation loss rises after its minimum: the model starts to overfit its training images. "
        "Train for the recommended epochs, not longer."
    ),
    "diverged": (
        "The loss exploded (NaN, inf or more than 4x its best) near the end; those points were left out. "
        "Lower the LR (e.g. lr_low instead of lr_mid) if it happened early."
    ),
}

STATUS_ADVICE: dict[str, str] = {
    "ok": "Validation loss bottomed out inside the run; train for the recommended epochs.",
    "still_improving": (
        "Still improving at the end of the run: the best length lies beyond it. Fine-tune for more epochs "
        "(e.g. twice as many) and select again. The LR may also be low for this budget: in the discovery bench, "
        "fine-tunes still improving at the end mostly trained below the best constant LR of a grid sweep, so with "
        "a fixed budget try lr_high (or a short grid from lr_mid up to 3 x lr_high) and keep the best."
    ),
    "no_improvement": (
        "Validation loss never fell by more than its noise: this LR does not help. Check the LR bounds "
        "(try lr_low), the data and captions, or use more validation images."
    ),
}


@dataclass
class StepCurveFit:
    """The curve as the analysis saw it, for plots and reports (not part of the JSON)."""

    update: np.ndarray
    epoch: np.ndarray
    val_loss: np.ndarray
    smoothed: np.ndarray
    stabilize_loss: Optional[np.ndarray]  # aligned with update, raw (NaN where not measured)
    stabilize_smoothed: Optional[np.ndarray]
    dropped_update: np.ndarray
    dropped_val_loss: np.ndarray


@dataclass
class StepWindow:
    status: WindowStatus
    best_update: Optional[float]
    best_epoch: Optional[float]
    best_val_loss: Optional[float]  # smoothed, at best_update
    window_start_epoch: Optional[float]
    window_end_epoch: Optional[float]
    window_start_update: Optional[float]
    window_end_update: Optional[float]
    recommended_epochs: Optional[int]
    recommended_updates: Optional[int]
    val_minus_stabilize: Optional[float]  # smoothed val minus smoothed stabilize loss at the best point
    tolerance: float  # relative tolerance asked for
    band: float  # the window's height in loss units: max(tolerance x |min|, 2 s.e. of the minimum)
    flags: list[str]
    p_improvement: float
    noise_sigma: float
    points_used: int
    points_dropped: int
    span: int
    advice: list[str]
    points_non_finite: int = 0  # rows left out for a NaN/inf between finite rows (counted in points_dropped too)
    reordered: bool = False  # the rows were not in update order and were read sorted
    rows_per_point: int = 1  # > 1: a long curve read as means of this many consecutive rows (MAX_CURVE_POINTS)
    rows_merged: int = 0  # rows read as one point with another row at the same update (curves.merge_ties)
    reading: list[str] = field(default_factory=list)  # what was done to the rows before reading (also in advice)
    fit: Optional[StepCurveFit] = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The JSON of `rangefinder select-steps` (NaN becomes null)."""
        return {k: _jsonable(v) for k, v in self.__dict__.items() if k != "fit"}


def band_widened(window: StepWindow) -> bool:
    """Whether the window's band is wider than its relative tolerance asked: the curve was noisier, and the band is
    2 standard errors of its minimum instead."""
    return window.band > window.tolerance * abs(window.best_val_loss or 0.0) * (1 + 1e-9)


def within_words(window: StepWindow) -> str:
    """How far above its minimum a window's smoothed validation loss stays, in words: the relative tolerance asked
    for or, where the curve is noisier than that, the band it was widened to, which is what drew the window."""
    tolerance = percent(window.tolerance)  # as given: a whole percent rounded 0.005 to "0%" and 0.025 to "2%"
    if not band_widened(window):
        return f"within {tolerance} of its minimum"
    share = f", {window.band / abs(window.best_val_loss):.1%}" if window.best_val_loss else ""
    return (f"within {window.band:.3g} of its minimum (the {tolerance} tolerance widened to 2 standard "
            f"errors of the curve's noise{share})")


def select_step_window(
    update: Any,
    epoch: Any,
    val_loss: Any,
    *,
    stabilize_loss: Any = None,
    tolerance: float = 0.02,
    seed: int = 0,
    divergence_factor: Optional[float] = DIVERGENCE_FACTOR,
) -> StepWindow:
    """Find where a constant-LR run's smoothed validation loss is within `tolerance` of its minimum.

    One (update, epoch, val_loss) per validation, read in update order; `epoch` may be None or NaN where unknown (it is
    then interpolated from the rows that have it, or left out). Raises RangefinderError for mismatched lengths,
    a tolerance outside (0, 1), a negative seed, a divergence_factor of 1 or less, or fewer than 3 finite losses.
    """
    u_all, y_all = numbers("update", update), numbers("val_loss", val_loss)
    e_all = np.full_like(u_all, np.nan) if epoch is None else numbers("epoch", epoch)
    if not (u_all.shape == y_all.shape == e_all.shape):
        raise RangefinderError(
            f"update, epoch and val_loss differ in length ({u_all.size}, {e_all.size}, {y_all.size}); pass one per row"
        )
    if not 0 < tolerance < 1:
        raise RangefinderError(f"tolerance must be in (0, 1), e.g. 0.02 for 2% (got {tolerance})")
    check_reading_settings(seed, divergence_factor)
    n_finite = int(np.sum(np.isfinite(y_all) & np.isfinite(u_all)))
    if n_finite < STEP_WINDOW_MIN_UPDATES:
        raise RangefinderError(
            f"the curve has {n_finite} finite (update, val_loss) points; the step window needs at least "
            f"{STEP_WINDOW_MIN_UPDATES} (validate more often during the fine-tune)"
        )
    distinct = np.unique(u_all[np.isfinite(u_all) & np.isfinite(y_all)])
    if distinct.size < STEP_WINDOW_MIN_UPDATES:
        # Rows at one or two updates (the window average's measurements, all at update 0) said "no_improvement: this
        # LR does not help", of a curve that has no length to read.
        raise RangefinderError(
            f"the curve has {distinct.size} distinct update value{'s' if distinct.size != 1 else ''} "
            f"({', '.join(f'{v:g}' for v in distinct)}); the step window needs validations at "
            f"{STEP_WINDOW_MIN_UPDATES} or more updates "
            "(pass a fine-tune's metrics.csv, or validate more often during the fine-tune)"
        )
    s_all = None
    if stabilize_loss is not None:
        s_all = numbers("stabilize_loss", stabilize_loss)
        if s_all.shape != u_all.shape:
            raise RangefinderError(f"stabilize_loss has {s_all.size} values for {u_all.size} updates; one per row")
        if not np.any(np.isfinite(s_all)):
            s_all = None

    # The rows in update order, without the NaN/inf ones that finite rows follow (curves.order_rows).
    rows = order_rows(u_all, y_all)
    n_rows = u_all.size
    u_all, y_all, e_all = u_all[rows.index], y_all[rows.index], e_all[rows.index]
    s_all = None if s_all is None else s_all[rows.index]
    window = _select(u_all, e_all, y_all, s_all, tolerance=tolerance, seed=seed, divergence_factor=divergence_factor)
    window.points_dropped = int(n_rows - window.points_used)
    window.points_non_finite, window.reordered = rows.non_finite, rows.reordered
    window.rows_merged = int(u_all.size - np.unique(u_all).size)
    window.reading = reading_notes(rows, n_rows, window.rows_per_point, "update", window.rows_merged)
    window.advice = window.advice + window.reading
    return window


def updates_for_epochs(update: Any, epoch: Any, epochs: float) -> Optional[int]:
    """The updates a run takes to train `epochs` epochs, read off its curve's update-epoch line: exact at a row,
    between rows on the line through them, past either end on from it at the whole line's slope (first to last row);
    rounded up as the engine counts a last, partial update (planning.plan). None without two rows of different
    epochs."""
    u = np.asarray(update, dtype=float).ravel()
    e = np.full_like(u, np.nan) if epoch is None else np.asarray(epoch, dtype=float).ravel()
    known = np.isfinite(u) & np.isfinite(e)
    u, e = u[known], e[known]
    order = np.argsort(e, kind="stable")
    u, e = u[order], e[order]
    if e.size < 2 or e[-1] <= e[0]:
        return None
    if e[0] <= epochs <= e[-1]:
        at = float(np.interp(epochs, e, u))
    else:
        end = -1 if epochs > e[-1] else 0
        at = float(u[end] + (epochs - e[end]) * (u[-1] - u[0]) / (e[-1] - e[0]))
    return max(0, math.ceil(at - 1e-6))  # 1e-6: the epochs' float noise, far below an update


LengthBasis = Literal["window", "earliest_tied", "no_window", "configured"]

# What the recommended length is (RecommendedLength.basis), for the report's row and lead.
LENGTH_BASIS_TEXT: dict[str, str] = {
    "window": "the centre of the window (its edges are better determined)",
    "earliest_tied": "the delivered checkpoint's epoch, rounded up (finetune.deliver is earliest_tied, so a retrain "
                     "trains the earliest tied checkpoint's length, not the window's centre)",
    "no_window": "the delivered checkpoint's epoch, rounded up (the lowest validation loss of the whole run)",
    "configured": "the configured finetune.epochs (no checkpoint to go by)",
}


@dataclass(frozen=True)
class RecommendedLength:
    """The length the fine-tune recommends, the one a full-data retrain trains: whole epochs, the updates those epochs
    take in the fine-tune (updates_for_epochs; the retrain's larger training set takes more per epoch), and what it
    was read from (LENGTH_BASIS_TEXT)."""

    epochs: int
    updates: int
    basis: LengthBasis

    @property
    def fallback(self) -> bool:
        """No step window said it: the pipeline falls back on another length."""
        return self.basis in ("no_window", "configured")

    @classmethod
    def of_window(cls, window: StepWindow) -> Optional[RecommendedLength]:
        """The window's own recommendation; None without one in epochs."""
        if window.recommended_epochs is None or window.recommended_updates is None:
            return None
        return cls(epochs=window.recommended_epochs, updates=window.recommended_updates, basis="window")


DeliveryRule = Literal["window_lowest", "window_nearest", "run_lowest", "cooldown", "window_average", "earliest_tied"]

# finetune.deliver: earliest_tied delivers the earliest checkpoint whose validation loss is within this fraction of the
# lowest the fine-tune measured: the Goal's tie band in bench.versus (TIE_PCT), where two losses are not told apart.
TIE_BAND = 0.01

DELIVERY_RULE_TEXT: dict[str, str] = {
    "window_lowest": "the checkpoint with the lowest validation loss inside the step window",
    "window_nearest": "the checkpoint nearest the window's centre (none inside the window was validated)",
    "run_lowest": "no step window was found, so the checkpoint with the lowest validation loss of the whole run",
    "cooldown": "the cooldown's weights: the recommended length trained again with its last stretch decaying to LR 0, "
                "which measured below the window's lowest checkpoint (rangefinder.steps.cooldown)",
    "window_average": "the uniform average of the checkpoints inside the step window, which measured below the "
                      "window's lowest checkpoint (rangefinder.steps.average)",
    "earliest_tied": f"the earliest checkpoint whose validation loss is within {TIE_BAND:.0%} of the lowest the "
                     "fine-tune measured (finetune.deliver: earliest_tied): the validation loss cannot tell them "
                     "apart, and this one moved least from the base model; a retrain trains its length",
}
# What DELIVERY_RULE_TEXT goes on to say where the checkpoint delivered is the run's final weights, its last checkpoint
# (the only one where finetune.checkpoint_every_epochs is not below finetune.epochs): the rule's words alone read as
# weights from inside the run.
FINAL_WEIGHTS_TEXT: dict[str, str] = {
    "window_nearest": "; it is the run's final weights, trained past the window (a smaller "
                      "finetune.checkpoint_every_epochs saves checkpoints inside it)",
    "window_lowest": "; it is the run's final weights: the window reaches the run's end",
}


@dataclass(frozen=True)
class Delivery:
    """Which checkpoint the fine-tune delivers, and by which rule (DELIVERY_RULE_TEXT)."""

    update: int
    rule: DeliveryRule
    val_loss: Optional[float]  # measured at the checkpoint's own update; None when it was not validated there
    base_val_loss: Optional[float]  # the curve's update 0: the base model's own loss; None when not measured
    tied_ceiling: Optional[float] = None  # earliest_tied: the band's top (TIE_BAND above the lowest loss measured)
    final: bool = False  # the run's final weights: its last checkpoint, at the curve's last update

    @classmethod
    def of_chosen(cls, chosen: Mapping[str, Any]) -> Delivery:
        """What a chosen.json (steps/finetune.py) delivers. One written by earlier code, or by hand, may lack a key:
        what it lacks reads as unknown (no loss, no band, not the final weights)."""
        return cls(update=int(chosen.get("update") or 0), rule=chosen.get("rule") or "window_lowest",
                   val_loss=chosen.get("val_loss"), base_val_loss=chosen.get("base_val_loss"),
                   tied_ceiling=(chosen.get("band") or {}).get("ceiling"), final=bool(chosen.get("final_weights")))

    @property
    def improved_on_base(self) -> Optional[bool]:
        """Whether the delivered weights measure lower than the base model; None when either is unknown."""
        if self.val_loss is None or self.base_val_loss is None:
            return None
        return self.val_loss < self.base_val_loss

    def against_base(self) -> str:
        """The sentence comparing the delivered weights with the base model (update 0); "" when either is unknown."""
        if self.improved_on_base is None:
            return ""
        if self.improved_on_base:
            return f"Its validation loss {self.val_loss:.4g} is below the base model's {self.base_val_loss:.4g}."
        return (f"The fine-tune did not improve on the base model: the delivered checkpoint's validation loss "
                f"{self.val_loss:.4g} is not below the base model's {self.base_val_loss:.4g} (update 0); use the base "
                "model, or check the LR bounds (try lr_low), the data and the captions.")

    def what(self) -> str:
        """The rule that picked it, in words, and whether it is the run's final weights."""
        if not self.final:
            return DELIVERY_RULE_TEXT[self.rule]
        return DELIVERY_RULE_TEXT[self.rule] + FINAL_WEIGHTS_TEXT.get(self.rule, "; it is the run's final weights")

    def sentence(self) -> str:
        """What was delivered and by which rule, for the report's lead and the run's description."""
        return f"Delivered: update {self.update}, {self.what()}. {self.against_base()}".rstrip()


def losses_by_update(update: Any, val_loss: Any) -> dict[int, float]:
    """The curve's finite validation losses at whole updates, by update (a checkpoint's own measurement)."""
    return {int(u): float(y) for u, y in zip(np.asarray(update, dtype=float).ravel(),
                                             np.asarray(val_loss, dtype=float).ravel(), strict=True)
            if math.isfinite(u) and math.isfinite(y) and float(u).is_integer()}


def delivered_checkpoint(window: StepWindow, checkpoint_updates: Any, update: Any, val_loss: Any) -> Optional[Delivery]:
    """The checkpoint to deliver, of those validated at their own update:
    - with a window: the one with the lowest validation loss inside it (ties: the one nearest the recommended update,
      then the earlier); the checkpoint nearest the recommended update when none inside was validated (passing over
      those whose own validation came out NaN or inf, unless all did);
    - without (no_improvement): the one with the lowest validation loss of the whole run (ties: the earlier);
    None when there is no checkpoint, or no window and no validated checkpoint.

    The window says which lengths the smoothed curve calls equally good; among those, each checkpoint's validation
    loss is a deterministic measurement of those very weights. At a high constant LR (LoRA above all) the weights
    scatter from one checkpoint to the next, so the one nearest the centre was up to 9 % worse than the best one
    inside the same window (bench/RESULTS.md, "Versus"); the recommended length stays the centre (module docstring).
    With no window there is no length to limit the choice to, and the final weights are the one point the run (which
    trains past any useful length) never vouches for: in the bench they were worse than the base model.
    """
    ckpts = sorted({int(c) for c in checkpoint_updates})
    if not ckpts:
        return None
    loss_at = losses_by_update(update, val_loss)
    base = loss_at.get(0)

    def delivery(c: int, rule: DeliveryRule) -> Delivery:
        return Delivery(update=c, rule=rule, val_loss=loss_at.get(c), base_val_loss=base,
                        final=is_final(c, ckpts, loss_at))

    rec = window.recommended_updates
    if rec is None:
        validated = [c for c in ckpts if c in loss_at and c > 0]
        return delivery(min(validated, key=lambda c: (loss_at[c], c)), "run_lowest") if validated else None
    lo, hi = window.window_start_update, window.window_end_update
    inside = [c for c in ckpts if lo is not None and hi is not None and lo <= c <= hi and c in loss_at]
    if inside:
        return delivery(min(inside, key=lambda c: (loss_at[c], abs(c - rec), c)), "window_lowest")
    # Not one whose own validation came out NaN or inf: it was measured, and failed (the nearest checkpoint to a
    # window whose only checkpoint did was delivered with no loss, as if never validated).
    failed = {int(u) for u, y in zip(np.asarray(update, dtype=float).ravel(), np.asarray(val_loss, dtype=float).ravel(),
                                     strict=True) if math.isfinite(u) and not math.isfinite(y)} - set(loss_at)
    near = [c for c in ckpts if c not in failed] or ckpts
    return delivery(min(near, key=lambda c: (abs(c - rec), c)), "window_nearest")


def earliest_tied(checkpoint_updates: Any, update: Any, val_loss: Any, target: float) -> Optional[Delivery]:
    """finetune.deliver: earliest_tied. The earliest checkpoint (after update 0), of those validated at their own
    update, whose validation loss is within TIE_BAND of `target`: the lowest the fine-tune measured (the usual rule's
    delivery, or the window average's or the cooldown's, which set the band but are not delivered:
    steps/finetune.keep_chosen_checkpoint). Compared with the base model as delivered_checkpoint does: the curve's
    update 0. None when no checkpoint lies in the band (a window average more than the
    band below every checkpoint): the usual rule's delivery stands.

    Among weights the validation loss cannot tell apart, the earliest moved least from the base. Measured for
    textual inversion on 12 fresh `shapes` cases (bench/RESULTS.md, "Textual inversion's earliest tied checkpoint"):
    it followed held-out prompts as well as Prodigy's best, but on the tiny model that checkpoint is almost the
    initializer, so it is an option, off by default.
    """
    ceiling = target + TIE_BAND * abs(target)
    loss_at = losses_by_update(update, val_loss)
    ckpts = sorted({int(c) for c in checkpoint_updates})
    tied = [c for c in ckpts if c > 0 and loss_at.get(c, math.inf) <= ceiling]
    if not tied:
        return None
    return Delivery(update=tied[0], rule="earliest_tied", val_loss=loss_at[tied[0]], base_val_loss=loss_at.get(0),
                    tied_ceiling=ceiling, final=is_final(tied[0], ckpts, loss_at))


def is_final(checkpoint: int, checkpoints: list[int], loss_at: dict[int, float]) -> bool:
    """Whether `checkpoint` holds the run's final weights: the last of `checkpoints` (sorted), at or past the curve's
    last measured update (the engine validates and checkpoints at its end)."""
    return checkpoint == checkpoints[-1] and checkpoint >= max(loss_at, default=checkpoint)


def _select(u_all: np.ndarray, e_all: np.ndarray, y_all: np.ndarray, s_all: Optional[np.ndarray], *,
            tolerance: float, seed: int, divergence_factor: Optional[float]) -> StepWindow:
    """The window on rows in update order (NaN/inf ones only as a run at the end)."""
    # Epochs where missing: interpolate from the rows that have them (epochs grow linearly with updates).
    known = np.isfinite(e_all) & np.isfinite(u_all)
    if known.sum() >= 2:
        e_all = np.where(known, e_all, np.interp(u_all, u_all[known], e_all[known]))

    n_ok = finite_prefix(u_all, y_all)
    if divergence_factor:
        n_ok = divergence_cut(y_all[:n_ok], divergence_factor)
    flags: list[str] = ["diverged"] if n_ok < u_all.size else []
    u, y, e = u_all[:n_ok], y_all[:n_ok], e_all[:n_ok]
    s = None if s_all is None else s_all[:n_ok]
    n_used = u.size
    binned = merge_ties(u, e, y, *([] if s is None else [s]))
    rows_per_point, binned = bin_means(MAX_CURVE_POINTS, *binned)
    u, e, y = binned[:3]
    s = binned[3] if s is not None else None
    n = u.size
    fit = StepCurveFit(u, e, y, y.copy(), s, None, u_all[n_ok:], y_all[n_ok:])
    common: dict[str, Any] = dict(tolerance=tolerance, points_used=n_used, points_dropped=int(u_all.size - n_used),
                                  rows_per_point=rows_per_point, fit=fit)
    if n < 3 or np.ptp(u) <= 0:
        return _no_improvement(flags, common, sigma=math.nan, p=1.0, span=n)

    span, degree = choose_span(u, y)
    sm = lowess(u, y, span, degree=degree)
    f = sm.fitted
    fit.smoothed = f
    sigma = float(noise_sigma(u, y))
    p_down, _ = trend_test(u, y, seed, PERMUTATIONS)
    if p_down > SIGNIFICANCE:
        return _no_improvement(flags, common, sigma=sigma, p=p_down, span=span)

    i_best = int(np.argmin(f))
    se_best = sigma * math.sqrt(float((sm.kernel[i_best] ** 2).sum()))
    band = max(tolerance * abs(float(f[i_best])), 2.0 * se_best)
    level = f[i_best] + band
    lo = i_best
    while lo > 0 and f[lo - 1] <= level:
        lo -= 1
    hi = i_best
    while hi < n - 1 and f[hi + 1] <= level:
        hi += 1

    def edge(i_in: int, i_out: int) -> float:
        """Update where the smoothed curve crosses `level` between an inside and an outside point."""
        t = (level - f[i_in]) / (f[i_out] - f[i_in]) if f[i_out] != f[i_in] else 0.0
        return float(u[i_in] + t * (u[i_out] - u[i_in]))

    start_u = edge(lo, lo - 1) if lo > 0 else float(u[0])
    end_u = edge(hi, hi + 1) if hi < n - 1 else float(u[-1])

    def epoch_at(upd: float) -> Optional[float]:
        return float(np.interp(upd, u, e)) if np.all(np.isfinite(e)) else None

    # Still improving: the minimum is at the end and the curve is still significantly falling there, so the
    # real minimum (and the window's end) lies beyond the run.
    slope, se_slope = end_slope(u, f, sigma)
    still = i_best >= n - max(2, math.ceil(0.1 * n)) and -slope > 2 * se_slope
    se_min = np.sqrt(((sm.kernel[i_best][None, :] - sm.kernel) ** 2).sum(-1)) * sigma
    if hi < n - 1 and f[-1] - f[i_best] > max(band, 2 * se_min[-1]):
        flags.append("rose_after_min")

    status: WindowStatus = "still_improving" if still else "ok"
    start_e, end_e = epoch_at(start_u), epoch_at(end_u)
    if status == "ok":
        rec_u = 0.5 * (start_u + end_u)
    else:
        rec_u = float(u[-1])
    rec_e = epoch_at(rec_u)
    rec_epochs, rec_updates = None, int(round(rec_u))  # a curve without epochs: the window's centre in updates
    if rec_e is not None:
        # Still improving: at least the whole run (rounded up); ok: the nearest whole epoch to the centre.
        rec_epochs = max(1, math.ceil(rec_e - 1e-9) if status == "still_improving" else int(round(rec_e)))
        # The updates those whole epochs take, so the two agree (73 epochs at 4 per epoch are 292 updates, where
        # the centre's own 292.6 said 293).
        at_epochs = updates_for_epochs(u_all, e_all, rec_epochs)
        rec_updates = rec_updates if at_epochs is None else at_epochs

    vms = None
    if s is not None and np.sum(np.isfinite(s)) >= 3:
        ok = np.isfinite(s)
        sspan, sdeg = choose_span(u[ok], s[ok])
        s_smooth = lowess(u[ok], s[ok], sspan, degree=sdeg).fitted
        fit.stabilize_smoothed = np.interp(u, u[ok], s_smooth)
        vms = float(f[i_best] - np.interp(u[i_best], u[ok], s_smooth))

    flags.sort(key=["rose_after_min", "diverged"].index)
    return StepWindow(
        status=status,
        best_update=float(u[i_best]),
        best_epoch=epoch_at(float(u[i_best])),
        best_val_loss=float(f[i_best]),
        window_start_epoch=start_e,
        window_end_epoch=end_e,
        window_start_update=start_u,
        window_end_update=end_u,
        recommended_epochs=rec_epochs,
        recommended_updates=rec_updates,
        val_minus_stabilize=vms,
        band=band,
        flags=flags,
        p_improvement=p_down,
        noise_sigma=sigma,
        span=span,
        advice=[_in_updates(a, rec_epochs) for a in [STATUS_ADVICE[status]] + [FLAG_ADVICE[fl] for fl in flags]],
        **common,
    )


def _in_updates(advice: str, epochs: Optional[int]) -> str:
    """The advice for a curve without epochs speaks of the updates it recommends, the one length it has."""
    return advice if epochs is not None else advice.replace("recommended epochs", "recommended updates")


def _no_improvement(flags: list[str], common: dict, *, sigma: float, p: float, span: int) -> StepWindow:
    return StepWindow(
        status="no_improvement", best_update=None, best_epoch=None, best_val_loss=None, window_start_epoch=None,
        window_end_epoch=None, window_start_update=None, window_end_update=None, recommended_epochs=None,
        recommended_updates=None, val_minus_stabilize=None, band=math.nan, flags=flags, p_improvement=p,
        noise_sigma=sigma, span=span, advice=[STATUS_ADVICE["no_improvement"]] + [FLAG_ADVICE[f] for f in flags],
        **common,
    )
