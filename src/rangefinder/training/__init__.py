"""The training engine shared by the LR range test, the constant fine-tune and the full-data retrain.

`train(TrainSpec(...),
       out_dir=...)` (in loop.py) runs one training run; `MetricSink` is what it reports metrics to, and a sink that is
also an `ImageSink` gets the samples rendered during training (the MLflow tracker implements both; the engine never
imports mlflow). Importing this package stays cheap: torch is loaded only when `train` is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    from rangefinder.training.loop import TrainResult, TrainSpec, train

__all__ = ["ImageSink", "MetricSink", "TrainResult", "TrainSpec", "train"]


@runtime_checkable
class MetricSink(Protocol):
    """Receives the metrics of each update and each validation measurement, keyed by update number."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


@runtime_checkable
class ImageSink(Protocol):
    """Receives images: `image` is a PNG file's path; with `key` and `step` (the update number) it is one step of an
    image series (MLflow's step-keyed images, which its UI shows with a step slider)."""

    def log_image(self, image: Any, artifact_file: Optional[str] = None, *, key: Optional[str] = None,
                  step: Optional[int] = None) -> None: ...


def __getattr__(name: str) -> Any:
    if name in ("train", "TrainResult", "TrainSpec"):
        from rangefinder.training import loop

        return getattr(loop, name)
    raise AttributeError(name)
