"""The run's types: `RunSettings` (what the settings check established), `EncodedData` (the latents and text
conditioning, encoded once) and `Run` (every part of one run, fixed once set up).

A module of their own, beside the acts that make them (setup.py: settings, device, model, optimizer; encoding.py:
the data) and below the acts that use them (loop.py, validation, checkpointing.py, samples.py), so none of those
imports an act for its types (the hidden loop setup -> checkpointing -> setup that a type-only import made).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from rangefinder.config import DataConfig, ModelConfig, TrainingConfig, ValidationConfig
from rangefinder.data.buckets import BucketSettings, Placement, Size
from rangefinder.formats import checkpoints
from rangefinder.planning import Plan
from rangefinder.training.caching import CachedTextFiles, CacheStats
from rangefinder.training.captions import ShuffledCaptions
from rangefinder.training.data import LatentSource, Stream
from rangefinder.training.family import Denoiser, Family, ImageGeometry
from rangefinder.training.master import MasterWeights
from rangefinder.training.schedules import LRSchedule
from rangefinder.training.spec import TrainOn
from rangefinder.training.validation import Shard, ValidationSet

if TYPE_CHECKING:
    from accelerate import Accelerator

    from rangefinder.data.dataset import Item
    from rangefinder.data.split import Split
    from rangefinder.models.loading import SDComponents
    from rangefinder.training.methods.base import Method


@dataclass
class RunSettings:
    cfg: TrainingConfig
    val_cfg: ValidationConfig
    train_on: TrainOn
    split: Split
    train_items: list[Item]  # train, or train + val for the full-data retrain
    val_items: dict[str, list[Item]]  # "val" (empty when training on it) and "stabilize"
    plan: Plan
    schedule: LRSchedule
    method: Method
    model_cfg: ModelConfig
    out_dir: Path
    # sha256 of every image the run reads, by item id, checked against the split's manifests (the latent cache's keys)
    file_hashes: dict[int, str] = field(default_factory=dict)
    compile: bool = False  # training.compile resolved (auto -> on or off); written to run_summary.json
    # training.mixed_precision as given (`cfg` holds it resolved for this machine): run_summary.json's `training`
    # section holds the settings as given, and what `auto` became beside them (mixed_precision_used)
    mixed_precision_given: str = "auto"
    # Aspect-ratio buckets (data.bucketing), None when every image is a centre-cropped square; then where each
    # item (by id, every subset) goes, and the bucket of each training item as an index into `train_buckets`.
    buckets: Optional[BucketSettings] = None
    placements: Optional[dict[int, Placement]] = None
    train_buckets: Optional[list[Size]] = None  # the buckets training items are in, sorted by (width, height)
    train_bucket_of: Optional[list[int]] = None
    branch: bool = False  # TrainSpec.branch: the first checkpoint is another run's, continued under another schedule
    title: str = ""  # the deliverables' model-spec title: TrainSpec.title, else the output folder's name

    @property
    def ckpt_root(self) -> Path:
        return self.out_dir / checkpoints.RUN_DIR

    @property
    def validating(self) -> bool:
        return self.val_cfg.enabled() and any(self.val_items.values())


@dataclass
class EncodedData:
    data_cfg: DataConfig  # resolution and crop the latents were made at
    train_latents: LatentSource  # (B, 4, h, w) latents of training items, cached or encoded per micro-batch
    # (N, 77, D) hidden states of the training captions, computed once with the frozen encoder; or (N, 77) token ids
    # when the text encoder's output changes (prompts are then encoded every micro-batch). `empty_cond` is the same
    # for the empty caption (caption dropout).
    train_cond: torch.Tensor
    empty_cond: torch.Tensor
    val_sets: list[ValidationSet]
    latent_stats: CacheStats
    text_stats: CacheStats
    # The training captions' conditioning per micro-batch, when it is not train_cond (which is then empty): read
    # from the text cache (a frozen encoder: memory does not grow with the set), or with training.shuffle_tags
    # shuffled and encoded afresh (training/captions.py says why those are not cached).
    train_text: Optional[Union[ShuffledCaptions, CachedTextFiles]] = None
    # Each training item's original size, crop and target size, which the family adds to its conditioning per
    # micro-batch (family.with_images; SDXL's add_time_ids). Validation sets have theirs in their conditioning.
    train_geometry: list[ImageGeometry] = field(default_factory=list)


@dataclass
class Run:
    """One run's parts, fixed once setup is done: the loop reads them and never replaces them (what changes as it
    trains is state.RunState)."""

    settings: RunSettings
    accelerator: Accelerator
    sd: SDComponents
    family: Family
    data: EncodedData
    stream: Stream  # which images go into each micro-batch (one bucket each, when bucketed)
    optimizer: Any  # training.optimizer (training/optimizers.py), as accelerate prepared it
    ema: Any  # diffusers EMAModel of the trainable parameters, or None
    trainable: list[torch.nn.Parameter]  # what the optimizer updates (and EMA tracks), in a fixed order
    modules: dict[str, torch.nn.Module]  # the method's trainable modules
    prepared: dict[str, torch.nn.Module]  # the same as accelerate prepared them (DDP-wrapped when multi-process)
    denoiser: Denoiser  # the training forward pass, through the prepared modules
    eval_denoiser: Denoiser  # the same through the unwrapped modules (validation)
    val_shard: Shard = field(default_factory=Shard)  # this process' share of each validation pass
    # training.weights_dtype bf16: the fp32 masters of the bf16 weights (`trainable` is then the masters); else None
    master: Optional[MasterWeights] = None

    @property
    def cfg(self) -> TrainingConfig:
        return self.settings.cfg

    @property
    def val_cfg(self) -> ValidationConfig:
        return self.settings.val_cfg

    @property
    def method(self) -> Method:
        return self.settings.method

    @property
    def schedule(self) -> LRSchedule:
        return self.settings.schedule

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def main(self) -> bool:
        return bool(self.accelerator.is_main_process)

    @property
    def validating(self) -> bool:
        return self.settings.validating

    @contextlib.contextmanager
    def ema_weights(self, on: bool = True) -> Iterator[None]:
        """The EMA weights in place of the trained ones while inside (put back bit for bit after), when `on` and
        EMA is kept."""
        if self.ema is None or not on:
            yield
            return
        self.ema.store(self.trainable)
        self.ema.copy_to(self.trainable)
        if self.master is not None:  # the EMA went into the masters: the bf16 weights follow
            self.master.weights_out()
        try:
            yield
        finally:
            self.ema.restore(self.trainable)
            if self.master is not None:
                self.master.weights_out()

    def fp32_weights(self) -> contextlib.AbstractContextManager[None]:
        """With bf16 weights (training.weights_dtype), the module's parameters are their fp32 masters while inside:
        what a checkpoint or the saved model reads from the module, and what a resume loads into it. Else nothing."""
        return self.master.fp32_weights() if self.master is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def schedule_free_eval(self) -> Iterator[None]:
        """A schedule-free optimizer's averaged weights (its eval mode, x) in place of the ones it steps from (y)
        while inside: what it is measured, sampled and saved with. y is put back bit for bit after: train()'s lerp
        back from x is not exact in floating point, and validation must not change training."""
        from rangefinder.config import SCHEDULE_FREE_OPTIMIZERS

        if self.cfg.optimizer not in SCHEDULE_FREE_OPTIMIZERS:
            yield
            return
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.trainable]
        self.optimizer.eval()
        try:
            yield
        finally:
            self.optimizer.train()
            with torch.no_grad():
                for p, k in zip(self.trainable, kept, strict=True):
                    p.copy_(k)
