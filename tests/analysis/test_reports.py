"""Plots, HTML/Markdown reports and the two CLI commands, on real files."""

import csv
import html
import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest

from rangefinder.analysis import (
    analyze_lr_curve,
    read_curve_csv,
    select_step_window,
    write_lr_report,
    write_step_report,
)
from rangefinder.analysis.synthetic import ConstantRunShape, RangeTestShape, lr_sweep, noisy
from rangefinder.cli.main import main


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.srcs, self.attributes = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attributes += [k for k, _ in attrs]
        a = dict(attrs)
        for k in ("src", "href"):
            if k in a:
                self.srcs.append(a[k])


def write_lr_csv(path, lr, y):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["update", "epoch", "lr", "train_loss", "val_loss", "stabilize_loss", "val_loss_b0"])
        for i, (lr_i, v) in enumerate(zip(lr, y, strict=True)):
            w.writerow([i * 5, i * 0.5, lr_i, "" if i == 0 else 0.25, v, v - 0.01, v])


def test_lr_report_is_self_contained(tmp_path):
    shape = RangeTestShape(rise=0.05)
    lr = lr_sweep(30)
    y = noisy(shape.loss(lr), 0.002, 0)
    y[-2:] = np.nan
    b = analyze_lr_curve(lr, y, stabilize_loss=y - 0.01)
    paths = write_lr_report(b, None, tmp_path, source="metrics.csv")
    assert png_size(paths["plot"]) == (800, 480)
    page = paths["html"].read_text()
    parser = _Collect()
    parser.feed(page)
    assert "img" in parser.tags and "table" in parser.tags
    assert parser.srcs and all(s.startswith("data:image/png;base64,") for s in parser.srcs)
    assert "http" not in page and "<script" not in page and "<link" not in page
    assert "rose_after_min" in page and "diverged" in page
    md = paths["markdown"].read_text()
    assert md.startswith("## LR range test") and "lr_mid" in md
    assert json.loads(paths["json"].read_text())["status"] == "ok"
    assert not list(tmp_path.glob(".*.tmp"))  # nothing left half-written


def test_not_ok_report_says_what_to_do(tmp_path):
    lr = lr_sweep(20)
    b = analyze_lr_curve(lr, noisy(np.full(lr.shape, 0.2), 0.002, 0))
    assert b.status == "no_descent"
    page = write_lr_report(b, None, tmp_path)["html"].read_text()
    assert "Validate more often" in page


def test_step_report(tmp_path):
    e = np.arange(61) / 2
    shape = ConstantRunShape()
    w = select_step_window(e * 10, e, noisy(shape.loss(e), 0.001, 0), stabilize_loss=shape.loss(e) - 0.01)
    paths = write_step_report(w, None, tmp_path)
    assert png_size(paths["plot"]) == (800, 480)
    page = paths["html"].read_text()
    assert "data:image/png;base64," in page and f"Train for {w.recommended_epochs} epochs" in page
    assert "rose_after_min" in paths["markdown"].read_text()


def test_the_reports_leave_the_process_s_matplotlib_backend_and_pyplot_alone(tmp_path):
    """A notebook's inline plots keep showing after a step wrote its reports: the plots switched the whole process to
    Agg (matplotlib.use("Agg", force=True)) for pyplot's figures. A backend other than Agg stands in for the
    notebook's, and no figure is left in pyplot's registry."""
    import matplotlib
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        e = np.arange(61) / 2
        paths = write_step_report(select_step_window(e * 10, e, noisy(ConstantRunShape().loss(e), 0.001, 0)), None,
                                  tmp_path)
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == []
        assert png_size(paths["plot"]) == (800, 480)
    finally:
        matplotlib.use(before)


def test_a_step_report_whose_band_was_widened_says_so_beside_the_tolerance(tmp_path):
    """The demo's report gave "tolerance 0.02" and a window "within 0.00279 of its minimum" (5.5 % of it) with no word
    that this curve's noise had widened the band, so the two rows read as a window too wide for its tolerance."""
    from rangefinder.analysis.step_window import band_widened

    e = np.arange(41) / 2
    shape = ConstantRunShape()
    rows = {}
    for noise in (0.001, 0.01):
        w = select_step_window(e * 10, e, noisy(shape.loss(e), noise, 0))
        md = write_step_report(w, None, tmp_path / str(noise))["markdown"].read_text()
        rows[noise] = (w, next(line for line in md.splitlines() if line.startswith("| tolerance |")))
    plain, noisier = rows[0.001], rows[0.01]
    assert not band_widened(plain[0]) and band_widened(noisier[0])
    assert "widened here" not in plain[1], plain[1]
    w = noisier[0]
    assert f"widened here to 2 standard errors, the curve being noisier: the window's band is " \
           f"{w.band / w.best_val_loss:.1%} of the minimum" in noisier[1], noisier[1]


def test_step_report_gives_the_recommended_epochs_and_the_updates_they_take(tmp_path):
    """The lead said "Train for 10 epochs (about 41 updates)" on a run of 4 updates per epoch: the window's centre in
    updates beside its rounded epochs. The lead, the rows and the plot's marker say the epochs and their 40 updates."""
    e = np.arange(61) / 2
    w = select_step_window(e * 4, e, noisy(ConstantRunShape().loss(e), 0.001, 0))
    assert w.status == "ok" and w.recommended_epochs == 10
    paths = write_step_report(w, None, tmp_path)
    md = paths["markdown"].read_text()
    assert "Train for 10 epochs (40 updates of this fine-tune)." in md.split("\n")[2]
    assert "| recommended epochs | 10 |" in md and "| recommended updates | 40 |" in md
    assert "Train for 10 epochs (40 updates of this fine-tune)." in paths["html"].read_text()


def test_step_report_of_a_curve_without_epochs_gives_the_window_in_updates(tmp_path):
    # A metrics.csv without an epoch column: the report said "train for the recommended epochs" over a table whose
    # epochs were all "-", and gave none of the updates the JSON had.
    e = np.arange(61) / 2
    w = select_step_window(e * 10, None, noisy(ConstantRunShape().loss(e), 0.001, 0))
    assert w.status == "ok" and w.recommended_epochs is None and w.recommended_updates is not None
    paths = write_step_report(w, None, tmp_path)
    md = paths["markdown"].read_text()
    assert f"Train for about {w.recommended_updates} updates (the curve has no epochs" in md
    assert f"| recommended updates | {w.recommended_updates} |" in md
    assert f"| window (updates) | {w.window_start_update:.4g} - {w.window_end_update:.4g} |" in md
    assert "train for the recommended epochs" not in md.split("\n")[2]
    assert "| window (epochs) | - |" in md
    assert f"Train for about {w.recommended_updates} updates" in paths["html"].read_text()


def test_step_report_notes_the_cooldown_and_the_average_under_their_names_once(tmp_path):
    # The steps' sentences open with their names (they are also the MLflow run's description); the note's label says
    # it already, so the report does not say "window average: Window average: ...".
    e = np.arange(61) / 2
    shape = ConstantRunShape()
    w = select_step_window(e * 10, e, noisy(shape.loss(e), 0.001, 0))
    text = write_step_report(w, None, tmp_path, cooldown="Cooldown: a wsd branch; validation loss 0.05, delivered.",
                             average="Window average: 6 checkpoints averaged; validation loss 0.049, delivered."
                             )["markdown"].read_text()
    assert "- **cooldown**: a wsd branch; validation loss 0.05, delivered." in text
    assert "- **window average**: 6 checkpoints averaged; validation loss 0.049, delivered." in text


def test_step_report_names_the_rule_that_picked_the_delivered_checkpoint_and_a_fine_tune_that_did_not_help(tmp_path):
    """No window (a flat curve): the lead says which checkpoint was delivered and why, and that it is not below the
    base model's loss (update 0); a row names the rule. With a window and an improvement, the lead stays short."""
    from rangefinder.analysis import Delivery, select_step_window

    e = np.arange(41) / 2
    flat = select_step_window(e * 10, e, noisy(np.full(e.shape, 0.2), 0.002, 0))
    assert flat.status == "no_improvement"
    worse = Delivery(update=40, rule="run_lowest", val_loss=0.1986, base_val_loss=0.1971)
    text = write_step_report(flat, None, tmp_path / "flat", delivered=worse)["markdown"].read_text()
    lead = text.split("|")[0]
    assert "Delivered: update 40, no step window was found" in lead and "did not improve on the base model" in lead
    row = "| delivered checkpoint | update 40, rule run_lowest, val loss 0.1986; base model (update 0): 0.1971 |"
    assert row in text

    shape = ConstantRunShape()
    w = select_step_window(e * 10, e, noisy(shape.loss(e), 0.001, 0))
    good = Delivery(update=100, rule="window_lowest", val_loss=0.05, base_val_loss=0.2)
    text = write_step_report(w, None, tmp_path / "ok", delivered=good)["markdown"].read_text()
    assert "Delivered:" not in text.split("|")[0] and "update 100, rule window_lowest, val loss 0.05" in text


@pytest.mark.parametrize("shape", ["a window", "no window"])
def test_a_step_report_on_a_run_that_kept_only_its_final_weights_says_they_are_delivered(tmp_path, shape):
    """finetune.checkpoint_every_epochs not below finetune.epochs: the run's only checkpoint is its end (update 200
    of a 20-epoch curve). The rule that picks it (delivered_checkpoint) says so in the report's lead and its row, the
    window's centre and the run's end being far apart; with every checkpoint kept, the same report names the window's
    pick and says nothing of final weights."""
    from rangefinder.analysis import delivered_checkpoint

    e = np.arange(41) / 2
    loss = ConstantRunShape().loss(e) if shape == "a window" else np.full(e.shape, 0.2)
    update, val = e * 10, noisy(loss, 0.002, 0)
    w = select_step_window(update, e, val)
    assert (w.recommended_updates is not None) is (shape == "a window")
    only_final = delivered_checkpoint(w, [200], update, val)
    assert only_final.update == 200 and only_final.final
    paths = write_step_report(w, None, tmp_path / "final", delivered=only_final)
    lead = paths["markdown"].read_text().split("|")[0]
    assert "Delivered: update 200" in lead and "it is the run's final weights" in lead
    page = html.unescape(paths["html"].read_text())
    row = page[page.index("delivered checkpoint</th>"):].split("</tr>")[0]  # the page's row has the rule's words
    assert "it is the run's final weights" in row
    if shape == "a window":
        assert only_final.rule == "window_nearest" and "trained past the window" in row
    every = delivered_checkpoint(w, update[1:], update, val)  # a checkpoint at every validation
    assert every.final is (every.update == 200) and (shape == "no window" or every.update < w.window_end_update)
    paths = write_step_report(w, None, tmp_path / "every", delivered=every)
    assert ("final weights" in paths["markdown"].read_text() + html.unescape(paths["html"].read_text())) is every.final


def test_step_report_lists_each_aspect_buckets_validation_loss(tmp_path):
    e = np.arange(61) / 2
    loss = noisy(ConstantRunShape().loss(e), 0.001, 0)
    w = select_step_window(e * 10, e, loss)
    # The engine's columns for a validation set in two buckets (40x24 before 24x40 in the file, sorted in the report).
    curve = {"update": e * 10, "epoch": e, "val_loss": loss, "val_loss_40x24": loss + 0.1, "val_loss_24x40": loss - 0.1}
    text = write_step_report(w, curve, tmp_path)["markdown"].read_text()
    at = int(np.argmin(np.abs(e * 10 - w.best_update)))
    lines = [ln for ln in text.splitlines() if ln.startswith("| val loss, bucket")]
    u = int(e[at] * 10)
    assert lines == [
        f"| val loss, bucket 24x40 | {loss[at] - 0.1:.4g} | at update {u} (baseline {loss[0] - 0.1:.4g}) |",
        f"| val loss, bucket 40x24 | {loss[at] + 0.1:.4g} | at update {u} (baseline {loss[0] + 0.1:.4g}) |"]
    plain = write_step_report(w, {"update": e * 10, "val_loss": loss}, tmp_path / "plain")["markdown"].read_text()
    assert "bucket" not in plain


def test_step_report_shows_each_sigmas_loss_and_states_the_weighting(tmp_path):
    """A flow family's run: one row per sigma of the validation grid, and the note saying how val_loss weighs them."""
    e = np.arange(61) / 2
    loss = noisy(ConstantRunShape().loss(e), 0.001, 0)
    w = select_step_window(e * 10, e, loss)
    curve = {"update": e * 10, "epoch": e, "val_loss": loss, "val_loss_b0": 3 * loss, "val_loss_b1": loss / 3}
    weighting = {"statement": "val_loss is the plain mean of the 2 per-sigma losses", "grid": [0.25, 0.75]}
    text = write_step_report(w, curve, tmp_path, validation_weighting=weighting)["markdown"].read_text()
    at = int(np.argmin(np.abs(e * 10 - w.best_update)))
    lines = [ln for ln in text.splitlines() if ln.startswith("| val loss at sigma")]
    u = int(e[at] * 10)
    assert lines == [f"| val loss at sigma 0.25 (val_loss_b0) | {3 * loss[at]:.4g} | at update {u} (baseline "
                     f"{3 * loss[0]:.4g}) |",
                     f"| val loss at sigma 0.75 (val_loss_b1) | {loss[at] / 3:.4g} | at update {u} (baseline "
                     f"{loss[0] / 3:.4g}) |"]
    assert "plain mean of the 2 per-sigma losses" in text
    # Flux's grid moves with the image size: over aspect buckets a column mixes sigmas, and its label says which.
    spanned = write_step_report(w, curve, tmp_path / "buckets", validation_weighting={
        **weighting, "grid_span": [[0.25, 0.31], [0.75, 0.8]]})["markdown"].read_text()
    assert [ln.split(" | ")[0] for ln in spanned.splitlines() if ln.startswith("| val loss at sigma")] == [
        "| val loss at sigma 0.25-0.31 by image size (val_loss_b0)",
        "| val loss at sigma 0.75-0.8 by image size (val_loss_b1)"]
    plain = write_step_report(w, curve, tmp_path / "ddpm", validation_weighting={"statement": "x", "grid": None})
    assert "sigma" not in plain["markdown"].read_text()


def test_cli_analyze_lr_and_select_steps(tmp_path, capsys):
    shape = RangeTestShape(rise=0.05)
    lr = lr_sweep(30)
    write_lr_csv(tmp_path / "lr.csv", lr, noisy(shape.loss(lr), 0.002, 0))
    assert main(["analyze-lr", str(tmp_path / "lr.csv"), "--json", "--plot", str(tmp_path / "lr.png"),
                 "--report", str(tmp_path / "rep")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "ok" and out["ramp"] == "exp" and len(out["lr_mid_ci80"]) == 2
    assert png_size(tmp_path / "lr.png") == (800, 480) and (tmp_path / "rep" / "lr_report.html").is_file()
    # The same CSV gives the same JSON.
    main(["analyze-lr", str(tmp_path / "lr.csv"), "--json"])
    again = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in out.items() if k not in ("plot", "report")} == again

    e = np.arange(41) / 2
    c = ConstantRunShape()
    with open(tmp_path / "ft.csv", "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["update", "epoch", "lr", "train_loss", "val_loss", "stabilize_loss"])
        for ep, v in zip(e, noisy(c.loss(e), 0.001, 0), strict=True):
            wr.writerow([int(ep * 10), ep, 1e-5, "", v, ""])
    assert main(["select-steps", str(tmp_path / "ft.csv"), "--json", "--tolerance", "0.02"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "ok" and out["recommended_epochs"] >= 1


def test_report_shows_every_midpoint_and_marks_the_chosen(tmp_path, capsys):
    shape = RangeTestShape(rise=0.05)
    lr = lr_sweep(30)
    write_lr_csv(tmp_path / "lr.csv", lr, noisy(shape.loss(lr), 0.002, 0))
    assert main(["analyze-lr", str(tmp_path / "lr.csv"), "--json", "--midpoint", "arithmetic",
                 "--report", str(tmp_path / "rep")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["midpoint"] == "arithmetic" and out["lr_mid"] == out["midpoints"]["arithmetic"]
    assert out["lr_mid"] == (out["lr_low"] + out["lr_high"]) / 2
    md = (tmp_path / "rep" / "lr_report.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in md.splitlines() if "midpoint:" in line}
    assert set(rows) == {"midpoint: tuned", "midpoint: geometric", "midpoint: arithmetic (chosen)"}
    assert rows["midpoint: arithmetic (chosen)"] == f"{out['lr_mid']:.3g}"
    assert "midpoint: arithmetic (chosen)" in (tmp_path / "rep" / "lr_report.html").read_text()
    with pytest.raises(SystemExit) as e:  # argparse: usage and "invalid choice" on stderr
        main(["analyze-lr", str(tmp_path / "lr.csv"), "--midpoint", "harmonic"])
    assert e.value.code == 2 and "invalid choice: 'harmonic'" in capsys.readouterr().err


def test_cli_bad_input(tmp_path, capsys):
    assert main(["analyze-lr", str(tmp_path / "missing.csv")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "noval.csv").write_text("update,lr\n0,0\n1,1e-6\n")
    assert main(["select-steps", str(tmp_path / "noval.csv")]) == 2
    err = capsys.readouterr().err
    assert "no val_loss column" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "short.csv").write_text("update,lr,val_loss\n0,0,0.2\n1,1e-6,nan\n2,2e-6,0.3\n")
    assert main(["analyze-lr", str(tmp_path / "short.csv")]) == 2
    assert "at least 3" in capsys.readouterr().err


def test_read_curve_roundtrip(tmp_path):
    lr = lr_sweep(5)
    write_lr_csv(tmp_path / "m.csv", lr, np.linspace(0.2, 0.1, lr.size))
    c = read_curve_csv(tmp_path / "m.csv")
    assert np.allclose(c["lr"], lr) and np.isnan(c["train_loss"][0])


def test_step_report_shows_the_samples_over_training_strip(tmp_path):
    """A row per prompt and seed, a column per sampled update in order, every image embedded; without samples the
    page has no strip."""
    from PIL import Image

    from rangefinder.analysis import SampleStrip

    e = np.arange(61) / 2
    w = select_step_window(e * 10, e, noisy(ConstantRunShape().loss(e), 0.001, 0))
    columns = []
    for update, colour in ((0, "red"), (40, "green"), (80, "blue")):
        pngs = []
        for row in range(2):
            pngs.append(tmp_path / f"u{update}-r{row}.png")
            Image.new("RGB", (32, 32), colour).save(pngs[-1])
        columns.append((update, update / 8, pngs))
    strip = SampleStrip(rows=["a red circle | seed 0", "a yellow square | seed 0"], columns=columns,
                        mlflow_key="samples_during_training")
    paths = write_step_report(w, None, tmp_path / "report", samples=strip)
    page = paths["html"].read_text()
    parser = _Collect()
    parser.feed(page)
    assert "Samples over training" in page and "samples_during_training" in page
    assert [s[:22] for s in parser.srcs].count("data:image/png;base64,") == 1 + 6  # the plot and 6 samples
    assert "<th class='row'>update</th><th>0</th><th>40</th><th>80</th></tr>" in page
    assert "<th class='row'>epoch</th><th>0</th><th>5</th><th>10</th></tr>" in page
    assert "alt='a yellow square | seed 0 at update 80'" in page and "width='96'" in page  # 32 px shown at 96
    assert "updates 0, 40, 80" in paths["markdown"].read_text() and "Scroll" not in page
    # Eleven columns (the demo's auto) still fit the page's width, at smaller cells; forty scroll inside the box.
    eleven = write_step_report(w, None, tmp_path / "eleven",
                               samples=SampleStrip(strip.rows, (columns * 4)[:11]))["html"].read_text()
    assert "width='53'" in eleven and "Scroll" not in eleven
    many = write_step_report(w, None, tmp_path / "many", samples=SampleStrip(strip.rows, columns * 14))["html"]
    assert "width='40'" in many.read_text() and "Scroll the strip sideways" in many.read_text()
    plain = write_step_report(w, None, tmp_path / "plain")["html"].read_text()
    assert "Samples over training" not in plain


def test_the_samples_strip_shows_prompts_as_text_never_as_markup(tmp_path):
    """A row's label is a sampling prompt and its seed, shown in a header cell and in each image's alt attribute of
    the report the KFP UI and MLflow render: a prompt that closes the attribute or opens an element stays text."""
    from PIL import Image

    from rangefinder.analysis import SampleStrip

    e = np.arange(61) / 2
    w = select_step_window(e * 10, e, noisy(ConstantRunShape().loss(e), 0.001, 0))
    png = tmp_path / "cell.png"
    Image.new("RGB", (32, 32), "red").save(png)
    rows = ["<script>alert(1)</script> | seed 0", "a' onerror='alert(2) | seed 0", '<img src=x onerror="alert(3)">']
    page = write_step_report(w, None, tmp_path / "report", samples=SampleStrip(rows, [(0, 0.0, [png] * 3)]))["html"]
    parser = _Collect()
    parser.feed(page.read_text())
    assert "script" not in parser.tags and parser.tags.count("img") == 1 + 3  # the plot and the three cells
    assert not [a for a in parser.attributes if a.startswith("on")]
    assert all(html.escape(r) in page.read_text() for r in rows)


def test_low_quality_reading_advises_a_zoom_or_a_grid(tmp_path):
    from rangefinder.analysis.lr_bounds import FLAG_ADVICE
    from rangefinder.analysis.zoom import zoom_range
    from rangefinder.defaults import LOW_QUALITY

    shape = RangeTestShape(rise=0.05)
    # A clean 40-point curve reads with a high score: no flag, no such advice.
    lr = lr_sweep(40)
    good = analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, 0))
    assert good.status == "ok" and good.quality >= LOW_QUALITY and "low_quality" not in good.flags
    assert "zoomed range test or a short grid" not in write_lr_report(good, None, tmp_path / "good")["html"].read_text()
    # 14 points with noise a fifth of the drop: still a descent, but placed loosely.
    lr = lr_sweep(14)
    weak = analyze_lr_curve(lr, noisy(shape.loss(lr), 0.02, 0))
    assert weak.status == "ok" and weak.quality < LOW_QUALITY
    assert weak.flags[-1] == "low_quality" and FLAG_ADVICE["low_quality"] in weak.advice
    paths = write_lr_report(weak, None, tmp_path / "weak")
    md = paths["markdown"].read_text()
    assert f"is under {LOW_QUALITY:g}: check lr_mid with a zoomed range test or a short grid" in md
    assert "low_quality" in md and "train a short grid of constant LRs" in md
    assert json.loads(paths["json"].read_text())["flags"][-1] == "low_quality"
    # Advice only: the zoom policy decides as it would without the flag.
    without = [f for f in weak.flags if f != "low_quality"]
    args = (weak.lr_low, weak.lr_high, float(lr[1]), float(lr[-1]), 9, 5)
    assert zoom_range("ok", weak.flags, *args) == zoom_range("ok", without, *args)


def test_a_range_test_the_zoom_replaced_says_so_instead_of_train_at(tmp_path):
    """Issue 35: the first test's report said "Train at lr_mid = ..." although the zoom's bounds were trained at."""
    shape = RangeTestShape(rise=0.05)
    lr = lr_sweep(30)
    b = analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, 0))
    assert b.status == "ok"
    plain = write_lr_report(b, None, tmp_path / "plain")["markdown"].read_text()
    replaced = write_lr_report(b, None, tmp_path / "zoomed", zoom=(2e-5, 3e-4))["markdown"].read_text()
    assert "Train at lr_mid" in plain
    assert "Train at" not in replaced and "Replaced by a zoomed range test over 2e-05..0.0003" in replaced
    # Nor does its status note tell the reader to train at this test's lr_mid (the demo's report did).
    assert "train at lr_mid" in plain and "train at lr_mid" not in replaced
    assert "the zoomed range test read the bounds again" in replaced
    assert f"this test read lr_mid {b.lr_mid:.3g}" in replaced


def test_the_range_test_plot_gives_its_lrs_as_the_report_s_lead_does():
    """The plot's legend said the bounds and lr_mid to 2 significant figures (the demo's 0.00021 and 0.00014) beside
    a lead saying 0.000209 and 0.000143: the reader compares them, so they carry the same digits."""
    from rangefinder.analysis.plots import lr_range_test_figure
    from rangefinder.analysis.reports import lr_headline

    shape = RangeTestShape(rise=0.05)
    lr = lr_sweep(30)
    b = analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, 0))
    assert b.status == "ok" and b.lr_low and b.lr_high and b.lr_mid
    fig = lr_range_test_figure(b)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    lead = lr_headline(b)
    for v in (b.lr_low, b.lr_high, b.lr_mid):
        assert f"{v:.3g}" in lead
    assert f"bounds {b.lr_low:.3g} - {b.lr_high:.3g}" in legend, legend
    assert f"lr_mid ({b.midpoint}) {b.lr_mid:.3g}" in legend, legend
    others = {rule: v for rule, v in (b.midpoints or {}).items() if rule != b.midpoint}
    assert others and all(f"{rule} midpoint {v:.3g}" in legend for rule, v in others.items()), legend


def test_the_reports_tables_give_each_lr_with_the_digits_of_their_lead(tmp_path):
    """The demo's reports led with "lr_mid = 0.000143" and "The LR is 0.000209" above tables saying 0.0001425 and
    0.0002091: the same LRs, read as two values. Every LR in a table has the lead's 3 significant figures."""
    from rangefinder.analysis.halving import HalvingCandidate, HalvingDecision

    shape = RangeTestShape(rise=0.05)
    lr = lr_sweep(30)
    b = analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, 0))
    md = write_lr_report(b, None, tmp_path / "lr")["markdown"].read_text()
    cells = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in md.splitlines()[6:] if "|" in line}
    lead = md.splitlines()[2]
    for key in ("lr_low", "lr_mid", "lr_high"):
        assert cells[key] == f"{getattr(b, key):.3g}" and cells[key] in lead, (key, cells[key], lead)
    assert cells["lr_mid 80% interval"] == " - ".join(f"{v:.3g}" for v in b.lr_mid_ci80)

    e = np.arange(41) / 2
    w = select_step_window(e * 10, e, noisy(ConstantRunShape().loss(e), 0.001, 0))
    u = e[:21] * 10
    decision = HalvingDecision(pause_update=100, kept="lr_high", lr=2.0912e-4, candidates={
        "lr_mid": HalvingCandidate.measured(1.4253e-4, "paused", 100, u, ConstantRunShape().loss(e[:21]) + 0.004, 100),
        "lr_high": HalvingCandidate.measured(2.0912e-4, "paused", 100, u, ConstantRunShape().loss(e[:21]), 100)})
    md = write_step_report(w, None, tmp_path / "step", halving=decision)["markdown"].read_text()
    assert "The LR is 0.000209, lr_high" in md.splitlines()[2]
    assert "| lr_high (kept) | 0.000209 |" in md and "| lr_mid (dropped) | 0.000143 |" in md, md


def test_step_plot_draws_each_dropped_halving_candidate_in_its_own_colour(tmp_path):
    """Three candidates race when lr_below fires: the two dropped ones get two colours, each found in the PNG."""
    from matplotlib.image import imread

    from rangefinder.analysis.halving import HalvingCandidate, HalvingDecision
    from rangefinder.analysis.plots import DROPPED, plot_step_window

    e = np.arange(41) / 2
    shape = ConstantRunShape()
    w = select_step_window(e * 10, e, noisy(shape.loss(e), 0.001, 0))
    u = e[:21] * 10

    def cand(lr, lift):
        return HalvingCandidate.measured(lr, "paused", 100, u, shape.loss(e[:21]) + lift, 100)

    decision = HalvingDecision(pause_update=100, kept="lr_below", lr=1e-3,
                               candidates={"lr_mid": cand(1e-2, 0.004), "lr_high": cand(1e-1, 0.008),
                                           "lr_below": cand(1e-3, 0.0)})
    png = imread(plot_step_window(w, tmp_path / "plot.png", halving=decision))[..., :3]

    def found(hex_colour):
        rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255
        return int((np.abs(png - rgb).max(axis=-1) < 0.03).sum())

    assert DROPPED["lr_mid"] != DROPPED["lr_high"]
    assert found(DROPPED["lr_mid"]) > 20 and found(DROPPED["lr_high"]) > 20
    assert found(DROPPED["lr_below"]) == 0  # the kept candidate is the run's own curve, not a dropped one


def test_the_step_plot_names_the_lr_its_run_trained_at_as_the_lead_does():
    """After successive halving the plot named the dropped candidate's LR alone (the demo's "lr_mid 0.000143: dropped
    at update 160"), never the LR of the run it draws, which the report's lead gives: its title now says it."""
    from rangefinder.analysis.halving import HalvingCandidate, HalvingDecision
    from rangefinder.analysis.plots import step_window_figure
    from rangefinder.analysis.reports import step_headline

    e = np.arange(41) / 2
    shape = ConstantRunShape()
    w = select_step_window(e * 10, e, noisy(shape.loss(e), 0.001, 0))
    u = e[:21] * 10
    decision = HalvingDecision(pause_update=100, kept="lr_high", lr=2.0912e-4, candidates={
        "lr_mid": HalvingCandidate.measured(1.4253e-4, "paused", 100, u, shape.loss(e[:21]) + 0.004, 100),
        "lr_high": HalvingCandidate.measured(2.0912e-4, "paused", 100, u, shape.loss(e[:21]), 100)})
    fig = step_window_figure(w, halving=decision)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    title = fig.axes[0].get_title()
    assert "The LR is 0.000209, lr_high, kept by successive halving." in step_headline(w, decision)
    assert title.startswith("Step window at lr_high 0.000209 (kept): "), title
    assert "lr_mid 0.000143: dropped at update 100" in legend, legend


def test_the_markdown_report_has_the_html_report_s_columns(tmp_path):
    """reports/*.md showed each row's quantity and value but not the third column the HTML page shows: the halving
    candidates' best validation losses by the pause, the window's band, the noise's p(improvement). Both now give the
    same three cells per row."""
    from rangefinder.analysis.halving import HalvingCandidate, HalvingDecision

    e = np.arange(41) / 2
    shape = ConstantRunShape()
    w = select_step_window(e * 10, e, noisy(shape.loss(e), 0.001, 0))
    u = e[:21] * 10
    decision = HalvingDecision(pause_update=100, kept="lr_high", lr=1e-3, candidates={
        "lr_mid": HalvingCandidate.measured(3e-4, "paused", 100, u, shape.loss(e[:21]) + 0.004, 100),
        "lr_high": HalvingCandidate.measured(1e-3, "paused", 100, u, shape.loss(e[:21]), 100)})
    paths = write_step_report(w, None, tmp_path, halving=decision)
    html_rows = [[html.unescape(c) for c in row] for row in re.findall(
        r"<tr><th>(.*?)</th><td class='num'>(.*?)</td><td class='muted'>(.*?)</td></tr>", paths["html"].read_text())]
    md_rows = [[c.strip() for c in ln.strip("|").split(" | ")] for ln in paths["markdown"].read_text().splitlines()
               if ln.startswith("| ") and not ln.startswith("| |")]
    assert len(html_rows) == 10 and md_rows == html_rows
    mid = next(r for r in md_rows if r[0].startswith("lr_mid (dropped)"))
    best = decision.candidates["lr_mid"]
    assert f"best val loss by update 100: {best.best_val_loss:.4g} at update {best.best_update}" in mid[2]


@pytest.mark.parametrize("rule", ["window_lowest", "earliest_tied"])
def test_step_plot_marks_the_delivered_checkpoint_and_an_earliest_tied_band(tmp_path, rule):
    """The plot showed the recommended length but not the weights delivered, which are a checkpoint of their own
    (the window's lowest, or with finetune.deliver: earliest_tied, an early one under the band's top). The star in
    its colour is drawn at its update, and the band's top only for the earliest tied checkpoint."""
    from matplotlib.image import imread

    from rangefinder.analysis import Delivery
    from rangefinder.analysis.plots import DELIVERED, plot_step_window

    e = np.arange(41) / 2
    loss = noisy(ConstantRunShape().loss(e), 0.001, 0)
    w = select_step_window(e * 10, e, loss)
    low = float(loss.min())
    delivered = Delivery(update=60, rule=rule, val_loss=low * 1.005, base_val_loss=float(loss[0]),
                         tied_ceiling=low * 1.01 if rule == "earliest_tied" else None)
    rgb = np.array([int(DELIVERED[i:i + 2], 16) for i in (1, 3, 5)]) / 255

    def drawn(path):
        png = imread(path)[..., :3]
        where = np.abs(png - rgb).max(axis=-1) < 0.03
        return int(where.sum()), int(where.any(axis=0).sum())  # pixels, and how many columns hold one

    none = drawn(plot_step_window(w, tmp_path / "none.png"))
    pixels, columns = drawn(plot_step_window(w, tmp_path / "plot.png", delivered=delivered))
    assert none == (0, 0) and pixels > 40
    # The band's top is a line across the axes (and the legend's sample of it); a star alone spans a few columns.
    assert (columns > 100) is (rule == "earliest_tied")
