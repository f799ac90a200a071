"""A one-step KFP pipeline whose training step is evicted (SIGTERM) on its first attempt, for the kfp.local retry
test in test_resume.py. Its own module: KFP reads a component's annotations as types, which the tests' `from
__future__ import annotations` would turn into strings."""

from kfp import dsl


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def preemptible_train(settings: str) -> int:
    """The engine on the settings (child_settings in test_resume.py) with training.resume, as the pipeline's
    training steps set it; the first attempt sends itself SIGTERM while update 5 is in flight, and writes its error
    and the checkpoints it left to `first_try_report`. Returns the update the run resumed at (-1: none)."""
    import json
    import os
    import signal
    from pathlib import Path

    import torch

    from rangefinder.config import TrainingConfig, ValidationConfig
    from rangefinder.training.loop import TrainSpec, train

    torch.set_num_threads(1)
    s = json.loads(settings)
    first_try = Path(s["first_try_marker"])

    class Evicted:
        def log_metrics(self, metrics, step):
            if step == 5 and "train_loss" in metrics and not first_try.exists():
                first_try.touch()
                os.kill(os.getpid(), signal.SIGTERM)

    spec = TrainSpec(TrainingConfig(**s["training"], resume=True), ValidationConfig(**s["validation"]),
                     split_dir=s["split_dir"], model=s["model"])
    try:
        result = train(spec, out_dir=s["out_dir"], metric_sink=Evicted())
    except Exception as e:  # what the failed attempt said and left, for the test; the step still fails
        folder = Path(s["out_dir"]) / "checkpoints"
        Path(s["first_try_report"]).write_text(json.dumps(
            {"type": type(e).__name__, "message": str(e), "checkpoints": sorted(p.name for p in folder.iterdir())}))
        raise
    return result.resumed_from if result.resumed_from is not None else -1


@dsl.pipeline(name="preemptible")
def preemptible(settings: str) -> int:
    task = preemptible_train(settings=settings)
    task.set_retry(num_retries=1, backoff_duration="0s", backoff_factor=1.0)
    return task.output
