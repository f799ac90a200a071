"""MLflow at the edges of a step (issue 36, item 7): a retried step goes on in its own MLflow run, so the UI shows one
whole curve; and registering a model waits for a server that is away at that moment, then names the command that
registers it later.
"""

from __future__ import annotations

import os
import shlex
import threading

import pytest
from mlflow import MlflowClient

from rangefinder.cli.main import main as cli_main
from rangefinder.config import RangefinderConfig
from rangefinder.errors import TrackingError
from rangefinder.tracking import ensure_parent_run, step_run
from rangefinder.tracking.runs import TAG_ERROR, TAG_PARENT, TAG_STEP, step_metric_sink
from rangefinder.tracking.spool import SPOOL_ENV
from tests.tracking.fixtures import free_port, start_mlflow_server, stop_mlflow_server


def test_a_retried_step_goes_on_in_its_run_with_each_update_once(shared_sqlite_tracking_uri):
    cfg = RangefinderConfig(tracking={"tracking_uri": shared_sqlite_tracking_uri, "experiment_name": "retried"})
    parent = ensure_parent_run(cfg, name="retried-pipeline")

    # The first attempt logs updates 1..6 and is preempted (its last checkpoint: update 3).
    with pytest.raises(RuntimeError), step_run(cfg, "finetune", parent_run_id=parent) as first:
        for update in range(1, 7):
            first.log_metrics({"train_loss": 1.0 / update, "lr": 1e-4, "val_loss": 2.0 / update}, step=update)
        first.metrics.flush()
        raise RuntimeError("preempted")

    # The retry resumes at update 3: it logs 4..6 again (the same values: it retraces them), then goes on to 8, in
    # its own process and through a worker's sink, as a multi-process run would.
    with step_run(cfg, "finetune", parent_run_id=parent) as retry:
        for update in range(4, 7):
            retry.log_metrics({"train_loss": 1.0 / update, "lr": 1e-4, "val_loss": 2.0 / update}, step=update)
        retry.metrics.flush()
        worker = step_metric_sink(cfg, retry.run_id, "finetune")
        for update in range(5, 9):
            worker.log_metrics({"train_loss": 1.0 / update, "lr": 1e-4, "val_loss": 2.0 / update}, step=update)
        worker.close()
        retry.log_decisions({"status": "ok"}, to_parent=False)
    assert retry.run_id == first.run_id

    client = MlflowClient(tracking_uri=shared_sqlite_tracking_uri)
    run = client.get_run(retry.run_id)
    # The validation loss too, whose MLflow key (validation/val_loss) is not the engine's (val_loss).
    for key in ("train_loss", "lr", "validation/val_loss"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == list(range(1, 9)), key
    assert run.info.status == "FINISHED" and run.data.tags["status"] == "ok"
    assert TAG_ERROR not in run.data.tags  # the first attempt's error is not this run's
    assert run.data.tags["rangefinder.attempt"] == "2"
    children = client.search_runs([run.info.experiment_id],
                                  filter_string=f"tags.`{TAG_PARENT}` = '{parent}' and tags.`{TAG_STEP}` = 'finetune'")
    assert [c.info.run_id for c in children] == [retry.run_id]

    # A step that finished is never reopened: running it again is a new run.
    with step_run(cfg, "finetune", parent_run_id=parent) as again:
        pass
    assert again.run_id != retry.run_id


def test_a_step_whose_pod_was_lost_mid_step_goes_on_in_its_run(shared_sqlite_tracking_uri):
    """A pod killed inside the step (SIGKILL, node loss) never ends its run: MLflow still has it RUNNING, and the
    retry goes on in it as it does in a FAILED one."""
    cfg = RangefinderConfig(tracking={"tracking_uri": shared_sqlite_tracking_uri, "experiment_name": "lost-pod"})
    parent = ensure_parent_run(cfg, name="lost-pod-pipeline")
    lost = step_run(cfg, "finetune", parent_run_id=parent)
    first = lost.__enter__()  # the pod dies in the block: nothing ends the run
    first.log_metrics({"train_loss": 1.0}, step=1)
    first.metrics.flush()
    client = MlflowClient(tracking_uri=shared_sqlite_tracking_uri)
    assert client.get_run(first.run_id).info.status == "RUNNING"
    with step_run(cfg, "finetune", parent_run_id=parent) as retry:
        retry.log_metrics({"train_loss": 0.5}, step=2)
    assert retry.run_id == first.run_id
    run = client.get_run(retry.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["rangefinder.attempt"] == "2"


@pytest.mark.slow
def test_register_model_waits_for_the_server_then_names_the_command(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from rangefinder.steps.register_model import run_register_model

    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "spool"))
    # A port nothing answers on yet: the server starts there later, on a new store (starting one only to stop it
    # again cost a server start, ~10 CPU-s, and tested nothing more).
    port, server_dir = free_port(), tmp_path / "server"
    uri = f"http://127.0.0.1:{port}"

    def cfg(wait_s: float) -> RangefinderConfig:
        return RangefinderConfig(tracking={"tracking_uri": uri, "experiment_name": "register",
                                           "registered_model_name": "rf-retried", "server_wait_seconds": wait_s},
                                 sampling={"num_inference_steps": 2})

    # Away for longer than the wait (a short one: the step checks, waits it out, checks again): one line, naming the
    # command that registers these weights later.
    with pytest.raises(TrackingError) as away:
        run_register_model(cfg(0.2), model_dir=tiny_model_dir, lr=2e-4, epochs=3)
    message = str(away.value)
    assert len(message.splitlines()) == 1 and "did not answer within" in message, message
    later = shlex.split(message.split("once it answers, run: ", 1)[1])
    assert later[:3] == ["rangefinder", "register", str(tiny_model_dir)]

    # Away at that moment, back within the wait: the step waits and registers.
    started: dict = {}
    back = threading.Thread(target=lambda: started.update(proc=start_mlflow_server(server_dir, port=port)[1]))
    back.start()
    try:
        registered = run_register_model(cfg(180), model_dir=tiny_model_dir, lr=2e-4, epochs=3)
        back.join()
        assert registered.version == "1"

        # The command the first one named does what the step would have done: run by the CLI's entry point in this
        # process (a subprocess would import torch, diffusers and mlflow again), with no MLflow setting of the step's.
        for name in [k for k in os.environ if k.startswith("MLFLOW_")]:
            monkeypatch.delenv(name)
        assert cli_main(later[1:]) == 0, capsys.readouterr().err
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        assert client.get_model_version_by_alias("rf-retried", "candidate").version == "2"
    finally:
        back.join()
        if "proc" in started:
            stop_mlflow_server(started["proc"])
