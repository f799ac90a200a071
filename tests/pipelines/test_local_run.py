"""The whole pipeline through kfp.local (SubprocessRunner, no containers) on the tiny model and shapes dataset."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from components.config import demo_config
from pipelines.commands.demo import missing_pieces

pytestmark = pytest.mark.slow

# The smallest run that still has a readable curve: few epochs, few prompts, few sampling steps.
TINY = {
    "lr_range_test": {"epochs": 4, "zoom": False},
    "finetune": {"epochs": 3},
    "sampling": {"prompts": ["a red circle"], "seeds": [0], "num_inference_steps": 2},
}


@pytest.fixture(scope="module", autouse=True)
def _pieces():
    missing = missing_pieces()
    if missing:
        pytest.skip("the steps' dependencies have not landed: " + "; ".join(missing))


def _cfg(dataset: Path, model: Path, **extra):
    return demo_config(data={"dataset_dir": str(dataset), "resolution": 32}, model={"base_model": str(model)},
                       **{**TINY, **extra})


def _parent_runs(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as con:
        return con.execute("select run_uuid, status from runs").fetchall()


@pytest.mark.parametrize("retrain", [False, True])
def test_discovery_with_and_without_retrain(tmp_path, shapes_dataset_dir, tiny_model_dir, monkeypatch, retrain):
    from pipelines.local_run import run_pipeline_locally

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = run_pipeline_locally(_cfg(shapes_dataset_dir, tiny_model_dir, retrain={"enabled": retrain}), tmp_path)
    s = run.summary()
    assert s["lr_source"] == "range-test"
    assert 0 < s["lr_low"] <= s["lr_mid"] <= s["lr_high"]
    assert s["recommended_epochs"] >= 1
    assert ("retrained_epochs" in s) is retrain
    assert any("lr-range-test" in r and r.endswith("report_html") for r in [x.split(":")[0] for x in s["reports"]])
    assert (tmp_path / "mlflow.db").is_file() and _parent_runs(tmp_path / "mlflow.db")
    # Everything the run wrote is under the output folder.
    assert Path(s["pipeline_root"]).is_relative_to(tmp_path)


def test_fixed_lr_skips_discovery(tmp_path, shapes_dataset_dir, tiny_model_dir, monkeypatch):
    from pipelines.local_run import run_pipeline_locally

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = run_pipeline_locally(_cfg(shapes_dataset_dir, tiny_model_dir, lr=2e-4), tmp_path)
    s = run.summary()
    assert (s["lr_source"], s["lr_low"], s["lr_mid"], s["lr_high"]) == ("fixed", 2e-4, 2e-4, 2e-4)
    assert not [t for t in run.outputs if t.startswith("lr-range-test")]
