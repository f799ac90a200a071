"""The final weights as a registered MLflow model, and the explicit promotion from `candidate` to `champion`.

The model is a pyfunc (see sd_pyfunc.py) holding the whole diffusers pipeline folder as an artifact, so
`mlflow.pyfunc.load_model("models:/NAME@candidate").predict(pd.DataFrame({"prompt": [...]}))` generates images
anywhere mlflow, diffusers and torch are installed. A pipeline run only ever moves `candidate`; `champion` moves by
hand (`rangefinder promote`), after someone has looked at the samples.
"""

from __future__ import annotations

import base64
import contextlib
import io
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, TypeVar

from rangefinder.errors import RunDidNotSucceed, TrackingError
from rangefinder.tracking.metrics import SAFE_TAG_VALUE, VALIDATION_SECTION, is_lr_key, lr_text
from rangefinder.tracking.redaction import redact, safe_uri
from rangefinder.tracking.spool import mlflow_key
from rangefinder.training.family_detection import (
    FAMILY_LAYOUTS,
    detect_family,
    folder_t5_sequence_length,
    guidance_scale_in,
    sampling_dtypes,
)

_log = logging.getLogger(__name__)
T = TypeVar("T")

SD_PYFUNC_PATH = Path(__file__).with_name("sd_pyfunc.py")
# The model's artifact holding the files a LoRA or textual-inversion run delivered (log_diffusers_model `delivered`).
DELIVERED = "delivered"
CANDIDATE = "candidate"
CHAMPION = "champion"
# The version tag naming the run that registered it (register_model's, or the training run's own).
REGISTERED_BY = "rangefinder.registered_by_run_id"
# The tag that named it before REGISTERED_BY was set on every version (cec60ec): a version registered by earlier code
# carries only this one where the registering run was the source run, and a retry must still find it.
OLD_REGISTERED_BY = "rangefinder.run_id"
# What made a version's weights, as its tags (StepRun.lineage), so that versions of one registered model that a schedule
# registers run after run can be told apart without opening their source runs: the base model, the revision it
# resolved to and its family, the method, the split's digest, the parts its weights trained on, and the validation
# part's digest and image count (the images its val_loss is measured on; a retrain's version has none, having trained
# on them). The runs that read the split carry its two digests too (log_dataset_manifest), and every step's run the
# base model, revision and family (common_tags).
TAG_BASE_MODEL = "rangefinder.base_model"
# TAG_BASE_MODEL's value for the embedded tiny model (model.base_model unset): the tag earlier versions carry, which
# versions are compared by; the files' own name for it is formats.weights_file.EMBEDDED_BASE_MODEL.
EMBEDDED_BASE_MODEL_TAG = "embedded-tiny"
# model.resolved_revision: a hub id's snapshot commit (`revision: main` names another commit once upstream moves), a
# single file's "sha256:<hex>", a folder's (and the embedded model's) "weights:<hex>" (models/fingerprint.py).
TAG_BASE_MODEL_REVISION = "rangefinder.base_model_revision"
TAG_MODEL_FAMILY = "rangefinder.model_family"
TAG_METHOD = "rangefinder.method"
TAG_DATASET_DIGEST = "rangefinder.dataset_digest"
TAG_VALIDATION_DIGEST = "rangefinder.validation_digest"
TAG_VALIDATION_IMAGES = "rangefinder.validation_images"
# The parts of the split the weights trained on (training.spec.TrainOn), in a person's words: "train+val" is the
# full-data retrain's, whose weights saw the validation images (so no val_loss of theirs, or of another version's on
# those images, measures them on unseen images).
TAG_TRAIN_ON = "rangefinder.train_on"
# How the val_loss was measured, as the settings that define it (validation_settings): two versions measured on the
# same images but at other timesteps, noise seed, resolution, crop, buckets, latents or target have val_loss values
# that do not compare either.
TAG_VALIDATION_SETTINGS = "rangefinder.validation_settings"
# The params (as the training runs log them) that define what a val_loss measures (training/validation.py): the K
# timesteps and the noise seed; the latents' size, crop, buckets and mode; the target the loss is taken against; and
# a flow family's sigma grid. validation.batch_size and the precision change only the last bits.
VALIDATION_DEFINITION = ("validation.timesteps", "validation.seed", "data.resolution", "data.center_crop",
                         "data.bucketing", "data.bucket_step", "data.max_aspect", "training.latent_sampling",
                         "training.prediction_type")
VALIDATION_DEFINITION_PREFIXES = ("training.flow.",)
# Under those prefixes, what weights training alone: validation is never weighted (config.FlowSettings), as DDPM's
# min_snr_gamma, left out above, weights training alone. A version registered before it was left out still names it
# in its tag, which a comparison does not read. So is a setting as set where what it resolved to is logged beside it
# as `<setting>_used` (training.flow.shift None and 3.0 on SD3 are one shift, 3.0): only the latter is read.
VALIDATION_UNRELATED = ("training.flow.loss_weighting",)
USED_SUFFIX = "_used"
# Whether the delivered weights' val_loss is below the base model's, measured alike (register_model sets it).
TAG_IMPROVED_ON_BASE = "rangefinder.improved_on_base"
TRAIN_ON_WORDS = {"train": "the training images alone", "train+val": "train + validation"}
# The lineage tags whose difference makes two versions other models, in the words a version's description says it.
TRAINED_AS = {TAG_BASE_MODEL: "base model", TAG_BASE_MODEL_REVISION: "base model revision",
              TAG_MODEL_FAMILY: "model family", TAG_METHOD: "method"}
# What loading the model needs, pinned to the public release of the versions that logged it.
# The registered model's description in MLflow's Models tab (set when it has none).
MODEL_DESCRIPTION = (
    "Stable Diffusion weights fine-tuned by rangefinder. Each version is one pipeline run's delivered weights: its "
    "description says which LR and length made them, and its source run is the training run with their curves. "
    "@candidate is the newest pipeline run's; @champion is the version promoted by rangefinder promote, by a person "
    "or by a job's --if-better (a lower val_loss on the same validation images); each version's tags "
    "rangefinder.champion_since, _until and _refused say when it held @champion, or why not."
)
_REQUIREMENTS = ("mlflow", "diffusers", "transformers", "torch", "safetensors", "accelerate", "pillow", "pandas",
                 "numpy")


@dataclass(frozen=True)
class RegisteredVersion:
    model_uri: str  # the logged model (models:/m-...), loadable whether or not it was registered
    name: Optional[str]  # registered model name; None when registration is off
    version: Optional[str]
    alias: Optional[str]

    @property
    def registry_uri(self) -> Optional[str]:
        return f"models:/{self.name}@{self.alias}" if self.name and self.alias else None


def _requirements() -> list[str]:
    """`dist==X.Y.Z` for each of _REQUIREMENTS that is installed.

    A local version label (PEP 440: `torch==2.13.0+cpu`, `+cu130`) is dropped: no public index serves those names,
    so pip could not install the model's environment. PyPI's torch of the same release is the CUDA build on Linux
    x86_64 (the CPU-only and other CUDA variants of that release come from PyTorch's own wheel indexes); a
    loaded model runs on whichever it finds (sd_pyfunc.py picks CUDA when available).
    """
    reqs = []
    for dist in _REQUIREMENTS:
        try:
            installed = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        reqs.append(f"{dist}=={installed.split('+', 1)[0]}")  # PEP 440: the local label starts at the first '+'
    return reqs


def _signature(defaults: Mapping[str, Any]):
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    inputs = Schema([ColSpec("string", "prompt"), ColSpec("long", "seed", required=False),
                     ColSpec("string", "negative_prompt", required=False)])
    outputs = Schema([ColSpec("string", "prompt"), ColSpec("long", "seed"), ColSpec("string", "image")])
    params = ParamSchema([
        ParamSpec("num_inference_steps", "long", int(defaults["num_inference_steps"])),
        # None where the model has no guidance input (FLUX.1-schnell): MLflow's ParamSpec takes a default of None (a
        # call may still pass a double), which the model's script leaves out of the pipeline's call.
        ParamSpec("guidance_scale", "double", None if defaults["guidance_scale"] is None
                  else float(defaults["guidance_scale"])),
        ParamSpec("height", "long", int(defaults["height"])),
        ParamSpec("width", "long", int(defaults["width"])),
    ])
    return ModelSignature(inputs=inputs, outputs=outputs, params=params)


def _geometry(pipeline_dir: Path, family: str) -> Any:
    """The size rules' geometry of the pipeline (training/geometry.py: ModelGeometry) from its VAE's and denoiser's
    config.json: its native resolution, the model's default size, and the multiple its sampling sides take."""
    import json

    from rangefinder.training.families import family_rules
    from rangefinder.training.geometry import ModelGeometry

    denoiser = FAMILY_LAYOUTS[family].denoiser
    try:
        vae_config = json.loads((pipeline_dir / "vae" / "config.json").read_text())
        denoiser_config = json.loads((pipeline_dir / denoiser / "config.json").read_text())
        return ModelGeometry.of(family_rules(family), vae_config, denoiser_config)
    except (OSError, KeyError, ValueError, TypeError) as e:  # KeyError, TypeError: a config missing what it needs
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TrackingError(f"{pipeline_dir}: cannot read the sizes of vae/config.json and {denoiser}/config.json "
                            f"({reason}); save the pipeline again with save_pipeline_folder before registering it"
                            ) from None


@contextlib.contextmanager
def _active_experiment(experiment_id: str):
    """Make `experiment_id` MLflow's active experiment for the block, then put back what was there.

    MLflow 3 files a logged model under the fluent API's active experiment, not under its `run_id`'s: without this it
    lands in experiment 0, whose artifacts go to ./mlruns of whatever folder the step runs in. `set_experiment` also
    exports MLFLOW_EXPERIMENT_ID to the environment, which subprocesses (kfp.local's steps) inherit, so both the
    module's active id and the variable are restored afterwards.
    """
    import mlflow
    import mlflow.tracking.fluent as fluent

    saved_env = os.environ.get("MLFLOW_EXPERIMENT_ID")
    saved_active = getattr(fluent, "_active_experiment_id", None)
    mlflow.set_experiment(experiment_id=experiment_id)
    try:
        yield
    finally:
        fluent._active_experiment_id = saved_active
        if saved_env is None:
            os.environ.pop("MLFLOW_EXPERIMENT_ID", None)
        else:
            os.environ["MLFLOW_EXPERIMENT_ID"] = saved_env


def log_diffusers_model(
    run: Any,
    pipeline_dir: str | os.PathLike,
    *,
    registered_model_name: Optional[str] = None,
    metrics: Optional[Mapping[str, Any]] = None,
    tags: Optional[Mapping[str, str]] = None,
    description: Optional[str] = None,
    alias: Optional[str] = CANDIDATE,
    num_inference_steps: int = 25,
    guidance_scale: Optional[float] = None,
    resolution: Optional[int] = None,
    scheduler: Optional[str] = None,
    delivered: Optional[str | os.PathLike] = None,
    name: str = "model",
    source_run_id: Optional[str] = None,
) -> RegisteredVersion:
    """Log a diffusers pipeline folder (model_index.json, unet/, vae/, ...) from the StepRun `run` as a pyfunc model;
    register it as a new version of `registered_model_name` (skipped when None) with `metrics` (default: the run's
    latest metric values) as version tags and in its description, `tags` as further version tags, and point
    `alias` at it.

    num_inference_steps, guidance_scale and resolution become the model's defaults (overridable per predict call);
    guidance_scale None: the model's own, its family's pipeline's default (family_detection.guidance_scale_in), and
    none for a model without the guidance input (FLUX.1-schnell), as the grid records;
    resolution None: the model's native one.
    `scheduler` (a diffusers class name, sampling.scheduler) is the scheduler it samples with, set up from the
    folder's own scheduler config; None: the folder's. A pipeline run registers its weights with the settings its
    samples were drawn with, so the model renders by default what the person promoting it looked at. A model with
    T5 (SD3, Flux) also gets `max_sequence_length` in its config, the T5 length it was trained with.

    `delivered`: the files the run delivered, where they are not the pipeline folder (a LoRA's or an embedding's,
    which `pipeline_dir` holds fused or added), logged beside it as the model's `artifacts/delivered/`, so that
    whoever loads the model can also download the files ComfyUI, A1111 and diffusers' loaders take.

    `source_run_id`: the run that trained the weights (StepRun.log_diffusers_model finds it from a step name): the
    version's source run, where the curves and decisions are, not the run logging the model (which has none).
    None: `run` itself.

    A version that `run` registered already (a retried step goes on in its earlier attempt's run; a server that went
    away part-way is waited for and the registration tried again) is that version, finished (description, alias),
    not a second one of the same weights: nothing is logged again.
    """
    import mlflow
    from mlflow.models import Model

    folder = Path(pipeline_dir)
    if not (folder / "model_index.json").is_file():
        raise TrackingError(
            f"{folder} is not a diffusers pipeline folder (no model_index.json); save the final pipeline with "
            "save_pretrained() before logging it"
        )
    _require_whole_pipeline(folder)
    family = detect_family(folder)
    geometry = _geometry(folder, family)
    res = int(resolution or geometry.native)
    # size_multiple: the pixels the pipeline's sides take (SD3's refuses others, Flux's quietly renders a smaller
    # image), which the model's script checks a call's height and width against.
    defaults: dict[str, Any] = {"num_inference_steps": int(num_inference_steps),
                                "guidance_scale": guidance_scale_in(folder, family, guidance_scale),
                                "height": res, "width": res, "size_multiple": geometry.sampling_multiple}
    # SD3's and Flux's T5 tokens per prompt, as trained (family_detection.t5_sequence_length), which the model's script
    # passes as max_sequence_length: it cannot import rangefinder, so the value travels in its config.
    t5_tokens = folder_t5_sequence_length(folder)
    if t5_tokens is not None:
        defaults["max_sequence_length"] = t5_tokens
    if scheduler:
        defaults["scheduler"] = scheduler
    # The dtype the model samples in, by what the machine loading it offers (family_detection.sampling_dtypes): the
    # model's script cannot import rangefinder, and loaded Flux and SD3 in fp16, where T5 overflows.
    defaults["sampling_dtypes"] = sampling_dtypes(family)
    mlflow.set_tracking_uri(run.tracking_uri)
    earlier = _version_registered_by(run.client, registered_model_name, run.run_id) if registered_model_name else None
    info = None
    if earlier is None:
        with _active_experiment(run.experiment_id), warnings.catch_warnings(), \
                tempfile.TemporaryDirectory(prefix="rangefinder-delivered-") as staging:
            # An input example would make mlflow load the whole pipeline and generate at logging time; the signature
            # already says what goes in and out.
            warnings.filterwarnings("ignore", message=".*input example was not provided.*")
            artifacts = {"pipeline": _artifact_uri(folder)}
            if delivered is not None:
                # Named `delivered` in the model whatever the folder's name (chosen/, final/, or a pipeline/ that would
                # land on the exported pipeline's): mlflow files a folder artifact under its own name.
                artifacts[DELIVERED] = _artifact_uri(shutil.copytree(delivered, Path(staging) / DELIVERED))
            info = Model.log(
                artifact_path=None,
                name=name,
                flavor=mlflow.pyfunc,
                run_id=run.run_id,
                python_model=str(SD_PYFUNC_PATH),
                artifacts=artifacts,
                model_config=defaults,
                signature=_signature(defaults),
                pip_requirements=_requirements(),
                # The model's source is the step that logged it, as its run's is: MLflow would name the process's
                # entry point (kfp's executor_main.py under KFP).
                tags=run.source_tags or None,
            )
    if not registered_model_name:
        assert info is not None  # nothing to find without a registered model: it was logged above
        return RegisteredVersion(model_uri=info.model_uri, name=None, version=None, alias=None)

    if metrics is None:  # the run's own latest values
        run.metrics.flush()
        metrics = run.client.get_run(run.run_id).data.metrics
    clean = {k: float(v) for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}
    # A version tag names the quantity as the reports do (val_loss), not by its chart section in the run; an LR is
    # written as the runs' tags write it (2.091e-04).
    shown = {k: lr_text(v) if is_lr_key(k) else f"{v:.6g}" for k, v in clean.items()}
    version_tags = {k.removeprefix(VALIDATION_SECTION): v for k, v in shown.items()}
    version_tags.update({k: redact(str(v)) for k, v in (tags or {}).items()})
    # A key over the 250 characters MLflow keeps (a user's own tag or metric, named by a prompt) failed the step.
    version_tags = {mlflow_key(k): v for k, v in version_tags.items()}
    # The run that registered the version, which a retry of it finds the version by; the run that trained the weights
    # is the version's own source run.
    version_tags[REGISTERED_BY] = run.run_id
    if run.parent_run_id:
        version_tags["rangefinder.parent_run_id"] = run.parent_run_id
    source_run_id = source_run_id or run.run_id
    mv = earlier if earlier is not None else _create_version(run.client, registered_model_name, info, source_run_id,
                                                              version_tags)
    if earlier is not None and earlier.tags.get(REGISTERED_BY) != run.run_id:  # registered by earlier code
        run.client.set_model_version_tag(registered_model_name, mv.version, REGISTERED_BY, run.run_id)
    summary = ", ".join(f"{k}={lr_text(v) if is_lr_key(k) else f'{v:.4g}'}" for k, v in clean.items())
    text = description or f"Fine-tuned by rangefinder (run {source_run_id})."
    if summary:
        text += f" Metrics: {summary}."
    text += "".join(f" {line}" for line in _unlike_earlier(run.client, registered_model_name, str(mv.version),
                                                             version_tags))
    later = _later_run_holds(run.client, registered_model_name, alias, run.parent_run_id) if alias else None
    if later is not None:
        text += (f" Not @{alias}: version {later}, of a pipeline run started after this one's, holds it (the two "
                 "ran at once, and this one finished last).")
        _log.warning("%s version %s is not @%s: version %s, of a pipeline run started after this one's, holds it",
                     registered_model_name, mv.version, alias, later)
        alias = None
    text += " " + how_to_load(registered_model_name, str(mv.version), folder.name, delivered=delivered is not None)
    run.client.update_model_version(registered_model_name, mv.version, description=redact(text))
    if alias:
        run.client.set_registered_model_alias(registered_model_name, alias, mv.version)
        _log.info("registered %s version %s as @%s", registered_model_name, mv.version, alias)
    return RegisteredVersion(model_uri=mv.source if info is None else info.model_uri, name=registered_model_name,
                             version=str(mv.version), alias=alias)


def how_to_load(name: str, version: str, pipeline_folder: str, *, delivered: bool) -> str:
    """The version description's last words: how its consumer, who sees only the registry, renders with it and gets
    its weights. mlflow files the pipeline folder under the model's `artifacts/` by its own name (chosen/, final/,
    pipeline/ for a fused adapter) and the delivered files as `artifacts/delivered/`."""
    uri = f"models:/{name}/{version}"
    files = (f" and `artifacts/{DELIVERED}/` the files the run delivered (the LoRA or the embedding, for diffusers' "
             "`load_lora_weights` or `load_textual_inversion`, ComfyUI and A1111)" if delivered else "")
    return (f"To use it: `mlflow.pyfunc.load_model(\"{uri}\")` renders prompts (`.predict(pandas.DataFrame("
            f"{{\"prompt\": [\"a red circle\"], \"seed\": [0]}}))`, each image a base64 PNG in column `image`); "
            f"`mlflow.artifacts.download_artifacts(\"{uri}\")` downloads it: its `artifacts/{pipeline_folder}/` is a "
            f"diffusers folder for `diffusers.DiffusionPipeline.from_pretrained`{files}.")


def _later_run_holds(client: Any, name: str, alias: str, parent_run_id: Optional[str]) -> Optional[str]:
    """The version `alias` points to where a pipeline run that started after `parent_run_id` registered it, else None.

    `@candidate` is the newest pipeline run's: two runs at once (a schedule's --max-concurrency, a run submitted
    beside it, a replaced schedule's run still going) registered in the order they finished, and the one started
    earlier, on older data, took the alias from the newer. None too where either start cannot be told (no parent
    run: a registration by hand; a version of earlier code), so the alias moves as it always did."""
    from mlflow.exceptions import MlflowException

    if not parent_run_id:
        return None
    try:
        held = client.get_model_version_by_alias(name, alias)
        theirs = held.tags.get("rangefinder.parent_run_id")
        if not theirs or theirs == parent_run_id:
            return None
        if client.get_run(theirs).info.start_time > client.get_run(parent_run_id).info.start_time:
            return str(held.version)
    except MlflowException:  # no version holds it, or a parent run is gone
        return None
    return None


def _unlike_earlier(client: Any, name: str, version: str, tags: Mapping[str, str]) -> list[str]:
    """A sentence for each version a person compares version `version` of `name` with, the one before it (the
    previous run's, @candidate until now) and @champion, that was not made alike (its lineage tags, `tags` here):
    another base model, another revision of the same one (a hub id's main moved, a folder's or a file's weights were
    replaced under the same path), family or method, other training
    images (one trained on train + validation: the images the other's val_loss was measured on), another validation
    set (their val_loss values were measured on other images and do not compare), or other data. Nothing where they
    were alike, or for a version registered before these tags were. Where its val_loss and @champion's rank the two
    (compare_versions), one more sentence says which is better, by how much."""
    from mlflow.exceptions import MlflowException

    earlier: dict[str, tuple[str, Any]] = {}  # version -> (which it is, to a person; the version)
    for before in range(int(version) - 1, 0, -1):  # the newest earlier version; a deleted one is skipped
        try:
            earlier[str(before)] = ("the version before it", client.get_model_version(name, str(before)))
            break
        except MlflowException:
            continue
    champion = None
    try:
        champion = client.get_model_version_by_alias(name, CHAMPION)
        if str(champion.version) in earlier:
            earlier[str(champion.version)] = (f"the version before it, @{CHAMPION}", champion)
        elif str(champion.version) != version:
            earlier[str(champion.version)] = (f"@{CHAMPION}", champion)
    except MlflowException:
        pass
    lines = []
    for other, (which, mv) in earlier.items():
        differs = [text for text, _ in _differences(tags, mv.tags)]
        if differs:
            lines.append(f"Unlike version {other} ({which}): {'; '.join(differs)}.")
    if champion is not None and str(champion.version) != version:
        # Where the two rank, the answer `rangefinder promote` would give, there when the run registers it.
        against = compare_versions(SimpleNamespace(version=version, tags=dict(tags)), champion)
        if against["better"] is not None:
            lines.append(f"Against @{CHAMPION}: {against['comparison']}.")
    return lines


def _differences(tags: Mapping[str, str], was: Mapping[str, str]) -> list[tuple[str, bool]]:
    """How a version made as its lineage tags `tags` say differs from one made as `was` says: (the difference in a
    person's words, whether it keeps their val_loss values from ranking them). Another base model or family does
    (the loss of another model, or of another noise schedule, ranks no fine-tune); so do weights that saw the
    other's validation images and another validation set. Another method, other data with the same validation set
    (a dataset that grew), or another revision of the same base model (a hub id's main moved between two scheduled
    runs, or someone replaced the weights in its folder or file: _base_moved says which) is what a comparison is for:
    both delivered models are measured alike on the same images."""
    # Another base model has another revision too: the revision is news only for the same one.
    said = [k for k in TRAINED_AS if _changed(k, tags, was)
            and not (k == TAG_BASE_MODEL_REVISION and _changed(TAG_BASE_MODEL, tags, was))]
    moved, _ = _base_moved(tags)
    differs = [(f"{TRAINED_AS[k]} {tags[k]} where it had {was[k]}"
                + (f" ({moved})" if k == TAG_BASE_MODEL_REVISION and moved else ""),
                k not in (TAG_METHOD, TAG_BASE_MODEL_REVISION)) for k in said]
    if _changed(TAG_TRAIN_ON, tags, was):
        whose = "its" if tags[TAG_TRAIN_ON] == "train+val" else "that version's"
        differs.append((f"trained on {TRAIN_ON_WORDS.get(tags[TAG_TRAIN_ON], tags[TAG_TRAIN_ON])} where it was "
                        f"trained on {TRAIN_ON_WORDS.get(was[TAG_TRAIN_ON], was[TAG_TRAIN_ON])}: {whose} weights "
                        "saw the validation images, so no val_loss measured on them compares the two", True))
    if _changed(TAG_VALIDATION_DIGEST, tags, was):
        differs.append((f"another validation set ({_validation_set(tags)}, where it had {_validation_set(was)}), "
                        "so their val_loss values were measured on other images and do not compare", True))
    if _changed(TAG_VALIDATION_SETTINGS, tags, was):
        ours, theirs = (_defining(dict(kv.split("=", 1) for kv in t[TAG_VALIDATION_SETTINGS].split(", ") if "=" in kv))
                        for t in (tags, was))
        changed = [f"{k} {ours.get(k, 'unset')} where it had {theirs.get(k, 'unset')}"
                   for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
        if changed:
            differs.append((f"val_loss measured otherwise ({'; '.join(changed)}), so their val_loss values do not "
                            "compare", True))
    if _changed(TAG_DATASET_DIGEST, tags, was):
        differs.append((f"other data (dataset digest {tags[TAG_DATASET_DIGEST]}, where it had "
                        f"{was[TAG_DATASET_DIGEST]})", False))
    return differs


def _artifact_uri(folder: Path) -> str:
    """The value mlflow reads a pyfunc artifact `folder` from: the file: URI of the folder it is in, then its name as
    it is. mlflow parses the value as a URI: a plain path's `#` began the URI's fragment and its `%41` read as `A`;
    but the last name, which it takes from the URI's path as written, must stay unescaped, or a folder named with a
    space or a letter outside ASCII (`rangefinder register` given a folder of one's own) is no such artifact."""
    folder = Path(folder).absolute()
    return f"{folder.parent.as_uri().rstrip('/')}/{folder.name}"


def _base_moved(tags: Mapping[str, str]) -> tuple[str, str]:
    """(what another revision of the same base model means where its revision, in `tags`, is not a hub commit's; ""
    for a hub id, whose main moved), and how to keep the base weights fixed from week to week. A hub id is pinned by
    model.revision; a folder and a single file have no revision to pin, and hold other weights where someone
    replaced their files under the same path; the embedded tiny model's are the rangefinder release's."""
    from rangefinder.formats.weights_file import FILE_REVISION_PREFIX, FOLDER_REVISION_PREFIX

    revision, base = tags.get(TAG_BASE_MODEL_REVISION, ""), tags.get(TAG_BASE_MODEL, "")
    fixed = "to keep the base weights fixed from week to week"
    if revision.startswith(FOLDER_REVISION_PREFIX) and base == EMBEDDED_BASE_MODEL_TAG:
        return "another rangefinder release's embedded tiny model", f"{fixed}, run the schedule on one release"
    if revision.startswith(FOLDER_REVISION_PREFIX):
        return ("the weights in its folder were replaced",
                f"{fixed}, put new ones in a folder of their own and set model.base_model to it, instead of "
                "replacing these")
    if revision.startswith(FILE_REVISION_PREFIX):
        return ("its file was replaced", f"{fixed}, save new ones under a file name of their own and set "
                                         "model.base_model to it, instead of replacing this one")
    return "", f"pin model.revision {fixed}"


def _changed(key: str, tags: Mapping[str, str], was: Mapping[str, str]) -> bool:
    """Both versions have the lineage tag `key`, and not the same value (a version registered before it has none)."""
    return bool(tags.get(key)) and bool(was.get(key)) and tags[key] != was[key]


def validation_settings(params: Mapping[str, Any]) -> Optional[str]:
    """The settings that define what a run's val_loss measures (VALIDATION_DEFINITION), from its flat params, as one
    readable tag value (`validation.timesteps=4, validation.seed=0, data.resolution=512, ...`); None where the params
    hold none of them (a run of earlier code)."""
    keys = [k for k in VALIDATION_DEFINITION if k in params]
    keys += sorted(k for k in _defining(params) if k.startswith(VALIDATION_DEFINITION_PREFIXES))
    return ", ".join(f"{k}={params[k]}" for k in keys) or None


def _defining(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` without what does not change what a val_loss measures (VALIDATION_UNRELATED: a weighting of
    training alone, and a setting as set where what it resolved to is beside it)."""
    return {k: v for k, v in settings.items()
            if k not in VALIDATION_UNRELATED and f"{k}{USED_SUFFIX}" not in settings}


def _validation_set(tags: Mapping[str, str]) -> str:
    """A version's validation set in a few words: its image count, where known, and digest."""
    count = f"{tags[TAG_VALIDATION_IMAGES]} images, " if tags.get(TAG_VALIDATION_IMAGES) else ""
    return f"{count}digest {tags[TAG_VALIDATION_DIGEST]}"


def _require_whole_pipeline(folder: Path) -> None:
    """Refuse a pipeline folder that is missing a part model_index.json names, or whose model part has no weights or
    a damaged .safetensors file (a copy cut short, a save that stopped part-way): registered, it would become
    @candidate and fail only when someone loads it."""
    import json

    from safetensors import SafetensorError, safe_open

    def refuse(why: str) -> TrackingError:
        return TrackingError(f"{folder} is not a whole diffusers pipeline folder: {why}; save the pipeline again "
                             "with save_pipeline_folder (or copy it again) before registering it")

    try:
        index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise refuse(f"model_index.json cannot be read ({e})") from None
    if not isinstance(index, dict):
        raise refuse("model_index.json is not a JSON object")
    for part, spec in sorted(index.items()):
        if part.startswith("_") or not (isinstance(spec, list) and len(spec) == 2) or spec[0] is None:
            continue  # a setting, or a part the pipeline goes without (safety_checker: [null, null])
        part_dir = folder / part
        if not part_dir.is_dir():
            raise refuse(f"model_index.json names {part} ({spec[1]}), but {part}/ is missing")
        if not (part_dir / "config.json").is_file():
            continue  # a scheduler or tokenizer: settings and vocabularies, no weights
        weights = sorted(part_dir.glob("*.safetensors"))
        if not weights and not any(part_dir.glob("*.bin")):
            raise refuse(f"{part}/ has a config.json but no weights file")
        for w in weights:
            try:
                with safe_open(str(w), framework="pt"):  # checks the header against the file's length
                    pass
            except (SafetensorError, OSError) as e:
                raise refuse(f"{part}/{w.name} is damaged or cut short ({str(e).splitlines()[0][:200]})") from None


def _version_registered_by(client: Any, name: str, run_id: str) -> Any:
    """The version of registered model `name` that the run `run_id` registered (its REGISTERED_BY tag, or for a
    version registered by earlier code its OLD_REGISTERED_BY), or None: also where the registry cannot search by tag
    (a new version is then registered, as before). MLflow's version search has no OR, so the old tag is a second
    search, made only when the first finds nothing."""
    from mlflow.exceptions import MlflowException

    if not SAFE_TAG_VALUE.match(run_id):
        return None
    for tag in (REGISTERED_BY, OLD_REGISTERED_BY):
        try:
            versions = client.search_model_versions(f"tags.`{tag}` = '{run_id}'")
        except MlflowException:
            return None
        found = [v for v in versions if v.name == name]
        if found:
            return max(found, key=lambda v: int(v.version))
    return None


def _create_version(client: Any, name: str, info: Any, source_run_id: str, tags: Mapping[str, str]) -> Any:
    """A new version of registered model `name` (created when missing) from the logged model `info`, its source run
    `source_run_id` (mlflow.register_model would take the logging run's)."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description=MODEL_DESCRIPTION)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        if not client.get_registered_model(name).description:  # a description someone wrote stays
            client.update_registered_model(name, description=MODEL_DESCRIPTION)
    return client.create_model_version(name, info.model_uri, run_id=source_run_id, tags=dict(tags),
                                       model_id=info.model_id)


def retry_while_server_away(cfg: Any, action: Callable[[], T], *, what: str, later: Callable[[], str]) -> T:
    """`action()`, tried again while the tracking server does not answer, for up to tracking.server_wait_seconds.

    Registering a model needs the server there and then (nothing can be spooled: the version number is the result),
    so a server that is away at that moment, or goes away part-way, is waited for. When it stays away, one
    TrackingError says so and gives `later()`, the command that does it once the server answers (made only then: it
    may keep a file). Any other error (credentials, a refused request) is raised at once.
    """
    from rangefinder.tracking.target import (
        ServerAway,
        await_tracking_server,
        away_reason,
        host_refused,
        refusal_message,
        refused_credentials,
        resolve_tracking_uri,
        server_unreachable,
        tracking_settings,
    )

    uri = resolve_tracking_uri(cfg)
    wait_s = tracking_settings(cfg).server_wait_seconds
    deadline = time.monotonic() + wait_s
    answered = False
    while True:
        try:
            return action()
        except Exception as e:
            status = refused_credentials(e)
            if status == 401:  # an answer, not an outage (basic auth's is no JSON: MLflow's error was a traceback)
                raise TrackingError(f"{refusal_message(uri, status)}; so could not {what}; once it takes them, "
                                    f"run: {later()}") from None
            if status == 403 and host_refused(e):  # the Host header, not the user: no permission would help
                raise TrackingError(f"{refusal_message(uri, status, host=True)}; so could not {what}; once it allows "
                                    f"it, run: {later()}") from None
            if status == 403:
                raise TrackingError(
                    f"the MLflow tracking server at {safe_uri(uri)} denied the user in MLFLOW_TRACKING_USERNAME "
                    f"(HTTP 403) the permission to {what}: it needs EDIT on the registered model (or the right to "
                    f"create one); ask the server's admin, then run: {later()}") from None
            if not server_unreachable(e):
                raise
            if answered and time.monotonic() >= deadline:
                # The check answers, yet the action still meets the outage: a store whose check sends no query (a
                # SQLite file another program holds locked, a SQL server gone: store_unavailable) was tried again
                # without end.
                raise TrackingError(
                    f"MLflow at {safe_uri(uri)} is not answering ({away_reason(e)}); it did not answer within "
                    f"tracking.server_wait_seconds ({wait_s:g} s), so could not {what}; once it answers, run: "
                    f"{later()}") from None
        try:
            # One check at least: its ServerAway says why in the words every step uses for the same outage, so a
            # run that fails here and in later steps shows one cause (pipelines.local_run.failure_summary).
            await_tracking_server(uri, max(0.0, deadline - time.monotonic()))
        except ServerAway as away:
            raise TrackingError(
                f"{away}; it did not answer within tracking.server_wait_seconds ({wait_s:g} s), so could not {what}; "
                f"once it answers, run: {later()}"
            ) from None
        answered = True  # tried once more after the check answers, however late
        _log.warning("MLflow at %s answers again; trying to %s again", safe_uri(uri), what)


def promote(
    name: str,
    version: Optional[str | int] = None,
    *,
    from_alias: str = CANDIDATE,
    to_alias: str = CHAMPION,
    tracking_uri: Optional[str] = None,
    if_better: bool = False,
    min_improvement: float = 0.0,
) -> dict[str, Any]:
    """Point `to_alias` (champion) at `version`, or at the version `from_alias` (candidate) points to.

    Returns {name, version, alias, previous_version, promoted} and the comparison with the version `to_alias` held
    (compare_versions): whether their val_loss values rank them, and by how much. Raises TrackingError naming the
    model, version or alias that does not exist. `if_better`: move the alias only where the version's val_loss is
    below that version's on the same validation images, of the same base model (the first version promoted: below
    its base model's), by at least `min_improvement` of that version's val_loss (0.01: 1 %, so a difference within
    what another training run of the same data would give is not taken for progress); else raise RunDidNotSucceed
    with the result (promoted false), the alias where it was. The
    versions keep the alias's history as tags: `rangefinder.<alias>_since` and `_until`, and `_refused`.
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from rangefinder.config import TrackingConfig
    from rangefinder.tracking.target import (
        ensure_tracking_server,
        refuse_uri_credentials,
        resolve_tracking_uri,
        sqlite_path,
    )

    if tracking_uri:
        refuse_uri_credentials(tracking_uri, "--tracking-uri")  # as relog does: a password has no place in argv
    uri = tracking_uri or resolve_tracking_uri(TrackingConfig())
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        # Opened, it was created empty (a megabyte of tables) and the model looked up in it: the default
        # ./mlflow.db is not the store a local run registered in, which is beside its outputs.
        raise TrackingError(
            f"no MLflow database at {db}, so no model to promote; a local run's is OUT/mlflow.db: "
            "pass --tracking-uri sqlite:///OUT/mlflow.db (the run's `mlflow` line), or set MLFLOW_TRACKING_URI"
        )
    ensure_tracking_server(uri)
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    try:
        client.get_registered_model(name)
    except MlflowException as e:
        if _denied(e):  # it was "no registered model ...; check --model" of a model that is there
            raise TrackingError(
                f"{safe_uri(uri)} denied reading registered model {name!r} (HTTP 403): the user in "
                "MLFLOW_TRACKING_USERNAME needs READ permission on it (EDIT to move an alias); ask the server's admin, "
                "or use credentials that have it") from None
        raise TrackingError(
            f"no registered model {name!r} in {safe_uri(uri)}; check --model (and MLFLOW_TRACKING_URI)"
        ) from None
    if version is None:
        try:
            chosen = client.get_model_version_by_alias(name, from_alias)
        except MlflowException:
            raise TrackingError(
                f"registered model {name!r} has no version with alias {from_alias!r}; pass --version N"
            ) from None
    else:
        try:
            chosen = client.get_model_version(name, str(version))
        except MlflowException:
            raise TrackingError(f"registered model {name!r} has no version {version}; list them in the MLflow UI "
                                "(Models tab) and pass an existing --version") from None
    # A str as `version` is: a file or sqlite store answers an int where a server answers a str.
    version = str(chosen.version)
    held = None
    with contextlib.suppress(MlflowException):
        held = client.get_model_version_by_alias(name, to_alias)
    previous = str(held.version) if held is not None else None
    result: dict[str, Any] = {"name": name, "version": version, "alias": to_alias, "previous_version": previous,
                              **compare_versions(chosen, held, to_alias)}
    if held is None or previous == version:  # nothing to beat, or nothing moves: only its base model to be below
        allowed = result["improved_on_base"] is not False
    else:
        allowed = result["better"] is True
        theirs, change = result["previous_val_loss"], result["val_loss_change"]
        if if_better and allowed and min_improvement > 0 and theirs and -change < min_improvement * theirs:
            allowed = False
            result["comparison"] += f"; --min-improvement asks for {min_improvement:.1%} at least"
    if if_better and not allowed:
        stays = f"at version {previous}" if previous is not None else "unset"
        # Said on the version too, where the Models tab shows why a scheduled week stayed a candidate; a user who
        # may only read the model is told the refusal all the same, and that the tab will not show it.
        tag, unrecorded = _history_tag(to_alias, "refused"), ""
        try:
            client.set_model_version_tag(name, version, tag, _history(f"not promoted: {result['comparison']}"))
        except MlflowException as e:
            why = ("the server denied setting it (HTTP 403): the user in MLFLOW_TRACKING_USERNAME needs EDIT "
                   "permission on the model to record it" if _denied(e) else redact(e.message).splitlines()[0][:300])
            unrecorded = f"; the refusal is not recorded on version {version} (tag {tag}): {why}"
        raise RunDidNotSucceed(f"not promoted (--if-better): {result['comparison']}; @{to_alias} stays {stays}"
                               + unrecorded, {**result, "promoted": False, "refusal_recorded": not unrecorded})
    try:
        client.set_registered_model_alias(name, to_alias, str(version))
        if previous != version:
            # An alias keeps no history: each version says when it took the alias, over which, and why; the one it
            # replaced, until when. So the Models tab answers "which version served in week N".
            client.set_model_version_tag(name, version, _history_tag(to_alias, "since"), _history(result["comparison"]))
            with contextlib.suppress(MlflowException):  # held before, and given it again (a rollback)
                client.delete_model_version_tag(name, version, _history_tag(to_alias, "until"))
            if previous is not None:
                client.set_model_version_tag(name, previous, _history_tag(to_alias, "until"),
                                             _history(f"replaced by version {version}"))
    except MlflowException as e:
        # The check above only proves we may read: a user with READ on the model is refused here (HTTP 403), and a
        # name MLflow does not take as an alias is refused before any request. One line, not mlflow's traceback.
        if _denied(e):
            raise TrackingError(
                f"{safe_uri(uri)} denied moving alias {to_alias!r} of registered model {name!r} (HTTP 403): the "
                "user in MLFLOW_TRACKING_USERNAME needs EDIT (or MANAGE) permission on it; ask the server's admin, "
                "or use credentials that have it") from None
        raise TrackingError(f"could not point alias {to_alias!r} of registered model {name!r} at version {version}: "
                            f"{redact(e.message).splitlines()[0][:300]}") from None
    return {**result, "promoted": True}


def _history_tag(alias: str, event: str) -> str:
    """The version tag of an alias's history, rangefinder.<alias>_since, _until or _refused, in the 250 characters
    MLflow keeps of a tag's key (mlflow_key): an alias takes 255, and one over it moved the alias, then failed."""
    return mlflow_key(f"rangefinder.{alias}_{event}")


def _history(what: str) -> str:
    """A version tag's value for an alias's history: the UTC time, then what happened (cut to fit a tag)."""
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return redact(f"{now} {what}")[:4000]


def compare_versions(mv: Any, held: Any, alias: str = CHAMPION) -> dict[str, Any]:
    """Version `mv` against `held`, the version `alias` points to (None: none yet), as a person deciding to promote
    it asks: is it better, by how much, and does its val_loss rank the two at all. {val_loss, previous_val_loss,
    val_loss_change (mv's less held's, where they compare), better (True, False, or None where they do not compare
    or nothing is held), improved_on_base (its tag, None where it has none), comparison (that, in one sentence)}.
    Two val_loss values rank two versions only where both were measured on the same validation images (the
    validation digest) of the same base model (another revision of it is said, not refused), by weights that never
    trained on them (_differences); a dataset that
    grows week by week draws another validation set each week unless its images are kept apart (split.val_dir). A
    version whose val_loss is not below its own base model's is said to be so."""
    loss = _tag_float(mv.tags, "val_loss")
    improved = mv.tags.get(TAG_IMPROVED_ON_BASE)
    out: dict[str, Any] = {"val_loss": loss, "previous_val_loss": None, "val_loss_change": None, "better": None,
                           "improved_on_base": None if improved is None else improved == "true"}
    worse_than_base = improved == "false"
    base_note = ("its val_loss is not below its base model's (tag rangefinder.improved_on_base), so fine-tuning made "
                 "it no better than the model it started from")
    if held is None or str(held.version) == str(mv.version):
        first = held is None
        out["comparison"] = (f"no version held @{alias} before: nothing to compare with" if first
                             else f"version {mv.version} already holds @{alias}")
        if worse_than_base:
            out["comparison"] = f"{out['comparison']}; {base_note}"
        return out
    theirs = _tag_float(held.tags, "val_loss")
    out["previous_val_loss"] = theirs
    reasons = [text for text, breaks in _differences(mv.tags, held.tags) if breaks]
    for v in (mv, held):
        if _tag_float(v.tags, "val_loss") is None:
            reasons.append(f"version {v.version} has no val_loss (weights trained on train + validation, or "
                           "registered by hand, are not measured on unseen images)")
        elif not v.tags.get(TAG_VALIDATION_DIGEST) and v.tags.get(TAG_TRAIN_ON) != "train+val":
            reasons.append(f"version {v.version} does not record its validation set (registered by hand or by "
                           "earlier code), so whether both were measured on the same images is unknown")
        elif not v.tags.get(TAG_VALIDATION_SETTINGS):
            # Read as alike before: two versions measured at other timesteps, seed or resolution ranked.
            reasons.append(f"version {v.version} does not record how its val_loss was measured (tag "
                           f"{TAG_VALIDATION_SETTINGS}: registered by hand or by earlier code), so whether both were "
                           "measured alike is unknown; where you know they were, promote it by hand with --version")
    said = f"val_loss {_num(loss)} against @{alias} version {held.version}'s {_num(theirs)}"
    if reasons:
        fix = (": to rank weekly versions by val_loss, keep the validation images in a folder of their own "
               "(split.val_dir), so every run measures on the same ones" if any(
                   "another validation set" in r for r in reasons) else "")
        out["comparison"] = f"{said} does not rank them: {'; '.join(reasons)}{fix}"
    else:
        assert loss is not None and theirs is not None  # a missing one is a reason above
        change = loss - theirs
        out["val_loss_change"] = change
        out["better"] = change < 0 and not worse_than_base
        how = "the same" if change == 0 else (f"{abs(change):.3g} {'lower' if change < 0 else 'higher'}"
                                                + (f" ({abs(change) / theirs:.1%})" if theirs > 0 else ""))
        out["comparison"] = (f"{said}: {how}, {'better' if change < 0 else 'not better'}, on the same validation "
                             f"images ({_validation_set(mv.tags)})")
        if worse_than_base:
            out["comparison"] += f"; but {base_note}"
    if _changed(TAG_BASE_MODEL_REVISION, mv.tags, held.tags) and not _changed(TAG_BASE_MODEL, mv.tags, held.tags):
        # Their val_loss ranks them all the same; the person promoting should know the base weights moved under it.
        why, fix = _base_moved(mv.tags)
        out["comparison"] += (f"; its base model {mv.tags.get(TAG_BASE_MODEL, '')} moved from revision "
                              f"{held.tags[TAG_BASE_MODEL_REVISION]} (version {held.version}'s) to "
                              f"{mv.tags[TAG_BASE_MODEL_REVISION]}{f' ({why})' if why else ''}: {fix}")
    return out


def _tag_float(tags: Mapping[str, str], key: str) -> Optional[float]:
    """A version tag as a finite number, or None: not there, or not a number."""
    try:
        value = float(tags[key])
    except (KeyError, TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _num(value: Optional[float]) -> str:
    return "none" if value is None else f"{value:.4g}"


def _denied(e: Any) -> bool:
    """Whether an MlflowException is the server's HTTP 403: the user may not do that to the model."""
    return e.get_http_status_code() == 403 or "error code 403" in str(e)


def decode_image(b64_png: str):
    """One `image` cell of the model's output as a PIL image."""
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64_png))).convert("RGB")
