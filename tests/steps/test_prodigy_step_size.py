"""The prodigy_step LR finder's step (steps/prodigy_step_size.py): a real Prodigy run on the tiny model whose last
step size is the LR, trained exactly as a fine-tune with training.optimizer prodigy and diffusers' settings, and
logged to MLflow as a child of the pipeline's run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rangefinder.analysis import read_curve_csv
from rangefinder.config import demo_config, load_config
from rangefinder.training.optimizers import PRODIGY_SETTINGS
from tests.tracking.fixtures import without_mlflow_run_env

# 3 epochs of 16 images at batch 4: 12 updates, validated every 2. Prodigy's d first grows at update 9 here; a
# shorter run ends on d0 and measures nothing (the error below).
FINETUNE = {"epochs": 3, "average": "off"}


def _config(tiny_model_dir, tmp, training=None, **extra):
    tmp.mkdir(parents=True, exist_ok=True)
    return demo_config(model={"base_model": str(tiny_model_dir)}, finetune=FINETUNE,
                       training={"cache_dir": str(tmp / "cache"), **(training or {})},
                       sampling={"every_validations": None}, validation={"every_epochs": 0.5},
                       tracking={"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment_name": "prodigy-step",
                                 "registered_model_name": None},
                       lr_range_test={"lr_min": None, "lr_max": None}, **extra)


@pytest.fixture(scope="module")
def probed(split_dir, tiny_model_dir, tmp_path_factory):
    """The step on the tiny model (full fine-tuning), under an MLflow parent run as the pipeline opens one, with the
    config's own prodigy_step_factor (2: the LR trained is twice the step size read)."""
    from rangefinder import tracking
    from rangefinder.steps.prodigy_step_size import run_prodigy_step_size

    tmp = tmp_path_factory.mktemp("prodigy-step")
    with without_mlflow_run_env():
        cfg = _config(tiny_model_dir, tmp, lr_finder="prodigy_step", prodigy_step_factor=2.0)
        parent = tracking.ensure_parent_run(cfg, name="pipeline", kfp_run_id="kfp-prodigy-step")
        result = run_prodigy_step_size(cfg, split_dir=split_dir, out_dir=tmp / "probe",
                                       report_html=tmp / "report.html", report_md=tmp / "report.md",
                                       mlflow_parent_run_id=parent)
    return cfg, tmp, parent, result


def test_the_lr_is_the_last_step_size_of_a_prodigy_fine_tune_bit_for_bit(probed, split_dir, tiny_model_dir):
    """The step's LR is the last prodigy_d_lr its real Prodigy run logged (d x lr after the last update, what
    lr_effective logged before it became the step each update took), and that run is the fine-tune a user gets
    with training.optimizer prodigy and PRODIGY_SETTINGS: the same step sizes and validation losses, bit for bit."""
    from rangefinder.steps.finetune import run_finetune

    cfg, tmp, _, result = probed
    updates = read_curve_csv(result.updates_csv, required=("lr_effective", "prodigy_d_lr"))
    assert len(updates["update"]) == result.reading.updates == 12
    step = result.reading.step_size
    assert step == updates["prodigy_d_lr"][-1] and result.lr == 2 * step  # the config's factor times the step size
    # The last update stepped with the d from before it, times the bias correction (< 1): less than the estimate.
    assert 0 < updates["lr_effective"][-1] < step
    assert result.reading.d == step  # at Prodigy's lr 1.0, d x lr is d
    assert 1e-6 < step < 1.0  # the step size d x lr, grown from d0, not the lr the run was given

    with without_mlflow_run_env():
        plain = _config(tiny_model_dir, tmp / "plain", training={"optimizer": "prodigy", "prodigy": PRODIGY_SETTINGS})
        assert plain.pipeline_lr() == 1.0  # the pipeline's fixed branch: one constant run at lr 1.0
        tuned = run_finetune(plain, split_dir=split_dir, lr_low=1.0, lr_high=1.0, lr_mid=1.0, lr_source="fixed",
                             model_dir=tmp / "plain" / "ft")
    theirs = read_curve_csv(tmp / "plain" / "ft" / "updates.csv", required=("lr_effective", "prodigy_d_lr"))
    for column in ("lr_effective", "prodigy_d_lr"):
        assert theirs[column].tolist() == updates[column].tolist(), column
    assert theirs["prodigy_d_lr"][-1] == step
    mine = read_curve_csv(result.curve_csv)
    assert read_curve_csv(tuned.curve_csv)["val_loss"].tolist() == mine["val_loss"].tolist()
    assert result.reading.best_val_loss == min(mine["val_loss"].tolist())


def test_logged_as_a_child_run_of_the_pipeline_like_the_range_test(probed):
    from mlflow import MlflowClient

    cfg, tmp, parent, result = probed
    client = MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name("prodigy-step").experiment_id
    (run,) = client.search_runs([exp], filter_string="tags.`rangefinder.step` = 'prodigy_step_size'")
    assert run.data.tags["mlflow.parentRunId"] == parent
    step = result.reading.step_size
    history = client.get_metric_history(run.info.run_id, "prodigy_d_lr")
    assert sorted((m.step, m.value) for m in history)[-1] == (12, step)
    # Beside it, the step each update took (the d from before it, times the bias correction).
    taken = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "lr_effective"))
    assert len(taken) == 12 and taken[-1][0] == 12 and 0 < taken[-1][1] < step
    assert run.data.params["training.optimizer"] == "prodigy" and run.data.params["lr_source"] == "prodigy-step"
    # Its config.yaml is the pipeline run's, as every step run's is: the probe's (optimizer prodigy at lr 1.0, no
    # halving, no average), copied to run again, trained a Prodigy fine-tune and discovered no LR, without a word.
    copied = load_config(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp / "copied")))
    assert copied == cfg and copied.pipeline_lr() is None
    # lr_source has one home on this run, its params, as on the fine-tune's; the step size read is a tag (an LR).
    assert "lr_source" not in run.data.tags and float(run.data.tags["lr_prodigy_step"]) == \
        pytest.approx(step, rel=1e-3)
    assert float(run.data.tags["lr_trained"]) == pytest.approx(result.lr, rel=1e-3) and result.lr == 2 * step
    assert run.data.metrics["prodigy_d"] == result.reading.d
    # The parent shows choose_lr's decision, not the probe's reading.
    assert "lr_prodigy_step" not in client.get_run(parent).data.tags
    # The report a person reads says where the LR came from; the probe's weights are not kept.
    assert f"{result.lr:.3g}" in (tmp / "report.md").read_text() and "d x lr" in (tmp / "report.md").read_text()
    assert (tmp / "report.html").read_text().startswith("<!DOCTYPE html>")
    # Its report and reading, as MLflow hands them to a teammate, name the curves as the run holds them.
    from tests.tracking.fixtures import check_logged_files_name_no_local_path

    text = check_logged_files_name_no_local_path(client, run.info.run_id, tmp, ("report", "analysis"))
    assert "curves/updates.csv in this step's MLflow run" in text  # the report's curve: the step size per update
    # One file of each: the report's JSON is the reading, which analysis/prodigy_step.json holds with the settings.
    assert [a.path for a in client.list_artifacts(run.info.run_id, "report")] == [
        "report/prodigy_report.html", "report/prodigy_report.md", "report/prodigy_step.png"]
    reading = json.loads(Path(client.download_artifacts(run.info.run_id, "analysis/prodigy_step.json",
                                                        str(tmp / "dl"))).read_text())
    assert (reading["curve_csv"], reading["updates_csv"]) == ("curves/metrics.csv", "curves/updates.csv")
    assert not list((tmp / "probe").rglob("checkpoint-*"))


@pytest.mark.parametrize("steps, match", [([], "took no update"), ([1e-6, float("nan")], "not a positive"),
                                          ([1e-6, 0.0], "not a positive"), ([1e-6] * 8, "never grew")])
def test_no_usable_step_size_is_one_error_naming_the_fix(steps, match):
    import numpy as np

    from rangefinder.analysis import read_prodigy_step
    from rangefinder.errors import RangefinderError

    updates = {"update": np.arange(1, len(steps) + 1, dtype=float), "lr_effective": np.asarray(steps, dtype=float)}
    with pytest.raises(RangefinderError, match=match) as err:
        read_prodigy_step(updates, None, 1.0)
    assert "lr_finder: range_test" in str(err.value) and "\n" not in str(err.value)


def test_the_reading_is_prodigy_d_lr_and_lr_effective_in_an_updates_csv_written_before_it(tmp_path):
    """updates.csv's prodigy_d_lr (d x lr after each update) is the reading, not lr_effective (the step the update
    took); a file written before prodigy_d_lr existed has that number as lr_effective, and a run resumed from such a
    checkpoint has its first rows without it: each row without prodigy_d_lr is read off its lr_effective."""
    from rangefinder.analysis import read_prodigy_step
    from rangefinder.analysis.prodigy_step import step_size_estimates

    files = {"now": "update,epoch,lr,train_loss,grad_norm,lr_effective,prodigy_d_lr\n"
                    "1,0.25,1.0,0.5,1.0,1e-06,1e-06\n2,0.5,1.0,0.5,1.0,7.4e-07,3e-05\n",
             "older": "update,epoch,lr,train_loss,grad_norm,lr_effective\n1,0.25,1.0,0.5,1.0,1e-06\n"
                      "2,0.5,1.0,0.5,1.0,3e-05\n",
             "resumed": "update,epoch,lr,train_loss,grad_norm,lr_effective,prodigy_d_lr\n"
                        "1,0.25,1.0,0.5,1.0,1e-06,\n2,0.5,1.0,0.5,1.0,7.4e-07,3e-05\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.csv").write_text(text)
        updates = read_curve_csv(tmp_path / f"{name}.csv", required=("update", "lr_effective"))
        assert step_size_estimates(updates).tolist() == [1e-06, 3e-05], name
        assert read_prodigy_step(updates, None, 1.0).step_size == 3e-05, name


def test_the_reading_s_losses_are_the_finite_ones_and_its_epochs_the_last_row_s():
    """A constant-LR run goes on past a validation that came out NaN (only a ramp stops on one): the best and the final
    validation loss are the finite ones, and the epochs are where the run ended, not where it began."""
    import numpy as np

    from rangefinder.analysis import read_prodigy_step

    updates = {"update": np.arange(1.0, 9.0), "epoch": np.arange(1.0, 9.0) / 4,
               "lr_effective": np.geomspace(1e-6, 1e-4, 8)}
    curve = {"update": np.asarray([0.0, 2, 4, 6, 8]), "val_loss": np.asarray([0.2, np.nan, 0.15, 0.18, np.nan])}
    reading = read_prodigy_step(updates, curve, 1.0)
    assert (reading.base_val_loss, reading.best_val_loss, reading.best_update, reading.final_val_loss) == (
        0.2, 0.15, 4, 0.18)
    assert (reading.updates, reading.epochs) == (8, 2.0)


def test_a_factor_trains_at_that_multiple_of_the_step_size_and_the_report_says_both(tmp_path):
    """config.PRODIGY_STEP_FACTOR (4 on SDXL's and SD3's full fine-tune): the reading keeps the step size, trains at the
    multiple, and the report and its JSON show both."""
    import json

    import numpy as np

    from rangefinder.analysis import read_prodigy_step, write_prodigy_report
    from rangefinder.config import prodigy_step_factor

    assert prodigy_step_factor("sdxl", "full") == prodigy_step_factor("sd3", "full") == 4.0
    assert {prodigy_step_factor(f, m) for f, m in [("sdxl", "lora"), ("sd3", "lora"), ("flux", "full"),
                                                   ("flux", "lora"), ("sd1", "full"), (None, "full")]} == {1.0}
    updates = {"update": np.arange(1.0, 5.0), "lr_effective": np.asarray([1e-6, 1e-5, 1e-4, 2.5e-4])}
    reading = read_prodigy_step(updates, None, 1.0, factor=4.0)
    assert (reading.step_size, reading.lr_trained, reading.d) == (2.5e-4, 1e-3, 2.5e-4)
    assert reading.headline().startswith("Fine-tune at lr 0.001: 4 x the step size d x lr (0.00025)")
    report = write_prodigy_report(reading, updates, None, tmp_path)
    md = report["markdown"].read_text()
    assert "| LR trained | 0.001 |" in md and "train at 4 times the step size Prodigy ended on" in md, md
    assert "the one it ends on, times 4, is taken as the fine-tune's constant LR" in md, md
    assert json.loads(report["json"].read_text())["lr_trained"] == 1e-3
    assert read_prodigy_step(updates, None, 1.0).lr_trained == 2.5e-4  # no factor: the step size itself
    # The config's own factor: the report says it was set, not measured.
    own = read_prodigy_step(updates, None, 1.0, factor=2.0, factor_source="prodigy_step_factor, as set in the config")
    md = write_prodigy_report(own, updates, None, tmp_path / "own")["markdown"].read_text()
    assert "| LR trained | 0.0005 |" in md and "2 times the step size Prodigy ended on (prodigy_step_factor, as set" \
        in md and "PRODIGY_STEP_FACTOR" not in md, md


def test_the_probe_trains_no_samples_and_scales_no_lr_whatever_the_fine_tune_does():
    """The probe is a plain Prodigy run: samples during training would render grids nobody reads, and an LR scaled
    with the batch is refused beside Prodigy (its lr is a multiplier of its own step size)."""
    from rangefinder.config import LR_FREE_LR
    from rangefinder.steps.prodigy_step_size import probe_config

    cfg = demo_config(lr_finder="prodigy_step", training={"scale_lr": "sqrt"}, sampling={"every_validations": 2},
                      lr_range_test={"lr_min": None, "lr_max": None})
    probe = probe_config(cfg)
    assert (probe.training.optimizer, probe.training.lr, probe.training.scale_lr) == ("prodigy", LR_FREE_LR, "none")
    assert probe.sampling.every_validations is None and not probe.finetune.successive_halving
