"""`rangefinder schedule`: a recurring run of the pipeline on a Kubeflow endpoint (6-field cron)."""

from __future__ import annotations

import argparse

from rangefinder.cli import args as argtypes
from rangefinder.cli.commands.submit import (
    add_endpoint_args,
    endpoint_kwargs,
    endpoint_result,
    experiment_result,
    load_checked_config,
)
from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "schedule",
        help="create a recurring run on a Kubeflow Pipelines endpoint",
        description="Compile the pipeline for a config, upload it (or reuse the same version), and create a recurring "
        "run. The cron has 6 fields, seconds first, as KFP reads it: '0 0 3 * * *' is every day at 03:00 in the "
        "scheduler's time zone (UTC unless KFP's CRON_SCHEDULE_TIMEZONE says otherwise); '@daily' and "
        "'@every 12h' work too. An enabled recurring run of the same name in the experiment is refused unless "
        "--replace. Exit status 0 once the recurring run is made (with --replace: and the old ones disabled), 1 "
        "when --replace made it but could not disable an old one (the result is printed all the same), 2 when "
        "nothing was made.",
    )
    add_endpoint_args(p)
    p.add_argument("--cron", required=True, help="6-field cron: seconds minutes hours day-of-month month day-of-week; "
                   "or @hourly, @daily, @weekly, @monthly, @yearly, @every DURATION (e.g. 12h, 90m)")
    p.add_argument("--name", help="display name of the recurring run (default: rangefinder-finetune)")
    p.add_argument("--replace", action="store_true",
                   help="disable the enabled recurring runs of this name in the experiment once the new one is made")
    p.add_argument("--max-concurrency", type=argtypes.int_in(1, 10), default=1,
                   help="runs of this schedule that may run at once (1-10, default 1); runs at once register into one "
                   "model, and @candidate ends on the one started last")
    p.add_argument("--catchup", action="store_true",
                   help="run every schedule missed while it was paused or behind (default: only the latest); each "
                   "trains on the dataset as it is when it runs, so the missed runs of a retrain repeat one run")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from rangefinder.errors import RunDidNotSucceed
    from rangefinder.pipelines.client import submit, validate_cron

    cron = validate_cron(args.cron)  # a bad cron fails before the config is even read
    cfg = load_checked_config(args, "schedule")
    sub = submit(cfg, **endpoint_kwargs(args), cron=cron, replace=args.replace,
                 max_concurrency=args.max_concurrency, catchup=args.catchup)
    out = {"recurring_run_id": sub.recurring_run_id, "recurring_run_url": sub.recurring_run_url, "name": sub.name,
           "cron": cron, "max_concurrency": args.max_concurrency, "catchup": args.catchup, "replaced": sub.replaced,
           **experiment_result(args, sub), "experiment_id": sub.experiment_id, "pipeline_id": sub.pipeline_id,
           "version_id": sub.version_id, "uploaded": sub.uploaded, **endpoint_result(args, sub)}
    if sub.replace_error:
        raise RunDidNotSucceed(f"recurring run {sub.recurring_run_id} was created, but {sub.replace_error}; run the "
                               "same command again to disable it, or disable it in the KFP UI", out)
    return out
