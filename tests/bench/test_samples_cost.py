"""The samples-cost benchmark keeps working: the demo's fine-tune step with samples during training on and off."""

import json

import pytest


@pytest.mark.slow
def test_samples_cost_smoke(tmp_path, monkeypatch):
    from bench.samples_cost import main

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "samples.json"
    result = main(["--smoke", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    saved = json.loads(out.read_text())
    assert saved["summary"] == result["summary"] and saved["machine"]["python"]
    by_arm = {r["arm"]: r for r in saved["runs"]}
    # 2 epochs of 16 images, validated every epoch (3 validations): auto samples each of them; off none.
    assert by_arm["auto"]["grids"] == 3 and by_arm["off"]["grids"] == 0
    assert by_arm["auto"]["render_seconds"] > 0 and by_arm["off"]["render_seconds"] == 0
    s = saved["summary"]["finetune"]
    assert s["grids"] == 3 and s["off_seconds"] > 0 and "added_pct" in s and "demo" not in saved["summary"]
