"""`rangefinder train`: a short run from the command line, and bad settings refused with one line."""

from __future__ import annotations

import contextlib
import csv
import json

import pytest
import yaml

from rangefinder.cli.main import main


@pytest.fixture(autouse=True)
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: a second intra-op thread mostly waits
    yield
    torch.set_num_threads(before)


def test_train_command_writes_curve_checkpoints_and_final(split_dir, tiny_model_dir, tmp_path, capsys):
    config = tmp_path / "rf.yaml"
    config.write_text(yaml.safe_dump({"training": {"cache_dir": str(tmp_path / "cache"), "lr": 1e-4, "epochs": 5}}))
    out = tmp_path / "out"
    rc = main(["train", "--data", str(split_dir), "--model", str(tiny_model_dir), "--out", str(out),
               "--config", str(config), "--steps", "2", "--batch-size", "4", "--schedule", "cosine",
               "--validate-every-updates", "1", "--checkpoint-every-updates", "1", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["status"] == "ok" and result["updates"] == 2  # --steps replaced the file's epochs
    with open(out / "metrics.csv", newline="") as f:
        assert [r["update"] for r in csv.DictReader(f)] == ["0", "1", "2"]
    assert (out / "final" / "model_index.json").is_file()
    assert [p.rsplit("/", 1)[-1] for p in result["checkpoints"]] == ["checkpoint-000001", "checkpoint-000002"]
    assert not (out / "samples").exists()  # no sampling: section in the file, no samples during training

    # Resuming a finished run redoes nothing and ends the same.
    rc = main(["train", "--data", str(split_dir), "--model", str(tiny_model_dir), "--out", str(out),
               "--config", str(config), "--steps", "2", "--batch-size", "4", "--schedule", "cosine",
               "--validate-every-updates", "1", "--checkpoint-every-updates", "1", "--resume", "--json"])
    assert rc == 0
    again = json.loads(capsys.readouterr().out)
    assert again["resumed_from"] == 2 and again["updates"] == 2


def test_a_sampling_section_renders_samples_during_training(split_dir, tiny_model_dir, tmp_path, capsys):
    config = tmp_path / "rf.yaml"
    config.write_text(yaml.safe_dump({"training": {"cache_dir": str(tmp_path / "cache"), "lr": 1e-4},
                                      "sampling": {"num_inference_steps": 2, "every_validations": 1}}))
    out = tmp_path / "out"
    rc = main(["train", "--data", str(split_dir), "--model", str(tiny_model_dir), "--out", str(out),
               "--config", str(config), "--steps", "2", "--batch-size", "4", "--validate-every-updates", "1"])
    assert rc == 0, capsys.readouterr().err
    index = json.loads((out / "samples" / "index.json").read_text())
    assert [e["update"] for e in index["samples"]] == [0, 1, 2]
    assert all((out / "samples" / e["grid"]).is_file() for e in index["samples"])


@pytest.mark.parametrize("flags, words", [
    (["--schedule", "linear-ramp", "--lr-min", "1e-3", "--lr-max", "1e-5", "--epochs", "1"], "lr_max"),
    (["--schedule", "zigzag", "--epochs", "1"], "schedule"),
    (["--batch-size", "0", "--epochs", "1"], "batch_size"),
    ([], "budget"),
])
def test_bad_settings_exit_2_with_one_line(flags, words, split_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["train", "--data", str(split_dir), "--out", str(out), *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and words in err
    assert not out.exists()


def test_an_adamw_lr_beside_prodigy_is_a_warning(split_dir, tmp_path, capsys):
    """`train --optimizer prodigy --lr 1e-4` trained at a ten-thousandth of Prodigy's step size without a word (no
    budget here: the warning comes before the run would start)."""
    rc = main(["train", "--data", str(split_dir), "--out", str(tmp_path / "out"), "--optimizer", "prodigy",
               "--lr", "1e-4"])
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "budget" in error
    assert warning.startswith("rangefinder: warning: training.lr: 0.0001 beside the LR-free optimizer prodigy "
                              "multiplies the step size it estimates")


def test_a_resolution_that_enlarges_the_splits_images_is_a_warning(shapes_dataset_dir, tmp_path, capsys):
    """A split made at 32 px keeps 16 px images; `train --resolution 512` on it enlarged them 16x without a word
    (`split` at 512 px skips them). No budget: the warning comes before the run would start."""
    split_dir = tmp_path / "split"
    assert main(["split", str(shapes_dataset_dir), "--out", str(split_dir), "--resolution", "32"]) == 0
    capsys.readouterr()
    rc = main(["train", "--data", str(split_dir), "--out", str(tmp_path / "out"), "--resolution", "512"])
    warning, error = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "budget" in error
    assert warning == (f"rangefinder: warning: 20 of the 20 images of split {split_dir} are under 256 px on their "
                       "short side (data.min_image_size, half of data.resolution 512), down to 32 px: they are "
                       "enlarged up to 16x; train at --resolution 32 (the split's), or split again with --resolution "
                       "512 to leave them out")
    rc = main(["train", "--data", str(split_dir), "--out", str(tmp_path / "out"), "--resolution", "32"])
    assert rc == 2 and "warning" not in capsys.readouterr().err


@pytest.mark.slow
def test_processes_per_node_trains_on_that_many_processes_as_the_pipeline_does(mixed_aspect_dataset_dir, tiny_sd3_dir,
                                                                               tmp_path, capfd, monkeypatch):
    """Issue 37: `training.processes_per_node: 2` starts 2 processes (torchrun, gloo on CPU), as the pipeline's
    training steps do; at the same global batch of 4 the curve is one process's (on SD through the steps' launcher:
    tests/steps/test_processes.py). On the tiny SD3 with LoRA over aspect-ratio buckets (the mixed set at 32 px:
    24x40, 32x32 and 40x24), the two-process run also carries the bucketed stream's split (chunks of 2 x 2 images,
    one bucket each; the buckets of 5 and 3 images end their epoch with chunks that leave a rank one image or none),
    the planner's count from the buckets, and the flow family's validation sharded over both ranks (once
    tests/training/test_bucketed_training.py's and test_flow_features.py's two-process runs, each a torchrun launch
    of its own)."""
    from rangefinder.config import TrainingConfig
    from rangefinder.data.buckets import BucketSettings, place
    from rangefinder.data.split import read_split
    from rangefinder.planning import plan_for

    split_dir = tmp_path / "split"
    assert main(["split", str(mixed_aspect_dataset_dir), "--out", str(split_dir), "--resolution", "32"]) == 0
    capfd.readouterr()
    train_buckets = [place(it.size, BucketSettings(32, 8, 2.0)).bucket for it in read_split(split_dir).train]
    per_bucket = [train_buckets.count(b) for b in sorted(set(train_buckets))]
    assert per_bucket == [4, 5, 3]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    curves = {}
    for processes, batch in ((1, 4), (2, 2)):
        training = {"method": "lora", "batch_size": batch, "epochs": 1}
        config = tmp_path / f"rf-{processes}.yaml"
        config.write_text(yaml.safe_dump({"training": {"cache_dir": str(tmp_path / "cache"), "lr": 2e-4, "seed": 7,
                                                       "processes_per_node": processes, **training},
                                          "data": {"resolution": 32}}))
        out = tmp_path / f"out-{processes}"
        rc = main(["train", "--data", str(split_dir), "--model", str(tiny_sd3_dir), "--out", str(out),
                   "--config", str(config), "--validate-every-updates", "2", "--json"])
        captured = capfd.readouterr()
        assert rc == 0, captured.err[-3000:]
        result = json.loads(captured.out)  # stdout is the result only, whatever the processes print
        planned = plan_for(TrainingConfig(**training, world_size=processes), len(train_buckets), per_bucket)
        # 1 + 2 + 1 chunks of 4 images for buckets of 4, 5 and 3.
        assert result["status"] == "ok" and result["updates"] == planned.total_updates == 4
        summary = json.loads((out / "run_summary.json").read_text())
        assert (summary["plan"]["world_size"], summary["plan"]["effective_batch"]) == (processes, 4)
        assert summary["family"] == "sd3"
        with open(out / "updates.csv", newline="") as f:
            assert len(list(csv.DictReader(f))) == 4
        with open(out / "metrics.csv", newline="") as f:
            curves[processes] = list(csv.DictReader(f))
    one, two = ([float(r["val_loss"]) for r in curves[p]] for p in (1, 2))
    assert len(one) == len(two) == 3 and one[1:] != one[:-1]  # the curve moves
    assert two == pytest.approx(one, rel=1e-4)
    assert [float(r["epoch"]) for r in curves[2]][::2] == [0.0, 1.0]
    # The baseline is the base model, each rank scoring half of every bucket's (item, sigma) pairs: one process's
    # baseline, the same columns, its numbers up to the last bits (the shard edges cut the forward batches).
    assert curves[2][0].keys() == curves[1][0].keys()
    for column, value in curves[1][0].items():
        if value == "":
            assert curves[2][0][column] == "", column
        else:
            assert float(curves[2][0][column]) == pytest.approx(float(value), rel=1e-6), column
    assert summary["validation_pairs_by_rank"][0] > 0 and summary["validation_pairs_by_rank"][1] > 0  # sharded


def test_the_plans_warnings_and_cancelling_settings_are_printed(split_dir, tiny_model_dir, tmp_path, capsys):
    # Issue 36, class 3: 16 training images at batch 4 x grad_accum 5 = 20 per update; the planner's warning was only
    # in run_summary.json. validation.every_epochs beside every_updates: one line saying which is not used.
    config = tmp_path / "rf.yaml"
    config.write_text(yaml.safe_dump({"training": {"cache_dir": str(tmp_path / "cache"), "lr": 1e-4},
                                      "validation": {"every_epochs": 2, "every_updates": 1}}))
    rc = main(["train", "--data", str(split_dir), "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"),
               "--config", str(config), "--steps", "1", "--batch-size", "4", "--grad-accum", "5", "--json"])
    err = capsys.readouterr().err
    assert rc == 0, err
    warnings = [ln for ln in err.splitlines() if ln.startswith("rangefinder: warning: ")]
    assert any("effective batch 20 is larger than the 16 training images" in w for w in warnings), err
    assert any("validation.every_epochs (2) is not used" in w for w in warnings), err


def test_a_copied_summary_s_training_resume_does_not_go_on_in_a_folder_holding_a_run(split_dir, tmp_path, capsys):
    """A pipeline step's run_summary.json holds training.resume: true, which the step sets so that a retried pod goes
    on from its checkpoint. Its `training` section copied into a config for `rangefinder train` into a folder that
    held a run went on without --resume or its check: from the run's checkpoint, or, with none left, from update 0
    over the run's final/ and summary. `train` resumes with --resume only, and names the copy's as not used."""
    out = tmp_path / "out"
    (out / "final").mkdir(parents=True)
    earlier = '{"status": "ok", "updates": 4}'
    (out / "run_summary.json").write_text(earlier)
    config = tmp_path / "copy.yaml"
    config.write_text(yaml.safe_dump({"training": {"resume": True, "epochs": 1}}))
    rc = main(["train", "--data", str(split_dir), "--out", str(out), "--config", str(config)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 2, err
    assert err[0] == ("rangefinder: warning: ignored by `rangefinder train`: training.resume (`rangefinder train` "
                      "resumes with --resume only, which checks the output folder holds a run to resume)"), err
    assert err[1] == (f"rangefinder train: error: output folder {out} already holds a run; pass --resume "
                      "(training.resume) to continue it, or choose an empty folder"), err
    assert (out / "run_summary.json").read_text() == earlier and not (out / "metrics.csv").exists()


@pytest.mark.parametrize("holds", ["nothing", "a lock file", "an updates.csv"])
def test_resume_on_a_folder_that_holds_no_run_is_refused(holds, split_dir, tmp_path, capsys):
    """--resume on a folder with no checkpoint (empty, only a lock file left by a probe, a run stopped before its
    first checkpoint) says so instead of starting a new run from update 0."""
    out = tmp_path / "out"
    out.mkdir()
    if holds == "a lock file":
        (out / ".rangefinder.lock").write_text("{}")
    elif holds == "an updates.csv":
        (out / "updates.csv").write_text("update,epoch,lr,train_loss,grad_norm\n")
    rc = main(["train", "--data", str(split_dir), "--out", str(out), "--steps", "1", "--resume"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"--resume: {out} holds no run to resume" in err and "leave out --resume" in err, err
    assert not (out / "checkpoints").exists() and not (out / "metrics.csv").exists()


@pytest.mark.slow
def test_ctrl_c_says_interrupted_and_names_the_command_that_goes_on(split_dir, tiny_model_dir, tmp_path, capsys):
    """SIGINT (Ctrl-C) after the first checkpoint: one line, "interrupted", and the same command with --resume. The
    final/ it never wrote, given to `sample` or `register`, names the run's newest checkpoint instead."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    args = ["train", "--data", str(split_dir), "--model", str(tiny_model_dir), "--out", str(out), "--steps", "400",
            "--batch-size", "4", "--validate-every-epochs", "0", "--checkpoint-every-updates", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Ctrl-C reaches a command in the terminal's foreground, whose SIGINT is at its default. A suite started in the
    # background (`make test &`, nohup, a CI step without job control) runs with SIGINT ignored, every process it
    # starts inherits that, and Python then leaves it ignored: the run went on to its end. So the child starts with
    # SIGINT at its default, as a person's command does.
    proc = subprocess.Popen([sys.executable, "-m", "rangefinder.cli.main", *args], stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "checkpoint-000001").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    line = err[err.index("rangefinder train: interrupted"):].splitlines()[0]
    assert line.endswith("go on from the newest checkpoint with: rangefinder " + " ".join(args) + " --resume"), line

    # Both said only "final does not exist" (sample) or "is not a folder" (register).
    from rangefinder.formats.checkpoints import latest_checkpoint

    newest = latest_checkpoint(out / "checkpoints")
    for command in (["sample", "--model", str(tiny_model_dir), "--checkpoints", str(out / "final"), "--out",
                     str(tmp_path / "grid")],
                    ["register", str(out / "final"), "--config", str(tmp_path / "none.yaml"), "--lr", "1e-4",
                     "--epochs", "1"]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"rangefinder {command[0]}: error: {out / 'final'} does not exist: the run in {out} stopped "
                       f"before it wrote final/ (killed, or still training); pass its newest checkpoint, {newest}, or "
                       f"resume the run (`rangefinder train --resume` with --out {out})"), err
    assert not (tmp_path / "grid").exists()


def test_train_prints_no_line_about_torchvision_and_every_other_warning(split_dir, tiny_model_dir, tmp_path):
    """transformers said on every run that CLIPImageProcessor and SiglipImageProcessor need torchvision (which
    rangefinder never installs) and fall back to PIL, as diffusers' pipeline modules import them: two lines of noise
    under the run's own warnings. They are gone; the run's warning stays, and so does any other line of the logger
    they came from. In a process of its own: transformers says it once per process."""
    import logging
    import subprocess
    import sys

    args = ["train", "--data", str(split_dir), "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"),
            "--steps", "1", "--validate-every-epochs", "0"]
    proc = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", *args], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torchvision" not in proc.stderr, proc.stderr[-2000:]
    assert "rangefinder: warning: tiny dataset" in proc.stderr  # the run's own warning (the split's 9 images)
    source = logging.getLogger("transformers.utils.import_utils")
    other = source.makeRecord(source.name, logging.WARNING, __file__, 0, "`Foo` requires scipy", None, None)
    assert source.filter(other)


def _train_in_a_child(split_dir, model_dir, tmp_path, target) -> tuple[list[str], object, str]:
    """`rangefinder train` of 2 updates, validation off, its cache under tmp_path, run by `target(args)` in a process
    of its own (a fork of this one, its imports done, SIGINT at Python's default): (args, the child, its stderr)."""
    from tests.training.test_resume import ForkedChild

    config = tmp_path / "rf.yaml"
    config.write_text(yaml.safe_dump({"training": {"cache_dir": str(tmp_path / "cache")}}))
    args = ["train", "--data", str(split_dir), "--model", str(model_dir), "--out", str(tmp_path / "out"),
            "--config", str(config), "--steps", "2", "--batch-size", "4", "--validate-every-epochs", "0"]
    child = ForkedChild(tmp_path / "child", tmp_path / "child.out", tmp_path / "child.err", target=target,
                        args=(args,))
    _, err = child.communicate(timeout=300)
    return args, child, err


def _train_with_a_sigint_inside_its_first_cached_latent_read(argv: list[str]) -> None:
    """In the child: `rangefinder train`, given a real SIGINT inside safetensors' read of a cached latent by the loop
    (tests/training/test_caching.py)."""
    from rangefinder.training.caching import CachedLatentFiles
    from tests.training.test_caching import sigint_inside_the_next_cache_read

    sigint_inside_the_next_cache_read(inside=CachedLatentFiles.get.__code__)
    raise SystemExit(main(argv))


def test_ctrl_c_inside_a_read_of_the_latent_cache_says_interrupted(split_dir, tiny_model_dir, tmp_path):
    """A Ctrl-C that lands inside the loop's read of a cached latent (the cache warm: encoded before the loop) is a
    Ctrl-C: exit 130 and the "interrupted" line. torch turned it into its own ValueError there, and the run ended
    with exit 2 blaming the cache ("cache entry ... cannot be read any more; the cache was cleared or damaged"), or,
    in a pipeline step, with its MLflow run FAILED (tests/pipelines/test_local_run_errors.py)."""
    args, child, err = _train_in_a_child(split_dir, tiny_model_dir, tmp_path,
                                         _train_with_a_sigint_inside_its_first_cached_latent_read)
    assert child.returncode == 130 and "Traceback" not in err, err[-3000:]
    line = err[err.index("rangefinder train: interrupted"):].splitlines()[0]
    assert line == ("rangefinder train: interrupted; no checkpoint was written yet, so run it again to start over: "
                    f"rangefinder {' '.join(args)}"), line
    assert list((tmp_path / "cache").rglob("*.safetensors"))  # the loop read a warm cache


def _train_with_a_sigterm_while_it_encodes(argv: list[str]) -> None:
    """In the child: `rangefinder train`, sent SIGTERM (`kill PID`) as it starts encoding its images, before the
    training loop (whose own rule is a checkpoint, then Preempted)."""
    import os
    import signal

    from rangefinder.training import loop

    encode = loop.encode_data

    def sigterm_then_encode(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return encode(*args, **kwargs)

    loop.encode_data = sigterm_then_encode
    raise SystemExit(main(argv))


def test_a_sigterm_before_training_is_one_line_and_exit_143(split_dir, tiny_model_dir, tmp_path):
    """SIGTERM while the run loads and encodes (a laptop's session ending, `kill`, a CI job cancelled): one line
    saying so and what to run, exit 143 (128 + SIGTERM), as for SIGTERM in the loop. The process died without a word."""
    args, child, err = _train_in_a_child(split_dir, tiny_model_dir, tmp_path, _train_with_a_sigterm_while_it_encodes)
    assert child.returncode == 128 + 15 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "rangefinder train: stopped by SIGTERM; no checkpoint was written yet, so run it again to start over: "
        f"rangefinder {' '.join(args)}"), err[-3000:]
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.safetensors"))


STEPS = 24  # of a 2-process run below: 6 epochs of 16 images at a global batch of 4, a checkpoint every 3


def _two_ranks_args(split_dir, tiny_model_dir, tmp_path):
    """`rangefinder train` on 2 processes (STEPS updates, a checkpoint every 3): (its arguments, its environment,
    its output folder)."""
    import os

    config = tmp_path / "rf.yaml"
    config.write_text(yaml.safe_dump({"training": {"cache_dir": str(tmp_path / "cache"), "processes_per_node": 2}}))
    out = tmp_path / "out"
    args = ["train", "--data", str(split_dir), "--model", str(tiny_model_dir), "--out", str(out), "--config",
            str(config), "--steps", str(STEPS), "--batch-size", "2", "--validate-every-epochs", "0",
            "--checkpoint-every-updates", "3"]
    return args, {**os.environ, "OMP_NUM_THREADS": "1"}, out


def _train_command(argv: list[str]) -> None:
    """In the child: `rangefinder train ARGV`, exiting with its status."""
    raise SystemExit(main(argv))


def _start_the_command(args, out):
    """`rangefinder train ARGS` in a process of its own: a fork of this one (its imports done; one torch thread, its
    own stderr; `ForkedChild`), which launches torchrun and its ranks as the command does. The command's own start
    is not what these tests are about: a fresh interpreter spent ~2 s of each launch on it."""
    from tests.training.test_resume import ForkedChild

    n = len(list(out.parent.glob("command-*.err")))
    return ForkedChild(out.parent / f"command-{n}", out.parent / f"command-{n}.out", out.parent / f"command-{n}.err",
                       target=_train_command, args=(args,))


def _run_to_a_checkpoint_past(args, env, out, after: int):
    """`rangefinder train ARGS` started and run until a checkpoint past update `after` is in `out`: the process."""
    import time

    from rangefinder.formats import checkpoints

    assert env["OMP_NUM_THREADS"] == "1"  # what the fork sets: one torch thread in the command, as its ranks have
    proc = _start_the_command(args, out)
    deadline = time.monotonic() + 300
    while not [c for c in checkpoints.list_checkpoints(out / "checkpoints")
               if (checkpoints.checkpoint_update(c) or 0) > after]:
        if proc.poll() is not None or time.monotonic() >= deadline:
            proc.kill()
            raise AssertionError(proc.communicate(timeout=60))
        time.sleep(0.05)
    return proc


def _kill_the_launcher(proc, killed: str, out) -> int:
    """SIGKILL to the command `proc` or to its torchrun: all 3 processes it launched end, each rank saying it was
    stopped by SIGTERM, at one whole checkpoint holding both ranks' RNG; the update it stopped at."""
    import psutil

    from rangefinder.formats import checkpoints

    launched: list[psutil.Process] = []
    try:
        torchrun = psutil.Process(proc.pid).children()[0]
        launched = [torchrun, *torchrun.children()]
        assert len(launched) == 3, launched
        (torchrun if killed == "torchrun" else psutil.Process(proc.pid)).kill()
        _, alive = psutil.wait_procs(launched, timeout=120)
        assert not alive, f"still training after their launcher ({killed}) died: {alive}"
    finally:
        for p in [psutil.Process(proc.pid), *launched]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        _, err = proc.communicate(timeout=60)
    assert err.count("error: Preempted: stopped by SIGTERM at update ") == 2, err[-3000:]  # each rank's line
    newest = checkpoints.list_checkpoints(out / "checkpoints")[-1]
    assert checkpoints.verify(newest) is None and (newest / "rng-1.pt").is_file()
    stopped = checkpoints.checkpoint_update(newest)
    assert stopped is not None and stopped < STEPS
    return stopped


@pytest.mark.slow
def test_a_launcher_killed_with_sigkill_stops_its_ranks_at_a_checkpoint(split_dir, tiny_model_dir, tmp_path):
    """`rangefinder train` on 2 processes, then SIGKILL to the command (a step killed without a SIGTERM), and in its
    resume SIGKILL to its torchrun (the OOM killer's pick). The ranks, in sessions of their own, once trained on as
    orphans holding the folder's lock: a resume was refused as "in use by another training run" until they had run
    to the end. Now they get SIGTERM when their launcher dies: they write a checkpoint together and stop, and
    --resume goes on."""
    args, env, out = _two_ranks_args(split_dir, tiny_model_dir, tmp_path)
    first = _kill_the_launcher(_run_to_a_checkpoint_past(args, env, out, 0), "command", out)
    # The folder is free: the resume goes on from there (a resume refused, or stopped, fails in the wait).
    second = _kill_the_launcher(_run_to_a_checkpoint_past([*args, "--resume"], env, out, first), "torchrun", out)
    assert second > first

    # The folder is free again and the run goes on from the checkpoint the second SIGTERM wrote, to its end.
    resumed = _start_the_command([*args, "--resume", "--json"], out)
    stdout, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-2000:]
    result = json.loads(stdout)
    assert (result["status"], result["resumed_from"], result["updates"]) == ("ok", second, STEPS)


@pytest.mark.slow
def test_a_rank_killed_with_sigkill_ends_the_run_with_one_line_naming_torchruns_status(split_dir, tiny_model_dir,
                                                                                        tmp_path):
    """SIGKILL to rank 1 of a 2-process `rangefinder train` (the OOM killer): torchrun stops rank 0, and the command
    exits 2 within a bounded time with one line naming the failure and how to go on (it named a missing file in the
    hidden job folder, `.out.launch/launch-result.json`, and the line meant for this case was never reached)."""
    import psutil

    from rangefinder.formats import checkpoints

    args, env, out = _two_ranks_args(split_dir, tiny_model_dir, tmp_path)
    proc = _run_to_a_checkpoint_past(args, env, out, 0)
    launched: list[psutil.Process] = []
    try:
        launched = psutil.Process(proc.pid).children(recursive=True)
        next(c for c in launched if c.environ().get("RANK") == "1").kill()
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()  # nothing, when it has ended
        for p in launched:
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert proc.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == ("rangefinder train: error: the 2 training processes failed (torchrun exit status 1); the log above "
                    "says why. Run the step again: it resumes from the newest whole checkpoint"), err[-3000:]
    assert checkpoints.verify(checkpoints.list_checkpoints(out / "checkpoints")[-1]) is None


def test_a_config_copied_from_a_run_trains_the_base_model_it_names(split_dir, tiny_model_dir, tiny_sdxl_dir, tmp_path,
                                                                   capsys):
    """A run's config.yaml (tracking.runs.config_text, as MLflow keeps it) holds the folder that run's base model
    resolved to (model.resolved_dir). Copied and given an SDXL model, `train` loaded that SD 1.x folder all the same,
    whatever model.base_model (or --model) said; the folder is named as ignored, and the model named is trained."""
    from rangefinder.config import demo_config
    from rangefinder.steps.resolve_config import with_resolved_base_model
    from rangefinder.tracking.runs import config_text

    earlier, _ = with_resolved_base_model(demo_config(model={"base_model": str(tiny_model_dir)}))
    copied = yaml.safe_load(config_text(earlier))
    assert copied["model"]["resolved_dir"] == str(tiny_model_dir)
    assert copied["model"]["resolved_revision"].startswith("weights:")
    copied["model"]["base_model"] = str(tiny_sdxl_dir)  # the user's one change (and a cache of the test's own)
    copied["training"]["cache_dir"] = str(tmp_path / "cache")
    config = tmp_path / "copied.yaml"
    config.write_text(yaml.safe_dump(copied))
    out = tmp_path / "out"
    rc = main(["train", "--data", str(split_dir), "--out", str(out), "--config", str(config), "--steps", "1",
               "--validate-every-epochs", "0", "--json"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert json.loads((out / "run_summary.json").read_text())["family"] == "sdxl"
    # A folder resolves to its weights' fingerprint (models/fingerprint.py): both are what an earlier run resolved.
    assert "model.resolved_dir, model.resolved_revision (each run resolves model.base_model afresh" in err


def test_a_prodigy_runs_config_switched_to_adamw_is_refused_at_lr_1(split_dir, tmp_path, capsys):
    """A Prodigy run's config.yaml holds training.lr: 1.0 (an LR-free optimizer's unset lr reads as its multiplier):
    copied, switched to AdamW and trained, it trained at lr 1 without a word. One line naming the fix; nothing
    trains."""
    from rangefinder.config import demo_config
    from rangefinder.tracking.runs import config_text

    prodigy_run = demo_config(training={"optimizer": "prodigy", "lr": None},
                              lr_range_test={"lr_min": None, "lr_max": None})
    copied = yaml.safe_load(config_text(prodigy_run))
    assert copied["training"]["lr"] == 1.0
    copied["training"]["optimizer"] = "adamw"  # the user's one change
    config = tmp_path / "copied.yaml"
    config.write_text(yaml.safe_dump(copied))
    out = tmp_path / "out"
    rc = main(["train", "--data", str(split_dir), "--out", str(out), "--config", str(config), "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "rangefinder train: error: training.lr is 1 with optimizer adamw: 1 is an LR-free optimizer's multiplier")
    assert not out.exists()
    # Given the LR to train at, it trains.
    rc = main(["train", "--data", str(split_dir), "--out", str(out), "--config", str(config), "--steps", "1",
               "--lr", "1e-4", "--validate-every-epochs", "0"])
    assert rc == 0, capsys.readouterr().err


def test_every_flag_reaches_its_setting(split_dir, tiny_model_dir, tmp_path):
    """The flags win over the file, each on its own setting (read as `train` reads them, before anything loads): a
    flag dropped or wired to another setting trained with the file's value (or the default) without a word."""
    from rangefinder.cli.commands.train import settings_from_args
    from rangefinder.cli.main import build_parser

    config = tmp_path / "rf.yaml"
    config.write_text(yaml.safe_dump({"training": {"steps": 50, "seed": 1, "lr_min": 1e-6, "lr_max": 1e-1},
                                      "validation": {"every_updates": 9}}))
    args = build_parser().parse_args([
        "train", "--data", str(split_dir), "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"),
        "--config", str(config), "--epochs", "3", "--schedule", "linear-ramp", "--lr-min", "1e-5", "--lr-max",
        "1e-3", "--batch-size", "2", "--grad-accum", "3", "--seed", "7", "--checkpoint-every-updates", "4",
        "--validate-every-epochs", "0.5", "--train-on", "train+val"])
    cfg, spec = settings_from_args(args)
    t = spec.training
    assert (t.epochs, t.steps, t.schedule, t.lr_min, t.lr_max) == (3, None, "linear-ramp", 1e-5, 1e-3)
    assert (t.batch_size, t.grad_accum, t.seed, t.checkpoint_every_updates) == (2, 3, 7, 4)
    # Validation every half epoch replaces the file's every 9 updates rather than both counting.
    assert (spec.validation.every_epochs, spec.validation.every_updates) == (0.5, None)
    assert spec.train_on == "train+val" and str(spec.split_dir) == str(split_dir)
    assert cfg.model.base_model == str(tiny_model_dir)
