"""`rangefinder promote`: point a registered model's `champion` alias at a version, by hand or from a job.

A pipeline run only ever moves `candidate`; what serves (or is compared against) follows `champion`, and moving it is
a decision a person makes after looking at the samples and curves, or a job's rule: `--if-better` moves it only to a
version measured better on the same validation images.
"""

from __future__ import annotations

import argparse

from rangefinder.cli import args as argtypes
from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    from rangefinder.config import TrackingConfig

    default_name = TrackingConfig().registered_model_name
    p = sub.add_parser(
        "promote",
        help="point the registered model's champion alias at a version",
        description=(
            "Set the MLflow alias --alias (default champion) of the registered model --model to --version, or to "
            "the version that --from-alias (default candidate) points to, and compare it with the version the alias "
            "held: its val_loss against that one's, and whether they rank the two at all (the same validation "
            "images and base model). --if-better moves the alias only where the new version is better (exit "
            "status 1 and the alias left where it was otherwise). The tracking server comes from "
            "--tracking-uri or $MLFLOW_TRACKING_URI (credentials from MLFLOW_TRACKING_USERNAME/PASSWORD or "
            "MLFLOW_TRACKING_TOKEN)."
        ),
    )
    p.add_argument("--model", default=default_name, help=f"registered model name (default {default_name})")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--version", help="the model version to promote")
    which.add_argument("--from-alias", default="candidate",
                       help="promote the version this alias points to (default candidate)")
    p.add_argument("--alias", default="champion", help="the alias to move (default champion)")
    p.add_argument("--if-better", action="store_true",
                   help="promote only a version whose val_loss is below the one the alias holds, measured on the same "
                   "validation images of the same base model (the first one promoted: below its base model's); "
                   "else exit 1 and move nothing")
    p.add_argument("--min-improvement", type=argtypes.float_in(0, 1), default=0.0,
                   help="with --if-better: the share of the held version's val_loss the new one must be lower by "
                   "(0.01: 1%%; default 0, any lower val_loss)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from rangefinder.errors import ConfigError
    from rangefinder.formats.text import warn
    from rangefinder.tracking import promote

    if not args.model:
        raise ConfigError("--model: give the registered model's name")
    if args.min_improvement and not args.if_better:
        raise ConfigError("--min-improvement applies to --if-better only; add --if-better, or leave it out")
    result = promote(args.model, args.version, from_alias=args.from_alias, to_alias=args.alias,
                     tracking_uri=args.tracking_uri, if_better=args.if_better,
                     min_improvement=args.min_improvement)
    moved = result["previous_version"] not in (None, result["version"])
    if result["improved_on_base"] is False or (moved and result["better"] is not True):
        # Promoted all the same (without --if-better): a person who did not look at the comparison is told.
        warn([f"promoted version {result['version']} to @{args.alias}, but {result['comparison']}"])
    return result
