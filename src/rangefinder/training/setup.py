"""Setting up one training run, act by act, as `train()` (loop.py) calls them: the settings (checked before anything
heavy), the device (the launcher), the model, the data (latents and text encoded once), then the optimizer and EMA,
which complete the `Run` the loop trains with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import numpy as np
import torch

from rangefinder.config import (
    DataConfig,
    ModelConfig,
    Plan,
    SamplingConfig,
    TrainingConfig,
    ValidationConfig,
    plan_for,
    resolve_mixed_precision,
)
from rangefinder.data.buckets import BucketSettings, Placement, Size, bucket_array, bucket_name, image_size, place
from rangefinder.errors import ConfigError, DataError
from rangefinder.formats import checkpoints
from rangefinder.training.caching import (
    CachedLatentFiles,
    CachedTextFiles,
    CacheStats,
    LatentCache,
    VaeEncoder,
    cache_root,
    cached_text_embeddings,
    ensure_text_embeddings,
    latent_cache_dir,
    text_cache_dir,
)
from rangefinder.training.captions import ShuffledCaptions
from rangefinder.training.data import EncodedOnTheFly, LatentSource, Stream, make_stream
from rangefinder.training.families import family_for
from rangefinder.training.family import Denoiser, Family, ImageGeometry
from rangefinder.training.methods import make_method
from rangefinder.training.outdir import check_out_dir_free
from rangefinder.training.schedules import LRSchedule, make_schedule
from rangefinder.training.validation import Shard, ValidationSet

if TYPE_CHECKING:
    from accelerate import Accelerator

    from rangefinder.data.dataset import Item
    from rangefinder.data.split import Split
    from rangefinder.models.loading import SDComponents
    from rangefinder.training.methods.base import Method

TrainOn = Literal["train", "train+val"]


@dataclass(frozen=True)
class TrainSpec:
    """What one training run trains: its settings, the split it reads its images from, and the base model.

    `data` gives the resolution, crop and aspect-ratio buckets (None: the base model's native resolution, every
    image centre-cropped to a square).
    `train_on="train+val"` trains on both sets (the full-data retrain); the val set is then not measured.
    `sampling` asks for samples during training (samples.py: at the validations `every_validations` picks); None:
    none.
    """

    training: TrainingConfig
    validation: ValidationConfig
    split_dir: Union[str, Path]
    model: Union[ModelConfig, str, Path, None]
    data: Optional[DataConfig] = None
    train_on: TrainOn = "train"
    sampling: Optional[SamplingConfig] = None


# ---------------------------------------------------------------------------------------------------------------
# Settings: everything that can be wrong fails here, before anything heavy


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
    # Aspect-ratio buckets (data.bucketing), None when every image is a centre-cropped square; then where each
    # item (by id, every subset) goes, and the bucket of each training item as an index into `train_buckets`.
    buckets: Optional[BucketSettings] = None
    placements: Optional[dict[int, Placement]] = None
    train_buckets: Optional[list[Size]] = None  # the buckets training items are in, sorted by (width, height)
    train_bucket_of: Optional[list[int]] = None

    @property
    def ckpt_root(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def validating(self) -> bool:
        return self.val_cfg.enabled() and any(self.val_items.values())


def check_settings(spec: TrainSpec, out_dir: Union[str, Path]) -> RunSettings:
    from rangefinder.data.split import file_hashes, read_split

    cfg, val_cfg = _revalidated(spec.training), _revalidated(spec.validation)
    cfg = cfg.model_copy(update={"mixed_precision": resolve_mixed_precision(cfg.mixed_precision)})  # auto: per device
    split_dir, model, train_on = spec.split_dir, spec.model, spec.train_on
    if train_on not in ("train", "train+val"):
        raise ConfigError(f"train_on must be 'train' or 'train+val' (got {train_on!r})")
    split = read_split(split_dir)
    train_items = list(split.train) + (list(split.val) if train_on == "train+val" else [])
    if not train_items:
        raise DataError(f"split {split_dir} has no training images; re-run `rangefinder split` with more images")
    val_items = {"val": list(split.val) if train_on == "train" else [], "stabilize": list(split.stabilize)}
    # Every image still there and still the one that was split (DataError naming each that is not).
    hashes = file_hashes(split, train_items + val_items["val"] + val_items["stabilize"])
    buckets = BucketSettings.from_data_config(spec.data) if spec.data is not None else None
    placements: Optional[dict[int, Placement]] = None
    train_buckets: Optional[list[Size]] = None
    train_bucket_of: Optional[list[int]] = None
    bucket_counts: Optional[list[int]] = None
    if buckets is not None:
        placements = place_items(split, train_items + val_items["val"] + val_items["stabilize"], buckets)
        train_buckets = sorted({placements[it.id].bucket for it in train_items})
        index = {b: i for i, b in enumerate(train_buckets)}
        train_bucket_of = [index[placements[it.id].bucket] for it in train_items]
        bucket_counts = [train_bucket_of.count(i) for i in range(len(train_buckets))]
    # ConfigError e.g. for a batch larger than the set with drop_last
    run_plan = plan_for(cfg, len(train_items), bucket_counts)
    schedule = make_schedule(cfg, run_plan.total_updates, run_plan.updates_per_epoch, run_plan.lr or cfg.lr)
    method = make_method(cfg)
    if cfg.use_8bit_adam and not torch.cuda.is_available():
        raise ConfigError("training.use_8bit_adam needs a CUDA GPU (bitsandbytes); set it false to use AdamW")
    # The output folder last: every settings error above leaves nothing behind (the lock probe creates the folder).
    out_dir = Path(out_dir)
    check_out_dir_free(out_dir)  # another live run in out_dir: fail now, naming it
    _check_out_dir(out_dir, cfg.resume)
    if not isinstance(model, ModelConfig):
        model = ModelConfig(base_model=None if model is None else str(model))
    return RunSettings(cfg=cfg, val_cfg=val_cfg, train_on=train_on, split=split, train_items=train_items,
                       val_items=val_items, plan=run_plan, schedule=schedule, method=method, model_cfg=model,
                       out_dir=out_dir, file_hashes=hashes,
                       compile=resolve_compile(cfg.compile, run_plan.total_updates, torch.cuda.is_available()),
                       buckets=buckets, placements=placements, train_buckets=train_buckets,
                       train_bucket_of=train_bucket_of)


def place_items(split: Split, items: list[Item], buckets: BucketSettings) -> dict[int, Placement]:
    """Each item's bucket, from the size the split recorded (or, in an older split, the image file's header)."""
    out = {}
    for it in items:
        if it.id not in out:
            try:
                size = it.size or image_size(split.path_of(it))
            except OSError as e:
                raise DataError(f"cannot read image {split.path_of(it)} ({e}); restore it, or split again") from None
            out[it.id] = place(size, buckets)
    return out


# Runs of more updates than this compile under training.compile=auto. Why 1000: regional compilation of SD 1.5's
# 16 transformer blocks costs on the order of 30-60 s on an H100 (forward and backward graphs, and again for
# validation's no-grad forward), and torch.compile's usual training gain on a UNet is 10-30% of a ~0.2 s update
# (512 px, batch 4, bf16): 0.02-0.06 s saved per update, so it breaks even after roughly 500-3000 updates. 1000
# sits inside that range and keeps the range test's short ramps (a few hundred updates) eager. The bench's GPU rows
# (compile seconds and per-update gain, bench/RESULTS.md) are what should move it.
COMPILE_AUTO_MIN_UPDATES = 1000


def resolve_compile(setting: str, total_updates: int, cuda: bool) -> bool:
    """training.compile as on/off: `auto` compiles CUDA runs of more than COMPILE_AUTO_MIN_UPDATES updates only
    (on CPU inductor's compile time is seldom repaid; accelerate trains on the GPU whenever there is one)."""
    if setting == "auto":
        return cuda and total_updates > COMPILE_AUTO_MIN_UPDATES
    return setting == "on"


def _revalidated(cfg: Any) -> Any:
    """Run the pydantic checks again (a config may have been built with model_construct or edited in place)."""
    from pydantic import ValidationError

    from rangefinder.config import format_validation_error

    section = "training." if isinstance(cfg, TrainingConfig) else "validation."
    try:
        return type(cfg).model_validate(cfg.model_dump())
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix=section)) from None


def _check_out_dir(out_dir: Path, resume: bool) -> None:
    if resume:
        return
    if checkpoints.list_checkpoints(out_dir / "checkpoints") or (out_dir / "run_summary.json").exists():
        raise ConfigError(
            f"output folder {out_dir} already holds a run; pass --resume (training.resume) to continue it, "
            "or choose an empty folder"
        )


# ---------------------------------------------------------------------------------------------------------------
# Device and precision: the launcher (accelerate) says how many processes there are and where they run


def start_accelerator(cfg: TrainingConfig) -> Accelerator:
    """The run's Accelerator; gradient accumulation is done by hand in the loop."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

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
    return accelerator


# ---------------------------------------------------------------------------------------------------------------
# Model


def load_model(settings: RunSettings, accelerator: Accelerator) -> tuple[SDComponents, Family]:
    """The base model with the method's trainable parts set up, frozen parts on the device; and its family."""
    from accelerate.utils import set_seed

    from rangefinder.models.loading import load_sd_components

    cfg, method, device = settings.cfg, settings.method, accelerator.device
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.mixed_precision, torch.float32)
    set_seed(cfg.seed)  # adapters' initial weights come from the global RNG
    sd = load_sd_components(settings.model_cfg)
    sd.vae.requires_grad_(False)
    _to(sd.vae, device, torch.float32)  # encodes once: fp32 avoids the SD VAE's fp16 overflow
    method.setup(sd, weight_dtype)
    sd.unet.eval()  # frozen modules stay in eval mode; the loop switches the trainable ones
    for m in (sd.unet, *sd.text_encoders().values()):
        m.eval()
        if not any(m is t for t in method.trainable_modules().values()):
            _to(m, device)
    family = family_for(sd, cfg.prediction_type)
    if cfg.gradient_checkpointing:
        for m in method.trainable_modules().values():
            enable = (getattr(m, "enable_gradient_checkpointing", None)  # diffusers' name
                      or getattr(m, "gradient_checkpointing_enable", None))  # transformers'
            if enable is not None:
                enable()
    if cfg.channels_last:
        # NHWC convolution weights; the convolutions then run NHWC whatever the inputs' layout.
        sd.unet.to(memory_format=torch.channels_last)
    if settings.compile:
        compile_forward_modules(sd, method)
    return sd, family


def compile_forward_modules(sd: SDComponents, method: Method) -> None:
    """torch.compile, in place, of what runs every micro-batch: the UNet, and the text encoder when its output
    changes (it is then part of every forward). In place (`Module.compile`, not a `torch.compile` wrapper) so that
    accelerate's prepare, unwrap_model and validation all see the same module and share its compiled graphs
    (validation's no-grad forward is one more graph of the same code, compiled once).

    The UNet is compiled by region (diffusers' compile_repeated_blocks: its BasicTransformerBlocks): the blocks are
    identical code, so one compile serves them all and compile time is a fraction of the whole UNet's
    (pytorch.org/tutorials/recipes/regional_compilation). Models without `_repeated_blocks` are compiled whole.
    With aspect-ratio buckets a run feeds several latent shapes: dynamo recompiles on the second shape with the
    height and width marked dynamic (its automatic dynamic shapes), so one more compile, not one per bucket;
    `max_aspect` keeps the number of shapes small.
    """
    modules = [sd.unet] + (list(sd.text_encoders().values()) if method.text_encoder_changes else [])
    for m in modules:
        if getattr(m, "_repeated_blocks", None) and hasattr(m, "compile_repeated_blocks"):
            m.compile_repeated_blocks()
        else:
            m.compile()


@contextlib.contextmanager
def memory_advice(cfg: TrainingConfig) -> Iterator[None]:
    """Turn a CUDA out-of-memory error inside an update into one sentence that says what to lower."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        fixes = [f"a smaller training.batch_size (now {cfg.batch_size}; raise grad_accum to keep the effective batch)"]
        if not cfg.gradient_checkpointing:
            fixes.append("training.gradient_checkpointing: true")
        if not cfg.use_8bit_adam and cfg.method == "full":
            fixes.append("training.use_8bit_adam: true")
        if cfg.mixed_precision == "no":
            fixes.append("training.mixed_precision: bf16")
        raise ConfigError(f"the GPU ran out of memory during a training update; try {', or '.join(fixes)}") from e


def native_data_config(sd: SDComponents) -> DataConfig:
    """The base model's native resolution (the UNet's sample size times the VAE's downscale), centre-cropped."""
    vae_scale = 2 ** (len(sd.vae.config.block_out_channels) - 1)
    return DataConfig(resolution=int(sd.unet.config.sample_size) * vae_scale)


def _to(module: torch.nn.Module, device: torch.device, dtype: Optional[torch.dtype] = None) -> None:
    """Move/cast only when needed (diffusers warns on every cast of a loaded model)."""
    p = next(module.parameters(), None)
    if p is None or (p.device == torch.device(device) and (dtype is None or p.dtype == dtype)):
        return
    module.to(device, dtype) if dtype is not None else module.to(device)


# ---------------------------------------------------------------------------------------------------------------
# Data: latents and text embeddings, encoded once per dataset and base model


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


def encode_data(settings: RunSettings, sd: SDComponents, family: Family, accelerator: Accelerator,
                data: DataConfig) -> EncodedData:
    """Latents (at `data`'s resolution and crop, or each image's aspect-ratio bucket) and text conditioning of the
    training and validation items, from the content-keyed cache where they were encoded before."""
    from rangefinder.data.pixels import load_rgb, to_model_array

    placements = settings.placements
    bucket_of_path: dict[Path, Size] = {}
    if placements is not None:
        check_bucket_sides(sd, {p.bucket for p in placements.values()}, data)
        items = settings.train_items + settings.val_items["val"] + settings.val_items["stabilize"]
        bucket_of_path = {settings.split.path_of(it): placements[it.id].bucket for it in items}

    def load_array(path: Path) -> np.ndarray:  # (3, H, W) in [-1, 1]
        try:
            img = load_rgb(path)
        except (OSError, ValueError) as e:  # deleted or broken after the run checked it (PIL's errors are OSErrors)
            raise DataError(f"image {path} cannot be read any more ({e}); put it back, or split the dataset again "
                            "(`rangefinder split`) and start the run again") from None
        if placements is None:
            return to_model_array(img, data.resolution, data.center_crop)
        # Resized and cropped from the file's real size into the bucket the split's record of it chose.
        return bucket_array(img, bucket_of_path[path], data.center_crop)

    cfg, device = settings.cfg, accelerator.device
    check_resolution(family, sd, data)
    encoder = VaeEncoder(sd.vae, device, cfg.latent_sampling, cfg.seed)
    root = cache_root(cfg.cache_dir)
    stats = CacheStats()

    def cache_for(bucket: Optional[Size]) -> LatentCache:  # the latent cache is keyed by bucket
        return LatentCache(encoder, load_array, latent_cache_dir(root, encoder, data.resolution, data.center_crop,
                                                                 bucket=bucket), stats=stats)

    with accelerator.main_process_first():  # one process encodes, the others then read the cache
        train_latents, val_latents = _encode_latents(settings, cache_for)
        if cfg.cache_latents:  # the VAE is not needed again; give its memory back
            _to(sd.vae, torch.device("cpu"))
        text = _encode_text(settings, sd, family, device, root, data)
    # One validation set per subset and bucket (the same shape throughout, so its passes batch); sets of one
    # subset are measured together and reported per bucket (validation.validate).
    val_sets = []
    for name, items in settings.val_items.items():
        rows_of: dict[Optional[Size], list[int]] = {}
        for r, it in enumerate(items):
            rows_of.setdefault(None if placements is None else placements[it.id].bucket, []).append(r)
        for bucket, rows in sorted(rows_of.items(), key=lambda kv: kv[0] or (0, 0)):
            index = torch.tensor(rows, dtype=torch.long)
            val_sets.append(ValidationSet(name, [items[r].id for r in rows], val_latents[name, bucket],
                                          text.val_cond[name][index] if len(rows) < len(items) else text.val_cond[name],
                                          bucket=None if bucket is None else bucket_name(bucket)))
    return EncodedData(data, train_latents, text.train_cond, text.empty_cond, val_sets, stats, text.stats,
                       text.train_text, text.train_geometry)


def check_resolution(family: Family, sd: SDComponents, data: DataConfig) -> None:
    """A training resolution below what the model family supports is a ConfigError naming the floor."""
    native = native_data_config(sd).resolution
    floor = family.min_resolution(native)
    if data.resolution < floor:
        raise ConfigError(
            f"data.resolution: {data.resolution} px is below what the {family.name} family supports for this base "
            f"model (native {native} px, at least {floor} px); set data.resolution to {floor} or more"
        )


def image_geometry(path: Path, data: DataConfig, placement: Optional[Placement] = None) -> ImageGeometry:
    """An item's original size, crop and target size (SDXL's size conditioning, as diffusers'
    train_text_to_image_sdxl.py computes them): from its aspect-ratio bucket placement when bucketed (the split's
    record: size, bucket, crop), else the file's size, the centre crop's top-left corner in the image resized to
    cover the square (0, 0 when the image is squashed, not cropped) and the square training resolution."""
    if placement is not None:
        (w, h), (bw, bh), (left, top) = placement.size, placement.bucket, placement.crop
        return ImageGeometry(original_hw=(h, w), crop_top_left=(top, left), target_hw=(bh, bw))
    from PIL import Image

    with Image.open(path) as img:
        width, height = img.size
    res = data.resolution
    top = left = 0
    if data.center_crop:
        scale = res / min(width, height)
        top, left = max(0, round((height * scale - res) / 2)), max(0, round((width * scale - res) / 2))
    return ImageGeometry(original_hw=(height, width), crop_top_left=(top, left), target_hw=(res, res))


def check_bucket_sides(sd: SDComponents, buckets: set[Size], data: DataConfig) -> None:
    """ConfigError unless every bucket side is a multiple of the model's divisor (the VAE's downscale times the
    UNet's), so that every latent passes the UNet's down- and upsampling evenly."""
    vae_scale = 2 ** (len(sd.vae.config.block_out_channels) - 1)
    divisor = vae_scale * 2 ** (len(sd.unet.config.down_block_types) - 1)
    odd = sorted(b for b in buckets if b[0] % divisor or b[1] % divisor)
    if odd:
        raise ConfigError(
            f"data.bucket_step {data.effective_bucket_step()} px does not fit the base model: its image sides must "
            f"be multiples of {divisor} px (VAE x{vae_scale}, UNet x{divisor // vae_scale}), but buckets "
            f"{', '.join(f'{w}x{h}' for w, h in odd)} are not; set data.bucket_step to a multiple of {divisor}"
        )


def _encode_latents(
    settings: RunSettings, cache_for: Callable[[Optional[Size]], LatentCache]
) -> tuple[LatentSource, dict[tuple[str, Optional[Size]], torch.Tensor]]:
    """The training latents, and (n, 4, h, w) latents of each validation set's items in each bucket (keyed by
    (set name, bucket); the bucket is None without bucketing)."""
    cfg, split, val_items, placements = settings.cfg, settings.split, settings.val_items, settings.placements
    all_items = {it.id: it for it in settings.train_items + val_items["val"] + val_items["stabilize"]}
    paths = {i: split.path_of(it) for i, it in all_items.items()}
    keys = {i: settings.file_hashes[i] for i in paths}  # content hash: the cache key and the sample seed

    def bucket_of(item_id: int) -> Optional[Size]:
        return None if placements is None else placements[item_id].bucket

    # Each distinct image once (the stabilize subset is part of train), bucket by bucket: (4, h, w) latents, and of
    # the mirrored images when flipping; without the cache only the validation images are encoded up front.
    val_item_ids = {it.id for items in val_items.values() for it in items}
    encode_now = [it for i, it in all_items.items() if cfg.cache_latents or i in val_item_ids]
    by_bucket: dict[Optional[Size], list[Item]] = {}
    for it in encode_now:
        by_bucket.setdefault(bucket_of(it.id), []).append(it)
    # Encoded to disk bucket by bucket and batch by batch, never all in memory; then only the validation latents are
    # read in, and the training ones are read per micro-batch (CachedLatentFiles).
    caches = {bucket: cache_for(bucket) for bucket in by_bucket}
    for bucket, group in by_bucket.items():
        caches[bucket].ensure([paths[it.id] for it in group], [keys[it.id] for it in group],
                              flipped=cfg.cache_latents and cfg.random_flip)

    def read(items: list[Item]) -> torch.Tensor:  # (n, 4, h, w) latents of items of one bucket
        return caches[bucket_of(items[0].id)].read([keys[it.id] for it in items], flipped=False)[0]

    train_items = settings.train_items
    train_latents: LatentSource
    if not cfg.cache_latents:
        one_bucket = cache_for(None)
        train_latents = EncodedOnTheFly(
            [paths[it.id] for it in train_items], [keys[it.id] for it in train_items], one_bucket.encoder,
            one_bucket.load,
        )
    else:  # each item's entry in its bucket's folder, read per micro-batch (a micro-batch holds one bucket)
        train_latents = CachedLatentFiles([caches[bucket_of(it.id)].entry_path(keys[it.id]) for it in train_items])
    val_latents = {}
    for name, items in val_items.items():
        groups: dict[Optional[Size], list[Item]] = {}
        for it in items:
            groups.setdefault(bucket_of(it.id), []).append(it)
        val_latents.update({(name, bucket): read(group) for bucket, group in groups.items()})
    return train_latents, val_latents


@dataclass
class _EncodedText:
    train_cond: torch.Tensor
    empty_cond: torch.Tensor
    val_cond: dict[str, torch.Tensor]
    stats: CacheStats
    train_text: Optional[Union[ShuffledCaptions, CachedTextFiles]] = None
    train_geometry: list[ImageGeometry] = field(default_factory=list)


def _encode_text(settings: RunSettings, sd: SDComponents, family: Family, device: torch.device,
                 root: Path, data: DataConfig) -> _EncodedText:
    method, stats, cfg = settings.method, CacheStats(), settings.cfg
    captions = [method.transform_caption(it.text) for it in settings.train_items]
    empty_ids = family.tokenize([""])
    # Tag shuffle: no fixed training conditioning to compute; the captions are shuffled and encoded per micro-batch.
    train_ids = (family.tokenize(captions) if not cfg.shuffle_tags
                 else torch.empty(0, *empty_ids.shape[1:], dtype=torch.long))
    val_ids = {name: family.tokenize([method.transform_caption(it.text) for it in items])
               for name, items in settings.val_items.items() if items}
    # Each item's size conditioning (SDXL; none for SD 1.x): the training items' is added per micro-batch by the
    # loop (family.with_images), the validation sets' once here.
    placements = settings.placements or {}
    sets = {"train": settings.train_items, **settings.val_items}
    geometry = {name: [image_geometry(settings.split.path_of(it), data, placements.get(it.id)) for it in items]
                for name, items in sets.items() if items}
    encoders = [getattr(sd, n) for n in family.text_encoder_names()]

    def frozen_encode(ids: torch.Tensor) -> torch.Tensor:
        return family.encode_prompt(encoders, ids)

    train_text: Optional[Union[ShuffledCaptions, CachedTextFiles]] = None
    if cfg.shuffle_tags:
        frozen = None if method.text_encoder_changes else frozen_encode
        train_text = ShuffledCaptions(captions, cfg.keep_tokens, family.tokenize, frozen, device)
    if method.text_encoder_changes:
        # (N, 77) ids (per family: family.py): prompts are encoded every micro-batch through the training encoders.
        return _EncodedText(train_ids, empty_ids, {name: family.with_images(ids, geometry[name])
                                                   for name, ids in val_ids.items()}, stats, train_text,
                            geometry["train"])
    # (N, 77, D) hidden states (per family), computed once with the frozen encoders.
    folder = text_cache_dir(root, *encoders)

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return cached_text_embeddings(ids, frozen_encode, folder, device, stats=stats)

    empty_cond = embed(empty_ids)
    if len(train_ids):
        # The training captions stay on disk, read per micro-batch (memory does not grow with the set).
        files = ensure_text_embeddings(train_ids, frozen_encode, folder, device, stats=stats)
        train_text = CachedTextFiles(files)
    train_cond = empty_cond[:0]
    val_cond = {name: family.with_images(embed(ids), geometry[name]) for name, ids in val_ids.items()}
    return _EncodedText(train_cond, empty_cond, val_cond, stats, train_text, geometry["train"])


# ---------------------------------------------------------------------------------------------------------------
# Optimizer, EMA: the Run is complete


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
    optimizer: Any  # torch AdamW (or bitsandbytes AdamW8bit), as accelerate prepared it
    ema: Any  # diffusers EMAModel of the trainable parameters, or None
    trainable: list[torch.nn.Parameter]  # what the optimizer updates (and EMA tracks), in a fixed order
    modules: dict[str, torch.nn.Module]  # the method's trainable modules
    prepared: dict[str, torch.nn.Module]  # the same as accelerate prepared them (DDP-wrapped when multi-process)
    denoiser: Denoiser  # the training forward pass, through the prepared modules
    eval_denoiser: Denoiser  # the same through the unwrapped modules (validation)
    val_shard: Shard = field(default_factory=Shard)  # this process' share of each validation pass

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
        try:
            yield
        finally:
            self.ema.restore(self.trainable)


def prepare_run(settings: RunSettings, accelerator: Accelerator, sd: SDComponents, family: Family,
                data: EncodedData) -> Run:
    """The optimizer (at the schedule's first LR) and EMA; the trainable modules and the optimizer handed to
    accelerate."""
    cfg, method, device = settings.cfg, settings.method, accelerator.device
    stream = make_stream(settings.plan, cfg.seed, settings.train_bucket_of)
    groups = method.param_groups()
    trainable = method.trainable_parameters()
    optimizer = _make_optimizer(cfg, groups, settings.schedule(0))
    ema = None
    if cfg.use_ema:
        from diffusers.training_utils import EMAModel

        ema = EMAModel(trainable, decay=cfg.ema_decay)
        ema.to(device)
    modules = method.trainable_modules()
    prepared = {name: accelerator.prepare(m) for name, m in modules.items()}  # DDP-wrapped when multi-process
    if cfg.allreduce_dtype == "bf16":
        _sum_gradients_in_bf16(prepared.values())
    optimizer = accelerator.prepare(optimizer)
    unet = prepared.get("unet", sd.unet)
    text_encoders = ([prepared.get(n, getattr(sd, n)) for n in family.text_encoder_names()]
                     if method.text_encoder_changes else None)
    unwrap = accelerator.unwrap_model
    return Run(
        settings, accelerator, sd, family, data, stream, optimizer, ema, trainable, modules, prepared,
        denoiser=Denoiser(family, unet, text_encoders, accelerator.autocast),
        eval_denoiser=Denoiser(family, unwrap(unet), None if text_encoders is None else
                               [unwrap(t) for t in text_encoders], accelerator.autocast),
        val_shard=Shard.of(accelerator),
    )


def _sum_gradients_in_bf16(modules: Iterable[torch.nn.Module]) -> None:
    """training.allreduce_dtype: bf16. DDP all-reduces each gradient bucket in bf16: half the bytes per update
    (docs/scaling.md, section 2). The hook is PyTorch's `bf16_compress_hook`, registered as `bf16_allreduce_hook`:
    DDP refuses the hook *by its name* unless the build has CUDA and NCCL, though gloo sums bf16 as well (how the
    CPU tests run it); so the NCCL version it protects is checked here. No effect on one process (no DDP)."""
    import torch.distributed as dist

    for module in modules:
        if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
            continue
        if dist.get_backend() == "nccl" and torch.cuda.nccl.version() < (2, 10):
            raise ConfigError(f"training.allreduce_dtype bf16 needs NCCL 2.10 or newer (this PyTorch has NCCL "
                              f"{'.'.join(map(str, torch.cuda.nccl.version()))}); set training.allreduce_dtype: fp32")
        module.register_comm_hook(None, bf16_allreduce_hook)


def bf16_allreduce_hook(process_group, bucket):  # unannotated: see the docstring
    """PyTorch's default_hooks.bf16_compress_hook: the bucket cast to bf16 and divided by the world size,
    all-reduced, cast back to fp32 in place. Unannotated: DDP checks a hook's annotations against real types, and
    this module's are strings."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


def _make_optimizer(cfg: TrainingConfig, groups: list[dict], lr: float) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = dict(
        lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay
    )
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
