"""SDXL through the whole pipeline (issue 22), without the whole demo's minutes (issue 32, item 5).

Two proofs replace the run of the unchanged `rangefinder demo --family sdxl`:
- a small SDXL pipeline run, the smallest SD pipeline config (tests/pipelines/tiny_run.py) on the tiny SDXL model,
  through kfp.local as the demo runs: it writes the SD runs' reports and records the family, read from the model, in
  every tracked step's MLflow run;
- `rangefinder demo --family sdxl` compiles the pipeline the SD demo compiles, but for the base model: so the demo
  on SDXL is the small run's pipeline with the demo's settings, which tests/pipelines/test_demo_learns.py runs whole.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from tests.pipelines.tiny_run import DISCOVERY_REPORTS, tiny_config
from tests.tracking.fixtures import free_port

pytestmark = pytest.mark.slow


def test_a_small_sdxl_run_writes_the_reports_of_the_sd_run(tiny_sdxl_dir, shapes_dataset_dir, tmp_path):
    from rangefinder.pipelines.local_run import run_pipeline_locally

    out = tmp_path / "sdxl"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("MLFLOW_RUN_ID", raising=False)
        s = run_pipeline_locally(tiny_config(shapes_dataset_dir, tiny_sdxl_dir), out).summary()
    assert s["lr_source"] == "range-test" and s["lr_low"] < s["lr_mid"] < s["lr_high"]
    assert s["recommended_epochs"] >= 1 and s["registered_model"] == "models:/rangefinder-sd/1"
    # The discovery run's reports, by name: DISCOVERY_REPORTS, which the SD demo's run (test_local_run.py) writes too,
    # with its zoom's two (this config has no zoom; no retrain, whose column would be within sample-images-grid.html).
    # Reading the set, not that run, keeps this test from building the shared run on an xdist worker that has no
    # other use for it.
    sdxl = {os.path.basename(p) for p in s["reports"]}
    assert sdxl == DISCOVERY_REPORTS, sdxl
    # The model was SDXL all along: the family came from the model, into every tracked step's MLflow run.
    with sqlite3.connect(out / "mlflow.db") as con:
        families = con.execute("select r.name, t.value from runs r join tags t on t.run_uuid = r.run_uuid "
                               "where t.key = 'rangefinder.model_family'").fetchall()
    assert families and {value for _, value in families} == {"sdxl"}, families
    assert {name for name, _ in families} >= {"lr_range_test", "finetune"}, families


def test_demo_family_sdxl_changes_only_the_base_model(tiny_model_dir, tiny_sdxl_dir, tmp_path, monkeypatch, capsys):
    """`rangefinder demo --family sdxl` compiles OUT/pipeline.yaml before it runs it; here the run is refused before
    its first step starts, since the MLflow URI holds credentials (pipelines.local_run: one line, no step process,
    the secret not printed). The SD demo's pipeline, compiled as `demo` compiles it, into the same folder (so every
    other path is the same), differs only in the model."""
    from rangefinder.cli.commands.demo import prepare_demo
    from rangefinder.cli.main import main
    from rangefinder.pipelines.pipeline import compile_pipeline

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://someone:hunter2@127.0.0.1:{free_port()}")
    out = tmp_path / "demo"
    assert main(["demo", "--family", "sdxl", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "MLFLOW_TRACKING_URI" in err and "holds" in err and "hunter2" not in err, err[-3000:]
    assert not (out / "pipeline-root").exists()  # refused before kfp.local made its root: no step ran
    sdxl = (out / "pipeline.yaml").read_text()
    sd = Path(compile_pipeline(prepare_demo(out), str(tmp_path / "sd.yaml"))).read_text()
    assert str(tiny_model_dir) in sd and str(tiny_sdxl_dir) not in sd
    assert str(tiny_sdxl_dir) in sdxl and str(tiny_model_dir) not in sdxl
    assert sdxl.replace(str(tiny_sdxl_dir), str(tiny_model_dir)) == sd
