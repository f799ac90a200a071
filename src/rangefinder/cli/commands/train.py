"""`rangefinder train`: one training run on a split, without KFP (the engine the pipeline steps share)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

from rangefinder.cli import args as argtypes
from rangefinder.cli.ignored import ignored_by_train, warn_conflicts, warn_ignored
from rangefinder.cli.output import add_json_flag
from rangefinder.config import Method, Optimizer, Schedule, TrainingConfig, ValidationConfig
from rangefinder.errors import ConfigError
from rangefinder.formats.text import warn


def _default(section: type[TrainingConfig] | type[ValidationConfig], field: str) -> str:
    """"(training.FIELD; default VALUE)": what a flag left out trains with, unless --config sets it."""
    name = "training" if section is TrainingConfig else "validation"
    return f"({name}.{field}; default {section.model_fields[field].default})"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train one run (full fine-tune, LR ramp, ...) on a split, with deterministic validation",
        description="Train on SPLIT_DIR from MODEL_DIR into OUT_DIR: metrics.csv, updates.csv, checkpoints/, final/. "
        "Settings come from --config (YAML sections training:, validation:, data:) and the flags below, which win. "
        "A sampling: section in --config also renders samples during training into OUT_DIR/samples/. "
        "training.processes_per_node processes train, as in the pipeline's steps (auto: one per GPU, 1 on CPU); "
        "settings of the file that train does not use are named in one warning line.",
        **argtypes.examples(
            "# an LR range test of your own model: split the images, ramp the LR, validate often, read the curve",
            "rangefinder split my_images --out my_split",
            "rangefinder train --data my_split --model my_model.safetensors --out lrtest --schedule exp-ramp "
            "--lr-min 1e-7 --lr-max 1e-3 --epochs 10 --validate-every-updates 5",
            "rangefinder analyze-lr lrtest/metrics.csv",
        ),
    )
    p.add_argument("--data", required=True, metavar="SPLIT_DIR", help="a split folder written by `rangefinder split`")
    p.add_argument("--model", metavar="MODEL_DIR",
                   help="base model folder, single file or hub id (default: the tiny model)")
    p.add_argument("--out", required=True, metavar="OUT_DIR",
                   help="output folder (checkpoints under OUT_DIR/checkpoints)")
    p.add_argument("--config", metavar="FILE", help="YAML config (sections as in `rangefinder` configs)")
    # The choices named from config's own lists: a schedule added there (wsd) went unnamed here.
    p.add_argument("--method", help=" | ".join(get_args(Method)) + " " + _default(TrainingConfig, "method"))
    p.add_argument("--schedule", help=", ".join(get_args(Schedule)) + " " + _default(TrainingConfig, "schedule"))
    p.add_argument("--lr", type=float, help="learning rate (constant, or the peak of cosine and wsd) "
                   + _default(TrainingConfig, "lr")[:-1] + "; 1.0, a multiplier, with prodigy and "
                   "prodigy_schedule_free)")
    p.add_argument("--optimizer", help=", ".join(f"{o} (default)" if o == "adamw" else o for o in get_args(Optimizer))
                   + " (README: Optimizers)")
    p.add_argument("--lr-min", type=float, help="lower end of a ramp or cycle, or where wsd decays to (0)")
    p.add_argument("--lr-max", type=float, help="upper end of a ramp or cycle")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--epochs", type=int, help="passes over the training images")
    budget.add_argument("--steps", type=int, help="optimizer updates (micro-batches with training.steps_unit: "
                                                     "micro-batch in --config)")
    p.add_argument("--batch-size", type=int,
                   help="images per micro-batch per process " + _default(TrainingConfig, "batch_size"))
    p.add_argument("--grad-accum", type=int, help="micro-batches per update " + _default(TrainingConfig, "grad_accum"))
    p.add_argument("--seed", type=int,
                   help="training seed (data order, noise, timesteps) " + _default(TrainingConfig, "seed"))
    p.add_argument("--resolution", type=int, help="training resolution in pixels (default: the model's native one)")
    p.add_argument("--validate-every-epochs", type=float, help="validate every N epochs; 0 turns validation off "
                   + _default(ValidationConfig, "every_epochs"))
    p.add_argument("--validate-every-updates", type=int, help="validate every N updates instead")
    p.add_argument("--checkpoint-every-updates", type=int, help="save a checkpoint every N updates (and at the end)")
    p.add_argument("--train-on", choices=["train", "train+val"], default="train",
                   help="train: the split's training images (default); train+val: the full-data retrain (the "
                   "validation set is then not measured)")
    p.add_argument("--resume", action="store_true", help="continue from the newest whole checkpoint in OUT_DIR")
    add_json_flag(p)
    p.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace):
    """(RangefinderConfig, TrainSpec) from --config and the flags; samples during training only when the file has a
    sampling: section. The spec trains on the processes `training.processes_per_node` asks for, as the pipeline's
    training steps do (launch.processes)."""
    from rangefinder.config import LR_FREE_LR, LR_FREE_OPTIMIZERS, given_settings, load_config, lr_free_lr_problem
    from rangefinder.launch.processes import step_world_size

    overrides: dict[str, Any] = {"training": {}, "validation": {}, "data": {}}
    t, v = overrides["training"], overrides["validation"]
    for flag, key in (
        ("method", "method"), ("schedule", "schedule"), ("optimizer", "optimizer"), ("lr", "lr"),
        ("lr_min", "lr_min"), ("lr_max", "lr_max"),
        ("epochs", "epochs"), ("steps", "steps"), ("batch_size", "batch_size"), ("grad_accum", "grad_accum"),
        ("seed", "seed"), ("checkpoint_every_updates", "checkpoint_every_updates"),
    ):
        if getattr(args, flag) is not None:
            t[key] = getattr(args, flag)
    if args.epochs is not None:
        t["steps"] = None  # a flag budget replaces the file's budget of the other kind
    if args.steps is not None:
        t["epochs"] = None
    if args.validate_every_epochs is not None:
        v["every_epochs"] = args.validate_every_epochs
        v.setdefault("every_updates", None)
    if args.validate_every_updates is not None:
        v["every_updates"] = args.validate_every_updates
    if args.resolution is not None:
        overrides["data"]["resolution"] = args.resolution
    if args.model is not None:
        overrides["model"] = {"base_model": args.model}
    # Only the sections given: a section the file or a flag gave is in cfg.model_fields_set.
    cfg = load_config(args.config, {name: section for name, section in overrides.items() if section})
    warn_ignored("train", ignored_by_train(cfg))
    # --resume alone resumes, after checking there is a run to resume: a pipeline step's run_summary.json holds the
    # training.resume its step set, and a copy of it continued, or overwrote, the run it found in the output folder.
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"resume": bool(args.resume)})})
    # What an earlier run resolved its base model to (a copied config.yaml holds it) is not this run's: it trained
    # that folder whatever model.base_model or --model said.
    cfg = cfg.unresolved()
    warn_conflicts(cfg)
    if cfg.training.optimizer not in LR_FREE_OPTIMIZERS and cfg.training.lr == LR_FREE_LR:
        # What a Prodigy run's config holds (an LR-free optimizer's unset lr reads as its multiplier, 1): copied and
        # switched to AdamW it trained at lr 1 without a word.
        raise ConfigError(
            f"training.lr is {LR_FREE_LR:g} with optimizer {cfg.training.optimizer}: {LR_FREE_LR:g} is an LR-free "
            "optimizer's multiplier of the step size it estimates, which a config written by a Prodigy run holds, "
            f"and {cfg.training.optimizer} would diverge at it; set the LR to train at (--lr or training.lr), or "
            "leave training.lr out for the default"
        )
    lr_free = "training.lr" in given_settings(cfg) and lr_free_lr_problem(cfg.training.optimizer, cfg.training.lr,
                                                                         "training.lr")
    if lr_free:
        warn([lr_free])
    if "data" in cfg.model_fields_set:  # else the model's native resolution, which the split was checked for
        warn(_enlarged(args.data, cfg.data))
    if not cfg.training.budget_given():
        raise ConfigError("give a budget: --epochs N or --steps N (or training.epochs / training.steps in --config)")
    if cfg.distributed.num_nodes > 1:
        raise ConfigError(
            f"distributed.num_nodes is {cfg.distributed.num_nodes}, but `rangefinder train` trains on this machine "
            "only: set num_nodes: 1 (training.processes_per_node still starts several processes here), or run the "
            "pipeline on a cluster (`rangefinder submit`)"
        )
    processes = step_world_size(cfg)
    # A world size written out at its default (a whole config dumped) asks for nothing.
    if "training.world_size" in given_settings(cfg) and cfg.training.world_size != processes:
        raise ConfigError(
            f"training.world_size is {cfg.training.world_size}, but training.processes_per_node "
            f"({cfg.training.processes_per_node}) starts {processes} process(es) here; leave world_size out (the "
            f"processes started are counted) or set processes_per_node: {cfg.training.world_size}"
        )
    from rangefinder.training.families import check_local_model_settings
    from rangefinder.training.loop import TrainSpec

    data = cfg.data if "data" in cfg.model_fields_set else None
    # What the family refuses (textual inversion on SD3 or Flux, a size its VAE cannot take, ...), said before any
    # weights load where the base model's configs are here to read, and before a hub model's weights are downloaded
    # (its family read off model_index.json alone); else the engine says it once it loads them.
    check_local_model_settings(cfg, native_data=data is None)
    training = cfg.training.model_copy(update={"world_size": processes})
    sampling = cfg.sampling if "sampling" in cfg.model_fields_set else None
    return cfg, TrainSpec(training, cfg.validation, split_dir=args.data, model=cfg.model, data=data,
                          train_on=args.train_on, sampling=sampling)


def _enlarged(split_dir: str, data: Any) -> list[str]:
    """A warning's line where the split holds images smaller than this run's data.min_image_size: `split` skips them
    for the resolution it is given (made at 32 px, a split keeps 16 px images), and `train --resolution 512` on it
    enlarged them 16x or more without a word. None of the items' sizes recorded (an older split): not checked."""
    from rangefinder.data.split import read_split

    split = read_split(split_dir)
    floor = data.effective_min_image_size()
    sizes = [min(it.size) for it in (*split.train, *split.val) if it.size is not None]
    small = [side for side in sizes if side < floor]
    if not small:
        return []
    made_at = split.buckets.resolution if split.buckets is not None else None
    again = f"train at --resolution {made_at} (the split's), or " if made_at else ""
    return [f"{len(small)} of the {len(sizes)} images of split {split_dir} are under {floor} px on their short side "
            f"(data.min_image_size, half of data.resolution {data.resolution}), down to {min(small)} px: they are "
            f"enlarged up to {data.resolution / min(small):g}x; {again}split again with --resolution "
            f"{data.resolution} to leave them out"]


def _check_something_to_resume(out: Path) -> None:
    """--resume continues a run: a folder without a checkpoint holds none to continue (an empty or mistyped --out,
    or a run stopped before its first checkpoint), and starting afresh there would look like a resume."""
    from rangefinder.errors import ConfigError
    from rangefinder.formats import checkpoints

    if checkpoints.list_checkpoints(out / checkpoints.RUN_DIR):
        return
    has = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    holds = f"holds only {', '.join(has)}" if has else ("is empty" if out.is_dir() else "does not exist")
    raise ConfigError(
        f"--resume: {out} holds no run to resume (no checkpoint under {out / 'checkpoints'}; the folder {holds}); "
        "check --out, or leave out --resume to start a run there"
    )


def run(args: argparse.Namespace) -> dict:
    from rangefinder.launch.processes import run_training

    cfg, spec = settings_from_args(args)
    if args.resume:
        _check_something_to_resume(Path(args.out))
    result = run_training(cfg, spec, out_dir=Path(args.out))
    out = result.as_dict()
    out.pop("checkpoints")
    out["checkpoints"] = [str(p) for p in result.checkpoints]
    return out
