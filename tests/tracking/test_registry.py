"""The final weights as a registered MLflow model that loads back and generates, and the explicit promotion."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import mlflow
import pandas as pd
import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from rangefinder.cli.main import main as cli_main
from rangefinder.config import ModelConfig, RangefinderConfig, TrackingConfig
from rangefinder.errors import TrackingError
from rangefinder.tracking import decode_image, promote, step_run


@pytest.mark.slow
def test_registered_model_loads_from_its_alias_and_generates(mlflow_server_uri, tiny_model_dir, capsys):
    name = "rf-test-model"
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=mlflow_server_uri, experiment_name="registry",
                                                    registered_model_name=name))
    with step_run(cfg, "finetune") as run:
        run.log_metrics({"val_loss": 0.21}, step=10)
        version = run.log_diffusers_model(tiny_model_dir, num_inference_steps=2, guidance_scale=1.0)
    assert (version.name, version.version, version.alias) == (name, "1", "candidate")

    client = MlflowClient(tracking_uri=mlflow_server_uri)
    mv = client.get_model_version_by_alias(name, "candidate")
    assert mv.version == "1" and mv.run_id == run.run_id
    assert mv.tags["val_loss"] == "0.21" and mv.tags["rangefinder.registered_by_run_id"] == run.run_id
    assert "val_loss=0.21" in mv.description

    mlflow.set_tracking_uri(mlflow_server_uri)
    model = mlflow.pyfunc.load_model(f"models:/{name}@candidate")
    assert model.model_config["guidance_scale"] == 1.0  # as set, not the pipeline's own
    prompts = pd.DataFrame({"prompt": ["a red circle on a blue background", "a yellow square"], "seed": [3, 3]})
    out = model.predict(prompts)
    assert list(out.columns) == ["prompt", "seed", "image"] and len(out) == 2
    images = [decode_image(b64) for b64 in out["image"]]
    assert images[0].size == (32, 32)  # the tiny model's resolution, the model's default
    assert images[0].tobytes() != images[1].tobytes()  # the prompt steers the image
    again = model.predict(prompts.iloc[[0]], params={"num_inference_steps": 2})
    assert decode_image(again["image"][0]).tobytes() == images[0].tobytes()  # (prompt, seed) fixes the image

    # A second run's model becomes the new candidate; champion moves only by hand.
    with step_run(cfg, "retrain") as run2:
        run2.log_diffusers_model(tiny_model_dir, metrics={"val_loss": 0.19}, num_inference_steps=2)
    assert client.get_model_version_by_alias(name, "candidate").version == "2"
    with pytest.raises(MlflowException):  # no version is @champion until promoted
        client.get_model_version_by_alias(name, "champion")

    assert promote(name, 1, tracking_uri=mlflow_server_uri)["version"] == "1"
    capsys.readouterr()
    assert cli_main(["promote", "--model", name, "--tracking-uri", mlflow_server_uri, "--json"]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed[printed.index("{"):])
    assert {k: result[k] for k in ("name", "version", "alias", "previous_version", "promoted")} == {
        "name": name, "version": "2", "alias": "champion", "previous_version": "1", "promoted": True}
    assert client.get_model_version_by_alias(name, "champion").version == "2"  # from @candidate

    with pytest.raises(TrackingError, match="has no version 9"):
        promote(name, 9, tracking_uri=mlflow_server_uri)
    with pytest.raises(TrackingError, match="no registered model 'nope'"):
        promote("nope", 1, tracking_uri=mlflow_server_uri)


def test_a_folder_that_is_not_a_pipeline_is_refused(shared_sqlite_tracking_uri, tmp_path):
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=shared_sqlite_tracking_uri,
                                                    experiment_name="registry-bad"))
    with pytest.raises(TrackingError, match="model_index.json"):
        with step_run(cfg, "finetune") as run:
            run.log_diffusers_model(tmp_path)


@pytest.mark.parametrize("damage", ["unet weights missing", "vae weights cut short", "text_encoder/ missing"])
def test_a_half_written_pipeline_folder_is_refused_before_anything_is_registered(sqlite_tracking_uri, tiny_model_dir,
                                                                                 tmp_path, damage):
    """A folder with model_index.json but a part missing or cut short (a copy or save that stopped part-way) would
    become @candidate and fail only when loaded: it is refused, and the registry stays empty."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    if damage == "unet weights missing":
        (folder / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    elif damage == "vae weights cut short":
        weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    else:
        shutil.rmtree(folder / "text_encoder")
    name = "rf-half-written"
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=sqlite_tracking_uri, experiment_name="half-written",
                                                    registered_model_name=name))
    with pytest.raises(TrackingError, match="not a whole diffusers pipeline folder"):
        with step_run(cfg, "register_model") as run:
            run.log_diffusers_model(folder, num_inference_steps=2)
    assert MlflowClient(sqlite_tracking_uri).search_model_versions(f"name='{name}'") == []


def test_promote_on_a_local_store_answers_as_on_a_server(sqlite_tracking_uri, tiny_model_dir, capsys):
    """The default store is a local sqlite file, whose versions are ints: `promote --json` still prints versions as
    strings, as against a server, and promoting the version champion already holds says so by previous_version."""
    name = "rf-local-promote"
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=sqlite_tracking_uri, experiment_name="local-promote",
                                                    registered_model_name=name))
    # A version tag of a user's own step, keyed by a prompt: a key over MLflow's 250 characters failed the step.
    per_prompt = "rangefinder.reviewed." + "a red circle on a blue background " * 9
    with step_run(cfg, "register_model") as run:
        run.log_diffusers_model(tiny_model_dir, num_inference_steps=2, tags={per_prompt: "kept"})
    (key,) = [k for k in MlflowClient(sqlite_tracking_uri).get_model_version(name, "1").tags if "reviewed" in k]
    assert len(key) == 250 and "chars cut" in key, key
    with pytest.raises(TrackingError, match="no version with alias 'nope'"):
        promote(name, from_alias="nope", tracking_uri=sqlite_tracking_uri)
    assert promote(name, tracking_uri=sqlite_tracking_uri)["previous_version"] is None
    capsys.readouterr()
    assert cli_main(["promote", "--model", name, "--tracking-uri", sqlite_tracking_uri, "--json"]) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{"):]) == {
        "name": name, "version": "1", "alias": "champion", "previous_version": "1", "promoted": True,
        "val_loss": None, "previous_val_loss": None, "val_loss_change": None, "better": None, "improved_on_base": None,
        "comparison": "version 1 already holds @champion"}


@pytest.mark.parametrize("given", ["model", "model/chosen"])
def test_register_by_hand_says_the_chosen_checkpoint_whichever_folder_it_is_given(sqlite_tracking_uri, tiny_model_dir,
                                                                                  tmp_path, given, capsys):
    """`rangefinder register` takes the fine-tune's model folder or its chosen/: either way the version is the chosen
    checkpoint and says so (tags, description), not "final weights, no validated checkpoint". Under a folder whose
    name MLflow would read as a URI's fragment and escapes (`#`, `%41`): the model's artifacts were not found. Its
    stderr, no terminal (a CI job's log), holds no progress bar: MLflow's `Downloading artifacts` bar was there."""
    import shutil

    model = tmp_path / "run #1 %41 é" / "model"
    shutil.copytree(tiny_model_dir, model / "chosen")
    shutil.copytree(tiny_model_dir, model / "final")
    (model / "chosen.json").write_text(json.dumps({
        "status": "window", "reason": "The step window's lowest validation loss, at update 12.",
        "rule": "window_lowest", "update": 12, "epoch": 3, "val_loss": 0.2, "checkpoint": "update-00000012"}))
    name = "rf-by-hand"
    config = tmp_path / "config.yaml"
    config.write_text(f"tracking: {{tracking_uri: '{sqlite_tracking_uri}', registered_model_name: {name}, "
                      "experiment_name: by-hand}\n")
    capsys.readouterr()
    assert cli_main(["register", str(model.parent / given), "--config", str(config), "--lr", "2.091234e-4", "--epochs",
                     "5"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "artifacts" not in err, err[-2000:]
    version = MlflowClient(sqlite_tracking_uri).get_model_version(name, "1")
    # The LR as the runs' tags write it (tracking.metrics.lr_text), not 0.000209123.
    assert version.tags["lr"] == "2.091e-04" and "lr=2.091e-04" in version.description
    assert version.tags["rangefinder.weights"] == "finetune update-00000012"
    assert version.tags["rangefinder.chosen_rule"] == "window_lowest" and version.tags["update"] == "12"
    # --epochs is the length the fine-tune recommends, not how long a checkpoint at epoch 3 trained.
    assert version.tags["recommended_epochs"] == "5" and version.tags["epoch"] == "3" and "epochs" not in version.tags
    assert version.description.startswith("The step window's lowest validation loss, at update 12.")


@pytest.mark.parametrize("damage", ['{"update": 12, "rul', '["update", 12]'])
def test_register_by_hand_refuses_a_damaged_chosen_json_in_one_line(sqlite_tracking_uri, tmp_path, capsys, damage):
    """A chosen.json damaged since the fine-tune wrote it whole (a torn copy, an edit): one line naming the file and
    the way on (the fine-tune again, or final/), before anything is registered. It was json's traceback."""
    model = tmp_path / "model"
    for folder in ("chosen", "final"):
        (model / folder).mkdir(parents=True)
    (model / "chosen.json").write_text(damage)
    name = "rf-damaged"
    config = tmp_path / "config.yaml"
    config.write_text(f"tracking: {{tracking_uri: '{sqlite_tracking_uri}', registered_model_name: {name}, "
                      "experiment_name: damaged}\n")
    capsys.readouterr()
    assert cli_main(["register", str(model), "--config", str(config), "--lr", "1e-4", "--epochs", "5"]) == 2
    err = capsys.readouterr().err
    why = "not valid JSON (" if damage.startswith("{") else "not a JSON object;"
    assert len(err.splitlines()) == 1 and err.startswith(
        f"rangefinder register: error: {model / 'chosen.json'} cannot be read: {why}"), err
    assert err.rstrip().endswith(f"the fine-tune wrote it whole, so it was damaged or changed since: run the fine-tune "
                                 f"again, or use {model / 'final'} (the run's final weights) instead"), err
    assert MlflowClient(sqlite_tracking_uri).search_registered_models(f"name='{name}'") == []


@pytest.mark.parametrize("registered_by", ["this code", "code before cec60ec"])
def test_a_retried_registration_finishes_its_version_instead_of_adding_one(sqlite_tracking_uri, tiny_model_dir,
                                                                          registered_by):
    """A retried register-model step goes on in its earlier attempt's run (tracking.step_run), and a server that went
    away part-way is waited for and the registration tried again: either way that run may have registered its
    version already. Stopped after the version was made, before its description and alias, the retry finishes that
    version: one version, @candidate on it, its description, and the model not logged a second time.

    Also for a version registered before cec60ec, which named its registering run (its source run here) only as
    `rangefinder.run_id`: the retry, run by the code of now, finds it by that tag and adds the tag of now."""
    from rangefinder.tracking import ensure_parent_run
    from rangefinder.tracking.registry import OLD_REGISTERED_BY, REGISTERED_BY

    name = "rf-retried"
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=sqlite_tracking_uri, experiment_name="retried-reg",
                                                    registered_model_name=name))
    client = MlflowClient(sqlite_tracking_uri)
    client.create_registered_model(name, description="Ours: ask #vision before promoting")  # someone made it first
    parent = ensure_parent_run(cfg, name="retried-registration")
    with pytest.raises(RuntimeError), step_run(cfg, "register_model", parent_run_id=parent) as first:
        made = first.log_diffusers_model(tiny_model_dir, metrics={"val_loss": 0.2}, num_inference_steps=2)
        client.delete_registered_model_alias(name, "candidate")  # as if stopped before the description and alias
        client.update_model_version(name, made.version, description="")
        if registered_by != "this code":  # the version's tags as the code before cec60ec wrote them
            client.delete_model_version_tag(name, made.version, REGISTERED_BY)
            client.set_model_version_tag(name, made.version, OLD_REGISTERED_BY, first.run_id)
        raise RuntimeError("preempted")
    with step_run(cfg, "register_model", parent_run_id=parent) as retry:
        again = retry.log_diffusers_model(tiny_model_dir, metrics={"val_loss": 0.2}, num_inference_steps=2)
    assert retry.run_id == first.run_id and again == made
    assert [str(v.version) for v in client.search_model_versions(f"name='{name}'")] == ["1"]
    assert str(client.get_model_version_by_alias(name, "candidate").version) == "1"
    assert "val_loss=0.2" in client.get_model_version(name, "1").description
    assert client.get_model_version(name, "1").tags[REGISTERED_BY] == first.run_id
    mlflow.set_tracking_uri(sqlite_tracking_uri)
    assert len(mlflow.search_logged_models(experiment_ids=[first.experiment_id], output_format="list")) == 1
    # Another run's registration is a version of its own; without metrics given, its tags are the run's own latest
    # values, each under the quantity's name (val_loss), not its chart section in the run (validation/val_loss).
    with step_run(cfg, "register_model") as other:
        other.log_metrics({"val_loss": 0.1, "train_loss": float("nan")}, step=3)  # a diverged value: no tag
        own = other.log_diffusers_model(tiny_model_dir, num_inference_steps=2)
    assert own.version == "2"
    assert client.get_registered_model(name).description == "Ours: ask #vision before promoting"  # kept
    tags = client.get_model_version(name, "2").tags
    assert tags["val_loss"] == "0.1" and not [k for k in tags if k.startswith("validation/")]
    assert "train_loss" not in tags and "nan" not in client.get_model_version(name, "2").description


def test_model_is_filed_under_the_runs_experiment(sqlite_tracking_uri, tiny_model_dir, tmp_path, monkeypatch):
    """MLflow 3 files logged models under the active experiment; ours must go with the step's run, and nothing may
    land in ./mlruns of the folder a step happens to run in (the demo keeps everything under its --out). A pipeline
    folder named with a space or a letter outside ASCII (`rangefinder register` given a folder of one's own) is
    logged: MLflow reads the last name of a file: URI's path unescaped, and found no such artifact."""
    import shutil

    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    folder = shutil.copytree(tiny_model_dir, tmp_path / "my model é")
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=sqlite_tracking_uri, experiment_name="filed",
                                                    registered_model_name=None))
    with step_run(cfg, "finetune") as run:
        version = run.log_diffusers_model(folder, num_inference_steps=2)
    model_id = version.model_uri.removeprefix("models:/")
    assert mlflow.get_logged_model(model_id).experiment_id == run.experiment_id
    assert not (workdir / "mlruns").exists()
    # Nothing leaks into the process: later runs (and subprocesses such as kfp.local's steps) see no experiment set.
    assert "MLFLOW_EXPERIMENT_ID" not in os.environ


# pip's words when no configured index has a pinned release (as for `torch==2.13.0+cpu` on PyPI).
NOT_ON_ANY_INDEX = ("No matching distribution found", "Could not find a version that satisfies")


def test_model_environment_installs_from_the_configured_index_and_predicts(sqlite_tracking_uri, tiny_model_dir,
                                                                          tmp_path, monkeypatch):
    """The logged model's requirements.txt names releases an index serves (no local label: `torch==2.13.0+cpu` is a
    name no public index has), each the release installed here, and pip resolves every one of them from the package
    indexes this machine is configured with (pip's own config: `pip config list`). The model then loads and generates
    an image in that environment.

    pip resolves the pinned packages themselves (`--no-deps`, about 10 s); resolving their whole dependency tree
    too takes minutes here and is what installing does anyway (README: "The registered MLflow model")."""
    import subprocess
    import sys
    from importlib import metadata

    monkeypatch.chdir(tmp_path)
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=sqlite_tracking_uri, experiment_name="reqs",
                                                    registered_model_name=None))
    with step_run(cfg, "finetune") as run:
        version = run.log_diffusers_model(tiny_model_dir, num_inference_steps=1, guidance_scale=1.0)
    mlflow.set_tracking_uri(sqlite_tracking_uri)
    reqs_path = mlflow.pyfunc.get_model_dependencies(version.model_uri)  # the logged requirements.txt
    lines = [ln.strip() for ln in open(reqs_path) if ln.strip() and not ln.startswith("#")]
    assert lines and not [ln for ln in lines if "+" in ln], lines
    pins = dict(ln.split("==", 1) for ln in lines)
    assert {"torch", "diffusers", "transformers", "mlflow"} <= set(pins)
    for dist, pinned in pins.items():
        here = metadata.version(dist)
        assert here.split("+", 1)[0] == pinned, f"{dist}: pinned {pinned}, installed here {here}"

    report = tmp_path / "pip-report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
                           "--quiet", "--report", str(report), "-r", reqs_path],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        assert not any(s in proc.stderr for s in NOT_ON_ANY_INDEX), proc.stderr[-2000:]
        pytest.skip(f"no package index reachable to resolve the model's requirements: {proc.stderr.strip()[-300:]}")
    installs = json.loads(report.read_text())["install"]
    resolved = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
    assert {d.lower(): v for d, v in pins.items()} == {d: v.split("+", 1)[0] for d, v in resolved.items()}

    # The model loads through MLflow's own loader in that environment (this one: the pins are its versions) and
    # generates. (`mlflow models predict --env-manager local` does the same in a process of its own: 35 s more here.)
    model = mlflow.pyfunc.load_model(version.model_uri)
    out = model.predict(pd.DataFrame({"prompt": ["a red circle"], "seed": [3]}))
    image = decode_image(out["image"][0])
    assert image.size == (32, 32) and len(set(image.getdata())) > 1  # an image, not a blank


@pytest.mark.slow
@pytest.mark.parametrize("family, pipeline_class", [("sdxl", "StableDiffusionXLPipeline"),
                                                    ("sd3", "StableDiffusion3Pipeline"), ("flux", "FluxPipeline")])
def test_each_family_loads_as_its_pipeline_and_generates_what_its_samples_do(sqlite_tracking_uri, request, family,
                                                                            pipeline_class):
    """The pyfunc model of each family renders the image the family's own pipeline renders with the call arguments
    of samples during training (SD3 and Flux: the T5 sequence length each was trained with, not its pipeline's
    default, from the model's config). Registered without a guidance scale, its default is the pipeline's own (it
    was 7.5 for every family: SDXL's is 5.0, SD3's 7.0 and Flux.1-dev's distilled guidance 3.5), so it renders what
    the pipeline renders given none."""
    import diffusers
    import numpy as np
    import torch

    from rangefinder.models.loading import pipeline_call_kwargs
    from rangefinder.training.family_detection import t5_sequence_length

    folder = request.getfixturevalue({"sdxl": "tiny_sdxl_dir", "sd3": "tiny_sd3_dir", "flux": "tiny_flux_dir"}[family])
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=sqlite_tracking_uri, experiment_name=family,
                                                    registered_model_name=f"rf-{family}"),
                            model=ModelConfig(base_model=str(folder)))
    with step_run(cfg, "finetune") as run:
        version = run.log_diffusers_model(folder, num_inference_steps=2, resolution=32)
    assert MlflowClient(tracking_uri=sqlite_tracking_uri).get_run(run.run_id).data.tags[
        "rangefinder.model_family"] == family
    mlflow.set_tracking_uri(sqlite_tracking_uri)
    model = mlflow.pyfunc.load_model(version.model_uri)
    assert type(model.unwrap_python_model().pipe).__name__ == pipeline_class
    # The T5 length is the model config's, written by the registration from the family's one source: the model's
    # script cannot import rangefinder, and kept a second table of its own.
    # The dtype, as the grid's (family_detection.sampling_dtypes): the script loaded every family in fp16 on a GPU.
    assert model.model_config["sampling_dtypes"]["bf16"] == ("float16" if family == "sdxl" else "bfloat16")
    script = model.unwrap_python_model()
    if not torch.cuda.is_available():  # the script's choice on a GPU without bf16, as torch says this machine is
        script.device = "cuda"
        assert script.dtype() == (torch.float16 if family == "sdxl" else torch.float32)
        script.device = "cpu"
    t5 = model.model_config.get("max_sequence_length")
    assert t5 == (None if family == "sdxl" else t5_sequence_length(family, model.unwrap_python_model().pipe))
    own = {"sdxl": 5.0, "sd3": 7.0, "flux": 3.5}[family]
    assert model.model_config["guidance_scale"] == own
    assert {p.name: p.default for p in model.metadata.get_params_schema().params}["guidance_scale"] == own
    prompt = "a red circle on a blue background"
    out = model.predict(pd.DataFrame({"prompt": [prompt], "seed": [3]}))
    image = decode_image(out["image"][0])
    assert image.size == (32, 32)
    # Off the sides the pipeline renders (a multiple of 8 px here): refused, where Flux's drew a 32 px image.
    with pytest.raises(MlflowException, match=r"^height: the pipeline renders sides in multiples of 8 px, not 36; "):
        model.predict(pd.DataFrame({"prompt": [prompt]}), params={"height": 36})
    if family == "flux":  # FluxPipeline reads a negative prompt only with true_cfg_scale: it drew the same image
        with pytest.raises(MlflowException, match=r"^negative_prompt: a Flux model draws without one \(.*; leave "
                                                  r"the column out$"):
            model.predict(pd.DataFrame({"prompt": [prompt], "seed": [3], "negative_prompt": ["blue"]}))
    pipe = getattr(diffusers, pipeline_class).from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    direct = pipe(prompt=prompt, num_inference_steps=2, height=32, width=32,
                  generator=torch.Generator().manual_seed(3), **pipeline_call_kwargs(pipe)).images[0]
    assert np.array_equal(np.asarray(image), np.asarray(direct))


@pytest.mark.slow
def test_a_model_without_a_guidance_input_has_no_default_guidance_and_predicts(sqlite_tracking_uri, tiny_schnell_dir):
    """FLUX.1-schnell has no guidance embedding and FluxPipeline feeds it no scale: its model's default guidance_scale
    was 3.5, where the grid records none. MLflow's params schema takes None as a double's default; the model predicts
    without a scale, takes 0 (diffusers' own schnell example) as none, and refuses another, as the grid does."""
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=sqlite_tracking_uri, experiment_name="schnell"),
                            model=ModelConfig(base_model=str(tiny_schnell_dir)))
    with step_run(cfg, "finetune") as run:
        version = run.log_diffusers_model(tiny_schnell_dir, num_inference_steps=1, resolution=32,
                                          registered_model_name=None)
    mlflow.set_tracking_uri(sqlite_tracking_uri)
    model = mlflow.pyfunc.load_model(version.model_uri)
    assert model.model_config["guidance_scale"] is None
    assert {p.name: p.default for p in model.metadata.get_params_schema().params}["guidance_scale"] is None
    prompt = pd.DataFrame({"prompt": ["a red circle"], "seed": [3]})
    image = decode_image(model.predict(prompt)["image"][0])
    assert image.size == (32, 32)
    assert model.predict(prompt, params={"guidance_scale": 0.0})["image"][0] == model.predict(prompt)["image"][0]
    with pytest.raises(MlflowException, match=r"^guidance_scale: 7.5 changes nothing: this model has no guidance "
                                              r"embedding .*; leave guidance_scale out$"):
        model.predict(prompt, params={"guidance_scale": 7.5})


def test_promote_refusals_are_one_line_and_keep_the_password_out(mlflow_auth_server, monkeypatch, capsys):
    """On a server with basic auth, what may read the registry may not move an alias: a READ-only user (the check
    before it passes), a name MLflow refuses as an alias, and a password written into --tracking-uri each end
    `rangefinder promote` with one line and status 2, not mlflow's traceback, and the alias stays where it was."""
    import requests  # type: ignore[import-untyped]

    uri, user, password = mlflow_auth_server
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    name = "rf-promote-denied"
    run = client.create_run(client.create_experiment("promote-denied"))
    client.log_text(run.info.run_id, "weights", "model/x.txt")
    client.create_registered_model(name)
    mv = client.create_model_version(name, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id)
    client.set_registered_model_alias(name, "candidate", mv.version)
    reader, reader_password = "rf-reader", "rf-Reader-pass-5512"
    made = requests.post(f"{uri}/api/2.0/mlflow/users/create", auth=(user, password), timeout=30,
                         json={"username": reader, "password": reader_password})
    assert made.status_code == 200, made.text

    def promote_cli(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        code = cli_main(["promote", "--model", name, *args])
        return code, capsys.readouterr().err

    code, err = promote_cli("--tracking-uri", uri, "--alias", "not an alias!")
    assert code == 2 and "Traceback" not in err and "'not an alias!'" in err, err

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", reader)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", reader_password)
    code, err = promote_cli("--tracking-uri", uri)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "HTTP 403" in err and "EDIT" in err and reader_password not in err
    with pytest.raises(MlflowException):
        client.get_model_version_by_alias(name, "champion")

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    code, err = promote_cli("--tracking-uri", uri.replace("://", f"://{user}:{password}@"))
    assert code == 2 and "user name and password" in err and "MLFLOW_TRACKING_PASSWORD" in err
    assert password not in err
    with pytest.raises(MlflowException):
        client.get_model_version_by_alias(name, "champion")
    assert promote_cli("--tracking-uri", uri) == (0, "")
    assert client.get_model_version_by_alias(name, "champion").version == mv.version

    # --if-better refusing the reader's version (no better than its base model): the tag that records the refusal
    # was dropped without a word where the server denied it; the line says the refusal and that it went unrecorded.
    client.set_model_version_tag(name, mv.version, "rangefinder.improved_on_base", "false")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", reader)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", reader_password)
    code, err = promote_cli("--tracking-uri", uri, "--if-better")
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("rangefinder promote: not promoted (--if-better): version 1 already holds @champion; "), err
    assert err.endswith(f"; the refusal is not recorded on version {mv.version} (tag rangefinder.champion_refused): "
                        "the server denied setting it (HTTP 403): the user in MLFLOW_TRACKING_USERNAME needs EDIT "
                        "permission on the model to record it\n"), err
    assert "rangefinder.champion_refused" not in client.get_model_version(name, mv.version).tags


def test_promote_by_a_user_denied_the_model_says_so_not_that_it_is_missing(mlflow_auth_server, monkeypatch, capsys):
    """A user the server denies a registered model (DENY on it) was told "no registered model ...; check --model" of
    a model that is there, sending them after a typo; the line says the server denied it and what permission the
    user needs. A model that is not there is still said to be missing."""
    import requests  # type: ignore[import-untyped]

    uri, user, password = mlflow_auth_server
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    name, outsider, outsider_password = "rf-promote-hidden", "rf-outsider", "rf-Outsider-pass-2290"
    MlflowClient(tracking_uri=uri, registry_uri=uri).create_registered_model(name)
    deny = {"username": outsider, "resource_type": "registered_model", "resource_id": name, "permission": "DENY"}
    for path, body in (("2.0/mlflow/users/create", {"username": outsider, "password": outsider_password}),
                       ("3.0/mlflow/users/permissions/grant", deny)):
        made = requests.post(f"{uri}/api/{path}", auth=(user, password), json=body, timeout=30)
        assert made.status_code == 200, made.text
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", outsider)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", outsider_password)
    capsys.readouterr()
    assert cli_main(["promote", "--tracking-uri", uri, "--model", name, "--version", "1"]) == 2
    assert capsys.readouterr().err == (
        f"rangefinder promote: error: {uri} denied reading registered model {name!r} (HTTP 403): the user in "
        "MLFLOW_TRACKING_USERNAME needs READ permission on it (EDIT to move an alias); ask the server's admin, or use "
        "credentials that have it\n")
    with pytest.raises(TrackingError, match=r"^no registered model 'rf-promote-nowhere' in .*; check --model"):
        promote("rf-promote-nowhere", "1", tracking_uri=uri)


def test_a_version_names_the_run_that_registered_it_once_and_its_retry_finds_it(shared_sqlite_tracking_uri,
                                                                                tiny_model_dir):
    """The register step's run id was on each version twice, as `rangefinder.run_id` and (weights trained by another
    run) `rangefinder.registered_by_run_id`. One tag now; a retried register step, which goes on in its earlier
    run, finds its version by it instead of registering the same weights again."""
    from rangefinder.tracking import ensure_parent_run

    name = "rf-registered-by"
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=shared_sqlite_tracking_uri,
                                                    experiment_name="registered-by", registered_model_name=name))
    parent = ensure_parent_run(cfg, name="pipeline-run-registered-by")
    with step_run(cfg, "finetune", parent_run_id=parent) as ft:
        ft.log_metrics({"val_loss": 0.3}, step=4)
    with step_run(cfg, "register_model", parent_run_id=parent) as reg:
        first = reg.log_diffusers_model(tiny_model_dir, source_step="finetune", num_inference_steps=2)
        again = reg.log_diffusers_model(tiny_model_dir, source_step="finetune", num_inference_steps=2)
    assert first.version == again.version == "1"
    mv = MlflowClient(tracking_uri=shared_sqlite_tracking_uri).get_model_version(name, "1")
    assert mv.run_id == ft.run_id  # the run that trained the weights: the version's source run
    assert {k for k, v in mv.tags.items() if v == reg.run_id} == {"rangefinder.registered_by_run_id"}


def test_a_delivered_window_average_s_version_states_its_own_validation_loss(sqlite_tracking_uri, tiny_model_dir,
                                                                              tmp_path):
    """The window average replaced the window's pick: the version's description (chosen.json's reason) ended on the
    pick's own "Its validation loss 0.05024 is below the base model's", read as the delivered weights' loss beside a
    val_loss tag of 0.04859. It now states the average's loss against the base model and frames the pick's reason as
    the pick's."""
    import shutil

    from rangefinder.formats import checkpoints
    from rangefinder.steps import average

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model / checkpoints.CHOSEN_DIR)
    shutil.copytree(tiny_model_dir, model / average.AVERAGE_DIR / "final")
    pick = {"checkpoint": "checkpoint-000304", "update": 304, "epoch": 76.0, "val_loss": 0.05024,
            "rule": "window_lowest", "status": "ok", "base_val_loss": 0.2486, "improved_on_base": True,
            "reason": "Weights at update 304 (epoch 76). Its validation loss 0.05024 is below the base model's 0.2486."}
    (model / checkpoints.CHOSEN_INFO).write_text(json.dumps(pick))
    average.deliver(model, average.WindowAverage(updates=(272, 288, 304, 312), val_loss=0.04859),
                    checkpoints.read_chosen(model), epoch=78.0)

    name = "rf-average"
    config = tmp_path / "config.yaml"
    config.write_text(f"tracking: {{tracking_uri: '{sqlite_tracking_uri}', registered_model_name: {name}, "
                      "experiment_name: average}\n")
    assert cli_main(["register", str(model), "--config", str(config), "--lr", "2e-4", "--epochs", "73"]) == 0
    version = MlflowClient(sqlite_tracking_uri).get_model_version(name, "1")
    assert version.tags["val_loss"] == "0.04859" and version.tags["rangefinder.chosen_rule"] == "window_average"
    delivered, replaced = version.description.split(" It replaced the window's pick: ")
    assert delivered.endswith("Its validation loss 0.04859 is below the base model's 0.2486.")
    assert "0.05024 is below" not in delivered and replaced.startswith("Weights at update 304 (epoch 76).")


def finetune_record_then_register(cfg: Any, parent: str, split: Any, weights: Any,
                                  val_loss: float = 0.1) -> tuple[Any, Any, Any]:
    """A pipeline run's fine-tune record (its config and split, as the real step logs them; no training) under
    `parent`, then the register step's version of `weights` from it, measured at `val_loss`: (the version, the
    fine-tune's run, the register step's run)."""
    with step_run(cfg, "finetune", parent_run_id=parent) as ft:
        ft.log_config(cfg)
        ft.log_dataset_manifest(split)
    with step_run(cfg, "register_model", parent_run_id=parent) as reg:
        made = reg.log_diffusers_model(weights, source_step="finetune", metrics={"val_loss": val_loss},
                                       num_inference_steps=2)
    return made, ft, reg


def test_scheduled_versions_name_what_made_them_and_say_when_their_val_loss_does_not_compare(
        sqlite_tracking_uri, tiny_model_dir, shapes_dataset_dir, split_dir, tmp_path, capsys):
    """A schedule registers run after run into one model, and a person compares the new @candidate with the one
    before it and with @champion in the Models tab. Each version's tags name its base model, family, method and data
    (the split's digest, and its validation set's digest and image count, as its source run's MLflow Datasets have
    them): a rerun on unchanged data reads alike. A version trained another way, or on other data, says so in its
    description, and that its val_loss was measured on other images where the validation set changed: they read
    only the same `val_loss` and description, and v3's looked worse than v2's where its validation set was harder.
    `promote` compares a version with @champion as the team that promotes only a better week does: by how much, on
    the same validation images, and `--if-better` leaves @champion where it was otherwise (it moved blindly before).
    Each version records when it held @champion and why, or why it was not promoted. The fine-tune's run is the
    real step's record (its config and split), without training."""
    import shutil

    from rangefinder.data.split import split_dataset
    from rangefinder.data.synthetic import make_synthetic_dataset
    from rangefinder.tracking import ensure_parent_run, folder_digest

    name = "rf-scheduled"
    client = MlflowClient(sqlite_tracking_uri)

    def pipeline_run(run_name: str, method: str, split, val_loss: float = 0.1, timesteps: int = 4) -> Any:
        cfg = RangefinderConfig.model_validate({
            "model": {"base_model": str(tiny_model_dir)}, "training": {"method": method},
            "validation": {"timesteps": timesteps},
            "tracking": {"tracking_uri": sqlite_tracking_uri, "experiment_name": "scheduled",
                         "registered_model_name": name}})
        parent = ensure_parent_run(cfg, name=run_name)
        made, _, _ = finetune_record_then_register(cfg, parent, split, tiny_model_dir, val_loss)
        return client.get_model_version(name, made.version)

    def promote_cli(*flags: str) -> tuple[int, dict, str]:
        """`rangefinder promote --json` of @candidate: (exit status, the result, stderr)."""
        capsys.readouterr()
        code = cli_main(["promote", "--model", name, "--tracking-uri", sqlite_tracking_uri, "--json", *flags])
        out, err = capsys.readouterr()
        return code, json.loads(out), err

    first = pipeline_run("monday", "lora", split_dir)
    lineage = {"rangefinder.base_model": str(tiny_model_dir), "rangefinder.model_family": "sd1",
               "rangefinder.method": "lora", "rangefinder.dataset_digest": folder_digest(split_dir, "*.jsonl"),
               "rangefinder.validation_digest": folder_digest(split_dir, "val.jsonl"),
               "rangefinder.validation_images": "4"}
    assert {k: first.tags.get(k) for k in lineage} == lineage
    assert first.tags["rangefinder.validation_settings"].startswith(
        "validation.timesteps=4, validation.seed=0, data.resolution=512, data.center_crop=True, ")
    # The first week: no @champion to beat, so --if-better promotes it, and says there was nothing to compare with.
    code, promoted, _ = promote_cli("--if-better")
    assert code == 0 and promoted["promoted"] and promoted["previous_version"] is None
    assert promoted["comparison"] == "no version held @champion before: nothing to compare with"
    # The same config and data again: another source run, the same lineage, and nothing said against version 1.
    again = pipeline_run("tuesday", "lora", split_dir, val_loss=0.12)
    assert again.run_id != first.run_id and {k: again.tags.get(k) for k in lineage} == lineage
    assert "Unlike" not in again.description
    # What promote would answer is in its description from the start: measured alike, and worse than @champion's.
    assert again.description.split(" To use it: ")[0].endswith(
        "Against @champion: val_loss 0.12 against @champion version 1's 0.1: 0.02 higher (20.0%), not better, on the "
        f"same validation images (4 images, digest {lineage['rangefinder.validation_digest']})."), again.description
    # Measured on the same images and worse: --if-better says by how much, exits 1 and leaves @champion at 1.
    code, refused, err = promote_cli("--if-better")
    assert code == 1 and not refused["promoted"] and refused["better"] is False
    assert refused["val_loss_change"] == pytest.approx(0.02)
    said = (f"val_loss 0.12 against @champion version 1's 0.1: 0.02 higher (20.0%), not better, on the same "
            f"validation images (4 images, digest {lineage['rangefinder.validation_digest']})")
    assert refused["comparison"] == said
    assert err == f"rangefinder promote: not promoted (--if-better): {said}; @champion stays at version 1\n"
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"

    # Images added and a caption changed, then a full fine-tune into the same registered model.
    data = tmp_path / "data"
    shutil.copytree(shapes_dataset_dir, data)
    make_synthetic_dataset(tmp_path / "more", kind="shapes", count=4, seed=9)
    for i, image in enumerate(sorted((tmp_path / "more").glob("*.png"))):
        shutil.copy(image, data / f"added{i}.png")
        shutil.copy(image.with_suffix(".txt"), data / f"added{i}.txt")
    (data / "00000.txt").write_text("a shape, captioned anew\n")
    changed = tmp_path / "split"
    split_dataset(data, changed, val_split=0.2, stabilize_split=0.2, seed=555)
    third = pipeline_run("wednesday", "full", changed)
    val_digest = folder_digest(changed, "val.jsonl")
    assert third.tags["rangefinder.method"] == "full" and third.tags["rangefinder.validation_images"] == "5"
    assert third.tags["rangefinder.validation_digest"] == val_digest != lineage["rangefinder.validation_digest"]
    unlike = (f"method full where it had lora; another validation set (5 images, digest {val_digest}, where it had "
              f"4 images, digest {lineage['rangefinder.validation_digest']}), so their val_loss values were measured "
              f"on other images and do not compare; other data (dataset digest {folder_digest(changed, '*.jsonl')}, "
              f"where it had {lineage['rangefinder.dataset_digest']}).")
    assert f"Unlike version 2 (the version before it): {unlike}" in third.description, third.description
    assert f"Unlike version 1 (@champion): {unlike}" in third.description, third.description
    # The run moved @candidate only: @champion stays where the person put it.
    assert str(client.get_model_version_by_alias(name, "candidate").version) == "3"
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
    # A lower val_loss on another validation set ranks nothing: --if-better refuses and names the fix; a promotion by
    # hand goes through, with a warning saying the same.
    code, refused, err = promote_cli("--if-better")
    assert code == 1 and refused["better"] is None and refused["val_loss_change"] is None
    assert "does not rank them: another validation set" in err and "split.val_dir" in err
    assert "base model" not in refused["comparison"]  # the same base model: that is not among the reasons
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
    code, promoted, err = promote_cli()
    assert code == 0 and promoted["promoted"] and promoted["previous_version"] == "1"
    assert err.startswith("rangefinder: warning: promoted version 3 to @champion, but val_loss 0.1 against "
                          "@champion version 1's 0.1 does not rank them: another validation set"), err
    assert str(client.get_model_version_by_alias(name, "champion").version) == "3"
    assert "--if-better" in client.get_registered_model(name).description  # the Models tab says how it moves
    # The alias keeps no history; the versions do: when each took @champion and why, until when, and why not.
    history = {v: client.get_model_version(name, v).tags for v in ("1", "2", "3")}
    assert re.fullmatch(r"20\d\d-\d\d-\d\dT\S+ no version held @champion before: nothing to compare with",
                        history["1"]["rangefinder.champion_since"])
    assert history["1"]["rangefinder.champion_until"].endswith(" replaced by version 3")
    assert history["2"]["rangefinder.champion_refused"].endswith(f" not promoted: {said}")
    assert "val_loss 0.1 against @champion version 1's 0.1 does not rank them" in history["3"][
        "rangefinder.champion_since"] and "rangefinder.champion_until" not in history["3"]
    # A rollback: version 1 again, which holds @champion without a stale "until"; version 3's says until when.
    assert promote(name, "1", tracking_uri=sqlite_tracking_uri)["previous_version"] == "3"
    assert "rangefinder.champion_until" not in client.get_model_version(name, "1").tags
    assert client.get_model_version(name, "3").tags["rangefinder.champion_until"].endswith(" replaced by version 1")
    assert promote(name, "3", tracking_uri=sqlite_tracking_uri)["previous_version"] == "1"
    # The same images as version 3, measured at 8 timesteps where it was 4: the same validation digest, but another
    # val_loss; the description and promote say so, and --if-better refuses it.
    fourth = pipeline_run("thursday", "full", changed, val_loss=0.05, timesteps=8)
    assert fourth.tags["rangefinder.validation_digest"] == val_digest
    otherwise = "val_loss measured otherwise (validation.timesteps 8 where it had 4), so their val_loss values do not"
    assert f"Unlike version 3 (the version before it, @champion): {otherwise} compare." in fourth.description
    code, refused, err = promote_cli("--if-better")
    assert code == 1 and refused["better"] is None and otherwise in refused["comparison"], err
    assert str(client.get_model_version_by_alias(name, "champion").version) == "3"


def test_a_scheduled_version_names_the_commit_its_hub_base_model_resolved_to(sqlite_tracking_uri, tiny_model_dir,
                                                                             split_dir, tmp_path, monkeypatch):
    """A schedule trains on `revision: main` of a hub id, and main moves upstream between two runs: the base model
    read the same on both versions, and only the parent's model.resolved_dir param showed the snapshot. resolve-config
    (the real step, from an offline Hugging Face cache) resolves main to a snapshot commit and hands it on in the
    config, as it hands on the folder: every step's run, the parent and the version carry it, and the second version
    says its base model revision differs from the first's."""
    from rangefinder.config import demo_config
    from rangefinder.steps.resolve_config import load_step_config, parameters_from_config, run_resolve_config
    from tests.conftest import HUB_REPO
    from tests.models.fake_hub import make_cached_repo

    cache = tmp_path / "hf-hub-cache"
    monday = make_cached_repo(cache, HUB_REPO, tiny_model_dir, refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = "rf-hub-scheduled"
    client = MlflowClient(sqlite_tracking_uri)

    def pipeline_run(kfp_run_id: str) -> tuple[Any, dict[str, Any]]:
        params = parameters_from_config(demo_config(
            model={"base_model": HUB_REPO, "revision": "main"},
            tracking={"tracking_uri": sqlite_tracking_uri, "experiment_name": "hub-scheduled",
                      "registered_model_name": name}))
        resolved = run_resolve_config(params.pop("base_config"), pipeline_job_id=kfp_run_id, **params)
        cfg, parent = load_step_config(resolved.config_json), resolved.mlflow_parent_run_id
        made, ft, reg = finetune_record_then_register(cfg, parent, split_dir, tiny_model_dir)
        runs = {"parent": client.get_run(parent), "finetune": client.get_run(ft.run_id),
                "register_model": client.get_run(reg.run_id)}
        return client.get_model_version(name, made.version), runs

    first, runs = pipeline_run("kfp-monday")
    revision = "rangefinder.base_model_revision"
    assert (first.tags["rangefinder.base_model"], first.tags[revision]) == (HUB_REPO, monday)
    assert {k: r.data.tags.get(revision) for k, r in runs.items()} == dict.fromkeys(runs, monday)
    assert runs["parent"].data.params["model.resolved_revision"] == monday

    tuesday = make_cached_repo(cache, HUB_REPO, tiny_model_dir, refs=("main",), commit="7" * 40)  # main moved
    second, runs = pipeline_run("kfp-tuesday")
    assert (second.tags["rangefinder.base_model"], second.tags[revision]) == (HUB_REPO, tuesday)
    assert {k: r.data.tags.get(revision) for k, r in runs.items()} == dict.fromkeys(runs, tuesday)
    assert (f"Unlike version 1 (the version before it): base model revision {tuesday} where it had {monday}."
            in second.description), second.description


@pytest.mark.usefixtures("one_thread_as_a_local_run")
def test_a_retrain_s_version_says_its_weights_saw_the_validation_images(sqlite_tracking_uri, tiny_model_dir,
                                                                        split_dir, tmp_path):
    """The nightly run retrains on train + validation after a week of fine-tunes registered as they were: the
    retrain's run logged no Datasets, so its version had the split's digest (from the parent) and nothing else, and
    beside the fine-tune's version, whose val_loss was measured on the validation images, read as made alike. The
    real retrain step logs the parts it trained on as its Datasets (both in context training: no validation set), and
    the real register step's version says it trained on train + validation, and what that means for val_loss."""
    from rangefinder.config import demo_config
    from rangefinder.steps.register_model import run_register_model
    from rangefinder.steps.retrain_full import run_retrain_full
    from rangefinder.tracking import ensure_parent_run, folder_digest

    name = "rf-nightly"
    # One update per epoch (20 images in one batch): the retrain is real, and short.
    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, retrain={"enabled": True},
                      training={"batch_size": 20},
                      tracking={"tracking_uri": sqlite_tracking_uri, "experiment_name": "nightly",
                                "registered_model_name": name})
    client = MlflowClient(sqlite_tracking_uri)
    monday = ensure_parent_run(cfg, name="monday")
    with step_run(cfg, "finetune", parent_run_id=monday) as ft:
        ft.log_config(cfg)
        ft.log_dataset_manifest(split_dir)
    with step_run(cfg, "register_model", parent_run_id=monday) as reg:
        reg.log_diffusers_model(tiny_model_dir, source_step="finetune", metrics={"val_loss": 0.1},
                                num_inference_steps=2)
    assert client.get_model_version(name, "1").tags["rangefinder.train_on"] == "train"

    tuesday = ensure_parent_run(cfg, name="tuesday")
    full = run_retrain_full(cfg, split_dir=split_dir, lr_low=1e-4, lr_high=1e-4, lr=1e-4, recommended_epochs=1,
                            model_dir=tmp_path / "retrain", mlflow_parent_run_id=tuesday)
    registered = run_register_model(cfg, model_dir=full.model_dir, lr=1e-4, epochs=full.epochs,
                                    mlflow_parent_run_id=tuesday)
    version = client.get_model_version(name, registered.version)
    retrain = client.get_run(version.run_id)
    assert retrain.data.tags["rangefinder.step"] == "retrain_full"
    # Its KFP metrics are named as its MLflow run has them (they were `epochs` and `updates` in KFP).
    assert {k: retrain.data.metrics.get(k) for k in full.metrics()} == full.metrics()
    datasets = {d.dataset.name: (d.dataset.digest, {t.key: t.value for t in d.tags}["mlflow.data.context"])
                for d in retrain.inputs.dataset_inputs}
    images = json.loads((split_dir / "split.json").read_text())["root"].rsplit("/", 1)[-1]  # the dataset's folder
    assert datasets == {f"{images}-train": (folder_digest(split_dir, "train.jsonl"), "training"),
                        f"{images}-val": (folder_digest(split_dir, "val.jsonl"), "training")}
    assert retrain.data.tags["rangefinder.dataset_digest"] == folder_digest(split_dir, "*.jsonl")
    assert "rangefinder.validation_digest" not in retrain.data.tags  # it validated on nothing

    assert version.tags["rangefinder.train_on"] == "train+val"
    assert version.tags["rangefinder.dataset_digest"] == folder_digest(split_dir, "*.jsonl")
    assert not {"rangefinder.validation_digest", "rangefinder.validation_images", "val_loss"} & set(version.tags)
    assert ("Unlike version 1 (the version before it): trained on train + validation where it was trained on the "
            "training images alone: its weights saw the validation images, so no val_loss measured on them compares "
            "the two.") in version.description, version.description


@pytest.fixture(scope="module")
def run_registered(shared_sqlite_tracking_uri, tiny_model_dir):
    """(config, model): the tiny model registered by the register step of a run with the demo's sampling settings
    (DDIM, guidance 5) and a sampling resolution of its own, loaded as the team downstream loads it."""
    from rangefinder.config import demo_config
    from rangefinder.steps.register_model import run_register_model
    from tests.tracking.fixtures import without_mlflow_run_env

    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, sampling={"num_inference_steps": 4, "resolution": 64},
                      tracking={"tracking_uri": shared_sqlite_tracking_uri, "experiment_name": "downstream",
                                "registered_model_name": "rf-downstream"})
    previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    with without_mlflow_run_env():
        registered = run_register_model(cfg, model_dir=tiny_model_dir, lr=1e-4, epochs=1)
        mlflow.set_tracking_uri(shared_sqlite_tracking_uri)
        model = mlflow.pyfunc.load_model(registered.model_uri)
    mlflow.set_tracking_uri(previous)
    return cfg, model


def test_the_registered_model_renders_by_default_what_the_run_s_grid_shows(run_registered, tiny_model_dir, tmp_path):
    """The model's defaults are the settings the run's samples and grid were drawn with: the scheduler (the demo's
    DDIM; the saved folder keeps the training DDPM, which the model sampled with), the steps, the guidance and
    sampling.resolution over data.resolution (it had data.resolution). So a (prompt, seed) of the grid renders, by
    default, the image the person promoting the model looked at."""
    import numpy as np
    from PIL import Image

    from rangefinder.sampling import render_grid

    cfg, model = run_registered
    s = cfg.sampling
    assert model.model_config == {"num_inference_steps": 4, "guidance_scale": 5.0, "scheduler": "DDIMScheduler",
                                  "height": 64, "width": 64, "size_multiple": 8,
                                  "sampling_dtypes": {"bf16": "float16", "fp16": "float16", "no": "float32"}}
    assert {p.name: p.default for p in model.metadata.get_params_schema().params} == {
        "num_inference_steps": 4, "guidance_scale": 5.0, "height": 64, "width": 64}
    prompt, seed = s.prompts[0], s.seeds[1]
    out = model.predict(pd.DataFrame({"prompt": [prompt], "seed": [seed]}))
    # As the sample_images step renders its grid.
    grid = render_grid([tiny_model_dir], [prompt], [seed], out_dir=tmp_path, steps=s.num_inference_steps,
                       guidance_scale=s.guidance_scale, scheduler=s.scheduler,
                       resolution=s.resolution or cfg.data.resolution)
    cell = Image.open(grid["images"][0][0]).convert("RGB")
    assert np.array_equal(np.asarray(decode_image(out["image"][0])), np.asarray(cell))


def test_a_version_s_description_says_how_to_load_it_and_what_it_says_works_as_written(run_registered,
                                                                                       shared_sqlite_tracking_uri,
                                                                                       tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    """A teammate who only sees the registry reads the version's description for how to use it: each call it
    quotes runs as written, the model it names renders, and the folder it names loads in diffusers as the pipeline
    registered (the tiny model's own folder name: mlflow files the folder under its name)."""
    import re

    import diffusers

    monkeypatch.chdir(tmp_path)  # download_artifacts' files land here
    mlflow.set_tracking_uri(shared_sqlite_tracking_uri)
    mv = MlflowClient(shared_sqlite_tracking_uri).get_model_version_by_alias("rf-downstream", "candidate")
    quoted = re.findall(r"`([^`]+)`", mv.description.split("To use it: ", 1)[1])
    load, predict, _, download, folder, *_ = quoted
    assert load == f'mlflow.pyfunc.load_model("models:/rf-downstream/{mv.version}")'
    out = eval(load + predict, {"mlflow": mlflow, "pandas": pd})  # noqa: S307  (the description's own words)
    assert decode_image(out["image"][0]).size == (64, 64)
    local = eval(download, {"mlflow": mlflow})  # noqa: S307
    assert folder == f"artifacts/{tiny_model_dir.name}/"
    pipe = diffusers.DiffusionPipeline.from_pretrained(os.path.join(local, folder), local_files_only=True)
    assert isinstance(pipe, diffusers.StableDiffusionPipeline)
    weights = "unet/diffusion_pytorch_model.safetensors"
    assert (tmp_path / local / folder / weights).read_bytes() == (tiny_model_dir / weights).read_bytes()
    assert "artifacts/delivered/" not in mv.description  # a full pipeline: no files beside it to name


def test_a_dict_of_prompt_lists_renders_an_image_per_prompt(run_registered):
    """`predict({"prompt": [...]})`, a DataFrame's columns as a dict: MLflow makes a dict of strings and lists of
    strings into one row holding the lists, and the model drew one image of the prompt "['a', 'b']". Each prompt
    gets its row, as pandas makes of the same dict, a single negative prompt or seed going with every prompt; lists
    of other lengths are refused in one line."""
    _, model = run_registered
    prompts = ["a red circle on a white background", "a blue square on a white background"]
    out = model.predict({"prompt": prompts})
    assert out["prompt"].tolist() == prompts and out["seed"].tolist() == [0, 1]
    as_frame = model.predict(pd.DataFrame({"prompt": prompts}))
    assert out["image"].tolist() == as_frame["image"].tolist()
    both = model.predict({"prompt": prompts, "negative_prompt": "green"})
    assert both["image"].tolist() == model.predict(pd.DataFrame({"prompt": prompts, "negative_prompt": "green"}))[
        "image"].tolist() != out["image"].tolist()
    with pytest.raises(MlflowException, match=r"^the input's columns are lists of different lengths \(prompt 2, "
                                              r"negative_prompt 1\); give each column one value per prompt"):
        model.predict({"prompt": prompts, "negative_prompt": ["green"]})


def test_a_row_without_a_prompt_is_refused_not_drawn_as_the_word_none(run_registered):
    """A gap in the prompt column (None, or NaN where pandas fills one) was drawn as the prompt "None" or "nan". It
    is refused in one line naming the rows; an empty prompt is a prompt, drawn without one."""
    _, model = run_registered
    with pytest.raises(MlflowException, match=r"^prompt: row\(s\) 1 have none \(None or NaN\), which would be drawn "
                                              r"as the text 'None' or 'nan'; give each row its prompt \('' draws "
                                              r"without one\)$"):
        model.predict(pd.DataFrame({"prompt": ["a red circle on a white background", None]}))
    assert model.predict(pd.DataFrame({"prompt": [""]}))["prompt"].tolist() == [""]


def test_a_negative_prompt_the_pipeline_would_draw_without_is_refused(run_registered):
    """At guidance_scale 1 or below the pipeline runs no classifier-free guidance, and drew the image a call without
    the negative prompt draws; the call is refused in one line that says what to pass. (Flux, which reads none at
    any guidance: test_each_family_loads_as_its_pipeline_and_generates_what_its_samples_do.)"""
    _, model = run_registered
    call = pd.DataFrame({"prompt": ["a red circle on a white background"], "negative_prompt": ["green"]})
    with pytest.raises(MlflowException, match=r"^negative_prompt: this call's guidance_scale is 1, and classifier-free "
                                              r"guidance, which a negative prompt steers, runs only above 1; pass "
                                              r"params=\{'guidance_scale': ...\} above 1, or leave the column out$"):
        model.predict(call, params={"guidance_scale": 1.0})
    # An empty cell is no negative prompt, as pandas leaves a column's gaps.
    gaps = model.predict(pd.DataFrame({"prompt": ["a", "b"], "negative_prompt": ["", None]}),
                         params={"guidance_scale": 1.0})
    assert gaps["image"].tolist() == model.predict({"prompt": ["a", "b"]}, params={"guidance_scale": 1.0})[
        "image"].tolist()


def test_a_seed_the_grid_and_config_refuse_is_refused(run_registered):
    """A negative seed (or one past 2**32 - 1) was drawn, a torch.Generator taking it, where the run's grid and config
    refuse it: no grid cell can show that image. The call is refused in one line naming the rows, before any is
    drawn."""
    _, model = run_registered
    call = pd.DataFrame({"prompt": ["a red circle on a white background"] * 3, "seed": [0, -1, 2**32]})
    with pytest.raises(MlflowException, match=r"^seed: row\(s\) 1 \(-1\), 2 \(4294967296\) have a seed the run's "
                                              r"grid and config refuse; pass seeds from 0 to 4294967295$"):
        model.predict(call)


@pytest.mark.parametrize("params, refusal", [
    ({"height": 0}, r"^height: the pipeline renders sides in multiples of 8 px, not 0; pass a multiple of 8 \(the "
                    r"default is 64\)$"),
    ({"width": 60}, r"^width: the pipeline renders sides in multiples of 8 px, not 60; "),
    ({"num_inference_steps": 0}, r"^num_inference_steps: 0 draws no image; pass 1 or more$"),
    ({"num_inference_steps": -1}, r"^num_inference_steps: -1 draws no image; pass 1 or more$"),
    ({"width": 264}, r"^width: 264 px is over 4 times the model's 64 px, more memory and time than a picture of it "
                     r"takes; pass at most 256$"),
    ({"guidance_scale": -3.0}, r"^guidance_scale: -3.0 is below 0; pass 0 or more \(the default is 5.0\)$")])
def test_a_size_or_step_count_the_pipeline_cannot_draw_is_refused(run_registered, params, refusal):
    """Each was drawn or failed without a word on what to pass: a side of 0 drew at the pipeline's default size, -1
    steps drew an image of no denoising, 0 steps divided by zero, a side off 8 px raised diffusers' own error. A side
    over 4 times the default was drawn however large: a height of 100000 until the kernel killed the process (264
    here: drawn, and cheap to draw, without the check). A guidance scale below 0 was drawn as if it were 1."""
    _, model = run_registered
    with pytest.raises(MlflowException, match=refusal):
        model.predict(pd.DataFrame({"prompt": ["a red circle on a white background"]}), params=params)


def test_a_registration_the_server_refuses_is_not_tried_again(sqlite_tracking_uri):
    """Only a server that does not answer is waited for: a refusal (no permission on the model) is raised at once,
    not tried again for as long as the server answers."""
    from mlflow.exceptions import RestException

    from rangefinder.tracking.registry import retry_while_server_away

    tries = []

    def register() -> str:
        tries.append(1)
        if len(tries) == 1:
            raise RestException({"error_code": "PERMISSION_DENIED", "message": "no EDIT on rangefinder-sd"})
        return "registered on a later try"

    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=sqlite_tracking_uri))
    with pytest.raises(TrackingError, match=r"denied the user in MLFLOW_TRACKING_USERNAME \(HTTP 403\) the "
                       r"permission to register the model: it needs EDIT on the registered model .*then run: "
                       r"rangefinder register$"):
        retry_while_server_away(cfg, register, what="register the model", later=lambda: "rangefinder register")
    assert len(tries) == 1


def test_a_registration_with_credentials_the_server_no_longer_takes_names_them_and_the_later_command(
        mlflow_auth_server, monkeypatch):
    """basic auth's 401 is no JSON, which MLflow raises as a plain MlflowException: taken for an outage, it went to
    the server check, which said the credentials were refused with no word on the command that registers the weights
    once they are fixed; taken for the answer it is, it was MLflow's traceback. It is said at once, with both."""
    import time

    from mlflow import MlflowClient

    from rangefinder.tracking.registry import retry_while_server_away

    uri, user, _ = mlflow_auth_server
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "changed-by-the-admin-8812")
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=uri, server_wait_seconds=30))
    started = time.monotonic()
    with pytest.raises(TrackingError) as e:
        retry_while_server_away(cfg, lambda: MlflowClient(uri).create_registered_model("rotated"),
                                what="register the model", later=lambda: "rangefinder register ...")
    assert time.monotonic() - started < 10  # not waited for as an outage
    assert str(e.value) == (
        f"the MLflow tracking server at {uri} refused the credentials (HTTP 401); set MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD (basic auth) or MLFLOW_TRACKING_TOKEN (bearer) to credentials the server accepts "
        "(now set: MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD); so could not register the model; once it "
        "takes them, run: rangefinder register ...")


def test_a_registration_the_server_refuses_for_its_host_header_names_allowed_hosts_not_a_permission(mlflow_server_uri):
    """A server restarted without --allowed-hosts answers the registration 403, `Invalid Host header`: it was said to
    deny the user EDIT on the registered model."""
    from rangefinder.tracking.registry import retry_while_server_away

    uri = f"http://localhost:{mlflow_server_uri.rsplit(':', 1)[1]}"  # a name the fixture's server does not allow
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=uri, server_wait_seconds=30))
    with pytest.raises(TrackingError) as e:
        retry_while_server_away(cfg, lambda: MlflowClient(uri).create_registered_model("host-refused"),
                                what="register the model", later=lambda: "rangefinder register ...")
    said = str(e.value)
    assert "--allowed-hosts" in said and "permission" not in said, said
    assert said.endswith("run: rangefinder register ..."), said


def test_a_registration_on_a_sqlite_store_another_program_holds_locked_gives_up_after_the_wait(
        shared_sqlite_tracking_uri):
    """A SQLite store another program holds locked is an outage (tracking/target.py store_unavailable) whose check
    sends no request, so it passes at once: the registration was tried again without end, for as long as the lock
    held, where a server that stays away is given up on after tracking.server_wait_seconds."""
    import sqlite3

    from rangefinder.tracking.registry import retry_while_server_away
    from tests.tracking.fixtures import sqlite_busy_timeout

    uri = shared_sqlite_tracking_uri
    MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # the store made first
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=uri, server_wait_seconds=0))
    tries = []

    def register() -> Any:
        tries.append(1)
        if len(tries) > 20:
            raise AssertionError("tried again without end while the store stayed locked")
        return MlflowClient(tracking_uri=uri, registry_uri=uri).create_registered_model("locked-store")

    holder = sqlite3.connect(uri.removeprefix("sqlite:///"), isolation_level=None)
    with sqlite_busy_timeout(50):
        try:
            holder.execute("BEGIN IMMEDIATE")
            with pytest.raises(TrackingError) as e:
                retry_while_server_away(cfg, register, what="register the model", later=lambda: "rangefinder register")
        finally:
            holder.close()
    said = str(e.value)
    assert len(said.splitlines()) == 1 and "database is locked" in said, said
    assert said.endswith("so could not register the model; once it answers, run: rangefinder register"), said
    assert len(tries) == 2  # once more after the check answered


def test_promote_where_there_is_no_database_creates_none(tmp_path, monkeypatch, capsys):
    """Run beside a local run's OUT folder, `promote` opened the default ./mlflow.db, which created an empty store
    there, and said only that the model was not in it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for args in ([], ["--tracking-uri", f"sqlite:///{tmp_path / 'run 1' / 'mlflow.db'}"]):
        capsys.readouterr()
        assert cli_main(["promote", "--version", "1", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "no MLflow database at" in err and "pass --tracking-uri sqlite:///OUT/mlflow.db" in err, err
    assert list(tmp_path.iterdir()) == []


def test_promote_ranks_two_versions_only_where_their_val_loss_was_measured_alike():
    """compare_versions, on versions as the registry holds them (their lineage tags): a lower val_loss ranks two
    versions only on the same validation images of the same base model, measured by weights that never trained on
    them; another method or more training data is what a comparison is for."""
    from mlflow.entities.model_registry import ModelVersion, ModelVersionTag

    from rangefinder.tracking.registry import compare_versions

    week = {"rangefinder.base_model": "sd-base", "rangefinder.model_family": "sd1", "rangefinder.method": "lora",
            "rangefinder.dataset_digest": "d1", "rangefinder.train_on": "train",
            "rangefinder.validation_digest": "v1", "rangefinder.validation_images": "4", "val_loss": "0.2",
            "rangefinder.validation_settings": "validation.timesteps=4, validation.seed=0, data.resolution=512"}

    def version(number: int, **tags: str) -> ModelVersion:
        merged = {k: v for k, v in {**week, **tags}.items() if v}
        return ModelVersion("m", str(number), 0, tags=[ModelVersionTag(k, v) for k, v in merged.items()])

    ranked = compare_versions(version(2, val_loss="0.18", **{"rangefinder.method": "full",
                                                            "rangefinder.dataset_digest": "d2"}), version(1))
    assert ranked["better"] is True and ranked["val_loss_change"] == pytest.approx(-0.02)
    assert ranked["comparison"] == ("val_loss 0.18 against @champion version 1's 0.2: 0.02 lower (10.0%), better, "
                                    "on the same validation images (4 images, digest v1)")
    other_base = compare_versions(version(2, val_loss="0.1", **{"rangefinder.base_model": "sd-other"}), version(1))
    assert other_base["better"] is None and "base model sd-other where it had sd-base" in other_base["comparison"]
    # A hub id's main moved between two weeks: the delivered models are still measured alike on the same images, so
    # they rank (--if-better was refused until a person promoted), and the comparison says from which commit to which.
    moved = compare_versions(version(2, val_loss="0.1", **{"rangefinder.base_model_revision": "b" * 40}),
                             version(1, **{"rangefinder.base_model_revision": "a" * 40}))
    assert moved["better"] is True and moved["comparison"] == (
        "val_loss 0.1 against @champion version 1's 0.2: 0.1 lower (50.0%), better, on the same validation images "
        f"(4 images, digest v1); its base model sd-base moved from revision {'a' * 40} (version 1's) to {'b' * 40}: "
        "pin model.revision to keep the base weights fixed from week to week")
    # A flow model's loss weighting weights training only (validation is never weighted, as min-SNR's is not): two
    # versions trained under other weightings are measured alike, and a version whose tag still names the weighting
    # (registered before it was left out) ranks against one whose tag does not; the sigma grid's settings do not.
    from rangefinder.tracking.registry import validation_settings

    flow = "validation.timesteps=4, validation.seed=0, data.resolution=512, training.flow.shift_used=3.0"
    assert validation_settings({"validation.timesteps": 4, "validation.seed": 0, "data.resolution": 512,
                                "training.flow.loss_weighting": "cosmap", "training.flow.shift_used": 3.0}) == flow
    weighted = compare_versions(version(2, val_loss="0.1", **{"rangefinder.validation_settings": flow}),
                                version(1, **{"rangefinder.validation_settings":
                                              f"{flow}, training.flow.loss_weighting=sigma_sqrt"}))
    assert weighted["better"] is True, weighted["comparison"]
    shifted = compare_versions(version(2, val_loss="0.1", **{"rangefinder.validation_settings": flow}),
                               version(1, **{"rangefinder.validation_settings": flow.replace("3.0", "1.0")}))
    assert shifted["better"] is None and "training.flow.shift_used 3.0 where it had 1.0" in shifted["comparison"]
    # The shift and Flux's guidance as set (None: the model's own) are measured by what they resolved to, logged
    # beside them: a shift of 3.0 set by hand measures as SD3's unset one, 3.0, does.
    assert validation_settings({"validation.timesteps": 4, "validation.seed": 0, "data.resolution": 512,
                                "training.flow.shift": "None", "training.flow.shift_used": 3.0}) == flow
    by_hand = compare_versions(version(2, val_loss="0.1", **{"rangefinder.validation_settings": flow}),
                               version(1, **{"rangefinder.validation_settings": flow.replace(
                                   "training.flow.shift_used", "training.flow.shift=3.0, training.flow.shift_used")}))
    assert by_hand["better"] is True, by_hand["comparison"]
    # A folder and a single file have no model.revision to pin: their weights were replaced under the same path.
    folder = compare_versions(version(2, val_loss="0.1", **{"rangefinder.base_model_revision": "weights:" + "b" * 32}),
                              version(1, **{"rangefinder.base_model_revision": "weights:" + "a" * 32}))
    assert folder["better"] is True and folder["comparison"].endswith(
        f"(version 1's) to weights:{'b' * 32} (the weights in its folder were replaced): to keep the base weights "
        "fixed from week to week, put new ones in a folder of their own and set model.base_model to it, instead of "
        "replacing these"), folder["comparison"]
    single = compare_versions(version(2, val_loss="0.1", **{"rangefinder.base_model_revision": "sha256:" + "b" * 64}),
                              version(1, **{"rangefinder.base_model_revision": "sha256:" + "a" * 64}))
    assert single["comparison"].endswith("(its file was replaced): to keep the base weights fixed from week to week, "
                                         "save new ones under a file name of their own and set model.base_model to "
                                         "it, instead of replacing this one"), single["comparison"]
    embedded = {"rangefinder.base_model": "embedded-tiny"}
    release = compare_versions(version(2, val_loss="0.1", **embedded,
                                       **{"rangefinder.base_model_revision": "weights:" + "b" * 32}),
                               version(1, **embedded, **{"rangefinder.base_model_revision": "weights:" + "a" * 32}))
    assert release["comparison"].endswith("(another rangefinder release's embedded tiny model): to keep the base "
                                          "weights fixed from week to week, run the schedule on one release")
    retrained = compare_versions(version(2), version(1, val_loss="", **{"rangefinder.train_on": "train+val",
                                                                        "rangefinder.validation_digest": ""}))
    assert retrained["better"] is None and "that version's weights saw the validation images" in retrained[
        "comparison"] and "version 1 has no val_loss" in retrained["comparison"]
    by_hand = compare_versions(version(2, val_loss="0.1"), version(1, **{"rangefinder.validation_digest": ""}))
    assert by_hand["better"] is None and "version 1 does not record its validation set" in by_hand["comparison"]
    # A version of code that did not record how its val_loss was measured was read as measured alike.
    unknown = compare_versions(version(2, val_loss="0.1"), version(1, **{"rangefinder.validation_settings": ""}))
    assert unknown["better"] is None and unknown["comparison"] == (
        "val_loss 0.1 against @champion version 1's 0.2 does not rank them: version 1 does not record how its "
        "val_loss was measured (tag rangefinder.validation_settings: registered by hand or by earlier code), so "
        "whether both were measured alike is unknown; where you know they were, promote it by hand with --version")
    first = compare_versions(version(1, **{"rangefinder.improved_on_base": "false"}), None)
    assert first["better"] is None and first["improved_on_base"] is False
    assert first["comparison"].startswith("no version held @champion before: nothing to compare with; its val_loss "
                                          "is not below its base model's")


def test_a_version_from_a_folder_whose_weights_were_replaced_says_so(shared_sqlite_tracking_uri, tiny_model_dir,
                                                                    tmp_path, capsys):
    """A schedule retrains weekly from a folder (a PVC mount) in which someone replaced the weights: both versions
    read as made from the same base model, with no revision, and promote --if-better ranked them as if only the
    fine-tune differed. resolve-config's revision of the folder (the fingerprint of its weights) is in each version's
    lineage tags, as StepRun.lineage takes them, and the second version's description and promote say the weights in
    the folder were replaced, and how to keep them fixed."""
    import shutil

    from rangefinder.config import demo_config
    from rangefinder.steps.resolve_config import with_resolved_base_model
    from rangefinder.tracking.registry import TRAINED_AS, _unlike_earlier
    from rangefinder.tracking.runs import common_tags
    from tests.models.test_fingerprint import UNET_WEIGHTS, flip_byte, last_tensor_data_at

    folder = tmp_path / "sd15"
    shutil.copytree(tiny_model_dir, folder)
    client = MlflowClient(tracking_uri=shared_sqlite_tracking_uri, registry_uri=shared_sqlite_tracking_uri)
    name = "rf-folder-replaced"
    run = client.create_run(client.create_experiment("folder-replaced"))
    client.create_registered_model(name)
    measured = {"rangefinder.validation_digest": "v1", "rangefinder.train_on": "train",
                "rangefinder.validation_settings": "validation.timesteps=4, validation.seed=0"}
    revision = "rangefinder.base_model_revision"

    def week(val_loss: str) -> tuple[str, dict[str, str]]:
        cfg, _ = with_resolved_base_model(demo_config(model={"base_model": str(folder)}))
        tags = {"val_loss": val_loss, **measured, **{k: v for k, v in common_tags(cfg).items() if k in TRAINED_AS}}
        mv = client.create_model_version(name, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id, tags=tags)
        client.set_registered_model_alias(name, "candidate", mv.version)
        return str(mv.version), tags

    first, monday = week("0.2")
    client.set_registered_model_alias(name, "champion", first)
    flip_byte(folder / UNET_WEIGHTS, last_tensor_data_at(folder / UNET_WEIGHTS))  # the weights replaced
    second, tuesday = week("0.1")
    assert monday[revision].startswith("weights:") and tuesday[revision] != monday[revision]
    assert _unlike_earlier(client, name, second, tuesday)[0] == (
        f"Unlike version {first} (the version before it, @champion): base model revision {tuesday[revision]} where it "
        f"had {monday[revision]} (the weights in its folder were replaced).")
    capsys.readouterr()
    code = cli_main(["promote", "--model", name, "--tracking-uri", shared_sqlite_tracking_uri, "--json",
                     "--if-better"])
    promoted = json.loads(capsys.readouterr().out)
    assert code == 0 and promoted["better"] is True, promoted
    assert promoted["comparison"].endswith(
        f"its base model {folder} moved from revision {monday[revision]} (version {first}'s) to {tuesday[revision]} "
        "(the weights in its folder were replaced): to keep the base weights fixed from week to week, put new ones in "
        "a folder of their own and set model.base_model to it, instead of replacing these"), promoted["comparison"]


def test_the_first_week_is_promoted_if_better_only_where_it_beats_its_base_model(sqlite_tracking_uri, capsys):
    """No @champion yet: --if-better has nothing to beat but the version's own base model, so a first week whose
    fine-tune made the model worse than it started stays a candidate (exit 1, no alias), and a promotion by hand
    of it goes through with a warning. A later week better by less than --min-improvement stays a candidate too."""
    client = MlflowClient(tracking_uri=sqlite_tracking_uri, registry_uri=sqlite_tracking_uri)
    name = "rf-first-week"
    run = client.create_run(client.create_experiment("first-week"))
    client.log_text(run.info.run_id, "weights", "model/x.txt")
    client.create_registered_model(name)
    measured = {"rangefinder.validation_digest": "v1", "rangefinder.train_on": "train",
                "rangefinder.validation_settings": "validation.timesteps=4, validation.seed=0"}

    def week(val_loss: str, **tags: str) -> None:
        mv = client.create_model_version(name, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id,
                                         tags={"val_loss": val_loss, **measured, **tags})
        client.set_registered_model_alias(name, "candidate", mv.version)

    week("0.3", **{"rangefinder.improved_on_base": "false"})

    def promote_cli(*flags: str) -> tuple[int, str]:
        capsys.readouterr()
        return cli_main(["promote", "--model", name, "--tracking-uri", sqlite_tracking_uri, *flags]), \
            capsys.readouterr().err

    code, err = promote_cli("--if-better")
    assert code == 1 and "its val_loss is not below its base model's" in err and "@champion stays unset" in err
    with pytest.raises(MlflowException):
        client.get_model_version_by_alias(name, "champion")
    code, err = promote_cli()
    assert code == 0 and err.startswith("rangefinder: warning: promoted version 1 to @champion, but no version held "
                                        "@champion before: nothing to compare with; its val_loss is not below"), err
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"

    week("0.299")  # 0.33 % lower, on the same validation images
    code, err = promote_cli("--if-better", "--min-improvement", "0.01")
    assert code == 1 and err.endswith("0.001 lower (0.3%), better, on the same validation images (digest v1); "
                                      "--min-improvement asks for 1.0% at least; @champion stays at version 1\n"), err
    assert promote_cli("--min-improvement", "0.01")[0] == 2  # without --if-better it would be ignored: refused
    assert promote_cli("--if-better") == (0, "")
    assert str(client.get_model_version_by_alias(name, "champion").version) == "2"

    # An alias MLflow takes (up to 255 characters) names the history tags (rangefinder.<alias>_since, _until,
    # _refused), which it keeps to 250: one over it moved the alias and then failed saying it could not.
    served = "served-by-the-shop-front-" + "x" * 220
    assert promote_cli("--version", "1", "--alias", served)[0] == 0
    assert promote_cli("--version", "2", "--alias", served) == (0, "")
    assert str(client.get_model_version_by_alias(name, served).version) == "2"
    code, err = promote_cli("--version", "1", "--alias", served, "--if-better")
    assert code == 1 and "not promoted" in err, err
    history = {v: {k for k in client.get_model_version(name, v).tags if k.startswith("rangefinder.served-by")}
               for v in ("1", "2")}
    assert [len(keys) for keys in history.values()] == [3, 1], history  # 1: since, until, refused; 2: since
    assert all(len(k) == 250 and "chars cut" in k for keys in history.values() for k in keys), history


def test_a_run_that_started_earlier_but_finished_later_does_not_take_candidate(sqlite_tracking_uri, tiny_model_dir,
                                                                                split_dir):
    """Two pipeline runs at once into one model (a schedule's --max-concurrency, a run submitted beside it): the one
    started first, on older data, finished last and took @candidate from the newer run's version. Its version is
    registered, and says why it is not @candidate."""
    from rangefinder.tracking import ensure_parent_run

    name = "rf-overlap"
    cfg = RangefinderConfig.model_validate({
        "model": {"base_model": str(tiny_model_dir)},
        "tracking": {"tracking_uri": sqlite_tracking_uri, "experiment_name": "overlap", "registered_model_name": name}})
    monday = ensure_parent_run(cfg, name="monday")
    tuesday = ensure_parent_run(cfg, name="tuesday")
    newer, _, _ = finetune_record_then_register(cfg, tuesday, split_dir, tiny_model_dir)
    older, _, _ = finetune_record_then_register(cfg, monday, split_dir, tiny_model_dir)
    client = MlflowClient(sqlite_tracking_uri)
    assert (newer.version, newer.alias, older.version, older.alias) == ("1", "candidate", "2", None)
    assert str(client.get_model_version_by_alias(name, "candidate").version) == "1"
    assert client.get_model_version(name, "2").description.split(" To use it: ")[0].endswith(
        "Not @candidate: version 1, of a pipeline run started after this one's, holds it (the two ran at once, and "
        "this one finished last).")
