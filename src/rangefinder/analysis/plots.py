"""PNG plots of the decisions, made to be read at a glance (matplotlib's Figure drawn by Agg: no display needed, and
the process's backend is left as it is)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from rangefinder.analysis.halving import HalvingDecision
from rangefinder.analysis.lr_bounds import LRBounds
from rangefinder.analysis.step_window import TIE_BAND, Delivery, RecommendedLength, StepWindow
from rangefinder.formats.atomic import atomic_path

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FIGSIZE = (8.0, 4.8)  # inches
DPI = 100  # 800 x 480 px: sharp in the KFP/MLflow UI, ~40 KB
RAW = "#9aa5b1"
SMOOTH = "#1f4e9c"
STABILIZE = "#d9822b"
BAND = "#2e9e5b"
OTHER_MID = "#7a5195"
DELIVERED = "#e0a100"  # the delivered checkpoint's star and, with finetune.deliver: earliest_tied, its band
# The halving's dropped candidates, one colour each (up to three race: lr_mid, lr_high, lr_below).
DROPPED = {"lr_mid": OTHER_MID, "lr_high": "#c0457a", "lr_below": "#3d8fa8"}
MID_STYLES = {"tuned": (0, (6, 2)), "geometric": ":", "arithmetic": "-."}


def _figure() -> tuple[Figure, Axes]:
    """A figure of its own, drawn to PNG by Agg whatever backend the process uses. Not pyplot's: its figures need
    the whole process switched to Agg (`matplotlib.use`), which in a notebook that called a step or a report stopped
    every later inline plot of the user's showing, and they stay in pyplot's registry unless closed."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, layout="constrained")
    return fig, fig.subplots()


def _save(fig, out_path: str | Path) -> Path:
    """Write to a temporary name, then rename, so a half-written PNG never looks finished."""
    with atomic_path(out_path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI)
    return Path(out_path)


def _y_limits(*series: Optional[np.ndarray]) -> tuple[float, float]:
    vals = np.concatenate([np.asarray(v, float)[np.isfinite(v)] for v in series if v is not None and len(v)])
    lo, hi = float(vals.min()), float(vals.max())
    pad = 0.06 * (hi - lo or abs(hi) or 1.0)
    return lo - pad, hi + pad


def plot_lr_range_test(bounds: LRBounds, out_path: str | Path, *, title: Optional[str] = None) -> Path:
    """Raw and smoothed validation loss against LR, stabilize loss, the bounds shaded, lr_mid marked and the
    other midpoint rules' points drawn thin (lr_range_test_figure). Returns the PNG's path."""
    return _save(lr_range_test_figure(bounds, title=title), out_path)


def lr_range_test_figure(bounds: LRBounds, *, title: Optional[str] = None):
    """plot_lr_range_test's figure, unsaved. Log LR axis for exponential sweeps, linear for linear ones; a baseline
    at LR 0 is drawn at the left edge of a log axis. The LRs in the legend have the 3 significant figures of the
    report's lead (reports.lr_headline), so a reader matches them digit for digit."""
    fit = bounds.fit
    if fit is None:
        raise ValueError("bounds carry no curve (fit is None); pass the result of analyze_lr_curve")
    log = fit.ramp == "exp"
    # Where each point is drawn: a 0 LR cannot sit on a log axis, so it goes one step left (as analysed).
    xs = np.exp(fit.x) if log else fit.lr
    fig, ax = _figure()
    if bounds.lr_low is not None and bounds.lr_high is not None:
        ax.axvspan(bounds.lr_low, bounds.lr_high, color=BAND, alpha=0.15, lw=0,
                   label=f"bounds {bounds.lr_low:.3g} - {bounds.lr_high:.3g}")
    ax.plot(xs, fit.val_loss, "o", color=RAW, ms=4, label="val loss (measured)")
    ax.plot(xs, fit.smoothed, "-", color=SMOOTH, lw=2.2, label="val loss (smoothed)")
    stab_ok = None
    if fit.stabilize_loss is not None and fit.all_lr is not None:
        stab_ok = np.isfinite(fit.stabilize_loss) & (fit.all_lr > 0 if log else np.isfinite(fit.all_lr))
        # Only the part measured alongside the validation points used: an exploded tail would squash the plot.
        stab_ok[len(fit.all_lr) - fit.dropped_lr.size:] = False
        if stab_ok.sum() >= 2:
            ax.plot(fit.all_lr[stab_ok], fit.stabilize_loss[stab_ok], "-", color=STABILIZE, lw=1.4, alpha=0.9,
                    label="stabilize loss (train subset)")
    lo, hi = _y_limits(fit.val_loss, fit.smoothed,
                       None if stab_ok is None or fit.stabilize_loss is None else fit.stabilize_loss[stab_ok])
    if fit.dropped_lr.size:
        # Left-out points (NaN or exploded) are drawn as crosses on the top edge.
        ax.plot(np.where(fit.dropped_lr > 0, fit.dropped_lr, np.nan) if log else fit.dropped_lr,
                np.full(fit.dropped_lr.shape, hi), "x", color="#c23030", ms=7, clip_on=False,
                label=fit.dropped_label)
    ax.set_ylim(lo, hi)
    for rule, lr_rule in (bounds.midpoints or {}).items():
        # The other rules' midpoints, thin, for comparison (analysis.midpoint picks lr_mid among them).
        if rule != bounds.midpoint:
            ax.axvline(lr_rule, color=OTHER_MID, lw=1.2, ls=MID_STYLES[rule], label=f"{rule} midpoint {lr_rule:.3g}")
    if bounds.lr_mid is not None:
        ax.axvline(bounds.lr_mid, color=BAND, lw=2, ls="--", label=f"lr_mid ({bounds.midpoint}) {bounds.lr_mid:.3g}")
        if bounds.lr_mid_ci80:
            y_bar = lo + 0.04 * (hi - lo)
            ax.plot(bounds.lr_mid_ci80, [y_bar, y_bar], "-", color=BAND, lw=5, alpha=0.8, solid_capstyle="butt",
                    label="lr_mid 80% interval")
    if log:
        ax.set_xscale("log")
    ax.set_xlabel("learning rate" + (" (log scale)" if log else ""))
    ax.set_ylabel("validation loss (MSE)")
    flags = f" · {', '.join(bounds.flags)}" if bounds.flags else ""
    ax.set_title(title or f"LR range test: {bounds.status}, quality {bounds.quality_label} "
                          f"({bounds.quality:.2f}){flags}", fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8.5, loc="best", framealpha=0.85)
    return fig


def plot_step_window(window: StepWindow, out_path: str | Path, *, title: Optional[str] = None,
                     halving: Optional[HalvingDecision] = None, delivered: Optional[Delivery] = None,
                     length: Optional[RecommendedLength] = None) -> Path:
    """Validation and stabilize loss of the constant run against updates (epochs on the top axis), the window
    shaded and the recommended length marked (`length`, the fine-tune's, which may be a fallback; else the window's);
    with `halving` (rangefinder.steps.halving's decision), the dropped candidate's measured curve up to the pause, and
    the pause; with `delivered` (the fine-tune's choice), a star at its update and loss, and for finetune.deliver's
    earliest tied checkpoint the band's top it lies under (step_window_figure). Returns the PNG's path."""
    fig = step_window_figure(window, title=title, halving=halving, delivered=delivered, length=length)
    return _save(fig, out_path)


def step_window_figure(window: StepWindow, *, title: Optional[str] = None, halving: Optional[HalvingDecision] = None,
                       delivered: Optional[Delivery] = None, length: Optional[RecommendedLength] = None):
    """plot_step_window's figure, unsaved. With `halving`, the title names the kept run's LR, as the dropped
    candidates' labels name theirs and as the report's lead says it (reports.step_headline): the LR the curve is of."""
    fit = window.fit
    if fit is None:
        raise ValueError("window carries no curve (fit is None); pass the result of select_step_window")
    fig, ax = _figure()
    if window.window_start_update is not None and window.window_end_update is not None:
        ax.axvspan(window.window_start_update, window.window_end_update, color=BAND, alpha=0.15, lw=0,
                   label=f"window (within {window.band:.3g} of the best)")
    ax.plot(fit.update, fit.val_loss, "o", color=RAW, ms=3.5, label="val loss (measured)")
    ax.plot(fit.update, fit.smoothed, "-", color=SMOOTH, lw=2.2, label="val loss (smoothed)")
    if fit.stabilize_loss is not None:
        ok = np.isfinite(fit.stabilize_loss)
        ax.plot(fit.update[ok], fit.stabilize_loss[ok], ".", color=STABILIZE, ms=3, alpha=0.6)
        if fit.stabilize_smoothed is not None:
            ax.plot(fit.update, fit.stabilize_smoothed, "-", color=STABILIZE, lw=1.6,
                    label="stabilize loss (train subset)")
    lo, hi = _y_limits(fit.val_loss, fit.smoothed, fit.stabilize_loss)
    if fit.dropped_update.size:
        ax.plot(fit.dropped_update, np.full(fit.dropped_update.shape, hi), "x", color="#c23030", ms=7,
                clip_on=False, label="left out (NaN / exploded)")
    if halving is not None:
        # The limits stay the kept run's: a dropped candidate that climbed far above it is cut at the top.
        ax.axvline(halving.pause_update, color=OTHER_MID, lw=1, ls=":")
        for name, c in halving.candidates.items():
            if name != halving.kept and c.curve:
                u, v = np.asarray(c.curve, float).T
                ax.plot(u, v, ".-", color=DROPPED.get(name, OTHER_MID), ms=3, lw=1, alpha=0.8,
                        label=f"{name} {c.lr:.3g}: dropped at update {halving.pause_update}")
    ax.set_ylim(lo, hi)
    if window.best_update is not None and window.best_val_loss is not None:
        ax.plot([window.best_update], [window.best_val_loss], "v", color=SMOOTH, ms=9, label="best (smoothed)")
    length = length or RecommendedLength.of_window(window)
    if length is not None:
        ax.axvline(length.updates, color=BAND, lw=2, ls="--",
                   label=f"{'fallback' if length.fallback else 'recommended'}: {length.epochs} epochs")
    elif window.recommended_updates is not None:  # a curve without epochs
        ax.axvline(window.recommended_updates, color=BAND, lw=2, ls="--",
                   label=f"recommended: {window.recommended_updates} updates")
    if delivered is not None and delivered.tied_ceiling is not None:
        ax.axhline(delivered.tied_ceiling, color=DELIVERED, lw=1.4, ls=":",
                   label=f"earliest-tied band: {TIE_BAND:.0%} above the lowest")
    if delivered is not None and delivered.val_loss is not None:
        ax.plot([delivered.update], [delivered.val_loss], "*", color=DELIVERED, mec="#5c4300", ms=14, zorder=5,
                label=f"delivered: update {delivered.update}")
    ax.set_xlabel("update (optimizer step)")
    ax.set_ylabel("loss (MSE)")
    e = fit.epoch
    if np.all(np.isfinite(e)) and np.ptp(fit.update) > 0 and np.ptp(e) > 0:
        a, b = np.polyfit(fit.update, e, 1)  # epochs grow linearly with updates
        top = ax.secondary_xaxis("top", functions=(lambda u: a * u + b, lambda ep: (ep - b) / a))
        top.set_xlabel("epoch")
    flags = f" · {', '.join(window.flags)}" if window.flags else ""
    # The legend's three columns fill the figure's width; the kept LR goes in the title, not beside its curve.
    kept = "" if halving is None else f" at {halving.kept} {halving.lr:.3g} (kept)"
    ax.set_title(title or f"Step window{kept}: {window.status}{flags}", fontsize=11)
    ax.grid(True, alpha=0.3)
    # Below the axes: a U-shaped curve leaves no free corner for it.
    fig.legend(fontsize=8.5, loc="outside lower center", ncols=3, frameon=False)
    return fig


def plot_prodigy_step(updates: np.ndarray, step_sizes: np.ndarray, step_size: float, out_path: str | Path, *,
                      curve: Optional[dict] = None, title: Optional[str] = None, factor: float = 1.0) -> Path:
    """The prodigy_step finder's run: Prodigy's step size d x lr after every update (log axis), the last one (the LR
    read) marked, and the LR trained (`factor` times it) where that differs, with the validation loss on a second axis
    when `curve` (metrics.csv's columns) has one. Returns the PNG's path."""
    fig, ax = _figure()
    ax.plot(updates, step_sizes, "-", color=SMOOTH, lw=2, label="step size d x lr after each update (prodigy_d_lr)")
    ax.axhline(step_size, color=BAND, lw=2, ls="--", label=f"LR read: the last step size {step_size:.3g}")
    if factor != 1:
        ax.axhline(step_size * factor, color=BAND, lw=2, ls=":",
                   label=f"LR trained: {factor:g} x the step size = {step_size * factor:.3g}")
    finite = np.asarray(step_sizes, float)[np.isfinite(step_sizes)]
    if finite.size and finite.min() == finite.max():  # d never moved from d0: a flat line needs its own limits
        ax.set_ylim(finite.min() / 2, max(finite.max(), step_size * factor) * 2)
    ax.set_yscale("log")
    ax.set_xlabel("update (optimizer step)")
    ax.set_ylabel("step size d x lr (log scale)")
    if curve is not None and len(curve.get("val_loss", ())):
        val_ax = ax.twinx()
        val_ax.plot(curve["update"], curve["val_loss"], "o-", color=RAW, ms=3.5, lw=1, label="val loss (measured)")
        val_ax.set_ylabel("validation loss (MSE)")
        lines, labels = ax.get_legend_handles_labels()
        more, more_labels = val_ax.get_legend_handles_labels()
        ax.legend(lines + more, labels + more_labels, fontsize=8.5, loc="best", framealpha=0.85)
    else:
        ax.legend(fontsize=8.5, loc="best", framealpha=0.85)
    ax.set_title(title or "Prodigy's step size: the LR the fine-tune trains at", fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    return _save(fig, out_path)


def plot_retrain(updates: dict, out_path: str | Path, *, title: Optional[str] = None) -> Path:
    """The full-data retrain's run (updates.csv's columns): its training loss after each update, raw and as the mean
    of about an epoch of updates (a retrain validates nothing, so this is its only curve), and the LR it trained at
    on a second axis (flat, or the triangular schedule's cycles), epochs on the top axis. Returns the PNG's path."""
    update = np.asarray(updates["update"], dtype=float)
    loss = np.asarray(updates["train_loss"], dtype=float)
    fig, ax = _figure()
    ax.plot(update, loss, "o", color=RAW, ms=3.5, label="train loss (each update)")
    epoch = np.asarray(updates.get("epoch", ()), dtype=float)
    # A trailing mean over an epoch's updates: the batches of one update differ in difficulty, an epoch holds them all.
    per_epoch = max(1, int(round(len(update) / max(1.0, float(np.nanmax(epoch))))) if epoch.size else 1)
    ok = np.isfinite(loss)
    if ok.sum() > 1:
        kept = loss[ok]
        mean = np.array([kept[max(0, i + 1 - per_epoch):i + 1].mean() for i in range(len(kept))])
        ax.plot(update[ok], mean, "-", color=SMOOTH, lw=2.2,
                label=f"train loss (mean of the last {per_epoch} update{'s' if per_epoch != 1 else ''})")
    if ok.any():
        ax.set_ylim(*_y_limits(loss[ok]))
    ax.set_xlabel("update (optimizer step)")
    ax.set_ylabel("training loss (MSE)")
    lines, labels = ax.get_legend_handles_labels()
    lr = np.asarray(updates.get("lr", ()), dtype=float)
    if lr.shape == update.shape and np.isfinite(lr).any():
        lr_ax = ax.twinx()
        lr_ax.plot(update, lr, "-", color=BAND, lw=1.4, label="lr")
        lr_ax.set_ylabel("learning rate")
        more, more_labels = lr_ax.get_legend_handles_labels()
        lines, labels = lines + more, labels + more_labels
    if epoch.shape == update.shape and np.all(np.isfinite(epoch)) and np.ptp(update) > 0 and np.ptp(epoch) > 0:
        a, b = np.polyfit(update, epoch, 1)  # epochs grow linearly with updates
        top = ax.secondary_xaxis("top", functions=(lambda u: a * u + b, lambda ep: (ep - b) / a))
        top.set_xlabel("epoch")
    ax.legend(lines, labels, fontsize=8.5, loc="best", framealpha=0.85)
    ax.set_title(title or "Full-data retrain: training loss (no validation)", fontsize=11)
    ax.grid(True, alpha=0.3)
    return _save(fig, out_path)
