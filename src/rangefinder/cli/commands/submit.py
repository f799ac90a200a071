"""`rangefinder submit`: upload (or reuse) the pipeline on a Kubeflow endpoint and start a run of a config."""

from __future__ import annotations

import argparse

from rangefinder.cli import args as argtypes
from rangefinder.cli.ignored import (
    ignored_by_submit,
    off_the_data_volume,
    tracking_off_the_cluster,
    warn_conflicts,
    warn_ignored,
)
from rangefinder.cli.output import add_json_flag
from rangefinder.formats.text import warn

WAIT_TIMEOUT_S = 24 * 3600  # --timeout's default


def add_endpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="KFP endpoint URL (default: $KF_PIPELINES_ENDPOINT)")
    p.add_argument("--ui-url", help="the KFP UI the printed links point at, e.g. "
                   "https://kubeflow.example.com/pipeline or http://localhost:8080 after `kubectl port-forward -n "
                   "kubeflow svc/ml-pipeline-ui 8080:80` (default: $KF_PIPELINES_UI_ENDPOINT, as kfp reads it, else "
                   "the endpoint)")
    p.add_argument("--token", help="bearer token (default: the token file $KF_PIPELINES_SA_TOKEN_PATH names, else "
                   "the in-cluster service-account token, if any)")
    p.add_argument("--namespace", help="Kubeflow profile namespace (multi-user installs)")
    p.add_argument("--ca-cert", help="PEM file of the CA that signed the endpoint's certificate (default: certifi's "
                   "public CAs)")
    p.add_argument("--request-timeout", type=argtypes.float_in(0, lo_open=True), default=30.0,
                   help="seconds a request to the endpoint may wait to connect, or for the server's answer, before the "
                   "command gives up; one that timed out is not sent again (default 30)")
    p.add_argument("--config", required=True, help="a rangefinder config YAML: parameters and pod settings")
    p.add_argument("--experiment", help="KFP experiment, made if missing, which the result says (default: "
                   "tracking.experiment_name of the config)")
    p.add_argument("--dataset-uri", default="",
                   help="object-store URI of the dataset folder (s3://, gs://, minio://); default: none, the "
                   "config's data.dataset_dir on the data volume")


def load_checked_config(args: argparse.Namespace, command: str):
    """The config, its ignored settings and conflicts warned about, --dataset-uri and --namespace checked: before any
    request."""
    from rangefinder.config import kubernetes_name_problem, load_config
    from rangefinder.errors import ConfigError
    from rangefinder.pipelines.client import check_dataset_uri

    check_dataset_uri(args.dataset_uri)  # before the warning that it replaces data.dataset_dir
    cfg = load_config(args.config)
    warn_ignored(command, ignored_by_submit(cfg, args.dataset_uri))
    warn_conflicts(cfg)
    warn(off_the_data_volume(cfg, args.dataset_uri) + tracking_off_the_cluster(cfg))
    problem = args.namespace and kubernetes_name_problem(args.namespace, "label")
    if problem:
        raise ConfigError(f"--namespace: {problem}")
    return cfg


def endpoint_kwargs(args: argparse.Namespace) -> dict:
    return {"host": args.host, "token": args.token, "namespace": args.namespace, "ca_cert": args.ca_cert,
            "request_timeout_s": args.request_timeout, "experiment": args.experiment, "dataset_uri": args.dataset_uri,
            "run_name": args.name, "ui_url": args.ui_url}


def experiment_result(args: argparse.Namespace, sub) -> dict:
    """The experiment in the result: --json carries `experiment_created`; the table says it in words, with where the
    name came from, since a misspelt name makes a new experiment rather than failing."""
    if args.json:
        return {"experiment": sub.experiment, "experiment_created": sub.experiment_created}
    if not sub.experiment_created:
        return {"experiment": sub.experiment}
    fix = "correct --experiment" if args.experiment else (f"pass --experiment or correct tracking.experiment_name in "
                                                         f"{args.config}")
    return {"experiment": f"{sub.experiment} (created: KFP had no experiment of that name; if you meant an existing "
                          f"one, {fix})"}


def endpoint_result(args: argparse.Namespace, sub) -> dict:
    """The endpoint and the KFP UI the links point at; the table says when that is the endpoint, taken to serve the
    UI (a port-forward of ml-pipeline-ui does; the API server, ml-pipeline, does not)."""
    ui_url = sub.ui_url
    if not (args.json or sub.ui_url_given):
        ui_url += (" (the endpoint, assumed to serve the KFP UI; where it does not, pass --ui-url or set "
                   "$KF_PIPELINES_UI_ENDPOINT)")
    return {"host": sub.host, "ui_url": ui_url}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit",
        help="run the pipeline on a Kubeflow Pipelines endpoint",
        description="Compile the pipeline for a config, upload it (or reuse the same version), and create a run. "
        "Prints the run's id and link (--json: as JSON alone on stdout). Exit status 0 once the run is created "
        "(with --wait: once it succeeded), 1 with --wait when it failed, was cancelled, was still going at "
        "--timeout or could no longer be read from the endpoint (the result is printed all the same), 2 when it "
        "could not be submitted.",
    )
    add_endpoint_args(p)
    p.add_argument("--name", help="display name of the run (default: rangefinder-finetune-<the first 8 characters "
                   "of version_id, the KFP pipeline version's id the result gives>)")
    p.add_argument("--once", action="store_true",
                   help="with --name: start no second run of that name in the experiment; one that has not failed, "
                   "been cancelled or skipped is reported (and waited for) instead. For a CI job that may be retried")
    p.add_argument("--wait", action="store_true", help="wait until the run finishes and print its state")
    p.add_argument("--timeout", type=argtypes.int_in(1, what="seconds"),
                   help=f"with --wait: seconds it waits (default {WAIT_TIMEOUT_S})")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from rangefinder.errors import RunDidNotSucceed
    from rangefinder.pipelines.client import submit

    if args.timeout is not None and not args.wait:
        # It was taken without a word: a CI job meaning to wait for the run, at most that long, got a command that
        # returned once the run was created, and passed whatever the run did.
        warn_ignored("submit", [(["--timeout"], "it bounds --wait, which is not given: the command returns once the "
                                 "run is created")])
    timeout = args.timeout or WAIT_TIMEOUT_S
    cfg = load_checked_config(args, "submit")
    sub = submit(cfg, **endpoint_kwargs(args), wait=args.wait, timeout_s=timeout, once=args.once)
    out: dict = {"run_id": sub.run_id, "run_url": sub.run_url, "name": sub.name}
    if sub.reused_run is not None:
        out["reused_run"] = sub.reused_run
    if sub.state is not None:
        out["state"] = sub.state
    out.update(experiment_result(args, sub))
    out.update(experiment_id=sub.experiment_id, pipeline_id=sub.pipeline_id, version_id=sub.version_id,
               uploaded=sub.uploaded, **endpoint_result(args, sub))
    if args.wait and sub.state != "SUCCEEDED":
        if sub.wait_error:
            raise RunDidNotSucceed(f"run {sub.run_id} was created, but --wait could not follow it: {sub.wait_error}; "
                                   f"see {sub.run_url}", out)
        if sub.timed_out:
            raise RunDidNotSucceed(f"run {sub.run_id} is still {sub.state} after --timeout {timeout} s (it goes "
                                   f"on on the cluster); see {sub.run_url}", out)
        raise RunDidNotSucceed(f"run {sub.run_id} finished {sub.state}; see {sub.run_url}", out)
    return out
