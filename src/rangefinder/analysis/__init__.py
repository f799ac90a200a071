"""Turning measured curves into decisions: LR bounds, the step window, their plots and reports.

numpy and matplotlib only (no torch), so every piece is fast to test on curves built from formulas.
"""

from rangefinder.analysis.curves import read_curve_csv
from rangefinder.analysis.lr_bounds import LRBounds, analyze_lr_curve
from rangefinder.analysis.plots import plot_lr_range_test, plot_prodigy_step, plot_step_window
from rangefinder.analysis.prodigy_step import ProdigyStep, read_prodigy_step
from rangefinder.analysis.reports import (
    SampleStrip,
    copy_report,
    write_lr_report,
    write_prodigy_report,
    write_step_report,
)
from rangefinder.analysis.step_window import (
    DELIVERY_RULE_TEXT,
    Delivery,
    RecommendedLength,
    StepWindow,
    delivered_checkpoint,
    earliest_tied,
    select_step_window,
)

__all__ = [
    "DELIVERY_RULE_TEXT",
    "Delivery",
    "LRBounds",
    "ProdigyStep",
    "RecommendedLength",
    "SampleStrip",
    "StepWindow",
    "analyze_lr_curve",
    "copy_report",
    "delivered_checkpoint",
    "earliest_tied",
    "plot_lr_range_test",
    "plot_prodigy_step",
    "plot_step_window",
    "read_curve_csv",
    "read_prodigy_step",
    "select_step_window",
    "write_lr_report",
    "write_prodigy_report",
    "write_step_report",
]
