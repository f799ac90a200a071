"""`analyze-lr` and `select-steps` on the curve files another trainer's user has: kohya's sd-scripts, OneTrainer and
the diffusers examples log to TensorBoard or W&B, and a curve reaches us as the CSV that a spreadsheet, a TensorBoard
or W&B export, or a pandas script wrote. Each test writes such a file and runs the command's entry point in-process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rangefinder.analysis.synthetic import RangeTestShape, lr_sweep, noisy
from tests.cli.test_bad_input import in_process

SHAPE = RangeTestShape(rise=0.05)


def range_test_rows(n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """(lr, val_loss) of a noisy exponential range test from 1e-7 to 1e-2 with a baseline at lr 0."""
    lr = lr_sweep(n)
    return lr, noisy(SHAPE.loss(lr), 0.001, seed=3)


def write_rows(path: Path, header: list[str], columns: list[np.ndarray], sep: str = ",",
               encoding: str = "utf-8") -> Path:
    lines = [sep.join(header)] + [sep.join(repr(float(v)) for v in row) for row in zip(*columns, strict=True)]
    path.write_text("\n".join(lines) + "\n", encoding=encoding)
    return path


def analyze(path: Path, *flags: str) -> dict:
    proc = in_process("analyze-lr", str(path), "--json", *flags)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_curve_saved_with_a_byte_order_mark_reads_as_without(tmp_path):
    # Excel's "CSV UTF-8 (Comma delimited)" and PowerShell's Export-Csv write a BOM before the header.
    lr, loss = range_test_rows()
    plain = analyze(write_rows(tmp_path / "plain.csv", ["lr", "val_loss"], [lr, loss]))
    bom = analyze(write_rows(tmp_path / "bom.csv", ["lr", "val_loss"], [lr, loss], encoding="utf-8-sig"))
    assert bom["lr_mid"] == plain["lr_mid"] and bom["status"] == "ok"


def test_a_curve_separated_by_semicolons_with_decimal_commas_or_by_tabs_reads_as_with_commas(tmp_path):
    # A spreadsheet in a German or French locale saves "CSV" with semicolons and decimal commas; a table pasted
    # from a terminal is tab-separated.
    lr, loss = range_test_rows()
    plain = analyze(write_rows(tmp_path / "plain.csv", ["lr", "val_loss"], [lr, loss]))
    semicolons = tmp_path / "excel-de.csv"
    rows = (f"{float(a)!r};{float(b)!r}\n".replace(".", ",") for a, b in zip(lr, loss, strict=True))
    semicolons.write_text("lr;val_loss\n" + "".join(rows))
    tabs = write_rows(tmp_path / "pasted.tsv", ["lr", "val_loss"], [lr, loss], sep="\t")
    for path in (semicolons, tabs):
        assert analyze(path)["lr_mid"] == plain["lr_mid"], path
