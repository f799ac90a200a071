"""The sample-images step's grid columns: the base model, the delivered weights, the kept checkpoints, final/."""

from __future__ import annotations

import json
from pathlib import Path

from rangefinder.config import demo_config
from rangefinder.formats import checkpoints
from rangefinder.steps.sample_images import grid_columns


def test_the_grid_shows_the_base_the_chosen_checkpoint_once_the_others_then_final_and_retrained(tiny_model_dir,
                                                                                                tmp_path):
    run = tmp_path / "finetuned"
    for update in (8, 4, 12):  # listed oldest first whatever order they were written in
        ckpt = run / checkpoints.RUN_DIR / f"checkpoint-{update}"
        ckpt.mkdir(parents=True)
        for name in checkpoints.REQUIRED:
            (ckpt / name).write_text("{}")
    (run / checkpoints.CHOSEN_DIR).mkdir()
    (run / checkpoints.CHOSEN_INFO).write_text(json.dumps({"checkpoint": "checkpoint-8", "update": 8, "epoch": 2,
                                                           "rule": "window_lowest"}))
    cfg = demo_config(model={"base_model": str(tiny_model_dir)})
    models, labels = grid_columns(cfg, run, tmp_path / "retrained")
    assert labels == ["base", "chosen (epoch 2, update 8)", "update 4", "update 12", "fine-tuned (final)", "retrained"]
    assert [Path(m) for m in models] == [Path(tiny_model_dir).resolve(), run / "chosen",
                                         run / "checkpoints" / "checkpoint-4", run / "checkpoints" / "checkpoint-12",
                                         run / "final", tmp_path / "retrained" / "final"]
