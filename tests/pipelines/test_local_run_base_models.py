"""A real user's first run: `rangefinder run --local` on a hub id, through every step to the registry.

The base model is the tiny model, published as hub repo HUB_REPO in a fake, offline Hugging Face cache
(tests/models/fake_hub.py; HF_HUB_OFFLINE=1, HF_HUB_CACHE set). Each run is as small as the pipeline allows: 2
fine-tune epochs validated every update (9 points: with 5, a steady fall is not yet significant and no window is
read), one prompt, one seed, 2 denoising steps. The full fine-tune discovers its LR (4 range-test epochs, the fewest
that give readable bounds); textual inversion takes a fixed LR, which skips only the range test, whose model loading
is the fine-tune's (both call the engine on the config's resolved folder). Checked on each: the first step resolved
the model once and every later step used that folder (the grid's base column included); the registered version
holds exactly the kept checkpoint's weights at the recommended update, and its tags and description say which and
why.

A single-file checkpoint takes the same road from the first step on: tests/pipelines/test_components.py converts one
(without metadata) through the first step's own function, once, into the folder in the config every later step
reads, and tests/models/test_loading.py shows that folder holds the file's weights (issue 32: a whole run for it
cost the suite about a minute and proved nothing the hub-id runs do not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rangefinder.config import demo_config
from tests.conftest import HUB_REPO
from tests.pipelines.registered_model import check_registered_is_the_kept_checkpoint, task_dir

pytestmark = pytest.mark.slow

TINY = {
    "lr_range_test": {"epochs": 4, "zoom": False},
    "finetune": {"epochs": 2},
    "validation": {"every_updates": 1},
    "sampling": {"prompts": ["a red circle"], "seeds": [0], "num_inference_steps": 2},
}
# A fixed LR per method near the tiny model's measured midpoints (config.DEFAULT_LR_RANGE's comment); textual inversion
# 2e-2 since the tiny model reads its captions (BUILDER_VERSION 3): at 6e-3 its 8 updates recommended no window.
FIXED_LR = {"textual_inversion": 2e-2}


@pytest.fixture(autouse=True)
def _offline_hub(fake_hub_cache, monkeypatch):
    """What a user on an air-gapped cluster has: a pre-filled Hugging Face cache and HF_HUB_OFFLINE."""
    cache, _ = fake_hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)


def _config(method: str, model: dict, dataset: Path):
    lr = {"lr": FIXED_LR[method]} if method in FIXED_LR else {}
    return demo_config(data={"dataset_dir": str(dataset), "resolution": 32}, model=model,
                       training={"method": method}, **TINY, **lr)


def _run_cli(cfg, out: Path) -> dict:
    config = out.parent / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"kubernetes"})))
    r = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "run", "--local", "--config", str(config),
                        "--out", str(out), "--json"], capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


# LoRA from a hub id adds no path of its own: model loading is method-independent, LoRA runs a whole pipeline in
# test_local_run.py (test_fixed_lr_skips_discovery_and_retrain_off), and each whole run costs about a minute of the
# suite's budget.
@pytest.mark.parametrize("method", ["full", "textual_inversion"])
def test_hub_id_through_every_step(method, tmp_path, shapes_dataset_dir, fake_hub_cache):
    cache, commit = fake_hub_cache
    s = _run_cli(_config(method, {"base_model": HUB_REPO}, shapes_dataset_dir), tmp_path / "out")
    assert s["lr_source"] == ("fixed" if method in FIXED_LR else "range-test")
    assert s["registered_model"] == "models:/rangefinder-sd/1"
    snapshot = cache / f"models--{HUB_REPO.replace('/', '--')}" / "snapshots" / commit
    # Resolved once, by the first step, into the config every later step read.
    resolved = json.loads(json.loads((task_dir(s, "resolve-config") / "executor_output.json").read_text())
                          ["parameterValues"]["config_json"])["model"]
    assert (resolved["base_model"], resolved["resolved_dir"]) == (HUB_REPO, str(snapshot))
    check_registered_is_the_kept_checkpoint(s, tmp_path / "out", snapshot, method)


def test_a_hub_id_missing_from_the_offline_cache_stops_the_first_step(tmp_path, shapes_dataset_dir):
    """One line naming the step, the model and how to fill the cache; no traceback; no training step ran."""
    cfg = _config("full", {"base_model": "rangefinder-tests/never-downloaded"}, shapes_dataset_dir)
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"kubernetes"})))
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
