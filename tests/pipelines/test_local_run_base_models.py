"""`rangefinder run --local` on a hub id missing from an offline Hugging Face cache: the first step stops the run.

The hub id that is there goes through every step elsewhere, at less cost (issue 32): LoRA at a fixed LR through
the whole CLI run on a terminal (tests/pipelines/test_local_run.py::test_fixed_lr_from_a_hub_id_skips_discovery_and_
retrain_off), and the full fine-tune (with its range test) and textual inversion through every step's own function
to the registry (tests/pipelines/test_components.py::test_a_hub_id_through_every_step_registers_the_kept_checkpoint).
A single-file checkpoint takes the same road from the first step on: test_components.py converts one (without
metadata) through the first step's own function, once, into the folder in the config every later step reads, and
tests/models/test_loading.py shows that folder holds the file's weights.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from rangefinder.config import demo_config
from tests.mlflow_store import seed

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _offline_hub(fake_hub_cache, monkeypatch):
    """What a user on an air-gapped cluster has: a pre-filled Hugging Face cache and HF_HUB_OFFLINE."""
    cache, _ = fake_hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)


def test_a_hub_id_missing_from_the_offline_cache_stops_the_first_step(tmp_path, shapes_dataset_dir):
    """One line naming the step, the model and how to fill the cache; no traceback; no training step ran."""
    cfg = demo_config(data={"dataset_dir": str(shapes_dataset_dir), "resolution": 32},
                      model={"base_model": "rangefinder-tests/never-downloaded"})
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"kubernetes"})))
    seed(tmp_path / "out" / "mlflow.db")  # the run's default store, migrated: its first step skips MLflow's migrations
    r = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "run", "--local", "--config", str(config),
                        "--out", str(tmp_path / "out"), "--json"], capture_output=True, text=True,
                       env=dict(os.environ))
    assert r.returncode == 2 and r.stdout == ""
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("rangefinder run: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = lines
    assert ("step resolve-config failed: ConfigError: model.base_model: hub model "
            "'rangefinder-tests/never-downloaded'") in line
    assert "hf download rangefinder-tests/never-downloaded --revision main" in line
    log = (tmp_path / "out" / "pipeline.log").read_text()
    assert "Traceback" not in log
    ran = {p.name for p in next((tmp_path / "out" / "pipeline-root").iterdir()).iterdir()}
    assert not any(t.startswith(("prepare-dataset", "lr-range-test", "finetune")) for t in ran), ran
