"""`rangefinder make-dataset`: the embedded default dataset (synthetic images with true captions), offline."""

from __future__ import annotations

import argparse

from rangefinder.cli import args as argtypes
from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-dataset",
        help="write a synthetic dataset with true captions (offline, deterministic)",
        description="Write synthetic images with .txt captions. The same --seed gives byte-identical files. "
        "'shapes-on-white' is the demo dataset (four colours, four shapes, on white); 'shapes' the same "
        "shapes in eight colours on eight backgrounds; 'stripes' is what the tiny base model is pre-trained on; "
        "'textures' (a textured style), 'subject' (one subject named by the rare token 'sks', DreamBooth-like) "
        "and 'glyphs' (stroke letters over soft landscapes) are further kinds for the discovery bench.",
    )
    # Written out, not imported from data.synthetic, so that `--help` stays fast (tests check they agree).
    p.add_argument("--kind", choices=["shapes-on-white", "shapes", "stripes", "textures", "subject", "glyphs"],
                   default="shapes-on-white",
                   help="what the images show (default shapes-on-white)")
    p.add_argument("--out", required=True, help="folder to create (must be new or empty)")
    p.add_argument("--count", type=argtypes.int_in(1, 1_000_000, what="the number of images"), default=20,
                   help="number of images (default 20)")
    p.add_argument("--seed", type=argtypes.seed, default=0, help="seed of the random choices (default 0)")
    p.add_argument("--resolution", type=argtypes.int_in(8, argtypes.MAX_RESOLUTION, what="the image side in pixels"),
                   default=32, help="image side in pixels (default 32)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from rangefinder.data.synthetic import make_synthetic_dataset

    return make_synthetic_dataset(args.out, kind=args.kind, count=args.count, seed=args.seed,
                                  resolution=args.resolution)
