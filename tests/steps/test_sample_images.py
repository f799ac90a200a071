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


def test_the_grid_run_s_description_reads_as_a_sentence_for_prompts_of_one_s_own(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    """The sample-images run's description, as MLflow shows it, for prompts that are not the synthetic data's (no
    colour scores): it ended "how well each follows the prompts' colours: ." and counted "1 prompts x 1 seeds"."""
    import shutil

    from mlflow import MlflowClient

    from rangefinder.steps.sample_images import run_sample_images

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    finetuned = tmp_path / "finetuned"
    shutil.copytree(tiny_model_dir, finetuned / "final")  # a whole fine-tune's final/ (the base model's weights)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = demo_config(model={"base_model": str(tiny_model_dir)},
                      sampling={"prompts": ["a photo of a dog"], "seeds": [0], "num_inference_steps": 1},
                      tracking={"tracking_uri": uri, "experiment_name": "grid-note", "registered_model_name": None})
    out = run_sample_images(cfg, finetuned_dir=finetuned, out_dir=tmp_path / "grid")
    assert out["scores"] == []  # nothing to score these prompts by
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("grid-note").experiment_id])
    assert run.data.tags["mlflow.note.content"] == (
        "Sample grid: 1 prompt x 1 seed for base, fine-tuned (final), the same noise in every column.")
    # The synthetic data's prompts (the demo's) are scored, and the note gives each column's colour score.
    from rangefinder.steps.sample_images import grid_note

    assert grid_note(4, 3, ["base", "chosen"], [{"column": "base", "colour": 0.479}, {"column": "chosen",
                                                                                     "colour": 0.763}]) == (
        "Sample grid: 4 prompts x 3 seeds for base, chosen, the same noise in every column; how well each follows "
        "the prompts' colours: base 0.48, chosen 0.76.")
