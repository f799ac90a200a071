"""`rangefinder`: one subcommand per module in src/rangefinder/cli/commands/.

Each command module defines `register(subparsers)`, which adds its parser and sets `func(args) -> dict`. The
returned dict is printed as a human table, or as JSON with `--json`. Bad input raises RangefinderError, which is
printed as one line on stderr with exit status 2; RunDidNotSucceed (`submit --wait` on a run that failed) prints its
result first, then its line, and exits 1. Heavy imports (torch, kfp, mlflow) happen inside `func`, so
`rangefinder --help` and `rangefinder plan` stay fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional

from rangefinder.cli.args import OneLineParser
from rangefinder.cli.output import print_table
from rangefinder.cli.storage import storage_problem
from rangefinder.errors import Preempted, RangefinderError, RunDidNotSucceed, on_sigint, sigterm_stops
from rangefinder.formats.text import printable
from rangefinder.redaction import redact
from rangefinder.steps.kept_settings import mlflow_settings_kept

# Order is the order `rangefinder --help` lists them in.
COMMANDS = [
    "plan",
    "compile",
    "demo",
    "run",
    "submit",
    "schedule",
    "make_dataset",
    "make_base_model",
    "split",
    "sample",
    "train",
    "analyze_lr",
    "select_steps",
    "register",
    "promote",
    "relog",
]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="rangefinder",
        description="Fine-tune Stable Diffusion with the learning rate and training length found by measurement.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"rangefinder.cli.commands.{name}").register(sub)
    return parser


# Arguments that name a file or folder (argparse dests). An empty one ("" from an unset shell variable) would mean
# the working folder to pathlib: `split --out ""` wrote the split there.
PATH_ARGS = ("out", "config", "data", "data_dir", "model", "curve", "plot", "report", "cache_dir", "tokenizer",
             "checkpoints", "spools", "prompts")
# Options whose absence means a default (an environment variable's, a config's, a name made up): given empty (a CI
# secret or shell variable that is unset), each was taken for absent, so `submit --token "$KFP_TOKEN"` sent the pod's
# own token or none, `--experiment ""` ran in the config's experiment and `--tracking-uri ""` promoted in ./mlflow.db.
NONEMPTY_ARGS = ("host", "token", "namespace", "experiment", "name", "ui_url", "ca_cert", "tracking_uri", "alias",
                 "from_alias")


def _refuse_empty_paths(args: argparse.Namespace) -> None:
    """RangefinderError for a path argument (or one of NONEMPTY_ARGS) that is empty or blank, or a path under the
    home folder of a user this machine does not have (config.home_of_no_user), or any argument holding a NUL
    character."""
    from rangefinder.config import home_of_no_user

    for dest, value in vars(args).items():
        values = value if isinstance(value, list) else [value]
        flag = f"--{dest.replace('_', '-')}" if dest not in ("data_dir", "curve", "spools") else dest.upper()
        for v in values:
            if not isinstance(v, str):
                continue
            if "\0" in v:
                raise RangefinderError(f"{flag} holds a NUL character, which no path or setting can; retype it")
            if dest in PATH_ARGS and not v.strip():
                raise RangefinderError(f"{flag} is empty; give a path (an unset shell variable gives an empty "
                                       "argument)")
            if dest in NONEMPTY_ARGS and not v.strip():
                raise RangefinderError(f"{flag} is empty (an unset shell variable or CI secret gives an empty "
                                       f"argument); give its value, or leave {flag} out for its default")
            problem = home_of_no_user(v) if dest in PATH_ARGS else None
            if problem is not None:
                raise RangefinderError(f"{flag} {problem}")


def _said(text: object) -> str:
    """An error line's words: printable, and with any secret it carries hidden (a token pasted into a setting that a
    message quotes, a URL's password)."""
    return printable(redact(text))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    terminated: list[bool] = []
    try:
        _refuse_empty_paths(args)
        # A Ctrl-C that surfaced as another error (a model load's "damaged weights") is a Ctrl-C; a SIGTERM stops the
        # command as a Ctrl-C does (the training loop's own rule aside: a checkpoint, then Preempted).
        # main() called again in one process (a notebook, a test) reads no MLflow setting an earlier command set.
        with on_sigint(), sigterm_stops(terminated), _library_logs_follow_stderr(), mlflow_settings_kept():
            result = args.func(args)
    except Preempted as e:  # SIGTERM: a checkpoint at the current update is written
        print(f"rangefinder {args.command}: {_said(e)}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except RunDidNotSucceed as e:
        status = _print_result(args, e.result)
        print(f"rangefinder {args.command}: {_said(e)}", file=sys.stderr)
        return status or e.exit_status
    except RangefinderError as e:
        print(f"rangefinder {args.command}: error: {_said(e)}", file=sys.stderr)
        return 2
    except (FileExistsError, NotADirectoryError, IsADirectoryError) as e:
        # A path given where a folder is meant names a file, or the other way round: the checks at the edge
        # (formats.atomic.usable_folder) catch the known ones; this says any other in one line too.
        print(f"rangefinder {args.command}: error: {_said(e.filename)}: {(e.strerror or str(e)).lower()}; pass a "
              "folder where a folder is meant and a file where a file is meant", file=sys.stderr)
        return 2
    except OSError as e:
        # A full disk, a read-only mount, a quota: one line naming the path (the atomic writers left nothing that
        # looks finished). Any other OSError is a bug and keeps its traceback.
        written = [getattr(args, d, None) for d in ("out", "plot", "report", "cache_dir")]
        problem = storage_problem(e, next((w for w in written if w), None))
        if problem is None:
            raise
        print(f"rangefinder {args.command}: error: {_said(problem)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if terminated:
            print(f"rangefinder {args.command}: stopped by SIGTERM{_how_to_go_on(args, argv)}", file=sys.stderr)
            return 128 + signal.SIGTERM
        print(f"rangefinder {args.command}: interrupted{_how_to_go_on(args, argv)}", file=sys.stderr)
        return 130
    if result is None:
        return 0
    return _print_result(args, result)


class _CurrentStderr:
    """A stream that writes to sys.stderr as it is at each write (logging's own last-resort handler does the same)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text) if sys.stderr is not None else len(text)

    def flush(self) -> None:
        if sys.stderr is not None:
            sys.stderr.flush()


def _log_handlers() -> set[logging.Handler]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return {h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers}


@contextlib.contextmanager
def _library_logs_follow_stderr() -> Iterator[None]:
    """The log handlers that the command's imports add write to sys.stderr as it is at each line, not as it was on
    import. huggingface_hub, diffusers, transformers and torch each add a StreamHandler on their import, bound to the
    sys.stderr of that moment, and the commands import them: in a process that calls main() again with sys.stderr
    swapped (a notebook, a test harness redirecting it), their lines went to the first call's stream, lost, or, that
    stream closed, as "--- Logging error --- ValueError: I/O operation on closed file" on the new one."""
    stderr = sys.stderr
    before = _log_handlers()
    try:
        yield
    finally:
        for handler in _log_handlers() - before:
            if isinstance(handler, logging.StreamHandler) and handler.stream is stderr:
                with handler.lock or contextlib.nullcontext():
                    # diffusers' and transformers' handlers also flush with `sys.stderr.flush` bound on import.
                    if getattr(vars(handler).get("flush"), "__self__", None) is stderr:
                        del handler.flush
                    handler.stream = _CurrentStderr()


def _print_result(args: argparse.Namespace, result: dict) -> int:
    """Print a command's result as JSON (--json) or a table; 0, or 141 where the reader stopped reading."""
    try:
        if getattr(args, "json", False):
            print(json.dumps(result, indent=2, default=str))
        else:
            print_table(result)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader stopped reading (`| head`): the command did its work; say nothing, and keep Python's exit-time
        # flush of the same stdout from printing a traceback of its own (Python's docs, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return 0


def _how_to_go_on(args: argparse.Namespace, argv: Optional[Sequence[str]]) -> str:
    """For `train`: the command that goes on from the newest checkpoint (or, without one, starts it again). For a
    local pipeline run (`run`, `demo`): that the same command starts it over, and where the steps' work so far is."""
    words = list(sys.argv[1:] if argv is None else argv)
    if args.command in ("run", "demo"):
        return (f"; a local pipeline run does not resume, the same command starts it over: rangefinder "
                f"{shlex.join(words)} (the steps' outputs so far are under {Path(args.out) / 'pipeline-root'})")
    if args.command != "train":
        return ""
    from rangefinder.formats import checkpoints

    if checkpoints.latest_checkpoint(Path(args.out) / checkpoints.RUN_DIR) is None:
        words = [w for w in words if w != "--resume"]
        return f"; no checkpoint was written yet, so run it again to start over: rangefinder {shlex.join(words)}"
    if "--resume" not in words:
        words.append("--resume")
    return f"; go on from the newest checkpoint with: rangefinder {shlex.join(words)}"


if __name__ == "__main__":
    sys.exit(main())
