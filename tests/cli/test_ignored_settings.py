"""Issue 37: a command given a config uses each setting in it or says, in one line, which it does not use; where not
using one would give a wrong answer without a word, it refuses instead. Through the real CLI, on real config files:
each command runs in a process of its own in this file (train and its warning, compile and its warning, run --local,
and compile of the shipped example, whose stderr must hold no warning at all, Python's at import included; a refused
compile's one line in a process: tests/cli/test_bad_input.py), and the other calls go to the console script's entry
point in this process (`in_process`, tests/cli/test_bad_input.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rangefinder.cli.ignored import ignored_by_pipeline, ignored_by_submit, ignored_by_train, tracking_off_the_cluster
from rangefinder.config import RangefinderConfig, demo_config, given_settings, parse_config
from rangefinder.errors import ConfigError
from rangefinder.planning import plan
from tests.cli.test_bad_input import assert_one_line_error, in_process, rangefinder


def _config(tmp_path, sections: dict):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(sections))
    return path


def _warning(stderr: str, command: str) -> str:
    prefix = f"rangefinder: warning: ignored by `rangefinder {command}`: "
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith(prefix)]
    return line.removeprefix(prefix)


def _named(said: str) -> list[str]:
    """The settings a warning names: `a, b (why); c (why)` -> [a, b, c]."""
    return [name for part in said.split("); ") for name in part.split(" (", 1)[0].split(", ")]


def test_a_default_written_out_is_not_a_setting_given():
    """A config written out whole (as the tests and the pipeline's base_config do) sets every field; only the values
    that differ from the defaults count as given."""
    assert given_settings(parse_config(RangefinderConfig().model_dump(mode="json"))) == []
    whole_demo = parse_config(demo_config().model_dump(mode="json"))
    assert "training.lr" in given_settings(whole_demo) and "training.epochs" not in given_settings(whole_demo)
    cfg = parse_config({"training": {"lora": {"rank": 8}}, "kubernetes": {"gpu_count": 2}})
    assert given_settings(cfg) == ["training.lora.rank", "kubernetes.gpu_count"]


def test_train_names_the_pipeline_settings_it_does_not_use(tmp_path, split_dir):
    cfg = _config(tmp_path, {
        "lr": 1e-3, "split": {"seed": 7}, "data": {"resolution": 32, "dataset_dir": "/data/mine"},
        "training": {"lr": 1e-4, "batch_size": 4}, "finetune": {"epochs": 5}, "tracking": {"experiment_name": "x"},
        "kubernetes": {"gpu_count": 4}, "distributed": {"namespace": "team"},
    })
    # No budget: the run stops at once, after the warning.
    proc = rangefinder("train", "--data", str(split_dir), "--out", str(tmp_path / "run"), "--config", str(cfg))
    assert proc.returncode == 2 and "give a budget" in proc.stderr.splitlines()[-1], proc.stderr
    said = _warning(proc.stderr, "train")
    assert said.startswith("data.dataset_dir, split.seed (the split in --data is made already; `rangefinder split` "
                           "takes them as flags); finetune.epochs, lr (they apply to the pipeline: `run`, "), said
    # What train uses (training:, data.resolution) is not named.
    assert _named(said) == ["data.dataset_dir", "split.seed", "finetune.epochs", "lr", "tracking.experiment_name",
                            "kubernetes.gpu_count", "distributed.namespace"], said
    assert not (tmp_path / "run").exists()


def test_train_refuses_several_nodes_and_a_world_size_it_does_not_start(tmp_path, split_dir):
    """Trained anyway, both would be another run than the one asked for: one line each, nothing written."""
    for run, sections, words in (
        (in_process, {"distributed": {"num_nodes": 2}}, ("distributed.num_nodes is 2", "`rangefinder submit`")),
        (in_process, {"training": {"world_size": 2}}, ("training.world_size is 2", "starts 1 process(es)",
                                                       "processes_per_node: 2")),
    ):
        cfg = _config(tmp_path, sections)
        proc = run("train", "--data", str(split_dir), "--out", str(tmp_path / "run"), "--config", str(cfg),
                   "--epochs", "1")
        assert_one_line_error(proc, *words)
        assert not (tmp_path / "run").exists()


PIPELINE_CONFIG = {
    "training": {"epochs": 3, "lr": 1e-4, "schedule": "cosine", "world_size": 2, "batch_size": 2},
    "finetune": {"epochs": 4}, "kubernetes": {"gpu_count": 2}, "distributed": {"namespace": "team"},
    "data": {"dataset_dir": "/data/mine"},
}


def test_compile_names_the_training_settings_the_pipeline_sets_itself(tmp_path):
    out = tmp_path / "pipeline.yaml"
    proc = rangefinder("compile", "--config", str(_config(tmp_path, PIPELINE_CONFIG)), "--out", str(out))
    assert proc.returncode == 0 and out.is_file(), proc.stderr
    said = _warning(proc.stderr, "compile")
    assert said.startswith("training.epochs (the pipeline's runs train for lr_range_test.epochs, finetune.epochs "
                           "and retrain.epochs); training.lr, training.schedule (the pipeline's LR comes from its "
                           "range test"), said
    assert "training.world_size (the pipeline counts the processes" in said
    assert "distributed.namespace (they apply with distributed.num_nodes > 1)" in said
    # Pods, the batch, the fine-tune's epochs and the dataset are the pipeline's own: not named.
    assert _named(said) == ["training.epochs", "training.lr", "training.schedule", "training.world_size",
                            "distributed.namespace"], said


def test_a_config_copied_from_a_run_is_checked_against_the_base_model_it_names(tmp_path, tiny_sd3_dir,
                                                                               tiny_model_dir):
    """A run's config.yaml (tracking.runs.config_text, as MLflow keeps it) holds the folder that run's base model
    resolved to (model.resolved_dir). Copied from an SD3 run and given an SD 1.x model to train textual inversion on,
    compile refused it for the SD3 folder, which the new run never loads ("textual inversion is not supported on
    Stable Diffusion 3/3.5 models"); the pipeline's first step resolves the model named, and so do the checks."""
    from rangefinder.steps.resolve_config import with_resolved_base_model
    from rangefinder.tracking.runs import config_text

    earlier, _ = with_resolved_base_model(demo_config(model={"base_model": str(tiny_sd3_dir)},
                                                      sampling={"scheduler": None},
                                                      lr_range_test={"lr_min": None, "lr_max": None}))
    copied = yaml.safe_load(config_text(earlier))
    copied["model"]["base_model"] = str(tiny_model_dir)
    copied["training"]["method"] = "textual_inversion"
    out = tmp_path / "pipeline.yaml"
    proc = in_process("compile", "--config", str(_config(tmp_path, copied)), "--out", str(out))
    assert proc.returncode == 0 and out.is_file(), proc.stderr
    assert "model.resolved_dir, model.resolved_revision (each run resolves model.base_model afresh" in _warning(
        proc.stderr, "compile")


def test_a_local_run_names_the_pod_settings_and_submit_the_folder_a_uri_replaces(tmp_path):
    cfg = _config(tmp_path, {**PIPELINE_CONFIG, "distributed": {"num_nodes": 2}})
    # Several nodes are refused by a local run before any step: the warning, then the error.
    proc = rangefinder("run", "--local", "--config", str(cfg), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "distributed.num_nodes is 2" in proc.stderr.splitlines()[-1], proc.stderr
    said = _warning(proc.stderr, "run")
    assert "kubernetes.gpu_count (pod settings: they apply to `compile`, `submit` and `schedule`)" in said, said
    assert "training.epochs" in _named(said) and "distributed.num_nodes" not in _named(said)

    parsed = parse_config(PIPELINE_CONFIG)
    assert ["data.dataset_dir"] not in [names for names, _ in ignored_by_pipeline(parsed, local=True)]
    assert (["data.dataset_dir"], "--dataset-uri is imported instead") in ignored_by_submit(parsed, "s3://b/mine")
    assert ignored_by_submit(parsed, "") == ignored_by_pipeline(parsed, local=False)
    assert ignored_by_train(parse_config({"training": {"epochs": 3}})) == []


def test_the_shipped_example_config_compiles_without_a_warning(tmp_path):
    """configs/example.yaml is what the README's CI job compiles and submits, and what people copy: every setting it
    writes out is used. It once set finetune.average: on beside LoRA on SD 1.5, where training.use_ema auto keeps an
    EMA, so every compile of it began with a warning that the line did nothing."""
    example = Path(__file__).resolve().parents[2] / "configs" / "example.yaml"
    out = tmp_path / "pipeline.yaml"
    proc = rangefinder("compile", "--config", str(example), "--out", str(out))
    assert proc.returncode == 0 and out.is_file(), proc.stderr
    assert "warning" not in proc.stderr, proc.stderr


def test_the_pipeline_refuses_validation_off_when_the_range_test_measures_the_lr(tmp_path):
    """validation.every_epochs: 0 compiled without a word, and the pipeline failed at its range-test step, after the
    data were imported and the base model resolved. `train` keeps running without validation (a plain run)."""
    from rangefinder.steps.resolve_config import config_from_parameters

    out = tmp_path / "pipeline.yaml"
    proc = in_process("compile", "--config", str(_config(tmp_path, {"validation": {"every_epochs": 0}})),
                      "--out", str(out))
    assert_one_line_error(proc, "validation.every_epochs: 0", "the LR range test measures validation loss",
                          "lr_range_test.validate_every_updates")
    assert not out.exists()
    with pytest.raises(ConfigError, match="the LR range test measures validation loss"):
        config_from_parameters(json.dumps({"validation": {"every_epochs": 0}}))
    # What the range test needs is there, or no LR is discovered: it compiles.
    for fine in ({"lr_range_test": {"validate_every_updates": 5}}, {"lr": 1e-4}, {"lr_finder": "prodigy_step"},
                 {"training": {"optimizer": "prodigy"}}):
        proc = in_process("compile", "--config", str(_config(tmp_path, {"validation": {"every_epochs": 0}, **fine})),
                          "--out", str(out))
        assert proc.returncode == 0 and out.is_file(), (fine, proc.stderr)
    assert not parse_config({"validation": {"every_epochs": 0}}).validation.enabled()  # `train` reads it as given
    # lr_finder auto measures full fine-tuning on SD3 with Prodigy's step size: no range test to refuse there, nor
    # before the family is known (a hub id not fetched); textual inversion's is a range test on every family.
    from rangefinder.config import check_pipeline_config

    off = {"validation": {"every_epochs": 0}}
    check_pipeline_config(parse_config(off), "sd3")
    check_pipeline_config(parse_config(off), None)
    with pytest.raises(ConfigError, match="the LR range test measures validation loss"):
        check_pipeline_config(parse_config({**off, "training": {"method": "textual_inversion"}}), None)
    with pytest.raises(ConfigError, match="the LR range test measures validation loss"):
        check_pipeline_config(parse_config(off), "sd1")


def test_an_lr_free_optimizer_s_own_lr_is_not_a_setting_given(tmp_path):
    """`training: {optimizer: prodigy}` alone warned that training.lr, never written, was ignored: the migration fills
    in the LR-free optimizer's lr (1.0), which then counted as given. A written lr is still named."""
    assert given_settings(parse_config({"training": {"optimizer": "prodigy"}})) == ["training.optimizer"]
    out = tmp_path / "pipeline.yaml"
    proc = in_process("compile", "--config", str(_config(tmp_path, {"training": {"optimizer": "prodigy"}})),
                      "--out", str(out))
    assert proc.returncode == 0 and out.is_file() and "warning" not in proc.stderr, proc.stderr
    proc = in_process("compile", "--config", str(_config(tmp_path, {"training": {"optimizer": "prodigy", "lr": 0.5}})),
                      "--out", str(out))
    assert _named(_warning(proc.stderr, "compile")) == ["training.lr"]


def test_the_pipeline_refuses_a_range_test_validated_only_at_its_ends(tmp_path):
    """validation.every_epochs at or above lr_range_test.epochs compiled, and the range test trained its whole sweep
    before analysis.lr_bounds refused its 2 points (it needs 3)."""
    from rangefinder.config import check_pipeline_config
    from rangefinder.planning import planned_validations

    out = tmp_path / "pipeline.yaml"
    for every in (10, 100):
        proc = in_process("compile", "--config", str(_config(tmp_path, {"validation": {"every_epochs": every}})),
                          "--out", str(out))
        assert_one_line_error(proc, f"validation.every_epochs ({every}) is not below lr_range_test.epochs (10)",
                              "at least 3 points")
        assert not out.exists()
    # Just below: the sweep's start, one boundary and its end, 3 points (as the engine plans them).
    cfg = parse_config({"validation": {"every_epochs": 9.5}})
    check_pipeline_config(cfg)
    assert planned_validations(plan(16, val_split=0.2, epochs=10), cfg.validation) == 3
    for fine in ({"lr_range_test": {"validate_every_updates": 5}}, {"lr": 1e-4}, {"validation": {"every_updates": 3}}):
        check_pipeline_config(parse_config({"validation": {"every_epochs": 10}, **fine}))


def test_the_pipeline_refuses_a_fine_tune_validated_only_at_its_ends(tmp_path):
    """A 1-epoch fine-tune validated every epoch (or every 2 epochs of 2) compiled, and the fine-tune trained to its
    end before the step window refused its 2 validations (it needs 3 updates). Refused when the pipeline is compiled
    or resolved, with a fixed LR too (no range test runs, the step window still does), counted as the engine plans
    its validations (planning.planned_validations)."""
    from rangefinder.config import demo_run_config
    from rangefinder.steps.resolve_config import config_from_parameters
    from rangefinder.training.families import check_pipeline_settings

    out = tmp_path / "pipeline.yaml"
    proc = in_process("compile", "--config", str(_config(tmp_path, {"lr": 1e-4, "finetune": {"epochs": 1}})),
                      "--out", str(out))
    assert_one_line_error(proc, "validation.every_epochs: 1 with finetune.epochs: 1 validates the fine-tune only at "
                          "its start and end", "needs validations at 3 or more updates",
                          "set validation.every_epochs below 1 (e.g. 0.5) or raise finetune.epochs")
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"every_epochs: 2 with finetune.epochs \(pipeline parameter "
                                          r"finetune_epochs\): 2 validates the fine-tune only at its start and end"):
        config_from_parameters(json.dumps({"validation": {"every_epochs": 2}}), finetune_epochs=2)
    for sections in ({"finetune": {"epochs": 1}, "lr_finder": "prodigy_step"},
                     {"finetune": {"epochs": 4}, "validation": {"every_epochs": 4.5},
                      "lr_range_test": {"validate_every_updates": 2}}):
        with pytest.raises(ConfigError, match="validates the fine-tune only at its start and end"):
            check_pipeline_settings(parse_config(sections))
    # One more validation inside the run is enough; without validation there is no window to read (the fine-tune keeps
    # its epochs); every_updates needs the data's size, so the steps check it with their plan.
    for sections in ({"finetune": {"epochs": 2}}, {"finetune": {"epochs": 1}, "validation": {"every_epochs": 0.5}},
                     {"lr": 1e-4, "finetune": {"epochs": 1}, "split": {"val_split": 0}},
                     {"lr": 1e-4, "finetune": {"epochs": 1}, "validation": {"every_epochs": 0}},
                     {"finetune": {"epochs": 1}, "validation": {"every_updates": 1000}}):
        check_pipeline_settings(parse_config(sections))
        config_from_parameters(json.dumps(sections), finetune_epochs=parse_config(sections).finetune.epochs)
    from rangefinder.planning import check_finetune_validations, planned_validations

    assert planned_validations(plan(16, val_split=0.2, epochs=2), parse_config({}).validation) == 3
    # The embedded default, the demo's run and the test and bench settings built on demo_config pass.
    for cfg in (RangefinderConfig(), demo_config(), demo_run_config(), demo_config(finetune={"epochs": 2})):
        check_finetune_validations(cfg)


def test_compile_names_each_path_the_clusters_pods_cannot_read(tmp_path):
    """A config written for `run --local` compiled without a word with the dataset on this machine's disk, and the
    run failed on the cluster, where the pods mount only the data volume."""
    cfg = _config(tmp_path, {"data": {"dataset_dir": str(tmp_path / "my data")},
                             "split": {"val_dir": "held-out"},
                             "model": {"base_model": "/home/me/sd15.safetensors",
                                       "single_file_config": "/data/models/sd15-config"},
                             "tracking": {"tracking_uri": "sqlite:///mlflow.db"}})
    proc = in_process("compile", "--config", str(cfg), "--out", str(tmp_path / "p.yaml"))
    assert proc.returncode == 0, proc.stderr
    lines = [ln.removeprefix("rangefinder: warning: ") for ln in proc.stderr.splitlines()]
    volume = (", and the pipeline's pods mount only the data volume (rangefinder-data) at /data: unless the step "
              "images hold it, the run will not find it there; copy it onto the volume and give its path under /data")
    outside = "is not under kubernetes.data_mount_path (/data)"
    assert lines == [
        f"data.dataset_dir {tmp_path / 'my data'} {outside}{volume} (or import it: `rangefinder submit --dataset-uri`)",
        f"split.val_dir held-out is a relative path, read from a pod's own working folder{volume}",
        f"model.base_model /home/me/sd15.safetensors {outside}{volume}",
        # The config's MLflow store wins over the one the pods are given: a laptop's went into every pod's own files.
        "tracking.tracking_uri sqlite:///mlflow.db names a store outside the data volume (/data), in each pod's own "
        "files, lost when the pod ends: in the pipeline's pods it replaces kubernetes.mlflow_tracking_uri "
        "(http://mlflow.rangefinder.svc.cluster.local:5000) and the MLflow Secret's, so each step's records and the "
        "registered model would not reach the cluster's MLflow; leave tracking.tracking_uri out of the cluster's "
        "config",
    ]
    (loopback,) = tracking_off_the_cluster(parse_config({"tracking": {"tracking_uri": "http://127.0.0.1:5000"}}))
    assert loopback.startswith("tracking.tracking_uri http://127.0.0.1:5000 names 127.0.0.1, which in a pod is the "
                               "pod itself")
    # MLflow's own name of a Databricks workspace, no path: the pods reach it as this machine does.
    assert tracking_off_the_cluster(parse_config({"tracking": {"tracking_uri": "databricks"}})) == []
    # Under the mount, a hub id, or no data volume at all (the image's own paths): nothing to say.
    for sections in ({"data": {"dataset_dir": "/data/datasets/mine/"}, "model": {"base_model": "org/name"},
                      "tracking": {"tracking_uri": "sqlite:////data/mlflow.db"}},
                     {"data": {"dataset_dir": "/srv/mine"}, "kubernetes": {"data_pvc": None}}):
        proc = in_process("compile", "--config", str(_config(tmp_path, sections)), "--out", str(tmp_path / "p.yaml"))
        assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
