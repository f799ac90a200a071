"""The fine-tune and retrain steps' settings (what LR, schedule and checkpoints the engine is given), and the
checkpoint the fine-tune keeps as its chosen model."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rangefinder.analysis import RecommendedLength
from rangefinder.config import RangefinderConfig, TrainingConfig, demo_config, parse_config
from rangefinder.data.split import read_split
from rangefinder.errors import ConfigError
from rangefinder.formats.weights_file import read_metadata
from rangefinder.models.loading import ResolvedModel
from rangefinder.steps.finetune import keep_chosen_checkpoint, recommended_length
from rangefinder.training.spec import TrainSpec


def finetune_training_config(cfg: RangefinderConfig, split_dir, lr_low: float, lr_high: float,
                             lr: float) -> TrainingConfig:
    """The fine-tune's training settings, from its spec's constructor, on the 16 training images of `split_dir`."""
    return TrainSpec.finetune(cfg, read_split(split_dir), bounds=(lr_low, lr_high), lr=lr,
                              world_size=1).training


def retrain_training_config(cfg: RangefinderConfig, split_dir, lr_low: float, lr_high: float, lr: float,
                            epochs: int) -> TrainingConfig:
    return TrainSpec.retrain(cfg, read_split(split_dir), bounds=(lr_low, lr_high), lr=lr,
                             epochs=epochs, world_size=1).training


def test_constant_at_the_midpoint(split_dir):
    cfg = demo_config()
    tc = finetune_training_config(cfg, split_dir, 1e-4, 1e-2, 1e-3)
    assert tc.schedule == "constant" and tc.lr == 1e-3 and tc.epochs == cfg.finetune.epochs
    assert tc.lr_min is None and tc.lr_max is None


def test_cyclical_between_the_bounds_and_checkpoints_every_two_epochs(split_dir):
    cfg = parse_config({"finetune": {"schedule": "triangular", "checkpoint_every_epochs": 2},
                        "training": {"batch_size": 4}, "split": {"val_split": 0.2}})
    tc = finetune_training_config(cfg, split_dir, 1e-4, 1e-2, 1e-3)
    assert (tc.schedule, tc.lr_min, tc.lr_max) == ("triangular", 1e-4, 1e-2)
    assert tc.checkpoint_every_updates == 8  # 2 epochs x 16 images / batch 4


def test_fixed_lr_cannot_cycle(split_dir):
    cfg = parse_config({"finetune": {"schedule": "triangular"}, "lr": 1e-3})
    tc = finetune_training_config(cfg, split_dir, 1e-3, 1e-3, 1e-3)
    assert tc.schedule == "constant"


def test_retrain_uses_recommended_epochs_and_schedule(split_dir):
    cfg = demo_config()
    tc = retrain_training_config(cfg, split_dir, 1e-4, 1e-2, 1e-3, epochs=5)
    assert (tc.epochs, tc.schedule, tc.lr) == (5, "constant", 1e-3)
    tri = retrain_training_config(parse_config({"retrain": {"schedule": "triangular"}}), split_dir, 1e-4, 1e-2,
                                  1e-3, 5)
    assert (tri.schedule, tri.lr_min, tri.lr_max) == ("triangular", 1e-4, 1e-2)
    # A fixed LR (bounds equal) cannot cycle: constant, as the fine-tune's (a triangle between equal bounds is refused).
    fixed = retrain_training_config(parse_config({"retrain": {"schedule": "triangular"}}), split_dir, 1e-3, 1e-3,
                                    1e-3, 5)
    assert (fixed.schedule, fixed.lr, fixed.lr_min, fixed.lr_max) == ("constant", 1e-3, None, None)


def test_the_retrain_trains_retrain_epochs_where_set_else_the_fine_tune_s_recommendation(split_dir):
    """retrain.epochs, set in the config, is the retrain's length whatever the fine-tune recommends (its preview in
    the fine-tune's report says so too); unset, the recommendation, at least one epoch."""
    from rangefinder.steps.retrain_full import retrain_epochs, retrain_preview

    fixed = demo_config(retrain={"enabled": True, "epochs": 3})
    assert retrain_epochs(fixed, 7) == 3
    preview = retrain_preview(fixed, read_split(split_dir), recommended_epochs=7, lr=1e-3, bounds=(1e-4, 1e-2))
    assert "3 epochs, 15 updates on its 20 images (retrain.epochs, set in the config)" in (preview or "")
    assert (retrain_epochs(demo_config(), 7), retrain_epochs(demo_config(), 0)) == (7, 1)


def test_checkpoints_every_epoch_all_kept_until_the_window_is_known(split_dir):
    cfg = demo_config()  # 150 epochs of 16 images at batch 4: 4 updates per epoch
    tc = finetune_training_config(cfg, split_dir, 1e-4, 1e-2, 1e-3)
    assert tc.checkpoint_every_updates == 4
    # Every epoch's checkpoint (and one spare): none is dropped during the run.
    assert tc.keep_checkpoints == cfg.finetune.epochs + 1 == 151


def test_each_step_s_spec_is_validated_planned_once_and_round_trips_through_json(split_dir):
    """The constructors and `with_lr` validate what they set (no unchecked copy of an LR into the settings), the plan
    is the engine's for the split read, and the spec is the same value after JSON (the job file of several
    processes)."""
    split = read_split(split_dir)
    cfg = demo_config()
    ft = TrainSpec.finetune(cfg, split, bounds=(1e-4, 1e-2), lr=1e-3, world_size=1)
    ramp = TrainSpec.ramp(cfg, split, lr_min=1e-6, lr_max=1e-1, world_size=1)
    full = TrainSpec.retrain(cfg, split, bounds=(1e-4, 1e-2), lr=1e-3, epochs=5,
                             world_size=1)
    assert ft.plan is not None and ft.plan.train_images == 16 and ft.plan.lr == 1e-3
    assert full.train_on == "train+val" and full.plan is not None and full.plan.train_images == 20
    # Issue 35: the images validated on are the split's 4 held out (none for the retrain, which trains on them).
    assert (ft.plan.val_images, ramp.plan.val_images, full.plan.val_images) == (4, 4, 0)
    assert not full.validation.enabled() and full.sampling is None and ramp.sampling is None
    for spec in (ft, ramp, full, ft.with_lr(1e-2)):
        again = TrainSpec.from_json(json.loads(json.dumps(spec.to_json())))
        assert again == dataclasses.replace(spec, split_dir=str(spec.split_dir))
    high = ft.with_lr(1e-2)
    assert (high.training.lr, high.plan.lr, high.plan.lr_base) == (1e-2, 1e-2, 1e-2)
    assert high.plan.total_updates == ft.plan.total_updates
    with pytest.raises(ConfigError, match="training.lr"):
        ft.with_lr(-1.0)
    with pytest.raises(ConfigError, match="training.lr_min"):
        TrainSpec.ramp(cfg, split, lr_min=-1e-6, lr_max=1e-1, world_size=1)


def test_a_cooldown_branch_renders_no_samples_and_keeps_only_its_newest_checkpoint(split_dir):
    """TrainSpec.cooldown_of: the constant run's settings but its schedule (wsd, decaying its last share), no samples
    during training, one checkpoint kept (a retried step goes on from it), branched from the run's checkpoint."""
    split = read_split(split_dir)
    ft = TrainSpec.finetune(demo_config(), split, bounds=(1e-3, 1e-3), lr=1e-3, world_size=1)
    assert ft.sampling is not None and ft.training.keep_checkpoints > 1 and ft.plan is not None
    cd = ft.cooldown_of(split, epochs=2, decay_fraction=0.5)
    assert cd.sampling is None and cd.branch and cd.training.keep_checkpoints == 1
    assert (cd.training.schedule, cd.training.decay_fraction, cd.training.epochs) == ("wsd", 0.5, 2)
    assert cd.plan is not None and cd.plan.total_updates == 2 * ft.plan.updates_per_epoch


def test_each_step_s_run_titles_its_deliverables_with_the_registered_model_name(split_dir):
    """What a step's run delivers is titled (its files' model spec, formats/model_spec.py) with the name the
    pipeline registers the model under; with none registered the spec leaves it to the engine, which takes the
    run's output folder name (training/setup.py)."""
    split = read_split(split_dir)
    for registered, title in (("cats-v2", "cats-v2"), (None, None)):
        cfg = demo_config(tracking={"registered_model_name": registered})
        ft = TrainSpec.finetune(cfg, split, bounds=(1e-3, 1e-3), lr=1e-3, world_size=1)
        specs = (ft, ft.with_lr(1e-2), ft.cooldown_of(split, epochs=2, decay_fraction=0.5),
                 TrainSpec.ramp(cfg, split, lr_min=1e-6, lr_max=1e-1, world_size=1),
                 TrainSpec.retrain(cfg, split, bounds=(1e-4, 1e-2), lr=1e-3, epochs=5, world_size=1))
        assert [spec.title for spec in specs] == [title] * len(specs), registered


@pytest.fixture(scope="module")
def ema_run(split_dir, tiny_model_dir, tmp_path_factory):
    """A 2-epoch full fine-tune of the tiny model with an EMA average (decay 0.5: far from the raw weights)."""
    from rangefinder.training.loop import train

    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, training={"use_ema": True, "ema_decay": 0.5},
                      finetune={"epochs": 2})
    spec = TrainSpec.finetune(cfg, read_split(split_dir), bounds=(1e-3, 1e-3), lr=1e-3,
                              world_size=1)
    spec = dataclasses.replace(spec, sampling=None)  # no samples during training: only the weights matter here
    out = tmp_path_factory.mktemp("ema-run")
    result = train(spec, out_dir=out)
    return out, result


def test_the_lowest_validation_loss_inside_the_window_becomes_the_chosen_model(ema_run, tiny_model_dir, tmp_path):
    """Both checkpoints (updates 4 and 8) lie in the window and the recommendation is the worse one: the one with
    the lower validation loss is kept (not the one nearest the recommendation), the other removed, and chosen/
    holds its weights as the run validated them, the EMA average, not the raw ones."""
    import shutil

    from diffusers import UNet2DConditionModel

    from rangefinder.analysis import read_curve_csv
    from rangefinder.formats import checkpoints

    result = ema_run[1]
    run_dir = shutil.copytree(ema_run[0], tmp_path / "run")  # the fixture's run stays whole for the other tests
    assert [checkpoints.checkpoint_update(p) for p in result.checkpoints] == [4, 8]
    curve = read_curve_csv(result.metrics_csv)
    loss = {u: float(curve["val_loss"][list(curve["update"]).index(u)]) for u in (4, 8)}
    assert loss[4] != loss[8]
    best, worse = sorted((4, 8), key=loss.__getitem__)
    window = SimpleNamespace(recommended_updates=worse, recommended_epochs=worse // 4, status="ok", tolerance=0.02,
                             band=0.02 * loss[best], best_val_loss=loss[best], window_start_update=2.0,
                             window_end_update=8.0)
    name = checkpoints.checkpoint_name(best)
    raw = checkpoints.read_weights(run_dir / "checkpoints" / name)
    shadow = checkpoints.read_ema(run_dir / "checkpoints" / name)["shadow_params"]
    # As a run from a single file hands it on: the folder it was converted to, and the file it resolved from.
    base = ResolvedModel(Path(tiny_model_dir), "single_file", "/models/sd15.safetensors", "sha256:" + "ab" * 32)
    info = keep_chosen_checkpoint(run_dir, window, curve, tiny_model_dir, base)

    assert (info["checkpoint"], info["update"], info["epoch"]) == (name, best, best / 4)
    assert info["val_loss"] == pytest.approx(loss[best]) and info["rule"] == "window_lowest"
    assert f"update {best} (epoch {best // 4})" in info["reason"]
    assert f"centre of that window, update {worse}" in info["reason"] and "lowest validation loss" in info["reason"]
    assert [p.name for p in checkpoints.list_checkpoints(run_dir / "checkpoints")] == [name]
    assert checkpoints.read_chosen(run_dir) == info

    chosen = UNet2DConditionModel.from_pretrained(str(run_dir / checkpoints.CHOSEN_DIR / "unet"))
    names = [n for n, p in chosen.named_parameters()]
    assert len(names) == len(shadow)
    for name, avg in zip(names, shadow, strict=True):
        assert torch.equal(dict(chosen.named_parameters())[name].detach(), avg.float()), name
    assert any(not torch.equal(raw[f"unet.{n}"], avg) for n, avg in zip(names, shadow, strict=True))  # not the raw
    # The method's whole output, like final/: a diffusers folder and the single file for A1111/ComfyUI.
    assert {"model_index.json", "model.safetensors"} <= {p.name for p in (run_dir / "chosen").iterdir()}
    # Its file names the run's base model and the revision it resolved to, not the converted folder's.
    meta = read_metadata(run_dir / "chosen" / "model.safetensors")
    assert (meta["rangefinder.base_model"], meta["rangefinder.base_model_revision"]) == (base.source, base.revision)


def test_no_validated_checkpoint_keeps_everything(tmp_path):
    window = SimpleNamespace(recommended_updates=None)
    (tmp_path / "checkpoints" / "checkpoint-000004").mkdir(parents=True)
    assert keep_chosen_checkpoint(tmp_path, window, {}, tmp_path) is None
    assert (tmp_path / "checkpoints" / "checkpoint-000004").is_dir() and not (tmp_path / "chosen").exists()


def test_weights_delivered_over_the_pick_keep_the_pick_s_checkpoint_alone(tmp_path):
    """At the step's end every checkpoint but the kept one goes: where the window average or the cooldown was
    delivered (chosen.json names no checkpoint), the window's pick they replaced is the one kept, and the run's
    newest, kept until then for a retry, goes too."""
    from rangefinder.formats import checkpoints
    from rangefinder.steps.finetune import keep_only_chosen

    root = tmp_path / checkpoints.RUN_DIR
    for update in (4, 8, 12):
        folder = root / checkpoints.checkpoint_name(update)
        folder.mkdir(parents=True)
        checkpoints.write_main(folder, weights={"w": torch.zeros(1)}, optimizer={"state": {}}, state={"update": update})
    keep_only_chosen(root, {"checkpoint": None, "rule": "window_average", "update": 12,
                            "window_pick": {"checkpoint": checkpoints.checkpoint_name(8), "update": 8}})
    assert [p.name for p in checkpoints.list_checkpoints(root)] == [checkpoints.checkpoint_name(8)]


@pytest.mark.parametrize("base", ["measured", "below every checkpoint"])
def test_with_no_window_the_run_s_lowest_validation_loss_checkpoint_is_delivered_and_compared_with_the_base(
        ema_run, tmp_path, tiny_model_dir, base):
    """No step window (no significant improvement): the old code kept every checkpoint and delivered the final
    weights. Now the checkpoint with the lowest validation loss of the run (updates 4 and 8) becomes chosen/, and
    chosen.json names the rule and compares it with the base model's loss, the curve's update 0 (as measured; then
    with update 0 read lower than every checkpoint, the case where the fine-tune did not help)."""
    import shutil

    from rangefinder.analysis import read_curve_csv
    from rangefinder.formats import checkpoints

    run_dir = shutil.copytree(ema_run[0], tmp_path / "run")
    curve = read_curve_csv(ema_run[1].metrics_csv)
    updates = [int(u) for u in curve["update"]]
    assert updates[0] == 0 and {4, 8} <= set(updates)
    loss = {u: float(curve["val_loss"][updates.index(u)]) for u in (0, 4, 8)}
    assert loss[4] != loss[8]
    if base != "measured":
        curve["val_loss"][updates.index(0)] = min(loss[4], loss[8]) / 2
        loss[0] = min(loss[4], loss[8]) / 2
    best = min((4, 8), key=loss.__getitem__)
    window = SimpleNamespace(recommended_updates=None, recommended_epochs=None, status="no_improvement",
                             tolerance=0.02, window_start_update=None, window_end_update=None)
    info = keep_chosen_checkpoint(run_dir, window, curve, tiny_model_dir)

    assert info is not None and (info["update"], info["rule"]) == (best, "run_lowest")
    assert info["val_loss"] == pytest.approx(loss[best]) and info["base_val_loss"] == pytest.approx(loss[0])
    assert info["improved_on_base"] is (loss[best] < loss[0])
    assert "no step window was found" in info["reason"] and "lowest validation loss" in info["reason"]
    assert ("did not improve on the base model" in info["reason"]) is (loss[best] >= loss[0])
    kept = [p.name for p in checkpoints.list_checkpoints(run_dir / "checkpoints")]
    assert kept == [checkpoints.checkpoint_name(best)] and checkpoints.read_chosen(run_dir) == info
    assert (run_dir / checkpoints.CHOSEN_DIR / "model_index.json").is_file()
    # What a full-data retrain then trains: up to the delivered checkpoint (its epoch rounded up), not the configured
    # budget, which the run trained through and measured no better (the old code kept the configured 10 epochs).
    length = recommended_length(window, info, 10, updates[-1], curve)
    assert (length.epochs, length.updates, length.basis) == (max(1, math.ceil(info["epoch"] - 1e-9)), best, "no_window")
    # The reason (the registered version's description) says that length, which the version's recommended_epochs
    # tag carries: it said "no length is recommended" beside that tag.
    assert "the recommended length is this checkpoint's epoch, rounded up" in info["reason"], info["reason"]


@pytest.mark.parametrize("window, rule", [
    ((None, None, None, "no_improvement"), "run_lowest"),
    ((2.0, 6.0, 4, "ok"), "window_nearest"),  # the window ends before the run: its final weights trained past it
    ((4.0, 8.0, 6, "ok"), "window_lowest"),  # the window reaches the run's end
], ids=["no-window", "window-before-the-end", "window-to-the-end"])
def test_with_only_the_final_checkpoint_the_reason_and_the_report_say_the_final_weights_are_delivered(
        ema_run, tmp_path, tiny_model_dir, window, rule):
    """finetune.checkpoint_every_epochs not below finetune.epochs (config.setting_conflicts warns of it): the run
    keeps only its final weights (here the 2-epoch run's update 8, its update-4 checkpoint removed), and those are
    delivered. chosen.json's reason (the registered model's description) said "the run's final weights are not
    delivered" with no window, and that they "overfit" with one; now it, the report's lead and its row say they are
    what is delivered."""
    import shutil

    from rangefinder.analysis import read_curve_csv
    from rangefinder.analysis.reports import step_headline
    from rangefinder.formats import checkpoints
    from rangefinder.steps.finetune import chosen_delivery

    run_dir = shutil.copytree(ema_run[0], tmp_path / "run")
    shutil.rmtree(run_dir / "checkpoints" / checkpoints.checkpoint_name(4))
    curve = read_curve_csv(ema_run[1].metrics_csv)
    start, end, centre, status = window
    window = SimpleNamespace(recommended_updates=centre, recommended_epochs=None if centre is None else centre / 4,
                             status=status, tolerance=0.02, band=0.0, best_val_loss=None,
                             window_start_update=start, window_end_update=end)
    info = keep_chosen_checkpoint(run_dir, window, curve, tiny_model_dir)

    assert (info["update"], info["rule"], info["final_weights"]) == (8, rule, True)
    reason = info["reason"]
    assert "the run's final weights" in reason and "not delivered" not in reason and "overfit" not in reason, reason
    delivered = chosen_delivery(info)
    said = {"lead": step_headline(window, None, delivered), "row": delivered.what()}
    for where, text in said.items():
        assert "it is the run's final weights" in text, (where, text)
    if rule == "window_nearest":  # and how to save a checkpoint inside the window
        assert "trained past the window" in said["row"] and "finetune.checkpoint_every_epochs" in reason


@pytest.mark.parametrize("besides", ["none", "an average 3 % lower", "an average 0.5 % lower"])
def test_earliest_tied_delivers_the_first_checkpoint_within_the_band_and_keeps_it_alone(
        ema_run, tmp_path, tiny_model_dir, besides):
    """finetune.deliver: earliest_tied. Updates 4 and 8 lie in the window, 8 the lower; with update 4's curve loss
    0.5 % above 8's, 4 is delivered: chosen/ holds its weights (as the run validated them), the other checkpoint goes,
    chosen.json keeps the usual pick and the band, and a retrain trains its length. A window average 3 % lower sets a
    band no checkpoint reaches, so the usual pick stands; one 0.5 % lower sets a band only update 8 reaches."""
    import shutil

    from rangefinder.analysis import read_curve_csv
    from rangefinder.formats import checkpoints

    run_dir = shutil.copytree(ema_run[0], tmp_path / "run")
    curve = read_curve_csv(ema_run[1].metrics_csv)
    updates = [int(u) for u in curve["update"]]
    low = float(curve["val_loss"][updates.index(8)])
    curve["val_loss"][updates.index(4)] = low * 1.005
    window = SimpleNamespace(recommended_updates=8, recommended_epochs=2, status="ok", tolerance=0.02, band=0.0,
                             best_val_loss=None, window_start_update=2.0, window_end_update=8.0)
    average = {"none": {}, "an average 3 % lower": {"the window average": low * 0.97},
               "an average 0.5 % lower": {"the window average": low * 0.995}}[besides]
    name = {u: checkpoints.checkpoint_name(u) for u in (4, 8)}
    shadow = {u: checkpoints.read_ema(run_dir / "checkpoints" / name[u])["shadow_params"] for u in (4, 8)}
    info = keep_chosen_checkpoint(run_dir, window, curve, tiny_model_dir, deliver="earliest_tied",
                                  measured_besides=average)

    expected = {"none": 4, "an average 3 % lower": 8, "an average 0.5 % lower": 8}[besides]
    assert info["update"] == expected and info["checkpoint"] == name[expected]
    assert [p.name for p in checkpoints.list_checkpoints(run_dir / "checkpoints")] == [name[expected]]
    assert checkpoints.read_chosen(run_dir) == info
    from diffusers import UNet2DConditionModel

    chosen = UNet2DConditionModel.from_pretrained(str(run_dir / checkpoints.CHOSEN_DIR / "unet"))
    assert all(torch.equal(p.detach(), avg.float())
               for p, avg in zip(chosen.parameters(), shadow[expected], strict=True))
    if besides == "an average 3 % lower":
        assert info["rule"] == "window_lowest" and "band" not in info and "window_pick" not in info
        assert recommended_length(window, info, 10, 8, curve) == RecommendedLength(2, 8, "window")  # its centre
        return
    assert info["rule"] == "earliest_tied"
    assert info["window_pick"] == {"checkpoint": name[8], "update": 8, "val_loss": pytest.approx(low),
                                   "rule": "window_lowest"}
    set_by = "the window's pick at update 8" if besides == "none" else "the window average"
    target = low if besides == "none" else low * 0.995
    assert info["band"] == {"target_val_loss": pytest.approx(target), "set_by": set_by, "fraction": 0.01,
                            "ceiling": pytest.approx(target * 1.01)}
    assert "finetune.deliver is earliest_tied" in info["reason"] and f"({set_by})" in info["reason"]
    assert "Without that rule: smoothed validation loss" in info["reason"] and "update 8 is the checkpoint" in info[
        "reason"]
    # A full-data retrain trains the delivered checkpoint's length, not the window's centre (update 8, epoch 2).
    assert recommended_length(window, info, 10, 8, curve) == RecommendedLength(expected // 4, expected, "earliest_tied")


def test_the_recommended_length_is_the_window_s_centre_else_the_configured_budget():
    window = SimpleNamespace(recommended_epochs=3, recommended_updates=12)
    assert recommended_length(window, {"rule": "window_lowest", "update": 16, "epoch": 4.0}, 10, 40) == (
        RecommendedLength(3, 12, "window"))
    none = SimpleNamespace(recommended_epochs=None, recommended_updates=None)
    # No validated checkpoint: the configured budget.
    assert recommended_length(none, None, 10, 40) == RecommendedLength(10, 40, "configured")
    # No window: the delivered checkpoint's epoch rounded up, in the updates those whole epochs take (4 per epoch on
    # this curve), not the checkpoint's own update: 2 epochs are 8 updates, never 6.
    curve = {"update": [0.0, 2.0, 4.0, 6.0], "epoch": [0.0, 0.5, 1.0, 1.5]}
    assert recommended_length(none, {"rule": "run_lowest", "update": 6, "epoch": 1.5}, 10, 40, curve) == (
        RecommendedLength(2, 8, "no_window"))
    assert recommended_length(none, {"rule": "run_lowest", "update": 8, "epoch": 2.0}, 10, 40, curve) == (
        RecommendedLength(2, 8, "no_window"))
    # Rounded up, never to the nearest: a checkpoint a quarter into epoch 2 is 2 epochs to reach.
    assert recommended_length(none, {"rule": "run_lowest", "update": 5, "epoch": 1.25}, 10, 40, curve) == (
        RecommendedLength(2, 8, "no_window"))


@pytest.mark.slow
def test_the_finetune_step_logs_samples_during_training_to_mlflow_with_their_steps(
        split_dir, tiny_model_dir, tmp_path, monkeypatch):
    """Issue 20, item 2's must-show: after the fine-tune step, its MLflow run (a real sqlite store) holds a sample
    grid at several updates, each as the step of the image series `samples_during_training`, and the step's report
    shows them as its "samples over training" strip."""
    from mlflow import MlflowClient

    from rangefinder.steps.finetune import run_finetune
    from rangefinder.training.samples import SAMPLES_KEY, read_index

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, finetune={"epochs": 3},
                      training={"cache_dir": str(tmp_path / "cache")},
                      tracking={"tracking_uri": uri, "experiment_name": "samples", "registered_model_name": None},
                      sampling={"num_inference_steps": 2, "every_validations": 2})
    report = tmp_path / "finetune.html"
    run_finetune(cfg, split_dir=split_dir, lr_low=1e-3, lr_high=1e-3, lr_mid=1e-3, model_dir=tmp_path / "ft",
                 report_html=report)

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("samples").experiment_id],
                                filter_string="tags.`rangefinder.step` = 'finetune'")
    names = [f.path.split("/")[-1] for f in client.list_artifacts(run.info.run_id, "images")]
    steps = sorted(int(n.split("+step+")[1].split("+")[0]) for n in names
                   if n.startswith(f"{SAMPLES_KEY}+step+") and n.endswith(".png"))
    # 16 images at batch 4, 3 epochs: validations at updates 0, 4, 8, 12; every 2nd (0, 8) and the last (12).
    assert steps == [0, 8, 12]
    index = read_index(tmp_path / "ft")
    assert [e["update"] for e in index["samples"]] == steps
    assert {e["logged_to"] for e in index["samples"]} == {run.info.run_id}
    # Issue 35: what MLflow shows of the run: its validation images as the split holds them, the bounds the step
    # was given on the run, and its decision in one line as its description.
    assert run.data.params["plan.val_images"] == "4"
    # The run a registered version links to names the data its weights were trained on (MLflow's Datasets column).
    inputs = {d.dataset.name.rsplit("-", 1)[1]: d for d in run.inputs.dataset_inputs}
    assert sorted(inputs) == ["stabilize", "train", "val"] and run.data.tags["rangefinder.dataset_digest"]
    assert (run.data.tags["rangefinder.method"], run.data.tags["rangefinder.model_family"]) == ("full", "sd1")
    assert json.loads(inputs["val"].dataset.profile) == {"num_rows": 4}
    assert float(run.data.params["lr_low"]) == float(run.data.params["lr_high"]) == 1e-3  # params, not tags too
    note = run.data.tags["mlflow.note.content"]
    headline, used = note.split(" Trained at ")
    assert used == "lr 0.001 (lr source: range-test)."
    assert f": {headline}\n" in (tmp_path / "ft" / "report" / "step_report.md").read_text()  # the report's lead
    # Which rule picked the delivered checkpoint: in chosen.json, as a tag on the run, and in the report's rows.
    from rangefinder.formats import checkpoints

    chosen = checkpoints.read_chosen(tmp_path / "ft")
    assert chosen["rule"] in ("window_lowest", "window_nearest", "run_lowest")
    assert run.data.tags["chosen_rule"] == chosen["rule"]
    assert f"update {chosen['update']}, rule {chosen['rule']}" in (tmp_path / "ft" / "report" / "step_report.md"
                                                                   ).read_text()
    page = report.read_text()
    assert "Samples over training" in page and "<th class='row'>update</th><th>0</th><th>8</th><th>12</th>" in page
    from tests.tracking.fixtures import check_logged_files_name_no_local_path

    check_logged_files_name_no_local_path(client, run.info.run_id, tmp_path, ("report",))
    # One file of each: the curve under curves/ only, the window's JSON inside decision.json only.
    assert [a.path for a in client.list_artifacts(run.info.run_id, "report")] == [
        "report/decision.json", "report/step_report.html", "report/step_report.md", "report/step_window.png"]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "curves")] == ["curves/metrics.csv"]
    assert page.count(f"alt='{cfg.sampling.prompts[0]} | seed 0 at update") == 3


def test_with_no_step_window_the_report_gives_the_fallback_length_the_pipeline_trains(
        split_dir, tiny_model_dir, tmp_path, monkeypatch):
    """An LR too small to move the weights: validation loss never falls, so there is no step window, and the pipeline
    falls back to the delivered checkpoint's length (recommended_length). The report said "recommended epochs -"
    while the step's outputs (the terminal's line, the retrain's input) and MLflow had the fallback's epochs; now the
    report, its lead (the run's description), decision.json, MLflow and the outputs give the same epochs and updates,
    the report calling it the fallback, and the retrain's note the same epochs on train + validation."""
    from mlflow import MlflowClient

    from rangefinder.analysis import read_curve_csv
    from rangefinder.steps.finetune import epochs_up_to, run_finetune
    from rangefinder.steps.retrain_full import retrain_epochs

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = demo_config(model={"base_model": str(tiny_model_dir)},
                      finetune={"epochs": 2, "cooldown": "off", "average": "off"},
                      training={"cache_dir": str(tmp_path / "cache")}, sampling={"every_validations": None},
                      validation={"every_epochs": 0.5}, retrain={"enabled": True},
                      tracking={"tracking_uri": uri, "experiment_name": "fallback", "registered_model_name": None})
    result = run_finetune(cfg, split_dir=split_dir, lr_low=1e-12, lr_high=1e-12, lr_mid=1e-12, lr_source="fixed",
                          model_dir=tmp_path / "ft")

    report = tmp_path / "ft" / "report"
    decision = json.loads((report / "decision.json").read_text())
    assert decision["status"] == "no_improvement" and result.chosen["rule"] == "run_lowest"
    epochs = epochs_up_to(result.chosen["epoch"])
    updates = 4 * epochs  # 16 training images at batch 4
    assert (result.recommended_epochs, result.recommended_updates) == (epochs, updates)
    assert decision["recommended_length"] == {"epochs": epochs, "updates": updates, "basis": "no_window"}
    md = (report / "step_report.md").read_text()
    assert f"| recommended epochs | {epochs} (fallback) |" in md and f"| recommended updates | {updates} |" in md
    lead = md.split("\n")[2]
    assert f"the pipeline falls back to {epochs} epochs ({updates} updates of this fine-tune)" in lead
    html = (report / "step_report.html").read_text()
    assert f"<td class='num'>{epochs} (fallback)</td>" in html
    # The retrain trains the same epochs, on train + validation: 20 images at batch 4.
    assert retrain_epochs(cfg, result.recommended_epochs) == epochs
    assert f"A retrain on train + validation follows: {epochs} epochs, {5 * epochs} updates on its 20 images" in md

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fallback").experiment_id],
                                filter_string="tags.`rangefinder.step` = 'finetune'")
    assert run.data.metrics["recommended_epochs"] == epochs and run.data.metrics["recommended_updates"] == updates
    assert run.data.tags["recommended_from"] == "no_window"
    assert run.data.tags["mlflow.note.content"].startswith(lead.removeprefix("**no_improvement**: "))
    # Each KFP metric of the step is the MLflow metric of the same name on its run (README, "Reading the results"),
    # but lr_used, the LR kept: a param here (below) and a tag on the parent.
    measured = [float(v) for v in read_curve_csv(result.curve_csv)["val_loss"] if math.isfinite(v)]
    kfp = {k: v for k, v in result.metrics().items() if k != "lr_used"}
    assert kfp["best_val_loss"] == min(measured)
    assert {k: run.data.metrics.get(k) for k in kfp} == kfp
    assert run.data.params["lr"] == "1e-12"  # lr_used: the LR kept, a param here and a tag on the parent


def test_a_fine_tune_that_diverges_says_so_and_what_to_do(split_dir, tiny_model_dir, tmp_path, monkeypatch):
    """A fixed LR far too high (a random-search draw in bench.versus, LoRA `glyphs` seed 4): the loss turns NaN, the
    engine stops as diverged and writes no final weights. The step names the divergence, the LR and the fix, not
    only that no final weights exist; the curve it measured stays for the user to read."""
    from rangefinder.errors import RangefinderError
    from rangefinder.steps.finetune import run_finetune

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, finetune={"epochs": 2},
                      training={"cache_dir": str(tmp_path / "cache")}, sampling={"every_validations": None},
                      tracking={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "registered_model_name": None})
    with pytest.raises(RangefinderError, match=r"diverged at lr 1e\+06 .*lower the LR"):
        run_finetune(cfg, split_dir=split_dir, lr_low=1e6, lr_high=1e6, lr_mid=1e6, lr_source="fixed",
                     model_dir=tmp_path / "ft")
    assert not (tmp_path / "ft" / "final").exists() and next((tmp_path / "ft").rglob("metrics.csv"), None)


def test_a_retrain_that_diverges_says_so_and_delivers_nothing(split_dir, tiny_model_dir, tmp_path, monkeypatch):
    """The retrain on train + validation at an LR its loss turns NaN at: it published its folder with no final/, and
    register-model took that folder whole for a model and failed on what was not in it, far from the cause."""
    from rangefinder.errors import RangefinderError
    from rangefinder.steps.retrain_full import run_retrain_full

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, training={"cache_dir": str(tmp_path / "cache")},
                      sampling={"every_validations": None},
                      tracking={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "registered_model_name": None})
    with pytest.raises(RangefinderError, match=r"^the retrain diverged at lr 1e\+06 .*lower the LR, or leave the "
                                               r"retrain off"):
        run_retrain_full(cfg, split_dir=split_dir, lr_low=1e6, lr_high=1e6, lr=1e6, recommended_epochs=1,
                         model_dir=tmp_path / "retrain")
    assert not (tmp_path / "retrain" / "final").exists()


def test_a_fine_tune_validated_too_seldom_for_its_step_window_is_refused_before_anything_trains(
        split_dir, tiny_model_dir, tmp_path, monkeypatch):
    """validation.every_updates not below the fine-tune's updates (8: 2 epochs of 16 images at batch 4): it validated
    at update 0 and at its end only, trained both halving candidates and the kept run to that end, and then the step
    window refused its 2 validations (it needs 3 updates). Only the data's size tells, so compile cannot; the step
    refuses it on its own plan before it trains, before the halving's race; so does the prodigy_step probe, which
    trains the fine-tune's plan first, and the range test, which trained its sweep before the fine-tune refused it:
    it counts the fine-tune's updates on its own run's figures (planning.plan_like), the same split and batches."""
    from rangefinder.planning import plan_like
    from rangefinder.steps.finetune import run_finetune
    from rangefinder.steps.lr_range_test import run_lr_range_test
    from rangefinder.steps.prodigy_step_size import run_prodigy_step_size

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, finetune={"epochs": 2},
                      validation={"every_updates": 8}, training={"cache_dir": str(tmp_path / "cache")},
                      sampling={"every_validations": None},
                      tracking={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "registered_model_name": None})
    said = (r"^validation\.every_updates: 8 with finetune\.epochs: 2 \(8 updates\) validates the fine-tune only at its "
            r"start and end, and its step window needs validations at 3 or more updates .*; set "
            r"validation\.every_updates below 8 \(e\.g\. 1\) or raise finetune\.epochs$")
    with pytest.raises(ConfigError, match=said):
        run_finetune(cfg, split_dir=split_dir, lr_low=1e-4, lr_high=1e-3, lr_mid=3e-4, lr_source="range-test",
                     model_dir=tmp_path / "ft")
    with pytest.raises(ConfigError, match=said):
        run_prodigy_step_size(cfg.model_copy(update={"lr_finder": "prodigy_step"}), split_dir=split_dir,
                              out_dir=tmp_path / "probe")
    with pytest.raises(ConfigError, match=said):
        run_lr_range_test(cfg, split_dir=split_dir, out_dir=tmp_path / "range")
    assert next(tmp_path.rglob("metrics.csv"), None) is None  # nothing trained
    # Every 4 updates: update 0, 4 and the end, enough for the window.
    from rangefinder.planning import check_finetune_validations

    every_4 = demo_config(finetune={"epochs": 2}, validation={"every_updates": 4})
    split = read_split(split_dir)
    planned = TrainSpec.finetune(every_4, split, lr=3e-4, bounds=(1e-4, 1e-3), world_size=1).plan
    check_finetune_validations(every_4, planned)
    # The range test's count is the fine-tune's own plan but for its LR (which the batch arithmetic does not use).
    ramp = TrainSpec.ramp(every_4, split, lr_min=1e-6, lr_max=1e-1, world_size=1).plan
    assert ramp is not None and planned is not None and ramp.total_updates != planned.total_updates
    same = {"lr", "lr_base", "val_images"}
    assert plan_like(ramp, epochs=2).model_dump(exclude=same) == planned.model_dump(exclude=same)


def test_the_delivered_update_is_sampled_in_the_strip_and_the_mlflow_series(tiny_model_dir, tmp_path, monkeypatch):
    """Issue 35: the samples during training ran every few validations, and the slider ended before the weights the
    pipeline delivers (the chosen checkpoint). The step renders those weights with the same settings and adds them
    at their update."""
    import shutil

    import numpy as np
    from mlflow import MlflowClient
    from PIL import Image

    from rangefinder.config import TrackingConfig
    from rangefinder.formats.checkpoints import CHOSEN_DIR
    from rangefinder.sampling import render_grid
    from rangefinder.steps.finetune import sample_delivered, sample_strip
    from rangefinder.tracking import step_run
    from rangefinder.training.samples import INDEX_NAME, SAMPLES_DIR, SAMPLES_KEY, read_index

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    work = tmp_path / "ft"
    shutil.copytree(tiny_model_dir, work / CHOSEN_DIR)  # a whole pipeline folder, as keep_chosen_checkpoint writes
    settings = {"prompts": ["a red circle on a white background"], "seeds": [0, 1], "num_inference_steps": 2,
                "guidance_scale": 5.0, "scheduler": "DDIMScheduler", "resolution": 32, "every_validations": 4}
    (work / SAMPLES_DIR).mkdir()
    (work / SAMPLES_DIR / INDEX_NAME).write_text(json.dumps({"settings": settings, "samples": [
        {"update": u, "epoch": u / 4, "validation": u // 4, "grid": "g.png", "cells": [], "seconds": 0.1}
        for u in (0, 16)]}))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with step_run(TrackingConfig(tracking_uri=uri, experiment_name="delivered"), "finetune") as run:
        sample_delivered(work, {"update": 12, "epoch": 3.0}, tiny_model_dir, run)
        sample_delivered(work, {"update": 16, "epoch": 4.0}, tiny_model_dir, run)  # sampled already: nothing
        entries = read_index(work)["samples"]
        assert [e["update"] for e in entries] == [0, 12, 16] and entries[1]["delivered"] is True
        # Drawn with the samples' own settings (a guidance scale other than the model's default here).
        drawn = render_grid([work / CHOSEN_DIR], settings["prompts"], settings["seeds"], out_dir=tmp_path / "drawn",
                            base_model=tiny_model_dir, steps=2, guidance_scale=5.0, scheduler="DDIMScheduler",
                            resolution=32, device="cpu")["images"]

        def pixels(path) -> list:
            return np.asarray(Image.open(path).convert("RGB")).tolist()

        assert [pixels(work / SAMPLES_DIR / c) for c in entries[1]["cells"]] == [pixels(p) for (p,) in drawn]
        assert [c[0] for c in sample_strip(work).columns] == [0, 12, 16]  # the report's strip
        names = [f.path.split("/")[-1] for f in MlflowClient(uri).list_artifacts(run.run_id, "images")]
        assert [n for n in names if n.startswith(f"{SAMPLES_KEY}+step+") and n.endswith(".png")] == [
            n for n in names if n.startswith(f"{SAMPLES_KEY}+step+12+") and n.endswith(".png")] != []
        # Weights that are no checkpoint (the window average, the cooldown) delivered at a sampled update are not
        # what was sampled there: their grid replaces that update's.
        sample_delivered(work, {"update": 16, "epoch": 4.0, "rule": "window_average"}, tiny_model_dir, run)

    entries = read_index(work)["samples"]
    assert [(e["update"], e.get("delivered")) for e in entries] == [(0, None), (12, True), (16, True)]
    names = [f.path.split("/")[-1] for f in MlflowClient(uri).list_artifacts(run.run_id, "images")]
    assert sorted(n.split("+")[2] for n in names if n.startswith(f"{SAMPLES_KEY}+step+") and n.endswith(".png")) == [
        "12", "16"]


def test_the_step_window_and_the_window_average_follow_their_settings(split_dir, tiny_model_dir, tmp_path,
                                                                      monkeypatch):
    """finetune.tolerance and validation.seed (the seed of the trend test's permutations) are the step window's:
    decision.json is select_step_window's reading of the run's curves with them, which neither leaves as it would be
    at its default; and finetune.soup_tries reaches the window average, which tries a greedy soup.

    The window must not rest on a p-value at the cut-off's edge: 4 epochs validated with seed 3 read p = 2/300
    (one shuffle of 299 above the curve's own drop, a second 13 % below it) against SIGNIFICANCE 0.01 = 3/300. Here
    no shuffle reaches it (p = 1/300, the test's floor) and the nearest two are 17 % and 24 % below it; seed 0's
    shuffles give 2/300, so the seed still shows in the decision."""
    from rangefinder.analysis import read_curve_csv, select_step_window
    from rangefinder.analysis.lr_bounds import PERMUTATIONS, SIGNIFICANCE
    from rangefinder.steps.finetune import run_finetune

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    # 20 updates at 3e-3, validated every 2: a window over the checkpoints at updates 12, 16 and 20.
    cfg = demo_config(model={"base_model": str(tiny_model_dir)},
                      finetune={"epochs": 5, "successive_halving": False, "cooldown": "off", "average": "on",
                                "soup_tries": 2, "tolerance": 0.1},
                      validation={"every_epochs": 0.5, "seed": 2}, training={"cache_dir": str(tmp_path / "cache")},
                      sampling={"every_validations": None},
                      tracking={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "registered_model_name": None})
    result = run_finetune(cfg, split_dir=split_dir, lr_low=3e-3, lr_high=3e-3, lr_mid=3e-3, lr_source="fixed",
                          model_dir=tmp_path / "ft")
    decision = json.loads((tmp_path / "ft" / "report" / "decision.json").read_text())
    curve = read_curve_csv(result.curve_csv)

    def window(**default) -> dict:
        settings = {"tolerance": 0.1, "seed": 2, **default}
        return select_step_window(curve["update"], curve["epoch"], curve["val_loss"],
                                  stabilize_loss=curve["stabilize_loss"], **settings).to_dict()

    read = window()
    assert {k: decision[k] for k in read} == read and read["status"] == "ok"
    assert read["p_improvement"] == 1 / (PERMUTATIONS + 1) < SIGNIFICANCE / 2
    assert window(tolerance=0.02)["tolerance"] != read["tolerance"]
    assert window(seed=0)["p_improvement"] != read["p_improvement"]
    assert result.chosen is not None and result.chosen["average"]["soup_tries"] >= 1


def test_validation_divergence_factor_is_the_step_window_s(split_dir, tiny_model_dir, tmp_path, monkeypatch):
    """A fine-tune whose loss blew up at once and stayed above 4 times its start (3e-2 on the tiny model): at the
    default validation.divergence_factor, 4, the step window leaves every point after the start out as diverged;
    with the setting null (off) it reads them all. decision.json is the reading with the step's setting, not with
    the default."""
    from rangefinder.analysis import read_curve_csv, select_step_window
    from rangefinder.steps.finetune import run_finetune

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    cfg = demo_config(model={"base_model": str(tiny_model_dir)},
                      finetune={"epochs": 1, "successive_halving": False, "cooldown": "off", "average": "off"},
                      validation={"every_epochs": 0.25, "divergence_factor": None},
                      training={"cache_dir": str(tmp_path / "cache")}, sampling={"every_validations": None},
                      tracking={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "registered_model_name": None})
    result = run_finetune(cfg, split_dir=split_dir, lr_low=3e-2, lr_high=3e-2, lr_mid=3e-2, lr_source="fixed",
                          model_dir=tmp_path / "ft")
    decision = json.loads((tmp_path / "ft" / "report" / "decision.json").read_text())
    curve = read_curve_csv(result.curve_csv)

    def window(factor) -> dict:
        return select_step_window(curve["update"], curve["epoch"], curve["val_loss"],
                                  stabilize_loss=curve["stabilize_loss"], tolerance=cfg.finetune.tolerance,
                                  seed=cfg.validation.seed, divergence_factor=factor).to_dict()

    read, at_default = window(None), window(4.0)
    assert {k: decision[k] for k in read} == read
    assert (read["points_dropped"], read["flags"]) == (0, [])
    assert at_default["points_dropped"] == read["points_used"] - 1 and at_default["flags"] == ["diverged"]


def test_a_step_stopped_after_its_pick_resumes_from_the_run_s_end_and_recommends_whole_epochs(
        split_dir, tiny_model_dir, tmp_path, monkeypatch):
    """The step keeps the run's newest checkpoint beside its pick until just before it ends: a step stopped in
    between (here by a Markdown report path that is a folder, where a pod would be preempted) leaves both, and run
    again on its folder resumes at the run's end, trains nothing, and delivers the pick. The pick is the earliest
    tied checkpoint (finetune.deliver: earliest_tied; an LR too small to move the weights ties them all), at update 3:
    at 2 images a micro-batch and 3 micro-batches an update an epoch is 2 2/3 updates, so update 3 is epoch 1.125 and
    the length recommended is the 2 whole epochs' 6 updates on the run's curve, not the checkpoint's own 3."""
    from rangefinder.errors import RangefinderError
    from rangefinder.formats import checkpoints
    from rangefinder.steps.finetune import run_finetune

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    cfg = demo_config(model={"base_model": str(tiny_model_dir)},
                      finetune={"epochs": 2, "successive_halving": False, "cooldown": "off", "average": "off",
                                "deliver": "earliest_tied"},
                      validation={"every_epochs": 0.5},
                      training={"cache_dir": str(tmp_path / "cache"), "batch_size": 2, "grad_accum": 3},
                      sampling={"every_validations": None},
                      tracking={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "registered_model_name": None})
    work, folder = tmp_path / "ft", tmp_path / "report.md"
    folder.mkdir()

    def step(report_md):
        return run_finetune(cfg, split_dir=split_dir, lr_low=1e-12, lr_high=1e-12, lr_mid=1e-12, lr_source="fixed",
                            model_dir=work, report_md=report_md)

    with pytest.raises(RangefinderError, match="is a folder"):
        step(folder)
    chosen = checkpoints.read_chosen(work)
    assert (chosen["rule"], chosen["update"], chosen["epoch"]) == ("earliest_tied", 3, 1.125)
    kept = [checkpoints.checkpoint_update(p) for p in checkpoints.list_checkpoints(work / checkpoints.RUN_DIR)]
    assert kept == [3, 6]  # the pick, and the run's end (6 updates: 16 micro-batches, the last update of 1)

    result = step(tmp_path / "report-again.md")
    assert json.loads((work / "run_summary.json").read_text())["resumed_from"] == 6  # nothing trained again
    assert result.chosen == chosen and [p.name for p in result.checkpoints] == [chosen["checkpoint"]]
    assert (result.recommended_epochs, result.recommended_updates) == (2, 6)


def test_a_fine_tune_without_a_validation_set_delivers_its_final_weights_after_the_configured_epochs(
        shapes_dataset_dir, tiny_model_dir, tmp_path, monkeypatch):
    """A split with no validation images (split.val_split 0, an LR given by hand): there is no curve to read a window
    from, so the step trains the configured epochs, delivers its final weights (no chosen/), keeps the newest
    training.keep_checkpoints checkpoints, and its reports, decision.json, MLflow and KFP outputs say the configured
    length, with no validation loss anywhere."""
    from mlflow import MlflowClient

    from rangefinder.data.split import split_dataset
    from rangefinder.formats import checkpoints
    from rangefinder.steps.finetune import run_finetune

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    split = tmp_path / "split"
    assert len(split_dataset(shapes_dataset_dir, split, val_split=0.0, stabilize_split=0.2, seed=555).val) == 0
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, split={"val_split": 0.0}, lr=1e-4,
                      finetune={"epochs": 2, "average": "off", "cooldown": "off"},
                      training={"cache_dir": str(tmp_path / "cache"), "keep_checkpoints": 1},
                      sampling={"every_validations": None},
                      tracking={"tracking_uri": uri, "experiment_name": "no-val", "registered_model_name": None})
    reports = {k: tmp_path / f"finetune.{k}" for k in ("html", "md")}
    result = run_finetune(cfg, split_dir=split, lr_low=1e-4, lr_high=1e-4, lr_mid=1e-4, lr_source="fixed",
                          model_dir=tmp_path / "ft", report_html=reports["html"], report_md=reports["md"])

    work = tmp_path / "ft"
    # 20 training images at batch 4: 5 updates an epoch; checkpoints at updates 5 and 10, the newest kept.
    assert (result.recommended_epochs, result.recommended_updates, result.updates_trained) == (2, 10, 10)
    assert result.chosen is None and result.best_val_loss is None and not result.still_improving
    assert (work / "final" / "model_index.json").is_file() and not (work / checkpoints.CHOSEN_DIR).exists()
    assert [checkpoints.checkpoint_update(p) for p in result.checkpoints] == [10]
    # The step report's page and Markdown, without a plot, saying what was trained and how to have it measured.
    page, markdown = reports["html"].read_text(), reports["md"].read_text()
    assert page.startswith("<!DOCTYPE html>") and "<img" not in page
    for text in (page, markdown):
        assert "No validation set: trained the configured 2 epochs at lr 0.0001." in text
        assert "split.val_split above 0" in text
    assert "| updates trained | 10 |" in markdown
    decision = json.loads((work / "report" / "decision.json").read_text())
    assert decision["recommended_length"] == {"epochs": 2, "updates": 10, "basis": "configured"}
    assert decision["chosen"] is None and decision["note"] == "no validation: the configured epochs are kept"
    assert result.metrics() == {"recommended_epochs": 2.0, "recommended_updates": 10.0, "lr_used": 1e-4,
                                "updates_trained": 10.0}
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("no-val").experiment_id],
                                filter_string="tags.`rangefinder.step` = 'finetune'")
    assert {k: run.data.metrics[k] for k in ("recommended_epochs", "recommended_updates", "updates_trained")} == {
        "recommended_epochs": 2.0, "recommended_updates": 10.0, "updates_trained": 10.0}
    assert not {"best_val_loss", "chosen_update", "validation/val_loss"} & set(run.data.metrics)
    assert (run.data.tags["recommended_from"], run.data.tags["still_improving"]) == ("configured", "false")
    assert run.data.tags["mlflow.note.content"] == "No validation set: trained the configured 2 epochs at lr 0.0001."
