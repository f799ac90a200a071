"""The model families the engine trains, by the name `family_detection.detect_family` reads from the base
model.

A new family is one module with a class providing family.Family's methods (and the classmethod `for_model`), its
rules told from the configs alone (a class in family_rules.py the family class inherits: `check_settings`,
`min_resolution`, `side_multiple_of`), one line for each here, and its family_detection.FamilyLayout (what loading,
sampling and the exports read of it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rangefinder.errors import ConfigError
from rangefinder.training.family_detection import (
    FAMILY_LAYOUTS,
    SAMPLING_GUIDANCE_REFUSAL,
    family_of,
    guidance_scale_in,
    import_named,
)

if TYPE_CHECKING:
    from rangefinder.config import RangefinderConfig, TrainingConfig
    from rangefinder.models.loading import SDComponents
    from rangefinder.training.family import Family

# family name (family_detection.detect_family) -> "module:Class"; imported only when chosen.
FAMILIES = {
    "sd1": "rangefinder.training.family:Sd1Family",
    "sdxl": "rangefinder.training.family_sdxl:SdxlFamily",
    "flux": "rangefinder.training.family_flux:FluxFamily",
    "sd3": "rangefinder.training.family_sd3:Sd3Family",
}
# family name -> its rules (family_rules.py), which FAMILIES' class inherits: what the checks before a run apply,
# without importing torch or diffusers.
FAMILY_RULES = {
    "sd1": "rangefinder.training.family_rules:Sd1Rules",
    "sdxl": "rangefinder.training.family_rules:SdxlRules",
    "flux": "rangefinder.training.family_rules:FluxRules",
    "sd3": "rangefinder.training.family_rules:Sd3Rules",
}


def family_for(sd: SDComponents, cfg: TrainingConfig) -> Family:
    """The family object of a loaded model (sd.family, as detected from the base model), with the training settings
    of its objective (a setting that means nothing for the family is a ConfigError)."""
    family: Family = family_class(sd.family).for_model(sd, cfg)
    return family


def family_class(name: str) -> Any:
    """The family class of a family name (imported now); ConfigError for one the engine does not train."""
    return import_named(_target(FAMILIES, name))


def family_rules(name: str) -> Any:
    """The rules of a family name (family_rules.py; no torch); ConfigError for one the engine does not train."""
    return import_named(_target(FAMILY_RULES, name))


def _target(registry: dict[str, str], name: str) -> str:
    target = registry.get(name)
    if target is None:
        raise ConfigError(f"model.base_model: rangefinder cannot train the {name!r} model family")
    return target


def check_family_settings(cfg: RangefinderConfig, family: str, *, native_data: bool = False) -> None:
    """ConfigError for a setting that is wrong for the base model's family: what resolve-config runs once the
    model is resolved, so that such a setting stops the run before any GPU is asked for, not when a training step
    loads the model (or, for the sampling scheduler and resolution, when the fine-tune first samples, after the LR
    discovery).

    No rule is written here: each is the one the engine applies (the family's `check_settings`, the method's
    family rule, the samples' scheduler checks, the size rules of geometry.py, textual inversion's initializer rule
    of models/tokens.py), so the two cannot drift. Reads
    the settings, the family's name and the resolved folder's (cfg.model.resolved_dir) small configs: its
    scheduler's, its denoiser's and its VAE's config.json, and for textual inversion its tokenizers' files (the
    initializer word must be one token), never weights; and imports neither torch nor diffusers
    (family_rules.py), but for a sampling.scheduler to check against diffusers' classes (the demo's is not:
    loading.KNOWN_SCHEDULERS). `native_data`: the run trains at the base model's native resolution whatever cfg.data
    says (`rangefinder train` without a data: section: training.setup.native_data_config), so the size rules judge
    that one."""
    from rangefinder.config import DataConfig
    from rangefinder.models.loading import check_scheduler_name, check_scheduler_takes
    from rangefinder.models.tokens import check_initializer_in_model
    from rangefinder.training.family_rules import check_flow_scheduler, check_method_family
    from rangefinder.training.geometry import ModelGeometry, check_sizes

    if not cfg.model.resolved_dir:  # a caller's mistake, not a person's setting
        raise ValueError("check_family_settings needs the resolved base model (model.resolved_dir)")
    rules = family_rules(family)
    layout = FAMILY_LAYOUTS[family]
    folder = Path(cfg.model.resolved_dir)
    scheduler_name = dict(layout.classes)["scheduler"].split(":")[1]  # the training scheduler models/loading.py loads
    try:
        # The file the engine's training scheduler is loaded from; the one key of it a rule reads that a file may
        # leave out has its default in the rule (family_rules.DDPM_DEFAULT_PREDICTION).
        scheduler_config: dict[str, Any] = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
        denoiser_config: dict[str, Any] = json.loads((folder / layout.denoiser / "config.json").read_text())
        vae_config: dict[str, Any] = json.loads((folder / "vae" / "config.json").read_text())
        geometry = ModelGeometry.of(rules, vae_config, denoiser_config)
    except (OSError, ValueError, KeyError, TypeError) as e:  # KeyError, TypeError: a config missing what it needs
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"model.base_model: cannot read the configs of {folder} ({reason}); pass a complete "
                          "diffusers folder") from None
    rules.check_settings(cfg.training, scheduler_config, denoiser_config)
    if cfg.sampling.guidance_scale:  # unset or 0 asks for none; and unset would import diffusers for the default
        # A scale for a model without the guidance input: the sample step would refuse it after training
        # (sampling.render_grid), where it changes nothing.
        guidance_scale_in(folder, family, cfg.sampling.guidance_scale,
                          refuse=SAMPLING_GUIDANCE_REFUSAL)
    check_method_family(cfg.training.method, family)
    if cfg.training.method == "textual_inversion":
        check_initializer_in_model(folder, cfg.training.textual_inversion.initializer_token)
    check_sizes(geometry, cfg.model_copy(update={"data": DataConfig(resolution=geometry.native)}) if native_data
                else cfg)
    check_scheduler_name(cfg.sampling.scheduler)
    if cfg.sampling.scheduler is not None:
        check_flow_scheduler(scheduler_name, cfg.sampling.scheduler)
        check_scheduler_takes(family, cfg.sampling.scheduler)


def objective_settings_used(cfg: RangefinderConfig, family: str) -> dict[str, Any]:
    """What the training objective's unset settings resolve to on the base model (its family rules'
    `settings_used`: a flow model's shift and Flux's training guidance), read from the small configs of its folder
    when it can be read here (the resolved folder, a local one, the embedded model); {} otherwise, or where they
    cannot be read (the checks before a run say why). For the MLflow params beside the settings."""
    from rangefinder.models.loading import local_model_folder

    folder = local_model_folder(cfg.model)
    if folder is None:
        return {}
    layout = FAMILY_LAYOUTS[family]
    try:
        scheduler_config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
        denoiser_config = json.loads((folder / layout.denoiser / "config.json").read_text())
        used: dict[str, Any] = family_rules(family).settings_used(cfg.training.flow, scheduler_config,
                                                                   denoiser_config)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    return used


def check_pipeline_settings(cfg: RangefinderConfig) -> None:
    """What `compile` and `run --local` check before the pipeline starts: the config's own rules for a pipeline run
    (config.check_pipeline_config) with the base model's family where it is known here, the fine-tune's validations
    (planning.check_finetune_validations), then that family's (check_local_model_settings)."""
    from rangefinder.config import check_pipeline_config
    from rangefinder.planning import check_finetune_validations

    cfg = cfg.unresolved()  # the pipeline's first step resolves model.base_model afresh: these checks read that model
    family = family_of(cfg.model)
    check_pipeline_config(cfg, family)
    check_finetune_validations(cfg)
    _check_local_model(cfg, family, native_data=False)


def check_local_model_settings(cfg: RangefinderConfig, *, native_data: bool = False) -> None:
    """check_family_settings before anything is fetched, for a base model that can be read here as it is
    (models.loading.local_model_folder: a local diffusers folder, the embedded model, a resolved folder): what
    `compile`, `run --local` (check_pipeline_settings) and `train` run first, so that a setting wrong for the family
    stops them at once, not at the pipeline's first step on the cluster, nor once a training step has loaded the
    weights. A single file's family is read off its tensor names (family_detection.family_of) but its configs only
    once it is converted: the method's rule, told from the family's name alone, applies to it then; so it does to a
    hub id, whose family is read off its model_index.json alone (models.loading.hub_family: from the cache, else
    that one file fetched), before its weights are downloaded. `native_data`: as for check_family_settings."""
    from rangefinder.models.loading import hub_family

    _check_local_model(cfg, family_of(cfg.model) or hub_family(cfg.model), native_data=native_data)


def _check_local_model(cfg: RangefinderConfig, family: Optional[str], *, native_data: bool) -> None:
    from rangefinder.models.loading import local_model_folder
    from rangefinder.training.family_rules import check_method_family

    if family is None:
        return
    folder = local_model_folder(cfg.model)
    if folder is None:
        check_method_family(cfg.training.method, family)
        return
    model = cfg.model.model_copy(update={"resolved_dir": str(folder)})
    check_family_settings(cfg.model_copy(update={"model": model}), family, native_data=native_data)
