"""The fine-tune's window average (steps/average.py): the checkpoints inside the step window averaged, validated on the
run's own terms, and delivered when they measure lower than the window's pick."""

from __future__ import annotations

import json

import pytest
import torch

from rangefinder.config import demo_config
from rangefinder.data.split import read_split
from rangefinder.formats import checkpoints
from rangefinder.steps.average import AVERAGE_DIR, average_weights
from rangefinder.training.spec import TrainSpec
from tests.tracking.fixtures import without_mlflow_run_env

LR = 1e-3


def _config(tiny_model_dir, tmp, **finetune):
    return demo_config(model={"base_model": str(tiny_model_dir)},
                       finetune={"epochs": 6, "successive_halving": False, **finetune},
                       training={"cache_dir": str(tmp / "cache")}, sampling={"every_validations": None},
                       validation={"every_epochs": 0.5},
                       tracking={"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment_name": "average",
                                 "registered_model_name": None})


@pytest.fixture(scope="module")
def averaged(split_dir, tiny_model_dir, tmp_path_factory):
    """A 6-epoch full fine-tune (16 images at batch 4: 24 updates, a validation every 2, a checkpoint every 4) through
    the step with finetune.average on, logging to a real sqlite store; and the same run's checkpoints kept whole (the
    step removes all but its pick) from a plain run of the same spec."""
    from rangefinder.launch.processes import run_training
    from rangefinder.steps.finetune import run_finetune

    tmp = tmp_path_factory.mktemp("average")
    with without_mlflow_run_env():
        cfg = _config(tiny_model_dir, tmp, average="on")
        result = run_finetune(cfg, split_dir=split_dir, lr_low=LR, lr_high=LR, lr_mid=LR, lr_source="fixed",
                              model_dir=tmp / "ft")
    split = read_split(split_dir)
    spec = TrainSpec.finetune(cfg, split, bounds=(LR, LR), lr=LR, world_size=1)
    plain = run_training(cfg, spec, out_dir=tmp / "plain", split=split)
    return cfg, tmp, result, spec, plain


def test_a_checkpoint_s_own_weights_measure_what_its_run_measured(averaged, split_dir):
    """measure_weights is the run's validation: a checkpoint's weights, measured outside the run, give the loss the
    run's curve has at that update, bit for bit."""
    from rangefinder.training.loop import measure_weights

    _, tmp, _, spec, plain = averaged
    curve = dict(zip(plain.curve["update"], plain.curve["val_loss"], strict=True))
    for ckpt in checkpoints.list_checkpoints(tmp / "plain" / "checkpoints")[:2]:
        row = measure_weights(spec, checkpoints.read_weights(ckpt), out_dir=tmp / f"m-{ckpt.name}",
                              split=read_split(split_dir))
        assert row["val_loss"] == curve[float(checkpoints.checkpoint_update(ckpt))]


def test_the_window_s_checkpoints_are_averaged_measured_and_the_lower_delivered(averaged, split_dir):
    """The step averaged exactly the checkpoints inside its window (the plain run's, which are the same run's), its
    measurement is that average's validation loss, and the average is delivered exactly when it measures below the
    window's pick: chosen/ then holds the average, and the report, decision.json and MLflow say so."""
    from diffusers import UNet2DConditionModel
    from mlflow import MlflowClient

    from rangefinder.training.loop import measure_weights

    cfg, tmp, result, spec, _ = averaged
    info = result.chosen
    avg = info["average"]
    start, end = info.get("window_start_update"), info.get("window_end_update")
    kept = checkpoints.checkpoints_by_update(tmp / "plain" / "checkpoints")
    inside = [u for u in sorted(kept) if start <= u <= end]
    assert avg["updates"] == inside and len(inside) >= 2
    mean = average_weights([kept[u] for u in inside])
    floats = [k for k in mean if mean[k].is_floating_point()]
    by_hand = {k: sum(checkpoints.read_weights(kept[u])[k] for u in inside) / len(inside) for k in floats}
    assert floats and all(torch.allclose(mean[k], by_hand[k], atol=1e-6) for k in floats)
    assert int(mean["method.updates"]) == inside[-1]  # the updates that made the newest of them
    assert avg["val_loss"] == measure_weights(spec, mean, out_dir=tmp / "again", split=read_split(split_dir))[
        "val_loss"]

    work = tmp / "ft"
    assert avg["delivered"] is (avg["val_loss"] < avg["pick_val_loss"])
    if avg["delivered"]:
        assert (info["rule"], info["update"], info["val_loss"]) == ("window_average", inside[-1], avg["val_loss"])
        assert info["window_pick"]["val_loss"] == avg["pick_val_loss"]
        unet = UNet2DConditionModel.from_pretrained(str(work / checkpoints.CHOSEN_DIR / "unet")).state_dict()
        assert all(torch.equal(unet[k.removeprefix("unet.")], v) for k, v in mean.items() if k.startswith("unet."))
    else:
        assert info["rule"] == "window_lowest" and info["val_loss"] == avg["pick_val_loss"]
    assert checkpoints.read_chosen(work) == info
    assert not (work / AVERAGE_DIR / "final").exists()  # delivered (moved) or dropped
    assert json.loads((work / "report" / "decision.json").read_text())["chosen"]["average"] == avg
    assert avg["sentence"] in (work / "report" / "step_report.md").read_text()
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name("average").experiment_id
    (ft,) = client.search_runs([exp], filter_string="tags.`rangefinder.step` = 'finetune'")
    assert ft.data.metrics["average_val_loss"] == avg["val_loss"]
    assert ft.data.tags["average_delivered"].lower() == str(avg["delivered"]).lower()


def test_checkpoints_of_different_runs_are_not_averaged(tmp_path):
    from safetensors.torch import save_file

    from rangefinder.errors import RangefinderError
    from rangefinder.formats.digest import file_sha256

    for name, key in (("a", "x"), ("b", "y")):
        d = tmp_path / name
        d.mkdir()
        save_file({key: torch.ones(2)}, str(d / checkpoints.WEIGHTS_NAME))
        for other in (checkpoints.OPTIMIZER_NAME, checkpoints.STATE_NAME):
            (d / other).write_text("{}")
        sums = {f.name: file_sha256(f) for f in d.iterdir()}
        (d / checkpoints.MANIFEST_NAME).write_text(json.dumps({"sha256": sums}))
    with pytest.raises(RangefinderError, match="other tensors"):
        average_weights([tmp_path / "a", tmp_path / "b"])


@pytest.mark.parametrize(("settings", "warned"), [
    ({"finetune": {"average": "on"}, "training": {"use_ema": True}}, "does nothing with training.use_ema"),
    ({"finetune": {"average": "on"}, "training": {"optimizer": "adamw_schedule_free"}},
     "does nothing with training.optimizer adamw_schedule_free"),
    ({"finetune": {"average": "on"}}, None),
    ({}, None),  # the default: on
])
def test_an_average_asked_for_where_it_cannot_run_is_one_warning(settings, warned):
    import yaml

    from rangefinder.config import parse_config, setting_conflicts
    from rangefinder.steps.average import average_applies

    cfg = parse_config(settings)
    lines = [ln for ln in setting_conflicts(cfg) if "average" in ln]
    assert lines == ([] if warned is None else [lines[0]]) and (warned is None or warned in lines[0])
    assert average_applies(cfg, True) is (settings in ({"finetune": {"average": "on"}}, {}))
    several = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"num_nodes": 2})})
    assert not average_applies(several, True)
    from rangefinder.steps.average import not_on_several_nodes

    said = not_on_several_nodes(several)  # the fine-tune's note, where it was asked for and did not run
    assert (said is not None and said.startswith("Window average: not measured")) is (cfg.finetune.average == "on")
    assert not_on_several_nodes(cfg) is None
    assert parse_config(yaml.safe_load("finetune:\n  average: off\n")).finetune.average == "off"


def test_the_registered_version_names_the_average_it_holds():
    """register_model's `rangefinder.weights` tag: the checkpoint's name, or for weights that are no checkpoint what
    they are (it said "finetune None" for them)."""
    from rangefinder.steps.register_model import delivered_name

    assert delivered_name({"checkpoint": "checkpoint-000012", "rule": "window_lowest"}) == "checkpoint-000012"
    assert delivered_name({"checkpoint": None, "rule": "window_average", "update": 16,
                           "average": {"updates": [8, 12, 16]}}) == "window average of updates 8-16"
    assert delivered_name({"checkpoint": None, "rule": "cooldown", "update": 20}) == "cooldown at update 20"
