"""Issue 35 item 5, MLflow as its users browse it: descriptions on the runs and the registered model, the version
linked to the run that trained its weights, and one LR decision on the parent run. Read back from real stores."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from mlflow import MlflowClient

from rangefinder.config import RangefinderConfig, TrackingConfig
from rangefinder.tracking import ensure_parent_run, step_run
from rangefinder.tracking.target import mlflow_executable

NOTE = "mlflow.note.content"


@pytest.mark.slow
def test_the_version_s_source_run_is_the_fine_tune_and_every_run_and_the_model_say_what_they_decided(
        sqlite_tracking_uri, tiny_model_dir, tmp_path, monkeypatch):
    from rangefinder.steps.register_model import run_register_model
    from rangefinder.tracking.spool import SPOOL_ENV

    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "spool"))  # register_model keeps its config there
    # The process as KFP starts a step: MLflow names its entry point as the source of what it logs unless told.
    monkeypatch.setattr(sys, "argv", ["/usr/local/lib/python3.11/site-packages/kfp/dsl/executor_main.py",
                                      "--executor_input", "{}", "--function_to_execute", "register_model"])

    name = "rf-browse"
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=sqlite_tracking_uri, experiment_name="browse",
                                                    registered_model_name=name))
    cfg.sampling.num_inference_steps = 2
    parent = ensure_parent_run(cfg, name="pipeline-run-1")
    with step_run(cfg, "finetune", parent_run_id=parent) as ft:
        ft.log_metrics({"val_loss": 0.3}, step=4)
    result = tmp_path / "result.md"
    registered = run_register_model(cfg, model_dir=tiny_model_dir, lr=2e-4, epochs=7, mlflow_parent_run_id=parent,
                                    result_md=result)
    assert registered.version == "1"
    # The run's outcome as register-model's Markdown artifact shows it in the Kubeflow UI: the model, the weights,
    # the LR, the length, and the link to the pipeline's MLflow run (not the step's), with the command serving the UI.
    exp_id = MlflowClient(tracking_uri=sqlite_tracking_uri).get_experiment_by_name("browse").experiment_id
    text = result.read_text()
    for row in (f"| Model | `models:/{name}/1` |", "| Weights | the fine-tune's final weights |",
                "| Learning rate | 0.0002 |", "| Epochs trained | 7 |",
                f"| MLflow | [the run's record](http://127.0.0.1:5000/#/experiments/{exp_id}/runs/{parent}) (serve the "
                f"UI first: `{mlflow_executable()} ui --backend-store-uri {sqlite_tracking_uri}`) |"):
        assert row in text, text

    client = MlflowClient(tracking_uri=sqlite_tracking_uri)
    mv = client.get_model_version(name, "1")
    # The version opens on the run with the curves and decisions, not on register_model's (which has none).
    assert mv.run_id == ft.run_id
    (reg,) = client.search_runs([client.get_experiment_by_name("browse").experiment_id],
                                filter_string="tags.`rangefinder.step` = 'register_model'")
    assert mv.tags["rangefinder.registered_by_run_id"] == reg.info.run_id != ft.run_id
    assert "epochs at lr 0.0002" in mv.description
    assert "fine-tuned by rangefinder" in client.get_registered_model(name).description
    assert reg.data.tags[NOTE].startswith(f"The delivered weights, registered as {name} version 1 (@candidate): ")
    # Each run and the logged model name the code that made them, as a job (MLflow's Source column and model page).
    for run_id, source in ((parent, "rangefinder pipeline"), (ft.run_id, "rangefinder.steps.finetune"),
                           (reg.info.run_id, "rangefinder.steps.register_model")):
        tags = client.get_run(run_id).data.tags
        assert (tags["mlflow.source.name"], tags["mlflow.source.type"]) == (source, "JOB"), run_id
    model = client.get_logged_model(mv.source.removeprefix("models:/"))
    assert (model.tags["mlflow.source.name"], model.tags["mlflow.source.type"]) == (
        "rangefinder.steps.register_model", "JOB")
    assert model.tags["mlflow.source.git.commit"] == reg.data.tags["mlflow.source.git.commit"]
    assert client.get_run(parent).data.tags[NOTE] == (
        "The fine-tune's final weights after 7 epochs at lr 0.0002 (no validated checkpoint to choose from). They are "
        f"registered as {name} version 1 (@candidate).")

    # A description someone wrote on the model stays; the next version still links its own training run.
    client.update_registered_model(name, description="ours")
    with step_run(cfg, "finetune", parent_run_id=parent) as ft2:
        ft2.log_metrics({"val_loss": 0.2}, step=4)
    # Its weights are the window average the fine-tune delivered: the pipeline run's description says so, with the
    # average's own loss as the version's does, not "73 epochs" (the recommended length) beside updates 272-312.
    averaged = tmp_path / "model"
    shutil.copytree(tiny_model_dir, averaged / "chosen")
    (averaged / "chosen.json").write_text(json.dumps({
        "checkpoint": None, "update": 312, "epoch": 78.0, "val_loss": 0.04859, "base_val_loss": 0.0612,
        "rule": "window_average", "status": "ok", "improved_on_base": True,
        "average": {"updates": [272, 292, 312], "how": "uniform", "delivered": True},
        "reason": "The average of the fine-tune's checkpoints at updates 272, 292, 312, the ones inside the step "
                  "window: ... Its validation loss 0.04859 is below the base model's 0.0612. It replaced the "
                  "window's pick: ... Its validation loss 0.05024 is below the base model's 0.0612."}))
    run_register_model(cfg, model_dir=averaged, lr=2e-4, epochs=73, mlflow_parent_run_id=parent)
    assert client.get_model_version(name, "2").run_id == ft2.run_id
    assert client.get_registered_model(name).description == "ours"
    assert client.get_run(parent).data.tags[NOTE] == (
        "Delivered the fine-tune's window average of updates 272-312, trained at lr 0.0002. Its validation loss "
        f"0.04859 is below the base model's 0.0612. They are registered as {name} version 2 (@candidate).")
    v2 = client.get_model_version(name, "2")
    assert "Its validation loss 0.04859 is below" in v2.description
    # The length handed in is the fine-tune's recommendation, not how long these weights trained (epoch 78).
    assert (v2.tags["recommended_epochs"], v2.tags["epoch"], v2.tags["update"]) == ("73", "78", "312")
    assert "epochs" not in v2.tags and "recommended_epochs=73" in v2.description


def test_a_range_test_s_bounds_stay_on_its_run_and_the_parent_shows_the_fine_tune_s(shared_sqlite_tracking_uri):
    """The parent run showed lr_low and lr_high from the first range test and lr_mid from the fine-tune: after a
    zoom they were two decisions. Now the range tests keep their readings; the fine-tune logs the bounds it used."""
    cfg = TrackingConfig(tracking_uri=shared_sqlite_tracking_uri, experiment_name="one-decision")
    parent = ensure_parent_run(cfg, name="pipeline-run-decisions")
    with step_run(cfg, "lr_range_test", parent_run_id=parent) as rt:
        rt.log_decisions({"lr_low": 1e-5, "lr_high": 1e-3, "lr_mid": 1e-4, "quality": 0.75, "status": "ok"},
                         numbers_to_parent=False)
    with step_run(cfg, "finetune", parent_run_id=parent) as ft:
        ft.log_decisions({"lr_low": 3e-5, "lr_high": 2e-4, "lr_mid": 8e-5, "lr_used": 8e-5})
    client = MlflowClient(tracking_uri=shared_sqlite_tracking_uri)
    on_parent = client.get_run(parent).data
    assert (on_parent.tags["lr_low"], on_parent.tags["lr_high"], on_parent.tags["lr_mid"]) == (
        "3.000e-05", "2.000e-04", "8.000e-05")
    assert on_parent.tags["lr_used"] == "8.000e-05" and not on_parent.metrics
    assert client.get_run(rt.run_id).data.tags["lr_low"] == "1.000e-05"
    assert client.get_run(rt.run_id).data.metrics == {"quality": 0.75}  # the range test's own number, not the parent's


def test_an_experiment_rangefinder_creates_says_what_it_holds_and_one_it_finds_keeps_its_own(
        shared_sqlite_tracking_uri):
    """MLflow's experiment page showed no description: one rangefinder creates has one (`mlflow.note.content`); an
    experiment someone made first, with a description of their own, keeps it."""
    from rangefinder.tracking.target import EXPERIMENT_DESCRIPTION

    client = MlflowClient(tracking_uri=shared_sqlite_tracking_uri)
    ensure_parent_run(TrackingConfig(tracking_uri=shared_sqlite_tracking_uri, experiment_name="made-here"),
                      name="pipeline-run-new-experiment")
    made = client.get_experiment_by_name("made-here")
    assert made.tags[NOTE] == EXPERIMENT_DESCRIPTION and "rangefinder" in EXPERIMENT_DESCRIPTION

    theirs = client.create_experiment("made-by-a-person", tags={NOTE: "Our SD fine-tunes for the spring campaign."})
    ensure_parent_run(TrackingConfig(tracking_uri=shared_sqlite_tracking_uri, experiment_name="made-by-a-person"),
                      name="pipeline-run-their-experiment")
    assert client.get_experiment(theirs).tags[NOTE] == "Our SD fine-tunes for the spring campaign."


def test_the_parent_run_s_model_resolved_dir_is_the_folder_resolve_config_resolved(sqlite_tracking_uri):
    """resolve-config makes the parent run before it fetches the base model (a server that does not answer stops the
    run before a download), so the parent's `model.resolved_dir` param read None, for good (a param is written once).
    It is the folder every later step reads, in the param and in config.yaml; a retried resolve-config adds nothing."""
    from pathlib import Path

    import yaml

    from rangefinder.config import demo_config
    from rangefinder.steps.resolve_config import load_step_config, parameters_from_config, run_resolve_config

    params = parameters_from_config(demo_config(tracking={"tracking_uri": sqlite_tracking_uri,
                                                          "experiment_name": "resolved"}))
    base = params.pop("base_config")
    r = run_resolve_config(base, pipeline_job_id="kfp-run-resolved", **params)
    folder = load_step_config(r.config_json).model.resolved_dir
    assert folder and r.mlflow_parent_run_id
    again = run_resolve_config(base, pipeline_job_id="kfp-run-resolved", **params)  # KFP's retry of the step
    assert again.mlflow_parent_run_id == r.mlflow_parent_run_id

    client = MlflowClient(tracking_uri=sqlite_tracking_uri)
    parent = client.get_run(r.mlflow_parent_run_id)
    assert parent.data.params["model.resolved_dir"] == folder
    config = yaml.safe_load(Path(client.download_artifacts(parent.info.run_id, "config.yaml")).read_text())
    assert config["model"]["resolved_dir"] == folder


def test_a_base_config_copied_from_an_earlier_run_records_the_base_model_this_run_resolves(
        sqlite_tracking_uri, tiny_model_dir, tiny_sdxl_dir):
    """An earlier run's config_json (resolve-config's output, shown in the KFP UI) pasted as base_config, with an SDXL
    model as the base_model parameter: the run trained SDXL, but its parent run, made before the model is resolved,
    logged the earlier run's SD 1.x folder as model.resolved_dir, a param written once and so wrong for good."""
    from rangefinder.config import demo_config
    from rangefinder.steps.resolve_config import load_step_config, parameters_from_config, run_resolve_config

    params = parameters_from_config(demo_config(model={"base_model": str(tiny_model_dir)},
                                                tracking={"tracking_uri": sqlite_tracking_uri,
                                                          "experiment_name": "copied-base-config"}))
    earlier = run_resolve_config(params.pop("base_config"), **params)
    assert load_step_config(earlier.config_json).model.resolved_dir == str(tiny_model_dir)
    r = run_resolve_config(earlier.config_json, pipeline_job_id="kfp-run-copied-base-config",
                           **{**params, "base_model": str(tiny_sdxl_dir)})
    assert load_step_config(r.config_json).model.resolved_dir == str(tiny_sdxl_dir)
    parent = MlflowClient(tracking_uri=sqlite_tracking_uri).get_run(r.mlflow_parent_run_id)
    assert parent.data.params["model.resolved_dir"] == str(tiny_sdxl_dir)
    assert parent.data.tags["rangefinder.model_family"] == "sdxl"
    # The filter a user writes for "my SDXL full fine-tunes" finds the run, as it finds their registered versions.
    found = MlflowClient(tracking_uri=sqlite_tracking_uri).search_runs(
        [parent.info.experiment_id], "tags.`rangefinder.model_family` = 'sdxl' and tags.`rangefinder.method` = 'full'")
    assert [r.info.run_id for r in found] == [parent.info.run_id]


def test_the_guidance_scale_used_is_logged_beside_the_setting_and_resolved_again_from_a_copied_config(
        sqlite_tracking_uri, tiny_flux_dir, tiny_sdxl_dir, tmp_path):
    """sampling.guidance_scale unset is the base model's own, known once resolve-config has the model: the parent run
    (made before that) shows the value every step samples at, FluxPipeline's 3.5 here, as sampling.guidance_scale_used.
    resolve-config wrote it into the setting itself, so the run's config.yaml, copied and given an SDXL model, sampled
    SDXL at Flux's 3.5 (its own is 5.0) without a word."""
    from pathlib import Path

    import yaml

    from rangefinder.config import demo_config, load_config
    from rangefinder.steps.resolve_config import load_step_config, parameters_from_config, run_resolve_config
    from rangefinder.training.family_detection import family_of, guidance_scale_for

    def resolve(cfg, job):
        params = parameters_from_config(cfg)
        r = run_resolve_config(params.pop("base_config"), pipeline_job_id=job, **params)
        parent = client.get_run(r.mlflow_parent_run_id)
        config = Path(client.download_artifacts(parent.info.run_id, "config.yaml", str(tmp_path / job)))
        resolved = load_step_config(r.config_json)
        # What every step that samples (the grid, the samples during training, the registered model) renders at.
        samples_at = guidance_scale_for(family_of(resolved.model), resolved.sampling.guidance_scale)
        return parent.data.params, config, samples_at

    client = MlflowClient(tracking_uri=sqlite_tracking_uri)
    (tmp_path / "kfp-run-guidance").mkdir()
    params, config, samples_at = resolve(demo_config(
        model={"base_model": str(tiny_flux_dir)}, sampling={"scheduler": None, "guidance_scale": None},
        tracking={"tracking_uri": sqlite_tracking_uri, "experiment_name": "guidance"}), "kfp-run-guidance")
    assert params["sampling.guidance_scale_used"] == "3.5" and samples_at == 3.5
    copied = yaml.safe_load(config.read_text())
    assert copied["sampling"]["guidance_scale"] is None  # as given

    copied["model"]["base_model"] = str(tiny_sdxl_dir)  # the user's one change
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(copied))
    (tmp_path / "kfp-run-copied").mkdir()
    params, _, samples_at = resolve(load_config(tmp_path / "mine.yaml"), "kfp-run-copied")
    assert samples_at == 5.0 and params["sampling.guidance_scale_used"] == "5.0"


def test_the_guidance_scale_used_by_a_model_without_a_guidance_input_is_none(tiny_schnell_dir, tmp_path):
    """FLUX.1-schnell has no guidance embedding, and FluxPipeline feeds it no scale: the runs' param said 3.5. A Flux
    single file, whose family its tensor names tell before it is converted but not whether it takes guidance, had
    Flux.1-dev's 3.5 written into the parent run made before resolve-config, where a param once logged stays: it is
    left out until the file's folder is there to read."""
    import numpy as np
    from safetensors.numpy import save_file

    from rangefinder.config import RangefinderConfig
    from rangefinder.formats.flux_layout import FLUX_DOUBLE_BLOCK_KEY, FLUX_SINGLE_BLOCK_KEY
    from rangefinder.tracking.runs import applicable_params

    cfg = RangefinderConfig.model_validate({"model": {"base_model": str(tiny_schnell_dir)}})
    assert applicable_params(cfg)["sampling.guidance_scale_used"] == "none (no guidance input)"
    # A transformer file in Black Forest Labs' layout, told Flux by its tensor names (family_detection.family_of).
    schnell = tmp_path / "flux1-schnell.safetensors"
    save_file({FLUX_DOUBLE_BLOCK_KEY: np.zeros(1, np.float32), FLUX_SINGLE_BLOCK_KEY: np.zeros(1, np.float32)},
              str(schnell))
    cfg = RangefinderConfig.model_validate({"model": {"base_model": str(schnell)}})
    assert "sampling.guidance_scale_used" not in applicable_params(cfg)
    resolved = cfg.model.model_copy(update={"resolved_dir": str(tiny_schnell_dir)})
    assert applicable_params(cfg.model_copy(update={"model": resolved}))["sampling.guidance_scale_used"] == (
        "none (no guidance input)")


def test_the_pipeline_run_s_description_names_a_delivered_checkpoint_by_its_update_and_epoch():
    from rangefinder.steps.register_model import delivered_lead

    chosen = {"checkpoint": "checkpoint-000116", "update": 116, "epoch": 29.0, "val_loss": 0.8868,
              "base_val_loss": 1.138, "rule": "window_lowest"}
    assert delivered_lead(chosen, 2.09e-4) == (
        "Delivered the fine-tune's checkpoint at update 116, epoch 29, trained at lr 0.000209. Its validation loss "
        "0.8868 is below the base model's 1.138.")
    # A chosen.json of earlier code (no epoch, no base model's loss): said without them.
    assert delivered_lead({"checkpoint": "update-00000012", "update": 12, "rule": None}, 1e-4) == (
        "Delivered the fine-tune's checkpoint at update 12, trained at lr 0.0001.")


def test_a_flow_run_s_params_say_the_shift_and_guidance_it_trains_at_where_the_settings_are_unset(
        sqlite_tracking_uri, tiny_flux_dir, tiny_sd3_dir, tiny_model_dir):
    """training.flow.shift and .guidance unset showed `None` in every step's params, where SD3 trains at its
    scheduler's shift 3.0 and Flux.1-dev at guidance 3.5 with the resolution-dependent shift (the engine's family
    reads the same rules: family_rules.FlowRules.settings_used); set, they are the settings; SD 1.x has none."""
    from rangefinder.config import demo_config

    client = MlflowClient(tracking_uri=sqlite_tracking_uri)
    logged = {}
    for name, model, flow in (("flux", tiny_flux_dir, {}), ("flux-set", tiny_flux_dir, {"shift": 2.0, "guidance": 1.0}),
                              ("sd3", tiny_sd3_dir, {}), ("sd1", tiny_model_dir, {})):
        cfg = demo_config(model={"base_model": str(model)}, training={"flow": flow} if flow else {},
                          tracking={"tracking_uri": sqlite_tracking_uri, "experiment_name": "flow-used"})
        with step_run(cfg, "finetune") as run:
            run.log_config(cfg)
        params = client.get_run(run.run_id).data.params
        logged[name] = tuple(params.get(f"training.flow.{k}_used") for k in ("shift", "guidance"))
    assert logged == {"flux": ("resolution-dependent", "3.5"), "flux-set": ("2.0", "1.0"), "sd3": ("3.0", None),
                      "sd1": (None, None)}
