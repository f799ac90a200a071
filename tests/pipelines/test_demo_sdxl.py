"""`rangefinder demo --family sdxl` (issue 22): the embedded demo, unchanged, on the tiny SDXL model, through every
step on this machine; it writes the reports the SD demo writes and records the family in MLflow."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_on_sdxl_writes_the_reports_of_the_sd_demo(tiny_sdxl_dir, default_local_run, tmp_path):
    out = tmp_path / "demo-sdxl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    r = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "demo", "--family", "sdxl", "--out", str(out),
                        "--json"], capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["lr_source"] in ("range-test", "zoom") and s["lr_low"] < s["lr_mid"] < s["lr_high"]
    assert s["recommended_epochs"] >= 1 and s["registered_model"] == "models:/rangefinder-sd/1"
    # The same reports as the SD pipeline's (the SD run here has no zoom; the demo may zoom: one report more).
    sd = {p.name for p in default_local_run.reports}
    sdxl = {os.path.basename(p) for p in s["reports"]}
    assert sd - sdxl == set() and sdxl - sd <= {"lr-range-test-zoom.html", "lr-range-test-zoom.md"}, (sd, sdxl)
    # The model was SDXL all along: the family came from the model, into every tracked step's MLflow run.
    with sqlite3.connect(out / "mlflow.db") as con:
        families = con.execute("select r.name, t.value from runs r join tags t on t.run_uuid = r.run_uuid "
                               "where t.key = 'rangefinder.model_family'").fetchall()
    assert families and {value for _, value in families} == {"sdxl"}, families
    assert {name for name, _ in families} >= {"lr_range_test", "finetune"}, families
