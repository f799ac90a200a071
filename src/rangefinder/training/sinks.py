"""What the engine reports to: `MetricSink` (the metrics of each update and measurement), `ImageSink` (the samples
rendered during training), `PrefixedSink` (two runs of one step in one MLflow run), and the keys it logs.

The MLflow step run (tracking.runs) and the workers' metric logger implement the sinks; the engine never imports
mlflow. A module of its own, below loop.py, validation.py and samples.py, so that none of them imports the
`rangefinder.training` package back.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable


@runtime_checkable
class MetricSink(Protocol):
    """Receives the metrics of each update and each validation measurement, keyed by update number."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


# What the engine logs to its MetricSink: these columns of each update's row (loop.py), and every measured column
# of a validation row (validation.py); a step that replays a run's CSVs (steps/halving.py) logs the same keys.
# lr_effective: the step size the update took; prodigy_d_lr: Prodigy's d x lr after it, its estimate of the step
# size, which lr_finder prodigy_step reads (training.optimizers.step_optimizer), logged by a Prodigy run only.
UPDATE_METRICS = ("train_loss", "lr", "grad_norm", "epoch", "lr_effective", "prodigy_d_lr")
MEASURED_PREFIXES = ("val_", "stabilize_")


@runtime_checkable
class ImageSink(Protocol):
    """Receives images: `image` is a PNG file's path; with `key` and `step` (the update number) it is one step of an
    image series (MLflow's step-keyed images, which its UI shows with a step slider)."""

    def log_image(self, image: Any, artifact_file: Optional[str] = None, *, key: Optional[str] = None,
                  step: Optional[int] = None) -> None: ...


class PrefixedSink:
    """A sink that logs under `prefix` + each key: two runs of one step (the fine-tune's successive halving trains
    `lr_mid` and `lr_high` side by side) keep apart curves in one MLflow run, e.g. `lr_high/val_loss`.

    `run_id` is the wrapped sink's (a multi-process run reopens that run by it); `sink_id` tells this series
    apart from the unprefixed one, so that samples logged here are logged again when the run goes on unprefixed."""

    def __init__(self, sink: MetricSink, prefix: str) -> None:
        self.sink, self.prefix = sink, prefix
        self.run_id = getattr(sink, "run_id", None)
        self.sink_id = f"{self.run_id}#{prefix}" if self.run_id is not None else None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.sink.log_metrics({f"{self.prefix}{k}": v for k, v in metrics.items()}, step)

    def log_image(self, image: Any, artifact_file: Optional[str] = None, *, key: Optional[str] = None,
                  step: Optional[int] = None) -> None:
        if not isinstance(self.sink, ImageSink):
            return
        if key is not None:
            key = f"{self.prefix}{key}"
        elif artifact_file is not None:
            artifact_file = f"{self.prefix}{artifact_file}"
        self.sink.log_image(image, artifact_file, key=key, step=step)
