"""`rangefinder relog SPOOL`: log to MLflow what a step kept on disk while the tracking server was not answering.

A step whose MLflow server stopped answering goes on, and ends with a warning naming its spool (a .jsonl file,
by default under OUT/mlflow-spool of a local run, or $RANGEFINDER_WORK/mlflow-spool on a cluster). Once the server
answers again, this command sends every record of it to the run it belongs to, in order, and removes the spool.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "relog",
        help="log to MLflow what a step kept on disk while the server was away",
        description="Send the metrics, params, tags, artifacts and run ends a step could not log (its MLflow spool) "
        "to the tracking server, then remove the spool. The server is --tracking-uri, else $MLFLOW_TRACKING_URI, "
        "else the one the spool names; credentials come from MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN.",
    )
    p.add_argument("spools", nargs="+", metavar="SPOOL", help="a spool file (*.jsonl), or a folder of them")
    p.add_argument("--tracking-uri", help="the MLflow server to log to (default: $MLFLOW_TRACKING_URI, else the "
                   "spool's own)")
    add_json_flag(p)
    p.set_defaults(func=run)


def spool_files(paths: list[str]) -> list[Path]:
    from rangefinder.errors import TrackingError

    files: list[Path] = []
    for given in paths:
        p = Path(given)
        if p.is_dir():
            files += sorted(p.glob("*.jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise TrackingError(f"{p} does not exist; pass a spool file (*.jsonl) or the folder a step's warning named")
    if not files:
        raise TrackingError(f"no spool files (*.jsonl) in {', '.join(paths)}: nothing to relog")
    return files


def run(args: argparse.Namespace) -> dict:
    from rangefinder.errors import TrackingError
    from rangefinder.tracking.outbox import spool_lock
    from rangefinder.tracking.redaction import safe_uri
    from rangefinder.tracking.spool import describe, read_spool, replay
    from rangefinder.tracking.target import (
        bound_http_requests,
        ensure_tracking_server,
        env_tracking_uri,
        no_artifact_bars_off_a_terminal,
        refusal_message,
        refuse_uri_credentials,
    )

    if args.tracking_uri:
        refuse_uri_credentials(args.tracking_uri, "--tracking-uri")
    bound_http_requests()
    no_artifact_bars_off_a_terminal()
    done: list[str] = []
    for path in spool_files(args.spools):
        if not path.is_file():  # a run's spool sent before its turn, with a spool naming that run (tracking.spool)
            done.append(f"{path}: already sent, with a spool that names its run")
            continue
        header = read_spool(path).header
        uri = args.tracking_uri or env_tracking_uri() or header["tracking_uri"]
        ensure_tracking_server(uri)
        # mlflow only now, once there is a spool to send (importing it costs seconds): a spool that cannot be read or
        # a URI holding credentials is refused at once.
        from mlflow import MlflowClient

        # The step that wrote the spool may still be running (a folder of spools holds every step's): it appends and
        # sends under this lock, and a replay beside it would drop what it appends meanwhile or send records twice.
        with spool_lock(path.parent):
            if not path.is_file():  # the step sent it itself while we waited
                done.append(f"{path}: already sent by its step")
                continue
            result = replay(path, MlflowClient(tracking_uri=uri))
        line = f"{path}: {describe(result.sent)} to run {header['run_id']} at {safe_uri(uri)}"
        if result.torn:
            line += f" ({result.torn} unreadable lines skipped: a write cut off when the step was killed)"
        if result.left and result.refused is not None:  # an answer: waiting for the server would not help
            raise TrackingError(f"{refusal_message(uri, result.refused, result.host)}; logged {describe(result.sent)}, "
                                f"and {describe(result.left)} are still in {path}: run `rangefinder relog {path}` "
                                + ("again once it allows it" if result.host else "again with credentials it takes")
                                + (f" (done before it: {'; '.join(done)})" if done else ""))
        if result.left:
            raise TrackingError(f"the MLflow server at {safe_uri(uri)} stopped answering again; logged "
                                f"{describe(result.sent)}, and {describe(result.left)} are still in {path}: "
                                f"run `rangefinder relog {path}` again once it answers"
                                + (f" (done before it: {'; '.join(done)})" if done else ""))
        done.append(line)
    return {"relogged": done}
