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
from typing import Any, NamedTuple, Optional

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Markdown, Metrics, Model, Output

from rangefinder.container_images import default_images

# The release's default names; `rangefinder.pipelines.pipeline` sets the image each task really runs in when it
# compiles.
TRAINER_IMAGE = default_images()["trainer"]
CPU_IMAGE = default_images()["cpu"]


def _config_default(parameter: str) -> Any:
    """resolve_config's default for `parameter`: the default config's value, as the published pipeline's parameters
    have it (steps.resolve_config.parameter_defaults). KFP ships this function beside the component
    (`additional_funcs`): on a cluster an input a pipeline leaves out is not passed at all and the function's own
    default applies, read here from the package in the image, the same value the compiler wrote into the IR."""
    from rangefinder.steps.resolve_config import parameter_defaults

    return parameter_defaults()[parameter]


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False, additional_funcs=[_config_default])
def resolve_config(
    report: Output[Markdown],
    base_config: str = "",
    dataset_dir: str = _config_default("dataset_dir"),
    base_model: str = _config_default("base_model"),
    base_model_revision: str = _config_default("base_model_revision"),
    method: str = _config_default("method"),
    lr_finder: str = _config_default("lr_finder"),
    resolution: int = _config_default("resolution"),
    batch_size: int = _config_default("batch_size"),
    grad_accum: int = _config_default("grad_accum"),
    ramp: str = _config_default("ramp"),
    lr_min: float = _config_default("lr_min"),
    lr_max: float = _config_default("lr_max"),
    range_test_epochs: int = _config_default("range_test_epochs"),
    finetune_epochs: int = _config_default("finetune_epochs"),
    val_split: float = _config_default("val_split"),
    split_seed: int = _config_default("split_seed"),
    seed: int = _config_default("seed"),
    fixed_lr: float = _config_default("fixed_lr"),
    retrain: bool = _config_default("retrain"),
    retrain_epochs: int = _config_default("retrain_epochs"),
    prompts: list = _config_default("prompts"),  # noqa: B008 (read once; the body never changes it)
    mlflow_experiment: str = _config_default("mlflow_experiment"),
    mlflow_ui_url: str = _config_default("mlflow_ui_url"),
    pipeline_job_id: str = "",
    pipeline_job_name: str = "",
    dataset_uri: str = "",
) -> NamedTuple(  # type: ignore[valid-type]
    "ResolvedConfig", config_json=str, fixed_lr=float, lr_finder=str, retrain=bool, mlflow_parent_run_id=str
):
    """Validate the parameters into one config and resolve the base model to a local folder (downloaded or
    converted once; fails fast, before any GPU is requested); open the MLflow parent run of this pipeline run. The
    log warns of each parameter the run leaves unused (retrain_epochs with retrain off, the range test's with a
    fixed LR), as the CLI does, and so does the `report` the KFP UI shows.

    Args:
        base_config: Every other setting, as the JSON of a rangefinder config; empty, the default: the default
            config. The parameters below override it, each at its default too (the default config's value): pass
            those whose field base_config sets otherwise (resolve-config warns of each it replaced).
        dataset_dir: Path of the dataset folder on the data volume; empty: the embedded synthetic shapes dataset.
        base_model: A diffusers folder, a single-file .safetensors checkpoint or a hub id; empty: the tiny model.
        base_model_revision: Branch, tag or commit of a hub base_model; empty: main.
        method: What trains: full, lora or textual_inversion.
        lr_finder: How discovery measures the LR: range_test, prodigy_step or auto (by model family and method).
        resolution: Training resolution in pixels, a multiple of 8: each image trains at about resolution^2 pixels
            in the aspect-ratio bucket nearest its own (a square crop with data.bucketing off).
        batch_size: Images per micro-batch per GPU.
        grad_accum: Micro-batches per optimizer update.
        ramp: The LR range test's ramp: exp or linear.
        lr_min: The LR range test's start; 0: the method's default.
        lr_max: The LR range test's end; 0: the method's default.
        range_test_epochs: Epochs the LR range test ramps over.
        finetune_epochs: Epochs of the constant-LR fine-tune.
        val_split: Share of images held out for validation loss.
        split_seed: Seed of the train/validation split.
        seed: Seed of training (weights, noise, shuffling).
        fixed_lr: A learning rate chosen by hand (skips discovery); 0: find it by measurement.
        retrain: Retrain on train + validation for the recommended epochs and register that model.
        retrain_epochs: Epochs of the full-data retrain; 0: the epochs the fine-tune recommends.
        prompts: Prompts of the evaluation grid (one row each, fixed seeds), as a JSON list of strings.
        mlflow_experiment: MLflow experiment the runs are logged under; where KFP's MLflow integration is on, the
            experiment it names the pods ($MLFLOW_EXPERIMENT_ID) wins.
        mlflow_ui_url: The MLflow UI's address as a browser opens it, which the run's MLflow links point at; empty:
            the tracking URI the pods use.
        pipeline_job_id: The KFP run id (dsl.PIPELINE_JOB_ID_PLACEHOLDER); the MLflow parent run is found by it.
            Empty, the default: no parent run, each step's MLflow run stands alone.
        pipeline_job_name: The KFP run name; the MLflow parent run is named after it, and found by it with the id.
        dataset_uri: The object-store URI (s3://, gs://, minio://) the pipeline's importer reads the dataset from,
            checked here (no path, no credentials); empty, the default: none.

    Returns:
        config_json: The validated config as JSON, with the base model resolved; every later step reads it.
        fixed_lr: The hand-chosen learning rate, or 0 when discovery runs.
        lr_finder: The finder discovery runs: range_test or prodigy_step (auto resolved for the model and method).
        retrain: Whether the full-data retrain runs.
        mlflow_parent_run_id: The MLflow run the steps' runs nest under (KFP's own when its MLflow plugin is on).
        report: What the run resolved to, in Markdown: the base model and its folder, revision and family, the
            method, how the LR will be found, the retrain, and the warnings of parameters the run leaves unused.
    """
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.pipelines.component_support import step_errors
    from rangefinder.steps.resolve_config import run_resolve_config

    with step_errors("resolve-config", report):
        r = run_resolve_config(
            base_config, dataset_dir=dataset_dir, base_model=base_model, base_model_revision=base_model_revision,
            method=method, lr_finder=lr_finder, resolution=resolution, batch_size=batch_size, grad_accum=grad_accum,
            ramp=ramp, lr_min=lr_min, lr_max=lr_max, range_test_epochs=range_test_epochs,
            finetune_epochs=finetune_epochs, val_split=val_split, split_seed=split_seed, seed=seed, fixed_lr=fixed_lr,
            retrain=retrain,
            retrain_epochs=retrain_epochs, prompts=prompts, mlflow_experiment=mlflow_experiment,
            mlflow_ui_url=mlflow_ui_url, pipeline_job_id=pipeline_job_id, pipeline_job_name=pipeline_job_name,
            dataset_uri=dataset_uri, report_path=Path(report.path),
        )
    ResolvedConfig = namedtuple("ResolvedConfig", "config_json fixed_lr lr_finder retrain mlflow_parent_run_id")
    return ResolvedConfig(r.config_json, r.fixed_lr, r.lr_finder, r.retrain, r.mlflow_parent_run_id)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def prepare_dataset(
    config_json: str,
    split: Output[Dataset],
    report: Output[Markdown],
    dataset: Optional[Input[Dataset]] = None,
) -> NamedTuple("Prepared", train_images=int, val_images=int, skipped_files=int):  # type: ignore[valid-type]
    """Validate the images and captions and split them (train / validation / stabilize) into one Dataset folder.

    Args:
        config_json: The run's validated config, as resolve-config returns it.
        dataset: A dataset folder (images with a caption in a sibling .txt or .caption, or a metadata.jsonl or
            metadata.csv); absent: the config's data.dataset_dir, or the embedded synthetic shapes dataset.

    Returns:
        split: The split dataset folder (train / validation / stabilize) every training step reads.
        report: What was kept, skipped and why, in Markdown: each file left out, named with its reason.
        train_images: Images in the training part.
        val_images: Images held out for validation loss.
        skipped_files: Files left out, each named with its reason in `report`: unreadable, corrupt, animated or too
            small images; images without a usable caption (none, empty, not UTF-8, or two that disagree); files not
            trained on (neither an image nor its caption, a mask, a split's manifests); broken, looping or repeated
            links and folders that cannot be read; metadata rows naming no image; training images identical to a
            split.val_dir image.
    """
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.pipelines.component_support import step_errors
    from rangefinder.steps.prepare_dataset import run_prepare_dataset
    from rangefinder.steps.resolve_config import load_step_config

    with step_errors("prepare-dataset", split):
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
    curve: Output[Dataset],
    metrics: Output[Metrics],
    report_html: Output[HTML],
    report_md: Output[Markdown],
    stage: str = "first",
    lr_min: float = 0.0,
    lr_max: float = 0.0,
    mlflow_parent_run_id: str = "",
) -> NamedTuple(  # type: ignore[valid-type]
    "LRBounds", lr_low=float, lr_high=float, lr_mid=float, needs_zoom=bool, zoom_lr_min=float, zoom_lr_max=float
):
    """One training run whose LR climbs from lr_min to lr_max (0: the configured range), then the bounds.

    Args:
        config_json: The run's validated config, as resolve-config returns it.
        split: The split dataset folder (prepare-dataset's `split`, or any folder of that layout).
        stage: "first", the default (the configured range), or "zoom" (a narrower re-test); names the MLflow run and
            report.
        lr_min: Where the LR ramp starts; 0: the config's lr_range_test range.
        lr_max: Where the LR ramp ends; 0: the config's lr_range_test range.
        mlflow_parent_run_id: The MLflow parent run of the pipeline run (resolve-config's output); empty, the
            default: the run KFP's MLflow integration made for the task, else $MLFLOW_RUN_ID's, else none.

    Returns:
        curve: The loss-against-LR curve (metrics.csv) and the run's record.
        metrics: The bounds (where the curve gave them) and the curve's quality as KFP metrics.
        report_html: The range test's report (curve, bounds, why), as HTML.
        report_md: The same report in Markdown.
        lr_low: The lowest LR at which the loss falls clearly; 0: the curve gave none (a zoom follows).
        lr_high: The highest LR before the loss stops falling or diverges; 0: the curve gave none (a zoom follows).
        lr_mid: The LR to fine-tune at, between lr_low and lr_high; 0: the curve gave none (a zoom follows).
        needs_zoom: Whether the curve is censored or too sparse to read, so a narrower test should follow.
        zoom_lr_min: Where a zoom re-test should start; 0: no zoom needed.
        zoom_lr_max: Where a zoom re-test should end; 0: no zoom needed.
    """
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.pipelines.component_support import log_step_metrics, step_errors
    from rangefinder.steps.lr_range_test import run_lr_range_test
    from rangefinder.steps.resolve_config import load_step_config

    with step_errors("lr-range-test", curve):
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
    log_step_metrics(metrics, r.metrics())
    LRBounds = namedtuple("LRBounds", "lr_low lr_high lr_mid needs_zoom zoom_lr_min zoom_lr_max")
    return LRBounds(r.lr_low, r.lr_high, r.lr_mid, r.needs_zoom, r.zoom_lr_min, r.zoom_lr_max)


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def prodigy_step_size(
    config_json: str,
    split: Input[Dataset],
    curve: Output[Dataset],
    metrics: Output[Metrics],
    report_html: Output[HTML],
    report_md: Output[Markdown],
    mlflow_parent_run_id: str = "",
) -> NamedTuple("ProdigyStepSize", lr=float, d=float, updates=int, factor=float):  # type: ignore[valid-type]
    """The prodigy_step LR finder: a Prodigy run of the fine-tune's length at lr 1.0 (diffusers' recommended
    settings, constant schedule), whose final step size d x lr (times the config's prodigy_step_factor; unset, 4 on
    SDXL's and SD3's full fine-tune: config.PRODIGY_STEP_FACTOR) is the LR the fine-tune trains at.

    Args:
        config_json: The run's validated config, as resolve-config returns it.
        split: The split dataset folder (prepare-dataset's `split`, or any folder of that layout).
        mlflow_parent_run_id: The MLflow parent run of the pipeline run (resolve-config's output); empty, the
            default: the run KFP's MLflow integration made for the task, else $MLFLOW_RUN_ID's, else none.

    Returns:
        curve: The run's validation curve (metrics.csv), its per-update step sizes (updates.csv) and its record.
        metrics: The step size read, Prodigy's d, the updates and the best validation loss as KFP metrics.
        report_html: The reading's report (step size and validation loss against updates), as HTML.
        report_md: The same report in Markdown.
        lr: The LR to fine-tune at: the step size d x lr at the run's last update, times its factor.
        d: Prodigy's final estimate d.
        updates: The updates the run took.
        factor: The factor the step size was multiplied by (1 where the family and method have none).
    """
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.pipelines.component_support import log_step_metrics, step_errors
    from rangefinder.steps.prodigy_step_size import run_prodigy_step_size
    from rangefinder.steps.resolve_config import load_step_config

    with step_errors("prodigy-step-size", curve):
        r = run_prodigy_step_size(
            load_step_config(config_json),
            split_dir=Path(split.path),
            out_dir=Path(curve.path),
            report_html=Path(report_html.path),
            report_md=Path(report_md.path),
            mlflow_parent_run_id=mlflow_parent_run_id or None,
        )
    log_step_metrics(metrics, r.metrics())
    ProdigyStepSize = namedtuple("ProdigyStepSize", "lr d updates factor")
    return ProdigyStepSize(r.lr, r.reading.d, r.reading.updates, r.reading.factor)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def choose_lr(
    config_json: str,
    source: str,
    lr_low: float,
    lr_high: float,
    lr_mid: float,
    decision: Output[Markdown],
    updates: int = 0,
    factor: float = 1.0,
) -> NamedTuple("ChosenLR", lr_low=float, lr_high=float, lr_mid=float, source=str):  # type: ignore[valid-type]
    """The LR bounds the fine-tune uses, and where they came from (first test, zoom re-test, Prodigy's step size or
    fixed by hand).

    Args:
        config_json: The run's validated config, as resolve-config returns it.
        source: Where the bounds come from: range-test, zoom, prodigy-step or fixed.
        lr_low: The lower LR bound.
        lr_high: The upper LR bound.
        lr_mid: The LR to fine-tune at.
        updates: The updates of the Prodigy run a prodigy-step LR was read off (for the decision's text); 0: none.
        factor: The factor prodigy-step-size multiplied that run's step size by (for the decision's text).

    Returns:
        decision: The decision and its reasons, in Markdown.
        lr_low: The lower LR bound the fine-tune uses.
        lr_high: The upper LR bound the fine-tune uses.
        lr_mid: The LR the fine-tune trains at.
        source: Where the bounds came from.
    """
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.pipelines.component_support import step_errors
    from rangefinder.steps.choose_lr import run_choose_lr
    from rangefinder.steps.resolve_config import load_step_config

    with step_errors("choose-lr", decision):
        r = run_choose_lr(load_step_config(config_json), source=source, lr_low=lr_low, lr_high=lr_high, lr_mid=lr_mid,
                          decision_path=Path(decision.path), updates=updates, factor=factor)
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
    model: Output[Model],
    curve: Output[Dataset],
    metrics: Output[Metrics],
    report_html: Output[HTML],
    report_md: Output[Markdown],
    mlflow_parent_run_id: str = "",
) -> NamedTuple(  # type: ignore[valid-type]
    "Finetuned", recommended_epochs=int, recommended_updates=int, still_improving=bool, chosen_update=int,
    chosen_epoch=float, chosen_rule=str, mixed_precision=str, lr_used=float, halving_kept=str,
):
    """Train at the midpoint LR (or cycle between the bounds) for longer than needed; find the step window. With
    successive halving, lr_mid and lr_high train half-way and the better one goes on: `lr_used` is the LR kept.

    Args:
        config_json: The run's validated config, as resolve-config returns it.
        split: The split dataset folder (prepare-dataset's `split`).
        lr_low: The lower LR bound (choose-lr's).
        lr_high: The upper LR bound (choose-lr's).
        lr_mid: The LR to fine-tune at (choose-lr's).
        lr_source: Where the bounds came from: range-test, zoom, prodigy-step or fixed.
        mlflow_parent_run_id: The MLflow parent run of the pipeline run (resolve-config's output); empty, the
            default: the run KFP's MLflow integration made for the task, else $MLFLOW_RUN_ID's, else none.

    Returns:
        model: The chosen checkpoint's weights (diffusers folder, or the adapter for lora / textual_inversion).
        curve: The training and validation curves (metrics.csv) and the run's record.
        metrics: The step window and the validation loss as KFP metrics.
        report_html: The fine-tune's report (curves, step window, why), as HTML.
        report_md: The same report in Markdown.
        recommended_epochs: Epochs to train for, read from the validation curve (with no step window, the
            fallback the report names).
        recommended_updates: The optimizer updates those epochs take in the fine-tune (a retrain on train +
            validation takes more per epoch).
        still_improving: Whether validation loss was still falling at the end (train longer).
        chosen_update: The update of the checkpoint delivered in `model`.
        chosen_epoch: The epoch of that checkpoint.
        chosen_rule: The rule that delivered it (window_lowest, window_nearest, run_lowest, window_average, cooldown
            or earliest_tied; the report says why); empty: no validation, the final weights.
        mixed_precision: The precision training ran in (no, fp16 or bf16).
        lr_used: The LR the fine-tune kept (lr_mid, or lr_high or lr_below when successive halving kept it).
        halving_kept: Which candidate successive halving kept (lr_mid, lr_high or lr_below); empty: no halving.
    """
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.pipelines.component_support import log_step_metrics, step_errors
    from rangefinder.steps.finetune import run_finetune
    from rangefinder.steps.resolve_config import load_step_config

    with step_errors("finetune", model):
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
    log_step_metrics(metrics, r.metrics())
    chosen = r.chosen or {}
    Finetuned = namedtuple("Finetuned", "recommended_epochs recommended_updates still_improving chosen_update "
                                        "chosen_epoch chosen_rule mixed_precision lr_used halving_kept")
    return Finetuned(r.recommended_epochs, r.recommended_updates, r.still_improving, int(chosen.get("update") or 0),
                     float(chosen.get("epoch") or 0.0), str(chosen.get("rule") or ""), r.mixed_precision, r.lr,
                     r.halving.kept if r.halving is not None else "")


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def retrain_full(
    config_json: str,
    split: Input[Dataset],
    lr_low: float,
    lr_high: float,
    lr: float,
    recommended_epochs: int,
    model: Output[Model],
    metrics: Output[Metrics],
    report_html: Output[HTML],
    report_md: Output[Markdown],
    mlflow_parent_run_id: str = "",
) -> NamedTuple("Retrained", epochs=int, Output=int):  # type: ignore[valid-type]
    """Retrain from the base model on train + validation for the recommended epochs, without validation.

    Args:
        config_json: The run's validated config, as resolve-config returns it.
        split: The split dataset folder (prepare-dataset's `split`).
        lr_low: The lower LR bound.
        lr_high: The upper LR bound.
        lr: The LR to train at: the one the fine-tune kept (its `lr_used`).
        recommended_epochs: Epochs to train for (the fine-tune's recommendation; the config's retrain_epochs wins).
        mlflow_parent_run_id: The MLflow parent run of the pipeline run (resolve-config's output); empty, the
            default: the run KFP's MLflow integration made for the task, else $MLFLOW_RUN_ID's, else none.

    Returns:
        model: The final weights after the retrain.
        metrics: The retrain's length as KFP metrics: retrain_epochs and retrain_updates (its training loss is in
            the report).
        report_html: The retrain's report (training loss and LR against updates, the length and why), as HTML.
        report_md: The same report in Markdown.
        epochs: The epochs the retrain ran.
        Output: The same as `epochs`, under its earlier name (KFP's for a bare return), kept; read `epochs`.
    """
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.pipelines.component_support import log_step_metrics, step_errors
    from rangefinder.steps.resolve_config import load_step_config
    from rangefinder.steps.retrain_full import run_retrain_full

    with step_errors("retrain-full", model):
        r = run_retrain_full(
            load_step_config(config_json),
            split_dir=Path(split.path),
            lr_low=lr_low, lr_high=lr_high, lr=lr,
            recommended_epochs=recommended_epochs,
            model_dir=Path(model.path),
            report_html=Path(report_html.path),
            report_md=Path(report_md.path),
            mlflow_parent_run_id=mlflow_parent_run_id or None,
        )
    log_step_metrics(metrics, r.metrics())
    Retrained = namedtuple("Retrained", "epochs Output")
    return Retrained(r.epochs, r.epochs)


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def sample_images(
    config_json: str,
    finetuned: Input[Model],
    grid: Output[HTML],
    images: Output[Dataset],
    retrained: Optional[Input[Model]] = None,
    mlflow_parent_run_id: str = "",
):
    """Render the fixed prompts and seeds with the base model, the fine-tune's checkpoints and final weights, and the
    retrain's where there is one, into one comparison grid.

    Args:
        config_json: The run's validated config, as resolve-config returns it.
        finetuned: The fine-tune's chosen checkpoint (finetune's `model`).
        retrained: The retrain's final weights (retrain-full's `model`); absent: no retrain column.
        mlflow_parent_run_id: The MLflow parent run of the pipeline run (resolve-config's output); empty, the
            default: the run KFP's MLflow integration made for the task, else $MLFLOW_RUN_ID's, else none.

    Returns:
        grid: The comparison grid, as HTML: a row per prompt and seed; a column per model (the base model, the
            chosen checkpoint and the others kept, the fine-tune's final weights, the retrain's where there is one).
        images: The grid's rendered images, per prompt, seed and model.
    """
    from pathlib import Path

    from rangefinder.pipelines.component_support import step_errors
    from rangefinder.steps.resolve_config import load_step_config
    from rangefinder.steps.sample_images import run_sample_images

    with step_errors("sample-images", images):
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
    result: Output[Markdown],
    mlflow_parent_run_id: str = "",
) -> NamedTuple("Registered", model_uri=str, version=str):  # type: ignore[valid-type]
    """Register the delivered model in MLflow: the fine-tune's checkpoint at the recommended length (or the
    retrain's final weights), tagged with the update, epoch and validation loss it was taken at.

    Args:
        config_json: The run's validated config, as resolve-config returns it.
        model: The weights to register (finetune's or retrain-full's `model`).
        lr: The LR the weights were trained at.
        epochs: The epochs they were trained for.
        mlflow_parent_run_id: The MLflow parent run of the pipeline run (resolve-config's output); empty, the
            default: the run KFP's MLflow integration made for the task, else $MLFLOW_RUN_ID's, else none.

    Returns:
        result: The run's result in Markdown: the registered model, the weights, the LR, the length and the link to
            the pipeline's MLflow run.
        model_uri: The registered model's URI (models:/NAME/VERSION).
        version: The registered version number; empty when no version was made.
    """
    from collections import namedtuple
    from pathlib import Path

    from rangefinder.pipelines.component_support import step_errors
    from rangefinder.steps.register_model import run_register_model
    from rangefinder.steps.resolve_config import load_step_config

    with step_errors("register-model", result):
        r = run_register_model(load_step_config(config_json), model_dir=Path(model.path), lr=lr, epochs=epochs,
                               mlflow_parent_run_id=mlflow_parent_run_id or None, result_md=Path(result.path))
    Registered = namedtuple("Registered", "model_uri version")
    return Registered(r.model_uri, r.version or "")


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def record_status(status: dsl.PipelineTaskFinalStatus, mlflow_experiment: str, pipeline_job_id: str,
                  pipeline_job_name: str = ""):
    """The exit step: record the run's final state (and the error, if any) on its MLflow parent run.

    Args:
        status: The pipeline's final status, which KFP fills in for an exit handler's task.
        mlflow_experiment: The MLflow experiment the parent run is in.
        pipeline_job_id: The KFP run id the parent run is found by.
        pipeline_job_name: The KFP run name (dsl.PIPELINE_JOB_NAME_PLACEHOLDER), which the parent run must carry
            too where given: kfp.local's run ids can repeat; empty, the default: the id alone.
    """
    from rangefinder.errors import one_line_errors
    from rangefinder.steps.record_status import run_record_status

    with one_line_errors("record-status"):
        run_record_status(
            state=status.state,
            error_message=status.error_message or "",
            failed_task=getattr(status, "pipeline_task_name", "") or "",
            mlflow_experiment=mlflow_experiment,
            pipeline_job_id=pipeline_job_id,
            pipeline_job_name=pipeline_job_name,
        )
