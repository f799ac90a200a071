"""What `rangefinder run --local` shows when a step fails or MLflow is away (issue 16): the step's own error on the
terminal, secrets nowhere in the terminal or pipeline.log, and what MLflow did not take listed in the result."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rangefinder.pipelines.local_run import LocalRun, failure_summary
from tests.mlflow_store import seed
from tests.pipelines.tiny_run import TINY, tiny_config
from tests.tracking.fixtures import free_port, start_mlflow_server, stop_mlflow_server


def run_local(cfg: Path, out: Path, env: dict, monkeypatch: pytest.MonkeyPatch,
              capfd: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess:
    """`rangefinder run --local` in this process, with MLflow's variables only from `env`: its step processes are
    real and capfd reads the file descriptors they print to, so the terminal is read whole. The CLI as a process of
    its own: test_server_killed_mid_run_ends_with_the_first_failed_steps_own_error (one start-up fewer per test)."""
    from rangefinder.cli.main import main

    for name in [k for k in os.environ if k.startswith("MLFLOW_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capfd.readouterr()
    code = main(["run", "--local", "--config", str(cfg), "--out", str(out)])
    return subprocess.CompletedProcess([], code, *capfd.readouterr())


@pytest.mark.slow
def test_mlflow_down_shows_the_cause_on_the_terminal(tmp_path, monkeypatch, capfd):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("data:\n  resolution: 32\n")
    uri = f"http://127.0.0.1:{free_port()}"
    # The first step's server check fails at once (its retries' backoff slept ~1 s before the cause was shown).
    proc = run_local(cfg, tmp_path / "out", {"MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"},
                     monkeypatch, capfd)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    # Not a terminal: plain lines, a line per step as it starts and ends, then the cause.
    assert "rangefinder: resolve-config started\n" in proc.stderr
    assert re.search(r"^rangefinder: resolve-config failed after \d+\.\d s$", proc.stderr, re.M), proc.stderr
    assert "\r" not in proc.stderr
    assert error.startswith("rangefinder run: error: the local pipeline run stopped: step resolve-config failed: "
                            f"TrackingError: cannot reach the MLflow tracking server at {uri}"), error
    assert "connection refused" in error and f"full log: {tmp_path / 'out' / 'pipeline.log'}" in error


@pytest.mark.slow
def test_a_failed_step_is_one_error_recorded_with_the_secrets_out_of_the_terminal_and_pipeline_log(
        tmp_path, monkeypatch, capfd):
    """A step that fails (prepare-dataset, on a dataset folder that is not there) stops the run with one error
    naming it, and the exit handler still marks the pipeline's MLflow run FAILED. A secret's value that turns up in
    what kfp.local prints (here inside the dataset path, printed with the step's inputs and in its error) is redacted
    in pipeline.log and in the error shown."""
    import sqlite3

    secret = "rf-Secret-4417-pw"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"data:\n  resolution: 32\n  dataset_dir: {tmp_path / ('no-such-' + secret)}\n")
    out = tmp_path / "out"
    seed(out / "mlflow.db")  # the run's default store, migrated: its first step skips MLflow's migrations
    proc = run_local(cfg, out, {"MLFLOW_TRACKING_PASSWORD": secret}, monkeypatch, capfd)
    assert proc.returncode == 2, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert re.search(r"step prepare-dataset(-\d+)? failed: DataError: data.dataset_dir \S*/no-such-\*\*\* does not "
                     "exist", error), error
    log = (out / "pipeline.log").read_text()
    assert "no-such-***" in log and "Executing task" in log
    assert secret not in log and secret not in proc.stdout + proc.stderr
    with sqlite3.connect(out / "mlflow.db") as con:  # the local default store: no tracking URI was set
        parents = [status for name, status in con.execute("select name, status from runs")
                   if name.startswith("rangefinder-")]
    assert parents == ["FAILED"]


def test_the_result_names_what_mlflow_did_not_take_and_no_credentials(tmp_path):
    out = tmp_path / "out"
    (out / "mlflow-spool").mkdir(parents=True)
    spool = out / "mlflow-spool" / "finetune-abc.jsonl"
    spool.write_text('{"kind": "spool", "version": 1, "tracking_uri": "http://mlflow:5000", "run_id": "abc"}\n')
    run = LocalRun(out_dir=out, run_dir=out / "pipeline-root" / "x", tracking_uri="http://u:hunter2-pw@mlflow:5000")
    summary = run.summary()
    assert summary["mlflow"] == "http://mlflow:5000"
    assert summary["mlflow_not_logged"] == [f"{spool} (when MLflow answers: rangefinder relog {spool})"]
    assert "mlflow_not_logged" not in LocalRun(out_dir=tmp_path, run_dir=tmp_path, tracking_uri="x").summary()


@pytest.mark.slow
def test_server_killed_mid_run_ends_with_the_first_failed_steps_own_error(tmp_path, shapes_dataset_dir,
                                                                           tiny_model_dir):
    """Issue 37: a real `mlflow server` killed (SIGKILL) while the fine-tune trains. The fine-tune goes on and spools;
    then register-model, sample-images and record-status each fail in their server check. The terminal ends with the
    first failed step's own error (cause and fix), and the two later failures are counted, not repeated. As cheap
    as a whole run gets: a fixed LR (no range test), 2 fine-tune epochs, no samples during training, no wait for
    the server at the fine-tune's end."""
    cfg = tiny_config(shapes_dataset_dir, tiny_model_dir, lr=2e-4,
                      tracking={"server_wait_seconds": 0}, sampling={**TINY["sampling"], "every_validations": None})
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"kubernetes"})))
    out = tmp_path / "out"
    uri, server = start_mlflow_server(tmp_path / "server")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_TRACKING_URI"] = uri
    # MLflow's calls, and each step's server check, fail at once once the server is gone (HTTP_LIMITS' retries
    # slept ~2 s in the fine-tune and ~1 s in each failing step's check); the steps' handling is the same.
    env.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="1", MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="0")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "rangefinder.cli.main", "run", "--local", "--config",
                                 str(config), "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)
        seen: list[str] = []
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            # The fine-tune's bar: its MLflow run is open and it trains. Kill the server as a lost node would.
            if line.startswith("rangefinder:   train") and server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=10)
        proc.wait(timeout=60)
    finally:
        stop_mlflow_server(server)
    terminal = "".join(seen)
    assert server.returncode == -signal.SIGKILL, f"the server was never killed:\n{terminal}"
    assert proc.returncode == 2 and "Traceback" not in terminal, terminal
    assert re.search(r"^rangefinder: finetune done in ", terminal, re.M), terminal  # it trained on without MLflow
    # kfp.local runs the two steps after the fine-tune in its own order, then the exit handler.
    failed = re.findall(r"^rangefinder: (\S+) failed after ", terminal, re.M)
    assert sorted(failed) == ["record-status", "register-model", "sample-images"] and failed[-1] == "record-status"
    first, *later = failed
    error = terminal.strip().splitlines()[-1]
    assert error.startswith(f"rangefinder run: error: the local pipeline run stopped: step {first} failed: "
                            f"TrackingError: cannot reach the MLflow tracking server at {uri} (connection refused); "
                            "check MLFLOW_TRACKING_URI"), error  # the cause and the fix
    assert f"; 2 later steps failed too: {', '.join(later)} (full log: {out / 'pipeline.log'}" in error, error
    assert error.count("cannot reach") == 1, error


def _task(name: str, lines: list[str], status: str = "FAILURE") -> str:
    """One task's part of a kfp.local log, as it prints it (colours included)."""
    body = "".join(f"    {line}\n" for line in lines)
    return (f"12:00:00.000 - INFO - Executing task \x1b[96m'{name}'\x1b[0m\n{body}"
            f"12:00:01.000 - ERROR - Task \x1b[96m'{name}'\x1b[0m finished with status \x1b[91m{status}\x1b[0m\n")


def test_a_later_failure_with_another_cause_keeps_its_own_error():
    gone = "TrackingError: cannot reach the MLflow tracking server at http://127.0.0.1:5000 (connection refused)"
    log = (_task("finetune-2", ["training"], "SUCCESS")
           + _task("register-model-2-2", [f"rangefinder step register-model: error: {gone}"])
           + _task("sample-images-2-2", [f"rangefinder step sample-images: error: {gone}"])
           + _task("record-status", ["rangefinder step record-status: error: DataError: disk full"]))
    # kfp.local's exception named another task, by its outer name: the log decides.
    assert failure_summary(log, "sample-images-2") == (
        f"step register-model failed: {gone}; 2 later steps failed too: sample-images, record-status "
        "(DataError: disk full)")
    assert failure_summary(_task("prepare-dataset-2", ["ValueError: bad"]), "x") == (
        "step prepare-dataset failed: ValueError: bad")
    assert failure_summary("", "choose-lr-3-2") == "step choose-lr failed"
    # A traceback's exception goes on below its line: what it goes on to say is the cause too.
    oom = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
           "torch.OutOfMemoryError: CUDA out of memory.", "Tried to allocate 2.00 GiB"]
    assert failure_summary(_task("finetune-2", oom), "x") == (
        "step finetune failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_step_s_error_after_its_progress_bar_is_the_error_alone():
    """A step that fails while it trains prints its one line where the bar stands (the bar's line ends in a carriage
    return, so the log holds both on one line), and the bar's last state follows when the bar is collected. The cause
    is the error line's text alone: it was the last three lines, bars and error run together."""
    bar = "train (constant):  46%|####6     | 11/24 [00:01<00:01,  7.11update/s, loss=0.3433, lr=0.000159]"
    error = "RangefinderError: cannot write checkpoint checkpoint-000012 under /out/checkpoints: disk full"
    lines = [bar.replace("11/24", "9/24"), f"{bar}rangefinder step finetune: error: {error}",
             bar.replace("11/24", "12/24")]
    assert failure_summary(_task("finetune-2", lines), "x") == f"step finetune failed: {error}"


def test_the_summary_says_the_retrain_s_own_epochs(tmp_path):
    """retrained_epochs is what retrain-full trained (retrain.epochs, when set, over the fine-tune's recommendation),
    beside the fine-tune's recommended_epochs: not the recommendation again."""
    run = LocalRun(out_dir=tmp_path, run_dir=tmp_path, tracking_uri="x", outputs={
        "finetune-2": {"recommended_epochs": 33, "lr_used": 3e-4}, "retrain-full-2": {"epochs": 50}})
    summary = run.summary()
    assert (summary["recommended_epochs"], summary["retrained_epochs"], summary["lr_used"]) == (33, 50, 3e-4)


def _stop_while_the_finetune_trains(tmp_path: Path, dataset: Path, model: Path, stop: str):
    """`rangefinder run --local` (a fixed LR, no range test, 30 fine-tune epochs) stopped once the fine-tune's bar
    shows (its MLflow run is open): `ctrl-c` (SIGINT to its process group, as a terminal sends it), `sigterm` (to the
    command alone, as `kill PID` does) or `sigkill` (to every process of it, as a machine losing power). (the process,
    what it printed, its config file, its --out)."""
    cfg = tiny_config(dataset, model, lr=2e-4, finetune={"epochs": 30},
                      sampling={**TINY["sampling"], "every_validations": None})
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"kubernetes"})))
    out = tmp_path / "out"
    seed(out / "mlflow.db")  # the run's default store, migrated: its first step skips MLflow's migrations
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    # Its own process group, SIGINT at its default: as a command in a terminal's foreground (tests/cli/test_train.py).
    proc = subprocess.Popen([sys.executable, "-m", "rangefinder.cli.main", "run", "--local", "--config", str(config),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("rangefinder:   train"):  # the fine-tune's first bar line: its run is open
                if stop == "sigterm":
                    proc.send_signal(signal.SIGTERM)
                else:
                    os.killpg(proc.pid, signal.SIGINT if stop == "ctrl-c" else signal.SIGKILL)
                break
        seen.append(proc.communicate(timeout=120)[1])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, "".join(seen), config, out


def _runs(out: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The local store's runs: {name: status}, and the parent's rangefinder.* tags."""
    import sqlite3

    with sqlite3.connect(out / "mlflow.db") as con:
        runs = dict(con.execute("select name, status from runs").fetchall())
        tags = dict(con.execute("select t.key, t.value from tags t join runs r on t.run_uuid = r.run_uuid where "
                                "r.name like 'rangefinder-finetune-%' and t.key like 'rangefinder.%'").fetchall())
    return runs, tags


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_ctrl_c_ends_the_pipelines_mlflow_run_killed(tmp_path, shapes_dataset_dir, tiny_model_dir, stop):
    """Ctrl-C (SIGINT to the terminal's process group) while the fine-tune trains: exit 130 with one "interrupted"
    line, and no MLflow run left RUNNING in the local sqlite store. The steps' own runs end KILLED by themselves; the
    pipeline's parent run is ended by the exit handler (record-status), which an interrupted kfp.local never runs,
    so it stayed RUNNING for good. The line says what running the command again does. SIGTERM to the command alone
    (`kill PID`, a supervisor's stop) does the same, saying SIGTERM, with exit 143: the command died without a word,
    its parent run stayed RUNNING and the fine-tune, training on into a closed pipe, ended FAILED."""
    proc, terminal, config, out = _stop_while_the_finetune_trains(tmp_path, shapes_dataset_dir, tiny_model_dir, stop)
    said = "interrupted" if stop == "ctrl-c" else "stopped by SIGTERM"
    assert proc.returncode == (130 if stop == "ctrl-c" else 143) and "Traceback" not in terminal, terminal
    # It says what a rerun does: a local run has no resume, so the same command starts over.
    assert terminal.strip().splitlines()[-1] == (
        f"rangefinder run: {said}; a local pipeline run does not resume, the same command starts it over: "
        f"rangefinder run --local --config {config} --out {out} (the steps' outputs so far are under "
        f"{out / 'pipeline-root'})"), terminal
    runs, tags = _runs(out)
    (parent,) = [name for name in runs if name.startswith("rangefinder-finetune-")]
    assert runs == {parent: "KILLED", "finetune": "KILLED"}, runs
    assert tags["rangefinder.final_state"] == "CANCELED"


@pytest.mark.slow
def test_the_runs_a_killed_local_run_left_running_are_ended_by_the_next_one(tmp_path, shapes_dataset_dir,
                                                                              tiny_model_dir, monkeypatch):
    """Every process of a local run SIGKILLed (a machine that lost power, the OOM killer taking the group) while the
    fine-tune trains: nothing could end its MLflow runs, and its parent and fine-tune stayed RUNNING for good. The
    next run in the same --out, holding the folder, ends them KILLED (saying why; how it ended is not known) before it
    starts."""
    from rangefinder.config import load_config
    from rangefinder.pipelines.local_run import ABANDONED, _end_abandoned_runs, local_tracking_uri

    proc, terminal, config, out = _stop_while_the_finetune_trains(tmp_path, shapes_dataset_dir, tiny_model_dir,
                                                                  "sigkill")
    assert proc.returncode == -signal.SIGKILL, terminal
    runs, _ = _runs(out)
    (parent,) = [name for name in runs if name.startswith("rangefinder-finetune-")]
    assert runs == {parent: "RUNNING", "finetune": "RUNNING"}, runs
    # What the next `run --local` does first, once it holds --out (run_pipeline_locally), on this folder's run folders,
    # in a command's environment: an experiment id an earlier test's mlflow.set_experiment left in this process's
    # environment ($MLFLOW_EXPERIMENT_ID, which wins) named another store's experiment, and nothing was ended.
    for name in [k for k in os.environ if k.startswith("MLFLOW_")]:
        monkeypatch.delenv(name)
    _end_abandoned_runs(local_tracking_uri(out), load_config(str(config)),
                        {p.name for p in (out / "pipeline-root").iterdir()})
    runs, tags = _runs(out)
    assert runs == {parent: "KILLED", "finetune": "KILLED"}, runs
    assert tags["rangefinder.final_state"] == "UNKNOWN" and tags["rangefinder.error"] == ABANDONED


def test_a_ctrl_c_ending_the_parent_run_waits_for_a_step_making_the_store(tmp_path, monkeypatch):
    """A Ctrl-C in a local run's first seconds, while its first step makes a new SQLite store (MLflow's migrations take
    seconds): the command's own look for the parent run to end opened the store as well, and ran the migrations
    beside the step's. It opens the store under the folder's lock the step holds while it makes it (held here)."""
    import fcntl
    import threading

    from rangefinder.config import demo_config
    from rangefinder.pipelines.local_run import _end_interrupted_parent, local_tracking_uri

    # The store in --out, as a local run's: a session fixture's step run in-process leaves $MLFLOW_TRACKING_URI set
    # to its own store for the rest of the worker, which local_tracking_uri takes first.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ended = threading.Event()

    def end() -> None:
        _end_interrupted_parent(local_tracking_uri(tmp_path), demo_config(), "rangefinder-finetune-1")
        ended.set()

    step = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(step, fcntl.LOCK_EX)
    thread = threading.Thread(target=end)
    thread.start()
    try:
        assert not ended.wait(0.5) and not (tmp_path / "mlflow.db").exists()
    finally:
        os.close(step)
    thread.join(60)
    assert ended.is_set()


def test_a_full_disk_outside_training_is_the_step_s_one_line_and_the_local_run_s(shapes_dataset_dir, tmp_path,
                                                                                monkeypatch, capsys):
    """prepare-dataset's split on a full disk (a tmpfs of one 4 KiB page: the split's first file fills it, the next
    write gets the real ENOSPC) ended in a traceback, and the local run said "step prepare-dataset failed: OSError:
    [Errno 28] No space left on device", naming neither the disk nor the fix. The component's function, in a local
    run's step environment, ends with the training steps' one line; the runner quotes it as it is. So does a training
    step's copy of its finished run into its artifact on that disk."""
    from kfp.dsl import Dataset, Markdown

    from rangefinder.config import demo_config
    from rangefinder.pipelines import kfp_components as c
    from rangefinder.pipelines.local_run import local_step_env

    task = tmp_path / "prepare-dataset"
    task.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(task)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN), which CI has")
    try:
        for name, value in local_step_env(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}").items():
            monkeypatch.setenv(name, value)
        cfg = demo_config(data={"dataset_dir": str(shapes_dataset_dir)})
        with pytest.raises(SystemExit) as stopped:
            c.prepare_dataset.python_func(config_json=cfg.model_dump_json(),
                                          split=Dataset(name="split", uri=str(task / "split")),
                                          report=Markdown(name="report", uri=str(task / "report")))
        assert not (task / "split" / "split.json").exists()  # no split that looks finished
        (line,) = capsys.readouterr().err.strip().splitlines()
        # A training step's finished run, copied from the work volume into its artifact (steps.workdir.publish), on
        # the same full disk: shutil.copytree's Error carries no errno of its own, and was a traceback.
        from kfp.dsl import Model

        from rangefinder.pipelines.component_support import step_errors
        from rangefinder.steps.workdir import publish

        work = tmp_path / "work" / "finetune"
        work.mkdir(parents=True)
        (work / "model.safetensors").write_bytes(b"\0" * 16384)
        with pytest.raises(SystemExit), step_errors("finetune", Model(name="model", uri=str(task / "model"))):
            publish(work, task / "model")
        (copied,) = capsys.readouterr().err.strip().splitlines()
    finally:
        subprocess.run(["umount", str(task)], check=True)
    assert stopped.value.code == 2
    assert copied.startswith(f"rangefinder step finetune: error: RangefinderError: cannot write the finetune step's "
                             f"outputs under {task}: disk full ("), copied
    said = (f"RangefinderError: cannot write the prepare-dataset step's outputs under {task}: disk full (0.00 GiB "
            f"free on {task}); free some space at {task} or choose another --out, then run the same command again (a "
            "local pipeline run starts over, in a new pipeline-root/ run folder)")
    assert line == f"rangefinder step prepare-dataset: error: {said}", line
    assert failure_summary(_task("prepare-dataset", [line]), "x") == f"step prepare-dataset failed: {said}"
    # Reading an input the step may not read is no write of its own: it is not said as one.
    with pytest.raises(PermissionError), step_errors("prepare-dataset", Dataset(name="split", uri=str(task / "split"))):
        raise PermissionError(13, "Permission denied", str(shapes_dataset_dir / "0.png"))
    # A full disk elsewhere (a cache, a converted model) is named where it is, not as the task's outputs.
    cache = tmp_path / "cache"
    with pytest.raises(SystemExit), step_errors("resolve-config", Markdown(name="report", uri=str(task / "report"))):
        raise OSError(28, "No space left on device", str(cache / "model.safetensors"))
    assert f"error: RangefinderError: cannot write the resolve-config step's file model.safetensors under {cache}: " \
           "disk full (" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["a cluster", "a user's own kfp.local run"])
def test_a_full_disk_in_a_step_on_a_cluster_names_no_command_option(where, tmp_path, monkeypatch, capsys):
    """A pod's step on a full volume was told to "choose another --out" and, with a checkpoint there, to "run again
    with --resume": a pipeline step has neither. Outside a local run (whose own words stand: the test above) a step
    says to give it a larger volume and retry the run, and so do the processes it launches (the environment, set
    only while the step runs). In a user's own kfp.local run of the components (its artifacts in a local folder) it
    said the same, of a volume there is none of and a retry that starts over: it names kfp.local's pipeline_root."""
    from kfp.dsl import Model

    from rangefinder.formats import checkpoints
    from rangefinder.pipelines.component_support import CLUSTER_WORDS, KFP_LOCAL_WORDS, step_errors
    from rangefinder.training.disk import AGAIN_ENV, ELSEWHERE_ENV, disk_problem

    for name in (AGAIN_ENV, ELSEWHERE_ENV):
        monkeypatch.delenv(name, raising=False)
    task = tmp_path / "finetune"
    run = task / "work"  # the training's run folder, a checkpoint in it: where `train` is told to pass --resume
    kept = run / checkpoints.RUN_DIR / checkpoints.checkpoint_name(4)
    kept.mkdir(parents=True)
    for name in checkpoints.REQUIRED:
        (kept / name).write_bytes(b"")
    # A cluster's artifact is remote (its path the launcher's mount of it); kfp.local's is the local folder.
    uri, words = (("minio://mlpipeline/v2/artifacts/rangefinder/abc/finetune/model", CLUSTER_WORDS)
                  if where == "a cluster" else (str(task / "model"), KFP_LOCAL_WORDS))
    with pytest.raises(SystemExit), step_errors("finetune", Model(name="model", uri=uri)):
        assert os.environ[AGAIN_ENV] == words[AGAIN_ENV]  # what a launched rank inherits
        raise disk_problem("the run's outputs", run, OSError(28, "No space left on device")) or AssertionError
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--out" not in line and "--resume" not in line and f"the previous checkpoint {kept} is intact" in line
    if where == "a cluster":
        assert line.endswith(" or give the step a larger volume, then retry the run (its training steps go on from "
                             "their newest checkpoint)"), line
    else:
        assert line.endswith(" or give kfp.local.init() another pipeline_root, then run the pipeline again "
                             "(kfp.local starts it over, in a new run folder)"), line
    assert AGAIN_ENV not in os.environ and ELSEWHERE_ENV not in os.environ


def test_a_full_disk_in_a_local_run_s_training_names_the_command_that_goes_on(tmp_path, monkeypatch):
    """A full disk at a fine-tune's checkpoint inside `run --local` (reproduced on a tmpfs of 24 MiB: checkpoint 8
    of the fine-tune, 4 intact) ended "then run again with --resume (another --out starts anew)": `run --local` takes
    no --resume, and the same command starts the pipeline over. In a local run's steps (its environment) the line
    names that command; `train`'s own keeps its --resume."""
    import errno

    from rangefinder.formats import checkpoints
    from rangefinder.pipelines.local_run import local_step_env
    from rangefinder.training.disk import disk_problem

    ckpts = tmp_path / "finetune-2" / "model" / "checkpoints"
    previous = ckpts / "checkpoint-000004"
    previous.mkdir(parents=True)
    for name in checkpoints.REQUIRED:
        (previous / name).write_text("{}")
    full = OSError(errno.ENOSPC, "No space left on device")
    assert str(disk_problem("checkpoint checkpoint-000008", ckpts, full)).endswith(
        "then run again with --resume (another --out starts anew)")
    for name, value in local_step_env(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}").items():
        monkeypatch.setenv(name, value)
    said = str(disk_problem("checkpoint checkpoint-000008", ckpts, full))
    assert f"the previous checkpoint {previous} is intact" in said and "--resume" not in said, said
    assert said.endswith(f"free some space at {ckpts} or choose another --out, then run the same command again (a "
                         "local pipeline run starts over, in a new pipeline-root/ run folder)"), said


def test_a_full_disk_under_kfp_s_own_write_of_a_step_s_outputs_is_the_local_run_s_one_line(tmp_path, monkeypatch):
    """kfp's executor writes a step's executor_output.json after the step's function has returned, outside the step's
    one-line errors (component_support.step_errors): on a full disk it ended in kfp's traceback, and the local run
    said "step finetune failed: OSError: [Errno 28] No space left on device", naming neither the disk nor the fix.
    The executor runs here as kfp.local runs it (kfp.dsl.executor_main), on a tmpfs its step's output filled."""
    import traceback

    from kfp.dsl import executor
    from kfp.dsl.types import artifact_types

    root = tmp_path / "pipeline-root"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(root)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN), which CI has")
    monkeypatch.setattr(artifact_types, "CONTAINER_TASK_ROOT", None)  # the executor sets it for its process
    task = root / "run" / "finetune-2"
    try:
        task.mkdir(parents=True)
        (task / "model").write_bytes(b"\0" * 4096)  # the step's output fills the disk

        def finetune() -> None:  # what the step's function did is done: only kfp's own write is left
            pass

        output = {"outputs": {"outputFile": str(task / "executor_output.json")}}
        with pytest.raises(OSError) as refused:
            executor.Executor(output, finetune).execute()
        lines = traceback.format_exception(refused.value)
        summary = failure_summary(_task("finetune-2", "".join(lines).splitlines()), "x", root)
    finally:
        subprocess.run(["umount", str(root)], check=True)
    assert refused.value.errno == errno.ENOSPC  # what kfp raises, and the run quoted as it was
    assert summary == (f"step finetune failed: RangefinderError: cannot write the finetune step's outputs under "
                       f"{root}: disk full (0.00 GiB free on {root}); free some space at {root} or choose another "
                       "--out, then run the same command again (a local pipeline run starts over, in a new "
                       "pipeline-root/ run folder)"), summary
    # Any other error of kfp's is quoted as it is.
    assert failure_summary(_task("finetune-2", ["OSError: [Errno 5] Input/output error"]), "x", root) == (
        "step finetune failed: OSError: [Errno 5] Input/output error")


def test_a_local_run_s_log_on_a_full_disk_is_one_line_not_a_logging_error_per_line(tmp_path, capsys):
    """pipeline.log on a full disk: kfp.local logs through Python's logging, which printed a "--- Logging error ---"
    traceback on the terminal for each line the log could not take, and a step's streamed line raised an OSError out
    of kfp.local mid-step. The log, written as a local run writes it (kfp.local's own logger, StepProgress, redact),
    drops what the disk refuses, and the run says so in one line."""
    import contextlib
    import logging

    from kfp.local import logging_utils

    from rangefinder.errors import RangefinderError
    from rangefinder.pipelines.local_run import RunLog
    from rangefinder.pipelines.progress import StepProgress
    from rangefinder.tracking.redaction import RedactingWriter

    out = tmp_path / "out"
    out.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(out)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN), which CI has")
    try:
        log = RunLog(out / "pipeline.log")
        with log, contextlib.redirect_stdout(RedactingWriter(StepProgress(log, sys.stderr))) as redacted, \
                logging_utils.local_logger_context():
            logging.info("Executing task 'finetune-2'")
            for _ in range(100):  # a step's streamed log, past the disk's one page
                print("    " + "x" * 100)
            logging.info("Task 'finetune-2' finished with status SUCCESS")
            redacted.flush()
        with pytest.raises(RangefinderError) as stopped:
            log.check(out, out / "pipeline-root", "stopped")
    finally:
        subprocess.run(["umount", str(out)], check=True)
    assert "Logging error" not in capsys.readouterr().err
    assert str(stopped.value) == (
        f"the local pipeline run stopped: cannot write the local run's log pipeline.log under {out}: disk full (0.00 "
        f"GiB free on {out}); free some space at {out} or choose another --out, then run the same command again (a "
        "local pipeline run starts over, in a new pipeline-root/ run folder) (the log holds what was written before; "
        f"artifacts so far under {out / 'pipeline-root'})"), stopped.value


def test_a_full_disk_under_the_reports_copy_names_the_reports_disk_not_the_source_s(tmp_path):
    """A local run's last write copies its reports into OUT/reports (_publish_reports, shutil.copyfile). On a full
    disk the copy's OSError names its source first and the file it wrote second, and the line named the source's
    file and the free space of the source's disk (the pipeline root, with room to spare). What the command says
    (cli.storage_problem) and what a step says (training.disk.disk_problem) name the disk the write went to; the
    local run says it ran to its end and where its reports are meanwhile, not only "cannot write OUT/reports"."""
    import shutil

    from rangefinder.cli.storage import storage_problem
    from rangefinder.errors import RangefinderError
    from rangefinder.pipelines.local_run import _publish_reports
    from rangefinder.training.disk import disk_problem

    source = tmp_path / "pipeline-root" / "run" / "finetune-2"
    source.mkdir(parents=True)
    (source / "report_md").write_bytes(os.urandom(8192))  # more than the disk's one page
    out = tmp_path / "out"
    out.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(out)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN), which CI has")
    try:
        run = LocalRun(out_dir=out, run_dir=source.parent, tracking_uri="sqlite:///unused.db",
                       artifacts={"finetune-2": {"report_md": str(source / "report_md")}})
        with pytest.raises(OSError) as refused:
            shutil.copyfile(source / "report_md", out / "reports.md")
        said = storage_problem(refused.value, str(out / "reports.md"))
        (out / "reports.md").unlink()
        with pytest.raises(RangefinderError) as published:
            _publish_reports(run)
        step_said = str(disk_problem("the reports", out, refused.value))
        left = sorted(p.name for p in out.iterdir())
    finally:
        subprocess.run(["umount", str(out)], check=True)
    assert left == [], left  # nothing half-copied
    assert said == (f"cannot write {out / 'reports.md'}: disk full (0.00 GiB free on {out}); free some space at {out} "
                    "or pass a path on another file system"), said
    assert f"disk full (0.00 GiB free on {out}); free some space at {out} or" in step_said, step_said
    # The local run's own last write: the pipeline ran to its end, and its reports are in the run's folder.
    assert str(published.value) == (
        f"the local pipeline run ran to its end, but cannot write the run's reports under {out / 'reports'}: disk full "
        f"(0.00 GiB free on {out}); free some space at {out} or choose another --out, then run the same command again; "
        f"meanwhile they are in the run's folder {source.parent}"), published.value
