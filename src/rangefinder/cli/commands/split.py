"""`rangefinder split`: the deterministic train / validation / stabilize split of a dataset folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from rangefinder.cli import args as argtypes
from rangefinder.cli.output import add_json_flag
from rangefinder.config import DataConfig
from rangefinder.formats.text import warn


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "split",
        help="validate a dataset folder and split it into train, validation and stabilize manifests",
        description="Check every image and caption (bad ones are listed and skipped), then split deterministically: "
        "items sorted by path, a seeded shuffle, ceil(p*N) to validation, the stabilize subset drawn from training.",
    )
    p.add_argument("data_dir", metavar="DATA_DIR",
                   help="dataset folder: images with .txt or .caption captions, or metadata.jsonl or .csv")
    p.add_argument("--out", required=True, help="folder for train.jsonl, val.jsonl, stabilize.jsonl and split.json")
    # One or the other: --val-split with --val-dir was dropped without a word (a config with both gets a warning).
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-split", type=float, default=0.2,
                     help="share of images for validation, rounded up (0.2); not with --val-dir")
    p.add_argument("--stabilize-split", type=float, default=0.2,
                   help="share of training images in the stabilize subset, rounded up (0.2)")
    p.add_argument("--seed", type=argtypes.seed, default=555, help="seed of the shuffle (555)")
    val.add_argument("--val-dir", help="a folder of validation images chosen by hand (replaces --val-split)")
    p.add_argument("--resolution", type=int, default=None,  # bounds: DataConfig, below
                   help="the training resolution, in pixels (data.resolution; default: the one a `make-dataset` "
                   f"folder was made at, else {DataConfig.model_fields['resolution'].default}): the aspect-ratio "
                   "buckets are reported for it, and it sets the default of --min-image-size")
    p.add_argument("--min-image-size", type=argtypes.int_in(1, argtypes.MAX_RESOLUTION,
                   what="the smallest image side in pixels"), default=None,
                   help="skip (and list) images whose short side is smaller than this, in pixels (default: half the "
                   "resolution, as data.min_image_size: smaller images would be enlarged more than twice)")
    p.add_argument("--tokenizer", metavar="MODEL_DIR",
                   help="a diffusers model folder (or tokenizer folder), or a single .safetensors checkpoint or hub id "
                   "as `train` takes its base model: count and list the captions longer than its text encoder reads "
                   "(75 tokens for SD 1.x), which training cuts off")
    p.add_argument("--min-images", type=argtypes.int_in(2, what="the fewest usable images"), default=2,
                   help="fail when fewer usable images remain (2)")
    p.add_argument("--captionless", action="store_true",
                   help="keep images without a caption, for textual inversion: each trains on one of its prompt "
                   "templates (\"a photo of a <tok>\"); full fine-tuning and LoRA refuse such a split. The "
                   "pipeline does this for training.method textual_inversion")
    p.add_argument("--no-bucketing", action="store_true",
                   help="report no aspect-ratio buckets (data.bucketing: false, every image a centre-cropped square)")
    p.add_argument("--bucket-step", type=int,
                   help="bucket sides are multiples of this, px (data.bucket_step; default: a quarter of the "
                   "resolution, rounded down to a multiple of 8, between 8 and 64)")
    p.add_argument("--max-aspect", type=float, default=2.0,
                   help="longest bucket side over its shortest (data.max_aspect; default 2.0)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from pydantic import ValidationError

    from rangefinder.config import format_validation_error
    from rangefinder.data.buckets import BucketSettings
    from rangefinder.data.dataset import check_out_outside_dataset, made_resolution
    from rangefinder.data.split import split_dataset
    from rangefinder.errors import ConfigError

    # Written into the dataset, the split's manifests were listed by the next split (and a local run's
    # prepare-dataset) as files of the dataset.
    for folder, setting in ((args.data_dir, "DATA_DIR"), (args.val_dir, "--val-dir")):
        if folder:
            check_out_outside_dataset(args.out, folder, flag="--out", setting=setting,
                                      outputs="train.jsonl, val.jsonl, stabilize.jsonl, split.json")
    # A folder `make-dataset` made (32 px by default) splits at its own size: 512 px would skip every image.
    # `--resolution 0` is checked below (DataConfig), not taken for "not given".
    resolution = (args.resolution if args.resolution is not None
                  else made_resolution(args.data_dir) or DataConfig.model_fields["resolution"].default)
    try:
        data = DataConfig(resolution=resolution, min_image_size=args.min_image_size,
                          bucketing=not args.no_bucketing, bucket_step=args.bucket_step, max_aspect=args.max_aspect)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix="data.")) from None

    count_tokens, token_limit = None, None
    if args.tokenizer:
        from rangefinder.models.tokens import caption_token_counter

        tokenizer = Path(args.tokenizer).expanduser()
        if not tokenizer.is_dir():  # a single file or a hub id, resolved as `train --model` resolves it: both were
            from rangefinder.config import ModelConfig  # "no tokenizer in" them, with a JSON parser's complaint.
            from rangefinder.models.loading import resolve_base_model

            tokenizer = resolve_base_model(ModelConfig(base_model=args.tokenizer)).path
        count_tokens, token_limit = caption_token_counter(tokenizer)
    split = split_dataset(
        args.data_dir,
        args.out,
        val_split=args.val_split,
        stabilize_split=args.stabilize_split,
        seed=args.seed,
        val_dir=args.val_dir,
        min_image_size=data.effective_min_image_size(),
        min_images=args.min_images,
        buckets=BucketSettings.from_data_config(data),
        count_tokens=count_tokens,
        token_limit=token_limit,
        captionless=args.captionless,
    )
    s = split.summary
    warn(s.get("notes", []))
    buckets = s["buckets"]
    result = {
        "out": str(args.out),
        "root": s["root"],
        "images": s["images"],
        "train_images": s["train_images"],
        "val_images": s["val_images"],
        "stabilize_images": s["stabilize_images"],
        "seed": s["seed"],
        "min_image_size": s["min_image_size"],
        **({"captionless": s["captionless"]} if args.captionless else {}),
        "duplicates": [" = ".join(group) for group in s["duplicates"]],
        "skipped": [f"{x['file_name']}: {x['reason']}" for x in s["skipped"]],
        "long_captions": (
            "not counted (give --tokenizer MODEL_DIR)" if s["long_captions"] is None
            else [f"{x['file_name']}: {x['tokens']} tokens, over {s['long_captions']['limit']}"
                  for x in s["long_captions"]["files"]]
        ),
    }
    if buckets is None:
        result["buckets"] = "off (every image centre-cropped to a square)"
        return result
    # The images of each aspect-ratio bucket: `rangefinder plan --bucket-counts` takes the train column.
    result["bucket_settings"] = {k: buckets[k] for k in ("resolution", "step", "max_aspect")}
    if args.json:
        result["buckets"] = buckets["table"]
    else:
        result["buckets"] = [f"{b['bucket']}: train {b['train']}, val {b['val']}, stabilize {b['stabilize']}"
                             for b in buckets["table"]]
    return result
