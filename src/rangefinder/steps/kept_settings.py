"""A step called in a process that goes on after it (a notebook's kernel, a test) leaves MLflow's process-wide
settings as it found them: see tracking.target.mlflow_settings_kept. In a KFP pod or a step's own process (the CLI's,
kfp.local's) the process ends with the step, so this changes nothing there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

Step = TypeVar("Step", bound=Callable[..., Any])


def keeps_mlflow_settings(step: Step) -> Step:
    """`step` (a run_<step>() that logs to MLflow), putting back the tracking URI and HTTP limits it set when it
    returns or raises. tracking is imported at the call, not here: importing a step stays as light as it was."""

    @functools.wraps(step)
    def call(*args: Any, **kwargs: Any) -> Any:
        from rangefinder.tracking.target import mlflow_settings_kept

        with mlflow_settings_kept():
            return step(*args, **kwargs)

    return cast(Step, call)
