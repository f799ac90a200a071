"""The errors a user can act on. Each message is one sentence naming the file, field or value, and the fix."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


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
def one_line_errors(step: str) -> Iterator[None]:
    """Inside a pipeline step: bad input ends the step with exit status 2 and one line on stderr,
    `rangefinder step STEP: error: ConfigError: MESSAGE`, instead of a traceback. The local runner quotes it from
    `ConfigError:` on, as it quotes other exceptions (rangefinder.pipelines.local_run); on a cluster it is the last
    line of the pod's log."""
    try:
        yield
    except RangefinderError as e:
        print(f"{STEP_ERROR_PREFIX} {step}: error: {public_name(e)}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def public_name(e: RangefinderError) -> str:
    """The error's kind as this module names it (e.g. TrackingError for a subclass a layer keeps for itself, such as
    tracking's ServerAway): what a user reads and a runner quotes."""
    return next(cls.__name__ for cls in type(e).__mro__ if cls.__module__ == __name__)


class Preempted(RangefinderError):
    """Training stopped on SIGTERM (a pod eviction, a spot preemption) after writing a checkpoint at the current
    update: the CLI exits 143 (128 + SIGTERM), a pipeline step fails, and a retry or `--resume` goes on from there."""
