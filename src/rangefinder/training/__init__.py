"""The training engine shared by the LR range test, the constant fine-tune and the full-data retrain.

`train(TrainSpec(...),
       out_dir=...)` (in loop.py) runs one training run; `MetricSink` (sinks.py) is what it reports metrics to, and a
sink that is also an `ImageSink` gets the samples rendered during training (the MLflow tracker implements both; the
engine never imports mlflow). `TrainSpec` and `TrainResult` (spec.py) are the run's request and answer. Importing
this package stays cheap: torch is loaded only when `train` is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rangefinder.training.sinks import MEASURED_PREFIXES, UPDATE_METRICS, ImageSink, MetricSink, PrefixedSink
from rangefinder.training.spec import TrainResult, TrainSpec

if TYPE_CHECKING:
    from rangefinder.training.loop import train

__all__ = ["MEASURED_PREFIXES", "UPDATE_METRICS", "ImageSink", "MetricSink", "PrefixedSink", "TrainResult",
           "TrainSpec", "train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from rangefinder.training.loop import train

        return train
    raise AttributeError(name)
