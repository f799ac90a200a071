"""The run as a value: what one training run trains (`TrainSpec`) and what it gave (`TrainResult`).

Torch-free, so the steps and the launchers hold a run's request and its answer with their types (importing this
module loads no torch). Both are frozen, and both go to JSON and back (`to_json`, `from_json`): the job file of a
run on several processes is a TrainSpec's JSON, and rank 0's answer a TrainResult's.

Each training step builds its spec with one validated constructor (`TrainSpec.ramp`, `.finetune`, `.retrain`), from
the split it has already read; the constructor computes the run's plan then, once, with the same images and
aspect-ratio buckets the engine will train on, and the engine uses that plan (loop.train). A spec's LR is changed
only through `with_lr`, which validates the new settings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, Optional, Union

import numpy as np
from pydantic import TypeAdapter, ValidationError

from rangefinder.config import (
    DataConfig,
    ModelConfig,
    RangefinderConfig,
    SamplingConfig,
    TrainingConfig,
    ValidationConfig,
    format_validation_error,
)
from rangefinder.data.buckets import BucketSettings
from rangefinder.data.dataset import Item
from rangefinder.data.split import Split, place_items
from rangefinder.errors import ConfigError
from rangefinder.planning import Plan, plan_for

TrainOn = Literal["train", "train+val"]

# A value as JSON holds it (what json.loads gives back).
JSONValue = Union[None, bool, int, float, str, list["JSONValue"], dict[str, "JSONValue"]]


@dataclass(frozen=True)
class TrainSpec:
    """What one training run trains: its settings, the split it reads its images from, and the base model.

    `data` gives the resolution, crop and aspect-ratio buckets (None: the base model's native resolution, every
    image centre-cropped to a square).
    `train_on="train+val"` trains on both sets (the full-data retrain); the val set is then not measured.
    `sampling` asks for samples during training (samples.py: at the validations `every_validations` picks); None:
    none.
    `plan`: the run's batch arithmetic, computed once by the step's constructor from the split it read; None (a spec
    built by hand): the engine plans from the split itself.
    `branch`: the checkpoint this run starts from was copied into its folder from another run, which it continues
    under another schedule or length (the fine-tune's cooldown, `cooldown_of`); the resume check then lets the
    schedule and the length differ, provided every update before the checkpoint had the same LR in both
    (identity.check_same_run). Everything else must be the same run.
    `title`: what the run's deliverables call the model (their model spec's title, formats/model_spec.py): the
    pipeline's registered model name; None: the output folder's name, as sd-scripts' default title is its output
    name. Recorded when the run starts (training/state.py RunState), so it is not part of the run's identity.
    """

    training: TrainingConfig
    validation: ValidationConfig
    split_dir: Union[str, Path]
    model: Union[ModelConfig, str, Path, None]
    data: Optional[DataConfig] = None
    train_on: TrainOn = "train"
    sampling: Optional[SamplingConfig] = None
    plan: Optional[Plan] = None
    branch: bool = False
    title: Optional[str] = None

    # --- one validated constructor per step kind ------------------------------------------------------------------

    @classmethod
    def ramp(cls, cfg: RangefinderConfig, split: Split, *, lr_min: float, lr_max: float, world_size: int) -> TrainSpec:
        """The LR range test's sweep from lr_min to lr_max over its epochs (validation every N updates when the
        range test says so)."""
        rt = cfg.lr_range_test
        training = _training(cfg.training, {
            "schedule": "exp-ramp" if rt.ramp == "exp" else "linear-ramp",
            "lr_min": lr_min, "lr_max": lr_max, "lr": lr_max, "scale_lr": "none",
            "epochs": rt.epochs, "steps": None, "world_size": world_size,
            # The folder is this task's own: a retry (a preempted node) goes on from its newest checkpoint.
            "resume": True,
        })
        validation = cfg.validation
        if rt.validate_every_updates is not None:
            validation = _validation(cfg.validation, {"every_updates": rt.validate_every_updates})
        return cls._planned(training, validation, cfg, split, "train", None)

    @classmethod
    def finetune(cls, cfg: RangefinderConfig, split: Split, *, lr: float, bounds: tuple[float, float],
                 world_size: int, epochs: Optional[int] = None) -> TrainSpec:
        """The fine-tune at `lr` (constant, or cycling between the range test's `bounds`, (lr_low, lr_high), as
        `finetune.schedule` says), with a checkpoint every `finetune.checkpoint_every_epochs`, every one kept until
        the step window is known."""
        ft, (lr_low, lr_high) = cfg.finetune, bounds
        # resume: the folder is this task's own, so a retry (a preempted node) goes on from its newest checkpoint.
        update: dict[str, object] = {"epochs": epochs or ft.epochs, "steps": None, "lr": lr, "scale_lr": "none",
                                     "resume": True, "world_size": world_size}
        if ft.schedule == "constant" or lr_high <= lr_low:
            update.update(schedule="constant", lr_min=None, lr_max=None)
        else:
            update.update(schedule=ft.schedule, lr_min=lr_low, lr_max=lr_high)
        training = _training(cfg.training, update)
        spec = cls._planned(training, cfg.validation, cfg, split, "train", cfg.sampling)
        assert spec.plan is not None
        every = max(1, math.ceil(ft.checkpoint_every_epochs * spec.plan.updates_per_epoch - 1e-9))
        # Every checkpoint stays until the step window is known (the run's last one included): the engine would
        # otherwise drop all but the newest `keep_checkpoints`, among them the one the window picks. Neither setting
        # changes the plan.
        training = _training(training, {"checkpoint_every_updates": every,
                                        "keep_checkpoints": math.ceil(spec.plan.total_updates / every) + 1})
        return replace(spec, training=training)

    @classmethod
    def retrain(cls, cfg: RangefinderConfig, split: Split, *, lr: float, bounds: tuple[float, float], epochs: int,
                world_size: int) -> TrainSpec:
        """The full-data retrain: train + validation for `epochs` at the fine-tune's `lr` (triangular between the
        range test's `bounds`, (lr_low, lr_high), with `retrain.schedule: triangular`); nothing is measured."""
        lr_low, lr_high = bounds
        update: dict[str, object] = {"epochs": epochs, "steps": None, "lr": lr, "scale_lr": "none", "resume": True,
                                     "world_size": world_size}
        if cfg.retrain.schedule == "triangular" and lr_high > lr_low:
            update.update(schedule="triangular", lr_min=lr_low, lr_max=lr_high)
        else:
            update.update(schedule="constant", lr_min=None, lr_max=None)
        no_val = _validation(cfg.validation, {"every_epochs": 0.0, "every_updates": None})
        return cls._planned(_training(cfg.training, update), no_val, cfg, split, "train+val", None)

    def cooldown_of(self, split: Split, *, epochs: int, decay_fraction: float) -> TrainSpec:
        """The fine-tune's cooldown (steps/cooldown.py): this constant-LR run, `epochs` long, with its last
        `decay_fraction` of updates decaying linearly to 0 (the wsd schedule), branched from one of this run's
        checkpoints; no samples during training, the newest checkpoint kept (a retried step goes on from it).
        `split`: the one at split_dir, as the step read it."""
        if self.training.schedule != "constant":
            raise ConfigError(f"a cooldown branches a constant-LR run (this one is {self.training.schedule})")
        training = _training(self.training, {"schedule": "wsd", "decay_fraction": decay_fraction, "lr_min": None,
                                             "lr_max": None, "warmup_updates": 0, "epochs": epochs, "steps": None,
                                             "keep_checkpoints": 1})
        spec = replace(self, training=training, sampling=None, branch=True, plan=None)
        return replace(spec, plan=spec.plan_from(split))

    @classmethod
    def _planned(cls, training: TrainingConfig, validation: ValidationConfig, cfg: RangefinderConfig, split: Split,
                 train_on: TrainOn, sampling: Optional[SamplingConfig]) -> TrainSpec:
        if split.folder is None:
            raise ValueError("a step's spec is built from a split read from its folder (data.split.read_split)")
        spec = cls(training, validation, split_dir=split.folder, model=cfg.model, data=cfg.data, train_on=train_on,
                   sampling=sampling, title=cfg.tracking.registered_model_name or None)
        return replace(spec, plan=spec.plan_from(split))

    def plan_from(self, split: Split) -> Plan:
        """The run's plan from `split` (the one at split_dir): the images it trains on and, when bucketed, how many
        fall in each bucket, as the engine counts them. ConfigError for impossible batch arithmetic."""
        items = train_items(split, self.train_on)
        counts = None
        buckets = BucketSettings.from_data_config(self.data) if self.data is not None else None
        if buckets is not None:
            placements = place_items(split, items, buckets)
            sizes = sorted({placements[it.id].bucket for it in items})
            counts = [sum(1 for it in items if placements[it.id].bucket == b) for b in sizes]
        # plan_for counts the images trained on; the images validated on are the split's held-out ones (none when
        # the run trains on them too), which is what `plan.val_images` says in MLflow.
        held_out = len(split.val) if self.train_on == "train" else 0
        return plan_for(self.training, len(items), counts).model_copy(update={"val_images": held_out})

    def with_lr(self, lr: float) -> TrainSpec:
        """The same run at another constant LR (the fine-tune's successive halving), validated; the plan's LR with
        it (the batch arithmetic does not depend on the LR)."""
        training = _training(self.training, {"lr": lr})
        plan = None
        if self.plan is not None:
            plan = Plan.model_validate({**self.plan.model_dump(), "lr": lr * self.plan.lr_scale_factor,
                                        "lr_base": lr})
        return replace(self, training=training, plan=plan)

    # --- JSON -----------------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, JSONValue]:
        return _SPEC.dump_python(self, mode="json")

    @classmethod
    def from_json(cls, data: Mapping[str, JSONValue]) -> TrainSpec:
        try:
            return _SPEC.validate_python(dict(data))
        except ValidationError as e:
            raise ConfigError(f"not a training run's spec: {format_validation_error(e)}") from None


def train_items(split: Split, train_on: TrainOn) -> list[Item]:
    """The items a run trains on: train, or train + val for the full-data retrain."""
    return list(split.train) + (list(split.val) if train_on == "train+val" else [])


@dataclass(frozen=True)
class TrainResult:
    """What one run gave: how it ended, where its files are, the model family it trained and its curve (metrics.csv's
    columns, empty cells as NaN: what analysis.read_curve_csv reads from the file), so that nothing in the same
    process reads the engine's files back."""

    status: str  # "ok" | "diverged" | "paused" (train(pause_after_update=...): a checkpoint, no final weights)
    updates: int  # optimizer updates taken
    planned_updates: int
    epochs: float  # passes over the training set done
    best_val_loss: Optional[float]
    best_update: Optional[int]
    out_dir: Path
    metrics_csv: Path
    updates_csv: Path
    summary_path: Path
    final_dir: Optional[Path]
    checkpoints: list[Path] = field(default_factory=list)
    resumed_from: Optional[int] = None
    cache: dict[str, dict[str, int]] = field(default_factory=dict)
    family: str = ""  # the model family (training.families), detected from the base model
    curve: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def curve_arrays(self) -> dict[str, np.ndarray]:
        """The curve as float arrays, one per column (analysis.read_curve_csv's shape)."""
        return {k: np.asarray(v, dtype=float) for k, v in self.curve.items()}

    def validation_weighting(self) -> Optional[dict]:
        """run_summary.json's `validation_weighting` (how val_loss combines its per-bucket losses, and a flow
        family's sigma grid), for the reports; None when the summary is not there (another process, a failed run)."""
        import json

        try:
            weighting = json.loads(Path(self.summary_path).read_text()).get("validation_weighting")
        except (OSError, ValueError, TypeError):
            return None
        return weighting if isinstance(weighting, dict) else None

    def as_dict(self) -> dict[str, JSONValue]:
        """The result without its family and curve: the fields run_summary.json opens with (its format), and what
        `rangefinder train` prints."""
        d = self.to_json()
        d.pop("curve")
        d.pop("family")
        return d

    def to_json(self) -> dict[str, JSONValue]:
        return _RESULT.dump_python(self, mode="json")

    @classmethod
    def from_json(cls, data: Mapping[str, JSONValue]) -> TrainResult:
        return _RESULT.validate_python(dict(data))


_SPEC: TypeAdapter[TrainSpec] = TypeAdapter(TrainSpec)
_RESULT: TypeAdapter[TrainResult] = TypeAdapter(TrainResult)


def _training(base: TrainingConfig, update: Mapping[str, object]) -> TrainingConfig:
    try:
        return TrainingConfig.model_validate({**base.model_dump(), **update})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix="training.")) from None


def _validation(base: ValidationConfig, update: Mapping[str, object]) -> ValidationConfig:
    try:
        return ValidationConfig.model_validate({**base.model_dump(), **update})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix="validation.")) from None
