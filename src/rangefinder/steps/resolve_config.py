"""Step `resolve_config`: the pipeline's typed parameters -> one validated `RangefinderConfig`.

The Kubeflow UI shows a handful of typed parameters (the ones a person changes between runs). Everything else comes
from `base_config`, the whole config as JSON (baked in at compile time by `rangefinder compile --config FILE`, or
sent by `rangefinder submit --config FILE`). The typed parameters are laid over it, so what a person types in the
UI wins. Validation happens here, in the first step, so a bad value stops the run before any GPU is asked for:
the config's own checks, then, once the base model is resolved, the settings that are wrong only for its family
(`preflight`).

The base model is resolved here too (rangefinder.models.loading): a hub id is found in the Hugging Face cache or
downloaded into it, a single file is converted to a diffusers folder, and `model.resolved_dir` in the config every
later step receives names that folder (`model.resolved_revision` the snapshot's commit, the file's sha256, or a
folder's fingerprint of its weights, models/fingerprint.py). So a missing, gated or malformed model stops the run
here, with one clear error, and the model is fetched once per pipeline run, not once per step.

Strings and numbers cannot be None in the KFP UI, so an empty string or 0 means "unset" for the parameters below
whose config field is Optional (dataset_dir, base_model, fixed_lr, retrain_epochs, mlflow_ui_url, and lr_min/lr_max,
whose unset value means the method's default sweep).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rangefinder.config import (
    FAMILY_NAMES,
    RangefinderConfig,
    _deep_merge,
    check_pipeline_config,
    parse_config,
    setting_conflicts,
)
from rangefinder.errors import ConfigError
from rangefinder.formats.text import markdown_code, markdown_text, warn
from rangefinder.formats.weights_file import FOLDER_REVISION_PREFIX
from rangefinder.planning import check_finetune_validations
from rangefinder.steps.kept_settings import keeps_mlflow_settings
from rangefinder.training.family_detection import family_of

# Pipeline parameter -> dotted config field. The order is the order the UI lists them in.
PARAMETER_FIELDS: dict[str, str] = {
    "dataset_dir": "data.dataset_dir",
    "base_model": "model.base_model",
    "base_model_revision": "model.revision",
    "method": "training.method",
    "lr_finder": "lr_finder",
    "resolution": "data.resolution",
    "batch_size": "training.batch_size",
    "grad_accum": "training.grad_accum",
    "ramp": "lr_range_test.ramp",
    "lr_min": "lr_range_test.lr_min",
    "lr_max": "lr_range_test.lr_max",
    "range_test_epochs": "lr_range_test.epochs",
    "finetune_epochs": "finetune.epochs",
    "val_split": "split.val_split",
    "split_seed": "split.seed",
    "seed": "training.seed",
    "fixed_lr": "lr",
    "retrain": "retrain.enabled",
    "retrain_epochs": "retrain.epochs",
    "prompts": "sampling.prompts",
    "mlflow_experiment": "tracking.experiment_name",
    "mlflow_ui_url": "tracking.ui_url",
}

# Parameters whose config field is Optional: the UI's "empty" value stands for None.
_UNSET: dict[str, Any] = {"dataset_dir": "", "base_model": "", "base_model_revision": "", "fixed_lr": 0.0,
                          "retrain_epochs": 0, "lr_min": 0.0, "lr_max": 0.0, "mlflow_ui_url": ""}


def _get(cfg: RangefinderConfig, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _nested(dotted: str, value: Any) -> dict:
    out: dict = {}
    cur = out
    parts = dotted.split(".")
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value
    return out


def base_config_json(cfg: RangefinderConfig) -> str:
    """The config as the `base_config` parameter carries it. Kubernetes settings are compiled into the pipeline
    itself (they shape the pods), so they are left out, and so is a resolved model folder and revision (each run
    resolves its own)."""
    return cfg.model_dump_json(exclude={"kubernetes": True, "model": {"resolved_dir", "resolved_revision"}})


def parameters_from_config(cfg: RangefinderConfig, dataset_uri: str = "") -> dict[str, Any]:
    """The pipeline arguments that reproduce `cfg` (used for compile-time defaults, submit and local runs)."""
    params: dict[str, Any] = {"dataset_uri": dataset_uri}
    for name, dotted in PARAMETER_FIELDS.items():
        value = _get(cfg, dotted)
        params[name] = _UNSET[name] if value is None and name in _UNSET else value
    params["prompts"] = list(params["prompts"])
    params["base_config"] = base_config_json(cfg)
    return params


def parameter_defaults() -> dict[str, Any]:
    """The typed parameters' defaults: the default config's values, as the published pipeline's parameters and
    resolve-config's inputs have them (one source, the config model)."""
    params = parameters_from_config(RangefinderConfig())
    del params["dataset_uri"], params["base_config"]
    return params


def defaults_replacing_base_config(base_config: str, params: Mapping[str, Any]) -> Optional[str]:
    """A warning naming the typed parameters that are at their default yet replace another value base_config sets,
    or None. resolve-config loaded into someone's pipeline defaults every one of them, so a whole config passed as
    base_config alone would otherwise lose each of its typed fields to the default without a word."""
    if not (base_config and base_config.strip()):
        return None
    try:
        base = parameters_from_config(config_from_parameters(base_config))
    except ConfigError:
        return None  # base_config's own fault is reported with the parameters laid over it
    defaults = parameter_defaults()
    replaced = [f"{name} {value!r} (base_config's {PARAMETER_FIELDS[name]}: {base[name]!r})"
                for name, value in params.items() if name in defaults and value == defaults[name] != base[name]]
    if not replaced:
        return None
    return (f"pipeline parameter(s) at their default replace what base_config sets: {'; '.join(replaced)}; pass "
            "each with base_config's value to keep it")


def form_conflicts(base_config: str, params: Mapping[str, Any], family: str, run_cfg: RangefinderConfig) -> list[str]:
    """The settings the run leaves unused (retrain_epochs with the retrain off, the range test's ramp and bounds with
    a fixed LR, ...), in the lines `rangefinder run`, `compile` and `submit` warn with (config.setting_conflicts), for
    the resolved base model's `family`. The run form sends every parameter, each at its default unless a person typed
    another value, so a parameter counts as given where it is not at its default or replaces what base_config sets:
    the config read so holds the same values as the run's, and only what a person gave (a fixed LR typed in the form
    did not make lr_finder auto, its default, a setting left unused). `run_cfg`: the run's config as `params` give
    it (config_from_parameters), which stands where reading only what was given changes a value."""
    defaults = parameter_defaults()
    base = json.loads(base_config) if base_config and base_config.strip() else {}

    def in_base(dotted: str) -> bool:
        section: Any = base
        for part in dotted.split("."):
            if not isinstance(section, dict) or part not in section:
                return False
            section = section[part]
        return True

    given = {name: value for name, value in params.items()
             if name not in defaults or value != defaults[name] or in_base(PARAMETER_FIELDS[name])}
    as_given = config_from_parameters(base_config, **given)
    if as_given.model_dump() != run_cfg.model_dump():
        as_given = run_cfg  # a default read otherwise: the run's own config
    return [naming_parameters(line) for line in setting_conflicts(as_given, family)]


# What KFP's importer downloads from (its launcher's object store: gs, s3, minio); the dataset_uri parameter's
# description and --dataset-uri's help name them.
DATASET_URI_SCHEMES = ("s3", "gs", "minio")


def check_dataset_uri(uri: str, name: str, folder_fix: str) -> None:
    """ConfigError unless `uri` (the parameter or flag `name`) is empty or an object-store URI without credentials.
    A folder's path there made a run whose importer failed in KFP's own words; credentials are named, never shown.
    `folder_fix`: where a folder's path goes instead."""
    from rangefinder.config import uri_credentials

    if not uri:
        return
    held = uri_credentials(uri)
    if held:
        raise ConfigError(f"{name} holds {held}, which the run's parameters would show; give the URI alone "
                          "(s3://bucket/prefix): the pods read the object store's keys from KFP's own Secret")
    scheme = uri.partition("://")[0] if "://" in uri else ""
    if scheme not in DATASET_URI_SCHEMES:
        schemes = ", ".join(f"{s}://" for s in DATASET_URI_SCHEMES)
        raise ConfigError(f"{name} {uri!r} is not an object-store URI ({schemes}), which KFP's importer downloads; "
                          f"for a folder on the data volume {folder_fix}")


def config_from_parameters(base_config: str = "", **params: Any) -> RangefinderConfig:
    """Lay the typed parameters over `base_config` and validate; ConfigError names the parameter at fault."""
    unknown = sorted(set(params) - set(PARAMETER_FIELDS) - {"dataset_uri"})
    if unknown:
        raise ConfigError(f"unknown pipeline parameter(s) {', '.join(unknown)}; known: {', '.join(PARAMETER_FIELDS)}")
    raw: dict = {}
    if base_config and base_config.strip():
        try:
            raw = json.loads(base_config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"pipeline parameter base_config is not valid JSON ({e}); leave it empty or paste "
                              "the output of `rangefinder compile --config FILE` defaults") from None
        if not isinstance(raw, dict):
            raise ConfigError("pipeline parameter base_config must be a JSON object of sections (data, training, ...)")
        raw.pop("kubernetes", None)
    for name, value in params.items():
        if name == "dataset_uri":
            continue
        if name in _UNSET and value == _UNSET[name]:
            value = None
        raw = _deep_merge(raw, _nested(PARAMETER_FIELDS[name], value))
    try:
        # A base_config copied from an earlier run's config_json holds the folder and revision its base model resolved
        # to: this run resolves its own, and its checks and its parent run's record are of that one, not of them.
        cfg = parse_config(raw).unresolved()
        check_pipeline_config(cfg, family_of(cfg.model))  # a hub id not fetched yet: again once it is, below
        check_finetune_validations(cfg)  # every_epochs here; every_updates, which needs the data's size, in the steps
        return cfg
    except ConfigError as e:
        raise ConfigError(naming_parameters(str(e))) from None


def naming_parameters(line: str) -> str:
    """`line` (an error or a warning) with the pipeline parameter a person typed named beside the config field behind
    it: `lr (pipeline parameter fixed_lr): ...`. A field is named where it starts a clause (`field:`), not inside a
    longer name (`training.lr:` is not the top-level lr)."""
    for name, dotted in PARAMETER_FIELDS.items():
        line = re.sub(rf"(?<![\w.]){re.escape(dotted)}:", f"{dotted} (pipeline parameter {name}):", line)
    return line


@dataclass(frozen=True)
class ResolvedConfig:
    config_json: str  # the whole validated config, handed to every later step
    fixed_lr: float  # 0.0: discover the LR (the DAG's condition needs a number, not None)
    lr_finder: str  # how discovery measures it: range_test or prodigy_step (auto resolved for the model and method)
    retrain: bool
    mlflow_parent_run_id: str  # "" when tracking is off


@keeps_mlflow_settings
def run_resolve_config(base_config: str = "", *, pipeline_job_id: str = "", pipeline_job_name: str = "",
                       report_path: Optional[Path] = None, **params: Any) -> ResolvedConfig:
    """The run form's parameters resolved into the run's config (ResolvedConfig); `report_path`: where the Markdown
    report of what the run resolved to goes (resolved_report), once every check has passed."""
    # The run form's dataset_uri, which the importer reads after this step: a folder's path typed there failed in
    # the importer, in KFP's words, and a URI with a password went on to it.
    check_dataset_uri(params.get("dataset_uri") or "", "pipeline parameter dataset_uri",
                      "give its path as dataset_dir and leave dataset_uri empty")
    cfg = asked = config_from_parameters(base_config, **params)
    replaced = defaults_replacing_base_config(base_config, params)
    warnings = [replaced] if replaced else []
    warn(warnings)
    # The parent run first: a tracking server that does not answer stops the run before a model download.
    parent = start_parent_run(cfg, pipeline_job_id, pipeline_job_name) if pipeline_job_id else ""
    cfg, family = with_resolved_base_model(cfg)
    if parent:
        from rangefinder import tracking

        tracking.log_resolved_config(cfg, parent)  # model.resolved_dir and resolved_revision, known now
    preflight(cfg, family)
    check_pipeline_config(cfg, family)  # lr_finder auto, resolved: the range test's needs on this family
    # The settings this run leaves unused, as the CLI warns of them: typed into the run form, they were dropped
    # without a word; and what the CLI could not tell before the model was fetched (a hub id's family).
    conflicts = form_conflicts(base_config, params, family, asked)
    warn(conflicts)
    if report_path is not None:
        from rangefinder.formats.atomic import write_text

        write_text(report_path, resolved_report(cfg, family, warnings + conflicts))
    return ResolvedConfig(
        config_json=cfg.model_dump_json(),
        fixed_lr=float(cfg.pipeline_lr() or 0.0),  # an LR-free optimizer skips discovery too
        # Resolved here, at run time, so auto follows the base model and the method a person sets in the UI.
        lr_finder=cfg.lr_finder_for(family),
        retrain=bool(cfg.retrain.enabled),
        mlflow_parent_run_id=parent,
    )


def resolved_report(cfg: RangefinderConfig, family: str, warnings: list[str]) -> str:
    """What the run resolved to, in Markdown (resolve-config's `report`, which the KFP UI shows): the base model as
    given and the folder and revision it resolved to, its family, the method, how the LR will be found (the fixed LR,
    an LR-free optimizer's, or lr_finder as set and as resolved), the retrain, and the `warnings` in the log's words
    (each naming the run-form parameter). User text is shown as text, never as markup; a secret in it as ***."""
    from rangefinder.redaction import redact
    from rangefinder.steps.choose_lr import finder_words, skipped_because

    model = cfg.model
    given = markdown_code(redact(model.base_model)) if model.base_model else "empty: the embedded tiny model"
    revision = markdown_code(model.resolved_revision) if model.resolved_revision else "none"
    if (model.resolved_revision or "").startswith(FOLDER_REVISION_PREFIX):
        revision += " (a fingerprint of the folder's weights and configs)"
    if cfg.lr is not None:
        lr = f"fixed by hand at {cfg.lr:g}; discovery skipped (lr_finder {cfg.lr_finder} has nothing to measure)"
    else:
        lr = skipped_because(cfg) or f"discovered ({finder_words(cfg, family)})"
    retrain = "off"
    if cfg.retrain.enabled:
        retrain = (f"on, {cfg.retrain.epochs} epochs" if cfg.retrain.epochs else
                   "on, for the epochs the fine-tune recommends")
    lines = ["# Resolved config", "", f"- base model: {given}",
             f"- resolved to: {markdown_code(redact(model.resolved_dir or ''))}, revision {revision}",
             f"- family: {FAMILY_NAMES[family]}", f"- method: {cfg.training.method}",
             f"- learning rate: {markdown_text(lr)}", f"- retrain: {retrain}",
             f"- warnings: {len(warnings) or 'none'}"]
    lines += [f"  - {markdown_text(line)}" for line in warnings]
    return "\n".join(lines) + "\n"


def with_resolved_base_model(cfg: RangefinderConfig) -> tuple[RangefinderConfig, str]:
    """`cfg` with `model.resolved_dir` set to the local diffusers folder of `model.base_model` (downloaded or
    converted now, once) and `model.resolved_revision` to what it resolved to (a hub snapshot's commit, a single file's
    sha256, a folder's fingerprint of its weights); and the model's family. ConfigError when the model cannot be had.
    A resolved_dir already in the config (a base_config copied from an earlier run's) is ignored: this run resolves
    its own. No setting is changed: an unset `sampling.guidance_scale` stays unset, and each step that samples reads
    the model's own off its family (family_detection.guidance_scale_for; the runs' param
    sampling.guidance_scale_used), so that a config copied from this run and given another base model samples that
    one at its own. A hub model's family is read off its model_index.json alone first, so that a method it cannot
    train (textual inversion on SD3 or Flux) is refused before its weights are downloaded; the rest of its rules once
    it is here (preflight)."""
    from rangefinder.models.loading import hub_family, resolve_base_model
    from rangefinder.training.family_rules import check_method_family

    model = cfg.unresolved().model
    before_download = hub_family(model)
    if before_download is not None:
        check_method_family(cfg.training.method, before_download)
    resolved = resolve_base_model(model)
    family = resolved.family
    print(f"base model: {resolved.source} -> {resolved.path} ({FAMILY_NAMES[family]})")
    return cfg.model_copy(update={"model": model.model_copy(update={"resolved_dir": str(resolved.path),
                                                                    "resolved_revision": resolved.revision})}), family


def preflight(cfg: RangefinderConfig, family: str) -> None:
    """ConfigError for a setting wrong only for the resolved base model's family (a DDPM setting on a flow-matching
    model, a DDPM sampling scheduler on one, a method the family cannot train), with the engine's own rules
    (training.families.check_family_settings): the engine meets them only when a training step loads the model, the
    sampling scheduler only when the fine-tune first samples, after the whole LR discovery has trained. `family`:
    the one read off the resolved folder (with_resolved_base_model)."""
    from rangefinder.training.families import check_family_settings

    check_family_settings(cfg, family)


def start_parent_run(cfg: RangefinderConfig, pipeline_job_id: str, pipeline_job_name: str = "") -> str:
    """The MLflow run every step of this pipeline run logs under (found or made by the KFP run id); its id.

    Named after the KFP run (its name when KFP gives one) so the two are easy to match in the UIs."""
    from rangefinder import tracking

    return tracking.ensure_parent_run(cfg, name=pipeline_job_name or f"rangefinder-{pipeline_job_id}",
                                      kfp_run_id=pipeline_job_id, kfp_run_name=pipeline_job_name or None)


def load_step_config(config_json: str) -> RangefinderConfig:
    """What every later step calls on its `config_json` parameter."""
    try:
        raw = json.loads(config_json)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config_json is not valid JSON ({e}); it should come from the resolve-config step") from None
    return parse_config(raw)
