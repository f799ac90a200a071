"""`training.prediction_type` over the base model's: every model a run delivers predicts what it was trained to.

A short real `full` fine-tune of the tiny SD 1.x model, trained as v-prediction on the epsilon model (and as epsilon
on the same model whose scheduler says v_prediction), keeping its checkpoints. Its final folder, a checkpoint written
out as the fine-tune's `chosen/` and as the window average's `final/` (training/restore.py `save_checkpoint_model`,
as steps/finetune.py and steps/average.py call it), the pipeline the grid samples a checkpoint with and the whole
pipeline the registry logs (sampling.py) are read by diffusers' own loaders, as a consumer reads them (MLflow's
logged model loads the folder with `DiffusionPipeline.from_pretrained`, tracking/sd_pyfunc.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.formats import checkpoints
from rangefinder.training.loop import TrainSpec, train

# (what the base model's scheduler predicts, training.prediction_type)
CASES = [("epsilon", "v_prediction"), ("v_prediction", "epsilon")]


def _predicts(folder: Path) -> str:
    from diffusers import DiffusionPipeline

    return str(DiffusionPipeline.from_pretrained(str(folder)).scheduler.config.prediction_type)


@pytest.fixture(scope="module", params=CASES, ids=["epsilon-model-trained-as-v", "v-model-trained-as-epsilon"])
def overridden(request, split_dir, tiny_model_dir, tmp_path_factory):
    """(base model folder, the prediction type trained, the run's result): 2 updates, a checkpoint after each."""
    base_predicts, trained = request.param
    tmp = tmp_path_factory.mktemp("predicts")
    base = Path(tiny_model_dir)
    if json.loads((base / "scheduler" / "scheduler_config.json").read_text())["prediction_type"] != base_predicts:
        base = Path(shutil.copytree(tiny_model_dir, tmp / "base"))
        config = base / "scheduler" / "scheduler_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "prediction_type": base_predicts}))
    assert _predicts(base) == base_predicts != trained
    cfg = TrainingConfig(batch_size=4, lr=1e-4, seed=7, cache_dir=str(tmp / "cache"), steps=2, prediction_type=trained,
                         checkpoint_every_updates=1, keep_checkpoints=2)
    result = train(TrainSpec(cfg, ValidationConfig(every_epochs=0), split_dir=split_dir, model=base),
                   out_dir=tmp / "run")
    assert result.status == "ok" and len(result.checkpoints) == 2
    return base, trained, result


def test_every_delivered_folder_predicts_what_was_trained(overridden, tmp_path):
    """final/, a checkpoint as chosen/ and the window average as average/final/ all load predicting the type trained,
    not the base model's."""
    from rangefinder.steps.average import average_weights
    from rangefinder.training.restore import save_checkpoint_model

    base, trained, result = overridden
    chosen = save_checkpoint_model(result.checkpoints[0], base, tmp_path / checkpoints.CHOSEN_DIR)
    average = save_checkpoint_model(result.checkpoints[-1], base, tmp_path / "average" / "final",
                                    weights=average_weights(list(result.checkpoints)))
    assert {name: _predicts(folder) for name, folder in
            (("final", result.final_dir), ("chosen", chosen), ("average", average))} == dict.fromkeys(
        ("final", "chosen", "average"), trained)


def test_a_checkpoint_is_sampled_and_registered_predicting_what_was_trained(overridden, tmp_path):
    """The grid's checkpoint column samples with the type trained, and the pipeline export_pipeline makes of a
    checkpoint (what the registry logs) loads with it."""
    from rangefinder.sampling import export_pipeline, load_column_pipeline, resolve_column

    base, trained, result = overridden
    column = resolve_column(result.checkpoints[-1])
    assert column.kind == "engine_checkpoint"
    pipe = load_column_pipeline(column, base, device="cpu")
    assert pipe.scheduler.config.prediction_type == trained
    assert _predicts(export_pipeline(result.checkpoints[-1], base, tmp_path / "pipeline")) == trained
