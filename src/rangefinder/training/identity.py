"""Which run a checkpoint belongs to, and the check a resume makes: a resume continues only the run it finds.

A checkpoint records what shapes the run's curve (checkpointing.save_checkpoint writes `run_identity` into its
state.json): the data (a digest of every image's sha256 and caption, by subset), the base model (its weights'
digest), the training settings, the validation settings, the data settings (resolution, crop, buckets) and what it
trains on. A resume whose run differs in any of them is refused with one error naming each difference; only the
settings in RESUMABLE_CHANGES may change (they change how the run is carried out or recorded, not what it
computes), and what the spec holds outside these (sampling, tracking) is not part of the run's identity. A branch
(TrainSpec.branch: the fine-tune's cooldown, continuing a copy of one of the run's checkpoints) may also change
BRANCH_CHANGES, the schedule and the length, if every update the checkpoint took had the same LR under both.
docs/security.md and the README ("A resume continues only its own run") list both.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING, Any, Optional

from rangefinder.config import FAMILY_NAMES, DataConfig, TrainingConfig, ValidationConfig, migrate_training
from rangefinder.errors import ConfigError

if TYPE_CHECKING:
    from rangefinder.training.run import Run, RunSettings

# training.* settings a resume may change: they do not change what the run computes (compile: the same maths, other
# kernels; processes_per_node: the number of processes, world_size, is compared, and it may not change, because each
# process's RNG state is saved per rank).
RESUMABLE_CHANGES = frozenset({"resume", "checkpoint_every_updates", "keep_checkpoints", "cache_dir", "compile",
                               "processes_per_node"})
# training.* settings a branch (TrainSpec.branch) may change too: the schedule and the length, as long as every update
# before the checkpoint had the same LR (_same_lr_so_far).
BRANCH_CHANGES = frozenset({"schedule", "decay_fraction", "lr_min", "lr_max", "warmup_updates", "epochs", "steps"})
# data.* settings that only choose which files the split takes (read when splitting, not when training).
_SPLIT_ONLY = frozenset({"dataset_dir", "min_image_size", "min_images"})


def data_digest(settings: RunSettings) -> str:
    """sha256 over each subset's images (their sha256, which the run already computed to check the split) and
    captions, in the run's order: another dataset of the same size, or one caption changed, gives another digest."""
    subsets = {"train": settings.train_items, **settings.val_items}
    listing = {name: [[settings.file_hashes[it.id], it.text] for it in items] for name, items in subsets.items()}
    return hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()


def run_identity(run: Run) -> dict[str, Any]:
    """What state.json records of the run beside its settings (`training`), for `check_same_run`."""
    return {
        "data_digest": data_digest(run.settings),
        "model_digest": run.sd.digest,
        "base_model": run.sd.source,
        "validation": run.val_cfg.model_dump(mode="json"),
        "data": _data_settings(run.data.data_cfg),
        "train_on": run.settings.train_on,
        # What the denoiser is trained to predict (epsilon, v_prediction: the base model's scheduler, or
        # training.prediction_type), which the same weights under an edited scheduler config change; None for the
        # flow families, which predict the velocity whatever the config.
        "prediction_type": getattr(run.family, "prediction_type", None),
        # The flow families' shift of the sigmas they draw and validate at: training.flow.shift, else the base
        # model's scheduler config's (a constant, or Flux's resolution-dependent constants), which the same weights
        # under an edited config change; None for the DDPM families.
        "sigma_shift": _sigma_shift(run.family),
    }


def _sigma_shift(family: Any) -> Any:
    """The flow family's shift as its objective applies it (family_flow.FlowFamily.shift_sigmas): Flux's
    resolution-dependent constants where it has them, else the constant shift; None for a DDPM family."""
    dynamic = getattr(family, "dynamic_shift", None)
    return dynamic if dynamic is not None else getattr(family, "shift", None)


def _data_settings(data: DataConfig) -> dict[str, Any]:
    return {k: v for k, v in data.model_dump(mode="json").items() if k not in _SPLIT_ONLY}


def check_same_run(saved: dict[str, Any], run: Run, train_buckets: Optional[dict[str, int]]) -> None:
    """ConfigError naming every way `run` differs from the run that wrote the checkpoint state `saved`. A checkpoint
    from before an item was recorded is not checked for that item; a setting newer than the checkpoint counts as its
    default (the run trained as that default does)."""
    root = run.settings.ckpt_root
    family = saved.get("family", "sd1")  # checkpoints from before families were recorded: SD 1.x/2.x
    if family != run.family.name:
        was, is_ = FAMILY_NAMES.get(family, family), FAMILY_NAMES.get(run.family.name, run.family.name)
        raise ConfigError(
            f"cannot resume: the checkpoint under {root} is from a {was} run but the base model "
            f"{run.sd.source} is {is_}; resume with the base model the run started from, or start in an empty folder"
        )
    identity = saved.get("identity", {})
    now = run_identity(run)
    diffs: list[str] = []
    if identity.get("model_digest") not in (None, now["model_digest"]):
        diffs.append(f"the base model (it started from {identity.get('base_model')}, this is {run.sd.source}, "
                     "whose weights differ)")
    same_size = saved["train_images"] == len(run.settings.train_items)
    if identity.get("data_digest") not in (None, now["data_digest"]) or not same_size:
        sizes = "" if same_size else f": {saved['train_images']} training images, now {len(run.settings.train_items)}"
        diffs.append(f"the data (another dataset, or images or captions changed{sizes})")
    if identity.get("prediction_type") not in (None, now["prediction_type"]):
        diffs.append(f"what the model is trained to predict ({identity['prediction_type']} -> "
                     f"{now['prediction_type']}: the base model's scheduler config, or training.prediction_type, "
                     "says otherwise now)")
    # Settings as written before a rename (use_8bit_adam: training.optimizer) read as today's.
    before = migrate_training(saved["training"])
    training = run.cfg.model_dump(mode="json")
    said: frozenset[str] = frozenset()  # training.* settings whose change an item above names already
    if identity.get("sigma_shift") not in (None, now["sigma_shift"]):
        # Set by hand (training.flow.shift changed) or read off the base model's scheduler config (edited, or
        # another model's): the item names the one that moved it, and the setting is not named again below.
        was_set, set_now = (before.get("flow") or {}).get("shift"), training["flow"]["shift"]
        why = (f"training.flow.shift {_show(was_set)} -> {_show(set_now)}" if was_set != set_now else
               "the base model's scheduler config says otherwise now")
        diffs.append(f"the shift of the sigmas it trains at ({_show(identity['sigma_shift'])} -> "
                     f"{_show(now['sigma_shift'])}: {why})")
        said = frozenset({"flow.shift"})
    if identity.get("train_on") not in (None, now["train_on"]):
        diffs.append(f"what it trains on ({identity['train_on']} -> {now['train_on']})")
    branch = run.settings.branch
    diffs += _changed("training", before, training, TrainingConfig(),
                      (RESUMABLE_CHANGES | BRANCH_CHANGES if branch else RESUMABLE_CHANGES) | said)
    if branch and not diffs:
        diffs += _same_lr_so_far(before, saved, run)
    if "validation" in identity:
        diffs += _changed("validation", identity["validation"], now["validation"], ValidationConfig())
    if "data" in identity:
        diffs += _changed("data", identity["data"], now["data"], DataConfig())
    elif saved.get("train_buckets") != train_buckets:  # None both ways without bucketing
        diffs.append("the training set's aspect-ratio buckets (data.*)")
    if not diffs and not branch and saved["total_updates"] != run.settings.plan.total_updates:
        diffs.append(f"the plan ({saved['total_updates']} updates, now {run.settings.plan.total_updates})")
    if diffs:
        raise ConfigError(
            f"cannot resume: the checkpoint under {root} was written by a run with different settings or data "
            f"({'; '.join(diffs)}); resume with the settings, data and base model it started with, or start in an "
            "empty folder"
        )


def _same_lr_so_far(before: dict[str, Any], saved: dict[str, Any], run: Run) -> list[str]:
    """A branch continues the checkpoint's run only if that run's schedule and the branch's gave the same LR at every
    update before the checkpoint's: then the weights, the optimizer state and the RNG it saved are the branch's own."""
    from rangefinder.training.schedules import lr_at, make_schedule

    plan = run.settings.plan
    old = make_schedule(TrainingConfig.model_validate(before), saved["total_updates"], plan.updates_per_epoch,
                        plan.lr or run.cfg.lr)
    new = run.settings.schedule
    for u in range(int(saved["update"])):
        if not math.isclose(lr_at(old, u), lr_at(new, u), rel_tol=1e-12, abs_tol=0.0):
            return [f"the LR at update {u} ({lr_at(old, u):.4g} in the run the checkpoint is from, {lr_at(new, u):.4g} "
                    f"in this branch of it): a branch may change the schedule only after the checkpoint's update "
                    f"{saved['update']}"]
    return []


def _changed(section: str, before: dict[str, Any], now: dict[str, Any], defaults: Any,
             may_change: frozenset[str] = frozenset()) -> list[str]:
    """`section.key before -> now` for each setting that differs, leaving out `may_change` (`flow.shift`: a setting
    of a section within); within a section of settings (training.flow, training.lora), each of its own that differs:
    `training.flow.guidance null -> 1.0`, where the whole section's JSON was written twice."""
    known = defaults if isinstance(defaults, dict) else defaults.model_dump(mode="json")
    before = {**{k: known[k] for k in now if k in known and k not in before}, **before}
    keys = sorted(k for k in set(before) | set(now) if k not in may_change and before.get(k) != now.get(k))
    out: list[str] = []
    for k in keys:
        was, is_ = before.get(k), now.get(k)
        if isinstance(was, dict) and isinstance(is_, dict):
            within = frozenset(m.removeprefix(f"{k}.") for m in may_change if m.startswith(f"{k}."))
            out += _changed(f"{section}.{k}", was, is_, known.get(k) if isinstance(known.get(k), dict) else {},
                            within)
        else:
            out.append(f"{section}.{k} {_show(was)} -> {_show(is_)}")
    return out


def _show(value: Any) -> str:
    return json.dumps(value)
