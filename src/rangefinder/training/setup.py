"""Setting up one training run, act by act, as `train()` (loop.py) calls them: the settings (checked before anything
heavy), the device (the launcher), the model, then (after the data, encoding.py) the optimizer and EMA, which
complete the `Run` (run.py) the loop trains with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from rangefinder.config import DataConfig, ModelConfig, TrainingConfig, resolve_mixed_precision
from rangefinder.data.buckets import BucketSettings, Placement, Size
from rangefinder.data.split import place_items
from rangefinder.errors import ConfigError, DataError
from rangefinder.formats import checkpoints
from rangefinder.planning import plan_for
from rangefinder.training.caching import cache_root
from rangefinder.training.data import make_stream
from rangefinder.training.families import family_for
from rangefinder.training.family import Denoiser, Family
from rangefinder.training.family_detection import FAMILY_LAYOUTS
from rangefinder.training.methods import make_method
from rangefinder.training.optimizers import check_optimizer, make_optimizer
from rangefinder.training.outdir import check_out_dir_free
from rangefinder.training.run import EncodedData, Run, RunSettings
from rangefinder.training.schedules import make_schedule
from rangefinder.training.spec import TrainSpec
from rangefinder.training.validation import Shard

if TYPE_CHECKING:
    from accelerate import Accelerator

    from rangefinder.data.split import Split
    from rangefinder.models.loading import SDComponents
    from rangefinder.training.methods.base import Method

# ---------------------------------------------------------------------------------------------------------------
# Settings: everything that can be wrong fails here, before anything heavy


def check_settings(spec: TrainSpec, out_dir: Union[str, Path], split: Optional[Split] = None) -> RunSettings:
    """`split`: the one at spec.split_dir as the step already read it (None: read here)."""
    from rangefinder.data.split import file_hashes, read_split

    cfg, val_cfg = _revalidated(spec.training), _revalidated(spec.validation)
    given_precision = cfg.mixed_precision
    cfg = cfg.model_copy(update={"mixed_precision": resolve_mixed_precision(cfg.mixed_precision)})  # auto: per device
    split_dir, model, train_on = spec.split_dir, spec.model, spec.train_on
    if train_on not in ("train", "train+val"):
        raise ConfigError(f"train_on must be 'train' or 'train+val' (got {train_on!r})")
    if split is None:
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
    # The step's constructor planned the run from the same split (TrainSpec.plan_from); a spec built by hand is planned
    # here. ConfigError e.g. for a batch larger than the set with drop_last.
    run_plan = spec.plan if spec.plan is not None else plan_for(cfg, len(train_items), bucket_counts)
    if run_plan.train_images != len(train_items) or run_plan.bucket_counts != (
            bucket_counts if bucket_counts is not None and len(bucket_counts) > 1 else None):
        raise ConfigError(f"the run's plan counts {run_plan.train_images} training images but split {split_dir} has "
                          f"{len(train_items)} (or other buckets); build the spec from the split it trains on")
    schedule = make_schedule(cfg, run_plan.total_updates, run_plan.updates_per_epoch, run_plan.lr or cfg.lr)
    method = make_method(cfg)
    bare = sorted({it.file_name for it in train_items + val_items["val"] + val_items["stabilize"] if not it.text})
    if bare and not method.fills_empty_captions:
        raise DataError(f"split {split_dir} holds {len(bare)} images without a caption ({', '.join(bare[:3])}"
                        f"{', ...' if len(bare) > 3 else ''}), made with `split --captionless`; {cfg.method} trains "
                        "on captions: caption them and split again, or train textual_inversion, which fills in a "
                        "prompt template")
    check_optimizer(cfg, torch.cuda.is_available())
    cache_root(cfg.cache_dir)  # a cache folder that is a file: one line now, not after the model has loaded
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
                       mixed_precision_given=given_precision,
                       buckets=buckets, placements=placements, train_buckets=train_buckets,
                       train_bucket_of=train_bucket_of, branch=spec.branch,
                       title=spec.title or out_dir.resolve().name)


# Runs of more updates than this would compile under training.compile=auto, if compiling paid: None, it has not.
# Measured on one H100 (bench/RESULTS.md, "GPU rows"; SD 1.5-sized UNet, 512 px, bf16, full fine-tune at batch 4,
# validated every epoch, a partial last micro-batch each epoch as with buckets). 2026-11-26: compiling cost ~40 s and
# saved 7 % of an update, so it paid after ~3500 updates; but dynamo had hit its recompile limit and run part of the
# UNet eager. 2026-11-27, with every block compiled (compile_forward_modules raises the limit): 9 graphs, no
# fallback, and an update took 10 % LONGER than eager (0.196 against 0.177 s, median), validation 13 % less. A
# compiled run never repays its compile there, so `auto` stays eager until a measurement says otherwise (the static-
# shape arm, bench.gpu_session --parts compile_static, is prepared and not yet run). `on` still compiles.
COMPILE_AUTO_MIN_UPDATES: Optional[int] = None


def resolve_compile(setting: str, total_updates: int, cuda: bool) -> bool:
    """training.compile as on/off: `auto` compiles CUDA runs of more than COMPILE_AUTO_MIN_UPDATES updates only, and
    none while that is None (measured slower on an H100; on CPU inductor's compile time is seldom repaid)."""
    if setting == "auto":
        return cuda and COMPILE_AUTO_MIN_UPDATES is not None and total_updates > COMPILE_AUTO_MIN_UPDATES
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
    if checkpoints.list_checkpoints(out_dir / checkpoints.RUN_DIR) or (out_dir / "run_summary.json").exists():
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
    move_module(sd.vae, device, torch.float32)  # encodes once: fp32 avoids the SD VAE's fp16 overflow
    # The family first: it refuses settings (and methods) it cannot train before anything is set up for them.
    family = family_for(sd, cfg)
    method.setup(sd, weight_dtype)
    sd.unet.eval()  # frozen modules stay in eval mode; the loop switches the trainable ones
    for m in (sd.unet, *sd.text_encoders().values()):
        m.eval()
        if not any(m is t for t in method.trainable_modules().values()):
            move_module(m, device)
    t5 = FAMILY_LAYOUTS[sd.family].t5  # SD3's text_encoder_3, Flux's text_encoder_2
    if t5 is not None:  # never trained; fp16 overflows in T5 (bf16 does not)
        getattr(sd, t5).requires_grad_(False).eval()
        move_module(getattr(sd, t5), device, torch.bfloat16 if weight_dtype == torch.bfloat16 else torch.float32)
    if cfg.gradient_checkpointing:
        for m in method.trainable_modules().values():
            enable = (getattr(m, "enable_gradient_checkpointing", None)  # diffusers' name
                      or getattr(m, "gradient_checkpointing_enable", None))  # transformers'
            if enable is not None:
                enable()
    if cfg.channels_last:
        # NHWC convolution weights; the convolutions then run NHWC whatever the inputs' layout.
        sd.unet.to(memory_format=torch.channels_last)
    if cfg.weights_dtype == "bf16":  # the trained weights in bf16, their fp32 master in the optimizer (prepare_run)
        from rangefinder.training.master import check_bf16_weights, to_bf16_module

        check_bf16_weights(str(accelerator.mixed_precision), accelerator.num_processes)
        for m in method.trainable_modules().values():
            to_bf16_module(m)
    if settings.compile:
        compile_forward_modules(sd, method)
    return sd, family


def compile_forward_modules(sd: SDComponents, method: Method, **compile_kwargs: Any) -> None:
    """torch.compile, in place, of what runs every micro-batch: the UNet, and the text encoder when its output
    changes (it is then part of every forward). In place (`Module.compile`, not a `torch.compile` wrapper) so that
    accelerate's prepare, unwrap_model and validation all see the same module and share its compiled graphs.
    `compile_kwargs` go to `torch.compile` as they are (the tests pass `backend="eager"`).

    The UNet is compiled by region (diffusers' compile_repeated_blocks: its BasicTransformerBlocks): the blocks are
    identical code, so compile time is a fraction of the whole UNet's (pytorch.org/tutorials/recipes/
    regional_compilation). Models without `_repeated_blocks` are compiled whole.

    Identical code means one code object: dynamo keeps every compiled graph of every block instance in one cache, on
    `BasicTransformerBlock.forward`, and the parameters' shapes are static, so each block width is its own graph (SD
    1.5: 320, 640, 1280). Each of those is compiled again for validation (no_grad is a guard of every graph), and with
    aspect-ratio buckets once more when a new latent shape changes the sequence length (dynamo's automatic dynamic
    shapes: one more graph with the length dynamic, not one per bucket; `max_aspect` keeps the shapes few). Dynamo
    allows 8 graphs per code object (`recompile_limit`) and then silently runs the rest eager: an SD 1.5 run on an
    H100 hit it (bench/RESULTS.md, issue 38). `raise_recompile_limit` makes room for them all.
    """
    modules = [sd.unet] + (list(sd.text_encoders().values()) if method.text_encoder_changes else [])
    for m in modules:
        if getattr(m, "_repeated_blocks", None) and hasattr(m, "compile_repeated_blocks"):
            raise_recompile_limit(repeated_block_shapes(m) * GRAPHS_PER_BLOCK_SHAPE)
            m.compile_repeated_blocks(**compile_kwargs)
        else:
            m.compile(**compile_kwargs)


# The graphs dynamo may keep per distinct shape of a repeated block: with grad (training) and without (validation),
# each for its first latent shape and again with the sequence length dynamic; x2 for what this does not foresee (e.g.
# a validation batch of another size, which makes the batch dimension dynamic too). SD 1.5: 3 x 8 = 24 graphs allowed.
GRAPHS_PER_BLOCK_SHAPE = 2 * 2 * 2


def repeated_block_shapes(module: torch.nn.Module) -> int:
    """The most distinct sets of parameter shapes among the instances of any one of `module`'s repeated block
    classes (diffusers' `_repeated_blocks`): the graphs one of their code objects needs per grad mode and shape."""
    repeated = getattr(module, "_repeated_blocks", ())
    shapes: dict[str, set[tuple[tuple[int, ...], ...]]] = {}
    for sub in module.modules():
        name = type(sub).__name__
        if name in repeated:
            shapes.setdefault(name, set()).add(tuple(tuple(p.shape) for p in sub.parameters()))
    return max((len(s) for s in shapes.values()), default=1)


def raise_recompile_limit(graphs: int) -> None:
    """Let dynamo keep `graphs` compiled graphs per code object, process-wide; an existing larger limit is kept.
    (`recompile_limit` was `cache_size_limit` before torch 2.6. Its companion `accumulated_recompile_limit`, 256 by
    default, caps all of a code object's graphs together and is far above what any UNet here needs.)"""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), graphs))


@contextlib.contextmanager
def memory_advice(cfg: TrainingConfig) -> Iterator[None]:
    """Turn a CUDA out-of-memory error inside an update into one sentence that says what to lower."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as e:
        fixes = [f"a smaller training.batch_size (now {cfg.batch_size}; raise grad_accum to keep the effective batch)"]
        if not cfg.gradient_checkpointing:
            fixes.append("training.gradient_checkpointing: true")
        if cfg.optimizer == "adamw" and cfg.method == "full":
            fixes.append("training.optimizer: adamw8bit")
        if cfg.mixed_precision == "no":
            fixes.append("training.mixed_precision: bf16")
        raise ConfigError(f"the GPU ran out of memory during a training update; try {', or '.join(fixes)}") from e


def native_data_config(sd: SDComponents) -> DataConfig:
    """The base model's native resolution (the UNet's sample size times the VAE's downscale), centre-cropped."""
    from rangefinder.training.geometry import native_resolution

    return DataConfig(resolution=native_resolution(sd.vae.config, sd.unet.config))


def move_module(module: torch.nn.Module, device: torch.device, dtype: Optional[torch.dtype] = None) -> None:
    """Move/cast only when needed (diffusers warns on every cast of a loaded model)."""
    p = next(module.parameters(), None)
    if p is None or (p.device == torch.device(device) and (dtype is None or p.dtype == dtype)):
        return
    module.to(device, dtype) if dtype is not None else module.to(device)


# ---------------------------------------------------------------------------------------------------------------
# Optimizer, EMA: the Run is complete


def prepare_run(settings: RunSettings, accelerator: Accelerator, sd: SDComponents, family: Family,
                data: EncodedData) -> Run:
    """The optimizer (at the schedule's first LR) and EMA; the trainable modules and the optimizer handed to
    accelerate."""
    cfg, method, device = settings.cfg, settings.method, accelerator.device
    stream = make_stream(settings.plan, cfg.seed, settings.train_bucket_of)
    groups = method.param_groups()
    trainable = method.trainable_parameters()
    master = None
    if cfg.weights_dtype == "bf16":  # the optimizer and the EMA step the fp32 masters of the bf16 weights
        from rangefinder.training.master import MasterWeights

        master = MasterWeights(trainable)
        groups, trainable = master.param_groups(groups), list(master.masters)
    optimizer = make_optimizer(cfg, groups, settings.schedule(0))
    ema = None
    if cfg.keeps_ema(family.name):
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
    autocast = accelerator.autocast if master is None else contextlib.nullcontext  # bf16 weights compute in bf16
    return Run(
        settings, accelerator, sd, family, data, stream, optimizer, ema, trainable, modules, prepared,
        denoiser=Denoiser(family, unet, text_encoders, autocast),
        eval_denoiser=Denoiser(family, unwrap(unet), None if text_encoders is None else
                               [unwrap(t) for t in text_encoders], autocast),
        val_shard=Shard.of(accelerator), master=master,
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
