"""Regenerate the example plots and reports under docs/figures/ from curves built from formulas.

    .venv/bin/python docs/make_report_examples.py

A noisy U-shaped LR range test (exponential sweep, explodes to NaN at the end) and a constant-LR fine-tune that
overfits after about 12 epochs; the same seeds give the same files.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from rangefinder.analysis import analyze_lr_curve, select_step_window, write_lr_report, write_step_report
from rangefinder.analysis.synthetic import ConstantRunShape, RangeTestShape, lr_sweep, noisy

OUT = Path(__file__).resolve().parent / "figures"


def main() -> None:
    shape = RangeTestShape(rise=0.05)
    lr = lr_sweep(40)
    val = noisy(shape.loss(lr), 0.003, 0)
    val[-3:] = [2.5, np.nan, np.nan]  # the sweep blew up at the top
    stabilize = noisy(shape.loss(lr) - 0.015, 0.0015, 1)
    bounds = analyze_lr_curve(lr, val, stabilize_loss=stabilize)

    run = ConstantRunShape()
    epoch = np.arange(61) / 2
    window = select_step_window(epoch * 10, epoch, noisy(run.loss(epoch), 0.001, 0),
                                stabilize_loss=noisy(run.loss(epoch) - 0.012 - 0.0006 * epoch, 0.0005, 1))

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        lr_paths = write_lr_report(bounds, None, Path(tmp) / "lr", source="synthetic U-shaped range test")
        step_paths = write_step_report(window, None, Path(tmp) / "step", source="synthetic constant-LR fine-tune")
        shutil.copyfile(lr_paths["plot"], OUT / "lr-range-test.png")
        shutil.copyfile(lr_paths["html"], OUT / "lr-report.html")
        shutil.copyfile(step_paths["plot"], OUT / "step-window.png")
        shutil.copyfile(step_paths["html"], OUT / "step-report.html")
    print(f"wrote {OUT}: lr_mid {bounds.lr_mid:.3g} ({bounds.quality_label}), "
          f"recommended epochs {window.recommended_epochs}")


if __name__ == "__main__":
    main()
