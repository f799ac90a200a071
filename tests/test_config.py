"""The typed config rejects every invalid value with a message naming the field, and loads from YAML."""

import functools
import json
import re
from pathlib import Path

import pytest
import yaml

from rangefinder.config import (
    MLFLOW_EXPERIMENT_NAME_CHARS,
    OTHER_TOOLS_NAMES,
    ModelConfig,
    RangefinderConfig,
    TrainingConfig,
    demo_config,
    load_config,
    parse_config,
)
from rangefinder.errors import ConfigError
from rangefinder.planning import plan, val_count


@pytest.mark.parametrize("raw", [{"model": {"hf_token": "hf_abcdefghijklmnopqrstuvwx"}},
                                 {"tracking": {"password": "hunter2-pw"}}, {"token": "hf_abcdefghijklmnopqrstuvwx"}])
def test_a_secret_under_a_setting_the_config_lacks_is_named_not_shown(raw, capsys, tmp_path):
    """A token pasted into base_config in the run form (or a config file) under a name the config does not have:
    the one line that refuses it printed its value, into the step's log and the run's record."""
    from kfp.dsl import Markdown

    from rangefinder.pipelines import kfp_components as c
    from rangefinder.steps.resolve_config import parameters_from_config

    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert "not a setting" in str(e.value) and "(got ***)" in str(e.value), e.value
    assert "hf_abc" not in str(e.value) and "hunter2" not in str(e.value)
    params = parameters_from_config(RangefinderConfig())
    params.pop("dataset_uri")
    params["base_config"] = json.dumps(raw)
    with pytest.raises(SystemExit):  # resolve-config's one line, on the run's log
        c.resolve_config.python_func(**params, pipeline_job_id="", report=Markdown(uri=str(tmp_path / "report")))
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "not a setting" in line and "hf_abc" not in line and "hunter2" not in line, line


@pytest.mark.parametrize(
    "raw,field,hint",
    [
        ({"split": {"val_split": 1.0}}, "split.val_split", "less than 1"),
        ({"split": {"val_split": -0.1}}, "split.val_split", "greater than or equal to 0"),
        ({"split": {"val_split": 0.0}}, "split.val_split", "needs val_split > 0"),
        ({"split": {"stabilize_split": 1.5}}, "split.stabilize_split", "less than or equal to 1"),
        ({"data": {"resolution": 30}}, "data.resolution", "multiple of 8"),
        ({"data": {"min_images": 1}}, "data.min_images", "greater than or equal to 2"),
        ({"data": {"colour": "red"}}, "data.colour", "not a setting of data (got 'red'); remove it"),
        ({"trainng": {}}, "trainng", "not a setting or section of the config; did you mean training?"),
        ({"training": {"batch_size": 0}}, "training.batch_size", "greater than or equal to 1"),
        ({"training": {"lr": 0}}, "training.lr", "greater than 0"),
        ({"training": {"epochs": 2, "steps": 10}}, "training", "either training.epochs or training.steps"),
        ({"training": {"schedule": "triangular", "lr_min": 1e-3, "lr_max": 1e-4}}, "training.lr_max",
         "must be above training.lr_min"),
        ({"training": {"schedule": "exp_range", "lr_min": 1e-4, "lr_max": 1e-4}}, "training.lr_max",
         "must be above training.lr_min"),  # a cycle of no height
        ({"training": {"schedule": "exp-ramp", "lr_max": 1e-2}}, "training.lr_min", "lr_min > 0"),
        ({"training": {"optimizer": "prodigy", "scale_lr": "linear"}}, "training.scale_lr", "set scale_lr: none"),
        ({"training": {"optimizer": "prodigy", "schedule": "linear-ramp", "lr_max": 1e-2}}, "training.schedule",
         "no LR to measure"),
        ({"training": {"schedule": "cosine-ish"}}, "training.schedule", "Input should be"),
        ({"training": {"steps_unit": "epoch"}}, "training.steps_unit", "'update' or 'micro-batch'"),
        ({"lr_range_test": {"lr_min": 1e-2, "lr_max": 1e-3}}, "lr_range_test.lr_max", "must be above"),
        ({"lr_range_test": {"lr_min": 1e-3, "lr_max": 1e-3}}, "lr_range_test.lr_max", "must be above"),  # no sweep
        ({"training": {"optimizer": "adamw_schedule_free"}, "finetune": {"schedule": "triangular"}},
         "finetune.schedule", "schedule-free, so it trains with a constant LR"),
        ({"lr_range_test": {"midpoint": "harmonic"}}, "lr_range_test.midpoint", "'tuned', 'geometric' or 'arithmetic'"),
        ({"validation": {"divergence_factor": 1.0}}, "validation.divergence_factor", "greater than 1"),
        ({"finetune": {"tolerance": 0}}, "finetune.tolerance", "greater than 0"),
        ({"sampling": {"prompts": []}}, "sampling.prompts", "at least one"),
        # One value where a list belongs: it said only "Input should be a valid list".
        ({"sampling": {"prompts": "a red circle"}}, "sampling.prompts", 'write it as a list, e.g. ["a red circle"]'),
        ({"sampling": {"seeds": 0}}, "sampling.seeds", "write it as a list, e.g. [0]"),
        ({"lr": -1}, "lr", "greater than 0"),
        ({"tracking": {"registered_model_name": "team/sd"}}, "tracking.registered_model_name", "may not contain '/'"),
        ({"tracking": {"registered_model_name": "sd:v1"}}, "tracking.registered_model_name", "may not contain '/'"),
        ({"tracking": {"registered_model_name": ".."}}, "tracking.registered_model_name", "MLflow refuses"),
        ({"tracking": {"registered_model_name": "  "}}, "tracking.registered_model_name", "blank space"),
        ({"training": {"lora": {"target_modules": []}}}, "training.lora.target_modules", "is empty, and LoRA adapts "
         "the layers it names; name at least one"),
        # A density's shape under another density: trained as if unset, without a word.
        ({"training": {"flow": {"timestep_sampling": "uniform", "logit_std": 1.5}}}, "training.flow.logit_std",
         "shapes timestep_sampling logit_normal, and timestep_sampling is uniform, which does not read it"),
        ({"training": {"flow": {"mode_scale": 1.0}}}, "training.flow.mode_scale",
         "and timestep_sampling is logit_normal, which does not read it; remove it, or set timestep_sampling: mode"),
        # Compiled, and refused by MLflow in the run's first step.
        ({"tracking": {"experiment_name": ""}}, "tracking.experiment_name", "MLflow refuses as an experiment name"),
        ({"tracking": {"experiment_name": "x" * 501}}, "tracking.experiment_name", "at most 500"),
        # Trained the tokenizer's unknown word (CLIP's end-of-text, in every prompt) in its place.
        ({"training": {"textual_inversion": {"placeholder_token": ""}}}, "training.textual_inversion.placeholder_token",
         "is empty or only blank space, and textual inversion trains the word it names"),
    ],
)
def test_invalid_values_name_the_field(raw, field, hint):
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    msg = str(e.value)
    assert field in msg and hint in msg, msg


@pytest.mark.parametrize("raw,hint", [
    ({"training": {"learnig_rate": "1e-4"}}, "training.learnig_rate: not a setting of training (got '1e-4'); "
                                             "rangefinder's name for learning_rate (kohya sd-scripts, diffusers) is "
                                             "training.lr"),
    ({"training": {"max_train_steps": 500}}, "training.max_train_steps: not a setting of training (got 500); "
                                             "rangefinder's name for max_train_steps (kohya sd-scripts, diffusers) "
                                             "is training.steps"),
    ({"training": {"lora": {"rnk": 4}}}, "training.lora.rnk: not a setting of training.lora (got 4); did you mean "
                                         "training.lora.rank?"),
    ({"epochs": 3}, "epochs: not a setting or section of the config (got 3); epochs is a setting of training, "
                    "lr_range_test, finetune, retrain: put it under the one meant"),
    ({"kubernetes": {"tolerations": [{"key": "a", "valu": "b"}]}},
     "kubernetes.tolerations.0.valu: not a setting of kubernetes.tolerations (got 'b'); did you mean "
     "kubernetes.tolerations.value?"),
    ({"training": {"colour": 3}}, "training.colour: not a setting of training (got 3); remove it (every setting "
                                  "is documented in src/rangefinder/config.py)"),
], ids=["misspelt-other-tools-name", "other-tools-name", "misspelt", "at-the-wrong-level", "in-a-list", "unknown"])
def test_an_unknown_setting_is_told_what_was_meant(raw, hint):
    """A key no section has said only "Extra inputs are not permitted": nothing of `epochs` belonging under a section
    or of kohya's `learning_rate` being `training.lr`."""
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert str(e.value) == hint


def test_every_other_tools_name_points_at_a_setting():
    cfg = RangefinderConfig()
    for name, target in OTHER_TOOLS_NAMES.items():
        section, _, key = target.rpartition(".")
        assert key in type(functools.reduce(getattr, section.split("."), cfg)).model_fields, (name, target)


@pytest.mark.parametrize("raw,hint", [
    ({"training": {"guidance_scale": 1.0}}, "training.guidance_scale: not a setting of training (got 1.0); the "
     "guidance Flux.1-dev trains with (diffusers' and sd-scripts' Flux guidance_scale) is training.flow.guidance"),
    ({"training": {"flow": {"weighting_scheme": "cosmap"}}}, "training.flow.weighting_scheme: not a setting of "
     "training.flow (got 'cosmap'); diffusers' weighting_scheme is two settings here: training.flow.timestep_sampling "
     "(logit_normal, mode, uniform) and training.flow.loss_weighting (sigma_sqrt, cosmap)"),
    ({"training": {"discrete_flow_shift": 3.1}}, "training.discrete_flow_shift: not a setting of training (got 3.1); "
     "rangefinder's name for discrete_flow_shift (kohya sd-scripts, diffusers) is training.flow.shift"),
    ({"training": {"flow": {"max_sequence_length": 256}}}, "training.flow.max_sequence_length: not a setting of "
     "training.flow (got 256); T5's tokens per caption are no setting: 512 on Flux.1, 77 on SD3"),
    ({"training": {"flow": {"timestep_sampling": "flux_shift"}}}, "training.flow.timestep_sampling: Input should be "
     "'uniform', 'logit_normal' or 'mode' (got 'flux_shift'); sd-scripts' flux_shift is logit_normal with "
     "training.flow.shift unset"),
    ({"training": {"flow": {"loss_weighting": "logit_normal"}}}, "training.flow.loss_weighting: Input should be "
     "'none', 'sigma_sqrt' or 'cosmap' (got 'logit_normal'); logit_normal is how sigma is drawn: "
     "training.flow.timestep_sampling"),
], ids=["training-guidance", "weighting-scheme", "flow-shift", "t5-length", "sd-scripts-sampling", "density-as-weight"])
def test_a_flow_setting_of_another_trainer_is_told_what_stands_for_it(raw, hint):
    """A config carried over from diffusers' or sd-scripts' SD3/Flux trainers: `training.guidance_scale` was sent to
    sampling (the samples' guidance, not the one Flux trains with), and weighting_scheme, discrete_flow_shift, T5's
    length and sd-scripts' timestep_sampling values were told only to go."""
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert str(e.value).startswith(hint), str(e.value)


def test_a_density_s_shape_is_taken_with_its_density_and_as_its_default_under_another():
    """The rule refuses only what changes nothing: a config written out whole (a run's config.yaml, every field at
    its value) reads back, and each shape goes with its own density."""
    for sampling in ("uniform", "logit_normal", "mode"):
        flow = parse_config({"training": {"flow": {"timestep_sampling": sampling}}}).training.flow
        assert parse_config({"training": {"flow": flow.model_dump()}}).training.flow == flow
    parse_config({"training": {"flow": {"timestep_sampling": "logit_normal", "logit_mean": 0.5, "logit_std": 0.8}}})
    parse_config({"training": {"flow": {"timestep_sampling": "mode", "mode_scale": 1.0}}})


def test_every_other_tools_value_is_refused_where_it_is_told():
    import typing

    from rangefinder.config import OTHER_TOOLS_SAID, OTHER_TOOLS_VALUES, FlowSettings, _sections

    for where, values in OTHER_TOOLS_VALUES.items():
        field = where.rpartition(".")[2]
        taken = typing.get_args(FlowSettings.model_fields[field].annotation)
        assert where.startswith("training.flow.") and taken, where
        assert not set(values) & set(taken), where  # each is refused there, and so its hint is read
    assert not set(OTHER_TOOLS_SAID) & {k for m in _sections().values() for k in m.model_fields} - {"guidance_scale"}


def test_the_experiment_name_limit_is_mlflows():
    from mlflow.utils.validation import MAX_EXPERIMENT_NAME_LENGTH

    assert MLFLOW_EXPERIMENT_NAME_CHARS == MAX_EXPERIMENT_NAME_LENGTH
    parse_config({"tracking": {"experiment_name": "x" * MAX_EXPERIMENT_NAME_LENGTH}})


def test_defaults_and_demo_are_valid():
    cfg = RangefinderConfig()
    assert cfg.split.val_split == 0.2 and cfg.data.resolution == 512
    assert cfg.tracking.server_wait_seconds == 60  # a step waits out a server pod's restart before it spools
    demo = demo_config()
    assert demo.data.resolution == 32 and demo.model.base_model is None


def test_val_split_always_leaves_a_training_image():
    # ceil(p*N) validation images, at least one, and never all of them.
    assert [val_count(n, 0.2) for n in (2, 5, 20, 21)] == [1, 1, 4, 5]
    assert val_count(2, 0.99) == 1 and val_count(10, 0.0) == 0
    p = plan(2, val_split=0.99, epochs=1)
    assert (p.train_images, p.val_images) == (1, 1)
    with pytest.raises(ConfigError, match="no training images left"):
        plan(1, val_split=0.0, epochs=1, train_images=0)


def test_plan_refuses_a_scale_lr_or_steps_unit_the_config_would_refuse():
    """Called from Python: "Linear" planned an unscaled LR and "steps" counted micro-batches, without a word."""
    with pytest.raises(ConfigError, match=r"^scale_lr must be one of none, linear, sqrt \(got 'Linear'\)$"):
        plan(20, epochs=1, lr=1e-4, scale_lr="Linear")
    with pytest.raises(ConfigError, match=r"^steps_unit must be one of update, micro-batch \(got 'steps'\)$"):
        plan(20, steps=8, steps_unit="steps")


def test_yaml_loading(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "data:\n  dataset_dir: /data/dogs\n  resolution: 64\n"
        "training:\n  method: lora\n  batch_size: 2\n  lora:\n    rank: 8\n"
        "lr_range_test:\n  lr_min: 1.0e-6\n  lr_max: 1.0e-3\n"
    )
    cfg = load_config(path, overrides={"training": {"grad_accum": 3}})
    assert cfg.data.dataset_dir == "/data/dogs" and cfg.data.resolution == 64
    assert cfg.training.method == "lora" and cfg.training.lora.rank == 8 and cfg.training.lora.alpha == 4.0
    assert (cfg.training.batch_size, cfg.training.grad_accum) == (2, 3)
    assert cfg.lr_range_test.lr_max == 1e-3


def test_yaml_errors_name_the_file_and_field(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("data:\n  resolution: 100\n")
    with pytest.raises(ConfigError, match=r"data\.resolution: must be a multiple of 8.*try 96"):
        load_config(wrong)


def test_lr_range_defaults_follow_the_method():
    """Adapters and embeddings learn ~100x higher than full fine-tuning: their default sweep reaches higher."""
    from rangefinder.config import DEFAULT_LR_RANGE, RangefinderConfig

    for method, (lo, hi) in DEFAULT_LR_RANGE.items():
        cfg = RangefinderConfig.model_validate({"training": {"method": method}})
        assert cfg.lr_range_test.range_for(method) == (lo, hi)
    assert DEFAULT_LR_RANGE["lora"][1] >= 100 * DEFAULT_LR_RANGE["full"][1]
    # One end set by hand keeps the other's default, and an impossible pair is refused naming both fields.
    cfg = RangefinderConfig.model_validate({"lr_range_test": {"lr_max": 0.5}, "training": {"method": "lora"}})
    assert cfg.lr_range_test.range_for("lora") == (DEFAULT_LR_RANGE["lora"][0], 0.5)
    with pytest.raises(ConfigError, match="lr_range_test.lr_max .* must be above lr_range_test.lr_min"):
        parse_config({"lr_range_test": {"lr_min": 0.05}, "training": {"method": "full"}})


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_compile(path, tmp_path):
    """The README points people at configs/: each must validate and compile into a pipeline package."""
    from rangefinder.pipelines.pipeline import compile_pipeline

    cfg = load_config(path)
    out = compile_pipeline(cfg, str(tmp_path / "pipeline.yaml"))
    assert Path(out).stat().st_size > 1000


DOCS = ("README.md", "docs/design.md", "docs/scaling.md", "docs/model-families.md", "docs/security.md",
        "docs/demo-learning.md")


def test_every_setting_the_docs_write_out_is_one_the_config_takes():
    """Each `section.field: value` the README and docs/ tell a user to write (`finetune.deliver: earliest_tied`,
    `retrain.enabled: true`, ...) is read by parse_config as written; a placeholder value (`num_nodes: N`) is not
    checked. The README once said `retrain: true`, which the config refuses."""
    sections = set(RangefinderConfig.model_fields)
    found, refused = 0, []
    for doc in DOCS:
        text = (Path(__file__).parents[1] / doc).read_text()
        for m in re.finditer(r"`([a-z_]+(?:\.[a-z_0-9]+)*): ([^`]+)`", text):
            path, value = m.group(1).split("."), m.group(2)
            if path[0] not in sections or re.fullmatch(r"[A-Z]+", value):
                continue
            raw = yaml.safe_load(value)
            for name in reversed(path):
                raw = {name: raw}
            found += 1
            try:
                parse_config(raw)
            except ConfigError as e:
                refused.append(f"{doc}: {m.group(0)}: {e}")
    assert found > 30 and refused == [], "\n".join(refused)


# ---------------------------------------------------------------------------------------------------------------
# Bounded, strict reading (issue 16): sizes, duplicate keys, finite numbers, seeds, credentials


def test_a_key_given_twice_is_an_error_naming_it_and_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("training:\n  lr: 1.0e-4\n  batch_size: 2\n  lr: 1.0e-2\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and "'lr'" in msg and "lines 2 and 4" in msg, msg
    # The same key in two different sections is two settings, and a YAML merge key may be overridden beside it.
    ok = tmp_path / "ok.yaml"
    ok.write_text("lr_range_test:\n  lr_min: 1.0e-6\ntraining:\n  lr_min: 1.0e-6\n  lr_max: 1.0e-3\n"
                  "  schedule: linear-ramp\nsampling:\n  seeds: [0]\n")
    assert load_config(ok).training.lr_min == 1e-6
    merged = tmp_path / "merged.yaml"
    merged.write_text("training: &t {batch_size: 2, lr: 1.0e-4}\nretrain: {enabled: false}\n"
                      "finetune: {epochs: 3}\nsampling: {<<: {num_inference_steps: 4}, num_inference_steps: 5}\n")
    cfg = load_config(merged)
    assert cfg.training.batch_size == 2 and cfg.sampling.num_inference_steps == 5


def test_a_file_over_the_size_limit_is_refused_before_parsing(tmp_path):
    from rangefinder.config import MAX_CONFIG_BYTES

    path = tmp_path / "big.yaml"
    prompt = "a red circle on a blue background " * 8
    path.write_text("sampling:\n  prompts:\n" + f"    - {prompt}\n" * (MAX_CONFIG_BYTES // len(prompt) + 1))
    assert path.stat().st_size > MAX_CONFIG_BYTES
    with pytest.raises(ConfigError, match=r"larger than 1024 KiB; a config holds settings, not data"):
        load_config(path)


@pytest.mark.parametrize(
    "raw,where,words",
    [
        ({"sampling": {"prompts": ["a cat"] * 1001}}, "sampling.prompts", "1001 entries, more than the 1000"),
        ({"data": {"dataset_dir": "/d/" + "x" * 5000}}, "data.dataset_dir", "5003 characters, more than the 4096"),
        ({"kubernetes": {"node_selector": {f"k{i}": "v" for i in range(1001)}}}, "kubernetes.node_selector",
         "1001 entries"),
        ({"training": {"lora": {"target_modules": ["to_q"] * 5000}}}, "training.lora.target_modules", "5000 entries"),
    ],
)
def test_strings_and_lists_are_capped_naming_the_field(raw, where, words):
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert str(e.value).startswith(where + ":") and words in str(e.value), str(e.value)
    assert "x" * 100 not in str(e.value)  # the value itself is not echoed back


def test_yaml_aliases_cannot_multiply_a_config(tmp_path):
    """A 'billion laughs' file is tiny but expands into millions of values; it is refused by the value count."""
    path = tmp_path / "laughs.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 7)]
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size < 2000
    with pytest.raises(ConfigError, match="more than 20000 values"):
        load_config(path)
    deep = tmp_path / "deep.yaml"
    deep.write_text("data: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ConfigError, match="nests too deeply|more than 20000 values"):
        load_config(deep)


@pytest.mark.parametrize("lr", [float("inf"), float("nan"), -1.0, 0.0])
def test_a_non_finite_or_non_positive_lr_is_refused_everywhere(lr, tmp_path):
    for raw in ({"training": {"lr": lr}}, {"lr": lr}, {"training": {"lr_max": lr}},
                {"lr_range_test": {"lr_max": lr}}):
        with pytest.raises(ConfigError, match="lr"):
            parse_config(raw)
    with pytest.raises(ConfigError, match="lr must be a finite number above 0"):
        plan(10, epochs=1, lr=lr)
    yaml_inf = tmp_path / "inf.yaml"
    yaml_inf.write_text("training:\n  lr: .inf\n")
    with pytest.raises(ConfigError, match=r"training\.lr: Input should be a finite number"):
        load_config(yaml_inf)
    assert plan(10, epochs=1, lr=10.0).lr == 10.0  # large, but a number: the planner only counts


def test_scale_lr_multiplies_the_lr_by_the_effective_batch_or_its_square_root():
    for scale, factor in (("none", 1.0), ("linear", 16.0), ("sqrt", 4.0)):
        p = plan(32, epochs=1, batch_size=2, grad_accum=4, world_size=2, lr=1e-4, scale_lr=scale)
        assert p.lr_scale_factor == factor and p.lr == pytest.approx(1e-4 * factor), scale


def test_validations_counted_every_n_updates_include_the_last_update():
    from rangefinder.config import ValidationConfig
    from rangefinder.planning import planned_validations

    p = plan(16, epochs=1)  # 16 updates: validated at 0, 5, 10, 15 and the last, 16
    assert planned_validations(p, ValidationConfig(every_updates=5)) == 5
    assert planned_validations(p, ValidationConfig(every_updates=4)) == 5  # 0, 4, 8, 12, 16


@pytest.mark.parametrize("field", ["training.seed", "split.seed", "validation.seed", "sampling.seeds.0"])
def test_seeds_outside_what_numpy_and_torch_take_are_refused(field):
    from rangefinder.config import MAX_SEED
    from rangefinder.steps.resolve_config import _nested

    section, name = field.split(".")[:2]
    for bad in (-1, MAX_SEED + 1, 2**64):
        value = [bad] if name == "seeds" else bad
        with pytest.raises(ConfigError, match=re.escape(field) + ": Input should be"):
            parse_config(_nested(f"{section}.{name}", value))
    value = [MAX_SEED] if name == "seeds" else MAX_SEED
    parse_config(_nested(f"{section}.{name}", value))


def test_the_largest_seed_really_seeds_numpy_and_torch():
    """The bound is what the libraries take, not a guess: 2**32-1 works, 2**32 does not (numpy)."""
    import numpy as np
    import torch

    from rangefinder.config import MAX_SEED

    np.random.seed(MAX_SEED)
    torch.Generator().manual_seed(MAX_SEED)
    np.random.default_rng([MAX_SEED, 3])
    with pytest.raises(ValueError):
        np.random.seed(MAX_SEED + 1)
    with pytest.raises(ValueError):
        np.random.seed(-1)


@pytest.mark.parametrize("field", ["tracking.tracking_uri", "kubernetes.mlflow_tracking_uri"])
@pytest.mark.parametrize("uri,held", [
    ("http://alice:hunter2-pw@mlflow.example:5000", "a user name and password"),
    ("https://alice@mlflow.example", "a user name"),
    ("https://mlflow.example/?access_token=hunter2-pw", "a secret in its query (access_token=)"),
])
def test_credentials_in_a_tracking_uri_are_refused_without_echoing_them(field, uri, held):
    from rangefinder.steps.resolve_config import _nested

    with pytest.raises(ConfigError) as e:
        parse_config(_nested(field, uri))
    msg = str(e.value)
    assert msg.startswith(field + ":") and held in msg and "MLFLOW_TRACKING_USERNAME" in msg, msg
    assert "hunter2" not in msg and "alice" not in msg
    parse_config(_nested(field, "https://mlflow.example:5000/prefix?x=1"))  # no secret: fine


@pytest.mark.parametrize("field", ["model.base_model", "data.dataset_dir"])
def test_credentials_in_another_setting_s_url_name_where_they_go_not_mlflow_s_variables(field):
    """A URL with a password in a setting other than an MLflow URI: refused unshown, as any, with a fix that fits it.
    It said to set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, which no hub or download reads."""
    from rangefinder.steps.resolve_config import _nested

    with pytest.raises(ConfigError) as e:
        parse_config(_nested(field, "https://alice:hunter2-pw@models.example/sd15.safetensors"))
    msg = str(e.value)
    assert msg == (f"{field}: the URI holds a user name and password; remove it: a config is compiled into the "
                   "pipeline and shown with its parameters; a gated or private hub model reads HF_TOKEN from the "
                   "environment (on a cluster from the Secret kubernetes.hf_token_secret)"), msg


@pytest.mark.parametrize("field,refused,taken", [
    ("cpu_limit", ["8 cores", "1.5.2"], ["8", "0.5", "500m"]),
    ("memory_limit", ["48GB", "48K", "1.5Gi"], ["48Gi", "64G", "512Mi"]),
    ("cpu_request", ["half a core"], ["1", "250m"]),
    ("memory_request", ["2GB"], ["4Gi", "512Mi"]),
    ("shm_size", ["8GB", "lots", "-1Gi"], ["8Gi", "1.5Gi", "512M"]),
    ("accelerator_type", ["gpu", "NVIDIA_TESLA_T4", "kubernetes.io/gpu"],
     ["nvidia.com/gpu", "amd.com/gpu", "nvidia.com/mig-1g.10gb"]),
    ("data_mount_path", ["data", "/", "/dev/shm"], ["/data", "/mnt/datasets/"]),
])
def test_pod_values_the_cluster_would_refuse_are_refused_naming_the_field(field, refused, taken):
    """What KFP's driver or the API server would refuse on the cluster (a step whose pod is never made, a driver that
    crashes on a bad /dev/shm size, a GPU limit under a name no device plugin has), refused when the config is read;
    what both kfp and Kubernetes take is taken as given."""
    for value in refused:
        with pytest.raises(ConfigError, match=rf"^kubernetes\.{field}: {re.escape(repr(value))} is not"):
            parse_config({"kubernetes": {field: value}})
    for value in taken:
        assert getattr(parse_config({"kubernetes": {field: value}}).kubernetes, field) == value


def test_mixed_precision_auto_is_the_default_and_resolves_per_device():
    import torch

    from rangefinder.config import RangefinderConfig, resolve_mixed_precision

    assert RangefinderConfig().training.mixed_precision == "auto"
    assert resolve_mixed_precision("auto", device="cpu") == "no"
    assert resolve_mixed_precision("auto", device="mps") == "no"
    for fixed in ("no", "fp16", "bf16"):
        assert resolve_mixed_precision(fixed, device="cpu") == fixed  # a setting given by hand is kept
    # On this machine: bf16 on a GPU that has it, fp16 on an older one, none without a GPU.
    if not torch.cuda.is_available():
        expected = "no"
    else:
        expected = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    assert resolve_mixed_precision("auto") == expected


@pytest.mark.parametrize("value", ["many", 0, True, -2])
def test_processes_per_node_is_auto_or_a_count(value):
    from rangefinder.config import parse_config

    with pytest.raises(ConfigError, match=r"training.processes_per_node: must be auto .* or a whole number"):
        parse_config({"training": {"processes_per_node": value}})
    assert parse_config({"training": {"processes_per_node": "2"}}).training.processes_per_node == 2


@pytest.mark.parametrize("value", ["sometimes", 0, True, -2, 1.5])
def test_samples_during_training_are_auto_a_count_of_validations_or_off(value):
    from rangefinder.config import parse_config

    with pytest.raises(ConfigError, match=r"sampling.every_validations: must be auto .*, a whole number of "
                                          r"validations >= 1, or null \(off\)"):
        parse_config({"sampling": {"every_validations": value}})
    assert parse_config({}).sampling.every_validations == "auto"
    assert parse_config({"sampling": {"every_validations": "3"}}).sampling.every_validations == 3
    for off in (None, False, "off"):  # a bare YAML `off` is False
        assert parse_config({"sampling": {"every_validations": off}}).sampling.every_validations is None


def test_samples_during_training_use_the_first_seeds():
    from rangefinder.config import parse_config

    s = parse_config({"sampling": {"seeds": [7, 8, 9], "seeds_during_training": 2}}).sampling
    assert s.seeds_for_training() == [7, 8]
    assert parse_config({}).sampling.seeds_for_training() == [0]  # one seed by default: a cheap grid
    with pytest.raises(ConfigError, match=r"sampling.seeds_during_training: 3 is more than the 2 seed\(s\) in "
                                          r"sampling.seeds; lower it or list more seeds"):
        parse_config({"sampling": {"seeds": [0, 1], "seeds_during_training": 3}})


# ---------------------------------------------------------------------------------------------------------------
# lr_finder: how discovery measures the LR


@pytest.mark.parametrize("finder, family, method, resolved", [
    # What the fresh cases chose (bench/RESULTS.md, "`lr_finder: auto` by model family"; SDXL's full fine-tune: "SDXL's
    # full fine-tune at Prodigy's step size", its LoRA and textual inversion untested there, so the range test).
    ("auto", "sd3", "full", "prodigy_step"),
    ("auto", "sd3", "lora", "prodigy_step"),
    ("auto", "flux", "full", "prodigy_step"),
    ("auto", "flux", "lora", "prodigy_step"),
    ("auto", "sdxl", "full", "prodigy_step"),
    ("auto", "sd1", "full", "range_test"),
    ("auto", "sd1", "lora", "range_test"),
    ("auto", "sdxl", "lora", "range_test"),
    ("auto", "sd1", "textual_inversion", "range_test"),
    ("auto", "sdxl", "textual_inversion", "range_test"),
    ("range_test", "sd3", "full", "range_test"),
    ("prodigy_step", "sd1", "textual_inversion", "prodigy_step"),
])
def test_lr_finder_auto_resolves_by_family_and_method_and_the_others_stay(finder, family, method, resolved):
    cfg = parse_config({"lr_finder": finder, "training": {"method": method}})
    assert cfg.lr_finder_for(family) == resolved


def test_auto_lr_finder_measures_sdxl_full_alone_of_sdxl_s_methods_with_prodigy_step():
    """The whole mapping, every family by every method: SDXL's full fine-tune moved to Prodigy's step size by its own
    rule (bench/RESULTS.md, "SDXL's full fine-tune at Prodigy's step size"); its LoRA and textual inversion, and every
    SD 1.x method, keep the range test."""
    from rangefinder.config import auto_lr_finder

    assert auto_lr_finder("sdxl", "full") == "prodigy_step"
    assert auto_lr_finder("sdxl", "lora") == auto_lr_finder("sdxl", "textual_inversion") == "range_test"
    prodigy = {(family, method) for family in ("sd1", "sdxl", "sd3", "flux")
               for method in ("full", "lora", "textual_inversion") if auto_lr_finder(family, method) == "prodigy_step"}
    assert prodigy == {("sdxl", "full"), ("sd3", "full"), ("sd3", "lora"), ("flux", "full"), ("flux", "lora")}


def test_lr_finder_auto_is_the_default():
    assert RangefinderConfig().lr_finder == parse_config({}).lr_finder == "auto"


@pytest.mark.parametrize("training, kept", [
    # auto, the default: LoRA by AdamW at a constant or decaying LR, where bench/RESULTS.md measured it ("The EMA as
    # LoRA's default"); nothing else.
    ({"method": "lora"}, True),
    ({"method": "lora", "optimizer": "adamw8bit"}, True),
    ({"method": "lora", "schedule": "cosine"}, True),
    ({"method": "lora", "schedule": "exp-ramp", "lr_min": 1e-6, "lr_max": 1e-2}, False),  # the range test's ramp
    ({"method": "lora", "optimizer": "prodigy", "lr": 1.0}, False),
    ({"method": "lora", "optimizer": "adamw_schedule_free"}, False),
    ({"method": "full"}, False),
    ({"method": "textual_inversion"}, False),
    # Given, it is kept or dropped for every method.
    ({"method": "full", "use_ema": True}, True),
    ({"method": "textual_inversion", "use_ema": "true"}, True),
    ({"method": "lora", "use_ema": False}, False),
])
def test_use_ema_auto_keeps_an_ema_for_lora_only_and_true_or_false_always_wins(training, kept):
    cfg = parse_config({"training": training})
    # On SD 1.x/2.x, and where the family is not known yet (a hub id the CLI has not fetched).
    assert cfg.training.keeps_ema("sd1") is cfg.training.keeps_ema(None) is kept
    # On SDXL, SD3 and Flux auto keeps none (bench/RESULTS.md, "The EMA on the flow families' LoRA" and "The EMA on
    # SDXL's LoRA"); a setting given wins.
    given = training.get("use_ema", "auto") != "auto"
    assert cfg.training.keeps_ema("sdxl") is cfg.training.keeps_ema("sd3") is cfg.training.keeps_ema("flux") \
        is (kept and given)
    assert cfg.training.use_ema == training.get("use_ema", "auto") or training["use_ema"] == "true"


def test_used_params_are_what_the_auto_settings_resolve_to_here():
    """What every training step logs beside its settings (TrainingConfig.used_params): on this CPU, `auto` precision
    is none, and `auto` EMA is LoRA's alone; a setting given is logged as given."""
    lora = parse_config({"training": {"method": "lora"}}).training
    assert lora.used_params("sd1") == {"training.mixed_precision_used": "no", "training.use_ema_used": True}
    assert lora.used_params("flux")["training.use_ema_used"] is lora.used_params("sdxl")["training.use_ema_used"] \
        is False
    assert parse_config({"training": {"method": "full", "mixed_precision": "bf16"}}).training.used_params("sd1") == {
        "training.mixed_precision_used": "bf16", "training.use_ema_used": False}


def test_use_ema_auto_is_the_default_and_reads_from_yaml(tmp_path):
    assert TrainingConfig().use_ema == RangefinderConfig().training.use_ema == "auto"
    for text, value in (("auto", "auto"), ("true", True), ("false", False)):
        (tmp_path / "c.yaml").write_text(f"training:\n  method: lora\n  use_ema: {text}\n")
        assert load_config(tmp_path / "c.yaml").training.use_ema == value
    with pytest.raises(ConfigError, match="training.use_ema: must be auto .* true or false"):
        parse_config({"training": {"use_ema": "sometimes"}})


def test_range_test_bounds_beside_a_prodigy_step_finder_are_one_clear_error():
    from rangefinder.config import setting_conflicts

    with pytest.raises(ConfigError) as err:
        parse_config({"lr_finder": "prodigy_step", "lr_range_test": {"lr_max": 1e-2}})
    msg = str(err.value)
    assert "\n" not in msg and "lr_finder: prodigy_step" in msg and "lr_range_test.lr_max" in msg
    assert "remove them, or set lr_finder: range_test" in msg
    # Under auto they are a warning where it picks prodigy_step (no config turns invalid with auto the default),
    # and the range test's own where it picks the range test: by the base model's family, when it is known.
    auto = parse_config({"lr_finder": "auto", "lr_range_test": {"lr_min": 1e-6}})
    (line,) = setting_conflicts(auto, "sd3")
    assert line == ("the range test's bounds (lr_range_test.lr_min) are not used: on this Stable Diffusion 3/3.5 "
                    "base model, lr_finder auto measures the LR of method full with prodigy_step, not the range test; "
                    "set lr_finder: range_test to use them, or remove them")
    # SDXL's full fine-tune too
    assert setting_conflicts(auto, "sdxl") == [line.replace("Stable Diffusion 3/3.5", "Stable Diffusion XL")]
    assert setting_conflicts(auto, "sd1") == []
    sdxl_lora = parse_config({"lr_finder": "auto", "training": {"method": "lora"}, "lr_range_test": {"lr_min": 1e-6}})
    assert setting_conflicts(sdxl_lora, "sdxl") == []  # SDXL's LoRA keeps the range test, and its bounds
    assert setting_conflicts(auto) == []  # a hub id not fetched yet: resolve-config says it (test_resolve_config)
    ti = parse_config({"lr_finder": "auto", "training": {"method": "textual_inversion"},
                       "lr_range_test": {"lr_max": 1.0}})
    assert setting_conflicts(ti) == setting_conflicts(ti, "flux") == []
    with pytest.raises(ConfigError, match="lr_finder: Input should be 'range_test', 'prodigy_step' or 'auto'"):
        parse_config({"lr_finder": "prodigy"})


def test_lr_finder_beside_a_fixed_lr_or_an_lr_free_optimizer_is_a_warning_naming_it():
    from rangefinder.config import setting_conflicts

    (line,) = setting_conflicts(parse_config({"lr": 1e-4, "lr_finder": "prodigy_step"}))
    assert line.startswith("lr_finder: prodigy_step is not used: lr: 0.0001 is fixed")
    (line,) = setting_conflicts(parse_config({"lr_finder": "auto", "training": {"optimizer": "prodigy"}}))
    assert "training.optimizer prodigy is LR-free" in line
    assert setting_conflicts(parse_config({"lr_finder": "auto"})) == []


def test_an_adamw_lr_beside_an_lr_free_optimizer_is_a_warning_naming_its_multiplier():
    """`lr: 1e-4` with Prodigy (a learning rate carried over from AdamW) trained at a ten-thousandth of the step size
    Prodigy estimates, without a word; 1.0 or 0.5 is its multiplier as meant."""
    from rangefinder.config import setting_conflicts

    (line,) = setting_conflicts(parse_config({"lr": 1e-4, "training": {"optimizer": "prodigy"}}))
    assert line == ("lr: 0.0001 beside the LR-free optimizer prodigy multiplies the step size it estimates (1.0 trains "
                    "at that step size), so this trains at 0.0001 x it: an AdamW LR does not carry over; leave lr out "
                    "(or set 1.0), or choose training.optimizer: adamw to train at 0.0001")
    for fine in ({"lr": 0.5, "training": {"optimizer": "prodigy_schedule_free"}}, {"lr": 1e-4},
                 {"training": {"optimizer": "prodigy"}}):
        assert setting_conflicts(parse_config(fine)) == [], fine


def test_prodigy_step_factor_overrides_the_family_s_and_is_refused_or_warned_where_nothing_reads_it():
    from rangefinder.config import setting_conflicts

    # Unset: the table's, by family and method. Set: the run's own, on every family (1: the step size itself).
    assert parse_config({}).prodigy_step_factor_for("sdxl") == 4.0
    assert parse_config({}).prodigy_step_factor_for("sd1") == 1.0
    assert parse_config({}).prodigy_step_factor_for("sd3") == 4.0
    assert parse_config({"training": {"method": "lora"}}).prodigy_step_factor_for("sd3") == 1.0
    own = parse_config({"prodigy_step_factor": 1})
    assert own.prodigy_step_factor_for("sdxl") == own.prodigy_step_factor_for(None) == 1.0
    assert "as set in the config" in own.prodigy_step_factor_source()
    for bad in (0, -2, "inf"):
        with pytest.raises(ConfigError, match="prodigy_step_factor"):
            parse_config({"prodigy_step_factor": bad})
    # Asked for by name beside the range test: a contradiction, one error naming both fixes.
    with pytest.raises(ConfigError) as err:
        parse_config({"lr_finder": "range_test", "prodigy_step_factor": 2})
    msg = str(err.value)
    assert "\n" not in msg and "lr_finder: range_test" in msg and "remove prodigy_step_factor" in msg
    # Under auto, a warning where the family's choice is the range test; none where it is prodigy_step.
    auto = parse_config({"prodigy_step_factor": 2})
    (line,) = setting_conflicts(auto, "sd1")
    assert line == ("prodigy_step_factor (2) is not used: on this Stable Diffusion 1.x/2.x base model, lr_finder "
                    "auto measures the LR of method full with the range test, not prodigy_step; set lr_finder: "
                    "prodigy_step to use it, or remove it")
    assert setting_conflicts(auto, "sd3") == setting_conflicts(auto, "sdxl") == setting_conflicts(auto) == []
    # Beside a fixed lr nothing is discovered.
    (line,) = setting_conflicts(parse_config({"lr": 1e-4, "prodigy_step_factor": 2}))
    assert line.startswith("prodigy_step_factor (2) is not used: lr: 0.0001 is fixed")


def test_adamw_settings_beside_another_optimizer_are_named_as_unused():
    """adam_beta1/2, adam_epsilon and weight_decay are AdamW's; the others start from their packages' defaults, so
    `weight_decay: 0.1` beside prodigy or adafactor trained with no weight decay and said nothing."""
    from rangefinder.config import setting_conflicts

    (line,) = setting_conflicts(parse_config({"training": {"optimizer": "prodigy", "weight_decay": 0.1,
                                                           "adam_beta1": 0.5}}))
    assert line == ("training.adam_beta1, training.weight_decay are not used: they are AdamW's, and "
                    "training.optimizer prodigy starts from its package's defaults (its own: training.prodigy); set "
                    "optimizer adamw, or remove them")
    (line,) = setting_conflicts(parse_config({"training": {"optimizer": "adafactor", "weight_decay": 0.0}}))
    assert line.startswith("training.weight_decay is not used: it is AdamW's, and training.optimizer adafactor")
    for optimizer in ("adamw", "adamw8bit"):
        assert setting_conflicts(parse_config({"training": {"optimizer": optimizer, "weight_decay": 0.0,
                                                            "adam_epsilon": 1e-6}})) == []
    assert setting_conflicts(parse_config({"training": {"optimizer": "adamw_schedule_free"}})) == []


def test_prodigy_settings_are_prodigy_s_arguments_and_unused_with_another_optimizer():
    from rangefinder.config import setting_conflicts
    from rangefinder.training.optimizers import PRODIGY_SETTINGS

    cfg = parse_config({"training": {"optimizer": "prodigy", "prodigy": PRODIGY_SETTINGS}})
    assert cfg.training.prodigy.kwargs() == PRODIGY_SETTINGS
    assert parse_config({}).training.prodigy.kwargs() == {}  # prodigyopt's own defaults
    (line,) = setting_conflicts(parse_config({"training": {"prodigy": {"safeguard_warmup": True}}}))
    assert line.startswith("training.prodigy (safeguard_warmup) is not used: training.optimizer is adamw")
    with pytest.raises(ConfigError, match=r"training.prodigy.betas.1: Input should be less than 1"):
        parse_config({"training": {"optimizer": "prodigy", "prodigy": {"betas": [0.9, 1.0]}}})


@pytest.mark.parametrize("name", ["team/sd", "sd:v1", ".", "..", "  ", "rangefinder-sd", "my model_2.x", "ä%b"])
def test_registered_model_names_are_refused_exactly_where_mlflow_refuses_them(name):
    """The register step runs last: a name MLflow refuses must stop the run when its config is read, and a name
    MLflow takes must not be refused."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_model_name

    try:
        _validate_model_name(name)
        mlflow_takes = True
    except MlflowException:
        mlflow_takes = False
    try:
        parse_config({"tracking": {"registered_model_name": name}})
        we_take = True
    except ConfigError:
        we_take = False
    assert we_take == mlflow_takes


def test_another_method_s_settings_and_keep_tokens_without_shuffle_are_a_warning_naming_them():
    """training.lora with method full, training.textual_inversion with lora, keep_tokens without shuffle_tags were
    taken without a word; each now gets one line naming it. A config written out whole (every default) says nothing."""
    from rangefinder.config import setting_conflicts

    (line,) = setting_conflicts(parse_config({"training": {"method": "full", "lora": {"rank": 16}}}))
    assert line.startswith("training.lora (rank) is not used: training.method is full; set method lora")
    (line,) = setting_conflicts(parse_config({"training": {"method": "lora",
                                                           "textual_inversion": {"placeholder_token": "<x>"}}}))
    assert line.startswith("training.textual_inversion (placeholder_token) is not used: training.method is lora")
    (line,) = setting_conflicts(parse_config({"training": {"keep_tokens": 3}}))
    assert line.startswith("training.keep_tokens (3) is not used") and "shuffle_tags is false" in line
    assert setting_conflicts(parse_config({"training": {"method": "lora", "lora": {"rank": 16},
                                                        "shuffle_tags": True, "keep_tokens": 2}})) == []
    whole = setting_conflicts(parse_config(RangefinderConfig().model_dump(mode="json")))
    assert not [ln for ln in whole if ln.startswith(("training.lora", "training.textual_inversion", "training.keep"))]


def test_halving_cooldown_and_average_asked_for_without_validation_are_one_warning_naming_them():
    """The fine-tune step skips each of them without validation (halving_applies, cooldown_applies,
    average_applies); asked for by name they went without a word."""
    from rangefinder.config import setting_conflicts

    no_val = {"validation": {"every_epochs": 0}, "lr_range_test": {"validate_every_updates": 5}}
    (line,) = setting_conflicts(parse_config({**no_val, "finetune": {"successive_halving": True, "cooldown": "on",
                                                                     "average": "on"}}))
    assert line.startswith("finetune.successive_halving: true, finetune.cooldown: on, finetune.average: on do "
                           "nothing without validation")
    (line,) = setting_conflicts(parse_config({"split": {"val_split": 0}, "training": {"optimizer": "prodigy"},
                                              "finetune": {"cooldown": "on"}}))
    assert line.startswith("finetune.cooldown: on does nothing without validation") and "split.val_split" in line
    # With validation, or left at their defaults, nothing is said; a fixed lr's halving line is said once.
    assert setting_conflicts(parse_config({"finetune": {"successive_halving": True, "cooldown": "on"}})) == []
    assert setting_conflicts(parse_config(no_val)) == []
    fixed = setting_conflicts(parse_config({"validation": {"every_epochs": 0}, "lr": 1e-4,
                                            "finetune": {"successive_halving": True}}))
    (line,) = [ln for ln in fixed if "successive_halving" in ln]
    assert "with a fixed lr" in line


def test_a_retrain_with_no_validation_images_is_a_warning_that_it_repeats_the_fine_tune():
    """retrain.enabled with split.val_split 0 (allowed with a fixed lr) trained the fine-tune's run a second time:
    train + validation is the train set, and the fine-tune keeps its configured epochs without validation."""
    from rangefinder.config import setting_conflicts

    no_val = {"split": {"val_split": 0}, "lr": 1e-4}
    (line,) = setting_conflicts(parse_config({**no_val, "retrain": {"enabled": True}}))
    assert line.startswith("retrain.enabled: true adds nothing with split.val_split 0") and "set enabled false" in line
    assert setting_conflicts(parse_config({**no_val, "retrain": {"enabled": True, "epochs": 30}})) == [line]
    # Another length, validation images, or no retrain: nothing to say.
    assert setting_conflicts(parse_config({**no_val, "retrain": {"enabled": True, "epochs": 5}})) == []
    assert setting_conflicts(parse_config({"lr": 1e-4, "retrain": {"enabled": True}})) == []
    assert setting_conflicts(parse_config({"lr": 1e-4, "split": {"val_dir": "/v"}, "retrain": {"enabled": True}})) == []
    assert setting_conflicts(parse_config(no_val)) == []


def test_a_cycle_or_a_third_candidate_with_one_lr_is_a_warning_naming_them():
    """With a fixed lr, an LR-free optimizer or lr_finder prodigy_step, choose_lr collapses the bounds onto one LR:
    finetune.schedule triangular, retrain.schedule triangular and halving_below_margin then trained constant and
    raced nothing, without a word."""
    from rangefinder.config import setting_conflicts

    cyc = {"finetune": {"schedule": "triangular"}, "retrain": {"enabled": True, "schedule": "triangular"}}
    (line,) = setting_conflicts(parse_config({"lr": 1e-4, **cyc}))
    assert line.startswith("finetune.schedule: triangular, retrain.schedule: triangular do nothing with a fixed lr "
                           "(0.0001): the LR bounds collapse onto that one LR")
    (line,) = setting_conflicts(parse_config({"training": {"optimizer": "prodigy"},
                                              "finetune": {"schedule": "triangular"}}))
    assert "LR-free training.optimizer prodigy" in line and line.endswith("(training.optimizer: adamw)")
    (line,) = setting_conflicts(parse_config({"lr_finder": "prodigy_step", "finetune": {"halving_below_margin": 0.1}}))
    assert line.startswith("finetune.halving_below_margin (0.1) does nothing with lr_finder: prodigy_step")
    # Bounds from the range test: each cycles or races as asked.
    assert setting_conflicts(parse_config(cyc)) == []
    assert setting_conflicts(parse_config({"finetune": {"halving_below_margin": 0.1}})) == []


def test_samples_without_validation_and_an_ema_decay_without_an_ema_are_a_warning_naming_them():
    """sampling.every_validations with validation off rendered nothing, and training.ema_decay with use_ema false
    was read by nothing, both without a word."""
    from rangefinder.config import setting_conflicts

    (line,) = setting_conflicts(parse_config({"validation": {"every_epochs": 0}, "lr": 1e-4,
                                              "sampling": {"every_validations": 3}}))
    assert line.startswith("sampling.every_validations (3) does nothing with validation.every_epochs 0")
    (line,) = setting_conflicts(parse_config({"training": {"use_ema": False, "ema_decay": 0.99}}))
    assert line.startswith("training.ema_decay (0.99) is not used: training.use_ema is false")
    assert setting_conflicts(parse_config({"validation": {"every_epochs": 0}, "lr": 1e-4,
                                           "sampling": {"every_validations": None}})) == []
    assert setting_conflicts(parse_config({"training": {"use_ema": "auto", "ema_decay": 0.99}})) == []
    assert setting_conflicts(parse_config({"sampling": {"every_validations": 3}})) == []


def test_checkpoints_no_more_often_than_the_fine_tune_s_length_are_a_warning_that_it_delivers_its_final_weights():
    """finetune.checkpoint_every_epochs at or above finetune.epochs compiled without a word: the engine then saves
    only at the end, so the step window, still measured, has no checkpoint in it and the final weights (trained past
    it) are delivered."""
    from rangefinder.config import setting_conflicts

    for every, epochs in ((10, 6), (6, 6)):
        (line,) = setting_conflicts(parse_config({"finetune": {"epochs": epochs, "checkpoint_every_epochs": every}}))
        assert line.startswith(f"finetune.checkpoint_every_epochs ({every}) is not below finetune.epochs ({epochs}): "
                               "the fine-tune saves only its final weights") and "set checkpoint_every_epochs" in line
    # A checkpoint before the end, or a one-epoch fine-tune at the default: nothing to say.
    assert setting_conflicts(parse_config({"finetune": {"epochs": 6, "checkpoint_every_epochs": 5}})) == []
    assert setting_conflicts(parse_config({"finetune": {"epochs": 1}})) == []


@pytest.mark.parametrize("sections", [
    {},
    {"training": {"method": "lora"}},  # use_ema auto keeps an EMA: finetune.average's default on does nothing
    {"training": {"optimizer": "prodigy"}},  # LR-free: lr_finder's default and AdamW's settings go unused
    {"lr": 1e-4},  # fixed: the range test's section, lr_finder and successive_halving's defaults go unused
    {"lr": 1e-4, "validation": {"every_epochs": 0}},
    {"split": {"val_dir": "/data/val"}, "validation": {"every_updates": 5}, "lr_range_test": {"zoom": False}},
    {"training": {"use_ema": False}},
], ids=["defaults", "lora", "prodigy", "fixed-lr", "no-validation", "val-dir-every-updates-no-zoom", "no-ema"])
def test_a_config_written_out_whole_is_told_only_of_what_it_changed(sections):
    """A run's whole config (every default written out, as the config.yaml MLflow keeps of it) read back was told
    that its training.prodigy section, its range test's section, AdamW's settings and others at their defaults went
    unused. A setting at its default in a section written out whole says nothing of what a person meant; a section
    at its defaults changes nothing whoever reads it."""
    from rangefinder.config import setting_conflicts

    whole = yaml.safe_dump(parse_config(sections).model_dump(mode="json"))
    assert setting_conflicts(parse_config(yaml.safe_load(whole)), "sd1") == []


def test_a_section_at_its_defaults_is_not_named_unused_but_a_changed_one_is():
    from rangefinder.config import setting_conflicts

    at_defaults = {"training": {"prodigy": {"safeguard_warmup": None}, "adam_beta1": 0.9, "optimizer": "adafactor"},
                   "lr": 1e-4, "lr_range_test": {"epochs": 10}}
    assert setting_conflicts(parse_config(at_defaults)) == []
    changed = {"training": {"prodigy": {"safeguard_warmup": True}, "optimizer": "adafactor", "adam_beta1": 0.8},
               "lr": 1e-4, "lr_range_test": {"epochs": 4}}
    lines = setting_conflicts(parse_config(changed))
    assert [ln.split(" is ")[0].split(" are ")[0] for ln in lines] == [
        "lr: 0.0001", "training.prodigy (safeguard_warmup)", "training.adam_beta1"], lines
    # Written out whole, the changed ones are still named, and only they.
    whole = parse_config(yaml.safe_load(yaml.safe_dump(parse_config(changed).model_dump(mode="json"))))
    assert setting_conflicts(whole) == lines


def _reads_of_a_path_from_the_environment():
    """(variable, its value, a call that reads it): every path a user sets outside the config and the command line."""
    from rangefinder.models.loading import hub_cache_dir
    from rangefinder.models.tiny import default_cache_dir
    from rangefinder.steps.workdir import work_dir
    from rangefinder.tracking.spool import spool_dir
    from rangefinder.tracking.target import resolve_tracking_uri
    from rangefinder.training.caching import cache_root

    home = "~rf-no-such-user/cache"
    return {"RANGEFINDER_CACHE": (home, default_cache_dir),
            "HF_HUB_CACHE": (home, lambda: hub_cache_dir(ModelConfig())),
            "HF_HOME": (home, lambda: hub_cache_dir(ModelConfig())),
            "RANGEFINDER_MLFLOW_SPOOL": (home, spool_dir),
            "RANGEFINDER_WORK": (home, lambda: work_dir(Path("artifact"), "key")),
            "MLFLOW_TRACKING_URI": ("sqlite:///~rf-no-such-user/mlflow.db", resolve_tracking_uri),
            "training.cache_dir": (None, lambda: cache_root(home))}


@pytest.mark.parametrize("variable", ["RANGEFINDER_CACHE", "HF_HUB_CACHE", "HF_HOME", "RANGEFINDER_MLFLOW_SPOOL",
                                      "RANGEFINDER_WORK", "MLFLOW_TRACKING_URI", "training.cache_dir"])
def test_a_path_from_the_environment_under_the_home_of_no_such_user_is_one_line(variable, monkeypatch):
    """`~name/...` set where the config's and the command line's checks do not look (an environment variable, or
    training.cache_dir, which a checkpoint carries from elsewhere) reached pathlib's expanduser, whose RuntimeError
    ("Could not determine home directory.") ended the command in a traceback."""
    for name in ("HF_HUB_CACHE", "HF_HOME", "RANGEFINDER_MLFLOW_SPOOL", "RANGEFINDER_WORK", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    value, read = _reads_of_a_path_from_the_environment()[variable]
    if value is not None:
        monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as e:
        read()
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"${variable}: " if value is not None else f"{variable}: ")
    assert "begins with ~rf-no-such-user, the home folder of a user this machine does not have; write ~/" in message
