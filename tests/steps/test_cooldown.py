"""The fine-tune's cooldown (steps/cooldown.py): a branch of the fine-tune from one of its checkpoints, trained to the
recommended length with its last stretch decaying, delivered when it measures lower than the window's pick."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rangefinder.config import demo_config
from rangefinder.data.split import read_split
from rangefinder.errors import ConfigError
from rangefinder.formats import checkpoints
from rangefinder.steps.cooldown import COOLDOWN_DIR
from rangefinder.training.spec import TrainSpec
from tests.tracking.fixtures import without_mlflow_run_env

LR = 1e-3


def _config(tiny_model_dir, tmp, **finetune):
    return demo_config(model={"base_model": str(tiny_model_dir)},
                       # The window average off: it would weigh its average against the cooldown's verdict.
                       finetune={"epochs": 3, "successive_halving": False, "average": "off", **finetune},
                       training={"cache_dir": str(tmp / "cache")}, sampling={"every_validations": None},
                       validation={"every_epochs": 0.5},  # 7 points: enough for the window's trend test
                       tracking={"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment_name": "cooldown",
                                 "registered_model_name": None})


@pytest.fixture(scope="module")
def cooled(split_dir, tiny_model_dir, tmp_path_factory):
    """A 3-epoch full fine-tune (16 images at batch 4: 12 updates, a validation every 2, a checkpoint every 4) through
    the step, with finetune.cooldown auto (on for full fine-tuning), logging to a real sqlite store."""
    from rangefinder.steps.finetune import run_finetune

    tmp = tmp_path_factory.mktemp("cooldown")
    with without_mlflow_run_env():
        cfg = _config(tiny_model_dir, tmp, cooldown="auto")
        result = run_finetune(cfg, split_dir=split_dir, lr_low=LR, lr_high=LR, lr_mid=LR, lr_source="fixed",
                              model_dir=tmp / "ft")
    return cfg, tmp, result


def test_the_cooldown_is_the_decaying_run_from_the_start_and_the_lower_weights_are_delivered(cooled, split_dir):
    """The cooldown branched from a checkpoint of the constant run and trained on with the wsd schedule: its weights
    at the recommended length must be those of one wsd run trained from the base model (the engine resumes
    bit-exactly), and the step delivers them exactly when they measure below the window's pick."""
    from mlflow import MlflowClient

    from rangefinder.launch.processes import run_training
    from rangefinder.tracking.metrics import lr_text

    cfg, tmp, result = cooled
    info = result.chosen
    cool = info["cooldown"]
    epochs = result.recommended_epochs
    total = 4 * epochs
    assert (cool["epochs"], cool["total_updates"]) == (epochs, total)
    assert cool["decay_start"] == total - -(-total // 5)  # the last ceil(20 %) decay
    assert cool["start_update"] == 4 * (cool["decay_start"] // 4)  # the newest checkpoint at or before it
    assert cool["updates_trained"] == total - cool["start_update"]
    assert result.updates_trained == 12 + cool["updates_trained"]

    # The same schedule trained from the base model, in one piece.
    split = read_split(split_dir)
    spec = TrainSpec.finetune(cfg, split, bounds=(LR, LR), lr=LR, world_size=1)
    whole = run_training(cfg, dataclasses.replace(
        spec.cooldown_of(split, epochs=epochs, decay_fraction=0.2), branch=False), out_dir=tmp / "whole", split=split)
    at_end = dict(zip(whole.curve["update"], whole.curve["val_loss"], strict=True))[float(total)]
    assert cool["val_loss"] == at_end  # bit for bit

    work = tmp / "ft"
    window_pick = cool["window_val_loss"]
    assert cool["delivered"] is (at_end < window_pick)
    if cool["delivered"]:
        assert (info["rule"], info["update"], info["val_loss"]) == ("cooldown", total, at_end)
        assert info["window_pick"]["val_loss"] == window_pick and "cooldown" in info["reason"].lower()
        from diffusers import UNet2DConditionModel

        mine = UNet2DConditionModel.from_pretrained(str(work / checkpoints.CHOSEN_DIR / "unet")).state_dict()
        theirs = UNet2DConditionModel.from_pretrained(str(whole.final_dir / "unet")).state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    else:
        assert info["rule"] != "cooldown" and info["val_loss"] == window_pick
    assert checkpoints.read_chosen(work) == info
    # Measured, then tidied: no checkpoints and no second model left in the cooldown's folder.
    assert sorted(p.name for p in (work / COOLDOWN_DIR).iterdir() if not p.name.startswith(".")) == [
        "branch.json", "cooldown.json", "metrics.csv", "run_summary.json", "updates.csv"]
    decision = json.loads((work / "report" / "decision.json").read_text())
    assert decision["chosen"]["cooldown"]["val_loss"] == at_end
    report = (work / "report" / "step_report.md").read_text()  # the sentence under the label that names it once
    assert f'**cooldown**: {cool["sentence"].removeprefix("Cooldown: ")}' in report

    # MLflow: the cooldown's curve in its own child run, the verdict on the fine-tune's run.
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name("cooldown").experiment_id
    (ft,) = client.search_runs([exp], filter_string="tags.`rangefinder.step` = 'finetune'")
    (child,) = client.search_runs([exp], filter_string="tags.`rangefinder.step` = 'finetune_cooldown'")
    assert child.data.tags["mlflow.parentRunId"] == ft.info.run_id
    assert child.data.tags["lr"] == lr_text(float(ft.data.params["lr"]))  # as every LR tag is written (2.091e-04)
    assert child.data.params["lr"] == ft.data.params["lr"]  # its peak LR, the param the compare view lines up
    history = client.get_metric_history(child.info.run_id, "validation/val_loss")
    assert max(m.step for m in history) == total and [m.value for m in history if m.step == total] == [at_end]
    assert ft.data.metrics["cooldown_val_loss"] == at_end
    assert ft.data.tags["cooldown_delivered"].lower() == str(cool["delivered"]).lower()


def test_a_branch_may_change_the_schedule_only_after_its_checkpoint(cooled, split_dir):
    """The resume check lets a branch (TrainSpec.branch) change the schedule, not the LR of an update it already
    took: a decay starting before the copied checkpoint is refused, naming the update; without the branch flag any
    change of schedule is refused as another run's."""
    import shutil

    from rangefinder.launch.processes import run_training

    cfg, tmp, _ = cooled
    kept = checkpoints.list_checkpoints(tmp / "ft" / "checkpoints")[-1]  # the window's pick stays
    update = checkpoints.checkpoint_update(kept)
    split = read_split(split_dir)
    spec = TrainSpec.finetune(cfg, split, bounds=(LR, LR), lr=LR, world_size=1)
    branch = spec.cooldown_of(split, epochs=update // 4, decay_fraction=0.2)  # decays before `update`
    for flag, refusal in ((True, f"only after the checkpoint's update {update}"),
                          (False, "training.schedule \"constant\" -> \"wsd\"")):
        out = tmp / f"refused-{flag}"
        shutil.copytree(kept, out / "checkpoints" / kept.name)
        with pytest.raises(ConfigError, match="cannot resume") as e:
            run_training(cfg, dataclasses.replace(branch, branch=flag), out_dir=out, split=split)
        assert refusal in str(e.value)


@pytest.mark.parametrize(("settings", "warned"), [
    ({"finetune": {"cooldown": "on", "schedule": "triangular"}}, "does nothing with finetune.schedule triangular"),
    ({"finetune": {"cooldown": "on"}, "training": {"optimizer": "adamw_schedule_free"}},
     "does nothing with training.optimizer adamw_schedule_free"),
    ({"finetune": {"cooldown": "on"}}, None),
    ({"finetune": {"cooldown": "auto", "schedule": "triangular"}}, None),  # auto: it runs where it can
    ({"finetune": {"cooldown": "auto"}, "training": {"method": "lora"}}, None),  # auto: full fine-tuning only
    ({}, None),  # the default: off
])
def test_a_cooldown_asked_for_where_it_cannot_run_is_one_warning(settings, warned):
    from rangefinder.config import parse_config, setting_conflicts
    from rangefinder.steps.cooldown import cooldown_applies

    cfg = parse_config(settings)
    lines = [ln for ln in setting_conflicts(cfg) if "cooldown" in ln]
    assert lines == ([] if warned is None else [lines[0]]) and (warned is None or warned in lines[0])
    # And where it is warned about, the step does not run it (a schedule-free optimizer would refuse the decay).
    assert cooldown_applies(cfg, True, cfg.finetune.schedule) is (settings == {"finetune": {"cooldown": "on"}})


def test_yaml_s_bare_on_and_off_mean_the_words():
    """`cooldown: on` in a YAML file is read as true by YAML 1.1: the setting takes it as "on", not an error."""
    import yaml

    from rangefinder.config import parse_config

    for word in ("on", "off", "auto"):
        assert parse_config(yaml.safe_load(f"finetune:\n  cooldown: {word}\n")).finetune.cooldown == word


def test_the_branch_starts_at_a_checkpoint_taken_at_the_decay_s_first_update(tmp_path):
    """The newest fine-tune checkpoint at or before the decay's start S is the branch point: one taken at S itself
    is the fine-tune's run up to there, so the cooldown trains only the decay (not S - 4 updates the fine-tune took
    already). Copied whole into the cooldown's checkpoints, and noted for a retry."""
    from rangefinder.steps.cooldown import BRANCH_POINT, _branch_point

    source = tmp_path / "ft" / checkpoints.RUN_DIR
    for update in (4, 8, 12):
        folder = source / checkpoints.checkpoint_name(update)
        folder.mkdir(parents=True)
        checkpoints.write_main(folder, weights={"w": torch.full((4,), float(update))}, optimizer={"state": {}},
                               state={"update": update})
    root = tmp_path / "ft" / COOLDOWN_DIR
    assert _branch_point(source, root, 8) == 8
    (copied,) = checkpoints.list_checkpoints(root / checkpoints.RUN_DIR)
    assert copied.name == checkpoints.checkpoint_name(8) and checkpoints.verify(copied) is None
    assert json.loads((root / BRANCH_POINT).read_text()) == {"start_update": 8}
    assert _branch_point(source, tmp_path / "other", 7) == 4 and _branch_point(source, tmp_path / "none", 3) == 0
