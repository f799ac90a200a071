"""The steps' KFP reports: an HTML page (plots embedded as base64; the KFP UI shows no image files) and Markdown.

Kept small on purpose: the analysis' own reports (components/analysis) hold the full reading of a curve; these pages
show the curve, the numbers the DAG passed on, and the advice, where the KFP UI can show them.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any, Optional


def _plot_png(curve_csv: Path, x: str, logx: bool, marks: dict[str, Optional[float]], title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from components.analysis.curves import read_curve_csv

    curve = read_curve_csv(curve_csv)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for key, style in (("val_loss", "o-"), ("stabilize_loss", "s--")):
        if key in curve:
            ax.plot(curve[x], curve[key], style, ms=3, label=key)
    for label, v in marks.items():
        if v:
            ax.axvline(v, ls=":", color="grey")
            ax.annotate(label, (v, 1), xycoords=("data", "axes fraction"), fontsize=8, rotation=90, va="top")
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _write(path: Optional[Path], text: str) -> None:
    if path is None:
        return
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _pages(title: str, rows: dict[str, Any], advice: list[str], png: bytes) -> tuple[str, str]:
    def cell(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else html.escape(json.dumps(v) if isinstance(v, (list, dict)) else str(v))

    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{cell(v)}</td></tr>" for k, v in rows.items())
    adv = "".join(f"<li>{html.escape(a)}</li>" for a in advice)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
            f"<h1>{html.escape(title)}</h1><img alt='curve' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
            f"<table>{table}</table><ul>{adv}</ul></body></html>")
    md = [f"# {title}", "", "| | |", "|---|---|"] + [f"| {k} | {cell(v)} |" for k, v in rows.items()]
    md += [""] + [f"- {a}" for a in advice]
    return page, "\n".join(md) + "\n"


def write_lr_reports(decision: dict, curve_csv: Path, *, html_path: Optional[Path], md_path: Optional[Path]) -> None:
    keys = ("stage", "status", "lr_low", "lr_mid", "lr_high", "quality_label", "flags", "points_between",
            "needs_zoom", "zoom_range", "lr_min", "lr_max")
    rows = {k: decision.get(k) for k in keys if k in decision}
    png = _plot_png(curve_csv, "lr", decision.get("ramp", "exp") == "exp",
                    {"lr_low": decision.get("lr_low"), "lr_mid": decision.get("lr_mid"),
                     "lr_high": decision.get("lr_high")}, "LR range test: validation loss vs LR")
    page, md = _pages(f"LR range test ({decision.get('stage', 'first')})", rows, list(decision.get("advice") or []), png)
    _write(html_path, page)
    _write(md_path, md)


def write_step_window_reports(decision: dict, curve_csv: Path, *, html_path: Optional[Path],
                              md_path: Optional[Path]) -> None:
    rows = {k: v for k, v in decision.items() if not isinstance(v, (dict,)) and k != "advice"}
    png = _plot_png(curve_csv, "epoch", False, {"recommended": decision.get("recommended_epochs")},
                    "Fine-tune at the chosen LR: validation loss vs epoch")
    page, md = _pages("Fine-tune and step window", rows, list(decision.get("advice") or []), png)
    _write(html_path, page)
    _write(md_path, md)
