"""What the KFP components' bodies share, in a module of its own: a body imports it in the step's process, where
importing rangefinder.pipelines.kfp_components would build every component again (~0.2 s a step)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rangefinder.formats.text import warn

if TYPE_CHECKING:
    from kfp.dsl import Metrics


def log_step_metrics(metrics: Metrics, values: Mapping[str, float]) -> None:
    """A step's numbers into its KFP Metrics artifact, the finite ones: KFP writes the artifact's metadata into the
    executor output with Python's json (kfp.dsl.executor), which spells NaN and inf `NaN` and `Infinity`, no JSON
    that a cluster's launcher, MLMD or the UI's metrics table reads. One left out is named in a warning; the step's
    MLflow run and report hold the curve it came from."""
    left_out = {name: value for name, value in values.items() if not math.isfinite(value)}
    for name, value in values.items():
        if name not in left_out:
            metrics.log_metric(name, float(value))
    if left_out:
        named = ", ".join(f"{name} ({value})" for name, value in left_out.items())
        warn([f"{named} left out of the step's KFP metrics: not a finite number (KFP's metrics are JSON); the step's "
              "MLflow run and report show where it came from"])
