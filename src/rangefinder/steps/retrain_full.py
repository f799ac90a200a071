"""Step `retrain_full`: retrain from the base model on train + validation for the recommended epochs.

No validation (every image trains). The LR is the fine-tune's (constant at the midpoint, or triangular between the
bounds with `retrain.schedule: triangular`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rangefinder.config import RangefinderConfig, TrainingConfig, plan_for, resolve_mixed_precision
from rangefinder.steps.launch import run_training, step_world_size
from rangefinder.steps.workdir import publish, work_dir


@dataclass
class RetrainResult:
    epochs: int
    updates: int
    model_dir: Path

    def metrics(self) -> dict[str, float]:
        return {"epochs": float(self.epochs), "updates": float(self.updates)}


def retrain_training_config(cfg: RangefinderConfig, lr_low: float, lr_high: float, lr_mid: float,
                            epochs: int) -> TrainingConfig:
    update = {"epochs": epochs, "steps": None, "lr": lr_mid, "scale_lr": "none", "resume": True,
              "world_size": step_world_size(cfg)}
    if cfg.retrain.schedule == "triangular" and lr_high > lr_low:
        update.update(schedule="triangular", lr_min=lr_low, lr_max=lr_high)
    else:
        update.update(schedule="constant", lr_min=None, lr_max=None)
    return TrainingConfig.model_validate(cfg.training.model_copy(update=update).model_dump())


def run_retrain_full(cfg: RangefinderConfig, *, split_dir: Path, lr_low: float, lr_high: float, lr_mid: float,
                     recommended_epochs: int, model_dir: Path,
                     mlflow_parent_run_id: Optional[str] = None) -> RetrainResult:
    from rangefinder import tracking
    from rangefinder.data.split import read_split
    from rangefinder.training.loop import TrainSpec

    epochs = cfg.retrain.epochs or max(1, int(recommended_epochs))
    tc = retrain_training_config(cfg, lr_low, lr_high, lr_mid, epochs)
    split = read_split(split_dir)
    n = len(split.train) + len(split.val)
    no_val = cfg.validation.model_copy(update={"every_epochs": 0.0, "every_updates": None})
    with tracking.step_run(cfg, "retrain_full", parent_run_id=mlflow_parent_run_id) as run:
        run.log_config(cfg, plan=plan_for(tc, n),
                       extra={"retrain.epochs_used": epochs, "lr_mid": lr_mid,
                              "training.mixed_precision_used": resolve_mixed_precision(tc.mixed_precision)})
        work = work_dir(model_dir, f"{mlflow_parent_run_id}/retrain_full" if mlflow_parent_run_id else None)
        result = run_training(cfg, TrainSpec(tc, no_val, split_dir=split_dir, model=cfg.model, data=cfg.data,
                                             train_on="train+val"),
                              out_dir=work, metric_sink=run, step_name="retrain_full")
        publish(work, model_dir)
        run.log_decisions({"retrain_epochs": epochs, "retrain_updates": result.updates})
    return RetrainResult(epochs=epochs, updates=result.updates, model_dir=Path(model_dir))
