"""The planner: the hyperparameter arithmetic, in one place (docs/design.md, section 3, "Hyperparameter
arithmetic"). What the engine will really run, from a dataset's size and the training settings:

- micro-batch: `batch_size` images through one forward/backward on one process;
- update: one optimizer step, after `grad_accum` micro-batches on each of `world_size` processes;
- effective batch: `batch_size * grad_accum * world_size`;
- epoch: every training image seen once.

The engine draws micro-batches from a *stream* of images: one seeded permutation of the training set per epoch,
concatenated, cut into consecutive chunks of `batch_size * world_size`. So a micro-batch may straddle an epoch
boundary, gradient accumulation carries across it, and an epoch is exactly `train_images` images. With
`drop_last=True` each epoch is instead cut on its own and the trailing `train_images % (batch_size * world_size)`
images of each permutation are skipped. `plan()` counts exactly what the engine does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional, get_args

from pydantic import BaseModel

from rangefinder.config import RangefinderConfig, ScaleLR, StepsUnit, TrainingConfig, ValidationConfig
from rangefinder.defaults import STEP_WINDOW_MIN_UPDATES
from rangefinder.errors import ConfigError


class Plan(BaseModel):
    train_images: int
    val_images: int
    batch_size: int
    grad_accum: int
    world_size: int
    effective_batch: int
    micro_batches_per_epoch: float  # per process; fractional when micro-batches straddle epochs
    updates_per_epoch: float
    total_updates: int
    total_micro_batches: int  # per process: what the engine runs
    epochs: int  # whole passes over the training set
    images_seen: int  # across all processes
    full_cycle: bool
    drop_last: bool
    # Training images per aspect-ratio bucket when there are two or more (each micro-batch then comes from one
    # bucket, so each bucket ends its epoch with its own partial micro-batch); None: one shape for all images.
    bucket_counts: Optional[list[int]] = None
    lr: Optional[float]
    lr_base: Optional[float]
    lr_scale_factor: float
    steps_unit: StepsUnit
    warnings: list[str]


def val_count(n_images: int, val_split: float) -> int:
    """ceil(p*N) validation images; at least 1 when p > 0, and at least 1 left for training."""
    if val_split <= 0:
        return 0
    return min(max(1, math.ceil(val_split * n_images - 1e-9)), n_images - 1)


def lr_scale_factor(scale_lr: str, effective_batch: int) -> float:
    if scale_lr == "linear":
        return float(effective_batch)
    if scale_lr == "sqrt":
        return math.sqrt(effective_batch)
    return 1.0


def _num(x: float) -> float:
    return int(x) if float(x).is_integer() else round(x, 4)


def plan(
    num_images: int,
    *,
    val_split: float = 0.0,
    batch_size: int = 1,
    grad_accum: int = 1,
    world_size: int = 1,
    epochs: Optional[int] = None,
    steps: Optional[int] = None,
    steps_unit: StepsUnit = "update",
    lr: Optional[float] = None,
    scale_lr: ScaleLR = "none",
    drop_last: bool = False,
    train_images: Optional[int] = None,
    bucket_counts: Optional[Sequence[int]] = None,
) -> Plan:
    """Translate a dataset size and settings into the counts the engine will really run.

    Give either `epochs` or `steps` (counted in `steps_unit`). `train_images`, when given, overrides the split
    (e.g. a hand-made validation folder). `bucket_counts`, the training images in each aspect-ratio bucket, gives
    the training set instead (`rangefinder split` lists them): every micro-batch then holds images of one bucket.
    Raises ConfigError for impossible settings.
    """
    for name, v in (("batch_size", batch_size), ("grad_accum", grad_accum), ("world_size", world_size)):
        if v < 1:
            raise ConfigError(f"{name} must be >= 1 (got {v})")
    # Checked here, not only by the config: called from Python, an unknown scale_lr planned an unscaled LR and an
    # unknown steps_unit counted micro-batches, without a word.
    choices = (("scale_lr", scale_lr, get_args(ScaleLR)), ("steps_unit", steps_unit, get_args(StepsUnit)))
    for name, value, allowed in choices:
        if value not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)} (got {value!r})")
    if (epochs is None) == (steps is None):
        raise ConfigError("give exactly one budget: epochs, or steps with steps_unit update|micro-batch")
    if (epochs is not None and epochs < 1) or (steps is not None and steps < 1):
        raise ConfigError(f"the budget must be >= 1 (got epochs={epochs}, steps={steps})")
    if not 0 <= val_split < 1:
        raise ConfigError(f"val_split must be in [0, 1) (got {val_split})")
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"lr must be a finite number above 0 (got {lr}); e.g. 1e-5")

    counts = [int(c) for c in bucket_counts or () if c]
    if any(c < 0 for c in counts):
        raise ConfigError(f"bucket counts must be >= 0 (got {list(bucket_counts or ())})")
    if counts:
        train_images = sum(counts)
    bucketed = len(counts) >= 2  # one bucket: every image has one shape, the plain stream below
    n_val = 0 if train_images is not None else val_count(num_images, val_split)
    n_train = train_images if train_images is not None else num_images - n_val
    if n_train < 1:
        raise ConfigError(f"no training images left ({num_images} images, val_split {val_split}); add images")
    per_step = batch_size * world_size  # images consumed by one micro-batch step across processes
    eff = batch_size * grad_accum * world_size
    warnings: list[str] = []

    mb_per_epoch: float  # per process; whole unless micro-batches straddle epochs
    images_per_epoch: float
    if bucketed:
        # Each bucket is shuffled and cut into micro-batches on its own, every epoch (data/buckets.py): a bucket's
        # last micro-batch is partial (or skipped, with drop_last), and no micro-batch straddles epochs.
        if drop_last:
            mb_per_epoch = sum(c // per_step for c in counts)
            if mb_per_epoch == 0:
                raise ConfigError(
                    f"batch_size x world_size = {per_step} is larger than every bucket ({counts}) with drop_last: no "
                    "micro-batch would ever run; lower batch_size or set drop_last false"
                )
            skipped = sum(c % per_step for c in counts)
            if skipped:
                warnings.append(
                    f"drop_last skips {skipped} of {n_train} images each epoch: each bucket's remainder after "
                    f"micro-batches of {per_step}"
                )
        else:
            mb_per_epoch = sum(-(-c // per_step) for c in counts)
            partial = sum(1 for c in counts if c % per_step)
            if partial:
                warnings.append(
                    f"{partial} of the {mb_per_epoch} micro-batches of each epoch are partial: a micro-batch holds one "
                    f"aspect-ratio bucket, and {partial} of the {len(counts)} buckets ({counts}) are not a multiple "
                    f"of batch_size x world_size = {per_step}"
                )
        images_per_epoch = sum(c // per_step * per_step for c in counts) if drop_last else n_train
    elif drop_last:
        if per_step > n_train:
            raise ConfigError(
                f"batch_size x world_size = {per_step} is larger than the {n_train} training images with "
                "drop_last: no micro-batch would ever run; lower batch_size or set drop_last false"
            )
        mb_per_epoch = n_train // per_step
        if n_train % per_step:
            warnings.append(
                f"drop_last skips {n_train % per_step} of {n_train} images each epoch (a different few each time)"
            )
    else:
        mb_per_epoch = n_train / per_step
    if not bucketed:
        images_per_epoch = mb_per_epoch * per_step  # == n_train unless drop_last

    if epochs is not None:
        total_mb = math.ceil(epochs * mb_per_epoch - 1e-9)
        total_updates = math.ceil(total_mb / grad_accum)
        n_epochs = epochs
        images_seen = round(epochs * images_per_epoch)
        if not drop_last and not bucketed and images_seen % per_step:
            warnings.append(
                f"partial last micro-batch: {epochs} epochs x {n_train} images is not a multiple of "
                f"batch_size x world_size = {per_step}; the last one has {images_seen % per_step} images"
            )
        if total_mb % grad_accum:
            warnings.append(
                f"the last update accumulates {total_mb % grad_accum} of {grad_accum} micro-batches "
                f"({total_mb} micro-batches in all)"
            )
    else:
        assert steps is not None
        if steps_unit == "update":
            total_updates = steps
            total_mb = steps * grad_accum
            budget_mb = total_mb
        else:
            total_updates = steps // grad_accum
            total_mb = total_updates * grad_accum
            budget_mb = steps
            if total_updates == 0:
                raise ConfigError(
                    f"{steps} micro-batch steps is fewer than grad_accum = {grad_accum}: no update would run; "
                    "raise steps or lower grad_accum"
                )
            if steps % grad_accum:
                warnings.append(
                    f"{steps} micro-batch steps is not a multiple of grad_accum = {grad_accum}: the last "
                    f"{steps % grad_accum} do not complete an update and are not run"
                )
        # Whole passes in the stated budget, rounded down as a person counting passes would.
        n_epochs = int(budget_mb // mb_per_epoch) if drop_last or bucketed else (budget_mb * per_step) // n_train
        images_seen = total_mb * per_step
        if bucketed:
            whole, rest = divmod(total_mb, int(mb_per_epoch))
            # Which buckets' micro-batches fill the last, unfinished epoch depends on its shuffle: the images of
            # those micro-batches are estimated at the epoch's mean micro-batch size.
            images_seen = round(whole * images_per_epoch + rest * images_per_epoch / mb_per_epoch)
            if rest:
                warnings.append(
                    f"the budget ends {rest} micro-batches into epoch {whole + 1}; with aspect-ratio buckets its "
                    "images seen is an estimate (which buckets come first is drawn each epoch)"
                )
        elif not drop_last and n_train % per_step:
            warnings.append(
                f"{n_train} training images is not a multiple of batch_size x world_size = {per_step}: "
                "micro-batches straddle epoch boundaries"
            )

    full_cycle = n_train == eff if not bucketed else mb_per_epoch == grad_accum
    if bucketed and not full_cycle and n_train <= 64:
        warnings.append(
            f"tiny dataset ({n_train} images) but not full-cycle: with aspect-ratio buckets an epoch is "
            f"{_num(mb_per_epoch)} micro-batches of batch_size x world_size = {per_step}; grad_accum = "
            f"{_num(mb_per_epoch)} gives one smooth update per epoch"
        )
    if eff > n_train:
        warnings.append(
            f"effective batch {eff} is larger than the {n_train} training images: each update sees some images "
            f"twice; lower batch_size or grad_accum to at most {n_train}"
        )
    elif not full_cycle and not bucketed and n_train <= 64:
        warnings.append(
            f"tiny dataset ({n_train} images) but not full-cycle: batch_size x grad_accum x world_size = {eff}; "
            f"setting it to {n_train} gives one smooth update per epoch"
        )

    factor = lr_scale_factor(scale_lr, eff)
    if factor > 8:
        warnings.append(
            f"scale_lr={scale_lr} multiplies the LR by {factor:g} (effective batch {eff}); check it is meant"
        )
    lr_final = None if lr is None else lr * factor

    return Plan(
        train_images=n_train,
        val_images=n_val,
        batch_size=batch_size,
        grad_accum=grad_accum,
        world_size=world_size,
        effective_batch=eff,
        micro_batches_per_epoch=_num(mb_per_epoch),
        updates_per_epoch=_num(mb_per_epoch / grad_accum),
        total_updates=total_updates,
        total_micro_batches=total_mb,
        epochs=int(n_epochs),
        images_seen=int(images_seen),
        full_cycle=full_cycle,
        drop_last=drop_last,
        bucket_counts=counts if bucketed else None,
        lr=lr_final,
        lr_base=lr,
        lr_scale_factor=factor,
        steps_unit=steps_unit,
        warnings=warnings,
    )


def loader_updates_per_epoch(images_per_bucket: Sequence[int], *, batch_size: int, world_size: int,
                             grad_accum: int, drop_last: bool = False) -> int:
    """Updates per epoch as kohya's sd-scripts and the diffusers examples count them, for their `max_train_steps`
    from `max_train_epochs` / `num_train_epochs` and back: each epoch is a dataloader of its own, whose last batch
    of each bucket is partial, sharded over the processes, and ended by an update however few micro-batches it
    accumulated. sd-scripts (train_network.py): ceil(len(train_dataloader) / num_processes / grad_accum); the
    diffusers examples: ceil(len(prepared dataloader) / grad_accum), accelerate's sharding giving
    ceil(batches / num_processes); the two agree (nested ceilings of whole numbers). `drop_last`: their
    dataloader's, which leaves each bucket's partial batch out."""
    batches = sum(n // batch_size if drop_last else -(-n // batch_size) for n in images_per_bucket)
    return -(-batches // (world_size * grad_accum))


def plan_for(cfg: TrainingConfig, train_images: int, bucket_counts: Optional[Sequence[int]] = None) -> Plan:
    """The plan of one engine run, from its settings and the size of its training set (and its images per
    aspect-ratio bucket, when bucketed)."""
    if not cfg.budget_given():
        raise ConfigError("training.epochs or training.steps must be set for a training run")
    return plan(
        train_images,
        train_images=train_images,
        batch_size=cfg.batch_size,
        grad_accum=cfg.grad_accum,
        world_size=cfg.world_size,
        epochs=cfg.epochs,
        steps=cfg.steps,
        steps_unit=cfg.steps_unit,
        lr=cfg.lr,
        scale_lr=cfg.scale_lr,
        drop_last=cfg.drop_last,
        bucket_counts=bucket_counts,
    )


def plan_like(run_plan: Plan, *, epochs: int) -> Plan:
    """The plan of a run on `run_plan`'s training images (and aspect-ratio buckets) with its batch arithmetic, over
    `epochs`: the fine-tune's updates, counted by the range test on its own run's figures before it trains (the same
    split and batches), without reading the split again. Its LR is None (the batch arithmetic does not use it)."""
    return plan(run_plan.train_images, train_images=run_plan.train_images, batch_size=run_plan.batch_size,
                grad_accum=run_plan.grad_accum, world_size=run_plan.world_size, epochs=epochs,
                drop_last=run_plan.drop_last, bucket_counts=run_plan.bucket_counts)


def planned_validations(plan: Plan, val_cfg: ValidationConfig) -> int:
    """The validations a run of `plan` makes: its update-0 baseline, one every N updates or at every crossed
    every-N-epochs boundary (loop._validation_due), and its last."""
    total = plan.total_updates
    if val_cfg.every_updates is not None:
        return 1 + total // val_cfg.every_updates + (1 if total % val_cfg.every_updates else 0)
    if val_cfg.every_epochs <= 0 or total == 0:
        return 0
    epochs = total / plan.updates_per_epoch
    crossed = math.floor(epochs / val_cfg.every_epochs + 1e-9)
    return 1 + crossed + (0 if abs(crossed * val_cfg.every_epochs - epochs) < 1e-9 else 1)


def check_finetune_validations(cfg: RangefinderConfig, finetune_plan: Optional[Plan] = None) -> None:
    """ConfigError for a fine-tune that validates at fewer updates than its step window reads
    (defaults.STEP_WINDOW_MIN_UPDATES, analysis.select_step_window): it would train to its end and only then fail.
    Counted as the engine validates (planned_validations): at update 0, every validation.every_epochs or every_updates,
    and at the end. The successive halving's pause adds none and takes none (both candidates pause right after a
    validation and the kept one goes on from it, the same run), and the retrain validates nothing; a fixed lr skips
    the range test, not the step window. Nothing to check without validation: the fine-tune keeps its epochs.

    `finetune_plan`: the fine-tune's own (TrainSpec.finetune's, from the split a step read). None: before the data are
    read (compile, run --local, resolve-config), where every_epochs alone decides: the boundaries a run crosses and
    its end are whole epochs, so every_epochs not below finetune.epochs validates only at the start and end whatever
    the data's size (counted here on one update per epoch); every_updates needs the fine-tune's updates, and is left
    to the steps that know them before they train: the LR finder that runs first (the range test, on its own run's
    figures: plan_like; the prodigy_step probe, which trains the fine-tune's plan) and the fine-tune itself."""
    val, epochs = cfg.validation, cfg.finetune.epochs
    if not val.enabled() or not cfg.split.holds_out_validation():
        return
    if finetune_plan is None and val.every_updates is not None:
        return
    counted = finetune_plan or plan(1, epochs=epochs)
    if planned_validations(counted, val) >= STEP_WINDOW_MIN_UPDATES:
        return
    total = counted.total_updates
    if val.every_updates is not None:
        setting = f"validation.every_updates: {val.every_updates}"
        fix = (f"set validation.every_updates below {total} (e.g. {max(1, total // 10)}) or raise finetune.epochs"
               if total > 1 else "raise finetune.epochs")
    else:
        setting = f"validation.every_epochs: {val.every_epochs:g}"
        fix = f"set validation.every_epochs below {epochs} (e.g. {min(1.0, epochs / 2):g}) or raise finetune.epochs"
    length = "" if finetune_plan is None else f" ({total} update{'s' if total != 1 else ''})"
    raise ConfigError(
        f"{setting} with finetune.epochs: {epochs}{length} validates the fine-tune only at its start and end, and its "
        f"step window needs validations at {STEP_WINDOW_MIN_UPDATES} or more updates (it would train to the end, then "
        f"fail); {fix}"
    )
