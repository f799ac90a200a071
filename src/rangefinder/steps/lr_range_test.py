"""Step `lr_range_test`: one run whose LR climbs from too low to too high, then the bounds read off its curve.

The LR climbs exponentially or linearly (Smith 2017, "Cyclical Learning Rates for Training Neural Networks",
section 3.3) over `lr_range_test.epochs`, with validation loss measured at update 0 and then every epoch (or every
N updates). `rangefinder.analysis` reads the lower bound, the upper bound and the midpoint off the curve.

When the curve is censored or too few measurements lie between the bounds, the step says so (`needs_zoom`) and
proposes the range of a second test ("zoom") by `rangefinder.analysis.zoom`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rangefinder.analysis.zoom import ended_above_start, points_between, zoom_range
from rangefinder.config import LR_FREE_OPTIMIZERS, ConfigLike, as_config
from rangefinder.errors import ConfigError, RangefinderError
from rangefinder.formats.atomic import write_json
from rangefinder.launch.processes import batch_note, run_training, step_world_size
from rangefinder.steps.kept_settings import keeps_mlflow_settings
from rangefinder.steps.workdir import publish, work_dir


@dataclass
class RangeTestResult:
    stage: str
    lr_min: float
    lr_max: float
    status: str
    lr_low: float
    lr_high: float
    lr_mid: float
    quality: float
    flags: list[str]
    points_between: int
    needs_zoom: bool
    zoom_lr_min: float  # 0.0 when no zoom is needed (KFP outputs cannot be None)
    zoom_lr_max: float
    curve_csv: Path
    bounds_json: Path

    def metrics(self) -> dict[str, float]:
        """The step's KFP metrics. The bounds only where the curve gave them: a test that read none (a diverged or
        flat curve, whose zoom comes next) returns 0.0 for them (a KFP output cannot be None), which the metrics
        table would show as bounds at LR 0; its MLflow run leaves them out too."""
        bounds = {"lr_low": self.lr_low, "lr_high": self.lr_high, "lr_mid": self.lr_mid} if self.status == "ok" else {}
        return {**bounds, "quality": self.quality, "points_between": float(self.points_between)}


@keeps_mlflow_settings
def run_lr_range_test(
    cfg: ConfigLike,
    *,
    split_dir: Path,
    out_dir: Path,
    stage: str = "first",
    lr_min: Optional[float] = None,
    lr_max: Optional[float] = None,
    report_html: Optional[Path] = None,
    report_md: Optional[Path] = None,
    mlflow_parent_run_id: Optional[str] = None,
) -> RangeTestResult:
    """Sweep, analyse, report; `lr_min`/`lr_max` None: the configured range (a zoom passes its own).
    `cfg`: a RangefinderConfig, or a dict of its sections (a notebook's, a YAML file's) validated as a config file
    is (rangefinder.config.as_config: ConfigError naming a bad setting); anything else is a TypeError."""
    cfg = as_config(cfg)  # a dict from a notebook is validated as a config file is
    from rangefinder import tracking
    from rangefinder.analysis import analyze_lr_curve, copy_report, write_lr_report
    from rangefinder.analysis.reports import lr_headline
    from rangefinder.data.split import read_split
    from rangefinder.planning import check_finetune_validations, plan_like
    from rangefinder.training.family_detection import family_of
    from rangefinder.training.spec import TrainSpec

    if stage not in ("first", "zoom"):
        raise RangefinderError(f"lr_range_test stage must be 'first' or 'zoom' (got {stage!r})")
    if cfg.training.optimizer in LR_FREE_OPTIMIZERS:
        raise ConfigError(f"training.optimizer {cfg.training.optimizer} is LR-free (it estimates its own step size): "
                          "a range test has no LR to measure; run the fine-tune at its lr (the pipeline skips the "
                          "range test), or choose training.optimizer: adamw to measure one")
    rt = cfg.lr_range_test
    default_lo, default_hi = rt.range_for(cfg.training.method)
    lo = lr_min if lr_min is not None else default_lo
    hi = lr_max if lr_max is not None else default_hi
    if not 0 < lo < hi:
        raise RangefinderError(f"LR range {lo:g}..{hi:g} is empty; lr_min must be above 0 and below lr_max")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    split = read_split(split_dir)
    spec = TrainSpec.ramp(cfg, split, lr_min=lo, lr_max=hi, world_size=step_world_size(cfg))
    assert spec.plan is not None
    if cfg.validation.every_updates is not None:
        # Whether the fine-tune validates often enough for its step window, only the data's size tells
        # (every_epochs was checked before the pipeline started): the fine-tune trains this split with these
        # batches, so its updates are counted here, and a fine-tune it would refuse is refused before this trains.
        check_finetune_validations(cfg, plan_like(spec.plan, epochs=cfg.finetune.epochs))
    train_cfg = spec.training
    if not spec.validation.enabled():
        raise RangefinderError("the LR range test measures validation loss: set validation.every_epochs > 0")

    step_name = "lr_range_test" if stage == "first" else "lr_range_test_zoom"
    # The zoom's run is this module's too (step_source would name a module lr_range_test_zoom).
    with tracking.step_run(cfg, step_name, parent_run_id=mlflow_parent_run_id, source=__name__) as run:
        # The range this run swept beside the setting it came from (a zoom's is its own; unset: the method's), named
        # as the other resolved settings are (training.mixed_precision_used), so MLflow's compare view sorts them
        # together and no second `lr_min` reads as the config's.
        run.log_config(cfg, extra={"lr_range_test.lr_min_used": lo, "lr_range_test.lr_max_used": hi,
                                   "range_test.stage": stage, **train_cfg.used_params(family_of(cfg.model))})
        run.log_dataset_manifest(split_dir)
        work = work_dir(out_dir / "run", f"{mlflow_parent_run_id}/{step_name}" if mlflow_parent_run_id else None)
        result = run_training(cfg, spec, out_dir=work, metric_sink=run, save_final=False, step_name=step_name,
                              split=split)
        publish(work, out_dir / "run")
        curve = result.curve_arrays()
        stabilize = curve.get("stabilize_loss")
        bounds = analyze_lr_curve(curve["lr"], curve["val_loss"], ramp=rt.ramp, stabilize_loss=stabilize,
                                  seed=cfg.validation.seed, divergence_factor=cfg.validation.divergence_factor,
                                  mid_position=rt.mid_position, midpoint=rt.midpoint)
        n_between = points_between(curve["lr"], curve["val_loss"], bounds.lr_low, bounds.lr_high)
        zoom = None
        if stage == "first" and rt.zoom:
            zoom = zoom_range(bounds.status, bounds.flags, bounds.lr_low, bounds.lr_high, lo, hi, n_between,
                              rt.zoom_min_points, lr_at_min=bounds.lr_at_min,
                              rose_at_top=ended_above_start(curve["val_loss"]))
        decision = {**bounds.to_dict(), "stage": stage, "lr_min": lo, "lr_max": hi, "points_between": n_between,
                    "needs_zoom": zoom is not None, "zoom_range": list(zoom) if zoom else None,
                    "updates": result.updates, "curve_csv": tracking.logged_curve_path(result.metrics_csv),
                    "world_size": train_cfg.world_size,
                    "global_batch": train_cfg.batch_size * train_cfg.grad_accum * train_cfg.world_size,
                    "model_family": result.family}
        report = write_lr_report(bounds, curve, out_dir / "report",
                                 source=f"{tracking.logged_curve(result.metrics_csv)}; {batch_note(train_cfg)}",
                                 plan_warnings=spec.plan.warnings if spec.plan is not None else (), zoom=zoom,
                                 validation_weighting=result.validation_weighting())
        copy_report(report, report_html, report_md)
        bounds_json = out_dir / "bounds.json"
        write_json(bounds_json, decision)
        run.log_artifact(result.metrics_csv, tracking.CURVES_ARTIFACT)
        run.log_artifact(bounds_json, "analysis")
        run.log_report(out_dir / "report", held_elsewhere=[report["json"]])  # analysis/bounds.json holds it all
        # The same keys on the first test's run and the zoom's (the run's stage tag tells them apart); nothing goes
        # to the parent run, which shows the one decision the fine-tune used (choose_lr's bounds), not one per test.
        run.log_decisions({k: decision[k] for k in ("status", "lr_low", "lr_high", "lr_mid", "quality", "flags",
                                                     "points_between", "needs_zoom", "stage")}, to_parent=False)
        what = "LR range test" if stage == "first" else "Zoomed LR range test"
        note = f"{what} over {lo:.3g}..{hi:.3g}: {lr_headline(bounds, zoom)}"
        run.describe(note)

    if bounds.status != "ok" and zoom is None:
        advice = " ".join(bounds.advice) or "widen the range or set a fixed lr"
        raise RangefinderError(f"the {stage} LR range test ({lo:g}..{hi:g}) found no usable bounds "
                               f"({bounds.status}): {advice}")
    return RangeTestResult(
        stage=stage, lr_min=lo, lr_max=hi, status=bounds.status,
        lr_low=float(bounds.lr_low or 0.0), lr_high=float(bounds.lr_high or 0.0), lr_mid=float(bounds.lr_mid or 0.0),
        quality=float(bounds.quality), flags=list(bounds.flags), points_between=n_between,
        needs_zoom=zoom is not None, zoom_lr_min=float(zoom[0]) if zoom else 0.0,
        zoom_lr_max=float(zoom[1]) if zoom else 0.0, curve_csv=result.metrics_csv, bounds_json=bounds_json,
    )


def fmt_lr(x: float) -> str:
    return f"{x:.3g}" if x and math.isfinite(x) else "-"
