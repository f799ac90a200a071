"""The fine-tune's window average (steps/average.py): the checkpoints inside the step window averaged, validated on the
run's own terms, and delivered when they measure lower than the window's pick."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
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
    the step with finetune.average on, logging to a real sqlite store; and that run as its training left it, copied
    to plain/ before the step went on (it removes all but its pick): its checkpoints whole and its result."""
    import shutil

    from rangefinder.launch.processes import run_training
    from rangefinder.steps import finetune
    from rangefinder.steps.finetune import run_finetune

    tmp = tmp_path_factory.mktemp("average")
    trained = []

    def copied_as_trained(*args, **kwargs):
        """The step's own training call, its run folder copied as soon as it returns (nothing else changed)."""
        result = run_training(*args, **kwargs)
        shutil.copytree(kwargs["out_dir"], tmp / "plain")
        trained.append(result)
        return result

    with without_mlflow_run_env(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(finetune, "run_training", copied_as_trained)
        cfg = _config(tiny_model_dir, tmp, average="on")
        result = run_finetune(cfg, split_dir=split_dir, lr_low=LR, lr_high=LR, lr_mid=LR, lr_source="fixed",
                              model_dir=tmp / "ft")
    (plain,) = trained
    spec = TrainSpec.finetune(cfg, read_split(split_dir), bounds=(LR, LR), lr=LR, world_size=1)
    return cfg, tmp, result, spec, plain


def test_a_checkpoint_s_own_weights_measure_what_its_run_measured(averaged, split_dir):
    """measure_weights is the run's validation: a checkpoint's weights, measured outside the run, give the loss the
    run's curve has at that update, bit for bit. It leaves the caller's global RNGs as they were (it loads the model
    as a run does, which seeds them)."""
    from rangefinder.training.loop import measure_weights

    _, tmp, _, spec, plain = averaged
    curve = dict(zip(plain.curve["update"], plain.curve["val_loss"], strict=True))
    for ckpt in checkpoints.list_checkpoints(tmp / "plain" / "checkpoints")[:2]:
        torch.manual_seed(1)  # the caller's own states, not those the fixture's runs left
        np.random.seed(1)
        before = torch.get_rng_state(), np.random.get_state()[1].tolist()
        row = measure_weights(spec, checkpoints.read_weights(ckpt), out_dir=tmp / f"m-{ckpt.name}",
                              split=read_split(split_dir))
        assert row["val_loss"] == curve[float(checkpoints.checkpoint_update(ckpt))]
        assert torch.equal(torch.get_rng_state(), before[0]) and np.random.get_state()[1].tolist() == before[1]


def test_the_window_s_checkpoints_are_averaged_measured_and_the_lower_delivered(averaged, split_dir):
    """The step averaged exactly the checkpoints inside its window (its run's, copied to plain/ before it pruned
    them), its measurement is that average's validation loss, and the average is delivered exactly when it measures
    below the window's pick: chosen/ then holds the average, and the report, decision.json and MLflow say so."""
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
        assert info["epoch"] == inside[-1] / 4  # the newest averaged checkpoint's epoch (16 images at batch 4)
        assert info["window_pick"]["val_loss"] == avg["pick_val_loss"]
        unet = UNet2DConditionModel.from_pretrained(str(work / checkpoints.CHOSEN_DIR / "unet")).state_dict()
        assert all(torch.equal(unet[k.removeprefix("unet.")], v) for k, v in mean.items() if k.startswith("unet."))
        # Its file says it is an average, and of which checkpoints; its updates and epochs are the newest one's, the
        # training that made it (what A1111 and kohya's browsers show as its steps), not a checkpoint it is.
        from rangefinder.formats.weights_file import read_metadata

        meta = read_metadata(work / checkpoints.CHOSEN_DIR / "model.safetensors")
        assert json.loads(meta["rangefinder.averaged_updates"]) == inside
        assert (meta["rangefinder.updates"], float(meta["rangefinder.epochs"])) == (str(inside[-1]), inside[-1] / 4)
    else:
        assert info["rule"] == "window_lowest" and info["val_loss"] == avg["pick_val_loss"]
    assert checkpoints.read_chosen(work) == info
    assert not (work / AVERAGE_DIR / "final").exists()  # delivered (moved) or dropped
    assert json.loads((work / "report" / "decision.json").read_text())["chosen"]["average"] == avg
    report = (work / "report" / "step_report.md").read_text()  # the sentence under the label that names it once
    assert f'**window average**: {avg["sentence"].removeprefix("Window average: ")}' in report
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name("average").experiment_id
    (ft,) = client.search_runs([exp], filter_string="tags.`rangefinder.step` = 'finetune'")
    assert ft.data.metrics["average_val_loss"] == avg["val_loss"]
    assert ft.data.tags["average_delivered"].lower() == str(avg["delivered"]).lower()
    assert ft.data.tags["average_how"] == avg["how"] == "uniform"  # soup_tries 0: no soup


def test_the_report_mlflow_and_the_step_s_outputs_give_one_recommended_length(averaged):
    """The report said "Train for 73 epochs (about 293 updates)", and MLflow and the step's outputs 293 updates too:
    the window's centre in updates, where the 73 epochs a retrain trains take 292 at 4 per epoch. Now the epochs and
    the updates they take agree, in the report's lead and rows, decision.json, MLflow and the step's outputs."""
    from mlflow import MlflowClient

    from rangefinder.analysis import read_curve_csv, select_step_window

    cfg, tmp, result, _, _ = averaged
    epochs, updates = result.recommended_epochs, result.recommended_updates
    assert updates == 4 * epochs  # 16 training images at batch 4
    report = tmp / "ft" / "report"
    md = (report / "step_report.md").read_text()
    assert f"Train for {epochs} epochs ({updates} updates of this fine-tune)." in md.split("\n")[2]
    assert f"| recommended epochs | {epochs} |" in md and f"| recommended updates | {updates} |" in md
    decision = json.loads((report / "decision.json").read_text())
    assert decision["recommended_length"] == {"epochs": epochs, "updates": updates, "basis": "window"}
    assert decision["recommended_updates"] == updates  # the window's own, beside it
    assert (result.chosen["recommended_epochs"], result.chosen["recommended_updates"]) == (epochs, updates)
    # The window is read off the run's validation and stabilize curves with the config's settings.
    curve = read_curve_csv(result.curve_csv)
    window = select_step_window(curve["update"], curve["epoch"], curve["val_loss"],
                                stabilize_loss=curve["stabilize_loss"], tolerance=cfg.finetune.tolerance,
                                seed=cfg.validation.seed, divergence_factor=cfg.validation.divergence_factor).to_dict()
    assert window["val_minus_stabilize"] is not None and {k: decision[k] for k in window} == window
    client = MlflowClient(cfg.tracking.tracking_uri)
    (ft,) = client.search_runs([client.get_experiment_by_name("average").experiment_id],
                               filter_string="tags.`rangefinder.step` = 'finetune'")
    assert (ft.data.metrics["recommended_epochs"], ft.data.metrics["recommended_updates"]) == (epochs, updates)
    metrics = result.metrics()  # the step's KFP metrics
    assert metrics["recommended_updates"] == updates
    assert [metrics[f"chosen_{k}"] for k in ("update", "epoch", "val_loss")] == [
        result.chosen[k] for k in ("update", "epoch", "val_loss")]


def test_a_retried_step_delivers_what_its_first_attempt_delivered(averaged, split_dir):
    """A pod preempted once the step had kept its checkpoint and delivered (its work folder kept, as RANGEFINDER_WORK
    keeps it) runs the step again on that folder: it trains again from the one checkpoint left, bit-exactly, reads
    the average it measured, and delivers the same weights under the same chosen.json, with one checkpoint left.
    (Until 2026-11-29 it wrote the kept checkpoint's model over the delivered average, and chosen.json said the
    average was not delivered.)"""
    import shutil

    from rangefinder.steps.finetune import run_finetune

    cfg, tmp, result, _, _ = averaged
    assert result.chosen["rule"] == "window_average"  # the average was delivered: what a retry must not undo
    retry = tmp / "retried"
    shutil.copytree(tmp / "ft", retry)
    store = cfg.tracking.model_copy(update={"tracking_uri": f"sqlite:///{tmp / 'retried.db'}"})
    with without_mlflow_run_env():
        again = run_finetune(cfg.model_copy(update={"tracking": store}), split_dir=split_dir, lr_low=LR, lr_high=LR,
                             lr_mid=LR, lr_source="fixed", model_dir=retry)
    assert again.chosen == result.chosen == checkpoints.read_chosen(retry)
    assert again.recommended_epochs == result.recommended_epochs

    def files(d):
        return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}

    assert files(retry / checkpoints.CHOSEN_DIR) == files(tmp / "ft" / checkpoints.CHOSEN_DIR)
    assert [p.name for p in checkpoints.list_checkpoints(retry / checkpoints.RUN_DIR)] == [
        p.name for p in checkpoints.list_checkpoints(tmp / "ft" / checkpoints.RUN_DIR)]
    assert len(checkpoints.list_checkpoints(retry / checkpoints.RUN_DIR)) == 1


def test_a_step_retried_before_it_ends_goes_on_from_the_run_s_end(averaged, split_dir, tiny_model_dir):
    """The step keeps the run's newest checkpoint beside the one it chose until just before it ends
    (keep_chosen_checkpoint's keep_newest; one is left after the step, as the test above checks): a step retried in
    between resumes at the run's end and trains nothing, where from the chosen checkpoint alone it would train the
    rest of the run again. Here the window is put at updates 4-12, so that the pick is not the run's end."""
    import shutil
    from types import SimpleNamespace

    from rangefinder.launch.processes import run_training
    from rangefinder.steps.finetune import keep_chosen_checkpoint

    cfg, tmp, _, spec, plain = averaged
    work = shutil.copytree(tmp / "plain", tmp / "before-the-end")
    window = SimpleNamespace(recommended_updates=8, recommended_epochs=2, status="ok", tolerance=0.02, band=0.0,
                             best_val_loss=None, window_start_update=4, window_end_update=12)
    info = keep_chosen_checkpoint(work, window, plain.curve_arrays(), tiny_model_dir, keep_newest=True)
    assert info is not None and info["update"] in (4, 8, 12)
    left = [checkpoints.checkpoint_update(p) for p in checkpoints.list_checkpoints(work / checkpoints.RUN_DIR)]
    assert left == [info["update"], plain.updates] == [info["update"], 24]
    again = run_training(cfg, spec, out_dir=work, split=read_split(split_dir))
    assert again.resumed_from == again.updates == plain.updates  # nothing trained again
    assert again.curve.keys() == plain.curve.keys()
    for column, values in plain.curve_arrays().items():  # the same curve, NaN where nothing was measured
        np.testing.assert_array_equal(again.curve_arrays()[column], values)


def test_a_window_holding_one_checkpoint_is_not_averaged(averaged, split_dir, tiny_model_dir):
    """Fewer than 2 checkpoints inside the window: nothing to average, so nothing is measured or written (an
    "average" of the one checkpoint is that checkpoint, and chosen.json would offer it as the window average)."""
    import shutil
    from types import SimpleNamespace

    from rangefinder.steps.average import run_average

    cfg, tmp, _, spec, _ = averaged
    work = tmp / "one-in-the-window"
    shutil.copytree(tmp / "plain" / "checkpoints", work / "checkpoints")
    window = SimpleNamespace(recommended_epochs=2, window_start_update=6.0, window_end_update=10.0)  # update 8 only
    assert run_average(cfg, spec, work, window, read_split(split_dir), tiny_model_dir) is None
    assert not (work / AVERAGE_DIR).exists()


def test_a_multi_process_fine_tune_s_average_is_measured_as_one_process_measures_it(averaged, split_dir,
                                                                                     tiny_model_dir):
    """The step measures the window average in its own process: for a fine-tune trained on 2 processes it measures
    the whole validation set as one process, the loss the one-process step measured for the same average."""
    import shutil
    from types import SimpleNamespace

    from rangefinder.steps.average import run_average

    cfg, tmp, result, _, _ = averaged
    info, split = result.chosen, read_split(split_dir)
    work = tmp / "two-processes"
    shutil.copytree(tmp / "plain" / "checkpoints", work / "checkpoints")
    window = SimpleNamespace(recommended_epochs=info["recommended_epochs"],
                             window_start_update=info["window_start_update"],
                             window_end_update=info["window_end_update"])
    two = TrainSpec.finetune(cfg, split, bounds=(LR, LR), lr=LR, world_size=2)
    measured = run_average(cfg, two, work, window, split, tiny_model_dir)
    assert measured is not None and measured.val_loss == info["average"]["val_loss"]


@pytest.mark.parametrize(("second", "said"), [
    ({"y": torch.ones(2)}, "other tensors"),
    # The same names at another shape (a LoRA rank changed between the runs): a torch broadcasting traceback.
    ({"x": torch.ones(3)}, r"holds x of shape \(3,\) where .*a holds \(2,\): they are not checkpoints of one run"),
], ids=["other-names", "other-shapes"])
def test_checkpoints_of_different_runs_are_not_averaged(tmp_path, second, said):
    from safetensors.torch import save_file

    from rangefinder.errors import RangefinderError
    from rangefinder.formats.digest import file_sha256

    for name, weights in (("a", {"x": torch.ones(2)}), ("b", second)):
        d = tmp_path / name
        d.mkdir()
        save_file(weights, str(d / checkpoints.WEIGHTS_NAME))
        for other in (checkpoints.OPTIMIZER_NAME, checkpoints.STATE_NAME):
            (d / other).write_text("{}")
        sums = {f.name: file_sha256(f) for f in d.iterdir()}
        (d / checkpoints.MANIFEST_NAME).write_text(json.dumps({"sha256": sums}))
    with pytest.raises(RangefinderError, match=said):
        average_weights([tmp_path / "a", tmp_path / "b"])


@pytest.mark.parametrize(("settings", "warned"), [
    ({"finetune": {"average": "on"}, "training": {"use_ema": True}}, "does nothing with training.use_ema"),
    # LoRA keeps an EMA by default (training.use_ema auto): the fix names the setting that measures the average.
    ({"finetune": {"average": "on"}, "training": {"method": "lora"}},
     "does nothing with training.use_ema auto, which keeps an EMA for LoRA on SD 1.x/2.x: the run already "
     "validates and delivers "
     "averaged weights; set average off, or training.use_ema false to average the window's checkpoints instead"),
    ({"finetune": {"average": "on"}, "training": {"method": "lora", "use_ema": False}}, None),
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
    assert average_applies(cfg, True) is (warned is None)
    several = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"num_nodes": 2})})
    assert not average_applies(several, True)
    from rangefinder.steps.average import not_on_several_nodes

    said = not_on_several_nodes(several)  # the fine-tune's note, where it was asked for and did not run
    assert (said is not None and said.startswith("Window average: not measured")) is (cfg.finetune.average == "on")
    assert not_on_several_nodes(cfg) is None
    assert parse_config(yaml.safe_load("finetune:\n  average: off\n")).finetune.average == "off"


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_lora_beyond_sd1_keeps_no_ema_by_default_so_the_window_average_runs(family, request):
    """On SDXL, SD3 and Flux training.use_ema auto keeps no EMA (config.EMA_AUTO_FAMILIES), so LoRA's window average
    is measured there, and asking for it is no conflict; on the tiny SD model the same settings keep an EMA instead."""
    from rangefinder.config import parse_config, setting_conflicts
    from rangefinder.steps.average import average_applies

    model_dir = request.getfixturevalue({"sdxl": "tiny_sdxl_dir", "flux": "tiny_flux_dir"}[family])
    settings = {"finetune": {"average": "on"}, "training": {"method": "lora"}}
    other = parse_config({**settings, "model": {"base_model": str(model_dir)}})
    assert average_applies(other, True) and not [ln for ln in setting_conflicts(other, family) if "average" in ln]
    sd = parse_config(settings)
    assert not average_applies(sd, True) and [ln for ln in setting_conflicts(sd, "sd1") if "average" in ln]


def test_the_registered_version_names_the_average_it_holds():
    """register_model's `rangefinder.weights` tag: the checkpoint's name, or for weights that are no checkpoint what
    they are (it said "finetune None" for them)."""
    from rangefinder.steps.register_model import delivered_name

    assert delivered_name({"checkpoint": "checkpoint-000012", "rule": "window_lowest"}) == "checkpoint-000012"
    assert delivered_name({"checkpoint": None, "rule": "window_average", "update": 16,
                           "average": {"updates": [8, 12, 16]}}) == "window average of updates 8-16"
    assert delivered_name({"checkpoint": None, "rule": "cooldown", "update": 20}) == "cooldown at update 20"


def test_the_greedy_soup_keeps_only_what_lowers_the_loss_and_offers_the_lower_average(averaged, split_dir,
                                                                                      tiny_model_dir):
    """finetune.soup_tries: from the window's pick, the window's other checkpoints tried in order of their curve
    loss, each kept only when the soup's measured loss falls; the lower of the uniform average and the soup is the
    one offered for delivery, and its model is the average of exactly the checkpoints it names."""
    import shutil
    from types import SimpleNamespace

    from rangefinder.steps.average import greedy_soup, run_average, window_checkpoints
    from rangefinder.steps.finetune import curve_losses
    from rangefinder.training.loop import measure_weights, weights_measurer

    cfg, tmp, result, spec, plain = averaged
    split = read_split(split_dir)
    info = result.chosen
    window = SimpleNamespace(recommended_epochs=1, window_start_update=info["window_start_update"],
                             window_end_update=info["window_end_update"])
    work = tmp / "soup"
    shutil.copytree(tmp / "plain" / "checkpoints", work / "checkpoints")
    losses = curve_losses(plain.curve_arrays())
    found = window_checkpoints(work / "checkpoints", window)
    pick = min(found, key=lambda u: (losses[u], u))

    measured_losses: list[float] = []
    with weights_measurer(spec, out_dir=tmp / "soup-by-hand", split=split) as measure:
        def recorded(weights):
            row = measure(weights)
            measured_losses.append(row["val_loss"])
            return row

        soup = greedy_soup(found, losses, recorded, tries=2)
    assert soup.tries == len(measured_losses) == min(2, len(found) - 1)
    assert pick in soup.updates and set(soup.updates) <= set(found)
    # Each kept addition lowered the soup: the soup's loss is the lowest measured, below the pick's own.
    if len(soup.updates) > 1:
        assert soup.val_loss == min(measured_losses) < losses[pick]
    else:
        assert soup.val_loss is None and min(measured_losses) >= losses[pick]

    soup_cfg = cfg.model_copy(update={"finetune": cfg.finetune.model_copy(update={"soup_tries": 2})})
    measured = run_average(soup_cfg, spec, work, window, split, tiny_model_dir, curve_losses=losses)
    assert measured is not None and measured.window_updates == tuple(found) and measured.soup_tries == soup.tries
    assert measured.uniform_val_loss == info["average"]["val_loss"]  # the step's uniform average, the same run
    if measured.how == "greedy_soup":
        assert measured.updates == soup.updates and measured.val_loss == soup.val_loss < measured.uniform_val_loss
    else:
        assert measured.updates == tuple(found) and measured.val_loss == measured.uniform_val_loss
    again = measure_weights(spec, average_weights([found[u] for u in measured.updates]), out_dir=tmp / "soup-again",
                            split=split)
    assert again["val_loss"] == pytest.approx(measured.val_loss, rel=1e-5)
    assert "greedy soup" in measured.sentence(losses[pick]) or measured.how == "uniform"


def test_soup_tries_without_the_average_is_one_warning():
    from rangefinder.config import parse_config, setting_conflicts

    lines = [ln for ln in setting_conflicts(parse_config({"finetune": {"average": "off", "soup_tries": 4}}))
             if "soup_tries" in ln]
    assert len(lines) == 1 and "set average on" in lines[0]
    assert not [ln for ln in setting_conflicts(parse_config({"finetune": {"soup_tries": 4}})) if "soup" in ln]


def test_the_registered_version_names_a_greedy_soup():
    from rangefinder.steps.register_model import delivered_name

    assert delivered_name({"checkpoint": None, "rule": "window_average", "update": 16,
                           "average": {"updates": [8, 16], "how": "greedy_soup"}}) == \
        "window greedy soup of updates 8, 16"


def test_earliest_tied_weighs_the_average_and_delivers_the_first_checkpoint_in_its_band(split_dir, tiny_model_dir,
                                                                                       tmp_path):
    """finetune.deliver: earliest_tied through the step, for textual inversion (the method it was measured for): the
    window average is measured and sets the band with the window's pick, the earliest checkpoint within 1 % of the
    lower of the two is delivered (found here again from the run's curve), the average is said and not delivered, and
    the report, decision.json, MLflow and the retrain's length follow the delivered checkpoint."""
    import math

    from mlflow import MlflowClient

    from rangefinder.analysis import read_curve_csv
    from rangefinder.steps.delivery import NOT_OFFERED
    from rangefinder.steps.finetune import run_finetune

    with without_mlflow_run_env():
        cfg = _config(tiny_model_dir, tmp_path, average="on", deliver="earliest_tied")
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"method": "textual_inversion"})})
        result = run_finetune(cfg, split_dir=split_dir, lr_low=5e-3, lr_high=5e-3, lr_mid=5e-3, lr_source="fixed",
                              model_dir=tmp_path / "ft")
    info, work = result.chosen, tmp_path / "ft"
    avg, pick = info["average"], info["window_pick"]
    target = min(v for v in (pick["val_loss"], avg["val_loss"]) if v is not None)
    curve = read_curve_csv(result.curve_csv)
    loss = {int(u): float(v) for u, v, e in zip(curve["update"], curve["val_loss"], curve["epoch"], strict=True)
            if float(e).is_integer() and e > 0}  # a checkpoint every epoch, validated there
    expected = min(u for u, v in loss.items() if v <= target * 1.01)
    assert (info["rule"], info["update"], info["val_loss"]) == ("earliest_tied", expected, loss[expected])
    assert expected < pick["update"]  # an earlier checkpoint than the window's pick: the rule changed something
    assert info["band"]["target_val_loss"] == target
    assert [checkpoints.checkpoint_update(p) for p in checkpoints.list_checkpoints(work / "checkpoints")] == [expected]
    assert avg["delivered"] is False and avg["sentence"].endswith(f"{NOT_OFFERED}.")
    assert avg["pick_val_loss"] == pick["val_loss"] and not (work / AVERAGE_DIR / "final").exists()
    decision = json.loads((work / "report" / "decision.json").read_text())
    assert decision["chosen"] == info == checkpoints.read_chosen(work)
    report = (work / "report" / "step_report.md").read_text()
    assert f"Delivered: update {expected}, the earliest checkpoint" in report
    epochs = math.ceil(info["epoch"] - 1e-9)
    assert (result.recommended_epochs, result.recommended_updates) == (epochs, expected)
    # The report's lead and rows give that length, the one the retrain trains, not the window's centre.
    assert f"Train for {epochs} epochs ({expected} updates of this fine-tune): the delivered checkpoint's epoch" in \
        report.split("\n")[2]
    assert f"| recommended epochs | {epochs} |" in report
    client = MlflowClient(cfg.tracking.tracking_uri)
    (ft,) = client.search_runs([client.get_experiment_by_name("average").experiment_id],
                               filter_string="tags.`rangefinder.step` = 'finetune'")
    assert ft.data.tags["chosen_rule"] == "earliest_tied" and ft.data.tags["average_delivered"].lower() == "false"
    assert ft.data.metrics["recommended_epochs"] == epochs and ft.data.metrics["chosen_update"] == expected


def test_earliest_tied_without_validation_is_one_warning():
    from rangefinder.config import parse_config, setting_conflicts

    def said(settings):
        return [ln for ln in setting_conflicts(parse_config(settings)) if "finetune.deliver" in ln]

    (line,) = said({"finetune": {"deliver": "earliest_tied"}, "split": {"val_split": 0}, "lr": 1e-4})
    assert "does nothing without validation" in line and "split.val_split" in line
    (line,) = said({"finetune": {"deliver": "earliest_tied"}, "validation": {"every_epochs": 0}})
    assert "validation.every_epochs" in line
    assert said({"finetune": {"deliver": "earliest_tied"}}) == said({"split": {"val_split": 0}, "lr": 1e-4}) == []


def test_the_window_s_checkpoints_include_the_ones_at_its_edges(tmp_path):
    """The average takes every kept checkpoint inside the step window, its first and last update included (a window
    read off validations lies on checkpoints where the two coincide); none without a recommended length."""
    from types import SimpleNamespace

    from rangefinder.steps.average import window_checkpoints

    root = tmp_path / checkpoints.RUN_DIR
    for update in (4, 8, 12, 16, 20):
        folder = root / checkpoints.checkpoint_name(update)
        folder.mkdir(parents=True)
        checkpoints.write_main(folder, weights={"w": torch.full((4,), float(update))}, optimizer={"state": {}},
                               state={"update": update})
    window = SimpleNamespace(recommended_epochs=3, window_start_update=8.0, window_end_update=16.0)
    assert sorted(window_checkpoints(root, window)) == [8, 12, 16]
    assert window_checkpoints(root, SimpleNamespace(recommended_epochs=None, window_start_update=8.0,
                                                    window_end_update=16.0)) == {}


def test_half_precision_checkpoints_are_averaged_in_float32_and_kept_in_their_own_dtype(tmp_path):
    """bf16 and fp16 trained tensors (LoRA factors, textual inversion vectors under a half-precision weights dtype):
    the running mean is taken in float32 and each average returned in its tensor's own dtype. In bf16 the mean of
    1, 1+2^-7, 1+2^-7 rounds back to 1 at every step (its steps are below bf16's spacing at 1), where the float32
    mean, 1.0052, rounds to 1+2^-7; the update count is the newest checkpoint's."""
    step = 2.0 ** -7  # bf16's spacing at 1
    ckpts = []
    for update, value in ((4, 1.0), (8, 1.0 + step), (12, 1.0 + step)):
        folder = tmp_path / checkpoints.checkpoint_name(update)
        folder.mkdir()
        weights = {"lora.bf16": torch.full((3,), value, dtype=torch.bfloat16),
                   "ti.fp16": torch.full((2,), value * 3, dtype=torch.float16),
                   "method.updates": torch.tensor(update, dtype=torch.int64)}
        checkpoints.write_main(folder, weights=weights, optimizer={"state": {}}, state={"update": update})
        ckpts.append(folder)
    mean = average_weights(ckpts)
    assert {k: v.dtype for k, v in mean.items()} == {"lora.bf16": torch.bfloat16, "ti.fp16": torch.float16,
                                                     "method.updates": torch.int64}
    for key in ("lora.bf16", "ti.fp16"):
        by_hand = torch.stack([checkpoints.read_weights(c)[key].float() for c in ckpts]).mean(0)
        assert torch.equal(mean[key], by_hand.to(mean[key].dtype)), key
    assert torch.equal(mean["lora.bf16"], torch.full((3,), 1.0 + step, dtype=torch.bfloat16))
    assert int(mean["method.updates"]) == 12


def test_the_greedy_soup_starts_from_the_pick_and_keeps_what_lowers_the_measured_loss(tmp_path):
    """greedy_soup's rule on weights whose loss is known: w at 0, 3 and -2 (updates 8, 12, 4) measured as (w - 1)^2,
    their curve losses 1, 4 and 9. From update 8 (the lowest), update 12 is tried first and kept (the soup's mean
    1.5 measures 0.25, below 1), then update 4 is tried and left out (1/3 measures 0.44); the soup's update count is
    its newest checkpoint's. Started from the worst, or each candidate measured at the wrong mean, it keeps others."""
    from rangefinder.steps.average import greedy_soup

    found = {}
    for update, w in ((4, -2.0), (8, 0.0), (12, 3.0)):
        folder = tmp_path / checkpoints.checkpoint_name(update)
        folder.mkdir()
        checkpoints.write_main(folder, weights={"w": torch.tensor([w]), "method.updates": torch.tensor(update)},
                               optimizer={"state": {}}, state={"update": update})
        found[update] = folder
    measured: list[float] = []

    def measure(weights):
        measured.append(float(weights["w"].mean()))
        return {"val_loss": (measured[-1] - 1.0) ** 2}

    soup = greedy_soup(found, {4: 9.0, 8: 1.0, 12: 4.0}, measure, tries=2)
    assert measured == pytest.approx([1.5, 1 / 3])
    assert (soup.updates, soup.val_loss, soup.tries) == ((8, 12), 0.25, 2)
    assert float(soup.weights["w"]) == 1.5 and int(soup.weights["method.updates"]) == 12


def test_the_greedy_soup_is_offered_only_where_it_measures_below_the_uniform_average():
    """The window average offers the greedy soup only where it measured lower than the uniform average of the
    window's checkpoints: a soup measured higher (it starts from the window's pick and keeps what lowers its own
    loss, which need not reach the uniform average's) leaves the uniform average offered, the soup's tries said."""
    from rangefinder.steps.average import Soup, WindowAverage, offered

    uniform = WindowAverage(updates=(4, 8, 12), val_loss=0.10, window_updates=(4, 8, 12), uniform_val_loss=0.10)

    def soup(updates, val_loss):
        return Soup(updates=updates, weights={}, val_loss=val_loss, tries=2)

    assert offered(uniform, None) == uniform
    higher = offered(uniform, soup((8, 12), 0.12))
    assert (higher.how, higher.updates, higher.val_loss, higher.soup_tries) == ("uniform", (4, 8, 12), 0.10, 2)
    assert offered(uniform, soup((8, 12), 0.10)).how == "uniform"  # as low: the uniform average, which has no choice
    lower = offered(uniform, soup((8, 12), 0.08))
    assert (lower.how, lower.updates, lower.val_loss, lower.uniform_val_loss, lower.window_updates) == (
        "greedy_soup", (8, 12), 0.08, 0.10, (4, 8, 12))
    assert offered(uniform, soup((4, 8, 12), 0.08)).how == "uniform"  # every checkpoint: the uniform average
    assert offered(uniform, soup((8,), None)).how == "uniform"  # nothing added to the pick: no soup
    not_finite = dataclasses.replace(uniform, val_loss=None, uniform_val_loss=None)
    assert offered(not_finite, soup((8, 12), 0.12)).how == "greedy_soup"
