"""Fixtures for the pipeline tests."""

from __future__ import annotations

import pytest

from tests.pipelines.tiny_run import tiny_config
from tests.tracking.fixtures import mlflow_server_uri  # noqa: F401  (a real `mlflow server` on loopback)


@pytest.fixture(scope="session")
def default_local_run(shapes_dataset_dir, tiny_model_dir, tmp_path_factory):
    """One whole kfp.local run with the local defaults (discovery, no retrain, no tracking URI anywhere, so it writes
    sqlite:///<out>/mlflow.db), shared by the tests that read its record, its reports and its pages in a browser."""
    from rangefinder.pipelines.local_run import run_pipeline_locally
    from tests.mlflow_store import seed

    out = tmp_path_factory.mktemp("default-local-run")
    seed(out / "mlflow.db")  # where the run's default store goes, migrated: its first step skips MLflow's migrations
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("MLFLOW_RUN_ID", raising=False)
        run = run_pipeline_locally(tiny_config(shapes_dataset_dir, tiny_model_dir), out)
    return run
