"""The KFP components: one lightweight Python component per step.

Each body only turns KFP artifacts and parameters into the typed config and paths, then calls `run_<step>()` from
`rangefinder.steps.<step>`, a plain function that also runs without KFP (the tests and bench/discovery_quality call
it; the CLI's one-step commands call the library functions beneath it). docs/design.md, section 4.3, maps each
component to its step function and library call. The image already holds the `rangefinder` package, so
`install_kfp_package=False` and nothing is pip-installed at run time. `base_image` is the default image of this
package version (`rangefinder.container_images`); `rangefinder.pipelines.pipeline` sets each task's image
(`set_container_image`) from `kubernetes.image` / `kubernetes.cpu_image` or the environment overrides when it
compiles.

Imports live inside the bodies: KFP ships each body to the pod as source, so module-level names do not exist there.
"""

# No `from __future__ import annotations`: KFP reads the components' annotations as real types. Their outputs are
# declared the way KFP documents, `-> NamedTuple("Name", field=type)`, a call mypy does not accept as a type; hence
# the `type: ignore[valid-type]` on each. A class-based NamedTuple would not exist in the pod: KFP ships only the body.
from typing import NamedTuple, Optional

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Markdown, Metrics, Model, Output

from rangefinder.container_images import default_images

# The release's default names; `rangefinder.pipelines.pipeline` sets the image each task really runs in when it
# compiles.
TRAINER_IMAGE = default_images()["trainer"]
CPU_IMAGE = default_images()["cpu"]


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def resolve_config(
    base_config: str,
    dataset_dir: str,
    base_model: str,
    base_model_revision: str,
    method: str,
    resolution: int,
    batch_size: int,
    grad_accum: int,
    ramp: str,
    lr_min: float,
    lr_max: float,
    range_test_epochs: int,
    finetune_epochs: int,
    val_split: float,
    split_seed: int,
    seed: int,
    fixed_lr: float,
    retrain: bool,
    retrain_epochs: int,
    prompts: list,
    mlflow_experiment: str,
    pipeline_job_id: str,
    pipeline_job_name: str = "",
) -> NamedTuple("ResolvedConfig", config_json=str, fixed_lr=float, retrain=bool, mlflow_parent_run_id=str):  # type: ignore[valid-type]
    """Validate the parameters into one config and resolve the base model to a local folder (downloaded or
    converted once; fails fast, before any GPU is requested); open the MLflow parent run of this pipeline run."""
    from collections import namedtuple

    from rangefinder.errors import one_line_errors
    from rangefinder.steps.resolve_config import run_resolve_config

    with one_line_errors("resolve-config"):
        r = run_resolve_config(
            base_config, dataset_dir=dataset_dir, base_model=base_model, base_model_revision=base_model_revision,
            method=method, resolution=resolution, batch_size=batch_size, grad_accum=grad_accum, ramp=ramp,
            lr_min=lr_min, lr_max=lr_max, range_test_epochs=range_test_epochs, finetune_epochs=finetune_epochs,
            val_split=val_split, split_seed=split_seed, seed=seed, fixed_lr=fixed_lr, retrain=retrain,
            retrain_epochs=retrain_epochs, prompts=prompts, mlflow_experiment=mlflow_experiment,
            pipeline_job_id=pipeline_job_id, pipeline_job_name=pipeline_job_name,
        )
    ResolvedConfig = namedtuple("ResolvedConfig", "config_json fixed_lr retrain mlflow_parent_run_id")
    return ResolvedConfig(r.config_json, r.fixed_lr, r.retrain, r.mlflow_parent_run_id)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def prepare_dataset(
    config_json: str,
    split: Output[Dataset],
    report: Output[Markdown],
    dataset: Optional[Input[Dataset]] = None,
) -> NamedTuple("Prepared", train_images=int, val_images=int, skipped_files=int):  # type: ignore[valid-type]
    """Validate the images and captions and split them (train / validation / stabilize) into one Dataset folder."""
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.errors import one_line_errors
    from rangefinder.steps.prepare_dataset import run_prepare_dataset
    from rangefinder.steps.resolve_config import load_step_config

    with one_line_errors("prepare-dataset"):
        r = run_prepare_dataset(
            load_step_config(config_json),
            out_dir=Path(split.path),
            dataset_dir=Path(dataset.path) if dataset is not None else None,
            report_path=Path(report.path),
        )
    Prepared = namedtuple("Prepared", "train_images val_images skipped_files")
    return Prepared(r.train_images, r.val_images, r.skipped)


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def lr_range_test(
    config_json: str,
    split: Input[Dataset],
    stage: str,
    mlflow_parent_run_id: str,
    curve: Output[Dataset],
    metrics: Output[Metrics],
    report_html: Output[HTML],
    report_md: Output[Markdown],
    lr_min: float = 0.0,
    lr_max: float = 0.0,
) -> NamedTuple(  # type: ignore[valid-type]
    "LRBounds", lr_low=float, lr_high=float, lr_mid=float, needs_zoom=bool, zoom_lr_min=float, zoom_lr_max=float
):
    """One training run whose LR climbs from lr_min to lr_max (0: the configured range), then the bounds."""
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.errors import one_line_errors
    from rangefinder.steps.lr_range_test import run_lr_range_test
    from rangefinder.steps.resolve_config import load_step_config

    with one_line_errors("lr-range-test"):
        r = run_lr_range_test(
            load_step_config(config_json),
            split_dir=Path(split.path),
            out_dir=Path(curve.path),
            stage=stage,
            lr_min=lr_min or None,
            lr_max=lr_max or None,
            report_html=Path(report_html.path),
            report_md=Path(report_md.path),
            mlflow_parent_run_id=mlflow_parent_run_id or None,
        )
    for name, value in r.metrics().items():
        metrics.log_metric(name, value)
    LRBounds = namedtuple("LRBounds", "lr_low lr_high lr_mid needs_zoom zoom_lr_min zoom_lr_max")
    return LRBounds(r.lr_low, r.lr_high, r.lr_mid, r.needs_zoom, r.zoom_lr_min, r.zoom_lr_max)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def choose_lr(
    config_json: str,
    source: str,
    lr_low: float,
    lr_high: float,
    lr_mid: float,
    decision: Output[Markdown],
) -> NamedTuple("ChosenLR", lr_low=float, lr_high=float, lr_mid=float, source=str):  # type: ignore[valid-type]
    """The LR bounds the fine-tune uses, and where they came from (first test, zoom re-test or fixed by hand)."""
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.errors import one_line_errors
    from rangefinder.steps.choose_lr import run_choose_lr
    from rangefinder.steps.resolve_config import load_step_config

    with one_line_errors("choose-lr"):
        r = run_choose_lr(load_step_config(config_json), source=source, lr_low=lr_low, lr_high=lr_high, lr_mid=lr_mid,
                          decision_path=Path(decision.path))
    ChosenLR = namedtuple("ChosenLR", "lr_low lr_high lr_mid source")
    return ChosenLR(r.lr_low, r.lr_high, r.lr_mid, r.source)


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def finetune(
    config_json: str,
    split: Input[Dataset],
    lr_low: float,
    lr_high: float,
    lr_mid: float,
    lr_source: str,
    mlflow_parent_run_id: str,
    model: Output[Model],
    curve: Output[Dataset],
    metrics: Output[Metrics],
    report_html: Output[HTML],
    report_md: Output[Markdown],
) -> NamedTuple(  # type: ignore[valid-type]
    "Finetuned", recommended_epochs=int, recommended_updates=int, still_improving=bool, chosen_update=int,
    chosen_epoch=float, mixed_precision=str, lr_used=float, halving_kept=str,
):
    """Train at the midpoint LR (or cycle between the bounds) for longer than needed; find the step window. With
    successive halving, lr_mid and lr_high train half-way and the better one goes on: `lr_used` is the LR kept."""
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.errors import one_line_errors
    from rangefinder.steps.finetune import run_finetune
    from rangefinder.steps.resolve_config import load_step_config

    with one_line_errors("finetune"):
        r = run_finetune(
            load_step_config(config_json),
            split_dir=Path(split.path),
            lr_low=lr_low, lr_high=lr_high, lr_mid=lr_mid, lr_source=lr_source,
            model_dir=Path(model.path),
            out_dir=Path(curve.path),
            report_html=Path(report_html.path),
            report_md=Path(report_md.path),
            mlflow_parent_run_id=mlflow_parent_run_id or None,
        )
    for name, value in r.metrics().items():
        metrics.log_metric(name, value)
    chosen = r.chosen or {}
    Finetuned = namedtuple("Finetuned", "recommended_epochs recommended_updates still_improving chosen_update "
                                        "chosen_epoch mixed_precision lr_used halving_kept")
    return Finetuned(r.recommended_epochs, r.recommended_updates, r.still_improving, int(chosen.get("update") or 0),
                     float(chosen.get("epoch") or 0.0), r.mixed_precision, r.lr,
                     r.halving.kept if r.halving is not None else "")


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def retrain_full(
    config_json: str,
    split: Input[Dataset],
    lr_low: float,
    lr_high: float,
    lr: float,
    recommended_epochs: int,
    mlflow_parent_run_id: str,
    model: Output[Model],
    metrics: Output[Metrics],
) -> int:
    """Retrain from the base model on train + validation for the recommended epochs, without validation, at `lr`:
    the LR the fine-tune kept (its `lr_used`)."""
    from pathlib import Path

    from rangefinder.errors import one_line_errors
    from rangefinder.steps.resolve_config import load_step_config
    from rangefinder.steps.retrain_full import run_retrain_full

    with one_line_errors("retrain-full"):
        r = run_retrain_full(
            load_step_config(config_json),
            split_dir=Path(split.path),
            lr_low=lr_low, lr_high=lr_high, lr=lr,
            recommended_epochs=recommended_epochs,
            model_dir=Path(model.path),
            mlflow_parent_run_id=mlflow_parent_run_id or None,
        )
    for name, value in r.metrics().items():
        metrics.log_metric(name, value)
    return r.epochs


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def sample_images(
    config_json: str,
    finetuned: Input[Model],
    mlflow_parent_run_id: str,
    grid: Output[HTML],
    images: Output[Dataset],
    retrained: Optional[Input[Model]] = None,
):
    """Render the fixed prompts and seeds with the base model, the chosen checkpoint and the final weights into one
    comparison grid."""
    from pathlib import Path

    from rangefinder.errors import one_line_errors
    from rangefinder.steps.resolve_config import load_step_config
    from rangefinder.steps.sample_images import run_sample_images

    with one_line_errors("sample-images"):
        run_sample_images(
            load_step_config(config_json),
            finetuned_dir=Path(finetuned.path),
            retrained_dir=Path(retrained.path) if retrained is not None else None,
            out_dir=Path(images.path),
            grid_html=Path(grid.path),
            mlflow_parent_run_id=mlflow_parent_run_id or None,
        )


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def register_model(
    config_json: str,
    model: Input[Model],
    lr: float,
    epochs: int,
    mlflow_parent_run_id: str,
) -> NamedTuple("Registered", model_uri=str, version=str):  # type: ignore[valid-type]
    """Register the delivered model in MLflow: the fine-tune's checkpoint at the recommended length (or the
    retrain's final weights), tagged with the update, epoch and validation loss it was taken at."""
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.errors import one_line_errors
    from rangefinder.steps.register_model import run_register_model
    from rangefinder.steps.resolve_config import load_step_config

    with one_line_errors("register-model"):
        r = run_register_model(load_step_config(config_json), model_dir=Path(model.path), lr=lr, epochs=epochs,
                               mlflow_parent_run_id=mlflow_parent_run_id or None)
    Registered = namedtuple("Registered", "model_uri version")
    return Registered(r.model_uri, r.version or "")


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def record_status(status: dsl.PipelineTaskFinalStatus, mlflow_experiment: str, pipeline_job_id: str):
    """The exit step: record the run's final state (and the error, if any) on its MLflow parent run."""
    from rangefinder.steps.record_status import run_record_status

    run_record_status(
        state=status.state,
        error_message=status.error_message or "",
        failed_task=getattr(status, "pipeline_task_name", "") or "",
        mlflow_experiment=mlflow_experiment,
        pipeline_job_id=pipeline_job_id,
    )
