"""`rangefinder promote`: point a registered model's `champion` alias at a version, by hand.

A pipeline run only ever moves `candidate`; what serves (or is compared against) follows `champion`, and moving it is
a decision a person makes after looking at the samples and curves.
"""

from __future__ import annotations

import argparse

from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    from rangefinder.config import TrackingConfig

    default_name = TrackingConfig().registered_model_name
    p = sub.add_parser(
        "promote",
        help="point the registered model's champion alias at a version",
        description=(
            "Set the MLflow alias --alias (default champion) of the registered model --model to --version, or to "
            "the version that --from-alias (default candidate) points to. The tracking server comes from "
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
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from rangefinder.errors import ConfigError
    from rangefinder.tracking import promote

    if not args.model:
        raise ConfigError("--model: give the registered model's name")
    return promote(args.model, args.version, from_alias=args.from_alias, to_alias=args.alias,
                   tracking_uri=args.tracking_uri)
