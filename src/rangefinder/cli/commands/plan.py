"""`rangefinder plan`: the hyperparameter arithmetic for a dataset size and settings, in both steps conventions."""

from __future__ import annotations

import argparse

from rangefinder.cli import args as argtypes
from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="count updates, epochs and images for a dataset size and settings",
        description="Translate settings between epochs, updates (diffusers, kohya sd-scripts, EveryDream) and "
        "micro-batch steps (A1111), e.g. kohya's 20 images in a 10_name folder, train_batch_size 2 on 2 GPUs, "
        "max_train_epochs 4: rangefinder plan --images 20 --repeats 10 --batch-size 2 --world-size 2 --epochs 4. "
        "per_epoch_loader gives the steps and epochs as sd-scripts and the diffusers examples count them "
        "(max_train_steps, num_train_epochs); passes_over_each_image, rangefinder's own epochs.",
        **argtypes.examples(
            "# kohya sd-scripts: 20 images in 10_name, train_batch_size 2 on 2 GPUs, max_train_epochs 4",
            "rangefinder plan --images 20 --repeats 10 --batch-size 2 --world-size 2 --epochs 4",
            "# the diffusers examples: max_train_steps 1100 at train_batch_size 2, gradient_accumulation_steps 2",
            "rangefinder plan --images 21 --batch-size 2 --grad-accum 2 --steps 1100",
            "# A1111: 3000 steps (micro-batches) at batch 3, accumulation 17",
            "rangefinder plan --images 26 --batch-size 3 --grad-accum 17 --steps 3000 --steps-unit micro-batch",
        ),
    )
    sizes = p.add_mutually_exclusive_group(required=True)
    sizes.add_argument("--images", type=int, help="number of images in the dataset")
    sizes.add_argument("--bucket-counts", metavar="N,N,...",
                       help="training images in each aspect-ratio bucket (the train column of `rangefinder split`); "
                       "each micro-batch then holds one bucket's images")
    p.add_argument("--repeats", type=argtypes.int_in(1, what="repeats"), default=1, metavar="N",
                   help="kohya sd-scripts' repeats, the N of an N_name folder: its epoch shows each image N times, "
                   "so --epochs counts such epochs (default 1: an epoch shows each image once, as rangefinder's "
                   "finetune.epochs and select-steps count)")
    p.add_argument("--val-split", type=float, default=0.0, help="share held out for validation (default 0)")
    p.add_argument("--batch-size", type=int, default=1, help="images per micro-batch per process (default 1)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per update (default 1)")
    p.add_argument("--world-size", type=int, default=None,
                   help="processes in all (GPUs); default --processes-per-node x --nodes")
    p.add_argument("--processes-per-node", type=int, default=1,
                   help="processes (GPUs) per node: training.processes_per_node (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes: distributed.num_nodes (default 1)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--epochs", type=int, help="passes over the training images")
    budget.add_argument("--steps", type=int, help="steps, counted in --steps-unit")
    p.add_argument("--steps-unit", choices=["update", "micro-batch"], default="update",
                   help="what a step is: an optimizer update (diffusers) or a micro-batch (A1111) (default update)")
    p.add_argument("--lr", type=float, help="base learning rate (before --scale-lr)")
    p.add_argument("--scale-lr", choices=["none", "linear", "sqrt"], default="none",
                   help="multiply the LR by the effective batch (linear) or its square root (default none)")
    p.add_argument("--drop-last", action="store_true", help="skip each epoch's trailing partial micro-batch")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from rangefinder.errors import ConfigError
    from rangefinder.planning import plan

    counts = None
    if args.bucket_counts is not None:
        usage = f"--bucket-counts takes whole numbers separated by commas, e.g. 5,4,3 (got {args.bucket_counts!r})"
        parts = args.bucket_counts.split(",")
        filled = [i for i, c in enumerate(parts) if c.strip()]
        if filled and filled[-1] - filled[0] + 1 != len(filled):
            # "1,,2" (a count lost in a pasted column) is not "1,2": the buckets would shift by one.
            raise ConfigError(f"{usage}: one is empty; give a count, 0 for an empty bucket, between every two commas")
        try:
            counts = [int(parts[i]) for i in filled]
        except ValueError:
            raise ConfigError(usage) from None
        if any(c < 0 for c in counts):
            raise ConfigError(f"{usage}: a count of images is 0 or more")
        if not counts or sum(counts) < 1:
            raise ConfigError(f"--bucket-counts needs at least one training image (got {args.bucket_counts!r})")
    from rangefinder.planning import loader_updates_per_epoch, val_count

    r = args.repeats
    # Repeats count each image r times an epoch: the plan of r copies of the training set (the split is of the images).
    n_val = 0 if counts is not None else val_count(args.images, args.val_split)
    distinct = sum(counts) if counts is not None else args.images - n_val
    result = plan(
        args.images if counts is None else sum(counts),
        train_images=distinct * r if r > 1 else None,
        val_split=args.val_split,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        world_size=args.world_size if args.world_size is not None else args.processes_per_node * args.nodes,
        epochs=args.epochs,
        steps=args.steps,
        steps_unit=args.steps_unit,
        lr=args.lr,
        scale_lr=args.scale_lr,
        drop_last=args.drop_last,
        bucket_counts=None if counts is None else [c * r for c in counts],
    ).model_dump()
    result["val_images"] = n_val
    if r > 1:
        result["train_images"] = distinct
        result["images_per_epoch"] = distinct * r
    result["repeats"] = r
    # rangefinder's epoch (finetune.epochs, select-steps' recommended_epochs): every training image once.
    result["passes_over_each_image"] = round(result["images_seen"] / distinct, 4)
    upe = loader_updates_per_epoch([c * r for c in counts] if counts is not None else [distinct * r],
                                   batch_size=args.batch_size, world_size=result["world_size"],
                                   grad_accum=args.grad_accum, drop_last=args.drop_last)
    steps = result["total_updates"] if args.steps is not None else args.epochs * upe
    result["per_epoch_loader"] = {
        "counts": "kohya sd-scripts and the diffusers examples: an epoch is a dataloader of its own, its partial "
        "last batch and update included; a step is an update",
        "updates_per_epoch": upe,
        "max_train_steps": steps,
        "num_train_epochs": args.epochs if args.epochs is not None else -(-steps // upe),
    }
    # The global batch: what one update averages over, across every process of every node.
    result["global_batch"] = result["effective_batch"]
    # Both conventions side by side, so a recipe can be read either way.
    result["steps_in_updates"] = result["total_updates"]
    result["steps_in_micro_batches"] = result["total_micro_batches"]
    return result

