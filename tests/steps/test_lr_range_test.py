"""The range-test step's pure parts: the sweep's settings (the zoom decision is tests/analysis/test_zoom.py)."""

from __future__ import annotations

import pytest

from rangefinder.config import demo_config, parse_config
from rangefinder.data.split import read_split
from rangefinder.training.spec import TrainSpec


def test_ramp_settings_follow_the_range_test_section(split_dir):
    cfg = demo_config()
    split = read_split(split_dir)
    tc = TrainSpec.ramp(cfg, split, lr_min=1e-6, lr_max=1e-1, world_size=1).training
    assert tc.schedule == "exp-ramp" and tc.lr_min == 1e-6 and tc.lr_max == 1e-1
    assert tc.epochs == cfg.lr_range_test.epochs and tc.steps is None and tc.scale_lr == "none"
    lin = TrainSpec.ramp(parse_config({"lr_range_test": {"ramp": "linear"}}), split,
                         lr_min=0.0001, lr_max=0.01, world_size=1).training
    assert lin.schedule == "linear-ramp"
    every = TrainSpec.ramp(parse_config({"lr_range_test": {"validate_every_updates": 3}}), split,
                           lr_min=0.0001, lr_max=0.01, world_size=1).validation
    assert every.every_updates == 3


def test_a_zoom_sweeps_the_range_it_is_given_not_the_configured_one(split_dir, tmp_path):
    """The zoom's lr_min and lr_max are its own: an empty one is refused as given (the configured range is not)."""
    from rangefinder.errors import RangefinderError
    from rangefinder.steps.lr_range_test import run_lr_range_test

    with pytest.raises(RangefinderError, match=r"^LR range 0\.001\.\.0\.0005 is empty"):
        run_lr_range_test(demo_config(), split_dir=split_dir, out_dir=tmp_path, stage="zoom", lr_min=1e-3,
                          lr_max=5e-4)


def test_its_kfp_metrics_are_named_as_its_mlflow_run_and_bounds_json_name_them(split_dir, tiny_model_dir, tmp_path,
                                                                                monkeypatch):
    """The step's KFP metrics (the run's Metrics in the KFP UI) name each quantity as its MLflow run and bounds.json
    do: the count of validations between the bounds was `points_between_bounds` in KFP and `points_between` in
    MLflow, bounds.json and docs/scaling.md, which tells the reader to look for it."""
    import json

    from mlflow import MlflowClient

    from rangefinder.steps.lr_range_test import run_lr_range_test

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, training={"cache_dir": str(tmp_path / "cache")},
                      tracking={"tracking_uri": uri, "registered_model_name": None})
    result = run_lr_range_test(cfg, split_dir=split_dir, out_dir=tmp_path / "range")
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    assert experiment is not None
    [run] = client.search_runs([experiment.experiment_id], "tags.`rangefinder.step` = 'lr_range_test'")
    kfp = set(result.metrics())
    assert kfp <= set(run.data.metrics) | set(run.data.tags), kfp - set(run.data.metrics) - set(run.data.tags)
    assert kfp <= set(json.loads(result.bounds_json.read_text(encoding="utf-8")))
    assert result.metrics()["points_between"] == run.data.metrics["points_between"]
    # Its report and bounds.json, as MLflow hands them to a teammate, name the curve as the run holds it, not as a
    # path of the machine that ran it.
    from tests.tracking.fixtures import check_logged_files_name_no_local_path

    check_logged_files_name_no_local_path(client, run.info.run_id, tmp_path, ("report", "analysis"))
    # One file of each: the report's own JSON is bounds.json's first keys, which analysis/ holds whole.
    assert [a.path for a in client.list_artifacts(run.info.run_id, "report")] == [
        "report/lr_range_test.png", "report/lr_report.html", "report/lr_report.md"]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "analysis")] == ["analysis/bounds.json"]
    local = client.download_artifacts(run.info.run_id, "analysis/bounds.json", str(tmp_path / "dl"))
    with open(local, encoding="utf-8") as f:
        assert json.load(f)["curve_csv"] == "curves/metrics.csv"  # the run's own path to it
