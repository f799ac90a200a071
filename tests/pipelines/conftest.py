"""Fixtures for the pipeline tests."""

from __future__ import annotations

import pytest

from tests.pipelines.tiny_run import RETRAIN, tiny_config
from tests.tracking.fixtures import mlflow_server_uri  # noqa: F401  (a real `mlflow server` on loopback)


@pytest.fixture(scope="session")
def default_local_run(shapes_dataset_dir, tiny_model_dir, tmp_path_factory):
    """One whole kfp.local run with the local defaults (discovery, no tracking URI anywhere, so it writes
    sqlite:///<out>/mlflow.db) and the full-data retrain on (1 epoch), shared by the tests that read its record, its
    reports and its pages in a browser. The retrain is on so that one run covers the retrain branch of the DAG
    (issue 32: it had a whole run of its own); retrain off is the fixed-LR run's (test_local_run.py)."""
    from rangefinder.pipelines.local_run import run_pipeline_locally
    from tests.mlflow_store import seed

    out = tmp_path_factory.mktemp("default-local-run")
    seed(out / "mlflow.db")  # where the run's default store goes, migrated: its first step skips MLflow's migrations
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("MLFLOW_RUN_ID", raising=False)
        run = run_pipeline_locally(tiny_config(shapes_dataset_dir, tiny_model_dir, **RETRAIN), out)
    return run


@pytest.fixture(scope="session")
def default_local_run_mlflow(default_local_run):
    """A real `mlflow server` on the shared run's own store (<out>/mlflow.db), started once for the tests that read
    that record through it (test_local_run.py through MlflowClient, test_reports_in_browser.py in a browser), one
    server start instead of one per test; they only read it."""
    from tests.tracking.fixtures import start_mlflow_server, stop_mlflow_server

    uri, proc = start_mlflow_server(default_local_run.out_dir)
    yield uri
    stop_mlflow_server(proc)
