"""Self-contained HTML reports and short Markdown summaries of the two decisions.

The KFP UI renders HTML and Markdown artifacts but shows no images, so the HTML embeds its plot as a base64 data
URI and carries its own CSS: no external file, script or font. Every file is written under a temporary name and
renamed, so a half-written report never looks finished.
"""

from __future__ import annotations

import base64
import html
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from rangefinder.analysis.halving import BELOW, HalvingDecision
from rangefinder.analysis.lr_bounds import FLAG_ADVICE as LR_FLAG_ADVICE
from rangefinder.analysis.lr_bounds import STATUS_ADVICE as LR_STATUS_ADVICE
from rangefinder.analysis.lr_bounds import LRBounds
from rangefinder.analysis.plots import plot_lr_range_test, plot_prodigy_step, plot_retrain, plot_step_window
from rangefinder.analysis.prodigy_step import FACTOR_FROM_TABLE, ProdigyStep, step_size_estimates
from rangefinder.analysis.step_window import FLAG_ADVICE as STEP_FLAG_ADVICE
from rangefinder.analysis.step_window import (
    LENGTH_BASIS_TEXT,
    Delivery,
    RecommendedLength,
    StepWindow,
    band_widened,
)
from rangefinder.analysis.step_window import STATUS_ADVICE as STEP_STATUS_ADVICE
from rangefinder.defaults import LOW_QUALITY
from rangefinder.formats.atomic import write_bytes
from rangefinder.formats.text import markdown_cell

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:860px;margin:24px auto;padding:0 16px;
color:#1d2733;line-height:1.45}
p,li{overflow-wrap:anywhere}
h1{font-size:1.4em;margin-bottom:4px} h2{font-size:1.1em;margin-top:28px}
.status{display:inline-block;padding:2px 10px;border-radius:10px;font-weight:600;color:#fff}
.ok{background:#2e9e5b} .warn{background:#d9822b} .bad{background:#c23030}
table{border-collapse:collapse;margin:8px 0} td,th{padding:4px 12px;border-bottom:1px solid #e3e7ec;text-align:left}
td.num{font-family:ui-monospace,Menlo,Consolas,monospace}
img{max-width:100%;border:1px solid #e3e7ec}
li{margin:6px 0} .flag{font-family:ui-monospace,Menlo,Consolas,monospace;font-weight:600}
.muted{color:#6b7785;font-size:.9em}
.strip{overflow-x:auto;max-width:100%} .strip table{margin:0} .strip td,.strip th{padding:2px 4px;border:0;
vertical-align:top} .strip th{font-weight:600;font-size:.85em;white-space:nowrap}
.strip th.row{font-weight:normal;white-space:normal;min-width:9em;max-width:14em}
.strip img{image-rendering:pixelated;display:block;border:0;max-width:none}
"""


STRIP_WIDTH = 828  # px: the page's content width (_CSS: max-width 860 less 2 x 16 padding)


@dataclass(frozen=True)
class SampleStrip:
    """Samples rendered during a run (training/samples.py), for its report: the same prompts and seeds at several
    updates, so only the weights differ along a row."""

    rows: list[str]  # one label per row: "prompt | seed N"
    columns: list[tuple[int, float, list[Path]]]  # (update, epoch, one PNG per row), in update order
    mlflow_key: Optional[str] = None  # the MLflow image series that holds the same grids


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        # A range with no ends (a window without epochs) is one "-", not "- - -".
        return "-" if all(i is None for i in v) else " - ".join(_fmt(i) for i in v)
    return str(v)


def _lr(v: Any) -> Any:
    """An LR, or a range of them, for a report's table: 3 significant figures, as the lead, the plot's legend, the
    progress lines and the run names give it (0.000209), where the table's 4 (0.0002091, 0.0001425) read beside the
    lead's 0.000143 as another value."""
    if isinstance(v, (list, tuple)):
        return [_lr(i) for i in v]
    return f"{v:.3g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def _png_data_uri(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")


def _status_class(status: str) -> str:
    return "ok" if status == "ok" else "bad" if status in ("diverged", "no_descent", "no_improvement") else "warn"


def _png_width(png: Path) -> int:
    """A PNG's width in pixels, from its IHDR chunk (bytes 16-20)."""
    with open(png, "rb") as f:
        head = f.read(24)
    return int(struct.unpack(">I", head[16:20])[0]) if head[:8] == b"\x89PNG\r\n\x1a\n" else 0


def _strip_html(strip: Optional[SampleStrip]) -> str:
    """The "samples over training" section: a row per prompt and seed, a column per sampled update (left to right
    in time); wider than the page, it scrolls inside its box. Small images are enlarged with crisp pixels."""
    if strip is None or not strip.columns:
        return ""
    e = html.escape
    # Cells as large as fit the page's width (_CSS: 860 px less padding, a 150 px label column, 8 px per cell), in
    # bounds: small images (tiny models) at 96 px down to 40, others at 128 down to 64, past which the box scrolls.
    natural, n = _png_width(strip.columns[0][2][0]), len(strip.columns)
    largest, smallest = (96, 40) if natural <= 96 else (128, 64)
    size = max(smallest, min(largest, (STRIP_WIDTH - 150) // n - 8))
    scrolls = 150 + n * (size + 8) > STRIP_WIDTH
    # Two header rows of bare numbers, labelled on the left, so a column is as narrow as its images.
    head = ("<tr><th class='row'>update</th>" + "".join(f"<th>{u}</th>" for u, _, _ in strip.columns) + "</tr>"
            "<tr><th class='row'>epoch</th>" + "".join(f"<th>{ep:g}</th>" for _, ep, _ in strip.columns) + "</tr>")
    body = []
    for r, label in enumerate(strip.rows):
        cells = "".join(
            f"<td><img alt='{e(label)} at update {u}' width='{size}' height='{size}' "
            f"src='{_png_data_uri(pngs[r])}'></td>" for u, _, pngs in strip.columns)
        body.append(f"<tr><th class='row'>{e(label)}</th>{cells}</tr>")
    where = (f" MLflow holds the same grids as the image series <span class='flag'>{e(strip.mlflow_key)}</span> "
             "of this run (step = update)." if strip.mlflow_key else "")
    more = " Scroll the strip sideways for the later updates." if scrolls else ""
    return (f"<h2>Samples over training</h2><p class='muted'>The same prompts and seeds rendered from the weights at "
            f"{len(strip.columns)} validations; only the weights differ along a row.{where}{more}</p>"
            f"<div class='strip'><table>{head}{''.join(body)}</table></div>")


def _page(title: str, status: str, lead: str, png: Optional[Path], rows: list[tuple[str, Any, str]],
          notes: list[tuple[str, str]], source: Optional[str], extra_html: str = "") -> str:
    e = html.escape
    table = "\n".join(
        f"<tr><th>{e(k)}</th><td class='num'>{e(_fmt(v))}</td><td class='muted'>{e(why)}</td></tr>"
        for k, v, why in rows
    )
    items = "\n".join(f"<li><span class='flag'>{e(k)}</span>: {e(text)}</li>" for k, text in notes)
    src = f"<p class='muted'>Curve: {e(source)}</p>" if source else ""
    img = f'<img alt="{e(title)} plot" src="{_png_data_uri(png)}">' if png is not None else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{e(title)}</title><style>{_CSS}</style></head>
<body>
<h1>{e(title)}</h1>
<p><span class="status {_status_class(status)}">{e(status)}</span> {e(lead)}</p>
{src}
{img}
{extra_html}
<h2>Numbers</h2>
<table>
{table}
</table>
<h2>What it means and what to do</h2>
<ul>
{items}
</ul>
</body></html>
"""


def _markdown(
    title: str, status: str, lead: str, rows: list[tuple[str, Any, str]], notes: list[tuple[str, str]],
    strip: Optional[SampleStrip] = None,
) -> str:
    # The HTML page's columns: the quantity, its value, and what it is (the halving candidates' best losses, ...).
    lines = [f"## {title}", "", f"**{status}**: {lead}", "", "| | | |", "|---|---|---|"]
    lines += [f"| {markdown_cell(k)} | {markdown_cell(_fmt(v))} | {markdown_cell(why)} |" for k, v, why in rows]
    lines += [""] + [f"- **{k}**: {text}" for k, text in notes]
    if strip is not None and strip.columns:
        where = f" (MLflow image series `{strip.mlflow_key}`)" if strip.mlflow_key else ""
        lines += ["", f"Samples over training{where}: updates {', '.join(str(u) for u, _, _ in strip.columns)}; "
                      "the HTML report shows them."]
    return "\n".join(lines) + "\n"


def _write_report(out: Path, stem: str, json_name: str, title: str, status: str, lead: str, png: Path,
                  rows: list[tuple[str, Any, str]], notes: list[tuple[str, str]], source_line: Optional[str],
                  decision: dict, strip: Optional[SampleStrip] = None) -> dict[str, Path]:
    """The HTML page, the Markdown summary and the decision's JSON beside the plot; {"plot", "html", ...} paths."""
    page = _page(title, status, lead, png, rows, notes, source_line, _strip_html(strip))
    return {
        "plot": png,
        "html": write_bytes(out / f"{stem}.html", page.encode("utf-8")),
        "markdown": write_bytes(out / f"{stem}.md", _markdown(title, status, lead, rows, notes, strip).encode()),
        "json": write_bytes(out / json_name, json.dumps(decision, indent=2).encode()),
    }


def _source_line(curve: Optional[dict], source: Optional[str]) -> Optional[str]:
    rows = None
    if curve:
        rows = max((len(v) for v in curve.values()), default=0)
    if source is None and rows is None:
        return None
    return ", ".join(p for p in (source, None if rows is None else f"{rows} rows") if p)


def lr_headline(bounds: LRBounds, zoom: Optional[tuple[float, float]] = None) -> str:
    """The LR report's lead: its decision in a sentence or two (also the step run's description in MLflow).
    `zoom`: the range of the zoomed test that reads the bounds again, when this one called for it; then this test's
    bounds are not the ones trained at, and the lead says so instead of "Train at"."""
    if zoom is not None:
        read = (f"this test read lr_mid {bounds.lr_mid:.3g} (between {bounds.lr_low:.3g} and {bounds.lr_high:.3g})"
                if bounds.status == "ok" and bounds.lr_mid else f"this test's curve was {bounds.status}")
        return (f"Replaced by a zoomed range test over {zoom[0]:.3g}..{zoom[1]:.3g}, whose bounds the fine-tune "
                f"uses: {read}, too few points or too uncertain to train at.")
    if bounds.status != "ok":
        return LR_STATUS_ADVICE[bounds.status]
    lead = (f"Train at lr_mid = {bounds.lr_mid:.3g} (between {bounds.lr_low:.3g} and {bounds.lr_high:.3g}); "
            f"confidence {bounds.quality_label}.")
    if "low_quality" in bounds.flags:
        lead += (f" The quality score {bounds.quality:.2f} is under {LOW_QUALITY:g}: check lr_mid with a zoomed "
                 "range test or a short grid before a long run (low_quality, below).")
    return lead


def step_headline(window: StepWindow, halving: Optional[HalvingDecision] = None,
                  delivered: Optional[Delivery] = None, length: Optional[RecommendedLength] = None) -> str:
    """The step-window report's lead (also the fine-tune run's description in MLflow); `delivered`: the checkpoint
    the fine-tune kept (analysis.delivered_checkpoint), said with its rule when it is not the window's usual one, is
    the run's final weights or does not beat the base model; `length`: the length the fine-tune recommends
    (steps.finetune.recommended_length), which a retrain trains: the window's unless a rule or a fallback sets another
    (default: the window's)."""
    length = length or RecommendedLength.of_window(window)
    if length is not None:
        made = f"{length.epochs} epochs ({length.updates} updates of this fine-tune)"
        if length.fallback:
            lead = (f"{STEP_STATUS_ADVICE[window.status]} With no window, the pipeline falls back to {made}: "
                    f"{LENGTH_BASIS_TEXT[length.basis]}.")
        elif length.basis != "window":
            lead = f"Train for {made}: {LENGTH_BASIS_TEXT[length.basis]}."
        else:
            lead = f"Train for {made}."
            if window.status == "still_improving":
                lead += " At least: the run ended while still improving."
    elif window.recommended_updates is not None:
        # A curve without epochs (no epoch column): the window is known in updates only. The status advice said
        # "train for the recommended epochs" over a table whose epochs were all "-".
        lead = f"Train for about {window.recommended_updates} updates (the curve has no epochs to count them in)."
        if window.status == "still_improving":
            lead += " At least: the run ended while still improving."
    else:
        lead = STEP_STATUS_ADVICE[window.status]
    if halving is not None:
        lead += f" The LR is {halving.lr:.3g}, {halving.kept}, kept by successive halving."
    if delivered is not None and (delivered.rule != "window_lowest" or delivered.final
                                  or delivered.improved_on_base is False):
        lead += f" {delivered.sentence()}"
    return lead


def write_lr_report(bounds: LRBounds, curve: Optional[dict], out_dir: str | Path, *,
                    source: Optional[str] = None, plan_warnings: Sequence[str] = (),
                    zoom: Optional[tuple[float, float]] = None,
                    validation_weighting: Optional[dict] = None) -> dict[str, Path]:
    """Write lr_range_test.png, lr_report.html (self-contained), lr_report.md and lr_bounds.json into out_dir.

    `curve` is the dict from read_curve_csv (or None): its rows are counted in the report; `source` names the
    curve file; `plan_warnings`: the training plan's warnings (planning.plan), one note each; `zoom`: the range of
    the zoomed test that replaces this one's bounds (lr_headline); `validation_weighting`: run_summary.json's
    statement of how val_loss combines its per-bucket (per-sigma) losses, a row per bucket and a note.
    Returns {"plot", "html", "markdown", "json"} -> paths.
    """
    out = Path(out_dir)
    png = plot_lr_range_test(bounds, out / "lr_range_test.png")
    lead = lr_headline(bounds, zoom)
    rows: list[tuple[str, Any, str]] = [
        ("lr_low", _lr(bounds.lr_low), "validation loss has started to fall"),
        ("lr_high", _lr(bounds.lr_high), "it has nearly reached its minimum (flattens or turns up after)"),
        ("lr_mid", _lr(bounds.lr_mid), f"the {bounds.midpoint} midpoint (below)"),
        ("lr_mid 80% interval", _lr(bounds.lr_mid_ci80), "from a seeded bootstrap of the curve"),
        *_midpoint_rows(bounds),
        ("quality", f"{bounds.quality:.2f} ({bounds.quality_label})",
         ", ".join(f"{k} {v:.2f}" for k, v in bounds.quality_parts.items())),
        ("signal-to-noise", bounds.snr, f"drop below the start in standard errors; p = {bounds.p_descent:.3g}"),
        ("noise (s.d.)", bounds.noise_sigma, "per-point validation-loss noise, from the data"),
        ("points used", bounds.points_used, f"{bounds.points_dropped} left out; sweep {bounds.ramp}"),
        ("lr_steepest (fastai 'steep')", _lr(bounds.lr_steepest),
         "for comparison: steepest raw slope, noise-sensitive"),
        ("lr_min / 10 (fastai 'minimum')", _lr(bounds.lr_min_div10), "for comparison"),
    ]
    advice = LR_STATUS_ADVICE[bounds.status]
    if zoom is not None and bounds.status == "ok":  # not "train at lr_mid": the zoom's bounds are trained at
        advice = "A real descent was found; the zoomed range test read the bounds again, and its report has them."
    notes: list[tuple[str, str]] = [(bounds.status, advice)]
    notes += [(f, LR_FLAG_ADVICE[f]) for f in bounds.flags]
    notes += _reading_notes(bounds.reading, plan_warnings)
    rows += _sigma_rows(curve, validation_weighting, None)
    notes += _weighting_note(validation_weighting)
    return _write_report(out, "lr_report", "lr_bounds.json", "LR range test", bounds.status, lead, png, rows, notes,
                         _source_line(curve, source), bounds.to_dict())


def write_prodigy_report(reading: ProdigyStep, updates: dict, curve: Optional[dict], out_dir: str | Path, *,
                         source: Optional[str] = None, plan_warnings: Sequence[str] = (),
                         validation_weighting: Optional[dict] = None) -> dict[str, Path]:
    """Write prodigy_step.png, prodigy_report.html (self-contained), prodigy_report.md and prodigy_step.json into
    out_dir: the prodigy_step LR finder's reading (analysis.prodigy_step). `updates`: the run's updates.csv columns;
    `curve`, `source`, `plan_warnings` and `validation_weighting` as for write_lr_report.
    Returns {"plot", "html", "markdown", "json"} -> paths."""
    out = Path(out_dir)
    png = plot_prodigy_step(updates["update"], step_size_estimates(updates), reading.step_size,
                            out / "prodigy_step.png", curve=curve, factor=reading.factor)
    best = None if reading.best_update is None else f"at update {reading.best_update}"
    rows: list[tuple[str, Any, str]] = [
        ("LR (step size)", _lr(reading.step_size),
         "d x lr after the last update: the constant LR the fine-tune trains at" if reading.factor == 1
         else "d x lr after the last update"),
        *([] if reading.factor == 1 else [
            ("LR trained", _lr(reading.lr_trained),
             f"{reading.factor:g} x the step size: the constant LR the fine-tune trains at")]),
        ("d", reading.d, "Prodigy's final estimate of the distance to the solution"),
        ("Prodigy lr", reading.lr, "the multiplier of d, as diffusers' recipe sets it"),
        ("updates", reading.updates, "as many as the fine-tune's (finetune.epochs), constant schedule"),
        ("epochs", reading.epochs, ""),
        ("val loss at update 0", reading.base_val_loss, "the base model"),
        ("best val loss", reading.best_val_loss, best or ""),
        ("final val loss", reading.final_val_loss, "at the last validation"),
    ]
    notes: list[tuple[str, str]] = [
        ("prodigy_step", "Prodigy estimates its own step size as it trains; the one it ends on"
                         + ("" if reading.factor == 1 else f", times {reading.factor:g},")
                         + " is taken as the fine-tune's constant LR (lr_low = lr_mid = lr_high, so there is no "
                         "successive halving). "
                         "Set lr_finder: range_test to measure the LR with the LR range test instead."),
    ]
    if reading.factor != 1 and reading.factor_source.startswith(FACTOR_FROM_TABLE):
        notes.append(("factor", f"This model family and method train at {reading.factor:g} times the step size "
                                f"Prodigy ended on ({reading.factor_source}): on fresh cases measured before the rule "
                                "shipped, on tiny models, that beat the step size itself (bench/RESULTS.md). Set "
                                "prodigy_step_factor to train at another multiple (1: the step size itself)."))
    elif reading.factor != 1:
        notes.append(("factor", f"The fine-tune trains at {reading.factor:g} times the step size Prodigy ended on "
                                f"({reading.factor_source})."))
    notes += _reading_notes((), plan_warnings)
    rows += _sigma_rows(curve, validation_weighting, reading.best_update)
    notes += _weighting_note(validation_weighting)
    return _write_report(out, "prodigy_report", "prodigy_step.json", "Prodigy step size", "ok", reading.headline(),
                         png, rows, notes, _source_line(curve, source), reading.to_dict())


def _reading_notes(reading: Sequence[str], plan_warnings: Sequence[str]) -> list[tuple[str, str]]:
    """Notes for the rows the analysis did not read as given, and for the training plan's warnings."""
    return [("rows read", r) for r in reading] + [("training plan", w) for w in plan_warnings]


def _midpoint_rows(bounds: LRBounds) -> list[tuple[str, Any, str]]:
    """One row per midpoint rule, the one lr_mid follows marked (analysis.midpoint)."""
    how = {
        "tuned": f"{bounds.mid_position:g} of the way from lr_low to lr_high"
                 + (" in log LR" if bounds.ramp == "exp" else ""),
        "geometric": "sqrt(lr_low x lr_high)",
        "arithmetic": "(lr_low + lr_high) / 2, the EveryDream2 write-up's rule",
    }
    mids = bounds.midpoints or {}
    return [(f"midpoint: {rule}" + (" (chosen)" if rule == bounds.midpoint else ""), _lr(mids.get(rule)), text)
            for rule, text in how.items()]


def write_step_report(window: StepWindow, curve: Optional[dict], out_dir: str | Path, *,
                      source: Optional[str] = None, samples: Optional[SampleStrip] = None,
                      halving: Optional[HalvingDecision] = None, plan_warnings: Sequence[str] = (),
                      validation_weighting: Optional[dict] = None,
                      delivered: Optional[Delivery] = None, cooldown: Optional[str] = None,
                      average: Optional[str] = None, length: Optional[RecommendedLength] = None,
                      retrain: Optional[str] = None) -> dict[str, Path]:
    """Write step_window.png, step_report.html (self-contained), step_report.md and step_window.json into out_dir.

    `curve` and `source` as for write_lr_report; `samples`: the run's samples over training, shown under the plot;
    `halving`: the successive halving's decision (rangefinder.steps.halving), as rows, a note and the dropped
    candidate's curve on the plot; `validation_weighting` as for write_lr_report; `delivered`: the checkpoint the
    fine-tune kept and the rule that picked it, as a row (and in the lead when step_headline says so); `cooldown`:
    what the fine-tune's cooldown measured and whether it was delivered (rangefinder.steps.cooldown), as a note;
    `average`: the same for the window average (rangefinder.steps.average); `length`: the length the fine-tune
    recommends (step_headline), as rows, in the lead and on the plot; `retrain`: what the full-data retrain that
    follows will train, as a note.
    Returns {"plot", "html", "markdown", "json"} -> paths.
    """
    out = Path(out_dir)
    length = length or RecommendedLength.of_window(window)
    png = plot_step_window(window, out / "step_window.png", halving=halving, delivered=delivered, length=length)
    lead = step_headline(window, halving, delivered, length)
    # The window row gives the band that drew the window; where the curve's noise widened it past the tolerance, this
    # row says so, or the two rows read as a window too wide for its tolerance.
    tolerance_why = "relative; widened to 2 standard errors when the curve is noisier"
    if band_widened(window) and window.best_val_loss:
        tolerance_why = (f"relative; widened here to 2 standard errors, the curve being noisier: the window's band is "
                         f"{window.band / abs(window.best_val_loss):.1%} of the minimum")
    rows: list[tuple[str, Any, str]] = [
        *_length_rows(length),
        ("window (epochs)", [window.window_start_epoch, window.window_end_epoch],
         f"smoothed val loss within {window.band:.3g} of its minimum" if window.band == window.band else ""),
        ("best epoch", window.best_epoch, f"update {_fmt(window.best_update)}; smoothed val loss "
                                          f"{_fmt(window.best_val_loss)}"),
        *([("recommended updates", window.recommended_updates, "the centre of the window, in updates: the curve "
                                                               "has no epochs"),
           ("window (updates)", [window.window_start_update, window.window_end_update],
            f"smoothed val loss within {window.band:.3g} of its minimum")]
          if window.recommended_epochs is None and window.recommended_updates is not None else []),
        ("val - stabilize at best", window.val_minus_stabilize,
         "the generalisation gap; growing after the best means overfitting"),
        ("tolerance", window.tolerance, tolerance_why),
        ("noise (s.d.)", window.noise_sigma, f"p(improvement) = {window.p_improvement:.3g}"),
        ("points used", window.points_used, f"{window.points_dropped} left out"),
    ]
    if delivered is not None:
        base = "" if delivered.base_val_loss is None else f"; base model (update 0): {_fmt(delivered.base_val_loss)}"
        rows.append(("delivered checkpoint", f"update {delivered.update}, rule {delivered.rule}, val loss "
                                             f"{_fmt(delivered.val_loss)}{base}", delivered.what()))
    rows += _bucket_rows(curve, window.best_update)
    rows += _sigma_rows(curve, validation_weighting, window.best_update)
    notes: list[tuple[str, str]] = [(window.status, STEP_STATUS_ADVICE[window.status])]
    notes += [(f, STEP_FLAG_ADVICE[f]) for f in window.flags]
    notes += _reading_notes(window.reading, plan_warnings)
    notes += _weighting_note(validation_weighting)
    if halving is not None:
        rows += _halving_rows(halving)
        notes.append(("successive halving", halving_note(halving)))
    for label, said in (("cooldown", cooldown), ("window average", average)):
        if said:  # the step's sentence opens with its name for the run's description; the note's label says it here
            notes.append((label, said.removeprefix(f"{label.capitalize()}: ")))
    if retrain:
        notes.append(("retrain", retrain))
    return _write_report(out, "step_report", "step_window.json", "Step window", window.status, lead, png, rows,
                         notes, _source_line(curve, source), window.to_dict(), samples)


def write_retrain_report(updates: dict, out_dir: str | Path, *, status: str, lead: str, epochs: int,
                         why_epochs: str, lr: float, schedule: str, bounds: tuple[float, float],
                         train_images: Optional[int] = None, source: Optional[str] = None,
                         plan_warnings: Sequence[str] = ()) -> dict[str, Path]:
    """Write retrain.png, retrain_report.html (self-contained), retrain_report.md and retrain.json into out_dir: the
    full-data retrain's run, which validates nothing, by its training loss (`updates`: its updates.csv columns) and
    the LR it trained at. `lead`: the run's description; `why_epochs`: where its length came from; `schedule`:
    constant or triangular (between `bounds`); `train_images`: train + validation; `source`, `plan_warnings` as for
    write_lr_report. Returns {"plot", "html", "markdown", "json"} -> paths."""
    out = Path(out_dir)
    png = plot_retrain(updates, out / "retrain.png")
    loss = np.asarray(updates.get("train_loss", ()), dtype=float)
    epoch = np.asarray(updates.get("epoch", ()), dtype=float)

    def mean_loss(part: np.ndarray) -> Optional[float]:
        kept = loss[part & np.isfinite(loss)] if part.shape == loss.shape else loss[:0]
        return float(kept.mean()) if kept.size else None

    first = mean_loss(epoch <= 1) if epoch.size else None
    last = mean_loss(epoch > np.nanmax(epoch) - 1) if epoch.size and np.isfinite(epoch).any() else None
    triangular = schedule == "triangular"
    rows: list[tuple[str, Any, str]] = [
        ("epochs", epochs, why_epochs),
        ("updates", int(loss.size), "on train + validation" + (f", {train_images} images" if train_images else "")
         + ": more per epoch than the fine-tune's"),
        ("lr", _lr(lr), "the LR the fine-tune kept (its lr_used)" + ("; the schedule cycles between the bounds instead"
                                                               if triangular else "")),
        ("schedule", f"triangular {_lr(bounds[0])} - {_lr(bounds[1])}" if triangular else schedule,
         "retrain.schedule"),
        ("train loss, first epoch", first, "mean over its updates"),
        ("train loss, last epoch", last, "mean over its updates"),
    ]
    notes: list[tuple[str, str]] = [
        ("no validation", "Every image trains, so no loss is validated and no checkpoint is chosen: the final weights "
                          "are delivered. The length was read off the fine-tune's validation curve (its report); the "
                          "training loss here shows the run trained, not how well it generalises."),
    ]
    notes += _reading_notes((), plan_warnings)
    decision = {"status": status, "epochs": epochs, "updates": int(loss.size), "lr": lr, "schedule": schedule,
                "lr_low": bounds[0], "lr_high": bounds[1], "train_loss_first_epoch": first,
                "train_loss_last_epoch": last}
    return _write_report(out, "retrain_report", "retrain.json", "Full-data retrain", status, lead, png, rows, notes,
                         _source_line(updates, source), decision)


def _length_rows(length: Optional[RecommendedLength]) -> list[tuple[str, Any, str]]:
    """The recommended length in epochs and in the updates they take, a fallback said as such; "-" without one."""
    if length is None:
        return [("recommended epochs", None, LENGTH_BASIS_TEXT["window"])]
    why = LENGTH_BASIS_TEXT[length.basis]
    return [("recommended epochs", f"{length.epochs} (fallback)" if length.fallback else length.epochs,
             f"no step window, so the fallback: {why}" if length.fallback else why),
            ("recommended updates", length.updates, "the updates those epochs take in this fine-tune")]


def halving_note(halving: HalvingDecision) -> str:
    """What the race did, in words: who raced to the pause, who went on, and where the others' curves are."""
    pause, kept = halving.pause_update, halving.kept
    if BELOW in halving.candidates:
        raced = (f"lr_mid and lr_high trained to update {pause}; lr_high lost by a wide margin, so lr_below "
                 "(lr_mid^2 / lr_high) trained to it too (finetune.halving_below_margin)")
        others, est = "The others' curves are", "lowest"
    else:
        raced, others, est = f"lr_mid and lr_high both trained to update {pause}", "The other's curve is", "lower"
    return (f"{raced}; {kept}, with the {est} validation loss by then, went on to the end and is the run above (its "
            f"curve from update 0). {others} drawn up to the pause. finetune.successive_halving: false trains lr_mid "
            "alone.")


def _halving_rows(halving: HalvingDecision) -> list[tuple[str, Any, str]]:
    """A row per candidate: its LR, and its best validation loss by the pause."""
    rows = []
    for name, c in halving.candidates.items():
        what = "kept" if name == halving.kept else "dropped"
        at = f" at update {c.best_update}" if c.best_update is not None else ""
        rows.append((f"{name} ({what})", _lr(c.lr), f"best val loss by update {halving.pause_update}: "
                                               f"{_fmt(c.best_val_loss)}{at}; {c.status}"))
    return rows


_BUCKET_COLUMN = re.compile(r"^val_loss_(\d+)x(\d+)$")


def _bucket_rows(curve: Optional[dict], best_update: Optional[float]) -> list[tuple[str, Any, str]]:
    """One row per aspect-ratio bucket of the validation set (the curve's val_loss_<W>x<H> columns): its measured
    loss at the row nearest the best update, and at the baseline."""
    if not curve or "update" not in curve:
        return []
    matched = [(m, c) for c in curve if (m := _BUCKET_COLUMN.match(c))]
    columns = [c for _, c in sorted(matched, key=lambda mc: (int(mc[0][1]), int(mc[0][2])))]
    if not columns:
        return []
    updates = np.asarray(curve["update"], dtype=float)
    at = int(np.argmin(np.abs(updates - best_update))) if best_update is not None else len(updates) - 1
    return [(f"val loss, bucket {c.removeprefix('val_loss_')}", float(curve[c][at]),
             f"at update {int(updates[at])} (baseline {_fmt(float(curve[c][0]))})") for c in columns]


def _sigma_rows(curve: Optional[dict], weighting: Optional[dict],
                best_update: Optional[float]) -> list[tuple[str, Any, str]]:
    """With a fixed sigma grid (flow-matching families), one row per sigma: its val loss at the row nearest the best
    update (the last row without one), and at the baseline; the losses at different sigma differ in scale. Where
    the grid moves with the image size and the validation images come in several (`grid_span`: Flux's dynamic shift
    over aspect buckets), each row is labelled with the span of sigmas its column mixes."""
    grid = (weighting or {}).get("grid")
    span = (weighting or {}).get("grid_span")
    if not curve or not grid or "update" not in curve:
        return []
    updates = np.asarray(curve["update"], dtype=float)
    at = int(np.argmin(np.abs(updates - best_update))) if best_update is not None else len(updates) - 1
    rows = []
    for k, sigma in enumerate(grid):
        column = curve.get(f"val_loss_b{k}")
        if column is not None:
            at_sigma = (f"sigma {span[k][0]:.3g}-{span[k][1]:.3g} by image size" if span and len(span) > k
                        else f"sigma {sigma:.3g}")
            rows.append((f"val loss at {at_sigma} (val_loss_b{k})", float(column[at]),
                         f"at update {int(updates[at])} (baseline {_fmt(float(column[0]))})"))
    return rows


def _weighting_note(weighting: Optional[dict]) -> list[tuple[str, str]]:
    return [("validation score", str(weighting["statement"]))] if weighting and weighting.get("statement") else []


def write_unmeasured_step_report(epochs: float, updates: int, lr: float, lr_source: str,
                                  html_path: Optional[Path], markdown_path: Optional[Path]) -> str:
    """The fine-tune's report where there was no validation set to read a step window from (split.val_split 0, an LR
    given by hand): the same page and Markdown as write_step_report's, without a plot, saying the configured length
    was trained and how to have it measured; None skips one. Returns its lead, the step's note."""
    lead = f"No validation set: trained the configured {_fmt(epochs)} epoch{'' if epochs == 1 else 's'} at lr {lr:.3g}."
    rows: list[tuple[str, Any, str]] = [
        ("epochs trained", epochs, "finetune.epochs, as configured"),
        ("updates trained", updates, "the final weights are delivered"),
        ("lr", _lr(lr), f"lr source: {lr_source}"),
    ]
    notes = [("no step window", "with no validation images there is no loss to read a window from, so the length "
                                "is not measured; set split.val_split above 0 (or split.val_dir) to have it measured")]
    for dest, text in ((html_path, _page("Step window", "no validation", lead, None, rows, notes, None)),
                       (markdown_path, _markdown("Step window", "no validation", lead, rows, notes))):
        if dest is not None:
            write_bytes(dest, text.encode("utf-8"))
    return lead


def copy_report(report: dict, html_path: Optional[Path], markdown_path: Optional[Path]) -> None:
    """A written report's self-contained HTML (plots embedded) and Markdown, also at the given paths (the KFP
    outputs' files); None skips one."""
    for key, dest in (("html", html_path), ("markdown", markdown_path)):
        if dest is not None:
            write_bytes(dest, Path(report[key]).read_bytes())
