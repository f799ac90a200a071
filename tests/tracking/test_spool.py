"""The spool of what MLflow did not take: bounded HTTP calls, whole lines on disk, and a replay that logs each record
once, against a real `mlflow server` on loopback (tests/tracking/test_server_loss.py kills one mid-training); and what
a step with child runs says of an outage, once for all its runs' spools."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rangefinder.config import RangefinderConfig
from rangefinder.errors import TrackingError
from rangefinder.tracking import step_run, tracking_client
from rangefinder.tracking.spool import AWAY_MARKER, PENDING, SPOOL_ENV, Spool, apply_record, read_spool, replay
from rangefinder.tracking.target import HTTP_LIMITS, bound_http_requests, ensure_tracking_server
from tests.tracking.fixtures import free_port, relay, sqlite_busy_timeout, start_mlflow_server, stop_mlflow_server


@pytest.fixture
def run_id(mlflow_server_uri):
    client = MlflowClient(tracking_uri=mlflow_server_uri)
    exp = client.get_experiment_by_name("spool") or client.get_experiment(client.create_experiment("spool"))
    return client.create_run(exp.experiment_id).info.run_id


def spool_of(tmp_path, uri: str, run_id: str) -> Spool:
    return Spool(tmp_path / "spool" / f"step-{run_id}.jsonl", tracking_uri=uri, run_id=run_id, step="step")


def test_steps_bound_mlflow_http_calls_and_keep_the_users_values(monkeypatch, sqlite_tracking_uri):
    for name in HTTP_LIMITS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "300")  # the user's own choice wins
    tracking_client(RangefinderConfig(tracking={"tracking_uri": sqlite_tracking_uri}))
    from mlflow.environment_variables import (
        MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR,
        MLFLOW_HTTP_REQUEST_MAX_RETRIES,
        MLFLOW_HTTP_REQUEST_TIMEOUT,
    )

    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 300
    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 2 and MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.get() == 1
    bound_http_requests()  # idempotent
    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 300


def test_a_dead_server_costs_a_logging_call_seconds(monkeypatch, mlflow_server_uri, run_id):
    """With the step's limits, one call to a server that is gone fails in seconds, not mlflow's ~4 minutes."""
    for name in HTTP_LIMITS:
        monkeypatch.delenv(name, raising=False)
    bound_http_requests()
    dead = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")
    start = time.monotonic()
    with pytest.raises(Exception, match="API request to"):
        dead.set_tag(run_id, "k", "v")
    assert time.monotonic() - start < 15


def test_records_survive_a_torn_line_and_replay_once(tmp_path, mlflow_server_uri, run_id):
    spool = spool_of(tmp_path, mlflow_server_uri, run_id)
    spool.append({"kind": "metrics", "run_id": run_id,
                  "metrics": [["loss", 0.5, 1000, 1], ["loss", math.nan, 1001, 2]]})
    spool.append({"kind": "params", "run_id": run_id, "params": {"training.lr": "0.0001"}})
    spool.append({"kind": "tags", "run_id": run_id, "tags": {"status": "ok"}})
    spool.append({"kind": "text", "run_id": run_id, "text": "hello", "artifact_file": "notes/hello.txt"})
    artifact = tmp_path / "report.md"
    artifact.write_text("# report\n")
    spool.append({"kind": "artifact", "run_id": run_id, "path": str(artifact), "artifact_path": "report"})
    curve = tmp_path / "metrics.csv"
    curve.write_text("update,val_loss\n0,1.0\n")
    spool.append({"kind": "artifact", "run_id": run_id, "path": str(curve), "artifact_path": "curves"})
    artifact.unlink()  # a pod's outputs are gone by relog time: the spool kept its own copy of each
    curve.unlink()
    with open(spool.path, "a") as f:
        f.write('{"kind": "metrics", "run_id": "')  # a write cut off (a full disk, a power loss)
    # A record appended after it (the step going on, once space was freed) was read as the torn line's tail, and
    # dropped with it.
    spool.append({"kind": "tags", "run_id": run_id, "tags": {"after": "torn"}})
    assert dict(spool.counts) == {"metrics": 2, "params": 1, "tags": 2, "text": 1, "artifact": 2}

    kept = read_spool(spool.path)
    assert kept.torn == 1 and kept.header["tracking_uri"] == mlflow_server_uri and len(kept.records) == 7
    result = replay(spool.path, MlflowClient(tracking_uri=mlflow_server_uri))
    assert result.torn == 1 and not result.left and sum(result.sent.values()) == 8
    assert not spool.path.exists() and not spool.files_dir.exists()

    client = MlflowClient(tracking_uri=mlflow_server_uri)
    history = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)
    assert history[0].value == 0.5 and math.isnan(history[1].value)
    run = client.get_run(run_id)
    assert run.data.params == {"training.lr": "0.0001"} and run.data.tags["status"] == "ok"
    assert run.data.tags["after"] == "torn"
    assert {a.path for a in client.list_artifacts(run_id, "report")} == {"report/report.md"}
    assert {a.path for a in client.list_artifacts(run_id, "curves")} == {"curves/metrics.csv"}
    assert client.download_artifacts(run_id, "notes/hello.txt", str(tmp_path)).endswith("hello.txt")


def test_replay_against_a_dead_server_keeps_everything_then_finishes(tmp_path, mlflow_server_uri, run_id):
    spool = spool_of(tmp_path, mlflow_server_uri, run_id)
    spool.append({"kind": "metrics", "run_id": run_id, "metrics": [["m", float(i), 1000 + i, i] for i in range(2500)]})
    spool.append({"kind": "end", "run_id": run_id, "status": "FINISHED"})
    dead = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")
    result = replay(spool.path, dead)
    assert not result.sent and dict(result.left) == {"metrics": 2500, "end": 1}
    assert read_spool(spool.path).counts() == result.left
    replay(spool.path, MlflowClient(tracking_uri=mlflow_server_uri))
    client = MlflowClient(tracking_uri=mlflow_server_uri)
    assert len(client.get_metric_history(run_id, "m")) == 2500  # every batch of 1000, once
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_record_mlflow_refuses_is_named_and_kept_with_the_rest(tmp_path, mlflow_server_uri, run_id):
    spool = spool_of(tmp_path, mlflow_server_uri, run_id)
    spool.append({"kind": "tags", "run_id": run_id, "tags": {"a": "1"}})
    spool.append({"kind": "tags", "run_id": "0" * 32, "tags": {"b": "2"}})  # no such run
    spool.append({"kind": "tags", "run_id": run_id, "tags": {"c": "3"}})
    with pytest.raises(TrackingError, match=f"refused a tags record of run {'0' * 32}"):
        replay(spool.path, MlflowClient(tracking_uri=mlflow_server_uri))
    left = read_spool(spool.path).records
    assert [r["tags"] for r in left] == [{"b": "2"}, {"c": "3"}]  # the first went, and is not sent twice


def test_a_param_logged_again_with_another_value_keeps_the_first_and_logs_the_rest(mlflow_server_uri, run_id, caplog):
    """A retried or replayed run logs its params again, some changed (the plan of a resumed run): MLflow refuses to
    change a param, so the first value stays, with a warning, and the new ones are logged; the step goes on."""
    from rangefinder.tracking.spool import apply_record

    client = MlflowClient(tracking_uri=mlflow_server_uri)
    apply_record(client, {"kind": "params", "run_id": run_id, "params": {"plan.lr": "0.0001"}})
    with caplog.at_level(logging.WARNING):
        apply_record(client, {"kind": "params", "run_id": run_id, "params": {"plan.lr": "0.0002", "plan.epochs": "3"}})
    assert client.get_run(run_id).data.params == {"plan.lr": "0.0001", "plan.epochs": "3"}
    assert any("plan.lr already logged as '0.0001'" in r.getMessage() for r in caplog.records)


def test_a_spool_s_key_over_mlflow_s_250_characters_is_cut_as_it_is_sent(sqlite_tracking_uri):
    """A spool written before keys were cut as a step logs them (a user's own step's metric or tag named by a
    prompt) holds one over MLflow's 250 characters: its replay failed on it, every record after it held back."""
    from rangefinder.tracking.spool import apply_record

    client = MlflowClient(tracking_uri=sqlite_tracking_uri)
    run_id = client.create_run(client.create_experiment("long-keys")).info.run_id
    per_prompt = "prompt_score." + "a red circle on a blue background " * 9
    apply_record(client, {"kind": "metrics", "run_id": run_id, "metrics": [[per_prompt + "colour", 0.8, 1, 0]]})
    apply_record(client, {"kind": "tags", "run_id": run_id, "tags": {per_prompt + "verdict": "kept"}})
    data = client.get_run(run_id).data
    cut = [k for k in (*data.metrics, *data.tags) if k.startswith("prompt_score.")]
    assert len(cut) == 2 and all(len(k) == 250 and "chars cut" in k for k in cut), cut


def test_relog_command_reports_a_spool_it_cannot_read(tmp_path):
    not_a_spool = tmp_path / "x.jsonl"
    not_a_spool.write_text('{"kind": "metrics"}\n')
    for arg in (str(not_a_spool), str(tmp_path / "missing.jsonl"), str(tmp_path / "empty-dir")):
        (tmp_path / "empty-dir").mkdir(exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "relog", arg], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "relog", str(not_a_spool),
                           "--tracking-uri", "http://u:hunter2-pw@127.0.0.1:1"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "MLFLOW_TRACKING_PASSWORD" in proc.stderr and "hunter2" not in proc.stderr


def test_a_step_whose_server_dies_waits_a_bounded_time_and_keeps_its_records(tmp_path, monkeypatch, caplog):
    """No training here (test_server_loss.py has it): the step's own calls after the server went away."""
    for name in HTTP_LIMITS:
        monkeypatch.delenv(name, raising=False)
    uri, proc = start_mlflow_server(tmp_path / "server")
    cfg = RangefinderConfig(tracking={"tracking_uri": uri, "experiment_name": "dies", "server_wait_seconds": 2})
    report = tmp_path / "report.html"
    report.write_text("<html></html>")
    caplog.set_level(logging.WARNING)
    try:
        with step_run(cfg, "sample_images", spool_dir=tmp_path / "spool") as run:
            run.log_metrics({"train_loss": 0.5}, step=1)
            stop_mlflow_server(proc)
            start = time.monotonic()
            run.log_artifact(report, "report")  # the first call to find the server gone: seconds
            run.log_image(_png(tmp_path), key="sample_grid")
            run.set_tags({"status": "ok"})
            assert run.offline and time.monotonic() - start < 15  # the later calls do not wait at all
    finally:
        stop_mlflow_server(proc)
    assert time.monotonic() - start < 15 + 2 + 10  # plus the bounded wait and its last probe
    (spool,) = (tmp_path / "spool").glob("*.jsonl")
    counts = read_spool(spool).counts()
    assert dict(counts) == {"artifact": 1, "image": 1, "tags": 1, "metrics": 1, "end": 1}
    assert any("rangefinder relog" in r.getMessage() and "1 metric value" in r.getMessage() for r in caplog.records)
    # One line when the spool starts, not one per record kept in it.
    assert sum("is not answering" in r.getMessage() for r in caplog.records) == 1


def _png(tmp_path):
    from PIL import Image

    path = tmp_path / "grid.png"
    Image.new("RGB", (8, 8), (255, 0, 0)).save(path)
    return path


def test_a_step_against_a_healthy_server_writes_no_spool(tmp_path, mlflow_server_uri):
    cfg = RangefinderConfig(tracking={"tracking_uri": mlflow_server_uri, "experiment_name": "healthy"})
    with step_run(cfg, "finetune", spool_dir=tmp_path / "spool") as run:
        run.log_metrics({"train_loss": 0.5}, step=1)
        run.log_decisions({"recommended_epochs": 3, "status": "ok"})
    assert not (tmp_path / "spool").exists()
    client = MlflowClient(tracking_uri=mlflow_server_uri)
    assert client.get_run(run.run_id).data.metrics == {"train_loss": 0.5, "recommended_epochs": 3.0}
    assert client.get_run(run.run_id).data.tags["status"] == "ok"


def test_a_replayed_record_may_only_name_files_the_spool_keeps(tmp_path, mlflow_server_uri, run_id):
    """relog uploads what a record names: a spool edited to name any other file (/etc/passwd) is refused."""
    (tmp_path / "x").write_text("not the spool's")
    for n, outside in enumerate(("/etc/passwd", "../../x")):  # each in a spool of its own: each refused
        spool = spool_of(tmp_path / str(n), mlflow_server_uri, run_id)
        spool.append({"kind": "tags", "run_id": run_id, "tags": {"a": "1"}})
        with open(spool.path, "a") as f:
            f.write(json.dumps({"kind": "artifact", "run_id": run_id, "path": outside, "artifact_path": "x"}) + "\n")
        with pytest.raises(TrackingError, match="outside the spool's folder"):
            replay(spool.path, MlflowClient(tracking_uri=mlflow_server_uri))
    assert not MlflowClient(tracking_uri=mlflow_server_uri).list_artifacts(run_id, "x")


def _waits_for_a_lock(pid: int) -> bool:
    """Whether process `pid` is blocked in a flock (or fcntl) call: its request is a `->` line of /proc/locks."""
    return any(f[1] == "->" and f[5] == str(pid) for f in map(str.split, Path("/proc/locks").read_text().splitlines()))


def test_relog_waits_for_a_step_still_writing_its_spool(tmp_path, mlflow_server_uri, run_id):
    """A folder of spools ($RANGEFINDER_WORK/mlflow-spool) holds every step's, some maybe still running and spooling.
    relog sends a spool only under the lock its step appends and sends under: a record the step appends while relog
    runs is sent with the rest, not dropped when relog removes the spool it read before."""
    from rangefinder.tracking.outbox import spool_lock

    spool = spool_of(tmp_path, mlflow_server_uri, run_id)
    spool.append({"kind": "tags", "run_id": run_id, "tags": {"before": "1"}})
    with spool_lock(spool.path.parent):  # the step, appending (or sending) right now
        relog = subprocess.Popen([sys.executable, "-m", "rangefinder.cli.main", "relog", str(spool.path.parent),
                                  "--tracking-uri", mlflow_server_uri], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        # relog starts, imports mlflow and checks the server (seconds), then waits for the lock: what the step
        # appends from here on, relog has not read yet.
        deadline = time.monotonic() + 120
        while not _waits_for_a_lock(relog.pid):
            assert relog.poll() is None and time.monotonic() < deadline, relog.communicate()
            time.sleep(0.1)
        spool.append({"kind": "tags", "run_id": run_id, "tags": {"during": "2"}})
    out, err = relog.communicate(timeout=120)
    assert relog.returncode == 0, err
    tags = MlflowClient(tracking_uri=mlflow_server_uri).get_run(run_id).data.tags
    assert tags["before"] == "1" and tags["during"] == "2"
    assert not spool.path.exists() and "2 tags to run" in out


def step_away_from(server_uri: str, tmp_path: Path, step_name: str = "finetune"):
    """(the server's own client, a step's run, the port): the step's run (experiment "outage") made on the
    server at `server_uri`, its outbox reaching the server through a port where nothing answers until
    `relay(port, server_uri)` starts (the server coming back); it spools to tmp_path/spool and waits for nothing at its
    end. No training."""
    from rangefinder.tracking import StepRun

    live = MlflowClient(tracking_uri=server_uri)
    exp = live.get_experiment_by_name("outage") or live.get_experiment(live.create_experiment("outage"))
    run_id = live.create_run(exp.experiment_id, run_name=step_name).info.run_id
    port = free_port()
    uri = f"http://127.0.0.1:{port}"  # nothing answers there but while a relay runs
    cfg = RangefinderConfig(tracking={"tracking_uri": uri, "experiment_name": "outage", "server_wait_seconds": 0})
    step = StepRun(client=MlflowClient(tracking_uri=uri), run_id=run_id, experiment_id=exp.experiment_id,
                   step_name=step_name, parent_run_id=None, tracking_uri=uri, cfg=cfg, spool_dir=tmp_path / "spool")
    return live, step, port


def test_one_outage_of_a_step_with_child_runs_is_said_once_and_its_end_once(tmp_path, mlflow_server_uri, caplog):
    """A step with child runs (the fine-tune's halving candidates, its cooldown) has an outbox per run: one outage was
    said once per run, each line naming another spool file, and "answers again" once per run that sent its spool (or
    not at all for a child whose spool another's record pulled in). The step's runs share one link to the server:
    one line when the first of them starts spooling, naming the step's spool folder, and one when the server answers,
    saying what was sent for all of them. No training: a parent run made on the session's server, reached through a
    port where nothing answers, then a relay to it (the server coming back)."""
    from rangefinder.tracking import child_run

    caplog.set_level(logging.WARNING)
    live, step, port = step_away_from(mlflow_server_uri, tmp_path)
    parent_id, uri, cfg, folder = step.run_id, step.tracking_uri, step.cfg, step.spool_dir
    step.set_tags({"status": "racing"})  # the step's first record to find the server away
    children = []
    for name in ("lr_mid", "lr_high"):
        with child_run(cfg, step, f"finetune_{name}", run_name=name, tags={"halving.candidate": name},
                       description=f"candidate {name}") as child:
            child.log_metrics({"val_loss": 0.5}, step=1)
            children.append(child.run_id)
    for child_id in children:
        step.set_run_tags(child_id, {"halving.outcome": "kept"})
    said = [r.getMessage() for r in caplog.records]
    away = [line for line in said if "is not answering" in line]
    assert len(away) == 1 and f"keeps what it logs in {folder} " in away[0], said
    # Why, in the words the step's server check uses: it was urllib3's error, cut off at 300 characters mid-word.
    assert f"MLflow at {uri} is not answering (connection refused); step finetune goes on" in away[0], away
    assert len(list(folder.glob("*.jsonl"))) == 3  # the step's own spool and each child's
    # The children ended with the server away: the step, going on, sends their spools; no relog line of their own.
    assert not any("rangefinder relog" in line for line in said), said

    caplog.clear()
    with relay(port, mlflow_server_uri):
        step.finish()
    said = [r.getMessage() for r in caplog.records]
    back = [line for line in said if "answers again" in line]
    assert len(back) == 1 and f"step finetune sent what it had kept in {folder}: " in back[0], said
    assert back[0].endswith("2 runs made, 5 tags, 2 metric values, 2 ends of the run, for 3 runs")
    assert not list(folder.glob("*.jsonl")) and not any("is not answering" in line for line in said)
    assert not (folder / AWAY_MARKER).exists()  # the outage said over: the next one is said again
    made = live.search_runs([step.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'",
                            order_by=["attributes.start_time ASC"])
    # Made in MLflow in the order the step made them: the newest child's spool was sent first, so the UI listed the
    # candidates made in the outage backwards.
    assert [r.data.tags["halving.candidate"] for r in made] == ["lr_mid", "lr_high"]
    assert made[0].info.start_time < made[1].info.start_time
    assert [(r.data.tags["halving.outcome"], r.data.metrics) for r in made] == [
        ("kept", {"validation/val_loss": 0.5})] * 2
    assert live.get_run(parent_id).info.status == "FINISHED"


def _training_worker(cfg: RangefinderConfig, run_id: str, step_name: str, said: Path) -> None:
    """Rank 0 of a multi-process training run, in a process of its own (launch/processes.py worker): it logs its
    curve into one of the step's runs through step_metric_sink, and what it says goes to the file `said`."""
    from rangefinder.tracking.runs import step_metric_sink

    logging.getLogger("rangefinder").addHandler(logging.FileHandler(said))
    sink = step_metric_sink(cfg, run_id, step_name)
    sink.log_metrics({"train_loss": 0.5}, step=1)
    sink.close()


@pytest.mark.parametrize("first", ["worker", "step"])
def test_one_outage_is_said_once_by_the_step_s_process_and_its_training_worker(first, tmp_path, monkeypatch, caplog):
    """A training worker logs into a child run of the step (a halving candidate) from a process of its own, with an
    outbox of its own: it said the outage when it started that run's spool, and the step's process said it again
    when it started its own run's (or the other way round). The first process to say it writes so in the spool
    folder; the other, whose runs include one of the first's, says nothing. No server: a port where nothing answers;
    the worker is a real second process."""
    import multiprocessing

    from rangefinder.tracking import StepRun

    caplog.set_level(logging.WARNING)
    folder = tmp_path / "spool"
    monkeypatch.setenv("RANGEFINDER_MLFLOW_SPOOL", str(folder))  # the worker's, as a local run sets it
    uri = f"http://127.0.0.1:{free_port()}"
    cfg = RangefinderConfig(tracking={"tracking_uri": uri, "experiment_name": "outage", "server_wait_seconds": 0})
    parent_id, child_id = "a" * 32, "b" * 32  # made while the server answered
    step = StepRun(client=MlflowClient(tracking_uri=uri), run_id=parent_id, experiment_id="1", step_name="finetune",
                   parent_run_id=None, tracking_uri=uri, cfg=cfg, spool_dir=folder)
    StepRun(client=step.client, run_id=child_id, experiment_id="1", step_name="finetune_lr_mid",
            parent_run_id=parent_id, tracking_uri=uri, cfg=cfg, spool_dir=folder, link=step.outbox.link)
    if first == "step":
        step.set_tags({"status": "training"})  # the step's process, before training: its own run's spool starts
    worker = multiprocessing.get_context("fork").Process(
        target=_training_worker, args=(cfg, child_id, "finetune_lr_mid", tmp_path / "worker.log"))
    worker.start()
    worker.join(60)
    assert worker.exitcode == 0
    if first == "worker":
        step.set_tags({"status": "trained"})  # the step's process, after training: its own run's spool starts
    lines = {"step": [r.getMessage() for r in caplog.records],
             "worker": (tmp_path / "worker.log").read_text().splitlines()}
    said = {who: [line for line in lines[who] if "is not answering" in line] for who in lines}
    assert [len(said[first]), len(said["worker" if first == "step" else "step"])] == [1, 0], said
    assert sorted(p.name for p in folder.glob("*.jsonl")) == [f"finetune-{parent_id}.jsonl",
                                                              f"finetune_lr_mid-{child_id}.jsonl"]


def test_an_outage_after_a_worker_s_spool_was_sent_by_the_step_s_process_is_said(tmp_path, mlflow_server_uri, caplog):
    """A training worker said an outage; the server came back and the step's process sent the worker's spool with its
    own; the worker, whose next try was not due yet, started its spool again without a word (the outage it took for
    the one going on), but wrote its run in the spool folder as one said. When the server went away again, the step's
    process found that line and said nothing: the new outage went unsaid. The worker's outbox is made here as
    step_metric_sink makes it in its own process; the server is the session's, reached through a relay."""
    from rangefinder.tracking import StepRun
    from rangefinder.tracking.outbox import Outbox
    from rangefinder.tracking.runs import run_spool

    caplog.set_level(logging.WARNING)
    live, step, port = step_away_from(mlflow_server_uri, tmp_path)
    folder, uri = tmp_path / "spool", step.outbox.client.tracking_uri
    child_id = live.create_run(step.experiment_id, run_name="finetune_lr_mid").info.run_id
    StepRun(client=step.client, run_id=child_id, experiment_id=step.experiment_id, step_name="finetune_lr_mid",
            parent_run_id=step.run_id, tracking_uri=uri, cfg=step.cfg, spool_dir=folder, link=step.outbox.link)
    worker = Outbox(MlflowClient(tracking_uri=uri), run_spool(uri, child_id, "finetune_lr_mid", folder))
    worker.send({"kind": "tags", "run_id": child_id, "tags": {"first": "1"}})  # the worker says the outage
    with relay(port, mlflow_server_uri):
        assert step.outbox.wait_for_server(5)  # the step's process sends the worker's spool
    worker.send({"kind": "tags", "run_id": child_id, "tags": {"second": "2"}})  # its retry not due: spooled
    step.set_tags({"status": "trained"})  # the step's process: the server away again
    away = [r.getMessage() for r in caplog.records if "is not answering" in r.getMessage()]
    assert len(away) == 2, away
    assert live.get_run(child_id).data.tags["first"] == "1"


def test_a_record_mlflow_refuses_in_a_child_run_s_spool_is_named_and_the_step_s_own_records_still_go(
        tmp_path, mlflow_server_uri, caplog):
    """The server, back, refuses a record a child run kept (its run deleted meanwhile, here a run it never had): the
    step's own records, sent with the children's spools when it answers, waited behind it, the step's run was left
    RUNNING, and a log call of the step would raise MLflow's refusal of another run's record. The child's spool is
    named and left for `rangefinder relog`; the step's own go."""
    from rangefinder.tracking import StepRun

    caplog.set_level(logging.WARNING)
    live, step, port = step_away_from(mlflow_server_uri, tmp_path)
    parent_id, uri, cfg, folder = step.run_id, step.tracking_uri, step.cfg, step.spool_dir
    child = StepRun(client=step.client, run_id="0" * 32, experiment_id=step.experiment_id, step_name="finetune_lr_mid",
                    parent_run_id=parent_id, tracking_uri=uri, cfg=cfg, spool_dir=folder, link=step.outbox.link)
    child.set_tags({"halving.candidate": "lr_mid"})  # spooled: the server is away
    step.set_tags({"status": "racing"})
    caplog.clear()
    with relay(port, mlflow_server_uri):
        step.finish()
    said = " ".join(r.getMessage() for r in caplog.records)
    (left,) = folder.glob("*.jsonl")
    assert left.name.startswith("finetune_lr_mid-") and f"refused a tags record of run {'0' * 32}" in said, said
    assert f"rangefinder relog {left}" in said, said
    run = live.get_run(parent_id)
    assert run.data.tags["status"] == "racing" and run.info.status == "FINISHED"


def test_a_step_whose_child_runs_end_with_the_server_away_names_every_spool_left_in_one_line(tmp_path, caplog):
    """The server never comes back: the step's end names what each of its runs left and one relog command for all of
    them; the child runs' own ends said nothing (each said its own line, and waited tracking.server_wait_seconds)."""
    from rangefinder.tracking import StepRun, child_run

    uri = f"http://127.0.0.1:{free_port()}"  # nothing answers there
    cfg = RangefinderConfig(tracking={"tracking_uri": uri, "experiment_name": "away", "server_wait_seconds": 0})
    folder = tmp_path / "spool"
    caplog.set_level(logging.WARNING)
    step = StepRun(client=MlflowClient(tracking_uri=uri), run_id="f" * 32, experiment_id="1", step_name="finetune",
                   parent_run_id=None, tracking_uri=uri, cfg=cfg, spool_dir=folder)
    with child_run(cfg, step, "finetune_cooldown", run_name="cooldown", tags={}, description="cooldown") as child:
        child.log_metrics({"val_loss": 0.5}, step=1)
    step.set_tags({"status": "ok"})
    step.finish()
    ends = [r.getMessage() for r in caplog.records if "did not take everything" in r.getMessage()]
    own = folder / f"finetune-{'f' * 32}.jsonl"
    (cooldown,) = folder.glob("finetune_cooldown-*.jsonl")
    assert len(ends) == 1 and own.is_file(), ends
    assert "step finetune logged for 2 of its runs: " in ends[0] and "1 metric value" in ends[0], ends
    assert ends[0].endswith(f"run: rangefinder relog {own} {cooldown}"), ends


def test_a_worker_of_a_child_run_opened_while_the_server_was_away_logs_into_it_once_the_server_answers(
        tmp_path, mlflow_server_uri, monkeypatch):
    """A halving candidate trained by several processes, its run opened while the server was away (a pending id):
    rank 0's sink (step_metric_sink, in a worker process) asked the server, back by then, for the run by that id,
    which MLflow does not know, and the worker ended in "Run with id=pending-... not found"."""
    from rangefinder.tracking import child_run
    from rangefinder.tracking.runs import step_metric_sink

    live, step, port = step_away_from(mlflow_server_uri, tmp_path)
    monkeypatch.setenv(SPOOL_ENV, str(step.spool_dir))  # the worker's spool folder is the step's, as in a pod
    with child_run(step.cfg, step, "finetune_lr_mid", run_name="lr_mid", tags={}, description="candidate") as child:
        assert child.run_id.startswith(PENDING)
        with relay(port, mlflow_server_uri):
            worker = step_metric_sink(step.cfg, child.run_id, "finetune_lr_mid")
            worker.log_metrics({"train_loss": 0.5}, step=1)
            worker.close()
    with relay(port, mlflow_server_uri):
        step.finish()
    (made,) = live.search_runs([step.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{step.run_id}'")
    assert made.data.metrics == {"train_loss": 0.5} and made.info.status == "FINISHED"


def test_a_second_outage_is_said_after_the_first_s_spool_was_sent_by_a_relog(tmp_path, mlflow_server_uri, caplog):
    """`rangefinder relog` sent the step's spool while the step ran, then the step's next try got an answer with
    nothing left to send (no "answers again" line): the step still took the first outage for the one going on, and
    said nothing when the server went away again."""
    caplog.set_level(logging.WARNING)
    live, step, port = step_away_from(mlflow_server_uri, tmp_path, "sample_images")
    run_id = step.run_id
    step.set_tags({"first": "1"})  # the first outage: spooled
    (spool,) = (tmp_path / "spool").glob("*.jsonl")
    assert not replay(spool, live).left  # what `rangefinder relog SPOOL` does meanwhile
    with relay(port, mlflow_server_uri):
        assert step.outbox.wait_for_server(5)  # the step's next try: answered, nothing left to send
    step.set_tags({"second": "2"})  # the relay is gone: the second outage
    away = [r.getMessage() for r in caplog.records if "is not answering" in r.getMessage()]
    assert len(away) == 2, away
    assert live.get_run(run_id).data.tags["first"] == "1"


def test_a_sqlite_store_locked_by_another_program_is_an_outage_and_the_step_s_records_wait(
        tmp_path, shared_sqlite_tracking_uri, caplog):
    """Another program holding the SQLite database in a transaction longer than MLflow waits (a sqlite3 shell, `mlflow
    gc`) failed the step mid-training in MLflow's traceback, `database is locked`: it is the store not answering, as
    a server's 503 is. The records go to the spool with one line saying so, and to MLflow when the lock is gone."""
    import sqlite3

    cfg = RangefinderConfig(tracking={"tracking_uri": shared_sqlite_tracking_uri, "experiment_name": "locked",
                                      "server_wait_seconds": 5})
    caplog.set_level(logging.WARNING)
    holder = sqlite3.connect(shared_sqlite_tracking_uri.removeprefix("sqlite:///"), isolation_level=None)
    with sqlite_busy_timeout(100):
        try:
            with step_run(cfg, "finetune", spool_dir=tmp_path / "spool") as run:
                holder.execute("BEGIN IMMEDIATE")  # a write transaction: readers go on, writers wait
                run.log_params({"lr_low": 0.001})
                assert run.offline and list((tmp_path / "spool").glob("*.jsonl"))
                holder.execute("ROLLBACK")
        finally:
            holder.close()
    said = [r.getMessage() for r in caplog.records if "is not answering" in r.getMessage()]
    assert len(said) == 1 and "database is locked" in said[0], said
    assert not any(r.exc_info or "Traceback" in r.getMessage() for r in caplog.records)
    assert MlflowClient(tracking_uri=shared_sqlite_tracking_uri).get_run(run.run_id).data.params["lr_low"] == "0.001"
    assert not list((tmp_path / "spool").glob("*.jsonl"))


def test_a_step_ending_while_another_program_holds_the_sqlite_store_waits_out_the_lock(
        tmp_path, shared_sqlite_tracking_uri):
    """The lock held through the step's end: the check before each try only reads, which the lock lets through, so
    the step tried its records once and left them for `rangefinder relog`, where a server away is waited for up to
    tracking.server_wait_seconds. The lock gone within that time, the records reach MLflow and no spool is left."""
    import sqlite3
    import threading

    cfg = RangefinderConfig(tracking={"tracking_uri": shared_sqlite_tracking_uri, "experiment_name": "locked",
                                      "server_wait_seconds": 20})
    holder = sqlite3.connect(shared_sqlite_tracking_uri.removeprefix("sqlite:///"), isolation_level=None,
                             check_same_thread=False)
    release = threading.Timer(1.0, holder.execute, ("ROLLBACK",))
    with sqlite_busy_timeout(100):
        try:
            with step_run(cfg, "finetune", spool_dir=tmp_path / "spool") as run:
                holder.execute("BEGIN IMMEDIATE")
                run.log_params({"lr_low": 0.001})
                assert run.offline
                release.start()  # the other program ends its transaction a moment into the step's end
        finally:
            release.join()
            holder.close()
    got = MlflowClient(tracking_uri=shared_sqlite_tracking_uri).get_run(run.run_id)
    assert got.data.params["lr_low"] == "0.001" and got.info.status == "FINISHED"
    assert not list((tmp_path / "spool").glob("*.jsonl"))


def test_a_sqlite_store_locked_while_a_step_makes_its_run_is_one_line_naming_it(tmp_path, shared_sqlite_tracking_uri):
    """The same lock met before the step has a run to keep records for (the check before it only reads, which a
    writer's transaction lets through): the step stopped in MLflow's traceback, with the query it ran."""
    import sqlite3

    db = shared_sqlite_tracking_uri.removeprefix("sqlite:///")
    cfg = RangefinderConfig(tracking={"tracking_uri": shared_sqlite_tracking_uri, "experiment_name": "locked"})
    MlflowClient(tracking_uri=shared_sqlite_tracking_uri).search_experiments(max_results=1)  # the store made first
    holder = sqlite3.connect(db, isolation_level=None)
    with sqlite_busy_timeout(100):
        try:
            holder.execute("BEGIN IMMEDIATE")
            with pytest.raises(TrackingError) as refused, step_run(cfg, "finetune", spool_dir=tmp_path / "spool"):
                pass
        finally:
            holder.close()
    said = str(refused.value)
    assert len(said.splitlines()) == 1 and db in said and "database is locked" in said and "sqlite3 shell" in said
    assert said.count("another program") == 1 and said.count("sqlite3 shell") == 1, said  # said once, not twice over
    # resolve-config making the pipeline's parent run met the same lock in MLflow's traceback.
    from rangefinder.tracking import ensure_parent_run

    holder = sqlite3.connect(db, isolation_level=None)
    with sqlite_busy_timeout(100):
        try:
            holder.execute("BEGIN IMMEDIATE")
            with pytest.raises(TrackingError) as refused:
                ensure_parent_run(cfg, name="locked-parent")
        finally:
            holder.close()
    assert str(refused.value) == said
    assert "INSERT" not in said and not (tmp_path / "spool").exists()


def test_a_child_run_opened_while_another_program_holds_the_sqlite_store_locked_waits_in_its_spool(
        tmp_path, shared_sqlite_tracking_uri, caplog):
    """The lock met as a halving candidate or the cooldown opens, once the step's run is open: it is the outage its
    records wait out, as while the server is away, where it failed the step that had trained up to it in one line
    saying to run the step again."""
    import sqlite3

    from rangefinder.tracking import child_run

    uri = shared_sqlite_tracking_uri
    cfg = RangefinderConfig(tracking={"tracking_uri": uri, "experiment_name": "locked-child", "server_wait_seconds": 5})
    caplog.set_level(logging.WARNING)
    holder = sqlite3.connect(uri.removeprefix("sqlite:///"), isolation_level=None)
    with sqlite_busy_timeout(100):
        try:
            with step_run(cfg, "finetune", spool_dir=tmp_path / "spool") as run:
                holder.execute("BEGIN IMMEDIATE")
                with child_run(cfg, run, "finetune_cooldown", run_name="cooldown", tags={},
                               description="cooldown") as child:
                    child.log_metrics({"val_loss": 0.5}, step=1)
                assert run.offline
                holder.execute("ROLLBACK")
        finally:
            holder.close()
    (made,) = MlflowClient(tracking_uri=uri).search_runs(
        [run.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{run.run_id}'")
    assert made.info.run_name == "cooldown" and made.data.metrics["validation/val_loss"] == 0.5
    assert not list((tmp_path / "spool").glob("*.jsonl"))


def test_a_folder_that_cannot_be_read_whole_is_not_blamed_on_a_local_artifact_store(tmp_path,
                                                                                   shared_sqlite_tracking_uri):
    """Only a store this process cannot write is named as one: a folder logged with a link in it that leads nowhere
    (a file removed meanwhile) was said to be a store this process cannot write, with a fix of MLFLOW_TRACKING_URI, on
    a laptop's store beside its database that takes every other file; a full disk lost the step's own words for it."""
    client = MlflowClient(tracking_uri=shared_sqlite_tracking_uri)
    store = (tmp_path / "mlartifacts").as_uri()
    run_id = client.create_run(client.create_experiment(f"source-{time.time_ns()}", store)).info.run_id
    folder = tmp_path / "outputs"
    folder.mkdir()
    (folder / "kept.txt").write_text("kept")
    (folder / "gone.txt").symlink_to(tmp_path / "removed.txt")
    with pytest.raises(OSError) as e:
        apply_record(client, {"kind": "artifact", "run_id": run_id, "path": str(folder)})
    assert "gone.txt" in str(e.value) and "keeps its artifacts" not in str(e.value)


def test_a_sqlite_store_that_fails_otherwise_as_a_step_makes_its_run_is_not_said_to_be_locked(tmp_path,
                                                                                            sqlite_tracking_uri):
    """Any query SQLite cannot run is MLflow's TEMPORARILY_UNAVAILABLE, a lock or not: a database this process cannot
    write (its file read-only, its journal not to be made) was said to be locked by another program, with the
    transaction of a sqlite3 shell to end. Here its rollback journal's name is taken by a folder after the check."""
    db = Path(sqlite_tracking_uri.removeprefix("sqlite:///"))
    cfg = RangefinderConfig(tracking={"tracking_uri": sqlite_tracking_uri, "experiment_name": "unwritable"})
    ensure_tracking_server(sqlite_tracking_uri)  # the check passed: the store opened, as at the step's start
    MlflowClient(tracking_uri=sqlite_tracking_uri).create_experiment("unwritable")
    journal = db.with_name(db.name + "-journal")
    journal.mkdir()
    try:
        with pytest.raises(TrackingError) as e, step_run(cfg, "finetune", spool_dir=tmp_path / "spool"):
            pass
    finally:
        journal.rmdir()
    said = str(e.value)
    assert len(said.splitlines()) == 1 and str(db) in said and "disk I/O error" in said, said
    assert "locked" not in said and "sqlite3 shell" not in said, said


def test_a_value_a_sql_store_refuses_in_the_code_of_an_outage_is_said_not_kept_for_ever(tmp_path,
                                                                                       shared_sqlite_tracking_uri):
    """MLflow raises every driver OperationalError as TEMPORARILY_UNAVAILABLE, a value its column refuses too (an emoji
    in a MySQL utf8mb3 column): it was kept as an outage, sent again at every relog for ever, and a live step spooled
    it and all that followed. Here SQLite refuses a tag's value in a trigger's error, with that code."""
    import sqlite3

    uri = shared_sqlite_tracking_uri
    cfg = RangefinderConfig(tracking={"tracking_uri": uri, "experiment_name": "refused-value"})
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # the store made first
    db = sqlite3.connect(uri.removeprefix("sqlite:///"), isolation_level=None)
    db.execute("CREATE TRIGGER refuse_value BEFORE INSERT ON tags WHEN NEW.value = 'refused \U0001F600' "
               "BEGIN SELECT json('not json'); END")
    try:
        with step_run(cfg, "finetune", spool_dir=tmp_path / "spool") as run:
            spool = spool_of(tmp_path / "relog", uri, run.run_id)
            spool.append({"kind": "tags", "run_id": run.run_id, "tags": {"a": "refused \U0001F600"}})
            with pytest.raises(TrackingError) as relogged:
                replay(spool.path, run.client)
            with pytest.raises(TrackingError) as live:
                run.set_tags({"b": "refused \U0001F600"})
            assert not run.offline and not list((tmp_path / "spool").glob("*.jsonl"))
    finally:
        db.execute("DROP TRIGGER refuse_value")
        db.close()
    for said in (str(relogged.value), str(live.value)):
        assert len(said.splitlines()) == 1 and "tags record" in said and "malformed JSON" in said, said
    assert "refused a tags record" in str(relogged.value) and "INSERT" not in str(live.value)
