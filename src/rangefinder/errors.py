"""The errors a user can act on. Each message is one sentence naming the file, field or value, and the fix."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType, TracebackType
from typing import Optional

from rangefinder.redaction import redact


class RangefinderError(Exception):
    """Bad input or an impossible setting; the CLI prints it on one line and exits non-zero."""


class ConfigError(RangefinderError, ValueError):
    """An invalid setting."""


class DataError(RangefinderError):
    """A dataset that cannot be used (too few usable images, unreadable folder, ...)."""


class TrackingError(RangefinderError):
    """The MLflow tracking server cannot be reached or refuses the credentials."""


STEP_ERROR_PREFIX = "rangefinder step"


@contextlib.contextmanager
def on_sigint() -> Iterator[None]:
    """SIGINT while inside raises KeyboardInterrupt as Python's handler does, and any error after it leaves as
    KeyboardInterrupt too: the step's MLflow run ends KILLED and the command exits 130, as for any Ctrl-C. Around
    every command (cli.main), every step (one_line_errors, and tracking.step_run for its MLflow run) and the engine's
    train().

    Python raises the KeyboardInterrupt in whatever Python code runs next, which can be code a C extension calls
    back: inside safetensors' read of a tensor (torch's UntypedStorage.__getitem__), torch turns it into its own
    ValueError ("could not determine the shape of object type 'torch.storage.UntypedStorage'"), and the run failed,
    blaming the cache; loading a model, diffusers turns that into "Unable to load weights from checkpoint file", and
    `sample` said the model was damaged. SIGINT ignored (a run started with nohup or in the background) or at the
    system's default stays so; a run in another thread keeps the process's handler."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    came = False

    def handle(signum: int, frame: Optional[FrameType]) -> None:
        nonlocal came
        came = True
        previous(signum, frame)  # Python's own raises KeyboardInterrupt

    signal.signal(signal.SIGINT, handle)
    try:
        yield
    except Exception as e:
        if came:
            raise KeyboardInterrupt from e
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def sigterm_stops(came: list[bool]) -> Iterator[None]:
    """SIGTERM while inside (`kill PID`, a supervisor or CI job stopping the command, a container's stop) stops the
    command as a Ctrl-C in its terminal does: the processes it started get SIGINT (a local run's steps end their MLflow
    runs KILLED), and this one runs its SIGINT handler (on_sigint's, so whatever error it surfaces as is an interrupt).
    `came` gets True, for the CLI to say SIGTERM and exit 143. It went by the system's default: the process died
    without a word, a local run's steps trained on into a closed pipe and their MLflow runs stayed RUNNING or ended
    FAILED. Where a part has its own rule it installs its own handler inside (the training loop: a checkpoint at the
    update, then Preempted). SIGTERM already handled or ignored by whoever started the command stays so."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def handle(signum: int, frame: Optional[FrameType]) -> None:
        came.append(True)
        on_int = signal.getsignal(signal.SIGINT)
        # Started with SIGINT ignored (in the background, nohup), the children ignore it too: they get the SIGTERM.
        for child in _children(os.getpid()):
            with contextlib.suppress(OSError):  # gone already
                os.kill(child, signal.SIGINT if callable(on_int) else signal.SIGTERM)
        if callable(on_int):
            on_int(signal.SIGINT, frame)  # raises KeyboardInterrupt (Python's handler, or on_sigint's around it)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _children(pid: int) -> list[int]:
    """Every process below `pid` (children, theirs, ...), from /proc; none where there is no /proc."""
    parents: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat", "rb") as f:
                        stat = f.read()
                except OSError:  # gone since the listing
                    continue
                # pid (comm) state ppid ...: comm may hold spaces and parentheses, so read after its last ")".
                parents[int(entry.name)] = int(stat[stat.rindex(b")") + 2:].split()[1])
    below, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        below += frontier
    return below


@contextlib.contextmanager
def one_line_errors(step: str) -> Iterator[None]:
    """Inside a pipeline step: bad input ends the step with exit status 2 and one line on stderr,
    `rangefinder step STEP: error: ConfigError: MESSAGE`, instead of a traceback. The local runner quotes it from
    `ConfigError:` on, as it quotes other exceptions (rangefinder.pipelines.local_run); on a cluster it is the last
    line of the pod's log. A Ctrl-C (a local run's) is a Ctrl-C whatever error it surfaced as (on_sigint)."""
    try:
        with on_sigint():
            yield
    except RangefinderError as e:
        # With any secret the message quotes hidden: the line is the last of the pod's log, and a local run shows it.
        print(f"{STEP_ERROR_PREFIX} {step}: error: {public_name(e)}: {redact(e)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if os.environ.get(QUICK_EXIT_ENV) == "1":
        _exit_without_teardown()


# Set by the local runner for its steps (pipelines/local_run.py). A step process that imported torch, diffusers,
# transformers and MLflow spends 1-5 s after its last line in the interpreter's teardown (freeing every module and
# object, no Python frame running; measured after a range test: 0.06 s in the atexit handlers, then 2.9 s), about
# 15 s of the demo's 9 steps. On a cluster a pod's exit is not what anyone waits for, so it is left alone there.
QUICK_EXIT_ENV = "RANGEFINDER_QUICK_EXIT"


def _exit_without_teardown() -> None:
    """Once the step has returned: at exit, run the other atexit handlers (logging, MLflow) as usual, flush the
    standard streams and leave with os._exit, skipping only the teardown. The status stays what Python's would be:
    1 after an uncaught exception (the executor failing to write its outputs, say), else 0. (A SystemExit raised
    after the step would read 0; the KFP executor raises none.)"""
    failed: list[bool] = []
    previous_hook = sys.excepthook

    def note_failure(kind: type[BaseException], error: BaseException, tb: Optional[TracebackType]) -> None:
        failed.append(True)
        previous_hook(kind, error, tb)

    def leave() -> None:
        atexit.unregister(leave)
        atexit._run_exitfuncs()  # the handlers registered before this one; this one runs first (last in, first out)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1 if failed else 0)

    sys.excepthook = note_failure
    atexit.register(leave)


def public_name(e: RangefinderError) -> str:
    """The error's kind as this module names it (e.g. TrackingError for a subclass a layer keeps for itself, such as
    tracking's ServerAway): what a user reads and a runner quotes."""
    return next(cls.__name__ for cls in type(e).__mro__ if cls.__module__ == __name__)


class Preempted(RangefinderError):
    """Training stopped on SIGTERM (a pod eviction, a spot preemption) after writing a checkpoint at the current
    update: the CLI exits 143 (128 + SIGTERM), a pipeline step fails, and a retry or `--resume` goes on from there."""


class RunDidNotSucceed(RangefinderError):
    """What a command waited on ended otherwise than it should (`submit --wait`: the pipeline run failed, was
    cancelled, or was still going when the wait ran out; `promote --if-better`: the version was not measured
    better). The command did its part, so the CLI prints `result` as it prints any result (a CI job reads the run's
    id and link from it), then this message, and exits 1, not bad input's 2."""

    exit_status = 1

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result
