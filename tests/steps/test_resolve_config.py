"""The pipeline's typed parameters <-> the one validated config."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from rangefinder.config import FAMILY_NAMES, RangefinderConfig, auto_finder_conflicts, demo_config, parse_config
from rangefinder.errors import ConfigError
from rangefinder.steps.choose_lr import finder_words
from rangefinder.steps.resolve_config import (
    PARAMETER_FIELDS,
    ResolvedConfig,
    config_from_parameters,
    load_step_config,
    parameter_defaults,
    parameters_from_config,
    run_resolve_config,
)
from rangefinder.training.families import check_local_model_settings


def _without_k8s(cfg: RangefinderConfig) -> dict:
    return cfg.model_dump(exclude={"kubernetes"})


@pytest.mark.parametrize("cfg", [
    RangefinderConfig(),
    demo_config(),
    parse_config({"data": {"dataset_dir": "/data/x", "resolution": 256}, "lr": 3e-5, "retrain": {"enabled": True,
                  "epochs": 7}, "training": {"method": "lora", "lora": {"rank": 16}},
                  "sampling": {"prompts": ["a cat"]}, "tracking": {"ui_url": "https://mlflow.example.org"}}),
])
def test_round_trip(cfg):
    params = parameters_from_config(cfg)
    assert set(params) == set(PARAMETER_FIELDS) | {"dataset_uri", "base_config"}
    back = config_from_parameters(**params)
    assert _without_k8s(back) == _without_k8s(cfg)


def test_unset_values_become_none_and_typed_parameters_win():
    cfg = parse_config({"data": {"dataset_dir": "/data/x"}, "lr": 1e-4, "training": {"lora": {"rank": 8}}})
    params = parameters_from_config(cfg)
    assert params["dataset_dir"] == "/data/x" and params["fixed_lr"] == 1e-4
    params.update(dataset_dir="", fixed_lr=0.0, resolution=320, prompts=["x", "y"])
    out = config_from_parameters(**params)
    assert out.data.dataset_dir is None and out.lr is None
    assert out.data.resolution == 320 and out.sampling.prompts == ["x", "y"]
    assert out.training.lora.rank == 8  # what only base_config carries survives


def test_bad_parameter_names_the_parameter():
    params = parameters_from_config(RangefinderConfig())
    params["resolution"] = 500
    with pytest.raises(ConfigError, match=r"data\.resolution \(pipeline parameter resolution\): .*multiple of 8"):
        config_from_parameters(**params)
    with pytest.raises(ConfigError, match="unknown pipeline parameter"):
        config_from_parameters(learning_rate=1.0)
    with pytest.raises(ConfigError, match="base_config is not valid JSON"):
        config_from_parameters(base_config="{nope")


def test_run_resolve_config_outputs():
    params = parameters_from_config(demo_config(lr=2e-4, retrain={"enabled": True}))
    base = params.pop("base_config")
    r = run_resolve_config(base, **params)
    assert r.fixed_lr == 2e-4 and r.retrain is True and r.mlflow_parent_run_id == ""
    resolved = load_step_config(r.config_json)
    # The embedded tiny model, resolved once for every later step, with the fingerprint of its weights as a folder's:
    # another rangefinder release may ship others.
    from rangefinder.models.fingerprint import folder_revision

    assert (Path(resolved.model.resolved_dir) / "model_index.json").is_file() and resolved.model.base_model is None
    assert resolved.model.resolved_revision == folder_revision(Path(resolved.model.resolved_dir))
    assert resolved.model_copy(update={"model": resolved.model.model_copy(
        update={"resolved_dir": None, "resolved_revision": None})}) == config_from_parameters(base, **params)
    assert json.loads(r.config_json)["lr"] == 2e-4


def test_an_lr_free_optimizer_takes_the_fixed_lr_branch_without_an_lr():
    """An LR-free optimizer (Prodigy) discovers nothing: fixed_lr, the DAG's condition, is its lr 1.0 with no lr set,
    so the pipeline skips the range test (which refuses it) and trains the fine-tune at once."""
    from rangefinder.config import LR_FREE_LR

    params = parameters_from_config(demo_config(training={"optimizer": "prodigy"},
                                                lr_range_test={"lr_min": None, "lr_max": None}))
    base = params.pop("base_config")
    r = run_resolve_config(base, **params)
    assert load_step_config(r.config_json).lr is None and r.fixed_lr == LR_FREE_LR == 1.0


def test_the_first_step_resolves_the_base_model_once_for_every_later_step(fake_hub_cache, monkeypatch):
    """A hub id becomes the cached snapshot folder, and its commit, in the config the later steps receive; the UI's
    revision wins."""
    from tests.conftest import HUB_REPO

    cache, commit = fake_hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    params = parameters_from_config(demo_config(model={"base_model": HUB_REPO, "revision": "main",
                                                       "resolved_dir": "/elsewhere/stale",
                                                       "resolved_revision": "0" * 40}))
    base = params.pop("base_config")
    assert {"resolved_dir", "resolved_revision"}.isdisjoint(json.loads(base)["model"])  # each run resolves its own
    params["base_model_revision"] = "v1"
    r = run_resolve_config(base, **params)
    model = json.loads(r.config_json)["model"]
    assert model["base_model"] == HUB_REPO and model["revision"] == "v1"
    assert model["resolved_dir"] == str(cache / f"models--{HUB_REPO.replace('/', '--')}" / "snapshots" / commit)
    assert model["resolved_revision"] == commit
    assert load_step_config(r.config_json).model.resolved_dir == model["resolved_dir"]


@pytest.mark.parametrize("base_model", ["", "/data/models/mine", "/data/models/mine.safetensors"])
def test_a_revision_for_a_base_model_that_has_none_is_named_by_its_parameter(base_model):
    """A branch, tag or commit typed into the run form's base_model_revision beside the embedded model, a folder or a
    single file on the data volume: the run trained that model as it was, the revision ignored without a word, and the
    person believed the run pinned to it. main, the default branch (configs/example.yaml sets it), is no change."""
    params = parameters_from_config(demo_config())
    base = params.pop("base_config")
    params.update(base_model=base_model, base_model_revision="v1.2")
    with pytest.raises(ConfigError) as e:
        config_from_parameters(base, **params)
    assert str(e.value).startswith("model.revision (pipeline parameter base_model_revision): 'v1.2' is a branch, tag "
                                   "or commit of a hub model"), e.value
    assert "clear it, or give model.base_model a hub id (org/name)" in str(e.value)
    params["base_model_revision"] = "main"
    assert config_from_parameters(base, **params).model.revision == "main"
    assert config_from_parameters(base, **{**params, "base_model": "org/name", "base_model_revision": "v1.2"}
                                  ).model.revision == "v1.2"


def test_a_bad_base_model_stops_the_first_step(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    params = parameters_from_config(demo_config(model={"base_model": "org/not-downloaded"}))
    base = params.pop("base_config")
    with pytest.raises(ConfigError, match=r"hub model 'org/not-downloaded' \(revision 'main'\) is not in the"):
        run_resolve_config(base, **params)


def test_a_token_pasted_as_the_base_model_is_hidden_in_the_step_s_error_line_and_the_command_s(
        tmp_path, monkeypatch, capsys):
    """A Hugging Face token pasted into the run form's base_model (or a config's): the loader's one line names the
    model it could not find, so the token went whole into the pod's log, and into the terminal of `rangefinder
    sample`. Both lines now show *** in its place, and still say what was wrong."""
    from rangefinder.cli.main import main as cli_main
    from rangefinder.errors import one_line_errors

    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWx12"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    params = parameters_from_config(demo_config(model={"base_model": token}))
    base = params.pop("base_config")
    with pytest.raises(SystemExit), one_line_errors("resolve-config"):
        run_resolve_config(base, **params)
    step_line = capsys.readouterr().err
    assert token not in step_line and "hub model '***'" in step_line, step_line
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    assert cli_main(["sample", "--model", token, "--prompts", str(tmp_path / "prompts.txt"),
                     "--out", str(tmp_path / "out")]) == 2
    command_line = capsys.readouterr().err
    assert token not in command_line and "***" in command_line and command_line.count("\n") == 1, command_line


def test_the_first_step_refuses_a_method_the_hub_model_s_family_cannot_train_before_downloading_it(
        tiny_sd3_dir, tmp_path, monkeypatch):
    """Textual inversion on an SD3 hub model: refused off its model_index.json, the one file in the cache here (as
    the hub's metadata is, before a download); it was refused only once the whole model had been downloaded, and
    here, offline, the step named the weights' folders missing instead."""
    from tests.models.fake_hub import make_cached_repo

    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "model_index.json").write_bytes((tiny_sd3_dir / "model_index.json").read_bytes())
    make_cached_repo(tmp_path / "hub", "org/sd3", tmp_path / "index")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    params = parameters_from_config(demo_config(model={"base_model": "org/sd3"},
                                                training={"method": "textual_inversion"}))
    base = params.pop("base_config")
    with pytest.raises(ConfigError, match="training.method: textual inversion is not supported on Stable Diffusion 3"):
        run_resolve_config(base, **params)


def test_one_line_errors_end_a_step_without_a_traceback(capsys):
    from rangefinder.errors import one_line_errors

    with pytest.raises(SystemExit) as e, one_line_errors("resolve-config"):
        raise ConfigError("model.base_model: nothing there; pass a folder")
    assert e.value.code == 2
    assert capsys.readouterr().err == "rangefinder step resolve-config: error: ConfigError: model.base_model: " \
                                      "nothing there; pass a folder\n"
    with pytest.raises(KeyError), one_line_errors("finetune"):  # a bug keeps its traceback
        raise KeyError("not bad input")


def test_a_local_runs_step_skips_the_teardown_but_keeps_its_exit_status_and_atexit_handlers(tmp_path):
    """errors.QUICK_EXIT_ENV (set by the local runner): after the step, os._exit skips the interpreter's teardown,
    but the other atexit handlers still run, what was printed is flushed, and an exception raised after the step
    (the executor failing to write its outputs) still fails the process."""
    import subprocess
    import sys

    from rangefinder.errors import QUICK_EXIT_ENV

    script = (
        "import atexit, pathlib, sys\n"
        "from rangefinder.errors import one_line_errors\n"
        f"atexit.register(lambda: pathlib.Path({str(tmp_path / 'handler-ran')!r}).write_text('yes'))\n"
        "with one_line_errors('finetune'):\n"
        "    pass\n"
        "print('step done', end='')\n"  # no newline, no flush: the exit must flush it
        "if sys.argv[1] == 'fail':\n"
        "    raise OSError('cannot write executor_output.json')\n"
    )
    env = {**os.environ, QUICK_EXIT_ENV: "1"}
    ok = subprocess.run([sys.executable, "-c", script, "ok"], capture_output=True, text=True, env=env, timeout=120)
    assert (ok.returncode, ok.stdout) == (0, "step done"), ok.stderr
    assert (tmp_path / "handler-ran").read_text() == "yes"
    (tmp_path / "handler-ran").unlink()
    bad = subprocess.run([sys.executable, "-c", script, "fail"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and "OSError: cannot write executor_output.json" in bad.stderr, bad.stderr
    assert (tmp_path / "handler-ran").read_text() == "yes"


@pytest.mark.parametrize("model, method, finder", [
    ("sd1", "full", "range_test"), ("sd1", "lora", "range_test"), ("sdxl", "full", "prodigy_step"),
    ("sdxl", "lora", "range_test"), ("sd3", "full", "prodigy_step"), ("sd3", "lora", "prodigy_step"),
    ("flux", "full", "prodigy_step"), ("flux", "lora", "prodigy_step"),
])
def test_lr_finder_auto_follows_the_model_and_method_a_person_sets_at_run_time(model, method, finder, request):
    """The compiled pipeline carries lr_finder as a parameter; resolve-config resolves auto for the base model it has
    just resolved and the method of this run, so changing either in the UI changes the finder (the DAG's condition
    reads this output). The family is read off the model's files, never from a name."""
    params = parameters_from_config(RangefinderConfig(lr_finder="auto"))
    base = params.pop("base_config")
    params["method"] = method
    if model != "sd1":  # sd1: the embedded default
        params["base_model"] = str(request.getfixturevalue(f"tiny_{model}_dir"))
    assert run_resolve_config(base, **params).lr_finder == finder
    params.update(lr_finder="range_test")  # the parameter itself wins over base_config
    assert run_resolve_config(base, **params).lr_finder == "range_test"
    if model in ("sd1", "sdxl"):  # textual inversion keeps the range test on each, SDXL's full fine-tune aside
        params.update(method="textual_inversion", lr_finder="auto")
        assert run_resolve_config(base, **params).lr_finder == "range_test"


def test_defaults_that_replace_base_config_are_a_warning(capsys):
    """resolve-config loaded into a user's pipeline defaults every typed parameter (the default config's values);
    a whole config passed as base_config alone loses its typed fields to them. The parameters still win, as the
    pipeline's do, but the step's log names each one it replaced."""
    mine = parameters_from_config(demo_config(training={"method": "lora"}, sampling={"prompts": ["a cat"]}))
    r = run_resolve_config(mine["base_config"], **parameter_defaults())
    assert load_step_config(r.config_json).training.method == "full"
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "base_config" in ln]
    assert line.startswith("rangefinder: warning: pipeline parameter(s) at their default replace what base_config "
                           "sets: method 'full' (base_config's training.method: 'lora'); resolution 512 ")
    assert "prompts [" in line and line.endswith("pass each with base_config's value to keep it")
    # The pipeline's own runs pass base_config and parameters from one config: nothing is replaced.
    base = mine.pop("base_config")
    mine.pop("dataset_uri")
    run_resolve_config(base, **mine)
    assert "base_config" not in capsys.readouterr().err
    # A parameter set on purpose (not its default) is not named.
    run_resolve_config(base, **{**parameter_defaults(), **mine, "method": "textual_inversion"})
    assert "base_config" not in capsys.readouterr().err


def test_range_test_bounds_auto_leaves_unused_are_a_warning_once_the_model_is_known(tiny_sd3_dir, capsys):
    """The CLI cannot tell a hub id's family before it is fetched; resolve-config can, and says it in its log."""
    params = parameters_from_config(RangefinderConfig(lr_range_test={"lr_max": 1e-2}))
    base = params.pop("base_config")
    assert run_resolve_config(base, **params).lr_finder == "range_test"  # SD 1.x: the bounds are used
    assert "warning" not in capsys.readouterr().err
    params["base_model"] = str(tiny_sd3_dir)
    assert run_resolve_config(base, **params).lr_finder == "prodigy_step"
    assert ("rangefinder: warning: the range test's bounds (lr_range_test.lr_max) are not used: on this Stable "
            "Diffusion 3/3.5 base model, lr_finder auto measures the LR of method full with "
            "prodigy_step") in capsys.readouterr().err


def test_parameters_the_chosen_path_leaves_unused_are_a_warning_in_the_step_s_log(capsys):
    """The run form: retrain_epochs with the retrain off, the range test's ramp and bound with a fixed LR did nothing
    without a word. resolve-config warns of them in the CLI's lines (config.setting_conflicts), naming the parameter;
    the parameters the form sends at their defaults are not taken for settings a person gave."""
    form = {**parameter_defaults(), "fixed_lr": 1e-4}
    run_resolve_config("", **form)  # lr_finder at its default (auto) is not "unused" by the fixed LR
    assert "warning" not in capsys.readouterr().err
    run_resolve_config("", **{**form, "ramp": "linear", "lr_max": 1e-2, "retrain_epochs": 3})
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("rangefinder: warning: ")]
    assert lines == [
        "rangefinder: warning: lr (pipeline parameter fixed_lr): 0.0001 is fixed, so no range test runs and the "
        "lr_range_test section (lr_max, ramp) is not used; remove lr to discover the LR, or the section",
        "rangefinder: warning: retrain.epochs (3) is not used: retrain.enabled is false; set enabled true to retrain "
        "on train+validation, or remove epochs"], lines


# --- the family preflight: settings wrong only for the resolved model's family stop the first step ---------------

def _resolve_on(model_dir: Path, **overrides) -> ResolvedConfig:
    """run_resolve_config on the demo's settings (plus `overrides`), the base model typed as a pipeline parameter."""
    params = parameters_from_config(demo_config(**overrides))
    base = params.pop("base_config")
    params["base_model"] = str(model_dir)
    return run_resolve_config(base, **params)


OWN_SAMPLER = {"scheduler": None}  # the model's own sampling scheduler, so that the setting under test is refused


@pytest.mark.parametrize("model, overrides, words", [
    # The demo's DDIM sampler: before, the range test trained in full and the fine-tune failed at its first sample.
    ("tiny_sd3_dir", {}, r"sampling.scheduler: DDIMScheduler samples DDPM models; this base model is a flow-matching "
                         r"model \(it samples with FlowMatchEulerDiscreteScheduler\); set a FlowMatch\* scheduler"),
    ("tiny_flux_dir", {}, r"sampling.scheduler: DDIMScheduler samples DDPM models"),
    # A flow scheduler FluxPipeline cannot hand its sigmas: the fine-tune's first sample was diffusers' ValueError.
    ("tiny_flux_dir", {"sampling": {"scheduler": "FlowMatchHeunDiscreteScheduler"}},
     r"sampling.scheduler: FlowMatchHeunDiscreteScheduler cannot sample Flux.1: FluxPipeline gives its scheduler "
     r"sigmas and mu, which FlowMatchHeunDiscreteScheduler.set_timesteps does not take; use "
     r"FlowMatchEulerDiscreteScheduler"),
    ("tiny_sd3_dir", {"training": {"min_snr_gamma": 5.0}, "sampling": OWN_SAMPLER},
     r"training.min_snr_gamma: min-SNR weighting is defined through the DDPM noise schedule; Stable Diffusion "
     r"3/3\.5 is a flow-matching"),
    ("tiny_sd3_dir", {"training": {"prediction_type": "v_prediction"}, "sampling": OWN_SAMPLER},
     r"training.prediction_type: Stable Diffusion 3/3\.5 is a flow-matching model"),
    ("tiny_flux_dir", {"training": {"noise_offset": 0.05}, "sampling": OWN_SAMPLER},
     r"training.noise_offset: the offset noise is DDPM's; Flux\.1 is a flow-matching model"),
    ("tiny_sd3_dir", {"training": {"flow": {"guidance": 3.5}}, "sampling": OWN_SAMPLER},
     r"training.flow.guidance: SD3 has no guidance"),
    ("tiny_sd3_dir", {"training": {"method": "textual_inversion"}, "sampling": OWN_SAMPLER},
     r"training.method: textual inversion is not supported on Stable Diffusion 3/3.5 models \(only on Stable "
     r"Diffusion 1.x/2.x and Stable Diffusion XL\); use method lora or full"),
    ("tiny_flux_dir", {"training": {"method": "textual_inversion"}, "sampling": OWN_SAMPLER},
     r"training.method: textual inversion is not supported on Flux \(its prompt reaches the transformer through T5"),
    # A word SDXL's tokenizers split: refused here, not by the first training step, once the weights had loaded.
    ("tiny_sdxl_dir",
     {"training": {"method": "textual_inversion", "textual_inversion": {"initializer_token": "zebra"}}},
     r"training.textual_inversion.initializer_token: 'zebra' is 5 tokens for the base model's tokenizer; pick a word "
     r"that is a single token \(e.g. 'object', 'style'\)$"),
    ("tiny_flux_dir", {"training": {"cond_dropout": 0.1}, "sampling": OWN_SAMPLER},
     r"training.cond_dropout: Flux.1-dev is guidance-distilled"),
    ("tiny_model_dir", {"training": {"flow": {"loss_weighting": "cosmap"}}},
     r"training.flow \(loss_weighting\): the base model is a DDPM model \(Stable Diffusion "
     r"1\.x/2\.x\), not a flow-matching one"),
])
def test_a_setting_wrong_for_the_model_family_stops_the_first_step(request, model, overrides, words):
    """The engine's own one-line refusal, raised by resolve-config, before any training step asks for a GPU."""
    with pytest.raises(ConfigError, match="^" + words) as e:
        _resolve_on(request.getfixturevalue(model), **overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model, sampling", [
    ("tiny_sd3_dir", {"scheduler": "FlowMatchEulerDiscreteScheduler"}),
    ("tiny_sd3_dir", {"scheduler": None}),
    ("tiny_sd3_dir", {"scheduler": "FlowMatchHeunDiscreteScheduler"}),  # SD3's pipeline gives it no sigmas
    ("tiny_flux_dir", {"scheduler": None, "guidance_scale": 3.5}),
    ("tiny_model_dir", {}),  # the demo's DDIM on an SD 1.x model
])
def test_settings_right_for_the_model_family_pass_the_preflight(request, model, sampling):
    model_dir = request.getfixturevalue(model)
    r = _resolve_on(model_dir, training={"flow": {"loss_weighting": "cosmap"}} if model != "tiny_model_dir" else {},
                    sampling=sampling)
    assert load_step_config(r.config_json).model.resolved_dir == str(model_dir)


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_sdxl_dir", "tiny_sd3_dir", "tiny_flux_dir"])
def test_an_unset_guidance_scale_is_the_one_the_model_s_own_pipeline_samples_at(request, model):
    """sampling.guidance_scale was 7.5 for every family: Flux.1-dev sampled its distilled guidance input at 7.5
    (FluxPipeline's default is 3.5), SDXL and SD3 off their pipelines' 5.0 and 7.0. Unset, every step samples at what
    the pipeline class the model's model_index.json names samples at when given none (guidance_scale_for, on the
    family of the folder resolve-config hands on); the config keeps it unset (a copy of it given another model samples
    that one at its own: tests/tracking/test_browsing.py). A value set, the old default included, stays what it says."""
    import inspect

    import diffusers

    from rangefinder.training.family_detection import family_of, guidance_scale_for

    model_dir = request.getfixturevalue(model)
    pipeline = getattr(diffusers, json.loads((model_dir / "model_index.json").read_text())["_class_name"])
    own = inspect.signature(pipeline.__call__).parameters["guidance_scale"].default
    assert own == {"tiny_model_dir": 7.5, "tiny_sdxl_dir": 5.0, "tiny_sd3_dir": 7.0, "tiny_flux_dir": 3.5}[model]
    unset = load_step_config(_resolve_on(model_dir, sampling={"scheduler": None, "guidance_scale": None}).config_json)
    assert unset.sampling.guidance_scale is None
    assert guidance_scale_for(family_of(unset.model), unset.sampling.guidance_scale) == own
    if model == "tiny_flux_dir":
        kept = load_step_config(_resolve_on(model_dir, sampling={"scheduler": None, "guidance_scale": 7.5}).config_json)
        assert guidance_scale_for(family_of(kept.model), kept.sampling.guidance_scale) == 7.5


def test_the_preflight_and_the_engine_refuse_in_the_same_words(tiny_sd3_dir, tiny_flux_dir):
    """One rule each: the preflight calls the family's check_settings, which for_model (the engine) calls too."""
    from rangefinder.config import ModelConfig, TrainingConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.families import family_for

    for model_dir, training in ((tiny_sd3_dir, {"noise_offset": 0.05}), (tiny_flux_dir, {"cond_dropout": 0.1})):
        with pytest.raises(ConfigError) as early:
            _resolve_on(model_dir, training=training, sampling={"scheduler": None})
        with pytest.raises(ConfigError) as engine:
            family_for(load_sd_components(ModelConfig(base_model=str(model_dir))), TrainingConfig(**training))
        assert str(early.value) == str(engine.value)


# --- the size preflight: a resolution the model cannot take stops the first step ---------------------------------

def _with_config(model_dir: Path, out: Path, part: str, **changes) -> Path:
    """A copy of a tiny model folder whose `part`'s config.json has `changes`; every other file is linked. The tiny
    models take every size the config allows (8 px sides), so a model that takes fewer is made this way: Flux.1's
    VAE depth, SD3's patch at 4, as the engine's own tests do on the loaded modules (register_to_config)."""
    for f in model_dir.rglob("*"):
        if f.is_file():
            dest = out / f.relative_to(model_dir)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if f.relative_to(model_dir) == Path(part, "config.json"):
                dest.write_text(json.dumps({**json.loads(f.read_text()), **changes}))
            else:
                dest.symlink_to(f)
    return out


DEEP_VAE = {"block_out_channels": [8, 16, 32, 32]}  # 4 levels: x8, as SD's and Flux.1's VAEs (the tiny one's: x4)
ON_OWN_SAMPLER = {"sd1": {}, "sdxl": {}, "sd3": OWN_SAMPLER, "flux": OWN_SAMPLER}
MODELS = {"sd1": "tiny_model_dir", "sdxl": "tiny_sdxl_dir", "sd3": "tiny_sd3_dir", "flux": "tiny_flux_dir"}


@pytest.mark.parametrize("family, changed, overrides, words", [
    # Before, the fine-tune refused it at its first sample, after the LR discovery had trained.
    ("sd1", None, {"sampling": {"resolution": 36}}, r"sampling.resolution: the pipeline renders sides in multiples "
     r"of 8 px, not 36; set it to a multiple of 8 \(or leave it unset for data.resolution\)"),
    ("sd3", None, {"sampling": {"resolution": 36}}, r"sampling.resolution: the pipeline renders sides in multiples "
     r"of 8 px, not 36"),
    ("flux", None, {"sampling": {"resolution": 44}}, r"sampling.resolution: the pipeline renders sides in multiples "
     r"of 8 px, not 44"),
    ("sd3", ("transformer", {"patch_size": 4}), {"sampling": {"resolution": 40}},
     r"sampling.resolution: the pipeline renders sides in multiples of 16 px, not 40"),
    # Before, the first training step refused it when it encoded.
    ("sdxl", None, {"data": {"resolution": 8}}, r"data.resolution: 8 px is below what Stable Diffusion XL supports for "
     r"this base model \(native 32 px, at least 16 px\); set data.resolution to 16 or more"),
    ("sd3", ("transformer", {"patch_size": 4}), {"data": {"resolution": 40}}, r"data.resolution: 40 px is not a "
     r"multiple of 16 px, Stable Diffusion 3/3\.5's patch size in pixels \(the VAE's downscale times the "
     r"transformer's patch\); set data.resolution to 32"),
    ("sd3", ("transformer", {"sample_size": 64}), {"data": {"resolution": 56}},  # native 256 px: floor 64
     r"data.resolution: 56 px is below what Stable Diffusion 3/3\.5 supports for this base model \(native 256 px, "
     r"at least 64 px\)"),
    ("flux", ("vae", DEEP_VAE), {"data": {"resolution": 40}}, r"data.resolution: 40 px is not a multiple of 16 px"),
    # SD 1.x's UNet takes any square the config allows; a bucket step none of whose buckets it takes cannot work.
    ("sd1", ("vae", DEEP_VAE), {"data": {"resolution": 40, "bucket_step": 24}}, r"data.bucket_step 24 px does not "
     r"fit the base model: its image sides must be multiples of 16 px \(VAE x8, UNet x2\), but buckets 24x24, 24x48, "
     r"48x24 are not; set data.bucket_step to a multiple of 16"),
], ids=["sd1-sampling", "sd3-sampling", "flux-sampling", "sd3-patch4-sampling", "sdxl-floor", "sd3-patch4-data",
        "sd3-floor", "flux-vae8-data", "sd1-vae8-buckets"])
def test_a_size_the_model_cannot_take_stops_the_first_step(request, tmp_path, family, changed, overrides, words):
    """The engine's one-line refusal, raised by resolve-config from the folder's config.json files."""
    model_dir = request.getfixturevalue(MODELS[family])
    if changed is not None:
        model_dir = _with_config(model_dir, tmp_path / "model", changed[0], **changed[1])
    sampling = {**ON_OWN_SAMPLER[family], **overrides.pop("sampling", {})}
    with pytest.raises(ConfigError, match="^" + words) as e:
        _resolve_on(model_dir, sampling=sampling, **overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("overrides", [
    {},  # the demo's 32 px, sampled at it
    {"sampling": {"resolution": 48}},
    {"data": {"resolution": 64, "bucket_step": 16}},
    {"data": {"resolution": 16, "bucketing": False}},
])
def test_sizes_the_model_takes_pass_the_preflight(request, family, overrides):
    model_dir = request.getfixturevalue(MODELS[family])
    sampling = {**ON_OWN_SAMPLER[family], **overrides.get("sampling", {})}
    r = _resolve_on(model_dir, **{**overrides, "sampling": sampling})
    assert load_step_config(r.config_json).model.resolved_dir == str(model_dir)


# A family's code as a word of its own (sd3, "(sdxl)"), not inside a path (tiny-sdxl/) or a name (Flux.1).
FAMILY_CODE = re.compile(r"(?<![\w/.-])(?:sd1|sdxl|sd3|flux)(?![\w/-])")


@pytest.mark.parametrize("family", MODELS)
def test_messages_name_the_family_as_users_know_it(request, family, capsys):
    """What a base model's family refuses, what lr_finder auto leaves unused on it, the first step's line on the base
    model and the LR decision's words name the family as users know it (config.FAMILY_NAMES: "Stable Diffusion
    3/3.5 is a flow-matching model"), never by the code the engine keys on ("sd3 is a flow-matching model")."""
    model_dir = request.getfixturevalue(MODELS[family])
    said = []
    for settings in ({"data": {"resolution": 8}}, {"training": {"min_snr_gamma": 5.0}},
                     {"training": {"prediction_type": "v_prediction"}}, {"training": {"noise_offset": 0.05}},
                     {"training": {"flow": {"shift": 2.0}}}, {"training": {"method": "textual_inversion"}}):
        try:
            check_local_model_settings(parse_config({"model": {"base_model": str(model_dir)}, **settings}))
        except ConfigError as e:
            said.append(str(e))
    unused = parse_config({"lr_range_test": {"lr_min": 1e-6}, "prodigy_step_factor": 2})
    said += [*auto_finder_conflicts(unused, family), finder_words(unused, family)]
    _resolve_on(model_dir, sampling=ON_OWN_SAMPLER[family])
    said.append(capsys.readouterr().out)
    assert sum(FAMILY_NAMES[family] in line for line in said) >= 4, said
    assert not [line for line in said if FAMILY_CODE.search(line)]


def test_a_bucket_step_that_fits_some_images_is_left_to_the_engine(tiny_model_dir, tmp_path):
    """At 40 px with 8 px steps an SD 1.x with the x8 VAE takes the 32x48 bucket but not 40x40: whether a set's
    images land in an odd bucket depends on them, so the first step lets it through and the engine checks the
    buckets the split fills."""
    _resolve_on(_with_config(tiny_model_dir, tmp_path / "m", "vae", **DEEP_VAE),
                data={"resolution": 40, "bucket_step": 8})


def test_the_preflight_and_the_engine_refuse_a_size_in_the_same_words(tiny_sdxl_dir, tiny_sd3_dir, tiny_flux_dir,
                                                                      tiny_model_dir, split_dir, tmp_path):
    """One rule each (training/geometry.py): the preflight applies it to the folder's config.json, the engine to the
    loaded modules' configs, here changed as the folder's are (register_to_config)."""
    from rangefinder.config import DataConfig, ModelConfig, SamplingConfig, TrainingConfig, ValidationConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.encoding import check_bucket_sides, check_resolution
    from rangefinder.training.families import family_for
    from rangefinder.training.loop import TrainSpec, train

    cases = [(tiny_sdxl_dir, None, {"resolution": 8}), (tiny_sd3_dir, ("transformer", {"patch_size": 4}),
             {"resolution": 40}), (tiny_flux_dir, ("vae", DEEP_VAE), {"resolution": 40})]
    for i, (model_dir, changed, data) in enumerate(cases):
        sd = load_sd_components(ModelConfig(base_model=str(model_dir)))
        family = family_for(sd, TrainingConfig())
        early_dir = model_dir
        if changed is not None:
            early_dir = _with_config(model_dir, tmp_path / f"m{i}", changed[0], **changed[1])
            (sd.unet if changed[0] == "transformer" else sd.vae).register_to_config(**changed[1])
        with pytest.raises(ConfigError) as early:
            _resolve_on(early_dir, data=data, sampling=OWN_SAMPLER)
        with pytest.raises(ConfigError) as engine:
            check_resolution(family, sd, DataConfig(**data))
        assert str(early.value) == str(engine.value)

    # A bucket step no bucket fits: the engine names the buckets the images landed in, here all of them.
    data = DataConfig(resolution=40, bucket_step=24)
    sd = load_sd_components(ModelConfig(base_model=str(tiny_model_dir)))
    sd.vae.register_to_config(**DEEP_VAE)
    with pytest.raises(ConfigError) as early:
        _resolve_on(_with_config(tiny_model_dir, tmp_path / "sd1", "vae", **DEEP_VAE), data=data.model_dump())
    with pytest.raises(ConfigError) as engine:
        check_bucket_sides(sd, family_for(sd, TrainingConfig()), {(24, 24), (24, 48), (48, 24)}, data)
    assert str(early.value) == str(engine.value)

    # The sampling resolution: the fine-tune's own refusal, before its first update. Off the 8 px every model renders
    # in, the config refuses it when it is read (config.sampling_resolution_problem, the same sentence); the engine
    # is handed it here unvalidated, as a spec built by hand may be.
    with pytest.raises(ConfigError) as early:
        _resolve_on(tiny_model_dir, sampling={"resolution": 36})
    training = TrainingConfig(batch_size=4, epochs=1, lr=1e-4, cache_dir=str(tmp_path / "cache"))
    sampling = SamplingConfig(num_inference_steps=1, every_validations=1).model_copy(update={"resolution": 36})
    with pytest.raises(ConfigError) as engine:
        train(TrainSpec(training, ValidationConfig(every_epochs=1), split_dir=split_dir, model=tiny_model_dir,
                        sampling=sampling), out_dir=tmp_path / "run")
    assert str(early.value) == str(engine.value)
