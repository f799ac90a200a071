"""An MLflow server that dies mid-run (issue 16): training goes on and the step ends within its normal time plus a
bounded wait, what was not logged stays on disk, and `rangefinder relog` puts it in MLflow once the server is back.

Everything is real: a `mlflow server` on loopback killed with SIGKILL while a tiny model trains, restarted on the
same backend store, and the relog command run as a subprocess.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rangefinder.config import RangefinderConfig, TrainingConfig, ValidationConfig
from rangefinder.tracking import step_run
from rangefinder.tracking.spool import read_spool
from rangefinder.tracking.target import HTTP_LIMITS
from tests.tracking.fixtures import start_mlflow_server, stop_mlflow_server

pytestmark = pytest.mark.slow

WAIT_S = 3.0  # tracking.server_wait_seconds here; a minute by default


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the server and its worker: no goodbye, as when a node dies."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


class KillServerAt:
    """A metric sink that hands everything to the step's run, and kills the server just before update `update`."""

    def __init__(self, sink, proc: subprocess.Popen, update: int) -> None:
        self.sink, self.proc, self.update = sink, proc, update

    def log_metrics(self, metrics, step):
        if step >= self.update and self.proc.poll() is None:
            kill(self.proc)
        self.sink.log_metrics(metrics, step)


def relog(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "relog", *args], capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.fixture
def mlflow_defaults(monkeypatch):
    """MLflow's own retry settings (the tracking tests' fixture shortens them, which would hide the hang)."""
    for name in HTTP_LIMITS:
        monkeypatch.delenv(name, raising=False)


def test_server_killed_mid_training_then_relogged(tmp_path, split_dir, tiny_model_dir, mlflow_defaults, caplog):
    server_dir = tmp_path / "server"
    uri, proc = start_mlflow_server(server_dir)
    # 4 updates, validated every 2: the server dies before update 3, with a validation still to log after it.
    tc = TrainingConfig(batch_size=4, lr=1e-4, seed=7, steps=4, cache_dir=str(tmp_path / "cache"))
    vc = ValidationConfig(every_updates=2)

    def step(name: str, tracking_uri: str, sink_of) -> tuple[str, float, Path]:
        from rangefinder.training.loop import train
        from rangefinder.training.spec import TrainSpec

        cfg = RangefinderConfig.model_validate({"tracking": {
            "tracking_uri": tracking_uri, "experiment_name": "server-loss", "server_wait_seconds": WAIT_S}})
        start = time.monotonic()
        with step_run(cfg, name, spool_dir=tmp_path / "spool") as run:
            run.log_config(cfg)
            spec = TrainSpec(training=tc, validation=vc, split_dir=split_dir, model=str(tiny_model_dir))
            result = train(spec, out_dir=tmp_path / name, metric_sink=sink_of(run))
            run.log_artifact(result.metrics_csv, "curves")
            run.log_decisions({"best_val_loss": result.best_val_loss, "status": "ok"})
        return run.run_id, time.monotonic() - start, result.metrics_csv

    try:
        caplog.set_level(logging.WARNING)
        # The first step in this test: it also fills the latent cache the healthy step below reads, so it is timed
        # against a step that did less (a warm-up step of its own, only to fill the cache, was a whole run more).
        run_id, faulted_s, csv_path = step("server-lost", uri, lambda run: KillServerAt(run, proc, update=3))
        assert proc.poll() is not None, "the server was never killed"
    finally:
        stop_mlflow_server(proc)
    # The training itself finished: every update is in the step's own curve.
    assert csv_path.is_file()

    # The warning names what was not logged and how to log it.
    spools = sorted((tmp_path / "spool").glob("*.jsonl"))
    assert len(spools) == 1 and run_id in spools[0].name
    warning = " ".join(r.getMessage() for r in caplog.records if "did not take everything" in r.getMessage())
    assert "metric values" in warning and "1 artifact" in warning and f"rangefinder relog {spools[0]}" in warning
    kept = read_spool(spools[0])
    assert kept.header["run_id"] == run_id and kept.torn == 0
    assert kept.counts()["metrics"] > 0 and kept.counts()["artifact"] == 1 and kept.counts()["end"] == 1

    # A relog while the server is still down is one line saying so, and keeps the spool whole.
    down = relog(str(spools[0]), "--tracking-uri", uri)
    assert down.returncode == 2 and "cannot reach the MLflow tracking server" in down.stderr, down.stderr
    assert "Traceback" not in down.stderr and read_spool(spools[0]).counts() == kept.counts()

    # The server comes back on the same store (on another port); relog puts everything in the run.
    uri2, proc2 = start_mlflow_server(server_dir)
    try:
        # The normal time: the same step with the server up the whole time (it spools nothing).
        healthy_id, healthy_s, _ = step("healthy", uri2, lambda run: run)
        assert sorted((tmp_path / "spool").glob("*.jsonl")) == spools
        # The lost step ended in about its normal time plus the bounded wait (a dead server cost ~4 minutes per call
        # before).
        call_limit = 3 * int(HTTP_LIMITS["MLFLOW_HTTP_REQUEST_TIMEOUT"])
        assert faulted_s < 1.5 * healthy_s + WAIT_S + call_limit, (faulted_s, healthy_s)

        done = relog(str(tmp_path / "spool"), "--tracking-uri", uri2, "--json")
        assert done.returncode == 0, done.stderr
        assert f"to run {run_id}" in json.loads(done.stdout)["relogged"][0]
        client = MlflowClient(tracking_uri=uri2)

        def recorded(rid: str) -> dict[str, list[int]]:
            data = client.get_run(rid).data
            return {k: sorted(m.step for m in client.get_metric_history(rid, k)) for k in data.metrics}

        lost_run = client.get_run(run_id)
        # Every metric at every update, as the healthy run has them: nothing was lost.
        assert recorded(run_id) == recorded(healthy_id)
        assert recorded(run_id)["train_loss"] == list(range(1, 5))
        assert lost_run.info.status == "FINISHED"
        assert lost_run.data.tags["status"] == "ok" and "best_val_loss" in lost_run.data.metrics
        assert [a.path for a in client.list_artifacts(run_id, "curves")] == ["curves/metrics.csv"]
    finally:
        stop_mlflow_server(proc2)
    assert not list((tmp_path / "spool").iterdir())  # the spool and its copied files are gone once logged
