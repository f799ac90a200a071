"""`rangefinder sample`: render fixed prompts and seeds for the base model and each checkpoint into one grid."""

from __future__ import annotations

import argparse

from rangefinder.cli import args as argtypes
from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    from rangefinder.config import SamplingConfig

    d = SamplingConfig()
    p = sub.add_parser(
        "sample",
        help="render a prompt x seed grid for the base model and each checkpoint",
        description=(
            "Every prompt x seed (rows) for the base model (first column) and each checkpoint, with the same seed "
            "and settings across a row so only the weights differ. Writes grid.png, grid.html, grid.json and "
            "the single images under --out."
        ),
    )
    p.add_argument("--model", required=True,
                   help="the base model (the first column): a diffusers folder, a single .safetensors checkpoint or a "
                   "hub id, as `train --model` takes it")
    p.add_argument(
        "--checkpoints",
        nargs="*",
        default=[],
        help="further columns: diffusers folders, checkpoint folders, single-file checkpoints, LoRA or "
        "textual-inversion files (LoRA and embeddings are applied on top of --model)",
    )
    p.add_argument("--single-file-config", metavar="FOLDER",
                   help="for a --model single file that names no architecture: a local diffusers folder of the same "
                   "architecture (model.single_file_config; a Flux transformer file takes its VAE and text encoders)")
    p.add_argument("--labels", nargs="*", help="column labels, one per column (base model first)")
    p.add_argument("--prompts", help="text file with one prompt per line (default: the sampling config's prompts)")
    p.add_argument("--seeds", nargs="+", type=argtypes.seed, default=None, help=f"seeds (default {d.seeds})")
    p.add_argument("--out", required=True,
                   help="output folder: a new or empty one, or an earlier grid's, which the new grid replaces once "
                   "whole (a run stopped part-way leaves the earlier grid as it was)")
    p.add_argument("--steps", type=argtypes.int_in(1, 10_000, what="the denoising steps"),
                   default=d.num_inference_steps, help=f"denoising steps (default {d.num_inference_steps})")
    p.add_argument("--guidance", type=argtypes.float_in(0.0), default=d.guidance_scale,
                   help="guidance scale: classifier-free guidance's, or Flux.1-dev's distilled guidance input "
                   "(default: the model's own, what its diffusers pipeline samples at: 7.5 for SD 1.x/2.x, 5 for "
                   "SDXL, 7 for SD3, 3.5 for Flux.1-dev; none for FLUX.1-schnell, which has no guidance input)")
    p.add_argument("--scheduler", help="a diffusers scheduler class name, e.g. DDIMScheduler (default: the model's)")
    p.add_argument("--resolution", type=argtypes.resolution, help="image size in pixels (default: the model's)")
    p.add_argument("--negative-prompt", help="negative prompt for every cell (it steers classifier-free guidance: "
                   "refused on Flux and at a guidance scale of 1 or below, where it would change nothing)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from pathlib import Path

    from rangefinder.config import ModelConfig, SamplingConfig
    from rangefinder.errors import ConfigError
    from rangefinder.models.loading import refuse_shipped_code, resolve_base_model
    from rangefinder.sampling import GridColumn, read_prompts, render_grid

    d = SamplingConfig()
    prompts = read_prompts(args.prompts) if args.prompts else d.prompts
    seeds = args.seeds if args.seeds else d.seeds
    if args.labels and len(args.labels) != 1 + len(args.checkpoints):
        raise ConfigError(
            f"--labels: {len(args.labels)} labels for {1 + len(args.checkpoints)} columns (the base model and "
            f"{len(args.checkpoints)} checkpoints); give one label per column"
        )
    if args.steps < 1:
        raise ConfigError(f"--steps must be at least 1 (got {args.steps})")
    base: object = args.model
    if args.single_file_config and Path(args.model).expanduser().is_dir():
        raise ConfigError(f"--single-file-config is for a --model that is a single .safetensors file; {args.model} is "
                          "a folder, whose own configs give its architecture: drop --single-file-config")
    if (Path(args.model).expanduser() / "model_index.json").is_file():
        refuse_shipped_code(Path(args.model).expanduser(), f"--model: {args.model}")
    else:
        # A single file or a hub id, resolved to a diffusers folder as `train --model` resolves it (a file converted
        # once into the rangefinder cache); anything else is refused there, naming what to pass.
        try:
            folder = resolve_base_model(ModelConfig(base_model=args.model,
                                                    single_file_config=args.single_file_config)).path
        except ConfigError as e:  # named as this command's flags: there is no config file to set them in
            raise ConfigError(str(e).replace("model.single_file_config", "--single-file-config")
                              .replace("model.base_model", "--model")) from None
        base = GridColumn(args.labels[0] if args.labels else Path(args.model).stem, folder, "pipeline")
    models = [base, *args.checkpoints]
    result = render_grid(
        models,
        prompts,
        seeds,
        out_dir=args.out,
        labels=args.labels or None,
        base_model=base.path if isinstance(base, GridColumn) else args.model,
        steps=args.steps,
        guidance_scale=args.guidance,
        scheduler=args.scheduler,
        resolution=args.resolution,
        negative_prompt=args.negative_prompt,
    )
    return {
        "grid": result["grid"],
        "html": result["html"],
        "manifest": result["manifest"],
        "columns": [c["label"] for c in result["columns"]],
        "rows": len(result["rows"]),
        "images": sum(len(r) for r in result["images"]),
    }
