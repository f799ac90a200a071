"""`rangefinder analyze-lr`: LR bounds (low, high, midpoint) from an LR range test's curve CSV."""

from __future__ import annotations

import argparse

from rangefinder.cli import args as argtypes
from rangefinder.cli.output import add_json_flag
from rangefinder.defaults import MIDPOINT_RULES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze-lr",
        help="read LR bounds off an LR range test (metrics.csv)",
        description="Find where validation loss starts to fall (lr_low), where it flattens or turns up (lr_high), "
        "and the midpoint to train at, with a quality score and flags for curves it cannot read.",
        **argtypes.examples(
            "rangefinder analyze-lr lrtest/metrics.csv --report lrtest/report",
            "# another trainer's range test: one row per validation, its LR and loss under its own names",
            "rangefinder analyze-lr kohya_lr_test.csv --lr-column lr/unet --loss-column loss/validation --json",
        ),
    )
    p.add_argument("curve", metavar="CURVE.csv",
                   help="the range test's metrics.csv, or any CSV with one row per validation: the LR it was "
                   "measured at and the validation loss, e.g. 'step,lr,val_loss' then '200,1e-06,0.1841' (rows "
                   "without a loss, e.g. the LR logged every step, are skipped; commas, semicolons or tabs)")
    p.add_argument("--lr-column", metavar="NAME",
                   help="the file's column holding the learning rate (default lr), e.g. 'lr/unet' as kohya logs it")
    p.add_argument("--loss-column", metavar="NAME",
                   help="the file's column holding the validation loss (default val_loss), e.g. 'myrun - val_loss' "
                   "from a W&B export")
    p.add_argument("--ramp", choices=["linear", "exp"], help="how the LR climbed (default: inferred from the LRs)")
    p.add_argument("--plot", metavar="OUT.png", help="write the range-test plot here")
    p.add_argument("--report", metavar="DIR", help="write an HTML report, a Markdown summary, the plot and JSON here")
    p.add_argument("--seed", type=argtypes.seed, default=0,
                   help="seed of the bootstrap and permutation test (default 0)")
    p.add_argument("--mid-position", type=float, default=None, metavar="P",
                   help="where lr_mid lies between the bounds: 0 = lr_low, 1 = lr_high, on the sweep's axis "
                   "(default: lr_range_test.mid_position's default, 0.75; this command reads no config); used by "
                   "--midpoint tuned")
    p.add_argument("--midpoint", choices=list(MIDPOINT_RULES), default=None,
                   help="the rule for lr_mid: tuned (mid_position of the way), geometric (sqrt(lr_low * lr_high)) "
                   "or arithmetic ((lr_low + lr_high) / 2) (default: lr_range_test.midpoint's default, tuned)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    import numpy as np

    from rangefinder.analysis import analyze_lr_curve, plot_lr_range_test, write_lr_report
    from rangefinder.analysis.curves import read_curve, replaced_note
    from rangefinder.errors import RangefinderError

    argtypes.refuse_plot_over_curve(args)
    columns = argtypes.named_columns(lr=args.lr_column, val_loss=args.loss_column)
    read = read_curve(args.curve, required=("lr", "val_loss"), skip_empty=("val_loss",), columns=columns,
                      flags={"lr": "--lr-column", "val_loss": "--loss-column"}, fill_down=("lr",), steps=("update",))
    curve, filled = read.columns, int(np.sum(read.filled["lr"]))
    if curve["val_loss"].dtype == object or curve["lr"].dtype == object:
        raise RangefinderError(f"{args.curve}: lr and val_loss must be numbers")
    extra = {k: v for k, v in (("mid_position", args.mid_position), ("midpoint", args.midpoint)) if v is not None}
    bounds = analyze_lr_curve(curve["lr"], curve["val_loss"], ramp=args.ramp, seed=args.seed,
                              stabilize_loss=curve.get("stabilize_loss"), **extra)
    notes = [replaced_note(read, "validation")] if read.replaced else []
    if filled:
        # The validation's own row had no LR: the LR logged last above it is that of the last update before it.
        above = f"above it in {read.step} order" if read.step else "above it in the file"
        notes.append(f"{filled} of {curve['val_loss'].size} validation rows had no lr; each took the lr of the last "
                     f"row {above} (the LR logged at the step before the validation)")
    return argtypes.curve_result(args, bounds, curve, columns, notes, plot_lr_range_test, write_lr_report)
