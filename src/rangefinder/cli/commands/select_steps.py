"""`rangefinder select-steps`: the step window and recommended epochs from a constant-LR run's curve CSV."""

from __future__ import annotations

import argparse

from rangefinder.cli import args as argtypes
from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "select-steps",
        help="find the step window of a constant-LR fine-tune (metrics.csv)",
        description="Find where smoothed validation loss is within a tolerance of its minimum, and how many "
        "epochs to train for.",
        **argtypes.examples(
            "rangefinder select-steps finetune/metrics.csv --plot window.png",
            "# TensorBoard's CSV of a validation-loss tag (Wall time,Step,Value), 50 updates an epoch",
            "rangefinder select-steps val_loss.csv --update-column Step --loss-column Value --updates-per-epoch 50",
        ),
    )
    p.add_argument("curve", metavar="CURVE.csv",
                   help="the fine-tune's metrics.csv, or any CSV with one row per validation: the optimizer update "
                   "(global step) it was measured at, the validation loss and, optionally, the epoch, e.g. "
                   "'update,epoch,val_loss' then '500,10,0.1841' (rows without a loss are skipped; commas, "
                   "semicolons or tabs)")
    p.add_argument("--update-column", metavar="NAME",
                   help="the file's column holding the update (default update), e.g. Step in a TensorBoard export; "
                   "the window comes back in its unit")
    p.add_argument("--epoch-column", metavar="NAME",
                   help="the file's column holding the epoch (default epoch); without one (and without "
                   "--updates-per-epoch) the recommendation is in updates only")
    p.add_argument("--updates-per-epoch", type=argtypes.float_in(0, lo_open=True), metavar="N",
                   help="the updates one epoch took, for a curve with updates and no epochs (the window comes back "
                   "in epochs too) or with epochs and no updates (a validation logged once an epoch) "
                   "(`rangefinder plan` counts them: its per_epoch_loader's for kohya's and diffusers' runs)")
    p.add_argument("--loss-column", metavar="NAME",
                   help="the file's column holding the validation loss (default val_loss), e.g. Value in a "
                   "TensorBoard export")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="relative distance from the minimum that still counts as in the window (default 0.02)")
    p.add_argument("--plot", metavar="OUT.png", help="write the step-window plot here")
    p.add_argument("--report", metavar="DIR", help="write an HTML report, a Markdown summary, the plot and JSON here")
    p.add_argument("--seed", type=argtypes.seed, default=0, help="seed of the permutation test (default 0)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from rangefinder.analysis import plot_step_window, select_step_window, write_step_report
    from rangefinder.analysis.curves import read_curve, replaced_note
    from rangefinder.errors import RangefinderError

    argtypes.refuse_plot_over_curve(args)
    columns = argtypes.named_columns(update=args.update_column, epoch=args.epoch_column, val_loss=args.loss_column)
    # Given the updates an epoch takes, a curve by epoch alone (a validation logged once an epoch, at step epoch)
    # needs no update column: the updates are counted from its epochs.
    by_epoch = args.updates_per_epoch is not None and args.update_column is None
    read = read_curve(args.curve, required=("val_loss",) if by_epoch else ("update", "val_loss"),
                      skip_empty=("val_loss",), columns=columns,
                      flags={"update": "--update-column", "val_loss": "--loss-column"}, steps=("update", "epoch"))
    curve = read.columns
    if args.updates_per_epoch is not None:
        if "update" in curve and "epoch" in curve:
            raise RangefinderError(f"{args.curve} has an epoch column and --updates-per-epoch was given too; "
                                   "drop --updates-per-epoch to read the file's epochs")
        if "update" in curve:
            curve["epoch"] = curve["update"] / args.updates_per_epoch
        elif "epoch" in curve:
            curve["update"] = curve["epoch"] * args.updates_per_epoch
        else:
            raise RangefinderError(f"{args.curve} has no update or epoch column (it has "
                                   f"{', '.join(curve)}); name the one it "
                                   "has with --update-column or --epoch-column")
    _refuse_a_range_test(args.curve, curve)
    window = select_step_window(curve["update"], curve.get("epoch"), curve["val_loss"], tolerance=args.tolerance,
                                stabilize_loss=curve.get("stabilize_loss"), seed=args.seed)
    notes = [replaced_note(read, "validation")] if read.replaced else []
    return argtypes.curve_result(args, window, curve, columns, notes, plot_step_window, write_step_report)


def _refuse_a_range_test(path: str, curve: dict) -> None:
    """RangefinderError for an LR range test's curve, whose LR rises at every validation by a decade or more in all:
    read as a fine-tune's, its turn where the LR grew too high was called overfitting, and its "window" an LR's.
    A warmup, a decay or a cycle does not rise at every validation, and is read."""
    import numpy as np

    from rangefinder.errors import RangefinderError

    lr = curve.get("lr")
    if lr is None or lr.dtype == object:
        return
    order = np.argsort(curve["update"], kind="stable")
    lr, y = lr[order], curve["val_loss"][order]
    lr = lr[np.isfinite(lr) & (lr > 0) & np.isfinite(y)]
    if lr.size >= 3 and np.all(np.diff(lr) > 0) and lr[-1] >= 10 * lr[0]:
        raise RangefinderError(f"{path} is an LR range test's curve: its lr rises at every validation, from "
                               f"{lr[0]:.3g} to {lr[-1]:.3g}; read it with analyze-lr (select-steps reads a "
                               "constant-LR fine-tune's curve)")
