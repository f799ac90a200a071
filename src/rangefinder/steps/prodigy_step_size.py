"""Step `prodigy_step_size`: the prodigy_step LR finder, the LR read off the step size a Prodigy run ends on.

Prodigy is LR-free: it estimates its own step size, d x lr, as it trains. This step trains the fine-tune's run with
Prodigy at lr 1.0 and the arguments diffusers' advanced_diffusion_training README recommends
(training.optimizers.PRODIGY_SETTINGS): the fine-tune's length (finetune.epochs), seed, data order and validation, a
constant schedule, and none of what the fine-tune step adds after its run (successive halving, cooldown, window
average, samples): a plain run, a probe. Its training is exactly that of a fine-tune with `training.optimizer:
prodigy` and `training.prodigy` set to those arguments. The step size d x lr after its last update (the last
`prodigy_d_lr` of its updates.csv), times a factor, is the LR: the config's prodigy_step_factor where set, else the
one for the model's family and the method (config.PRODIGY_STEP_FACTOR: 4 on SDXL's and SD3's full fine-tune, 1
elsewhere).
choose_lr takes it as lr_low = lr_mid = lr_high (source "prodigy-step"), and the fine-tune trains that one constant
LR with the run's own optimizer (AdamW by default).

The probe's weights are not kept: its output is a number, the report and the curves. It checkpoints as the fine-tune
does, one checkpoint at a time, so a retried pod goes on from where the preempted one stopped.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from rangefinder.analysis.prodigy_step import ProdigyStep
from rangefinder.config import LR_FREE_LR, ConfigLike, RangefinderConfig, TrainingConfig, as_config
from rangefinder.errors import RangefinderError
from rangefinder.formats import checkpoints
from rangefinder.formats.atomic import write_json
from rangefinder.launch.processes import batch_note, run_training, step_world_size
from rangefinder.steps.kept_settings import keeps_mlflow_settings
from rangefinder.steps.workdir import publish, work_dir

STEP = "prodigy_step_size"
SOURCE = "prodigy-step"  # choose_lr's source for this finder


@dataclass
class ProdigyStepResult:
    reading: ProdigyStep  # the step size read, and what the report shows of the run
    curve_csv: Path  # metrics.csv: the validation curve
    updates_csv: Path  # updates.csv: prodigy_d_lr (d x lr after the update) per update
    reading_json: Path

    @property
    def lr(self) -> float:
        """The LR the fine-tune trains at: the step size times its family's and method's factor."""
        return self.reading.lr_trained

    def metrics(self) -> dict[str, float]:
        out = {"lr_prodigy_step": self.reading.step_size, "prodigy_d": self.reading.d,
               "prodigy_step_factor": self.reading.factor, "lr_trained": self.reading.lr_trained,
               "updates": float(self.reading.updates)}
        if self.reading.best_val_loss is not None:
            out["best_val_loss"] = self.reading.best_val_loss
        return out


def probe_config(cfg: RangefinderConfig) -> RangefinderConfig:
    """`cfg` as the probe trains it: training.optimizer prodigy with PRODIGY_SETTINGS (training.prodigy) at lr 1.0,
    no LR scaling; the fine-tune's constant schedule without successive halving, cooldown or window average; no samples
    during training. Everything else (seed, batch, length, validation, precision) is the fine-tune's."""
    from rangefinder.training.optimizers import PRODIGY_SETTINGS

    raw = cfg.model_dump()
    raw["training"].update(optimizer="prodigy", prodigy=dict(PRODIGY_SETTINGS), lr=LR_FREE_LR, scale_lr="none")
    raw["finetune"].update(schedule="constant", successive_halving=False, halving_below_margin=None, cooldown="off",
                           average="off", soup_tries=0)
    raw["sampling"]["every_validations"] = None
    # An LR-free optimizer discovers nothing: the range test's bounds (refused beside prodigy_step) and a fixed LR go.
    raw["lr_range_test"].update(lr_min=None, lr_max=None)
    raw["lr"] = None
    return RangefinderConfig.model_validate(raw)


@keeps_mlflow_settings
def run_prodigy_step_size(
    cfg: ConfigLike,
    *,
    split_dir: Path,
    out_dir: Path,
    report_html: Optional[Path] = None,
    report_md: Optional[Path] = None,
    mlflow_parent_run_id: Optional[str] = None,
) -> ProdigyStepResult:
    """Train the probe, read its last step size (and the LR trained, config.prodigy_step_factor times it), report;
    RangefinderError when it diverged or read no step size.
    `cfg`: a RangefinderConfig, or a dict of its sections (a notebook's, a YAML file's) validated as a config file
    is (rangefinder.config.as_config: ConfigError naming a bad setting); anything else is a TypeError."""
    cfg = as_config(cfg)  # a dict from a notebook is validated as a config file is
    from rangefinder import tracking
    from rangefinder.analysis import copy_report, read_curve_csv, read_prodigy_step, write_prodigy_report
    from rangefinder.data.split import read_split
    from rangefinder.planning import check_finetune_validations
    from rangefinder.training.family_detection import family_of
    from rangefinder.training.optimizers import require_prodigy
    from rangefinder.training.spec import TrainSpec

    require_prodigy("lr_finder prodigy_step", instead="set lr_finder: range_test")
    probe = probe_config(cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    split = read_split(split_dir)
    spec = TrainSpec.finetune(probe, split, bounds=(LR_FREE_LR, LR_FREE_LR), lr=LR_FREE_LR,
                              world_size=step_world_size(probe))
    # The probe trains the fine-tune's plan: a fine-tune its step window cannot read is refused before either trains.
    check_finetune_validations(cfg, spec.plan)
    # One checkpoint at a time (for a retried pod): the probe's weights are never read, so none is kept for a window.
    spec = replace(spec, training=TrainingConfig.model_validate({**spec.training.model_dump(), "keep_checkpoints": 1}))
    tc = spec.training
    family = family_of(cfg.model)
    factor = cfg.prodigy_step_factor_for(family)
    with tracking.step_run(cfg, STEP, parent_run_id=mlflow_parent_run_id) as run:
        run.log_config(cfg, trained=probe, plan=spec.plan,
                       extra={"lr_finder_used": "prodigy_step", "lr_source": SOURCE, "prodigy_step_factor": factor,
                              **tc.used_params(family)})
        run.log_dataset_manifest(split_dir)
        work = work_dir(out_dir / "run", f"{mlflow_parent_run_id}/{STEP}" if mlflow_parent_run_id else None)
        result = run_training(probe, spec, out_dir=work, metric_sink=run, save_final=False, step_name=STEP,
                              split=split)
        if result.status == "diverged":
            raise RangefinderError(f"the Prodigy run of the prodigy_step LR finder diverged (its loss stopped being "
                                   f"finite by update {result.updates}), so it has no step size to read; set "
                                   f"lr_finder: range_test, or a fixed lr. Its curve: {result.metrics_csv}")
        shutil.rmtree(work / checkpoints.RUN_DIR, ignore_errors=True)  # a finished probe is not resumed
        publish(work, out_dir / "run")
        updates = read_curve_csv(result.updates_csv, required=("update", "lr_effective"))
        curve = result.curve_arrays()
        reading = read_prodigy_step(updates, curve, LR_FREE_LR, factor=factor,
                                    factor_source=cfg.prodigy_step_factor_source())
        report = write_prodigy_report(reading, updates, curve, out_dir / "report",
                                      source=f"{tracking.logged_curve(result.updates_csv)}; {batch_note(tc)}",
                                      plan_warnings=spec.plan.warnings if spec.plan is not None else (),
                                      validation_weighting=result.validation_weighting())
        copy_report(report, report_html, report_md)
        decision: dict[str, Any] = {**reading.to_dict(), "lr_source": SOURCE, "prodigy_settings": tc.prodigy.kwargs(),
                                    "curve_csv": tracking.logged_curve_path(result.metrics_csv),
                                    "updates_csv": tracking.logged_curve_path(result.updates_csv),
                                    "world_size": tc.world_size, "model_family": result.family}
        reading_json = out_dir / "prodigy_step.json"
        write_json(reading_json, decision)
        run.log_artifact(result.metrics_csv, tracking.CURVES_ARTIFACT)
        run.log_artifact(result.updates_csv, tracking.CURVES_ARTIFACT)
        run.log_artifact(reading_json, "analysis")
        run.log_report(out_dir / "report", held_elsewhere=[report["json"]])  # analysis/ holds it, with settings
        out = ProdigyStepResult(reading=reading, curve_csv=result.metrics_csv, updates_csv=result.updates_csv,
                                reading_json=reading_json)
        # On this run only, as the range tests keep their readings: the parent shows choose_lr's decision. The same
        # numbers as the component's KFP metrics. lr_source is a param above (its one home, as on the fine-tune's run).
        run.log_decisions(out.metrics(), to_parent=False)
        run.describe(reading.headline())
    return out
