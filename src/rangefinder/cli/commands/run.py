"""`rangefinder run --local --config FILE`: the whole pipeline on this machine, on your own data and model."""

from __future__ import annotations

import argparse

from rangefinder.cli.ignored import ignored_by_pipeline, warn_conflicts, warn_ignored
from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run the whole pipeline locally (kfp.local) on a config",
        description="Run every step of the pipeline on this machine through kfp.local, on the dataset and base model "
        "of a config. For a Kubeflow cluster use `rangefinder submit`.",
    )
    p.add_argument("--local", action="store_true", required=True,
                   help="run on this machine (the only mode; `submit` runs on a cluster)")
    p.add_argument("--config", required=True, help="a rangefinder config YAML")
    p.add_argument("--out", default="rangefinder-run", help="output folder (default ./rangefinder-run)")
    p.add_argument("--verbose", action="store_true",
                   help="stream every step's log on stderr instead of to OUT/pipeline.log")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from rangefinder.config import load_config
    from rangefinder.pipelines.local_run import run_pipeline_locally

    cfg = load_config(args.config)
    warn_ignored("run", ignored_by_pipeline(cfg, local=True))
    warn_conflicts(cfg)
    return run_pipeline_locally(cfg, args.out, quiet=not args.verbose).summary()
