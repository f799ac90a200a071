"""Curve CSVs, a lag-free robust smoother, and noise estimates taken from the data itself.

Both decisions (LR bounds, step window) rest on the same three tools:

- `lowess`: Cleveland's robust locally weighted linear regression (Cleveland 1979, JASA 74:829). It is centred, so
  it does not shift a curve to the right as a one-sided EMA does, and its local *linear* fit keeps the ends
  unbiased where a running mean would flatten them. Its bisquare robustness weights ignore isolated spikes, but
  never most of a window (a knee sharper than the sampling is the curve, not a run of outliers).
- `choose_span`: the neighbourhood size by robust leave-one-out cross-validation, so clean curves are smoothed
  lightly and noisy ones heavily, with no tuning knob for the user.
- `noise_sigma`: the per-point noise from second-difference pseudo-residuals (Gasser, Sroka & Jennen-Steinmetz
  1986, Biometrika 73:625), which cancel any locally linear trend and so measure noise, not the curve's shape.

Everything is vectorised over leading batch axes so a seeded residual bootstrap costs a few milliseconds.
"""

from __future__ import annotations

import codecs
import csv
import itertools
import math
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any, Literal, Optional

import numpy as np

from rangefinder.errors import RangefinderError

Ramp = Literal["linear", "exp"]

# The columns the engine writes (see the Curve CSV contract); per-bucket columns follow them.
CURVE_COLUMNS = ("update", "epoch", "lr", "train_loss", "val_loss", "stabilize_loss")


# ---------------------------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class CurveFile:
    """A curve CSV as read (`read_curve`): its columns, and what was done to its rows on the way."""

    columns: dict[str, np.ndarray]  # one float array per column (string arrays for non-number ones), in file order
    filled: dict[str, np.ndarray]  # per `fill_down` column: whether each kept row's cell came from a row above it
    step: Optional[str]  # the file's column the rows were put in order by (fill, replacement), or None: file order
    replaced: int  # kept rows left out for a later row at the same step (a resumed run's discarded rows)


def read_curve_csv(path: str | Path, required: Sequence[str] = ("val_loss",),
                   skip_empty: Sequence[str] = (), columns: Optional[Mapping[str, str]] = None,
                   flags: Optional[Mapping[str, str]] = None) -> dict[str, np.ndarray]:
    """The columns of `read_curve` (the engine's metrics.csv, or another trainer's export, read in file order)."""
    return read_curve(path, required, skip_empty, columns, flags).columns


def read_curve(path: str | Path, required: Sequence[str] = ("val_loss",),
               skip_empty: Sequence[str] = (), columns: Optional[Mapping[str, str]] = None,
               flags: Optional[Mapping[str, str]] = None, fill_down: Sequence[str] = (),
               steps: Sequence[str] = ()) -> CurveFile:
    """Read a curve CSV (the engine's metrics.csv) into float arrays, one per column; empty cells become NaN.

    `columns` maps a contract column to the file's name for it (another trainer's export: `Step`, `Value`,
    `lr/unet`); that column is read under the contract name. `flags` names, per contract column, the command-line
    flag that sets its name, for the message when it is missing.
    `steps`: the contract columns, in preference, that count the run's steps (update, epoch); the first the file
    has, or else its one column named as a step (`step`, W&B's `_step`, `global_step`), orders the rows. A kept row
    whose `fill_down` cell is empty takes the last value above it in that order, as a log that writes the LR on each
    step's row and the validation loss on a row of its own reads (W&B's history, a join of TensorBoard tags); and of
    kept rows at one step the last in the file stands: a run resumed from a checkpoint logs the steps after it again,
    and the earlier rows are those of the run it discarded. Without a step column, both go by file order.
    Rows whose cell is empty in a `skip_empty` column are left out (not measured there), while a written `nan` or
    `inf` is kept: it is a measurement that blew up.
    Columns that are not numbers throughout (none in the contract) are kept as string arrays. Raises
    RangefinderError naming the file, line and column when the file is missing, empty, ragged, lacks a
    `required` column or has a non-number in a contract column.
    """
    p = Path(path)
    if p.is_dir():  # a run's output folder, given for the curve in it: it was told the folder does not exist
        inside = p / "metrics.csv"
        raise RangefinderError(f"curve file {p} is a folder; pass "
                               + (f"the curve in it, {inside}" if inside.is_file() else
                                  "the metrics.csv a training run wrote"))
    if not p.is_file():
        raise RangefinderError(f"curve file {p} does not exist; pass the metrics.csv a training run wrote")
    try:
        return _read_csv(p, required, skip_empty, columns or {}, flags or {}, fill_down, steps)
    except (UnicodeDecodeError, csv.Error) as e:
        raise RangefinderError(f"curve file {p} is not a CSV text file ({type(e).__name__}: {e}); pass the "
                               "metrics.csv a training run wrote") from None


def _read_csv(p: Path, required: Sequence[str], skip_empty: Sequence[str], columns: Mapping[str, str],
              flags: Mapping[str, str], fill_down: Sequence[str], steps: Sequence[str]) -> CurveFile:
    # utf-8-sig: Excel's "CSV UTF-8" and PowerShell's Export-Csv start the file with a byte-order mark, which read as
    # utf-8 glued itself to the first column's name ("\ufefflr"). A UTF-16 mark: Windows PowerShell 5.1's `>`
    # (Out-File) writes a script's printed CSV so, which read as utf-8 was "not a CSV text file".
    with p.open("rb") as raw:
        utf16 = raw.read(2) in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
    with p.open(newline="", encoding="utf-16" if utf16 else "utf-8-sig") as f:
        first = f.readline()
        # The separator the header row uses: a comma, or the semicolon a spreadsheet in a decimal-comma locale
        # (German, French, ...) writes, or a tab (a table pasted from a terminal or a spreadsheet). Read with commas,
        # "lr;val_loss" was one column that held neither.
        sep = next((s for s in (",", ";", "\t") if s in first), ",")
        reader = csv.reader(itertools.chain([first], f), delimiter=sep)
        header = next(reader, None)
        if not header or not any(h.strip() for h in header):
            raise RangefinderError(
                f"curve file {p} is empty; it needs a header row such as update,epoch,lr,val_loss")
        header = [h.strip() for h in header]
        twice = sorted({h for h in header if header.count(h) > 1})
        if twice:
            # Two TensorBoard exports pasted side by side (Wall time,Step,Value twice): read by name, the two
            # columns' cells were interleaved into one, and the curve read was neither.
            raise RangefinderError(f"{p} names more than one column {', '.join(map(repr, twice))}; rename them "
                                   "apart in the header row (e.g. Value to lr and val_loss), or drop the copies")
        absent = [f"{given!r} (named for {ours})" for ours, given in columns.items() if given not in header]
        if absent:
            raise RangefinderError(f"{p} has no column {', '.join(absent)} (it has {', '.join(header)}); "
                                   "give a name as the header row spells it")
        # The named column is read as ours; a column the file itself calls by our name is set aside.
        renamed = {given: ours for ours, given in columns.items()}
        header = [renamed.get(h, f"{h} (unused)" if h in columns else h) for h in header]
        cells: dict[str, list[str]] = {h: [] for h in header}
        kept_lines: list[int] = []  # the line number of each kept row, for error messages
        skip_at = [header.index(c) for c in skip_empty if c in header]
        fill_at = {header.index(c): c for c in fill_down if c in header}
        step_at = _step_column(header, steps)
        # Of every row, kept or not: its step and its fill_down cells, to fill and replace by step once all are read.
        row_steps: list[str] = []
        row_fills: list[tuple[str, ...]] = []
        kept_rows: list[int] = []  # each kept row's index among all rows
        # Row by row into the columns: a long file is held once, as its cells, not also as its rows.
        for lineno, row in enumerate(reader, start=2):
            if not any(c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise RangefinderError(
                    f"{p} line {lineno} has {len(row)} cells but the header has {len(header)}; "
                    "the file is cut or not a curve CSV"
                )
            row_steps.append(row[step_at].strip() if step_at is not None else "")
            row_fills.append(tuple(row[i].strip() for i in fill_at))
            if any(not row[i].strip() for i in skip_at):
                continue
            kept_rows.append(len(row_steps) - 1)
            kept_lines.append(lineno)
            for h, c in zip(header, row, strict=True):
                cells[h].append(c.strip())
    missing = [c for c in required if c not in cells]
    if missing:
        fix = "pass the metrics.csv of a run that measured validation loss"
        if all(c in flags for c in missing):
            fix = "; ".join(_name_the_column(c, flags[c], header) for c in missing)
        raise RangefinderError(f"{p} has no {', '.join(missing)} column (it has {', '.join(header)}); {fix}")
    # Where the comma does not separate cells it may be the decimal mark ("1,5e-06;0,2113"), and reads as a point.
    number = float if sep == "," else lambda c: float(c.replace(",", "."))
    step = np.array([_number_or_nan(c, number) for c in row_steps], dtype=float)
    order = np.argsort(step, kind="stable") if step_at is not None else np.arange(step.size)
    filled = _fill_down(cells, fill_at, row_fills, order, kept_rows)
    # Of kept rows at one step, the last in the file stands.
    kept_step = step[kept_rows]
    stands = np.ones(len(kept_rows), dtype=bool)
    if step_at is not None:
        last = {s: i for i, s in enumerate(kept_step.tolist()) if math.isfinite(s)}
        stands = np.array([not math.isfinite(s) or last[s] == i for i, s in enumerate(kept_step.tolist())], dtype=bool)
    out: dict[str, np.ndarray] = {}
    for h, col in cells.items():
        try:
            out[h] = np.array([number(c) if c else math.nan for c in col], dtype=float)
        except ValueError:
            if h in CURVE_COLUMNS or h.startswith(("val_loss_b", "stabilize_loss_b")):
                bad = next((i, c) for i, c in zip(kept_lines, col, strict=True) if not _is_float(c, number))
                named = f"{columns[h]!r} (read as {h})" if h in columns else h  # as the user's header spells it
                raise RangefinderError(
                    f"{p} line {bad[0]}, column {named}: {bad[1]!r} is not a number; leave a cell empty when not "
                    "measured"
                ) from None
            out[h] = np.array(col, dtype=object)
    _refuse_long_form(p, out)
    if not stands.all():
        out = {h: col[stands] for h, col in out.items()}
        filled = {c: f[stands] for c, f in filled.items()}
    step_name = None if step_at is None else columns.get(header[step_at], header[step_at])  # as the file spells it
    return CurveFile(columns=out, filled=filled, step=step_name,
                     replaced=int(np.sum(~stands)))


def _step_column(header: Sequence[str], steps: Sequence[str]) -> Optional[int]:
    """The index of the header's column that counts steps: the first of `steps` it has, else its one column named
    as a step (`step`, W&B's `_step`, `global_step`), else None (no order but the file's)."""
    if not steps:
        return None
    ours = next((c for c in steps if c in header), None)
    if ours is not None:
        return header.index(ours)
    named = [i for i, h in enumerate(header) if _LIKELY["update"](_plain_name(h))]
    return named[0] if len(named) == 1 else None


def _number_or_nan(c: str, number: Callable[[str], float]) -> float:
    try:
        return number(c) if c else math.nan
    except ValueError:  # a kept row's is named by the column check; another row's cannot be placed
        return math.nan


def _fill_down(cells: dict[str, list[str]], fill_at: Mapping[int, str], row_fills: Sequence[tuple[str, ...]],
               order: np.ndarray, kept_rows: Sequence[int]) -> dict[str, np.ndarray]:
    """Fill each kept row's empty `fill_at` cells (in `cells`) with the last value above it in `order`; per
    column, whether each kept row's cell was filled."""
    at_kept = {r: k for k, r in enumerate(kept_rows)}
    filled = {c: np.zeros(len(kept_rows), dtype=bool) for c in fill_at.values()}
    above: dict[str, str] = {}
    for r in order.tolist():
        for c, value in zip(fill_at.values(), row_fills[r], strict=True):
            if value:
                above[c] = value
            elif c in above and r in at_kept:
                cells[c][at_kept[r]] = above[c]
                filled[c][at_kept[r]] = True
    return filled


def replaced_note(read: CurveFile, rows: str) -> str:
    """The reading note for the rows `read` replaced by a later row at the same step."""
    return (f"{read.replaced} {rows} rows were replaced by a later row at the same {read.step}: a run resumed from a "
            "checkpoint logs the steps after it again, and the earlier rows are those of the run it discarded. "
            "Check that the file holds one run if that is unexpected.")


def _refuse_long_form(p: Path, out: dict[str, np.ndarray]) -> None:
    """RangefinderError for MLflow's metric history in long form, one row per (metric, step) under `key` and
    `value` (MlflowClient.get_metric_history in a DataFrame, mlflow's `key,value,step,timestamp`): read as columns,
    `value` mixed every metric's values into one curve."""
    key = next((h for h in out if h.lower() == "key" and out[h].dtype == object), None)
    names = sorted({str(k) for k in out[key]}) if key else []
    if len(names) > 1:
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        raise RangefinderError(
            f"{p} holds {len(names)} metrics in long form, one per row under {key} ({shown}), which read as columns "
            "mix into one curve; write one column per metric first, e.g. with pandas: "
            "df.pivot_table(index='step', columns='key', values='value').to_csv('wide.csv'), then name its columns")


# What another trainer's log calls a contract column, by its name in lower case with every run of other characters
# read as "_": kohya's `lr/unet`, W&B's `run - val_loss` (not its `__MIN`/`__MAX` band), OneTrainer's
# `loss/validation_step`, a TensorBoard export's `Step` and `Value` (one tag per file).
_LIKELY = {
    "lr": lambda n: n in ("lr", "learning_rate") or n.startswith("lr_") or n.endswith("_lr"),
    "val_loss": lambda n: n == "value" or ("loss" in n and "val" in n and not n.endswith(("_min", "_max"))),
    "update": lambda n: n in ("step", "global_step", "steps", "update", "updates", "optimizer_step"),
    "epoch": lambda n: n in ("epoch", "epochs"),
}
_MEANING = {"lr": "the learning rate of each validation", "val_loss": "the validation loss",
            "update": "the optimizer update (global step) of each validation", "epoch": "the epoch of each validation"}


def _plain_name(header_name: str) -> str:
    """A column's name as _LIKELY reads it: lower case, every run of other characters one "_", none at the ends."""
    return re.sub(r"[^a-z0-9]+", "_", header_name.lower()).strip("_")


def _name_the_column(ours: str, flag: str, header: Sequence[str]) -> str:
    """How to name the file's column for `ours`: its flag, and the one column of `header` that looks like it."""
    likely = [h for h in header if _LIKELY.get(ours, lambda n: False)(_plain_name(h))]
    guess = f", e.g. {flag} {shlex.quote(likely[0])}" if len(likely) == 1 else ""
    return f"name the column that holds {_MEANING.get(ours, ours)} with {flag} NAME{guess}"


def _is_float(c: str, number: Callable[[str], float] = float) -> bool:
    if not c:
        return True
    try:
        number(c)
        return True
    except ValueError:
        return False


# The most points an analysis reads. The smoother, its cross-validated span, the permutation test and the bootstrap
# each hold n x n weights and kernels: 500 points take ~3 s on one core and 4 MB per matrix, 1000 take ~16 s, and a
# 2,000,000-row file would need 32 TB per matrix. A longer curve is read as the means of consecutive rows
# (`bin_means`); every curve the engine writes at the shipped settings (tens to a few hundred validations) is
# shorter and read row by row, as before.
MAX_CURVE_POINTS = 500


@dataclass(frozen=True)
class RowOrder:
    """Which rows of a curve an analysis reads, and in which order (`order_rows`)."""

    index: np.ndarray  # rows in axis order: those with a finite value, then the non-finite run at the end
    non_finite: int  # rows left out for a NaN/inf between finite rows, or a NaN/inf on the axis itself
    reordered: bool  # the rows were not in increasing axis order as given


def order_rows(axis: np.ndarray, y: np.ndarray) -> RowOrder:
    """The rows to read, sorted by `axis` (stable: ties keep their order).

    A NaN or inf value with finite values after it (in axis order) is a failed measurement, not the end of the
    curve: the rows after it were measured, so it is left out and counted, and the rest is read. A non-finite run
    at the end stays: it is where the loss blew up (`finite_prefix` and the analyses' "diverged"). A row whose axis
    value is not finite cannot be placed and is left out and counted too.
    """
    placed = np.isfinite(axis)
    idx = np.flatnonzero(placed)
    reordered = bool(np.any(np.diff(axis[idx]) < 0))
    idx = idx[np.argsort(axis[idx], kind="stable")]
    finite = np.isfinite(y[idx])
    measured = np.flatnonzero(finite)
    end = int(measured[-1]) + 1 if measured.size else 0
    keep = np.concatenate([idx[:end][finite[:end]], idx[end:]])
    return RowOrder(index=keep, non_finite=int(axis.size - keep.size), reordered=reordered)


def merge_ties(x: np.ndarray, *arrays: np.ndarray) -> list[np.ndarray]:
    """[x, *arrays] with the rows that share an `x` value (x sorted) read as one: that x, and the mean of each array's
    finite values over them (NaN where none is). The arrays as they are when every x is distinct.

    The smoother, the noise estimate and the permutation test each divide by differences of x: two rows at one x gave
    a 0/0 that made the permutation test call pure noise a descent (p = 1/300) and the noise NaN. Rows at one update
    are the same weights measured again (a file written twice); rows at one LR of a step-wise sweep, its loss there.
    """
    values, first, inverse = np.unique(x, return_index=True, return_inverse=True)
    if values.size == x.size:
        return [x, *arrays]
    out = [x[first]]
    for a in arrays:
        finite = np.isfinite(a)
        counts = np.bincount(inverse, weights=finite.astype(float), minlength=values.size)
        sums = np.bincount(inverse, weights=np.where(finite, a, 0.0), minlength=values.size)
        out.append(np.where(counts > 0, sums / np.maximum(counts, 1.0), np.nan))
    return out


def bin_means(max_points: int, *arrays: np.ndarray) -> tuple[int, list[np.ndarray]]:
    """(rows per point, arrays) with each array cut into consecutive bins of k rows, k the smallest that leaves
    at most `max_points` bins, and each bin replaced by its mean (NaNs ignored; all-NaN bins stay NaN). k = 1
    returns the arrays as they are."""
    n = arrays[0].size
    k = max(1, math.ceil(n / max_points))
    if k == 1:
        return 1, list(arrays)
    m = math.ceil(n / k)
    out = []
    for a in arrays:
        padded = np.full(m * k, np.nan)
        padded[:n] = a
        bins = padded.reshape(m, k)
        counts = np.sum(np.isfinite(bins), axis=1)
        sums = np.nansum(bins, axis=1)
        out.append(np.where(counts > 0, sums / np.maximum(counts, 1), np.nan))
    return k, out


def reading_notes(rows: RowOrder, n_rows: int, rows_per_point: int, axis_name: str, merged: int = 0) -> list[str]:
    """Advice lines for what an analysis did to the rows before reading them (none when it read them as given)."""
    notes = []
    if rows.non_finite:
        notes.append(
            f"{rows.non_finite} of {n_rows} rows had a NaN or inf {axis_name} or val_loss between finite rows and "
            "were left out (a failed measurement: the rows after them were measured); check how the file was "
            "written if that is unexpected."
        )
    if rows.reordered:
        notes.append(
            f"The rows were not in increasing {axis_name} order; they were read sorted by {axis_name}. Check that "
            "the file holds one run (two files joined end to end interleave)."
        )
    if merged:
        why = "a row written twice" + (", or an LR held over several validations" if axis_name == "lr" else "")
        notes.append(
            f"{merged} of {n_rows} rows had the {axis_name} of another row; the rows at each {axis_name} were read as "
            f"one point, their mean ({why}). Check that the file holds one run if that is unexpected."
        )
    if rows_per_point > 1:
        notes.append(
            f"The curve has more than {MAX_CURVE_POINTS} points; it was read as the means of {rows_per_point} "
            "consecutive rows each (the analysis' cost grows with the square of the points)."
        )
    return notes


def numbers(name: str, values: Any) -> np.ndarray:
    """`values` (a list, an array, a pandas column) as a flat float array; RangefinderError naming `name` where one is
    not a number: a column of text, or pandas' NA in an object column, failed in NumPy's conversion with its
    ValueError or TypeError, which a caller catching RangefinderError did not catch. None and NaN read as NaN."""
    try:
        return np.asarray(values, dtype=float).ravel()
    except (TypeError, ValueError) as e:
        raise RangefinderError(f"{name} must be numbers, one per row ({e}); pass a numeric column (pandas: "
                               "pd.to_numeric(column, errors='coerce') reads what is not a number as NaN)") from None


def check_reading_settings(seed: Any, divergence_factor: Optional[float]) -> None:
    """RangefinderError naming the argument, for a `seed` or `divergence_factor` of the analysis that the config's
    fields refuse (config.Seed, lr_range_test.divergence_factor): called from Python, a negative seed failed deep in
    NumPy's seeding, and a factor of 1 or less read a healthy curve as diverged."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise RangefinderError(f"seed must be a whole number of 0 or more (got {seed!r}); it seeds the permutation "
                               "test (and the range test's bootstrap)")
    if divergence_factor is not None and not divergence_factor > 1:
        raise RangefinderError(f"divergence_factor must be above 1, the multiple of the best loss past which the curve "
                               f"counts as diverged, or None to read every point (got {divergence_factor!r})")


def finite_prefix(*arrays: np.ndarray) -> int:
    """Length of the leading run in which every array is finite (a NaN/inf ends a ramp: all after it is void)."""
    ok = np.ones(len(arrays[0]), dtype=bool)
    for a in arrays:
        ok &= np.isfinite(a)
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else len(ok)


def divergence_cut(y: np.ndarray, factor: float) -> int:
    """Index where a positive loss has exploded for good: every point from there on is above `factor` x the best
    point before it. Returns len(y) when it never does. A lone spike followed by a normal point is not cut."""
    n = len(y)
    if n < 2 or factor is None or np.any(y <= 0):
        return n
    best_before = np.minimum.accumulate(np.concatenate([[np.inf], y[:-1]]))
    above = y > factor * best_before
    # Walk back from the end while every point is above: the explosion is the whole tail or nothing.
    k = n
    while k > 1 and above[k - 1]:
        k -= 1
    return k


def rise_cut(y: np.ndarray, min_points: int) -> int:
    """Length of the prefix before the curve climbs back above its start after its lowest point.

    From that point on the LR is beyond any upper bound (the loss is worse than before training), so the rest of
    the curve says nothing more about where the descent starts or stops; but a steep rise there, often many times
    the size of the descent, swells the second-difference noise estimate and lets shuffled curves start high, which
    hides a small, clean descent from the permutation test. Even the one point above the start costs the test most
    of its power on a prefix of 6-8 points (shuffles that put it first drop further than the real curve), so it is
    left out too. The climb is looked for after the lowest point: on a flat start, noise puts points on both sides
    of the start, and the first of them above it is no climb. Returns len(y) when there is no such point or the
    prefix would hold fewer than `min_points`.
    """
    n = len(y)
    i_min = int(np.argmin(y))
    if n < 2 or not y[i_min] < y[0]:
        return n
    above = np.flatnonzero(y[i_min + 1:] > y[0])
    if not above.size:
        return n
    i = i_min + 1 + int(above[0])
    return i if i >= min_points else n


def infer_ramp(lr: np.ndarray) -> Ramp:
    """`exp` when the positive LRs grow by a near-constant factor, `linear` when by a near-constant step.

    Compares the spread of the log-ratios with the spread of the differences, each relative to its mean; a
    baseline at LR 0 is ignored. The LRs are read sorted and each once, as the analysis reads the rows: in file
    order, a shuffled exponential sweep's steps looked no more constant one way than the other, and it was read as
    linear. With fewer than 3 distinct positive LRs there is nothing to compare and `exp` (the default sweep) is
    returned.
    """
    pos = np.unique(lr[np.isfinite(lr) & (lr > 0)])
    if pos.size < 3:
        return "exp"
    d_lin = np.diff(pos)
    d_log = np.diff(np.log(pos))
    cv_lin = np.std(d_lin) / max(abs(np.mean(d_lin)), 1e-300)
    cv_log = np.std(d_log) / max(abs(np.mean(d_log)), 1e-300)
    return "linear" if cv_lin < cv_log else "exp"


# ---------------------------------------------------------------------------------------------------------------
# Smoothing


@dataclass(frozen=True)
class Smooth:
    """A LOWESS fit. `fitted = kernel @ y` and `slope = slope_kernel @ y` (per batch row), so standard errors of
    any linear contrast of the fitted curve follow from the kernels and the noise."""

    fitted: np.ndarray  # (..., n) smoothed values at the data's x
    slope: np.ndarray  # (..., n) d fitted / dx of the local polynomial
    kernel: np.ndarray  # (..., n, n) equivalent kernel (hat matrix) of the final, robust pass
    slope_kernel: np.ndarray  # same shape as kernel
    leverage: np.ndarray  # (..., n) the kernel's diagonal L_ii, also when the kernels are not built
    span: int  # neighbours in each local fit
    degree: int  # 1: local lines; 2: local parabolas


def _tricube_weights(x: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    n = x.size
    dx = x[None, :] - x[:, None]  # (n, n): dx[i, j] = x_j - x_i
    dist = np.abs(dx)
    srt = np.sort(dist, axis=1)
    # Radius halfway between the span-th and the next neighbour, so exactly `span` points get weight.
    h = srt[:, span - 1] * 1.1 if span >= n else 0.5 * (srt[:, span - 1] + srt[:, span])
    h = np.maximum(h, 1e-12 * max(float(np.ptp(x)), 1e-300))
    u = np.clip(dist / h[:, None], 0.0, 1.0)
    return (1 - u**3) ** 3, dx


def _solve_local(s: list, t: list, degree: int) -> tuple:
    """Value and slope of weighted local polynomials from their moment sums s_k = sum w dx^k and t_k = sum w dx^k y
    (closed-form 2x2 / symmetric 3x3 inverses, elementwise, so any batch shape works). Also returns the first two
    rows of the inverse moment matrix, which give the kernels. A degenerate neighbourhood (too few distinct x)
    falls back to the local mean."""
    if degree == 1:
        a, b, c = s[0], s[1], s[2]
        det = a * c - b * b
        ok = det > 1e-10 * np.maximum(a * c, 1e-300)
        det = np.where(ok, det, 1.0)
        r0: tuple[np.ndarray, ...] = (np.where(ok, c / det, 1.0 / np.maximum(a, 1e-300)), np.where(ok, -b / det, 0.0))
        r1: tuple[np.ndarray, ...] = (np.where(ok, -b / det, 0.0), np.where(ok, a / det, 0.0))
    else:
        a, b, c, d, e = s
        c00, c01, c02 = c * e - d * d, c * d - b * e, b * d - c * c
        c11, c12 = a * e - c * c, b * c - a * d
        det = a * c00 + b * c01 + c * c02
        ok = det > 1e-10 * np.maximum(a * c * e, 1e-300)
        det = np.where(ok, det, 1.0)
        r0 = (np.where(ok, c00 / det, 1.0 / np.maximum(a, 1e-300)), np.where(ok, c01 / det, 0.0),
              np.where(ok, c02 / det, 0.0))
        r1 = tuple(np.where(ok, v / det, 0.0) for v in (c01, c11, c12))
    value = sum(r * tk for r, tk in zip(r0, t, strict=True))
    slope = sum(r * tk for r, tk in zip(r1, t, strict=True))
    return value, slope, r0, r1


def lowess(x: np.ndarray, y: np.ndarray, span: int, robust_iters: int = 2, kernels: bool = True,
           degree: int = 1) -> Smooth:
    """Robust LOWESS of y (..., n) on x (n,) with `span` nearest neighbours per local polynomial of `degree`.

    The weighted sums are matrix products with the (n, n) tricube weights, so a batch of B curves costs
    O(B n^2) without building B kernels; `kernels=False` skips them (the bootstrap and permutation test).
    Local parabolas (degree 2) follow the knees of a sigmoid and the bottom of a U without the bias of lines
    (Cleveland & Devlin 1988, JASA 83:596), at the cost of more variance; `choose_span` picks between them.
    """
    x = np.asarray(x, float)
    y = np.asarray(y, float)
    n = x.size
    span = int(min(max(span, degree + 2), n))
    # Standardise x so the moment sums stay well conditioned on an LR axis (dx ~ 1e-4, dx^4 ~ 1e-16).
    scale = float(np.std(x)) or 1.0
    w0, dx = _tricube_weights(x / scale, span)
    pw = [(w0 * dx**k).T for k in range(2 * degree + 1)]
    rw = np.ones_like(y)
    inside = (w0 > 0).astype(float)  # (n, n): the points of each window
    plain_s: list[np.ndarray] = []  # the first (not robust) pass's moment sums
    plain_t: list[np.ndarray] = []
    keep_plain = None
    for it in range(robust_iters + 1):
        ry = rw * y
        s = [rw @ p for p in pw]
        t = [ry @ p for p in pw[: degree + 1]]
        if it == 0:
            plain_s, plain_t = s, t
        else:
            if it < robust_iters:
                # A window whose every point is set aside has no fit (it would read 0): it keeps the plain one
                # for this pass; the next pass usually restores the points a spike had only pulled off the fit.
                keep_plain = s[0] <= 1e-12 * plain_s[0]
            else:
                # The final fit may set aside a minority of its window's points as outliers, never most of them
                # (a robust fit's breakdown point is one half): then the "outliers" are the curve. On a near
                # noiseless curve with a knee sharper than the sampling (flat, then a steep fall over 2-3
                # points), the flat part fits to ~0 and every point of the knee lies beyond 6 MADs; robust fits
                # there flatten the descent away. Such windows keep the plain fit.
                keep_plain = rw @ inside.T < 0.5 * inside.sum(axis=1)
            s = [np.where(keep_plain, a, b) for a, b in zip(plain_s, s, strict=True)]
            t = [np.where(keep_plain, a, b) for a, b in zip(plain_t, t, strict=True)]
        fitted, slope, r0, r1 = _solve_local(s, t, degree)
        if it == robust_iters:
            break
        # Bisquare robustness weights on residuals scaled by 6 MADs (Cleveland 1979).
        resid = y - fitted
        mad = np.median(np.abs(resid), axis=-1, keepdims=True)
        # A floor far below any real noise, so an exact fit (residuals at rounding level) keeps all its weights.
        mad = np.maximum(mad, 1e-7 * (np.median(np.abs(y), axis=-1, keepdims=True) + np.ptp(y, axis=-1, keepdims=True)))
        u = resid / np.where(mad > 0, 6.0 * mad, np.inf)
        rw = np.where(np.abs(u) < 1, (1 - u * u) ** 2, 0.0)
    if keep_plain is not None:
        # Row i of the weights: the robustness weights window i's final fit used (all 1 where it kept the plain fit).
        rw_row = np.where(keep_plain[..., :, None], 1.0, rw[..., None, :])
        rw_own = np.where(keep_plain, 1.0, rw)
    else:
        rw_row, rw_own = rw[..., None, :], rw
    L = M = np.empty(0)
    if kernels:
        w = w0 * rw_row
        L = w * sum(r[..., None] * dx**k for k, r in enumerate(r0))
        M = w * sum(r[..., None] * dx**k for k, r in enumerate(r1)) / scale
    leverage = rw_own * r0[0]  # L_ii = w_ii rw_i (S^-1)_00 with w_ii = 1 and dx_ii = 0
    return Smooth(fitted=fitted, slope=slope / scale, kernel=L, slope_kernel=M, leverage=leverage, span=span,
                  degree=degree)


def choose_span(x: np.ndarray, y: np.ndarray, min_span: int = 4) -> tuple[int, int]:
    """The LOWESS (span, degree) with the smallest robust leave-one-out error.

    LOO residuals of a linear smoother are e_i / (1 - L_ii) (no refits needed). The largest tenth of them are
    trimmed so an outlier spike cannot pull the choice toward wiggly fits.
    """
    n = x.size
    if n <= min_span:
        return n, 1
    fractions = (0.1, 0.15, 0.2, 0.25, 0.33, 0.45, 0.6, 0.8, 1.0)
    best, best_err = (n, 1), math.inf
    keep = n - max(1, int(math.ceil(0.1 * n)))
    for degree in (1, 2):
        lo = min_span + degree - 1
        if n < lo + 1:
            continue
        for span in sorted({int(min(n, max(lo, round(f * n)))) for f in fractions}):
            sm = lowess(x, y, span, degree=degree)
            lev = np.clip(np.diagonal(sm.kernel), 0.0, 0.99)
            loo = ((y - sm.fitted) / (1 - lev)) ** 2
            err = float(np.mean(np.sort(loo)[:keep]))
            if err < best_err * (1 - 1e-9):
                best, best_err = (span, degree), err
    return best


def trend_test(x: np.ndarray, y: np.ndarray, seed: int, permutations: int = 299) -> tuple[float, float]:
    """Permutation p-values of "the smoothed curve falls below its start" and "rises above it".

    The statistic is the largest (fitted_0 - fitted_k) / (sigma ||L_0 - L_k||) over k (the drop in units of its
    standard error, sigma from `noise_sigma`), on a robust LOWESS with a span of half the
    points (a quarter as well lost more power on broad descents than it gained on narrow valleys). It is compared
    with the same statistic on the same losses in shuffled order, which is what pure noise looks like, so the test
    is exact for any number of points and needs no noise model. The span is fixed because cross-validating it on
    the observed curve alone would favour that curve. Permutations are seeded: the same curve, the same p-value.
    """
    n = x.size
    rng = np.random.default_rng([seed, 1])
    perms = np.argsort(rng.random((permutations, n)), axis=1)
    ys = np.concatenate([y[None, :], y[perms]])
    # The 90%-trimmed noise, not the one that also trims gross pseudo-residuals: trimming those would trim the
    # scattered low points of the shuffles too, and cost power (the small-descent synthetic case in
    # tests/analysis/test_lr_bounds.py: 6 instead of 8 of 12 read).
    noise = noise_sigma(x, ys, trim_gross=False)[:, None]
    down = np.full(permutations + 1, -np.inf)
    up = np.full(permutations + 1, -np.inf)
    for span in (max(4, int(math.ceil(n / 2))),):
        kernel = lowess(x, y, span, robust_iters=0).kernel
        d = kernel[0][None, :] - kernel
        norm = np.sqrt((d * d).sum(-1))
        norm[0] = np.inf
        f = lowess(x, ys, span, kernels=False).fitted
        # Studentised by each curve's own second-difference noise: shuffling a smooth trend makes neighbours
        # jump, so its noise estimate swells and the shuffled statistic shrinks; for pure noise nothing changes.
        scale = norm[None, :] * noise
        down = np.maximum(down, np.max((f[:, :1] - f) / scale, axis=1))
        up = np.maximum(up, np.max((f - f[:, :1]) / scale, axis=1))
    p_down = (1 + np.sum(down[1:] >= down[0] - 1e-12)) / (permutations + 1)
    p_up = (1 + np.sum(up[1:] >= up[0] - 1e-12)) / (permutations + 1)
    return float(p_down), float(p_up)


# ---------------------------------------------------------------------------------------------------------------
# Noise


def noise_sigma(x: np.ndarray, y: np.ndarray, trim_gross: bool = True) -> np.ndarray:
    """Per-point noise standard deviation from Gasser et al.'s pseudo-residuals, robustly (trimmed). Batched over
    leading axes of y. Each pseudo-residual compares y_i with the line through its two neighbours, so a smooth
    trend cancels and what is left is noise. Curvature the sampling resolves adds a little, which errs on the
    cautious side; a knee sharper than the sampling is trimmed like a spike when `trim_gross` (below)."""
    x = np.asarray(x, float)
    y = np.asarray(y, float)
    if x.size < 3:
        return np.full(y.shape[:-1], np.nan)
    span = x[2:] - x[:-2]
    a = (x[2:] - x[1:-1]) / span
    b = (x[1:-1] - x[:-2]) / span
    eps = (a * y[..., :-2] + b * y[..., 2:] - y[..., 1:-1]) / np.sqrt(a * a + b * b + 1)
    # Root mean square of the smallest 90% (a spike or two cannot inflate it), rescaled to a normal s.d.; more
    # efficient than the MAD, which scatters by +-30% on 60 points. With `trim_gross`, more are trimmed where more
    # lie beyond 3 robust s.d.s (1.4826 x the median |pseudo-residual|; never more than half): the bend of a near
    # noiseless curve from flat into a steep fall between two LRs of a coarse sweep gives 2-3 pseudo-residuals
    # hundreds of times the others, which would otherwise pass for the noise (the LoRA range test in
    # tests/analysis/test_lr_bounds.py: 0.0028 instead of ~1e-4, on a drop of 0.027). The rescaling treats every
    # trimmed one as a normal tail, so it errs high when they are a knee.
    m = eps.shape[-1]
    e2 = np.sort(eps * eps, axis=-1)
    keep = np.full(e2.shape[:-1], m)
    if m >= 5:
        gross = np.sum(e2 > 9 * 1.4826**2 * np.median(e2, axis=-1, keepdims=True), axis=-1) * trim_gross
        keep = np.clip(m - gross, math.ceil(m / 2), m - math.ceil(0.1 * m))
    q = np.arange(1, m + 1) / m  # kept share for each possible count
    z = np.array([NormalDist().inv_cdf(0.5 + 0.5 * v) if v < 1 else math.inf for v in q])
    with np.errstate(invalid="ignore"):
        consistency = np.where(q < 1, 1.0 - 2 * z * np.exp(-z * z / 2) / math.sqrt(2 * math.pi) / q, 1.0)
    mean_kept = np.take_along_axis(np.cumsum(e2, axis=-1), keep[..., None] - 1, axis=-1)[..., 0] / keep
    sigma = np.sqrt(mean_kept / consistency[keep - 1])
    # An exactly smooth curve gives 0; keep a floor so ratios stay finite (relative to the curve's scale).
    scale = np.maximum(np.abs(np.median(y, axis=-1)), 1e-12)
    return np.maximum(sigma, 1e-9 * scale)


def contrast_se(kernel: np.ndarray, i: np.ndarray | int, j: np.ndarray | int, sigma: np.ndarray | float) -> np.ndarray:
    """Standard error of fitted[i] - fitted[j] for independent noise of s.d. sigma (batched over kernel's lead)."""
    diff = np.take(kernel, np.atleast_1d(i), axis=-2) - np.take(kernel, np.atleast_1d(j), axis=-2)
    return np.asarray(sigma)[..., None] * np.sqrt((diff * diff).sum(-1))


def end_slope(x: np.ndarray, y: np.ndarray, sigma: float, share: float = 0.2) -> tuple[float, float]:
    """Least-squares slope of the last `share` of the points (at least 4) and its standard error for noise sigma."""
    k = min(x.size, max(4, int(math.ceil(share * x.size))))
    dx = x[-k:] - x[-k:].mean()
    sxx = float((dx * dx).sum())
    if sxx <= 0:
        return 0.0, math.inf
    return float((dx * y[-k:]).sum() / sxx), sigma / math.sqrt(sxx)


def crossing(x: np.ndarray, f: np.ndarray, level: float, start: int, stop: int) -> Optional[float]:
    """First x in [x[start], x[stop]] where f falls to `level` or below, linearly interpolated; None if never."""
    for k in range(start, stop + 1):
        if f[k] <= level:
            if k == start:
                return float(x[k])
            f0, f1 = f[k - 1], f[k]
            t = (f0 - level) / (f0 - f1) if f0 != f1 else 1.0
            return float(x[k - 1] + t * (x[k] - x[k - 1]))
    return None
