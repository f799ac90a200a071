"""One training run: the loop the LR range test, the constant fine-tune and the full-data retrain share.

`train()` reads top to bottom: setup (settings -> device -> model -> data -> optimizer -> resume) -> the loop (one
update, validation, checkpoint) -> finish (final weights and summary). The acts live in sibling modules:
- spec.py: the run's request and answer (TrainSpec, TrainResult); run.py: the run's types (RunSettings, Run);
- setup.py: the settings checks, the launcher (accelerate), model loading, the optimizer and EMA; encoding.py: the
  encoded data;
- family.py: the model family (how captions become conditioning, what the UNet predicts);
- methods/: what trains and what is saved (full fine-tuning, LoRA, textual inversion);
- data.py: which images go into each micro-batch; validation.py: the measurement (a row of the curve: `validate`,
  here);
- samples.py: the prompts rendered from the current weights at chosen validations (`samples/`, and MLflow);
- state.py: what the loop changes (RunState, and the CSV log); checkpointing.py: saving and resuming it
  (identity.py: which run a checkpoint belongs to); divergence.py: the finite checks; disk.py: the failed-write
  rule; outdir.py: the folder lock; preemption.py: SIGTERM (SIGINT: errors.on_sigint).

Outputs under out_dir: `metrics.csv` (one row per validation measurement; the curve CSV), `updates.csv` (one row
per update), `checkpoints/`, `final/` (the method's deliverable; a StableDiffusionPipeline folder for full
fine-tuning), `samples/` (when the spec asks for samples during training) and `run_summary.json`.

With EMA on, `final/` holds the EMA weights, and validation measures them too (the step window is then read on the
model that is saved), except on the LR range test's ramps: there it measures the raw weights, because the average
lags behind the climbing LR and would shift the curve the LR bounds are read from.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from rangefinder.config import ValidationConfig
from rangefinder.errors import ConfigError, Preempted, on_sigint
from rangefinder.formats import checkpoints
from rangefinder.formats.atomic import atomic_dir, sweep_leftovers, write_json
from rangefinder.formats.model_spec import SpecFacts
from rangefinder.formats.text import warn
from rangefinder.training.checkpointing import check_resume, restore_checkpoint, save_checkpoint
from rangefinder.training.data import Stream
from rangefinder.training.disk import outputs_written
from rangefinder.training.divergence import trainable_finite, update_finite
from rangefinder.training.encoding import encode_data
from rangefinder.training.optimizers import step_optimizer
from rangefinder.training.outdir import OutDirLock
from rangefinder.training.preemption import StopRequest, on_sigterm
from rangefinder.training.run import Run
from rangefinder.training.samples import TrainingSamples
from rangefinder.training.setup import (
    check_settings,
    load_model,
    memory_advice,
    native_data_config,
    prepare_run,
    start_accelerator,
)
from rangefinder.training.sinks import MEASURED_PREFIXES, UPDATE_METRICS, MetricSink
from rangefinder.training.spec import TrainResult, TrainSpec
from rangefinder.training.state import RunLog, RunState
from rangefinder.training.validation import (
    PairScoring,
    ValidationSet,
    bucket_columns,
    diverged,
    measure_subset,
    preserved_rng,
)

if TYPE_CHECKING:
    from rangefinder.data.split import Split
    from rangefinder.training.family import Family


@on_sigint()  # Ctrl-C ends the run as interrupted, whichever error it surfaced as
@preserved_rng()  # the run seeds the global RNGs (load_model): the caller's states are put back after, a notebook's say
def train(
    spec: TrainSpec, *, out_dir: Union[str, Path], metric_sink: Optional[MetricSink] = None, save_final: bool = True,
    pause_after_update: Optional[int] = None, split: Optional[Split] = None,
) -> TrainResult:
    """Train one run and write its curve, checkpoints and final weights (unless `save_final` is off) under out_dir.

    `pause_after_update`: stop at the first validation at or after that update, with a checkpoint there and no
    final weights (status "paused"); the same spec with `training.resume` then goes on from it to the end as if it
    had never stopped. The pause is not part of the run's identity: the successive halving of the fine-tune
    (rangefinder.steps.finetune) trains two LRs half-way this way and continues the better one.

    `split`: the split at spec.split_dir as the step already read it (its images are then hashed once for all the
    step's runs); None: read here.
    """
    # --- settings: everything that can be wrong fails here, before anything heavy ---------------------------------
    settings = check_settings(spec, out_dir, split)
    cfg = settings.cfg

    # --- device and precision (the launcher: accelerate) ----------------------------------------------------------
    accelerator = start_accelerator(cfg)
    if accelerator.is_main_process:
        # The plan's warnings (an effective batch larger than the set, ...) change what the run measures: on the
        # terminal, not only in run_summary.json. A local run's progress shows lines of this form too.
        warn(settings.plan.warnings)
    out_lock = OutDirLock(settings.out_dir, hold=accelerator.is_main_process)  # one run per out_dir; until the end
    if accelerator.is_main_process:
        sweep_leftovers(settings.out_dir)  # a killed run's half-written final/, summary, curve: the lock is ours now

    # --- model: the method's trainable parts set up, the family's conditioning and objective ----------------------
    sd, family = load_model(settings, accelerator)

    # --- data: latents and text embeddings, encoded once per dataset and base model -------------------------------
    encoded = encode_data(settings, sd, family, accelerator, spec.data or native_data_config(sd))

    # --- optimizer, EMA -------------------------------------------------------------------------------------------
    run = prepare_run(settings, accelerator, sd, family, encoded)

    # A full disk or a read-only folder while writing the curve, final/ or the summary: one sentence, no traceback.
    # SIGTERM (an eviction) from here on: a checkpoint at the next update boundary, then Preempted.
    with outputs_written(settings.out_dir), on_sigterm() as stop:
        # --- resume, or the update-0 baseline -------------------------------------------------------------------------
        check_resume(run)  # another run's checkpoint is refused before the curve CSVs below are rewritten
        log = RunLog(settings.out_dir, settings.val_cfg.timesteps, run.main, bucket_columns(run.data.val_sets))
        # One training generator, the same on every rank: each rank draws the randomness of the whole micro-batch
        # and keeps its share (_micro_batch_loss), so N processes train what one process does at the same global
        # batch (up to float summation order).
        state = RunState.fresh(cfg.seed, log, settings.title)
        restore_checkpoint(run, state)
        # Samples during training (sampling.every_validations): rendered right after the validations they follow.
        samples = TrainingSamples.start(run, state, spec.sampling, metric_sink)
        if run.validating and state.update == 0:
            validate(run, state, metric_sink)  # the baseline: the base model before any update
            if samples is not None:
                samples.after_validation(state, last=False)

        # --- the loop -------------------------------------------------------------------------------------------------
        from tqdm.auto import tqdm

        for m in run.modules.values():
            m.train()
        stream = run.stream
        # The bar is closed (its line ended) however the loop ends: in a log that is no terminal its line ends in a
        # carriage return, and the line a stop or an error prints (Preempted's, a full disk's) was written onto it.
        with tqdm(total=stream.total_updates, initial=state.update, disable=not run.main,
                  desc=f"train ({cfg.schedule})", unit="update", dynamic_ncols=True) as progress:
            t0, cpu0 = time.perf_counter(), time.process_time()
            paused = _pause_due(pause_after_update, state)  # resumed at the pause: nothing to train
            while state.update < stream.total_updates and state.status == "ok" and not paused:
                first_micro_batch = state.micro_batches_done
                row = _train_one_update(run, state)
                state.add_update(row)
                if not update_finite(run, row):
                    state.status = "diverged"  # a NaN/inf loss stops any run, validation on or off
                if metric_sink is not None and run.main:
                    # prodigy_d_lr: Prodigy's only
                    logged = {k: row[k] for k in UPDATE_METRICS if row[k] is not None}
                    metric_sink.log_metrics(logged, state.update)
                progress.set_postfix(loss=f"{row['train_loss']:.4f}", lr=f"{row['lr']:.3g}", refresh=False)
                progress.update(1)

                # Validation: every N updates, or whenever an every-N-epochs boundary was crossed; and at the end. A
                # ramp stops once it diverges: the range test has found its upper bound.
                last = state.update == stream.total_updates
                if run.validating and (_validation_due(run.val_cfg, stream, first_micro_batch, state) or last):
                    validate(run, state, metric_sink, last=last)
                    if samples is not None:
                        samples.after_validation(state, last=last)
                    if run.schedule.is_ramp and _diverged(run.val_cfg, state.log):
                        state.status = "diverged"
                paused = not last and _pause_due(pause_after_update, state)

                # Checkpoint: every N updates and at the end (also when stopping on divergence; weights that are no
                # longer finite are not saved, so the last checkpoint is the last finite one), and where the run pauses.
                every = cfg.checkpoint_every_updates
                saving = bool(every and (state.update % every == 0 or last or state.status != "ok")) or paused
                if saving:
                    save_checkpoint(run, state)
                # Preemption (SIGTERM): at this update boundary, on every rank at once.
                if not last and state.status == "ok" and not paused and stop.agreed(run):
                    _preempt(run, state, stop, saved_already=saving)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0

        # --- final weights and summary --------------------------------------------------------------------------------
        if paused:
            state.status = "paused"  # after its checkpoint, which stays "ok": resuming goes on
        result = _finish(run, state, save_final=save_final, seconds=seconds, cpu_seconds=cpu_seconds)
    out_lock.release()
    return result


def measure_weights(spec: TrainSpec, weights: dict[str, torch.Tensor], *, out_dir: Union[str, Path],
                    split: Optional[Split] = None) -> dict[str, Any]:
    """One row of the curve of the run `spec` describes, measured on `weights` (the method's trained tensors, as a
    checkpoint holds them) instead of on a checkpoint the run wrote: the same validation sets, fixed timesteps and
    noise (validation.py) as every row of that run's metrics.csv, so the numbers compare with its curve's. Nothing is
    trained. The row is also written to out_dir/metrics.csv."""
    with weights_measurer(spec, out_dir=out_dir, split=split) as measure:
        return measure(weights)


@contextlib.contextmanager
def weights_measurer(spec: TrainSpec, *, out_dir: Union[str, Path],
                     split: Optional[Split] = None) -> Iterator[Callable[[dict[str, torch.Tensor]], dict[str, Any]]]:
    """measure_weights for several sets of weights on one setup: the model loaded and the data encoded once, then
    each call loads the given tensors and validates them, a row each in out_dir/metrics.csv, in call order. The
    fine-tune measures its window average and greedy soup this way (rangefinder.steps.average)."""
    with preserved_rng():  # load_model seeds the global RNGs: the caller's states are put back after, as train's
        settings = check_settings(spec, out_dir, split)
        accelerator = start_accelerator(settings.cfg)
        sd, family = load_model(settings, accelerator)
        if settings.cfg.validates_averaged_weights(family.name):
            raise ConfigError("measure_weights measures the weights it is given; a run with EMA or a schedule-free "
                              "optimizer validates its averaged weights instead, which these are not")
        encoded = encode_data(settings, sd, family, accelerator, spec.data or native_data_config(sd))
        run = prepare_run(settings, accelerator, sd, family, encoded)
        if not run.validating:
            raise ConfigError(f"the run measures nothing: split {spec.split_dir} has no validation images")
        with outputs_written(settings.out_dir):
            log = RunLog(settings.out_dir, settings.val_cfg.timesteps, run.main, bucket_columns(run.data.val_sets))

            def measure(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
                run.method.load_trainable_state_dict({k: v.to(run.device) for k, v in weights.items()})
                validate(run, RunState.fresh(settings.cfg.seed, log, settings.title), None)
                return dict(log.metrics_rows[-1])

            yield measure


def _preempt(run: Run, state: RunState, stop: StopRequest, saved_already: bool) -> None:
    """The checkpoint of the current update (unless the loop just wrote it), then `Preempted`, whose one line says
    where it is and how to go on."""
    if not saved_already:
        save_checkpoint(run, state)
    if state.status != "ok":
        return  # weights no longer finite: not saved, and the loop ends as diverged
    ckpt = run.settings.ckpt_root / checkpoints.checkpoint_name(state.update)
    raise Preempted(
        f"stopped by SIGTERM at update {state.update} of {run.stream.total_updates}: checkpoint {ckpt} written "
        f"{stop.since()}; run again with --resume (a retried pipeline step does) to go on "
        "from there"
    )


# ---------------------------------------------------------------------------------------------------------------
# One update


def _train_one_update(run: Run, state: RunState) -> dict[str, Any]:
    """Accumulate the gradients of one update's micro-batches, then step; returns the update's row of updates.csv."""
    stream, accelerator = run.stream, run.accelerator
    micro_steps = stream.update_micro_batches(state.update)
    # Each image's loss is weighted 1/(images in this update) so the update's gradient is the mean over all of
    # its images whatever their split into micro-batches and processes (DDP averages, hence x world size).
    images_in_update = sum(len(stream.micro_batch(j)) for j in micro_steps)
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    with memory_advice(run.cfg):  # a CUDA OOM becomes a sentence naming what to lower
        for j in micro_steps:
            with _gradient_sync(run, sync=j == micro_steps[-1]):
                loss_sum += _micro_batch_loss(run, state.train_gen, j, images_in_update)

    # One update: clip, set this update's LR, step, hooks, EMA. With bf16 weights the fp32 masters are clipped and
    # stepped (run.trainable), from the accumulated bf16 gradients cast into them here, then copied into the weights.
    if run.master is not None:
        run.master.gradients_in()
    clip = run.cfg.max_grad_norm if run.cfg.max_grad_norm is not None else float("inf")
    grad_norm = float(accelerator.clip_grad_norm_(run.trainable, clip))
    lr = run.schedule(state.update)
    for g in run.optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    with memory_advice(run.cfg):  # AdamW allocates its state on the first step
        step_sizes = step_optimizer(run.cfg.optimizer, run.optimizer)
    run.optimizer.zero_grad(set_to_none=True)
    if run.master is not None:
        run.master.weights_out()
    run.method.after_optimizer_step()
    if run.ema is not None:
        run.ema.step(run.trainable)
    state.update += 1
    state.micro_batches_done = micro_steps[-1] + 1

    # Train loss is the plain MSE mean over the update's images (comparable with the validation loss).
    total = accelerator.reduce(loss_sum, "sum") if accelerator.num_processes > 1 else loss_sum
    train_loss = float(total) / images_in_update
    epoch = stream.epochs_after(state.micro_batches_done)
    return {"update": state.update, "epoch": epoch, "lr": lr, "train_loss": train_loss, "grad_norm": grad_norm,
            **step_sizes}


@contextlib.contextmanager
def _gradient_sync(run: Run, sync: bool) -> Iterator[None]:
    """DDP all-reduces the gradients on an update's last micro-batch only (`sync`); the others accumulate locally."""
    with contextlib.ExitStack() as stack:
        if not sync:
            for module in run.prepared.values():
                stack.enter_context(run.accelerator.no_sync(module))
        yield


def _micro_batch_loss(run: Run, gen: torch.Generator, j: int, images_in_update: int) -> torch.Tensor:
    """Forward and backward of this process's share of micro-batch j; the sum of its images' losses (float64)."""
    cfg, device = run.cfg, run.device
    rank = run.accelerator.process_index
    idx = run.stream.local(j, rank)
    weight = run.accelerator.num_processes / images_in_update
    # The random draws are made for the whole micro-batch (every process's images, the same generator state on every
    # rank) and each process keeps the slice of its own images: an image's flip, timestep and noise do not depend on
    # how many processes share the batch.
    whole = len(run.stream.micro_batch(j))
    first = rank * run.stream.batch_size
    if not idx:  # this process got no image in a partial last chunk: a zero-weight stand-in
        idx, weight, first = run.stream.micro_batch(j)[:1], 0.0, 0
    B = len(idx)
    mine = slice(first, first + B)
    flips = (torch.rand(whole, generator=gen) < 0.5)[mine].tolist() if cfg.random_flip else [False] * B
    drop = (torch.rand(whole, generator=gen) < cfg.cond_dropout)[mine] if cfg.cond_dropout > 0 else None
    latents = run.data.train_latents.get(idx, flips, device)  # (B, C, h, w) scaled latents (draws nothing)
    timesteps = run.family.sample_timesteps(whole, gen, (latents.shape[-2], latents.shape[-1]))[mine]
    noise = torch.randn((whole, *latents.shape[1:]), generator=gen)[mine]
    if cfg.noise_offset:
        # Offset noise (Guttenberg 2023, crosslabs.org/blog/diffusion-with-offset-noise): lets the model
        # shift a whole channel's mean, i.e. learn very dark and very bright images.
        noise = noise + cfg.noise_offset * torch.randn((whole, latents.shape[1], 1, 1), generator=gen)[mine]
    noise, timesteps = noise.to(device), timesteps.to(device)
    # (B, 77, D) hidden states (read from the text cache, or tag-shuffled with orders drawn from `gen` and encoded),
    # or (B, 77) ids when the text encoder trains.
    cond = run.data.train_text.cond(idx, gen) if run.data.train_text is not None else run.data.train_cond[idx]
    # The images' own conditioning (SDXL: original size, crop, target size), after the captions'.
    cond = run.family.with_images(cond, [run.data.train_geometry[i] for i in idx])
    if drop is not None:
        # Caption dropout: train the unconditional branch classifier-free guidance needs (Ho & Salimans 2022).
        cond = run.family.drop_captions(cond, run.data.empty_cond, drop)
    pred, target = run.denoiser(latents, noise, timesteps, cond.to(device))
    per_image = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))  # (B,)
    weighted = per_image * run.family.loss_weights(timesteps, cfg.min_snr_gamma)
    run.accelerator.backward(weighted.sum() * weight)
    return per_image.detach().double().sum() * (weight > 0)


# ---------------------------------------------------------------------------------------------------------------
# Validation: one row of the curve


def validate(run: Run, state: RunState, metric_sink: Optional[MetricSink], last: bool = False) -> None:
    """One row of metrics.csv: mean and per-bucket losses on val and stabilize, RNGs untouched. The stabilize
    subset is measured at every `stabilize_every`th row (the row count survives a resume) and at the last."""
    val_cfg, log = run.val_cfg, state.log
    nth = len(log.metrics_rows)
    # With EMA on, the EMA weights are measured, so the step window is read on the model that is saved (diffusers'
    # example trainers validate the same way); not on ramps, where the average lags behind the climbing LR and would
    # shift the range test's curve towards higher LRs, the lag the analysis avoids.
    # A schedule-free optimizer is measured in its eval mode (its averaged weights), ramps included: that is the model
    # it trains, and the one it saves.
    with preserved_rng((state.train_gen,)), run.schedule_free_eval(), run.ema_weights(on=not run.schedule.is_ramp):
        for m in run.modules.values():
            m.eval()
        row: dict[str, Any] = {"update": state.update, "epoch": run.stream.epochs_after(state.micro_batches_done)}
        # The update-0 baseline has taken no step: its LR is 0, the start of a range test's curve.
        row["lr"] = log.update_rows[-1]["lr"] if log.update_rows else 0.0
        row["train_loss"] = state.train_loss_since_row()
        scoring = PairScoring(val_cfg.timesteps, val_cfg.seed, val_cfg.batch_size, run.device)
        subsets: dict[str, list[ValidationSet]] = {}
        for vset in run.data.val_sets:  # one set per subset and aspect-ratio bucket
            subsets.setdefault(vset.name, []).append(vset)
        for name, vsets in subsets.items():
            sparse = name == "stabilize" and len(subsets) > 1 and not last
            if sparse and nth % val_cfg.stabilize_every != 0:
                continue
            mean, buckets, by_shape = measure_subset(vsets, run.eval_denoiser, scoring, shard=run.val_shard)
            row[f"{name}_loss"] = mean
            row.update({f"{name}_loss_b{k}": b for k, b in enumerate(buckets)})
            if len(vsets) > 1:  # the loss of each aspect-ratio bucket: val_loss_40x24, ...
                row.update({f"{name}_loss_{shape}": loss for shape, loss in by_shape.items()})
        for m in run.modules.values():
            m.train()
    state.start_row()
    log.add_metrics(row)
    if metric_sink is not None and run.main:
        # Only the measurements: lr, epoch and the per-update train loss were logged with the update itself.
        measured = {k: float(v) for k, v in row.items() if k.startswith(MEASURED_PREFIXES) and v is not None}
        metric_sink.log_metrics(measured, state.update)


# ---------------------------------------------------------------------------------------------------------------
# When to validate, when a ramp has diverged


def _validation_due(val_cfg: ValidationConfig, stream: Stream, first_micro_batch: int, state: RunState) -> bool:
    """After the update just taken (which began at `first_micro_batch`)."""
    if val_cfg.every_updates is not None:
        return state.update % val_cfg.every_updates == 0
    if val_cfg.every_epochs <= 0:
        return False
    before = stream.epochs_after(first_micro_batch) / val_cfg.every_epochs
    after = stream.epochs_after(state.micro_batches_done) / val_cfg.every_epochs
    return math.floor(after + 1e-9) > math.floor(before + 1e-9)


def _pause_due(pause_after_update: Optional[int], state: RunState) -> bool:
    """Whether the run pauses here: at or past `pause_after_update`, right after a validation, i.e. the newest
    metrics row is this update's (so the paused curve ends on a measurement; a run resumed at its pause has that
    measurement as its newest row)."""
    if pause_after_update is None or state.update < pause_after_update or state.status != "ok":
        return False
    rows = state.log.metrics_rows
    return bool(rows) and int(rows[-1]["update"]) == state.update


def _diverged(val_cfg: ValidationConfig, log: RunLog) -> bool:
    """The watched loss (val, else stabilize) has blown up (validation.diverged); never when the check is off."""
    if not val_cfg.divergence_factor:
        return False
    watched = log.series("val_loss") or log.series("stabilize_loss")
    return diverged(watched, val_cfg.divergence_factor, val_cfg.divergence_window)


# ---------------------------------------------------------------------------------------------------------------
# Finish


def _bucket_summary(run: Run, state: RunState) -> Optional[dict[str, Any]]:
    """The aspect-ratio buckets of run_summary.json: the settings, and each bucket's image counts and its last
    measured validation losses; None when every image was a centre-cropped square."""
    from rangefinder.data.buckets import bucket_name, bucket_table

    settings = run.settings
    if settings.buckets is None or settings.placements is None:
        return None
    placed = settings.placements
    table = bucket_table({"train": [placed[it.id] for it in settings.train_items],
                          **{name: [placed[it.id] for it in items] for name, items in settings.val_items.items()}})
    last = state.log.metrics_rows[-1] if state.log.metrics_rows else {}
    for row in table:
        for name in settings.val_items:
            loss = last.get(f"{name}_loss_{row['bucket']}")
            if loss is not None:
                row[f"{name}_loss"] = loss
    return {**settings.buckets.to_json(), "table": table,
            "train_buckets": [bucket_name(b) for b in settings.train_buckets or []]}


def _latent_hw(run: Run) -> tuple[int, int]:
    """The (h, w) of the run's first validation set's latents (the training resolution's without validation)."""
    if run.data.val_sets:
        return int(run.data.val_sets[0].latents.shape[-2]), int(run.data.val_sets[0].latents.shape[-1])
    side = run.data.data_cfg.resolution // 2 ** (len(run.sd.vae.config.block_out_channels) - 1)
    return side, side


def validation_weighting_over(family: Family, num_buckets: int, sizes: list[tuple[int, int]]) -> dict[str, Any]:
    """run_summary.json's `validation_weighting`: the family's, at the first of the validation latents' (h, w)
    `sizes`; where a flow family's grid moves with the image size (Flux's dynamic shift) and the sizes give more than
    one grid (aspect buckets), with `grid_span`, each sigma's lowest and highest over them: a per-sigma column mixes
    them, and the first size's sigma alone, which its label said, is not what it measured."""
    weighting = family.validation_weighting(num_buckets, sizes[0]).as_dict()
    grids = {g for hw in sizes if (g := family.validation_weighting(num_buckets, hw).grid) is not None}
    if len(grids) > 1:
        weighting["grid_span"] = [[min(g[k] for g in grids), max(g[k] for g in grids)] for k in range(num_buckets)]
    return weighting


def _finish(run: Run, state: RunState, *, save_final: bool, seconds: float, cpu_seconds: float) -> TrainResult:
    """Write the final weights (a finished, undiverged run) and run_summary.json; the run's result."""
    settings, log = run.settings, state.log
    if not trainable_finite(run):
        state.status = "diverged"  # never a final/ of NaN weights
    final_dir = None
    if save_final and state.status == "ok" and run.main:
        final_dir = settings.out_dir / "final"
        if run.cfg.channels_last:
            run.sd.unet.to(memory_format=torch.contiguous_format)  # safetensors writes contiguous tensors only
        # the average (EMA's, a schedule-free optimizer's) is what it saves
        run.method.epochs_trained = run.stream.epochs_after(state.micro_batches_done)
        run.method.spec_facts = SpecFacts(title=state.title, resolution=run.data.data_cfg.resolution,
                                          date=state.started or None)
        with run.schedule_free_eval(), run.ema_weights(on=True), run.fp32_weights(), atomic_dir(final_dir) as tmp:
            run.method.save_final(run.sd, tmp)
    run.accelerator.wait_for_everyone()

    val_series = log.series("val_loss")
    best = int(np.nanargmin(val_series)) if val_series and np.isfinite(val_series).any() else None
    result = TrainResult(
        status=state.status,
        updates=state.update,
        planned_updates=run.stream.total_updates,
        epochs=run.stream.epochs_after(state.micro_batches_done),
        best_val_loss=None if best is None else float(val_series[best]),
        best_update=None if best is None else int(log.rows_with("val_loss")[best]["update"]),
        out_dir=settings.out_dir,
        metrics_csv=log.metrics_path,
        updates_csv=log.updates_path,
        summary_path=settings.out_dir / "run_summary.json",
        final_dir=final_dir,
        checkpoints=checkpoints.list_checkpoints(settings.ckpt_root),
        resumed_from=state.resumed_from,
        cache={"latents": run.data.latent_stats.as_dict(), "text": run.data.text_stats.as_dict()},
        family=run.family.name,
        curve={c: tuple(float("nan") if r.get(c) is None else float(r[c]) for r in log.metrics_rows)
               for c in log.metric_columns},
    )
    if run.main:
        updates_here = state.update - (state.resumed_from or 0)
        summary = result.as_dict() | {
            "plan": settings.plan.model_dump(),
            # The settings as given (a copy of them trains as they say on another machine); what auto became: below.
            "training": run.cfg.model_dump() | {"mixed_precision": settings.mixed_precision_given},
            "validation": run.val_cfg.model_dump(),
            "train_on": settings.train_on,
            "resolution": run.data.data_cfg.resolution,
            # the run's start (a resumed run's too), its deliverables' model-spec date; None: resumed from an older
            # rangefinder's checkpoint, which did not record it
            "started": state.started or None,
            "title": state.title,  # their model-spec title
            "buckets": _bucket_summary(run, state),
            "family": run.family.name,  # detected from the base model (models/loading.py: detect_family)
            "prediction_type": run.family.prediction_type,
            # how val_loss combines its per-bucket (per-sigma) losses, and the flow families' sigma grid
            "validation_weighting": validation_weighting_over(
                run.family, run.val_cfg.timesteps,
                [_latent_hw(run), *((int(s.latents.shape[-2]), int(s.latents.shape[-1]))
                                    for s in run.data.val_sets if s.name == "val")]),
            "compile": "on" if settings.compile else "off",  # training.compile resolved
            "mixed_precision_used": run.cfg.mixed_precision,  # training.mixed_precision resolved (auto: per device)
            "use_ema_used": run.ema is not None,  # training.use_ema resolved (TrainingConfig.keeps_ema)
            "seconds": seconds,  # the loop's wall time (loading and encoding excluded)
            "cpu_seconds": cpu_seconds,  # this process' CPU time in the loop (all threads)
            "torch_threads": torch.get_num_threads(),  # CPU threads (RANGEFINDER_TORCH_THREADS; local runs: 1)
            "updates_per_second": updates_here / seconds if seconds > 0 else None,
            # (item, k) pairs each process put through the UNet in validation (training.validation.Shard)
            "validation_pairs_by_rank": run.val_shard.pairs_by_rank,
        }
        write_json(result.summary_path, summary)
    return result
