"""A step called in a process that goes on after it (a notebook's kernel, a test, the CLI's main() called again)
leaves MLflow's process-wide settings as it found them. In a KFP pod or a step's own process (the CLI's, kfp.local's)
the process ends with the step, so this changes nothing there.

What a step sets for the whole process while it runs: mlflow.set_tracking_uri (tracking_client's, the registry's)
exports its URI as $MLFLOW_TRACKING_URI for subprocesses, tracking.target.bound_http_requests the
$MLFLOW_HTTP_REQUEST_* limits, mlflow.set_experiment $MLFLOW_EXPERIMENT_ID. They stayed after it, so a later call
without a tracking setting logged to the earlier step's store, not the user's own or the default. Light to import
(mlflow is not): the CLI's start pays nothing for it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

Step = TypeVar("Step", bound=Callable[..., Any])

_MLFLOW_URI_MODULE = "mlflow.tracking._tracking_service.utils"  # where mlflow keeps set_tracking_uri's URI


def _mlflow_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}


@contextlib.contextmanager
def mlflow_settings_kept() -> Iterator[None]:
    """MLflow's process-wide settings as the block found them once it ends, returned or raised: the tracking URI
    mlflow holds and the $MLFLOW_* environment (the tracking URI, the HTTP limits, the experiment id). A user's own
    setting is what is put back. Inside the block nothing changes: the processes a step starts inherit what it set."""
    saved_env = _mlflow_env()
    loaded = sys.modules.get(_MLFLOW_URI_MODULE)  # not imported yet: nothing was set
    saved_uri = getattr(loaded, "_tracking_uri", None)
    try:
        yield
    finally:
        now = sys.modules.get(_MLFLOW_URI_MODULE)
        if now is not None and getattr(now, "_tracking_uri", None) != saved_uri:
            import mlflow

            # None unsets it as mlflow's own tests do; set_tracking_uri also resets the tracer's exporter to it.
            mlflow.set_tracking_uri(saved_uri)  # type: ignore[arg-type]
        for name in set(_mlflow_env()) - set(saved_env):
            del os.environ[name]
        os.environ.update({k: v for k, v in saved_env.items() if os.environ.get(k) != v})


def keeps_mlflow_settings(step: Step) -> Step:
    """`step` (a run_<step>() that logs to MLflow), putting back MLflow's process-wide settings it changed when it
    returns or raises (mlflow_settings_kept)."""

    @functools.wraps(step)
    def call(*args: Any, **kwargs: Any) -> Any:
        with mlflow_settings_kept():
            return step(*args, **kwargs)

    return cast(Step, call)
