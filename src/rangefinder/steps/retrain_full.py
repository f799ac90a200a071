"""Step `retrain_full`: retrain from the base model on train + validation for the recommended epochs.

No validation (every image trains). The LR, `lr`, is the one the fine-tune kept (the midpoint, or the upper bound when
successive halving kept it); constant, or triangular between the bounds with `retrain.schedule: triangular`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rangefinder.config import ConfigLike, RangefinderConfig, as_config
from rangefinder.errors import RangefinderError
from rangefinder.launch.processes import run_training, step_world_size
from rangefinder.steps.kept_settings import keeps_mlflow_settings
from rangefinder.steps.workdir import publish, work_dir
from rangefinder.training.spec import TrainSpec

if TYPE_CHECKING:
    from rangefinder.data.split import Split


@dataclass
class RetrainResult:
    epochs: int
    updates: int
    model_dir: Path

    def metrics(self) -> dict[str, float]:
        """The step's KFP metrics, named as its MLflow run (and the parent) has them."""
        return {"retrain_epochs": float(self.epochs), "retrain_updates": float(self.updates)}


def retrain_epochs(cfg: RangefinderConfig, recommended_epochs: int) -> int:
    """The epochs the retrain trains: retrain.epochs where the config sets it, else the fine-tune's recommendation."""
    return cfg.retrain.epochs or max(1, int(recommended_epochs))


def _why_this_length(cfg: RangefinderConfig) -> str:
    return "retrain.epochs, set in the config" if cfg.retrain.epochs else "the fine-tune's recommended length"


def retrain_preview(cfg: RangefinderConfig, split: Split, *, recommended_epochs: int, lr: float,
                    bounds: tuple[float, float]) -> Optional[str]:
    """What the retrain after the fine-tune will train, in a sentence for the fine-tune's report: its epochs, and the
    updates they take on train + validation (more per epoch than the fine-tune's); None with the retrain off."""
    if not cfg.retrain.enabled:
        return None
    epochs = retrain_epochs(cfg, recommended_epochs)
    plan = TrainSpec.retrain(cfg, split, bounds=bounds, lr=lr, epochs=epochs, world_size=step_world_size(cfg)).plan
    assert plan is not None
    return (f"A retrain on train + validation follows: {epochs} epochs, {plan.total_updates} updates on its "
            f"{plan.train_images} images ({_why_this_length(cfg)}).")


@keeps_mlflow_settings
def run_retrain_full(cfg: ConfigLike, *, split_dir: Path, lr_low: float, lr_high: float, lr: float,
                     recommended_epochs: int, model_dir: Path, report_html: Optional[Path] = None,
                     report_md: Optional[Path] = None,
                     mlflow_parent_run_id: Optional[str] = None) -> RetrainResult:
    """`lr`: the fine-tune's kept LR (its `lr_used`); `lr_low`, `lr_high`: the bounds, for a triangular schedule.
    The report (training loss and LR against updates; the run's `report/` in MLflow) is also written to
    `report_html` and `report_md` where given (the KFP outputs' files).
    `cfg`: a RangefinderConfig, or a dict of its sections (a notebook's, a YAML file's) validated as a config file
    is (rangefinder.config.as_config: ConfigError naming a bad setting); anything else is a TypeError."""
    cfg = as_config(cfg)  # a dict from a notebook is validated as a config file is
    import tempfile

    from rangefinder import tracking
    from rangefinder.analysis import copy_report, read_curve_csv
    from rangefinder.analysis.reports import write_retrain_report
    from rangefinder.data.split import read_split
    from rangefinder.training.family_detection import family_of

    epochs = retrain_epochs(cfg, recommended_epochs)
    split = read_split(split_dir)
    spec = TrainSpec.retrain(cfg, split, bounds=(lr_low, lr_high), lr=lr, epochs=epochs,
                             world_size=step_world_size(cfg))
    with tracking.step_run(cfg, "retrain_full", parent_run_id=mlflow_parent_run_id) as run:
        run.log_config(cfg, plan=spec.plan,
                       extra={"retrain.epochs_used": epochs, "lr": lr,
                              **spec.training.used_params(family_of(cfg.model))})
        run.log_dataset_manifest(split_dir, train_on=spec.train_on)  # its Datasets: train and val, both trained on
        work = work_dir(model_dir, f"{mlflow_parent_run_id}/retrain_full" if mlflow_parent_run_id else None)
        result = run_training(cfg, spec, out_dir=work, metric_sink=run, step_name="retrain_full", split=split)
        if result.status == "diverged":
            # No final weights (training never writes NaN ones): published, the folder went on to register-model,
            # which took it whole for a model and failed on what was not in it, far from the cause.
            cycling = (f", its schedule cycling {lr_low:.3g}-{lr_high:.3g}" if spec.training.schedule != "constant"
                       else "")
            raise RangefinderError(f"the retrain diverged at lr {lr:.3g}{cycling} (its loss stopped being finite by "
                                   f"update {result.updates}), so it delivered no weights; lower the LR, or leave the "
                                   "retrain off (retrain.enabled: false) to deliver the fine-tune's chosen model. Its "
                                   f"curve: {result.updates_csv}")
        publish(work, model_dir)
        retrained = RetrainResult(epochs=epochs, updates=result.updates, model_dir=Path(model_dir))
        run.log_decisions(retrained.metrics())
        lead = (f"Retrained on train + validation for {epochs} epochs ({result.updates} updates) at lr {lr:.3g}: "
                f"{_why_this_length(cfg)}, and the fine-tune's kept LR; nothing is validated.")
        # The step's one curve, its training loss, in the report the KFP UI shows as the other training steps' (the
        # plot embedded), and in the run's report/ as theirs are; kept out of the model artifact it would be part of.
        with tempfile.TemporaryDirectory(prefix="retrain-report-") as report_dir:
            report = write_retrain_report(
                read_curve_csv(result.updates_csv, required=("update", "train_loss")), report_dir,
                status=result.status, lead=lead, epochs=epochs, why_epochs=_why_this_length(cfg), lr=lr,
                schedule=spec.training.schedule, bounds=(lr_low, lr_high),
                train_images=spec.plan.train_images if spec.plan is not None else None,
                source=tracking.logged_curve(result.updates_csv),
                plan_warnings=spec.plan.warnings if spec.plan is not None else ())
            copy_report(report, report_html, report_md)
            run.log_report(report_dir, held_elsewhere=[])
        run.log_artifact(result.updates_csv, tracking.CURVES_ARTIFACT)  # the curve the report names
        run.describe(lead)
    return retrained
