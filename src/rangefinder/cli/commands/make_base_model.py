"""`rangefinder make-base-model`: the embedded tiny Stable Diffusion model, built offline and cached."""

from __future__ import annotations

import argparse

from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-base-model",
        help="build the tiny offline Stable Diffusion model (diffusers folder layout), or reuse the cached one",
        description="Build a tiny Stable Diffusion pipeline from config and pre-train it briefly on synthetic stripes "
        "(a few minutes on 2 CPU cores). It is cached under $RANGEFINDER_CACHE or ~/.cache/rangefinder; "
        "--out copies it to a folder of your choice.",
    )
    p.add_argument("--out", help="folder to write the model to (new or empty); default: print the cached folder")
    p.add_argument("--cache-dir", help="cache folder (default $RANGEFINDER_CACHE or ~/.cache/rangefinder)")
    p.add_argument("--family", choices=("sd1", "sdxl"), default="sd1",
                   help="sd1: the tiny Stable Diffusion 1.x model (default); sdxl: the tiny SDXL model, as `demo "
                   "--family sdxl` trains")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    import json

    from rangefinder.models.tiny import copy_model, ensure_tiny_base_model
    from rangefinder.models.tiny_sdxl import ensure_tiny_sdxl_model

    ensure = ensure_tiny_sdxl_model if args.family == "sdxl" else ensure_tiny_base_model
    cached = ensure(args.cache_dir)
    out = copy_model(cached, args.out) if args.out else cached
    info = json.loads((cached / "rangefinder_tiny.json").read_text())
    return {"out": str(out), "cached": str(cached), "family": args.family,
            **{k: round(v, 5) for k, v in info.get("pretraining", {}).items()}}
