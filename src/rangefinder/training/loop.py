"""One training run: the loop the LR range test, the constant fine-tune and the full-data retrain share.

Reads top to bottom: settings -> device -> model -> data (cached latents and text) -> optimizer -> resume -> loop
(micro-batches, update, validation, checkpoint) -> final weights. Method specifics (which weights train, how
prompts are encoded, what is saved) live behind methods/base.Method; the image stream in data.py; validation in
validation.py; checkpoints in checkpoints.py.

Outputs under out_dir: `metrics.csv` (one row per validation measurement; the curve CSV), `updates.csv` (one row
per update), `checkpoints/`, `final/` (the method's deliverable; a StableDiffusionPipeline folder for full
fine-tuning) and `run_summary.json`.

With EMA on, validation measures the raw weights (the curve is the training trajectory the LR and step choices are
read from); the EMA weights are what `final/` holds.
"""

from __future__ import annotations

import contextlib
import csv
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from rangefinder.config import DataConfig, ModelConfig, TrainingConfig, ValidationConfig, plan_for
from rangefinder.errors import ConfigError, DataError
from rangefinder.formats import checkpoints
from rangefinder.formats.atomic import atomic_dir, atomic_path, write_json
from rangefinder.training import MetricSink
from rangefinder.training.caching import (
    CacheStats,
    VaeEncoder,
    cache_root,
    cached_latents,
    cached_text_embeddings,
    file_sha256,
    latent_cache_dir,
    text_cache_dir,
    tokenize,
)
from rangefinder.training.data import CachedLatents, EncodedOnTheFly, ImageStream
from rangefinder.training.methods import make_method
from rangefinder.training.schedules import make_schedule
from rangefinder.training.validation import ValidationSet, diverged, measure, preserved_rng

TrainOn = Literal["train", "train+val"]


@dataclass
class TrainResult:
    status: str  # "ok" | "diverged"
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

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: (str(v) if isinstance(v, Path) else [str(p) for p in v] if k == "checkpoints" else v) for k, v in d.items()}


def train(
    cfg: TrainingConfig,
    val_cfg: ValidationConfig,
    *,
    split_dir: Union[str, Path],
    model: Union[ModelConfig, str, Path, None],
    out_dir: Union[str, Path],
    train_on: TrainOn = "train",
    metric_sink: Optional[MetricSink] = None,
    data: Optional[DataConfig] = None,
    save_final: bool = True,
) -> TrainResult:
    """Train one run and write its curve, checkpoints and final weights under out_dir.

    `data` gives the resolution and crop (None: the base model's native resolution, centre-cropped).
    `train_on="train+val"` trains on both sets (the full-data retrain); the val set is then not measured.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed

    from rangefinder.data.pixels import load_rgb, to_model_array
    from rangefinder.data.split import read_split
    from rangefinder.models.loading import load_sd_components

    # --- settings: everything that can be wrong fails here, before anything heavy -----------------------------
    cfg, val_cfg = _revalidated(cfg), _revalidated(val_cfg)
    if train_on not in ("train", "train+val"):
        raise ConfigError(f"train_on must be 'train' or 'train+val' (got {train_on!r})")
    split = read_split(split_dir)
    train_items = list(split.train) + (list(split.val) if train_on == "train+val" else [])
    if not train_items:
        raise DataError(f"split {split_dir} has no training images; re-run `rangefinder split` with more images")
    run_plan = plan_for(cfg, len(train_items))  # ConfigError e.g. for a batch larger than the set with drop_last
    schedule = make_schedule(cfg, run_plan.total_updates, run_plan.updates_per_epoch, run_plan.lr or cfg.lr)
    method = make_method(cfg)
    val_sets_items = {"val": list(split.val) if train_on == "train" else [], "stabilize": list(split.stabilize)}
    validating = val_cfg.enabled() and any(val_sets_items.values())
    out_dir = Path(out_dir)
    ckpt_root = out_dir / "checkpoints"
    _check_out_dir(out_dir, ckpt_root, cfg.resume)
    if cfg.use_8bit_adam and not torch.cuda.is_available():
        raise ConfigError("training.use_8bit_adam needs a CUDA GPU (bitsandbytes); set it false to use AdamW")
    model_cfg = model if isinstance(model, ModelConfig) else ModelConfig(base_model=None if model is None else str(model))

    # --- device and precision (accelerate); gradient accumulation is done by hand below ----------------------
    # accelerate keeps its settings process-wide; each train() call is its own run and may use another precision
    # (the process group, PartialState, is kept).
    AcceleratorState._reset_state()
    # Without an accelerator, say so: accelerate then runs several processes (torchrun, accelerate launch) on gloo.
    no_accelerator = not (torch.cuda.is_available() or torch.backends.mps.is_available())
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, cpu=no_accelerator)
    if accelerator.num_processes != cfg.world_size:
        raise ConfigError(
            f"training.world_size is {cfg.world_size} but accelerate started {accelerator.num_processes} processes; "
            "set world_size to the number of processes (it changes the batch arithmetic)"
        )
    device, rank, main = accelerator.device, accelerator.process_index, accelerator.is_main_process
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.mixed_precision, torch.float32)
    set_seed(cfg.seed)  # adapters' initial weights come from the global RNG

    # --- model ---------------------------------------------------------------------------------------------
    sd = load_sd_components(model_cfg)
    sd.vae.requires_grad_(False)
    _to(sd.vae, device, torch.float32)  # encodes once: fp32 avoids the SD VAE's fp16 overflow
    method.setup(sd, weight_dtype)
    sd.unet.eval()  # frozen modules stay in eval mode; the loop switches the trainable ones
    sd.text_encoder.eval()
    for m in (sd.unet, sd.text_encoder):
        if not any(m is t for t in method.trainable_modules().values()):
            _to(m, device)
    if cfg.prediction_type is not None:
        sd.noise_scheduler.register_to_config(prediction_type=cfg.prediction_type)
    prediction_type = sd.noise_scheduler.config.prediction_type
    if prediction_type not in ("epsilon", "v_prediction"):
        raise ConfigError(f"training.prediction_type: the base model predicts {prediction_type!r}; set epsilon or v_prediction")
    num_timesteps = sd.noise_scheduler.config.num_train_timesteps
    if data is None:
        vae_scale = 2 ** (len(sd.vae.config.block_out_channels) - 1)
        data = DataConfig(resolution=int(sd.unet.config.sample_size) * vae_scale)
    if cfg.gradient_checkpointing:
        for m in method.trainable_modules().values():
            if hasattr(m, "enable_gradient_checkpointing"):
                m.enable_gradient_checkpointing()
            elif hasattr(m, "gradient_checkpointing_enable"):
                m.gradient_checkpointing_enable()
    if cfg.channels_last:
        # NHWC convolution weights; the convolutions then run NHWC whatever the inputs' layout.
        sd.unet.to(memory_format=torch.channels_last)

    # --- data: latents and text embeddings, encoded once per dataset and base model ------------------------
    def load_array(path: Path) -> np.ndarray:  # (3, H, W) in [-1, 1]
        return to_model_array(load_rgb(path), data.resolution, data.center_crop)

    all_items = {it.id: it for it in train_items + val_sets_items["val"] + val_sets_items["stabilize"]}
    paths = {i: split.path_of(it) for i, it in all_items.items()}
    keys = {i: file_sha256(p) for i, p in paths.items()}  # content hash: the cache key and the sample seed
    encoder = VaeEncoder(sd.vae, device, cfg.latent_sampling, cfg.seed)
    root = cache_root(cfg.cache_dir)
    latent_stats, text_stats = CacheStats(), CacheStats()
    latent_folder = latent_cache_dir(root, encoder, data.resolution, data.center_crop)
    with accelerator.main_process_first():  # one process encodes, the others then read the cache
        # Each distinct image once (the stabilize subset is part of train): (N, 4, h, w) latents, and of the
        # mirrored images when flipping; without the cache only the validation images are encoded up front.
        val_item_ids = {it.id for items in val_sets_items.values() for it in items}
        encode_now = [it for i, it in all_items.items() if cfg.cache_latents or i in val_item_ids]
        z, z_flipped = cached_latents(
            [paths[it.id] for it in encode_now], [keys[it.id] for it in encode_now], encoder, load_array,
            latent_folder, flipped=cfg.cache_latents and cfg.random_flip, stats=latent_stats,
        )
        row_of = {it.id: r for r, it in enumerate(encode_now)}

        def rows_for(items):
            return torch.tensor([row_of[it.id] for it in items], dtype=torch.long)

        if cfg.cache_latents:
            train_rows = rows_for(train_items)
            train_latents = CachedLatents(z[train_rows], None if z_flipped is None else z_flipped[train_rows])
        else:
            train_latents = EncodedOnTheFly(
                [paths[it.id] for it in train_items], [keys[it.id] for it in train_items], encoder, load_array
            )
        val_latents = {name: z[rows_for(items)] for name, items in val_sets_items.items() if items}
        if cfg.cache_latents:  # the VAE is not needed again; give its memory back
            _to(sd.vae, torch.device("cpu"))

        captions = [method.transform_caption(it.text) for it in train_items]
        train_ids, empty_ids = tokenize(sd.tokenizer, captions), tokenize(sd.tokenizer, [""])
        val_ids = {name: tokenize(sd.tokenizer, [method.transform_caption(it.text) for it in items])
                   for name, items in val_sets_items.items() if items}
        if method.text_encoder_changes:
            # (N, 77) ids: prompts are encoded every micro-batch through the training text encoder.
            train_cond, empty_cond, val_cond = train_ids, empty_ids, val_ids
        else:
            # (N, 77, D) hidden states, computed once with the frozen encoder.
            text_folder = text_cache_dir(root, sd.text_encoder)
            def embed(ids):
                return cached_text_embeddings(
                    ids, lambda x: method.encode_prompt(sd.text_encoder, x), text_folder, device, stats=text_stats
                )
            train_cond, empty_cond = embed(train_ids), embed(empty_ids)
            val_cond = {name: embed(ids) for name, ids in val_ids.items()}
    val_sets = [
        ValidationSet(name, [it.id for it in items], val_latents[name], val_cond[name])
        for name, items in val_sets_items.items()
        if items
    ]
    stream = ImageStream.from_plan(run_plan, cfg.seed)

    # --- optimizer, EMA -----------------------------------------------------------------------------------
    groups = method.param_groups()
    trainable = method.trainable_parameters()
    optimizer = _make_optimizer(cfg, groups, schedule(0), device)
    ema = None
    if cfg.use_ema:
        from diffusers.training_utils import EMAModel

        ema = EMAModel(trainable, decay=cfg.ema_decay)
        ema.to(device)
    modules = method.trainable_modules()
    prepared = {name: accelerator.prepare(m) for name, m in modules.items()}  # DDP-wrapped when multi-process
    optimizer = accelerator.prepare(optimizer)
    unet = prepared.get("unet", sd.unet)
    text_encoder = prepared.get("text_encoder", sd.text_encoder)
    train_gen = torch.Generator().manual_seed(cfg.seed + rank)  # all training randomness; CPU, device-independent

    # --- resume -------------------------------------------------------------------------------------------
    log = _RunLog(out_dir, val_cfg.timesteps, main)
    update, micro_batches_done, resumed_from = 0, 0, None
    loss_since_row = [0.0, 0]  # sum of per-update train losses since the last metrics row, and their count
    status = "ok"
    ckpt = checkpoints.latest_checkpoint(ckpt_root) if cfg.resume else None
    if ckpt is not None:
        saved = checkpoints.load(ckpt, rank)
        state = saved["state"]
        _check_same_run(state, cfg, run_plan.total_updates, len(train_items))
        method.load_trainable_state_dict({k: v.to(device) for k, v in saved["weights"].items()})
        optimizer.load_state_dict(saved["optimizer"])
        if ema is not None and saved["ema"] is not None:
            ema.load_state_dict(saved["ema"])
        if saved["scaler"] is not None and accelerator.scaler is not None:
            accelerator.scaler.load_state_dict(saved["scaler"])
        _set_rng(saved["rng"], train_gen)
        update, micro_batches_done = state["update"], state["micro_batches_done"]
        loss_since_row, status = state["loss_since_row"], state["status"]
        log.restore(state["metrics_rows"], state["update_rows"])
        resumed_from = update

    def validate(at_update: int, last: bool = False) -> None:
        """One row of metrics.csv: mean and per-bucket losses on val and stabilize, RNGs untouched. The stabilize
        subset is measured at every `stabilize_every`th row (the row count survives a resume) and at the last."""
        nth = len(log.metrics_rows)
        with preserved_rng((train_gen,)), _ema_weights(ema, trainable, on=not cfg.schedule.endswith("-ramp")):
            for m in modules.values():
                m.eval()
            row: dict[str, Any] = {"update": at_update, "epoch": stream.epochs_after(micro_batches_done)}
            # The update-0 baseline has taken no step: its LR is 0, the start of a range test's curve.
            row["lr"] = log.update_rows[-1]["lr"] if log.update_rows else 0.0
            row["train_loss"] = loss_since_row[0] / loss_since_row[1] if loss_since_row[1] else None
            te = accelerator.unwrap_model(text_encoder)
            for vset in val_sets:
                sparse = vset.name == "stabilize" and len(val_sets) > 1 and not last
                if sparse and nth % val_cfg.stabilize_every != 0:
                    continue
                mean, buckets = measure(
                    vset,
                    unet=accelerator.unwrap_model(unet),
                    encode=(lambda ids: method.encode_prompt(te, ids)) if method.text_encoder_changes else None,
                    noise_scheduler=sd.noise_scheduler,
                    prediction_type=prediction_type,
                    num_buckets=val_cfg.timesteps,
                    seed=val_cfg.seed,
                    batch_size=val_cfg.batch_size,
                    device=device,
                    autocast=accelerator.autocast,
                )
                row[f"{vset.name}_loss"] = mean
                row.update({f"{vset.name}_loss_b{k}": b for k, b in enumerate(buckets)})
            for m in modules.values():
                m.train()
        loss_since_row[:] = [0.0, 0]
        log.add_metrics(row)
        if metric_sink is not None and main:
            # Only the measurements: lr, epoch and the per-update train loss were logged with the update itself.
            measured = {k: float(v) for k, v in row.items() if k.startswith(("val_", "stabilize_")) and v is not None}
            metric_sink.log_metrics(measured, at_update)

    if validating and update == 0:
        validate(0)  # the baseline: the base model before any update

    # --- the loop -----------------------------------------------------------------------------------------
    from tqdm.auto import tqdm

    for m in modules.values():
        m.train()
    progress = tqdm(total=stream.total_updates, initial=update, disable=not main, desc=f"train ({cfg.schedule})",
                    unit="update", dynamic_ncols=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    first_update = update
    while update < stream.total_updates and status == "ok":
        micro_steps = stream.update_micro_batches(update)
        # Each image's loss is weighted 1/(images in this update) so the update's gradient is the mean over all of
        # its images whatever their split into micro-batches and processes (DDP averages, hence x world size).
        images_in_update = sum(len(stream.micro_batch(j)) for j in micro_steps)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for j in micro_steps:
            sync = j == micro_steps[-1]
            with contextlib.ExitStack() as stack:
                if not sync:
                    for pm in prepared.values():
                        stack.enter_context(accelerator.no_sync(pm))
                idx = stream.local(j, rank)
                weight = accelerator.num_processes / images_in_update
                if not idx:  # this process got no image in a partial last chunk: a zero-weight stand-in
                    idx, weight = stream.micro_batch(j)[:1], 0.0
                B = len(idx)
                flips = (torch.rand(B, generator=train_gen) < 0.5).tolist() if cfg.random_flip else [False] * B
                drop = torch.rand(B, generator=train_gen) < cfg.cond_dropout if cfg.cond_dropout > 0 else None
                timesteps = torch.randint(0, num_timesteps, (B,), generator=train_gen)
                latents = train_latents.get(idx, flips, device)  # (B, 4, h, w) scaled latents
                noise = torch.randn(latents.shape, generator=train_gen)
                if cfg.noise_offset:
                    # Offset noise (Guttenberg 2023, crosslabs.org/blog/diffusion-with-offset-noise): lets the model
                    # shift a whole channel's mean, i.e. learn very dark and very bright images.
                    noise = noise + cfg.noise_offset * torch.randn((B, latents.shape[1], 1, 1), generator=train_gen)
                noise, timesteps = noise.to(device), timesteps.to(device)
                cond = train_cond[idx]
                if drop is not None:
                    # Caption dropout: train the unconditional branch classifier-free guidance needs (Ho & Salimans 2022).
                    cond = torch.where(drop.view(-1, *([1] * (cond.dim() - 1))), empty_cond.expand_as(cond), cond)
                cond = cond.to(device)
                with accelerator.autocast():
                    hidden = method.encode_prompt(text_encoder, cond) if method.text_encoder_changes else cond
                    noisy = sd.noise_scheduler.add_noise(latents, noise, timesteps)
                    pred = unet(noisy, timesteps, hidden.to(noisy.dtype), return_dict=False)[0]
                target = noise if prediction_type == "epsilon" else sd.noise_scheduler.get_velocity(latents, noise, timesteps)
                per_image = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))  # (B,)
                weighted = per_image * _min_snr_weights(cfg.min_snr_gamma, sd.noise_scheduler, timesteps, prediction_type)
                accelerator.backward(weighted.sum() * weight)
                loss_sum += per_image.detach().double().sum() * (weight > 0)
        # One update: clip, set this update's LR, step, hooks, EMA.
        clip = cfg.max_grad_norm if cfg.max_grad_norm is not None else float("inf")
        grad_norm = float(accelerator.clip_grad_norm_(trainable, clip))
        lr = schedule(update)
        for g in optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        method.after_optimizer_step()
        if ema is not None:
            ema.step(trainable)
        update += 1
        micro_batches_done = micro_steps[-1] + 1

        # Log: train loss is the plain MSE mean over the update's images (comparable with the validation loss).
        train_loss = float(accelerator.reduce(loss_sum, "sum") if accelerator.num_processes > 1 else loss_sum) / images_in_update
        epoch = stream.epochs_after(micro_batches_done)
        log.add_update({"update": update, "epoch": epoch, "lr": lr, "train_loss": train_loss, "grad_norm": grad_norm})
        loss_since_row[0] += train_loss
        loss_since_row[1] += 1
        if metric_sink is not None and main:
            metric_sink.log_metrics({"train_loss": train_loss, "lr": lr, "grad_norm": grad_norm, "epoch": epoch}, update)
        progress.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.3g}", refresh=False)
        progress.update(1)

        # Validation: every N updates, or whenever an every-N-epochs boundary was crossed; and at the end.
        last = update == stream.total_updates
        if validating and (_due(val_cfg, stream, micro_steps[0], micro_batches_done, update) or last):
            validate(update, last)
            watched = log.series("val_loss") or log.series("stabilize_loss")
            if schedule.is_ramp and val_cfg.divergence_factor and diverged(watched, val_cfg.divergence_factor, val_cfg.divergence_window):
                status = "diverged"

        # Checkpoint: every N updates and at the end (also when stopping on divergence).
        every = cfg.checkpoint_every_updates
        if every and (update % every == 0 or last or status != "ok"):
            _save_checkpoint(
                ckpt_root, update, cfg, accelerator, method, optimizer, ema, train_gen, log, run_plan.total_updates,
                len(train_items), micro_batches_done, loss_since_row, status,
            )
    progress.close()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0

    # --- final weights and summary ------------------------------------------------------------------------
    final_dir = None
    if save_final and status == "ok" and main:
        final_dir = out_dir / "final"
        if cfg.channels_last:
            sd.unet.to(memory_format=torch.contiguous_format)  # safetensors writes contiguous tensors only
        with _ema_weights(ema, trainable, on=True), atomic_dir(final_dir) as tmp:  # the average is what it saves
            method.save_final(sd, tmp)
    accelerator.wait_for_everyone()

    val_series = log.series("val_loss")
    best = int(np.nanargmin(val_series)) if val_series and np.isfinite(val_series).any() else None
    result = TrainResult(
        status=status,
        updates=update,
        planned_updates=stream.total_updates,
        epochs=stream.epochs_after(micro_batches_done),
        best_val_loss=None if best is None else float(val_series[best]),
        best_update=None if best is None else int(log.rows_with("val_loss")[best]["update"]),
        out_dir=out_dir,
        metrics_csv=log.metrics_path,
        updates_csv=log.updates_path,
        summary_path=out_dir / "run_summary.json",
        final_dir=final_dir,
        checkpoints=checkpoints.list_checkpoints(ckpt_root),
        resumed_from=resumed_from,
        cache={"latents": latent_stats.as_dict(), "text": text_stats.as_dict()},
    )
    if main:
        summary = result.as_dict() | {
            "plan": run_plan.model_dump(),
            "training": cfg.model_dump(),
            "validation": val_cfg.model_dump(),
            "train_on": train_on,
            "resolution": data.resolution,
            "prediction_type": prediction_type,
            "seconds": seconds,  # the loop's wall time (loading and encoding excluded)
            "cpu_seconds": cpu_seconds,  # this process' CPU time in the loop (all threads)
            "updates_per_second": (update - first_update) / seconds if seconds > 0 else None,
        }
        write_json(result.summary_path, summary)
    return result


# ---------------------------------------------------------------------------------------------------------------
# The pieces the loop calls


def _revalidated(cfg):
    """Run the pydantic checks again (a config may have been built with model_construct or edited in place)."""
    from pydantic import ValidationError

    from rangefinder.config import format_validation_error

    section = "training." if isinstance(cfg, TrainingConfig) else "validation."
    try:
        return type(cfg).model_validate(cfg.model_dump())
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix=section)) from None


def _check_out_dir(out_dir: Path, ckpt_root: Path, resume: bool) -> None:
    if resume:
        return
    if checkpoints.list_checkpoints(ckpt_root) or (out_dir / "run_summary.json").exists():
        raise ConfigError(
            f"output folder {out_dir} already holds a run; pass --resume (training.resume) to continue it, "
            "or choose an empty folder"
        )


def _check_same_run(state: dict, cfg: TrainingConfig, total_updates: int, train_images: int) -> None:
    ignore = {"resume", "checkpoint_every_updates", "keep_checkpoints", "cache_dir"}
    before = {k: v for k, v in state["training"].items() if k not in ignore}
    now = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in ignore}
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    if changed or state["total_updates"] != total_updates or state["train_images"] != train_images:
        what = ", ".join(f"training.{k}" for k in changed) or "the training set"
        raise ConfigError(
            f"cannot resume: the checkpoint was written with different settings ({what}); "
            "resume with the same settings and data, or start in an empty folder"
        )


def _make_optimizer(cfg: TrainingConfig, groups: list[dict], lr: float, device: torch.device):
    kwargs = dict(lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    if cfg.use_8bit_adam:
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError(
                "training.use_8bit_adam needs bitsandbytes: pip install 'rangefinder[cuda]', or set it false"
            ) from None
        return bnb.optim.AdamW8bit(groups, **kwargs)
    # The fused kernel does the whole update in one pass (CUDA, and CPU in recent torch); it is not in older builds.
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(groups, **kwargs)


def _min_snr_weights(gamma: Optional[float], scheduler, timesteps: torch.Tensor, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma loss weights (Hang et al. 2023, arXiv:2303.09556): min(SNR, gamma) / SNR for epsilon, and
    min(SNR, gamma) / (SNR + 1) for v-prediction; 1 when off."""
    if gamma is None:
        return torch.ones(timesteps.shape, device=timesteps.device)
    from diffusers.training_utils import compute_snr

    snr = compute_snr(scheduler, timesteps)
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1) if prediction_type == "v_prediction" else clipped / snr


def _due(val_cfg: ValidationConfig, stream: ImageStream, first_mb: int, mb_done: int, update: int) -> bool:
    if val_cfg.every_updates is not None:
        return update % val_cfg.every_updates == 0
    if val_cfg.every_epochs <= 0:
        return False
    before = stream.epochs_after(first_mb) / val_cfg.every_epochs
    after = stream.epochs_after(mb_done) / val_cfg.every_epochs
    return math.floor(after + 1e-9) > math.floor(before + 1e-9)


def _rng_states(train_gen: torch.Generator) -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "train_generator": train_gen.get_state(),
    }


def _set_rng(states: Optional[dict], train_gen: torch.Generator) -> None:
    if not states:
        return
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    train_gen.set_state(states["train_generator"])


def _save_checkpoint(root, update, cfg, accelerator, method, optimizer, ema, train_gen, log, total_updates,
                     train_images, micro_batches_done, loss_since_row, status) -> None:
    if accelerator.is_main_process:
        checkpoints.begin(root, update)
    accelerator.wait_for_everyone()
    tmp = checkpoints.tmp_folder(root, update)
    checkpoints.write_rng(tmp, accelerator.process_index, _rng_states(train_gen))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {
            "update": update,
            "micro_batches_done": micro_batches_done,
            "total_updates": total_updates,
            "train_images": train_images,
            "loss_since_row": list(loss_since_row),
            "status": status,
            "training": cfg.model_dump(mode="json"),
            "metrics_rows": log.metrics_rows,
            "update_rows": log.update_rows,
        }
        checkpoints.write_main(
            tmp,
            weights={k: v.cpu() for k, v in method.trainable_state_dict().items()},
            optimizer=optimizer.state_dict(),
            ema=ema.state_dict() if ema is not None else None,
            scaler=accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
            state=state,
        )
        checkpoints.commit(tmp, cfg.keep_checkpoints)
    accelerator.wait_for_everyone()


@contextlib.contextmanager
def _ema_weights(ema, params, on: bool):
    """The EMA weights in place of the trained ones while inside (put back bit for bit after), when `on` and EMA is
    kept. The run saves them, and validation measures them so that the step window is read on the model it
    recommends (diffusers' example trainers validate the same way); not on ramps, where the average lags behind the
    climbing LR and would shift the range test's curve towards higher LRs, the lag the analysis avoids."""
    if ema is None or not on:
        yield
        return
    ema.store(params)
    ema.copy_to(params)
    try:
        yield
    finally:
        ema.restore(params)


def _to(module: torch.nn.Module, device: torch.device, dtype: Optional[torch.dtype] = None) -> None:
    """Move/cast only when needed (diffusers warns on every cast of a loaded model)."""
    p = next(module.parameters(), None)
    if p is None or (p.device == torch.device(device) and (dtype is None or p.dtype == dtype)):
        return
    module.to(device, dtype) if dtype is not None else module.to(device)


class _RunLog:
    """metrics.csv (rewritten whole, atomically, per row) and updates.csv (appended per update)."""

    def __init__(self, out_dir: Path, num_buckets: int, write: bool) -> None:
        self.metrics_path, self.updates_path, self.write = out_dir / "metrics.csv", out_dir / "updates.csv", write
        buckets = [f"{s}_loss_b{k}" for s in ("val", "stabilize") for k in range(num_buckets)]
        self.metric_columns = ["update", "epoch", "lr", "train_loss", "val_loss", "stabilize_loss"] + buckets
        self.update_columns = ["update", "epoch", "lr", "train_loss", "grad_norm"]
        self.metrics_rows: list[dict[str, Any]] = []
        self.update_rows: list[dict[str, Any]] = []
        if write:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._rewrite_metrics()
            self._rewrite_updates()

    def restore(self, metrics_rows: list[dict], update_rows: list[dict]) -> None:
        self.metrics_rows, self.update_rows = list(metrics_rows), list(update_rows)
        if self.write:
            self._rewrite_metrics()
            self._rewrite_updates()

    def add_metrics(self, row: dict[str, Any]) -> None:
        self.metrics_rows.append(row)
        if self.write:
            self._rewrite_metrics()

    def add_update(self, row: dict[str, Any]) -> None:
        self.update_rows.append(row)
        if self.write:
            with open(self.updates_path, "a", newline="") as f:
                csv.DictWriter(f, self.update_columns).writerow(_cells(row, self.update_columns))

    def series(self, column: str) -> list[float]:
        return [float(r[column]) for r in self.rows_with(column)]

    def rows_with(self, column: str) -> list[dict]:
        return [r for r in self.metrics_rows if r.get(column) is not None]

    def _rewrite_metrics(self) -> None:
        _write_csv(self.metrics_path, self.metric_columns, self.metrics_rows)

    def _rewrite_updates(self) -> None:
        _write_csv(self.updates_path, self.update_columns, self.update_rows)


def _cells(row: dict, columns: list[str]) -> dict:
    # repr() round-trips a float exactly, so two runs' CSVs compare equal only if their numbers are bit-identical.
    return {c: ("" if row.get(c) is None else repr(row[c]) if isinstance(row[c], float) else row[c]) for c in columns}


def _write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        for r in rows:
            w.writerow(_cells(r, columns))
