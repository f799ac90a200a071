"""StepProgress reading what kfp.local prints: the excerpt below is a real kfp.local log (the demo's range test and
choose-lr), ANSI colours included, trimmed to the lines that matter and with the paths shortened. The finished bar's
line comes twice, as tqdm's close repeats it (with another rate) in a real log; the terminal shows it once."""

from __future__ import annotations

import io

from rangefinder.pipelines.progress import StepProgress, headline_text

C, E = "\x1b[96m", "\x1b[0m"
LOG = f"""23:29:05.604 - INFO - Executing task {C}'lr-range-test-3'{E}
    Loading weights: 100%|██████████| 52/52 [00:00<00:00, 1200.00it/s]
    encode latents: 100%|██████████| 20/20 [00:00<00:00, 98.20image/s]
    train (exp-ramp):   4%|▍         | 1/24 [00:00<00:05,  4.10update/s, loss=0.2212, lr=1.33e-05]
    train (exp-ramp):  50%|█████     | 12/24 [00:01<00:01,  6.51update/s, loss=0.2101, lr=0.000316]
    train (exp-ramp): 100%|██████████| 24/24 [00:03<00:00,  6.49update/s, loss=0.1688, lr=0.01]
        train (exp-ramp): 100%|██████████| 24/24 [00:04<00:00,  5.90update/s, loss=0.1688, lr=0.01]
    [KFP Executor 2026-11-23 23:29:23,324 INFO]: Wrote executor output file to /out/executor_output.json.


23:29:25.933 - INFO - Task {C}'lr-range-test-3'{E} finished with status \x1b[92mSUCCESS{E}
23:29:25.935 - INFO - Task {C}'lr-range-test-3'{E} outputs:
    needs_zoom: True
    zoom_lr_min: 1.1397092313062261e-05
    zoom_lr_max: 0.0009859428321015499
    lr_low: 4.558836925224904e-05
    lr_mid: 0.0001616431560297725
    lr_high: 0.00024648570802538746
    report_md: Markdown( name='report_md',
                         uri='/out/lr-range-test-3/report_md',
                         metadata={{}} )
--------------------------------------------------------------------------------
23:29:47.943 - INFO - Executing task {C}'choose-lr-4'{E}
23:29:48.465 - INFO - Task {C}'choose-lr-4'{E} finished with status \x1b[91mFAILURE{E}
"""


def _shown(plain_every: float) -> tuple[list[str], str]:
    terminal, log = io.StringIO(), io.StringIO()
    progress = StepProgress(log, terminal, plain_every=plain_every)
    for piece in (LOG[:100], LOG[100:777], LOG[777:]):  # as it comes: in pieces that cut lines
        progress.write(piece)
    progress.close()
    return terminal.getvalue().splitlines(), log.getvalue()


def _terminal_of(log: str) -> list[str]:
    """The lines a local run's terminal shows for the pipeline log `log`, written at once and closed."""
    terminal = io.StringIO()
    progress = StepProgress(io.StringIO(), terminal)
    progress.write(log)
    progress.close()
    return terminal.getvalue().splitlines()


def test_a_line_per_step_with_its_headline_and_the_log_kept_whole():
    lines, log = _shown(plain_every=3600)
    assert log == LOG
    assert lines[0] == "rangefinder: lr-range-test started"
    # Only the engine's bars, not the libraries' loading bars; each bar's last line always shows.
    assert lines[1:-3] == ["rangefinder:   encode latents: 20/20",
                           "rangefinder:   train (exp-ramp): 1/24 (loss=0.2212, lr=1.33e-05), eta 00:05",
                           "rangefinder:   train (exp-ramp): 24/24 (loss=0.1688, lr=0.01)"]
    assert lines[-3].startswith("rangefinder: lr-range-test done in ")
    assert lines[-3].endswith(" s: lr_low 4.56e-05, lr_mid 0.000162, lr_high 0.000246 (provisional: a zoomed range "
                              "test follows over 1.14e-05..0.000986)")
    assert lines[-2] == "rangefinder: choose-lr started"
    assert lines[-1].startswith("rangefinder: choose-lr failed after ")


def test_plain_lines_come_at_most_every_interval():
    every, _ = _shown(plain_every=0)
    assert [ln for ln in every if "train (exp-ramp)" in ln] == [
        "rangefinder:   train (exp-ramp): 1/24 (loss=0.2212, lr=1.33e-05), eta 00:05",
        "rangefinder:   train (exp-ramp): 12/24 (loss=0.2101, lr=0.000316), eta 00:01",
        "rangefinder:   train (exp-ramp): 24/24 (loss=0.1688, lr=0.01)"]


def test_a_steps_warning_is_shown_once_under_its_step():
    # Issue 36, class 3: the training plan's warnings reach the terminal of a local run, once per step even when
    # several processes print them.
    warning = "effective batch 24 is larger than the 16 training images: each update sees some images twice"
    log = (f"23:29:05.604 - INFO - Executing task {C}'finetune-2'{E}\n"
           f"    rangefinder: warning: {warning}\n"
           f"    WARNING:rangefinder.training.loop:rangefinder: warning: {warning}\n"
           f"23:29:25.933 - INFO - Task {C}'finetune-2'{E} finished with status \x1b[92mSUCCESS{E}\n")
    lines = _terminal_of(log)
    assert lines[:2] == ["rangefinder: finetune started", f"rangefinder:   finetune: warning: {warning}"]
    assert len(lines) == 3


def test_a_warning_several_steps_print_is_shown_once_per_run():
    """The demo's training plan warns that its batch (4 of 16 images) is not full-cycle, and the range test, its zoom
    and the fine-tune (once per successive-halving run) each print it: the terminal showed it three times. It shows
    it once, under the first step; a warning no step said before is shown under its own."""
    plan = ("tiny dataset (16 images) but not full-cycle: batch_size x grad_accum x world_size = 4; setting it to 16 "
            "gives one smooth update per epoch")
    other = "training.flow.shift (3) is not used"
    log = ""
    for task, said in (("lr-range-test-3", [plan]), ("lr-range-test-2-2", [plan]),
                       ("finetune-2", [plan, plan, other, plan])):
        log += f"23:29:05.604 - INFO - Executing task {C}'{task}'{E}\n"
        log += "".join(f"    rangefinder: warning: {w}\n" for w in said)
        log += f"23:29:25.933 - INFO - Task {C}'{task}'{E} finished with status \x1b[92mSUCCESS{E}\n"
    lines = _terminal_of(log)
    warned = [ln for ln in lines if ": warning: " in ln]
    assert warned == [f"rangefinder:   lr-range-test: warning: {plan}", f"rangefinder:   finetune: warning: {other}"]


def test_an_mlflow_outage_a_step_rides_out_is_said_on_the_terminal():
    """The outbox's two lines of an outage (the server away: the step goes on and spools; back: the spool sent), as a
    step logs them, reach a local run's terminal under the step: they were only in pipeline.log, and the terminal
    said nothing of a server that went away mid-run and came back."""
    from rangefinder.tracking.outbox import AWAY_SAID, BACK_SAID

    away = AWAY_SAID % ("http://127.0.0.1:5000", "connection refused", "finetune", "/out/mlflow-spool", "30 s")
    back = BACK_SAID % ("http://127.0.0.1:5000", "finetune", "/out/mlflow-spool", "60 metric values, 2 images")
    log = (f"23:29:05.604 - INFO - Executing task {C}'finetune-2'{E}\n"
           f"    [KFP Executor 2026-12-07 09:44:27,602 WARNING]: {away}\n"
           f"    [KFP Executor 2026-12-07 09:44:46,490 WARNING]: {back}\n"
           f"23:29:25.933 - INFO - Task {C}'finetune-2'{E} finished with status \x1b[92mSUCCESS{E}\n")
    lines = _terminal_of(log)
    said = [ln.removeprefix("rangefinder:   finetune: warning: ") for ln in lines[1:3]]
    assert said == [away.removeprefix("rangefinder: warning: "), back.removeprefix("rangefinder: warning: ")]
    assert said[0].startswith("MLflow at http://127.0.0.1:5000 is not answering (connection refused); step ")


def test_a_second_outage_of_a_step_is_said_on_the_terminal_as_the_first():
    """A server that goes away again after it came back: the step's away line is the same words as the first time
    (its spool folder, the first try's wait), and the terminal, which says each warning once per run, left the second
    outage out, showing "answers again" twice under one "not answering"."""
    from rangefinder.tracking.outbox import AWAY_SAID, BACK_SAID

    away = AWAY_SAID % ("http://127.0.0.1:5000", "connection refused", "finetune", "/out/mlflow-spool", "30 s")
    back = BACK_SAID % ("http://127.0.0.1:5000", "finetune", "/out/mlflow-spool", "12 metric values")
    log = (f"23:29:05.604 - INFO - Executing task {C}'finetune'{E}\n"
           + f"    {away}\n    {back}\n" * 2
           + f"23:29:25.933 - INFO - Task {C}'finetune'{E} finished with status \x1b[92mSUCCESS{E}\n")
    warned = [ln for ln in _terminal_of(log) if ": warning: " in ln]
    assert [ln.split(": warning: ")[1] for ln in warned] == [away.removeprefix("rangefinder: warning: "),
                                                               back.removeprefix("rangefinder: warning: ")] * 2


def test_a_range_test_s_line_says_what_its_zoom_means():
    """The first range test's bounds are provisional when a zoom follows, and the component's 0 is no bound: the line
    said "lr_low 0, lr_mid 0, lr_high 0, needs_zoom True" when the curve gave none. The zoomed test's line (needs_zoom
    False) says its bounds and nothing of a zoom."""
    none = {"needs_zoom": "True", "lr_low": "0", "lr_mid": "0", "lr_high": "0", "zoom_lr_min": "1e-06",
            "zoom_lr_max": "10"}
    assert headline_text(none) == "no LR bounds read yet: a zoomed range test follows over 1e-06..10"
    some = {**none, "lr_low": "0.0002"}
    assert headline_text(some) == "lr_low 0.0002 (provisional: a zoomed range test follows over 1e-06..10)"
    final = {"needs_zoom": "False", "lr_low": "0.0002", "lr_mid": "0.0005", "lr_high": "0.0006", "zoom_lr_min": "0",
             "zoom_lr_max": "0"}
    assert headline_text(final) == "lr_low 0.0002, lr_mid 0.0005, lr_high 0.0006"
    assert headline_text({"train_images": "16", "source": "fixed"}) == "source fixed, train_images 16"


def test_the_retrains_line_says_its_epochs_by_name():
    # retrain-full's one output was KFP's default `Output`: the terminal said "retrain-full done in 20 s: Output 1".
    assert headline_text({"epochs": "1", "Output": "1"}) == "epochs 1"


def test_the_bar_is_drawn_on_a_terminal_that_reports_no_width():
    """A pseudo-terminal no window sized (0 x 0: `script` or `docker run -t` in CI) is a terminal, so the bar is drawn
    in place, not as plain lines; tqdm sized to it drew nothing at all, and a training step showed no progress
    between its started and done lines. A real pty, as opened (0 x 0), as the stderr of a process of its own, where
    StepProgress draws as a local run does (tqdm reads the size of sys.stderr itself)."""
    import os
    import pty
    import select
    import subprocess
    import sys
    from pathlib import Path

    code = ("import io, sys\n"
            "from rangefinder.pipelines.progress import StepProgress\n"
            "from tests.pipelines.test_progress import LOG\n"
            "progress = StepProgress(io.StringIO(), sys.stderr)\n"
            "for line in LOG.splitlines(keepends=True):\n"
            "    progress.write(line)\n"
            "progress.close()\n")
    master, slave = pty.openpty()
    assert os.get_terminal_size(slave) == (0, 0)
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=slave, cwd=Path(__file__).resolve().parents[2])
    os.close(slave)
    drawn = b""
    try:
        while True:
            if select.select([master], [], [], 60)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the process closed the terminal
                    break
                if not data:
                    break
                drawn += data
            else:
                break
    finally:
        os.close(master)
        assert proc.wait(timeout=60) == 0
    shown = drawn.decode("utf-8", errors="replace")
    assert "rangefinder: lr-range-test started" in shown
    assert "  train (exp-ramp):  50%|" in shown and "12/24" in shown and "loss=0.2101" in shown, shown  # 80 columns
    assert "rangefinder:   train" not in shown  # the live bar, not plain lines
