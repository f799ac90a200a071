"""`rangefinder make-base-model`: the embedded tiny Stable Diffusion model, from the shipped weights, cached."""

from __future__ import annotations

import argparse

from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-base-model",
        help="the tiny offline Stable Diffusion model (diffusers folder layout), from the package's shipped weights",
        description="Copy the tiny Stable Diffusion pipeline shipped with the package (checked against its sha256 "
        "digests) into the cache under $RANGEFINDER_CACHE or ~/.cache/rangefinder, or reuse the cached one; --out "
        "copies it to a folder of your choice. --rebuild builds the tiny SD, SDXL, SD3 and Flux models from config, "
        "pre-trains them on synthetic stripes (about 5 minutes on 2 CPU cores) and writes them as the package's "
        "shipped weights (`make tiny-weights`).",
    )
    p.add_argument("--out", help="folder to write the model to (new or empty); default: print the cached folder")
    p.add_argument("--cache-dir", help="cache folder (default $RANGEFINDER_CACHE or ~/.cache/rangefinder)")
    p.add_argument("--rebuild", action="store_true",
                   help="rebuild the shipped tiny SD, SDXL, SD3 and Flux weights (src/rangefinder/models/weights) on "
                   "this CPU")
    p.add_argument("--family", choices=("sd1", "sdxl", "sd3", "flux"), default="sd1",
                   help="sd1: the tiny Stable Diffusion 1.x model (default); sdxl, sd3, flux: the tiny SDXL, SD3 or "
                   "Flux.1 model, as `demo --family F` trains")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    import json

    from rangefinder.models.loading import TINY_MODELS
    from rangefinder.models.tiny import copy_model
    from rangefinder.training.family_detection import import_named

    if args.rebuild:
        from rangefinder.models.tiny_weights import rebuild_shipped_weights

        return {name: str(folder) for name, folder in rebuild_shipped_weights().items()}
    cached = import_named(TINY_MODELS[args.family])(args.cache_dir)
    out = copy_model(cached, args.out) if args.out else cached
    info = json.loads((cached / "rangefinder_tiny.json").read_text())
    return {"out": str(out), "cached": str(cached), "family": args.family,
            **{k: round(v, 5) for k, v in info.get("pretraining", {}).items()}}
