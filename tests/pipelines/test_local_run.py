"""The whole pipeline through kfp.local (SubprocessRunner, no containers) on the tiny model and shapes dataset.

Two runs cover the DAG's branches: discovery then the full-data retrain, and a fixed LR (no discovery) without it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from components.config import demo_config
from pipelines.commands.demo import missing_pieces

pytestmark = pytest.mark.slow

# The smallest run that still reads a curve: 4 epochs of 4 updates, validated every 2 (9 points); 2 fine-tune
# epochs (3 points); one prompt, 2 denoising steps.
TINY = {
    "lr_range_test": {"epochs": 4, "zoom": False},
    "finetune": {"epochs": 2},
    "retrain": {"epochs": 1},
    "sampling": {"prompts": ["a red circle"], "seeds": [0], "num_inference_steps": 2},
}


@pytest.fixture(scope="module", autouse=True)
def _pieces():
    missing = missing_pieces()
    if missing:
        pytest.skip("the steps' dependencies have not landed: " + "; ".join(missing))


@pytest.fixture(autouse=True)
def _local_mlflow(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)


def _cfg(dataset: Path, model: Path, **extra):
    return demo_config(data={"dataset_dir": str(dataset), "resolution": 32}, model={"base_model": str(model)},
                       **{**TINY, **extra})


def _mlflow_runs(db: Path) -> dict[str, str]:
    """run name -> status, from the SQLite store the run wrote."""
    with sqlite3.connect(db) as con:
        return dict(con.execute("select name, status from runs").fetchall())


def test_discovery_then_retrain(tmp_path, shapes_dataset_dir, tiny_model_dir):
    from pipelines.local_run import run_pipeline_locally

    run = run_pipeline_locally(_cfg(shapes_dataset_dir, tiny_model_dir, retrain={"enabled": True, "epochs": 1}),
                               tmp_path)
    s = run.summary()
    assert s["lr_source"] == "range-test"
    assert 0 < s["lr_low"] <= s["lr_mid"] <= s["lr_high"] < 1e-2
    assert s["recommended_epochs"] >= 1 and s["retrained_epochs"] == 1
    assert s["registered_model"].startswith("models:/")
    # The reports exist and the HTML embeds its plot (the KFP UI shows no image files).
    html = Path(run.artifacts[run.task("lr-range-test")]["report_html"]).read_text()
    assert "data:image/png;base64," in html
    assert Path(run.artifacts[run.task("sample-images")]["grid"]).stat().st_size > 1000
    # MLflow: one parent run closed by the exit handler, and a child per step, all under the output folder.
    runs = _mlflow_runs(tmp_path / "mlflow.db")
    for step in ("lr_range_test", "finetune", "retrain_full", "sample_images", "register_model"):
        assert runs.get(step) == "FINISHED", (step, runs)
    parents = [status for name, status in runs.items() if name.startswith("rangefinder-")]
    assert parents == ["FINISHED"]
    assert Path(s["pipeline_root"]).is_relative_to(tmp_path)


def test_fixed_lr_skips_discovery_and_retrain_off(tmp_path, shapes_dataset_dir, tiny_model_dir):
    """Through the CLI: `rangefinder run --local --config FILE`, as a person runs it on their own data."""
    cfg = _cfg(shapes_dataset_dir, tiny_model_dir, lr=2e-4)
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"kubernetes"})))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    r = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", "--local", "--config", str(config),
                        "--out", str(out), "--json"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)  # the steps' logs went to OUT/pipeline.log: stdout is the result only
    assert Path(s["log"]).is_file() and "finetune" in Path(s["log"]).read_text()
    assert (s["lr_source"], s["lr_low"], s["lr_mid"], s["lr_high"]) == ("fixed", 2e-4, 2e-4, 2e-4)
    run_dir = Path(s["pipeline_root"])
    tasks = {p.name for p in run_dir.iterdir()}
    assert not [t for t in tasks if t.startswith("lr-range-test") or t.startswith("retrain-full")], tasks
    assert [t for t in tasks if t.startswith("finetune")] and "retrained_epochs" not in s
    runs = _mlflow_runs(out / "mlflow.db")
    assert "lr_range_test" not in runs and runs.get("finetune") == "FINISHED"


def test_failed_step_is_one_error_and_recorded(tmp_path, shapes_dataset_dir, tiny_model_dir):
    """A step that fails stops the run with one error naming it; the exit handler still marks MLflow FAILED."""
    from components.errors import RangefinderError
    from pipelines.local_run import run_pipeline_locally

    cfg = _cfg(tmp_path / "no-such-dataset", tiny_model_dir)
    with pytest.raises(RangefinderError, match="prepare-dataset"):
        run_pipeline_locally(cfg, tmp_path)
    parents = [status for name, status in _mlflow_runs(tmp_path / "mlflow.db").items()
               if name.startswith("rangefinder-")]
    assert parents == ["FAILED"]
