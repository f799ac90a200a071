"""Step `finetune`: train at the chosen LR for longer than needed, with validation; the step window is found in it.

The LR is constant at the midpoint of the range test's bounds, or cycles between the bounds (Smith 2017's
triangular schedules) when `finetune.schedule` says so. The step window is where smoothed validation loss is within
`finetune.tolerance` of its minimum; its centre gives the recommended epochs, since the window's edges are
better determined than the minimum itself (rangefinder.analysis.step_window).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rangefinder.config import RangefinderConfig, TrainingConfig, plan_for
from rangefinder.errors import RangefinderError
from rangefinder.formats.atomic import write_json, write_text
from rangefinder.steps.workdir import publish, work_dir


@dataclass
class FinetuneResult:
    recommended_epochs: int
    recommended_updates: int
    still_improving: bool
    best_val_loss: Optional[float]
    model_dir: Path
    curve_csv: Path
    checkpoints: list[Path]

    def metrics(self) -> dict[str, float]:
        out = {"recommended_epochs": float(self.recommended_epochs),
               "recommended_updates": float(self.recommended_updates)}
        if self.best_val_loss is not None:
            out["best_val_loss"] = float(self.best_val_loss)
        return out


def finetune_training_config(cfg: RangefinderConfig, lr_low: float, lr_high: float, lr_mid: float,
                             train_images: int, epochs: Optional[int] = None) -> TrainingConfig:
    ft = cfg.finetune
    # resume: the folder is this task's own, so a retry (a preempted node) goes on from its newest checkpoint.
    update: dict[str, Any] = {"epochs": epochs or ft.epochs, "steps": None, "lr": lr_mid, "scale_lr": "none",
                              "resume": True}
    if ft.schedule == "constant" or lr_high <= lr_low:
        update.update(schedule="constant", lr_min=None, lr_max=None)
    else:
        update.update(schedule=ft.schedule, lr_min=lr_low, lr_max=lr_high)
    tc = cfg.training.model_copy(update=update)
    if ft.checkpoint_every_epochs:
        per_epoch = plan_for(tc, train_images).updates_per_epoch
        every = max(1, math.ceil(ft.checkpoint_every_epochs * per_epoch))
        tc = tc.model_copy(update={"checkpoint_every_updates": every})
    return TrainingConfig.model_validate(tc.model_dump())


def run_finetune(
    cfg: RangefinderConfig,
    *,
    split_dir: Path,
    lr_low: float,
    lr_high: float,
    lr_mid: float,
    lr_source: str = "range-test",
    model_dir: Path,
    out_dir: Optional[Path] = None,
    report_html: Optional[Path] = None,
    report_md: Optional[Path] = None,
    mlflow_parent_run_id: Optional[str] = None,
) -> FinetuneResult:
    from rangefinder import tracking
    from rangefinder.analysis import copy_report, read_curve_csv, select_step_window, write_step_report
    from rangefinder.data.split import read_split
    from rangefinder.training.loop import TrainSpec, train

    split = read_split(split_dir)
    tc = finetune_training_config(cfg, lr_low, lr_high, lr_mid, len(split.train))
    validating = cfg.validation.enabled() and len(split.val) > 0
    model_dir = Path(model_dir)
    with tracking.step_run(cfg, "finetune", parent_run_id=mlflow_parent_run_id) as run:
        run.log_config(cfg, plan=plan_for(tc, len(split.train)),
                       extra={"lr_low": lr_low, "lr_high": lr_high, "lr_mid": lr_mid, "lr_source": lr_source})
        work = work_dir(model_dir, f"{mlflow_parent_run_id}/finetune" if mlflow_parent_run_id else None)
        result = train(TrainSpec(tc, cfg.validation, split_dir=split_dir, model=cfg.model, data=cfg.data),
                       out_dir=work, metric_sink=run)
        publish(work, model_dir)
        report_dir = Path(out_dir or model_dir / "report")
        report_dir.mkdir(parents=True, exist_ok=True)
        if validating:
            curve = read_curve_csv(result.metrics_csv)
            window = select_step_window(curve["update"], curve.get("epoch"), curve["val_loss"],
                                        stabilize_loss=curve.get("stabilize_loss"), tolerance=cfg.finetune.tolerance,
                                        seed=cfg.validation.seed,
                                        divergence_factor=cfg.validation.divergence_factor)
            report = write_step_report(window, curve, report_dir, source=str(result.metrics_csv))
            copy_report(report, report_html, report_md)
            # No window (no improvement at all): keep the configured budget and say so in the report.
            rec_epochs = int(window.recommended_epochs or tc.epochs or 1)
            rec_updates = int(window.recommended_updates or result.updates)
            improving = window.status == "still_improving"
            decision = window.to_dict()
        else:
            # No validation set (a fixed LR with val_split 0): nothing to read a window from; keep the budget.
            rec_epochs, rec_updates, improving = tc.epochs or 1, result.updates, False
            decision = {"recommended_epochs": rec_epochs, "note": "no validation: the configured epochs are kept"}
            for p in (report_html, report_md):
                if p is not None:
                    write_text(p, f"No validation set: trained {rec_epochs} epochs at lr {lr_mid:.3g}.\n")
        decision.update(lr_low=lr_low, lr_high=lr_high, lr_mid=lr_mid, lr_source=lr_source)
        write_json(report_dir / "decision.json", decision)
        shutil.copyfile(result.metrics_csv, report_dir / "metrics.csv")
        run.log_artifact(report_dir, "report")
        run.log_artifact(result.metrics_csv, "curves")
        run.log_decisions({"recommended_epochs": rec_epochs, "recommended_updates": rec_updates,
                           "still_improving": improving, "lr_mid": lr_mid, "lr_source": lr_source})
    if result.final_dir is None:
        raise RangefinderError(f"the fine-tune wrote no final weights under {model_dir}")
    return FinetuneResult(recommended_epochs=max(1, rec_epochs), recommended_updates=rec_updates,
                          still_improving=improving, best_val_loss=result.best_val_loss, model_dir=model_dir,
                          curve_csv=result.metrics_csv, checkpoints=list(result.checkpoints))

