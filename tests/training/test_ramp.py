"""The LR range test on the tiny model: validation loss falls, then rises, and divergence stops the ramp."""

from __future__ import annotations

import csv
import json

import pytest

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.training.loop import TrainSpec, train


@pytest.mark.slow
def test_linear_ramp_falls_then_rises_and_stops_on_divergence(split_dir, tiny_model_dir, tmp_path):
    # 16 images, batch 4: 40 updates over 10 epochs, LR climbing linearly to 0.03, far too high for this model.
    cfg = TrainingConfig(batch_size=4, epochs=10, schedule="linear-ramp", lr_max=0.03, seed=3,
                         cache_dir=str(tmp_path / "cache"), checkpoint_every_updates=8)
    val_cfg = ValidationConfig(every_updates=2, divergence_factor=4.0, divergence_window=3)
    result = train(TrainSpec(cfg, val_cfg, split_dir=split_dir, model=tiny_model_dir), out_dir=tmp_path / "run")

    assert result.status == "diverged"
    assert result.updates < result.planned_updates == 40
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    updates = [int(r["update"]) for r in table]
    val = [float(r["val_loss"]) for r in table]
    assert updates == list(range(0, result.updates + 1, 2))  # the curve up to the stop is kept
    best = val.index(min(val))
    assert 0 < best < len(val) - 1  # fell below the baseline first ...
    assert val[-1] > 3 * min(val)  # ... then blew up
    for r in table[1:]:  # the LR of the update just taken, per the linear ramp
        assert float(r["lr"]) == pytest.approx(0.03 * int(r["update"]) / 40, rel=1e-12)
    summary = json.loads(result.summary_path.read_text())
    assert summary["status"] == "diverged" and summary["final_dir"] is None
    assert not (tmp_path / "run" / "final").exists()

    # Killed after the stop's checkpoint, before the summary: the retry's resume reads the stop from the checkpoint
    # and ends there, instead of ramping on past the divergence and adding points above it to the curve.
    curve = (tmp_path / "run" / "metrics.csv").read_bytes()
    result.summary_path.unlink()
    again = train(TrainSpec(cfg.model_copy(update={"resume": True}), val_cfg, split_dir=split_dir,
                            model=tiny_model_dir), out_dir=tmp_path / "run")
    assert (again.status, again.updates) == ("diverged", result.updates)
    assert (tmp_path / "run" / "metrics.csv").read_bytes() == curve
