"""`training.prediction_type` over the base model's: every model a run delivers predicts what it was trained to.

A short real `full` fine-tune of the tiny SD 1.x model, trained as v-prediction on the epsilon model (and as epsilon
on the same model whose scheduler says v_prediction), keeping its checkpoints. Its final folder, a checkpoint written
out as the fine-tune's `chosen/` and as the window average's `final/` (training/restore.py `save_checkpoint_model`,
as steps/finetune.py and steps/average.py call it), the pipeline the grid samples a checkpoint with and the whole
pipeline the registry logs (sampling.py) are read by diffusers' own loaders, as a consumer reads them (MLflow's
logged model loads the folder with `DiffusionPipeline.from_pretrained`, tracking/sd_pyfunc.py); their single files
say it as ComfyUI's saver does, and rangefinder's own readers of a single file read it back. A one-update run's
checkpoint and final folder sample with the base model's own scheduler class (SD 1.5's PNDM, SDXL's Euler), not the
training DDPM.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.formats import checkpoints
from rangefinder.training.loop import TrainSpec, train
from rangefinder.training.spec import TrainResult

# (what the base model's scheduler predicts, training.prediction_type)
CASES = [("epsilon", "v_prediction"), ("v_prediction", "epsilon")]


def _predicts(folder: Path) -> str:
    from diffusers import DiffusionPipeline

    return str(DiffusionPipeline.from_pretrained(str(folder)).scheduler.config.prediction_type)


@dataclass
class Run:
    base: Path  # the base model's folder
    trained: str  # training.prediction_type
    result: TrainResult
    chosen: Path  # its first checkpoint written out as the fine-tune's chosen/
    average: Path  # its two checkpoints' average written out as the window average's final/


@pytest.fixture(scope="module", params=CASES, ids=["epsilon-model-trained-as-v", "v-model-trained-as-epsilon"])
def overridden(request, split_dir, tiny_model_dir, tmp_path_factory) -> Run:
    """2 updates, a checkpoint after each, and what the fine-tune's steps write of them."""
    from rangefinder.steps.average import average_weights
    from rangefinder.training.restore import AveragedWeights, save_checkpoint_model

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
    result = train(TrainSpec(cfg, ValidationConfig(every_epochs=0), split_dir=split_dir, model=base,
                             title="rf-predicts"), out_dir=tmp / "run")
    assert result.status == "ok" and len(result.checkpoints) == 2
    chosen = save_checkpoint_model(result.checkpoints[0], base, tmp / checkpoints.CHOSEN_DIR)
    average = save_checkpoint_model(result.checkpoints[-1], base, tmp / "average" / "final",
                                    weights=AveragedWeights(average_weights(list(result.checkpoints))))
    return Run(base, trained, result, chosen, average)


def test_every_delivered_folder_predicts_what_was_trained(overridden):
    """final/, a checkpoint as chosen/ and the window average as average/final/ all load predicting the type trained,
    not the base model's."""
    run = overridden
    folders = {"final": run.result.final_dir, "chosen": run.chosen, "average": run.average}
    assert {name: _predicts(folder) for name, folder in folders.items()} == dict.fromkeys(folders, run.trained)


def test_a_checkpoint_is_sampled_and_registered_predicting_what_was_trained(overridden, tmp_path):
    """The grid's checkpoint column samples with the type trained, and the pipeline export_pipeline makes of a
    checkpoint (what the registry logs) loads with it."""
    from rangefinder.sampling import export_pipeline, load_column_pipeline, resolve_column

    run = overridden
    column = resolve_column(run.result.checkpoints[-1])
    assert column.kind == "engine_checkpoint"
    pipe = load_column_pipeline(column, run.base, device="cpu")
    assert pipe.scheduler.config.prediction_type == run.trained
    assert _predicts(export_pipeline(run.result.checkpoints[-1], run.base, tmp_path / "pipeline")) == run.trained


def test_the_single_files_say_what_was_trained_and_rangefinder_reads_it_back(overridden, tmp_path):
    """Each model.safetensors says what its UNet predicts as ComfyUI's own saver does: a `v_pred` tensor when it
    predicts v (what ComfyUI and A1111 read, for SDXL), `modelspec.predict_key` either way. rangefinder's own readers
    of a single file, the grid's single-file column and a single file as the base model, take the architecture and
    scheduler from the base model's folder and then predict what the file says."""
    from safetensors import safe_open

    from rangefinder.config import ModelConfig
    from rangefinder.formats.single_file import PREDICT_KEY, SINGLE_FILE_NAME, V_PRED_KEY
    from rangefinder.models.loading import resolve_base_model
    from rangefinder.sampling import load_column_pipeline, resolve_column

    run = overridden
    for folder in (run.result.final_dir, run.chosen, run.average):
        with safe_open(str(folder / SINGLE_FILE_NAME), framework="pt") as f:
            said = (V_PRED_KEY in f.keys(), (f.metadata() or {}).get(PREDICT_KEY))
        assert said == {"v_prediction": (True, "v"), "epsilon": (False, "epsilon")}[run.trained], folder
    file = run.result.final_dir / SINGLE_FILE_NAME
    column = resolve_column(file)
    assert column.kind == "single_file"
    assert load_column_pipeline(column, run.base, device="cpu").scheduler.config.prediction_type == run.trained
    converted = resolve_base_model(ModelConfig(base_model=str(file), cache_dir=str(tmp_path / "cache")))
    assert _predicts(converted.path) == run.trained


def test_the_single_files_name_the_run_and_what_it_trained_in_their_model_spec(overridden):
    """The model spec of final/'s single file (what SwarmUI lists and samples a checkpoint by: its title, date and
    resolution, and modelspec.prediction_type, which it applies where ComfyUI and A1111 read nothing for SD 1.x)
    names the run: its title (the spec's, as a pipeline step gives its registered model name), the resolution it
    trained at and when it started, as run_summary.json records them; and what it trained the UNet to predict, not
    what the base model predicts. chosen/ and the average's final/, written out of the run's checkpoints, say the
    same."""
    import datetime

    from rangefinder.formats.single_file import SINGLE_FILE_NAME
    from rangefinder.formats.weights_file import read_metadata

    run = overridden
    summary = json.loads(run.result.summary_path.read_text())
    started = datetime.datetime.fromisoformat(summary["started"])
    assert started.utcoffset() == datetime.timedelta(0)
    assert abs(datetime.datetime.now(datetime.timezone.utc) - started) < datetime.timedelta(hours=1)
    predicts = {"v_prediction": "v", "epsilon": "epsilon"}[run.trained]
    specs = {name: {k: v for k, v in read_metadata(folder / SINGLE_FILE_NAME).items() if k.startswith("modelspec.")}
             for name, folder in (("final", run.result.final_dir), ("chosen", run.chosen), ("average", run.average))}
    assert specs["final"] == {
        "modelspec.sai_model_spec": "1.0.1", "modelspec.architecture": "stable-diffusion-v1",
        "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
        "modelspec.title": "rf-predicts", "modelspec.resolution": f"{summary['resolution']}x{summary['resolution']}",
        "modelspec.date": summary["started"], "modelspec.prediction_type": predicts,
        "modelspec.predict_key": predicts}
    assert specs["chosen"] == specs["average"] == specs["final"]


def _shipping_pndm(model_dir: Path, out: Path) -> Path:
    """A copy of an SD 1.x folder whose own sampling scheduler is PNDM, as Stable Diffusion 1.5's is (its
    model_index.json and scheduler/ say PNDMScheduler; it trains with DDPM all the same)."""
    from diffusers import PNDMScheduler

    folder = Path(shutil.copytree(model_dir, out))
    PNDMScheduler.from_pretrained(str(folder), subfolder="scheduler").save_pretrained(str(folder / "scheduler"))
    index = folder / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "scheduler": ["diffusers", "PNDMScheduler"]}))
    return folder


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_a_checkpoint_and_the_final_folder_sample_with_the_base_model_s_own_scheduler_predicting_what_was_trained(
        family, split_dir, tiny_model_dir, tiny_sdxl_dir, tmp_path):
    """A run's checkpoint column in the grid, and the final folder it saves, sample with the base model's own
    scheduler (model_index.json: PNDM for an SD 1.x model as SD 1.5 ships, Euler for the tiny SDXL as for SDXL), set up
    from its config, predicting what the run trained: not the run's training DDPMScheduler, and not the base model's
    prediction type. So a grid's columns of one run differ only in their weights, as its base column does."""
    from diffusers import DiffusionPipeline

    from rangefinder.sampling import load_column_pipeline, resolve_column

    base = _shipping_pndm(tiny_model_dir, tmp_path / "base") if family == "sd1" else Path(tiny_sdxl_dir)
    own = json.loads((base / "scheduler" / "scheduler_config.json").read_text())
    assert json.loads((base / "model_index.json").read_text())["scheduler"][1] == own["_class_name"] != "DDPMScheduler"
    assert own["prediction_type"] == "epsilon"
    cfg = TrainingConfig(batch_size=4, lr=1e-4, seed=7, cache_dir=str(tmp_path / "cache"), steps=1,
                         prediction_type="v_prediction", checkpoint_every_updates=1)
    result = train(TrainSpec(cfg, ValidationConfig(every_epochs=0), split_dir=split_dir, model=base),
                   out_dir=tmp_path / "run")
    assert result.status == "ok" and len(result.checkpoints) == 1
    column = resolve_column(result.checkpoints[0])
    assert column.kind == "engine_checkpoint"
    schedulers = {"base": DiffusionPipeline.from_pretrained(str(base)).scheduler,
                  "checkpoint": load_column_pipeline(column, base, device="cpu").scheduler,
                  "final": DiffusionPipeline.from_pretrained(str(result.final_dir)).scheduler}
    expected = {k: v for k, v in own.items() if not k.startswith("_")}
    for name, scheduler in schedulers.items():
        assert type(scheduler).__name__ == own["_class_name"], name
        trained = "epsilon" if name == "base" else "v_prediction"
        assert {k: scheduler.config[k] for k in expected} == expected | {"prediction_type": trained}, name


@pytest.mark.parametrize("method, predicts, warned", [
    ("lora", "v_prediction", True), ("textual_inversion", "v_prediction", True),
    ("lora", "epsilon", False), ("full", "v_prediction", False), ("lora", None, False)])
def test_an_adapter_trained_to_predict_other_than_its_base_model_is_warned_of(tiny_model_dir, capsys, method,
                                                                             predicts, warned):
    """A LoRA or an embedding is sampled on its base model with that model's scheduler, which reads its denoiser's
    output as the model predicts: one trained to another target (training.prediction_type v_prediction on the epsilon
    tiny model) trained without a word. Full fine-tuning may change the target (its folder says the new one); a
    prediction_type equal to the model's changes nothing."""
    from rangefinder.config import ModelConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.family import Sd1Family

    sd = load_sd_components(ModelConfig(base_model=str(tiny_model_dir)))
    family = Sd1Family.for_model(sd, TrainingConfig(method=method, prediction_type=predicts))
    assert family.prediction_type == (predicts or "epsilon")
    said = capsys.readouterr().err
    assert ("training.prediction_type v_prediction with method" in said) is warned, said
    if warned:
        assert said.count("rangefinder: warning:") == 1 and "which reads it as epsilon" in said, said
