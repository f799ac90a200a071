"""Under KFP 2.17's own MLflow integration: KFP makes the pipeline run's parent run and one nested run per task, and
names the task's run to its pod in $MLFLOW_RUN_ID (with $MLFLOW_EXPERIMENT_ID and $MLFLOW_WORKSPACE). The steps'
runs go where KFP says, and rangefinder makes no second parent.

The test plays KFP's part against a real `mlflow server` on loopback, started with workspaces on (the MLflow client
refuses $MLFLOW_WORKSPACE against a server without them): it makes the parent and task runs as KFP's driver does,
sets the variables for each task in turn, and runs what each step runs.
"""

from __future__ import annotations

import pytest

from rangefinder.config import RangefinderConfig, TrackingConfig
from rangefinder.steps.record_status import run_record_status
from rangefinder.tracking import ensure_parent_run, step_run, tracking_client
from rangefinder.tracking.runs import TAG_PIPELINE_RUN
from tests.tracking.fixtures import start_mlflow_server, stop_mlflow_server

PARENT = "mlflow.parentRunId"


@pytest.fixture(scope="module")
def workspace_server_uri(tmp_path_factory):
    uri, proc = start_mlflow_server(tmp_path_factory.mktemp("mlflow-workspaces"), extra_args=("--enable-workspaces",))
    yield uri
    stop_mlflow_server(proc)


@pytest.fixture
def kfp(workspace_server_uri, monkeypatch, request):
    """KFP's side: an experiment, the pipeline run's parent run, and a function that starts a task (its nested run,
    announced in the environment as KFP's driver announces it)."""
    name = f"kfp-{request.node.name}"
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=workspace_server_uri, experiment_name=name))
    monkeypatch.setenv("MLFLOW_WORKSPACE", "default")
    client = tracking_client(cfg)
    exp = client.create_experiment(name)
    parent = client.create_run(exp, run_name="my-kfp-run", tags={"kfp.pipeline_run": "job-1"}).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", workspace_server_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)

    def start_task(task: str) -> str:
        run_id = client.create_run(exp, run_name=task, tags={PARENT: parent}).info.run_id
        monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
        return run_id

    return cfg, client, exp, parent, start_task


def test_steps_log_into_the_task_runs_kfp_made_and_no_second_parent_is_made(kfp):
    cfg, client, exp, kfp_parent, start_task = kfp

    # resolve-config: the parent it hands on is KFP's, not one of its own.
    start_task("resolve-config")
    parent = ensure_parent_run(cfg, name="my-kfp-run", kfp_run_id="job-1")
    assert parent == kfp_parent

    # lr-range-test: its run is KFP's task run, under KFP's parent; its decisions reach that parent.
    task = start_task("lr-range-test")
    with step_run(cfg, "lr_range_test", parent_run_id=parent) as run:
        run.log_metrics({"train_loss": 0.5}, step=1)
        run.log_decisions({"lr_mid": 3e-5, "status": "ok"})
        # A step's own child run (a halving candidate, say) nests under the step's run.
        with step_run(cfg, "lr_mid", parent_run_id=run.run_id) as child:
            child.log_metrics({"val_loss": 0.4}, step=1)
    assert run.run_id == task
    logged = client.get_run(task)
    assert logged.data.tags[PARENT] == kfp_parent and logged.data.tags["rangefinder.step"] == "lr_range_test"
    assert logged.data.metrics["train_loss"] == 0.5
    assert logged.info.status == "RUNNING"  # KFP ends its task's run itself
    assert client.get_run(child.run_id).data.tags[PARENT] == task
    assert float(client.get_run(kfp_parent).data.tags["lr_mid"]) == pytest.approx(3e-5)

    # record-status (the exit handler): the final state goes on KFP's parent, which KFP ends itself.
    start_task("record-status")
    assert run_record_status(state="SUCCEEDED", mlflow_experiment=cfg.tracking.experiment_name,
                             pipeline_job_id="job-1") == "FINISHED"
    top = client.get_run(kfp_parent)
    assert top.data.tags["rangefinder.final_state"] == "SUCCEEDED" and top.info.status == "RUNNING"

    runs = client.search_runs([exp], max_results=100)
    assert [r.info.run_id for r in runs if PARENT not in r.data.tags] == [kfp_parent], "a second top-level run"
    assert not [r for r in runs if TAG_PIPELINE_RUN in r.data.tags], "rangefinder made a parent of its own"
    # 1 parent, 3 task runs, 1 child of a step: nothing else.
    assert len(runs) == 5
