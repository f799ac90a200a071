"""`analyze-lr` and `select-steps` on the curve files another trainer's user has: kohya's sd-scripts, OneTrainer and
the diffusers examples log to TensorBoard or W&B, and a curve reaches us as the CSV that a spreadsheet, a TensorBoard
or W&B export, or a pandas script wrote. Each test writes such a file and runs the command's entry point in-process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rangefinder.analysis.synthetic import ConstantRunShape, RangeTestShape, lr_sweep, noisy
from tests.cli.test_bad_input import assert_one_line_error, in_process

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


def test_a_curve_in_utf16_as_windows_powershell_redirects_output_reads_as_in_utf8(tmp_path):
    # `python export.py > curve.csv` in Windows PowerShell 5.1 writes UTF-16 with its byte-order mark: it was
    # "not a CSV text file".
    lr, loss = range_test_rows()
    plain = analyze(write_rows(tmp_path / "plain.csv", ["lr", "val_loss"], [lr, loss]))
    for encoding in ("utf-16", "utf-16-be"):
        path = tmp_path / f"{encoding}.csv"
        path.write_bytes((b"\xfe\xff" if encoding == "utf-16-be" else b"")
                         + (tmp_path / "plain.csv").read_text().encode(encoding))
        assert analyze(path)["lr_mid"] == plain["lr_mid"], encoding


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


def test_analyze_lr_reads_another_trainers_column_names_when_told_them(tmp_path):
    # kohya logs the LR every step as lr/unet; a validation loss joined in from another tag fills every 10th row.
    lr, loss = range_test_rows()
    ours = analyze(write_rows(tmp_path / "metrics.csv", ["lr", "val_loss"], [lr, loss]))
    steps = np.arange(lr.size * 10)
    every_step_lr = np.repeat(lr, 10)
    sparse_loss = np.where(steps % 10 == 0, np.repeat(loss, 10), np.nan)
    kohya = tmp_path / "kohya.csv"
    rows = zip(steps, every_step_lr, sparse_loss, strict=True)
    kohya.write_text("step,lr/unet,loss/validation\n"
                     + "".join(f"{s},{float(a)!r},{'' if np.isnan(b) else repr(float(b))}\n" for s, a, b in rows))
    theirs = analyze(kohya, "--lr-column", "lr/unet", "--loss-column", "loss/validation")
    assert theirs["lr_mid"] == ours["lr_mid"]
    assert theirs["columns"] == {"lr": "lr/unet", "val_loss": "loss/validation"}
    # Not told: one line naming both flags, with the column that looks like each.
    assert_one_line_error(in_process("analyze-lr", str(kohya)), "no lr, val_loss column",
                          "--lr-column lr/unet", "--loss-column loss/validation")
    # A name the header does not spell: the line names it, and what the header has.
    assert_one_line_error(in_process("analyze-lr", str(kohya), "--lr-column", "lr", "--loss-column", "loss/validation"),
                          "no column 'lr' (named for lr)", "it has step, lr/unet, loss/validation")


def test_select_steps_reads_a_tensorboard_export_when_told_its_columns(tmp_path):
    # TensorBoard's "download CSV" of one tag: Wall time,Step,Value; Step is the trainer's global step (its updates).
    shape = ConstantRunShape()
    updates = np.arange(0, 800, 10)
    loss = noisy(shape.loss(updates / 20), 0.0005, seed=5)
    ours = json.loads(in_process("select-steps", str(write_rows(tmp_path / "metrics.csv", ["update", "val_loss"],
                                                                [updates, loss])), "--json").stdout)
    export = write_rows(tmp_path / "tb.csv", ["Wall time", "Step", "Value"], [1.7e9 + updates, updates, loss])
    proc = in_process("select-steps", str(export), "--json", "--update-column", "Step", "--loss-column", "Value",
                      "--report", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr
    theirs = json.loads(proc.stdout)
    assert theirs["recommended_updates"] == ours["recommended_updates"] and theirs["status"] == "ok"
    assert "update from &#x27;Step&#x27;" in (tmp_path / "report" / "step_report.html").read_text()
    assert_one_line_error(in_process("select-steps", str(export)), "--update-column Step", "--loss-column Value")


def test_select_steps_recommends_epochs_for_a_curve_without_them_given_the_updates_per_epoch(tmp_path):
    # A trainer's log has the global step only; its user knows (or `plan` counts) 20 updates per epoch.
    shape = ConstantRunShape()
    updates = np.arange(0, 800, 10)
    loss = noisy(shape.loss(updates / 20), 0.0005, seed=5)
    with_epochs = write_rows(tmp_path / "metrics.csv", ["update", "epoch", "val_loss"], [updates, updates / 20, loss])
    ours = json.loads(in_process("select-steps", str(with_epochs), "--json").stdout)
    steps_only = write_rows(tmp_path / "steps.csv", ["step", "val_loss"], [updates, loss])
    flags = ("--update-column", "step", "--json")
    theirs = json.loads(in_process("select-steps", str(steps_only), *flags, "--updates-per-epoch", "20").stdout)
    assert ours["recommended_epochs"] is not None
    for key in ("recommended_epochs", "recommended_updates", "best_epoch", "window_start_epoch"):
        assert theirs[key] == ours[key], key
    # Without it the advice speaks of the length it has, in updates, not of epochs it leaves null.
    bare = json.loads(in_process("select-steps", str(steps_only), *flags).stdout)
    assert bare["recommended_epochs"] is None and bare["recommended_updates"] is not None
    assert "recommended updates" in bare["advice"][0] and not any("epochs" in a for a in bare["advice"][:2])
    assert_one_line_error(in_process("select-steps", str(with_epochs), "--updates-per-epoch", "20"),
                          "has an epoch column", "drop --updates-per-epoch")


def test_two_tensorboard_exports_pasted_side_by_side_are_refused_for_their_repeated_names(tmp_path):
    # The LR tag's and the loss tag's CSV pasted into one sheet: Wall time,Step,Value twice. Read by name, the two
    # Value columns were interleaved into one and select-steps reported on a curve that was neither.
    lr, loss = range_test_rows()
    steps = np.arange(lr.size) * 10.0
    pasted = write_rows(tmp_path / "pasted.csv", ["Wall time", "Step", "Value"] * 2,
                        [1.7e9 + steps, steps, lr, 1.7e9 + steps, steps, loss])
    line = assert_one_line_error(in_process("select-steps", str(pasted), "--update-column", "Step",
                                            "--loss-column", "Value"), "more than one column", "'Value'")
    assert "rename them apart" in line


def test_an_mlflow_metric_history_in_long_form_is_refused_with_the_pivot_that_reads_it(tmp_path):
    # MlflowClient.get_metric_history of two metrics in one DataFrame: key,value,step,timestamp. Told the loss is
    # `value`, analyze-lr read the LRs and the losses as one curve.
    lr, loss = range_test_rows()
    steps = np.arange(lr.size) * 10
    history = tmp_path / "history.csv"
    history.write_text("key,value,step,timestamp\n" + "".join(
        f"{k},{float(v)!r},{s},0\n" for s, a, b in zip(steps, lr, loss, strict=True) for k, v in (("lr", a),
                                                                                                ("val_loss", b))))
    line = assert_one_line_error(in_process("select-steps", str(history), "--update-column", "step",
                                            "--loss-column", "value"), "2 metrics in long form", "lr, val_loss")
    assert "pivot_table" in line


def test_a_validation_logged_on_a_row_of_its_own_takes_the_lr_logged_above_it(tmp_path):
    # W&B's history: wandb.log({"lr": ...}) every step and wandb.log({"val_loss": ...}) at each validation, each
    # call a row of its own. Every validation row had an empty lr, and analyze-lr found 0 points and asked to
    # validate more often.
    lr, loss = range_test_rows()
    ours = analyze(write_rows(tmp_path / "metrics.csv", ["lr", "val_loss"], [lr, loss]))
    lines = ["_step,lr,val_loss"]
    for i, (a, b) in enumerate(zip(lr, loss, strict=True)):
        lines += [f"{3 * i},{float(a)!r},", f"{3 * i + 1},{float(a)!r},", f"{3 * i + 2},,{float(b)!r}"]
    history = tmp_path / "wandb_history.csv"
    history.write_text("\n".join(lines) + "\n")
    theirs = analyze(history)
    assert theirs["lr_mid"] == ours["lr_mid"]
    assert any(f"{lr.size} of {lr.size} validation rows had no lr" in note for note in theirs["reading"])


def test_select_steps_refuses_a_range_tests_curve_and_reads_a_warmup_and_decay(tmp_path):
    # The range test's file given to the wrong command: its rise where the LR grew too high was read as
    # overfitting and a "window" of updates came back, status ok.
    lr, loss = range_test_rows()
    sweep = write_rows(tmp_path / "lr_test.csv", ["update", "lr", "val_loss"], [np.arange(lr.size) * 10.0, lr, loss])
    assert_one_line_error(in_process("select-steps", str(sweep)), "is an LR range test's curve", "analyze-lr")
    # kohya's warmup then cosine decay: the LR rises, then holds and falls; a fine-tune's curve, read.
    updates = np.arange(0, 800, 10.0)
    warm_cosine = np.where(updates < 100, 1e-5 * updates / 100, 1e-5 * 0.5 * (1 + np.cos(np.pi * updates / 800)))
    loss = noisy(ConstantRunShape().loss(updates / 20), 0.0005, seed=5)
    run = write_rows(tmp_path / "run.csv", ["update", "lr", "val_loss"], [updates, warm_cosine, loss])
    assert in_process("select-steps", str(run)).returncode == 0


def test_a_cell_that_is_not_a_number_is_named_by_the_files_own_column(tmp_path):
    # A spreadsheet's thousands separator in TensorBoard's Step: the line said "column update", a name the
    # user's file does not have.
    export = tmp_path / "tb.csv"
    export.write_text('Wall time,Step,Value\n1.7e9,0,0.2\n1.7e9,"1,200",0.19\n1.7e9,2400,0.18\n')
    assert_one_line_error(in_process("select-steps", str(export), "--update-column", "Step", "--loss-column", "Value"),
                          "line 3, column 'Step' (read as update): '1,200' is not a number")


def test_select_steps_reads_a_curve_logged_by_epoch_given_the_updates_per_epoch(tmp_path):
    # A validation logged once an epoch at step = epoch (a TensorBoard tag of epoch averages): no update column.
    shape = ConstantRunShape()
    epochs = np.arange(0, 40.0)
    loss = noisy(shape.loss(epochs), 0.0005, seed=5)
    ours = json.loads(in_process("select-steps", str(write_rows(
        tmp_path / "metrics.csv", ["update", "epoch", "val_loss"], [epochs * 50, epochs, loss])), "--json").stdout)
    export = write_rows(tmp_path / "epoch_average.csv", ["Wall time", "Step", "Value"], [1.7e9 + epochs, epochs, loss])
    proc = in_process("select-steps", str(export), "--epoch-column", "Step", "--loss-column", "Value",
                      "--updates-per-epoch", "50", "--json")
    assert proc.returncode == 0, proc.stderr
    theirs = json.loads(proc.stdout)
    for key in ("recommended_epochs", "recommended_updates", "best_update", "window_end_epoch"):
        assert theirs[key] == ours[key], key
    unnamed = in_process("select-steps", str(export), "--loss-column", "Value", "--updates-per-epoch", "50")
    assert_one_line_error(unnamed, "no update or epoch column", "--epoch-column")


def test_a_run_resumed_from_a_checkpoint_is_read_by_its_later_rows_at_each_step(tmp_path):
    # kohya's --resume (or any trainer's) goes back to the checkpoint at update 300 and logs updates 300 on again;
    # the rows logged past it before the restart are the run it discarded. They were averaged with the continued
    # run's rows at the same step.
    shape = ConstantRunShape()
    updates = np.arange(0, 800, 10)
    loss = noisy(shape.loss(updates / 20), 0.0005, seed=5)
    ours = json.loads(in_process("select-steps", str(write_rows(tmp_path / "metrics.csv", ["update", "val_loss"],
                                                                [updates, loss])), "--json").stdout)
    lost = (updates >= 300) & (updates < 500)  # logged before the crash, its loss rising where the run diverged
    export = write_rows(tmp_path / "resumed.csv", ["Wall time", "Step", "Value"],
                        [np.concatenate([1.7e9 + updates[updates < 500], 1.8e9 + updates[updates >= 300]]),
                         np.concatenate([updates[updates < 500], updates[updates >= 300]]),
                         np.concatenate([loss[updates < 300], loss[lost] + 0.05, loss[updates >= 300]])])
    proc = in_process("select-steps", str(export), "--json", "--update-column", "Step", "--loss-column", "Value")
    assert proc.returncode == 0, proc.stderr
    theirs = json.loads(proc.stdout)
    for key in ("recommended_updates", "best_update", "window_start_update", "status"):
        assert theirs[key] == ours[key], key
    assert any(f"{int(lost.sum())} validation rows were replaced by a later row at the same Step" in note
               for note in theirs["reading"]), theirs["reading"]


def test_an_export_out_of_step_order_fills_the_lr_in_step_order(tmp_path):
    # A W&B history as the export's rows came (not sorted by _step), with a validation on a row of its own: filled
    # from the row above it in the file, it took another step's LR. The run was resumed before its 11th validation,
    # which it logged again: the later row stands.
    lr, loss = range_test_rows()
    ours = analyze(write_rows(tmp_path / "metrics.csv", ["lr", "val_loss"], [lr, loss]))
    rows = []
    for i, (a, b) in enumerate(zip(lr, loss, strict=True)):
        rows += [(3 * i, repr(float(a)), ""), (3 * i + 1, repr(float(a)), ""), (3 * i + 2, "", repr(float(b)))]
    np.random.default_rng(0).shuffle(rows)
    rows.insert(0, (3 * 10 + 2, "", repr(float(loss[10]) + 0.05)))  # the discarded run's, logged before the restart
    history = tmp_path / "wandb_history.csv"
    history.write_text("_step,lr,val_loss\n" + "".join(f"{s},{a},{b}\n" for s, a, b in rows))
    theirs = analyze(history)
    assert theirs["lr_mid"] == ours["lr_mid"] and theirs["lr_low"] == ours["lr_low"]
    assert any(f"{lr.size} of {lr.size} validation rows had no lr; each took the lr of the last row above it in "
               "_step order" in note for note in theirs["reading"]), theirs["reading"]
    assert any("1 validation rows were replaced by a later row at the same _step" in n for n in theirs["reading"])
