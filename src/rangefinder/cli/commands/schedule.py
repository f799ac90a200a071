"""`rangefinder schedule`: a recurring run of the pipeline on a Kubeflow endpoint (6-field cron)."""

from __future__ import annotations

import argparse

from rangefinder.cli.commands.submit import add_endpoint_args
from rangefinder.cli.ignored import ignored_by_submit, warn_conflicts, warn_ignored
from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "schedule",
        help="create a recurring run on a Kubeflow Pipelines endpoint",
        description="Compile the pipeline for a config, upload it (or reuse the same version), and create a recurring "
        "run. The cron has 6 fields, seconds first, as KFP reads it: '0 0 3 * * *' is every day at 03:00.",
    )
    add_endpoint_args(p)
    p.add_argument("--cron", required=True, help="6-field cron: seconds minutes hours day-of-month month day-of-week")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from dataclasses import asdict

    from rangefinder.config import kubernetes_name_problem, load_config
    from rangefinder.errors import ConfigError
    from rangefinder.pipelines.client import submit, validate_cron

    cron = validate_cron(args.cron)  # a bad cron fails before the config is even read
    cfg = load_config(args.config)
    warn_ignored("schedule", ignored_by_submit(cfg, args.dataset_uri))
    warn_conflicts(cfg)
    problem = args.namespace and kubernetes_name_problem(args.namespace, "label")
    if problem:
        raise ConfigError(f"--namespace: {problem}")
    sub = submit(cfg, host=args.host, token=args.token, experiment=args.experiment, run_name=args.name,
                 dataset_uri=args.dataset_uri, cron=cron, namespace=args.namespace)
    out = {k: v for k, v in asdict(sub).items() if v is not None}
    out["cron"] = cron
    return out
