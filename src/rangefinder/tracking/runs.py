"""The run tree: one parent run per pipeline run, one child run per step, and what a step logs into its run.

Each KFP step is its own process (often its own pod), so nothing is shared in memory: a step finds its parent by id.
`ensure_parent_run` is idempotent: it looks the parent up by the tag `rangefinder.pipeline_run` (the KFP run id, or
the pipeline run's name), and by `kfp.run_name` too where the KFP run's name is known, and creates it only when
missing, so any step, in any order, gets the same parent.

Under KFP's own MLflow integration (KFP 2.17), KFP makes the tree itself: a parent run per pipeline run and a nested
run per task, which it names to the task's pod in $MLFLOW_RUN_ID (with $MLFLOW_EXPERIMENT_ID and $MLFLOW_WORKSPACE,
which the MLflow client reads itself). Then the parent is KFP's (the task run's `mlflow.parentRunId`), no second one
is made, and a step logs into the task run KFP made for it instead of opening a child of its own (`kfp_task_run`).

Everything here goes through `MlflowClient` with explicit run ids, never mlflow's global "active run", because the
fluent API would silently resume $MLFLOW_RUN_ID instead of opening a child.

A server that stops answering while a step runs does not stop the step: tracking/outbox.py holds the one policy (what
the step logs goes to its spool and is sent in order when the server answers again; the step waits a bounded time,
`tracking.server_wait_seconds`, at its end, and otherwise ends with a warning naming what was not logged and the
`rangefinder relog` command).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import numbers as numbers_abc
import os
import subprocess
import time
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

from rangefinder.errors import TrackingError, on_sigint
from rangefinder.formats.digest import hash_file_into
from rangefinder.tracking.metrics import SAFE_TAG_VALUE, BatchedMetricLogger, is_lr_key, lr_text, metric_name
from rangefinder.tracking.outbox import Outbox, StepLink, is_away_error
from rangefinder.tracking.redaction import REDACTED, is_secret_key, redact, safe_uri
from rangefinder.tracking.registry import (
    EMBEDDED_BASE_MODEL_TAG,
    TAG_BASE_MODEL,
    TAG_BASE_MODEL_REVISION,
    TAG_DATASET_DIGEST,
    TAG_METHOD,
    TAG_MODEL_FAMILY,
    TAG_TRAIN_ON,
    TAG_VALIDATION_DIGEST,
    TAG_VALIDATION_IMAGES,
    TAG_VALIDATION_SETTINGS,
    validation_settings,
)
from rangefinder.tracking.spool import (
    MLFLOW_NAME_CHARS,
    PENDING,
    Spool,
    apply_record,
    describe,
    mlflow_key,
    read_spool,
    spool_dir,
)
from rangefinder.tracking.target import (
    TAG_NOTE,
    CredentialsRefused,
    ServerAway,
    TrackingSource,
    away_reason,
    bound_http_requests,
    check_tracking_server,
    default_experiment_id,
    ensure_tracking_server,
    no_artifact_bars_off_a_terminal,
    refusals_named,
    resolve_experiment_name,
    resolve_tracking_uri,
    sqlite_path,
    store_error,
    tracking_settings,
)

_log = logging.getLogger(__name__)

# Tags (mlflow.* are MLflow's own, shown in its UI).
TAG_PARENT = "mlflow.parentRunId"
TAG_PIPELINE_RUN = "rangefinder.pipeline_run"  # the key a parent is found by
TAG_STEP = "rangefinder.step"
TAG_CREATED_BY = "rangefinder.created_by"
TAG_ERROR = "rangefinder.error"
TAG_ATTEMPT = "rangefinder.attempt"  # 1, then 2, ... when a retried step goes on in its run
TAG_KFP_RUN_NAME = "kfp.run_name"
# Each split part's MLflow Dataset context, by what the run trains on (training.spec.TrainOn): the full-data retrain
# trains on the validation images as on the training ones (MLflow's "training" context), and measures nothing.
DATASET_CONTEXTS = {"train": {"train": "training", "val": "validation", "stabilize": "stabilize"},
                    "train+val": {"train": "training", "val": "training"}}
# Parent runs of one key read to find the one of a KFP run's name: one is usual, a few where kfp.local's ids met.
MAX_PARENTS_OF_A_KEY = 100
MAX_PARAM_CHARS = 500  # MLflow takes 6000; longer values (prompt lists) are unreadable in its table anyway
MAX_TAG_CHARS = 5000


# ---------------------------------------------------------------------------------------------------------------
# Client and the facts every run is tagged with


def tracking_client(cfg: Optional[TrackingSource] = None, *, check: bool = True):
    """An MlflowClient for the resolved tracking URI, after the fail-fast check (see target.py)."""
    import mlflow
    from mlflow import MlflowClient

    uri = resolve_tracking_uri(cfg)
    bound_http_requests()
    no_artifact_bars_off_a_terminal()
    if check:
        ensure_tracking_server(uri, experiment_name=resolve_experiment_name(cfg))
    # The fluent calls mlflow makes inside Model.log / register_model read the global URI.
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def git_revision() -> Optional[str]:
    """$RANGEFINDER_GIT_REVISION (baked into images), else `git rev-parse HEAD` of this checkout, else None."""
    return os.environ.get("RANGEFINDER_GIT_REVISION") or _checkout_revision()


@functools.lru_cache(maxsize=1)
def _checkout_revision() -> Optional[str]:
    root = Path(__file__).resolve().parents[3]  # src/rangefinder/tracking/runs.py -> the checkout
    if not (root / ".git").exists():  # an installed package: whatever repo encloses site-packages is not ours
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


# MLflow's source of a pipeline's parent run (a step's is its module: `step_source`); the pipeline may be someone's
# own, made of rangefinder's components, so not the name of rangefinder's.
PIPELINE_SOURCE = "rangefinder pipeline"


def step_source(step_name: str) -> str:
    """The source MLflow shows for a step's run: the module that runs the step, rangefinder.steps.<step>."""
    return f"rangefinder.steps.{step_name}"


def source_tags(source: str) -> dict[str, str]:
    """MLflow's source tags for a run or logged model rangefinder made: `source` (PIPELINE_SOURCE or a step's module)
    as a JOB, at the git revision when known. Without them MLflow names the process's entry point: kfp's
    executor_main.py under KFP, pytest or the rangefinder script elsewhere."""
    tags = {"mlflow.source.name": source, "mlflow.source.type": "JOB"}
    rev = git_revision()
    if rev:
        tags["mlflow.source.git.commit"] = rev  # MLflow's UI links this
    return tags


def common_tags(cfg: Optional[TrackingSource] = None, *, source: str = PIPELINE_SOURCE) -> dict[str, str]:
    """Pipeline version, source (`source_tags`) and git revision, image and base model (with the revision it
    resolved to, once resolve-config has resolved it: model.resolved_revision), its family and the method: the facts
    that make a run reproducible, and what a search for "every LoRA of SDXL" filters runs by, as it filters the
    registered versions (which carry the same two tags)."""
    from rangefinder import __version__

    tags = {"rangefinder.version": __version__, **source_tags(source)}
    image = os.environ.get("RANGEFINDER_IMAGE") or _get(cfg, "kubernetes", "image")
    if image:
        tags["rangefinder.image"] = image
    model = _get(cfg, "model", "base_model")
    if cfg is not None and hasattr(cfg, "model"):
        tags[TAG_BASE_MODEL] = model or EMBEDDED_BASE_MODEL_TAG
        revision = _get(cfg, "model", "resolved_revision")
        if revision:
            tags[TAG_BASE_MODEL_REVISION] = revision
        from rangefinder.config import ModelConfig
        from rangefinder.training.family_detection import family_of

        family = family_of(cfg.model) if isinstance(cfg.model, ModelConfig) else None
        if family:
            tags[TAG_MODEL_FAMILY] = family  # detected from the model (sd1 | sdxl), never configured
    method = _get(cfg, "training", "method")
    if method:
        tags[TAG_METHOD] = str(method)
    return tags


def _get(cfg: Optional[TrackingSource], section: str, name: str) -> Any:
    return getattr(getattr(cfg, section, None), name, None)


def folder_digest(folder: str | os.PathLike, pattern: str = "*") -> str:
    """A short sha256 over the relative paths and bytes of the files under `folder` (the dataset digest tag)."""
    root = Path(folder)
    h = hashlib.sha256()
    for p in sorted(x for x in root.rglob(pattern) if x.is_file()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        hash_file_into(h, p)
        h.update(b"\0")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# Params: flat, truncated, secret-free


def flatten_params(obj: Any, prefix: str = "") -> dict[str, str]:
    """Nested settings as flat `section.field` -> string params. Secret-named keys (is_secret_key, on the dotted
    name) are dropped to ***."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(mode="json")
    out: dict[str, str] = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            key = f"{prefix}{k}"
            if is_secret_key(key):
                out[key] = REDACTED
            elif isinstance(v, Mapping) or hasattr(v, "model_dump"):
                out.update(flatten_params(v, key + "."))
            else:
                out[key] = _param_value(v)
    else:
        out[prefix.rstrip(".") or "value"] = _param_value(obj)
    return out


# The file the resolved config is logged as, whole, on every run that logs its settings.
CONFIG_ARTIFACT = "config.yaml"
# The folder a training step's curve CSVs are logged under (metrics.csv; the Prodigy step's updates.csv too).
CURVES_ARTIFACT = "curves"
# The folder a step's report (plot, HTML, Markdown) is logged under (StepRun.log_report).
REPORT_ARTIFACT = "report"


def logged_curve_path(csv: str | os.PathLike) -> str:
    """A step's curve CSV as its MLflow run holds it (`curves/metrics.csv`), the path its decision JSON names. The
    step's own path is a folder of the machine that ran it (a pod's volume, a local run's pipeline-root), which the
    JSON and the report travel away from (MLflow, the KFP UI)."""
    return f"{CURVES_ARTIFACT}/{Path(csv).name}"


def logged_curve(csv: str | os.PathLike) -> str:
    """Where a step's report says its curve is, in words: `curves/metrics.csv in this step's MLflow run`."""
    return f"{logged_curve_path(csv)} in this step's MLflow run"


# The `training` fields the pipeline's runs set themselves (cli/ignored.py's PIPELINE says the same to the user).
PIPELINE_SET_TRAINING = ("epochs", "steps", "steps_unit", "lr", "scale_lr", "schedule", "lr_min", "lr_max",
                         "warmup_updates", "decay_fraction", "world_size", "resume")


# The split's image count and the files it left out (log_dataset_manifest), on the training runs and their parent.
TAG_DATASET_IMAGES = "rangefinder.dataset_images"
TAG_SKIPPED_FILES = "rangefinder.skipped_files"


def applicable_params(cfg: Any) -> dict[str, str]:
    """The params of `cfg` that apply to this run, flat (`training.batch_size`, ...).

    A whole RangefinderConfig holds every method's and every mode's settings; logged as they are, a local full
    fine-tune showed 162 params, among them LoRA's rank and the pods' tolerations. Left out here (they are still in
    the run's config.yaml artifact): the settings of the methods not trained (`training.lora`,
    `training.textual_inversion`), `kubernetes` outside a pod (Kubernetes sets $KUBERNETES_SERVICE_HOST in every
    pod), `distributed` on one node, `retrain` when it is off, the objective settings of the other kind of model
    (`training.flow` on SD 1.x/2.x and SDXL, DDPM's on SD3 and Flux: family_rules' `unused_training`, once the
    family can be told from the model), and the `training` fields each pipeline run sets
    itself (its budget, LR, schedule and process count: training/spec.py), which only `rangefinder train` reads and
    which logs to no MLflow: a fine-tune showed `training.lr` 1e-4 beside the LR it trained at. Added, once the family
    can be told: `sampling.guidance_scale_used`, the guidance the samples use, and on SD3 and Flux
    `training.flow.shift_used` and (Flux) `training.flow.guidance_used`, what training uses
    (families.objective_settings_used).
    """
    params = flatten_params(cfg)
    if getattr(cfg, "lr", 0) is None:
        params.pop("lr", None)  # no LR set by hand: "lr" is the one a step trained at (the fine-tune logs it)
    if getattr(getattr(cfg, "model", None), "resolved_dir", "") is None:
        # Not resolved yet (the parent run is made before resolve-config fetches the model): logged once it is
        # (log_resolved_config), where a param, written once, would otherwise read None for good.
        params.pop("model.resolved_dir", None)
        params.pop("model.resolved_revision", None)
    training = getattr(cfg, "training", None)
    if training is None or not hasattr(cfg, "kubernetes"):
        return params
    dropped = [f"training.{m}." for m in ("lora", "textual_inversion") if m != training.method]
    pipeline_set = {f"training.{k}" for k in PIPELINE_SET_TRAINING}
    if not os.environ.get("KUBERNETES_SERVICE_HOST"):
        dropped.append("kubernetes.")
    if cfg.distributed.num_nodes <= 1:
        dropped += [f"distributed.{k}" for k in type(cfg.distributed).model_fields if k != "num_nodes"]
    if not cfg.retrain.enabled:
        dropped += [f"retrain.{k}" for k in type(cfg.retrain).model_fields if k != "enabled"]
    from rangefinder.models.loading import local_model_folder
    from rangefinder.training.families import family_rules, objective_settings_used
    from rangefinder.training.family_detection import family_of, guidance_scale_in

    family = family_of(cfg.model)
    if family:  # the objective's settings of the other kind (flow-matching or DDPM), refused unless left unset
        unused = [f"training.{k}" for k in family_rules(family).unused_training]
        pipeline_set |= set(unused)
        dropped += [f"{k}." for k in unused]
        # What the samples use beside what the config says (unset: the model's own, resolved here and by every step
        # that samples, never written into the setting: a config copied from this run samples another model at its
        # own): the parent run made before a hub id is fetched gets it once resolve-config has the model.
        # None where the model has no guidance input (FLUX.1-schnell), read off its folder where it is here; a Flux
        # single file not converted yet, dev's or schnell's, gets it once resolve-config has its folder (a param once
        # logged on the parent run stays).
        folder = local_model_folder(cfg.model)
        if folder is not None or family != "flux":
            used = guidance_scale_in(folder, family, cfg.sampling.guidance_scale)
            params["sampling.guidance_scale_used"] = "none (no guidance input)" if used is None else _param_value(used)
        # And what the flow objective trains at where its settings are unset (SD3's shift 3.0, Flux's guidance 3.5),
        # which the settings' own params show as None.
        params.update({k: _param_value(v) for k, v in objective_settings_used(cfg, family).items()})
    return {k: v for k, v in params.items() if k not in pipeline_set and not k.startswith(tuple(dropped))}


def config_text(cfg: Any) -> str:
    """The resolved config as YAML, secrets redacted: what `run --local --config` reads back. The Kubernetes Secrets'
    names are kept (config.SECRET_REFERENCES); a value that had to be hidden is *** whole, and reads back as a
    one-line refusal naming the setting (config's `_check_raw`)."""
    import yaml

    data = cfg.model_dump(mode="json") if hasattr(cfg, "model_dump") else dict(cfg)
    return yaml.safe_dump(_redacted(data), sort_keys=False, allow_unicode=True)


def _redacted(obj: Any, prefix: str = "") -> Any:
    if isinstance(obj, Mapping):
        return {k: REDACTED if is_secret_key(f"{prefix}{k}") else _redacted(v, f"{prefix}{k}.")
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redacted(v, prefix) for v in obj]
    # A string that held a secret is hidden whole, as a secret-named setting is: only the mark alone is refused when
    # the file is read back (config.REDACTED), and "a cat ***" would read back as a prompt to train on.
    return REDACTED if isinstance(obj, str) and redact(obj) != obj else obj


def _param_value(v: Any) -> str:
    if isinstance(v, (list, tuple, dict)):
        s = json.dumps(v, default=str, separators=(",", ":"))
    elif isinstance(v, float):
        s = repr(v)
    else:
        s = str(v)
    return _cut(redact(s), MAX_PARAM_CHARS)


def _cut(s: str, limit: int) -> str:
    """`s`, or where longer than `limit`, its start and how much was left off: a value cut without a word reads as
    the whole one."""
    return s if len(s) <= limit else s[: limit - 20] + f"...(+{len(s) - limit + 20} chars)"


def _run_name(name: str) -> str:
    """A run's name as MLflow keeps it: a KFP run's name (`submit --name`, one typed in the KFP UI) names the parent
    run, and one over MLFLOW_NAME_CHARS ends in how much was cut."""
    return _cut(redact(name), MLFLOW_NAME_CHARS)


def _tag_value(v: Any) -> str:
    if isinstance(v, bool):
        s = "true" if v else "false"
    elif isinstance(v, (list, tuple)):
        s = ",".join(str(x) for x in v)
    elif isinstance(v, dict):
        s = json.dumps(v, default=str, sort_keys=True)
    else:
        s = str(v)
    return _cut(redact(s), MAX_TAG_CHARS)


# ---------------------------------------------------------------------------------------------------------------
# The parent run of a pipeline run


def _pipeline_key(kfp_run_id: Optional[str], name: Optional[str]) -> str:
    key = kfp_run_id or name
    if not key:
        raise TrackingError("a pipeline run needs a name or a KFP run id to be found by its steps; pass name=...")
    # The key goes into a search filter; anything outside a safe alphabet is replaced by its digest.
    return key if SAFE_TAG_VALUE.match(key) else "sha1:" + hashlib.sha1(key.encode()).hexdigest()


def ensure_parent_run(
    cfg: Optional[TrackingSource] = None,
    *,
    name: Optional[str] = None,
    kfp_run_id: Optional[str] = None,
    kfp_run_name: Optional[str] = None,
    tags: Optional[Mapping[str, Any]] = None,
    log_config: bool = True,
) -> str:
    """The run id of the pipeline run's parent run, created if no step has made it yet.

    Under KFP's MLflow integration, KFP's pipeline run is the parent: the parent of $MLFLOW_RUN_ID's task run (or
    $MLFLOW_RUN_ID itself when it has no parent: a run the caller made for us). Otherwise the parent is found by
    `kfp_run_id` (or `name`; $KFP_RUN_ID / $KFP_RUN_NAME fill them in when not given), and by `kfp_run_name` as
    well when it is known (`_find_parent`), and made when missing: named `name`, tagged with the KFP run, pipeline
    version, git revision, image, base model and `tags` (e.g. `{"rangefinder.dataset_digest": ...}`), with `cfg`'s
    settings as params when it is a whole RangefinderConfig. A SQLite store another program holds locked is the
    one line `step_run` says of it (StoreLocked), where it was MLflow's traceback.
    """
    with _lock_named(resolve_tracking_uri(cfg)):
        return _ensure_parent_run(cfg, name=name, kfp_run_id=kfp_run_id, kfp_run_name=kfp_run_name, tags=tags,
                                  log_config=log_config)


def _ensure_parent_run(cfg: Optional[TrackingSource], *, name: Optional[str], kfp_run_id: Optional[str],
                       kfp_run_name: Optional[str], tags: Optional[Mapping[str, Any]], log_config: bool) -> str:
    client = tracking_client(cfg)
    env_run = os.environ.get("MLFLOW_RUN_ID")
    if env_run:
        run = _get_run(client, env_run, "$MLFLOW_RUN_ID")
        return run.data.tags.get(TAG_PARENT) or env_run

    kfp_run_id = kfp_run_id or os.environ.get("KFP_RUN_ID") or None
    kfp_run_name = kfp_run_name or os.environ.get("KFP_RUN_NAME") or None
    name = name or kfp_run_name or kfp_run_id
    key = _pipeline_key(kfp_run_id, name)
    exp_id = default_experiment_id(client, cfg)
    found = _find_parent(client, exp_id, key, kfp_run_name)
    if found:
        return found

    all_tags: dict[str, Any] = {**common_tags(cfg), TAG_PIPELINE_RUN: key, TAG_CREATED_BY: "rangefinder"}
    if kfp_run_id:
        all_tags["kfp.run_id"] = kfp_run_id
    if kfp_run_name:
        all_tags[TAG_KFP_RUN_NAME] = kfp_run_name
    all_tags.update(tags or {})
    with refusals_named(resolve_tracking_uri(cfg)):  # a READ user, let in by the check, is denied the run
        run = client.create_run(exp_id, run_name=_run_name(name or key), tags=_tag_values(all_tags))
    run_id = run.info.run_id
    # Two steps racing to create the parent: the earliest one wins, the loser's run is deleted.
    first = _find_parent(client, exp_id, key, kfp_run_name)
    if first and first != run_id:
        client.delete_run(run_id)
        return first
    if log_config and cfg is not None and hasattr(cfg, "tracking"):
        _log_parent_config(client, run_id, cfg)
    _log.info("MLflow parent run %s (%s) in %s", run_id, name, safe_uri(resolve_tracking_uri(cfg)))
    return run_id


def _log_parent_config(client: Any, run_id: str, cfg: Any, logged: Collection[str] = ()) -> None:
    """`cfg`'s params (applicable_params) but those named in `logged`, and its config.yaml, on the parent run
    `run_id`."""
    params = {k: v for k, v in applicable_params(cfg).items() if k not in logged}
    if params:
        apply_record(client, {"kind": "params", "run_id": run_id, "params": params})
    if hasattr(cfg, "kubernetes"):
        apply_record(client, {"kind": "text", "run_id": run_id, "text": config_text(cfg),
                              "artifact_file": CONFIG_ARTIFACT})


def log_resolved_config(cfg: Any, run_id: str) -> None:
    """resolve-config's config, once the base model is resolved, on the parent run `run_id` that ensure_parent_run
    made before: the params it did not have (model.resolved_dir, model.resolved_revision, and a hub id's
    sampling.guidance_scale_used; all of them for a parent made by a step that stopped before it logged any),
    config.yaml with the folder in it, and the base model's tags known only now (its revision; the family of a hub id
    not fetched before). A parent KFP's MLflow integration made is KFP's, left as it is."""
    client = tracking_client(cfg)
    run = _get_run(client, run_id, "the parent run id")
    if run.data.tags.get(TAG_CREATED_BY) == "rangefinder":
        _log_parent_config(client, run_id, cfg, run.data.params)
        known = {k: v for k, v in common_tags(cfg).items() if k in (TAG_BASE_MODEL_REVISION, TAG_MODEL_FAMILY)}
        if known:
            apply_record(client, {"kind": "tags", "run_id": run_id, "tags": known})


def _find_parent(client: Any, exp_id: str, key: str, kfp_run_name: Optional[str] = None) -> Optional[str]:
    """The oldest parent run tagged with the pipeline run's `key` and, where `kfp_run_name` is given, with that KFP
    run name (the tag as ensure_parent_run wrote it). The key alone is not always one run's: kfp.local draws a run's
    id from 10^8 numbers (kfp 2.17, kfp.local.placeholder_utils.make_random_id), so of a few thousand local runs in
    one experiment two likely share one, and the newer run's steps would go on under the older run's parent (an
    unfinished step's MLflow run continued as a retry, the older parent's description and state overwritten). A
    kfp.local run's name holds its start to the microsecond; a cluster's run ids are UUIDs."""
    runs = client.search_runs(
        [exp_id],
        filter_string=f"tags.`{TAG_PIPELINE_RUN}` = '{key}'",
        max_results=MAX_PARENTS_OF_A_KEY,
        order_by=["attributes.start_time ASC"],
    )
    name = _tag_value(kfp_run_name) if kfp_run_name else None
    return next((r.info.run_id for r in runs if name is None or r.data.tags.get(TAG_KFP_RUN_NAME) == name), None)


def _get_run(client: Any, run_id: str, what: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as e:
        raise TrackingError(
            f"{what} names MLflow run {run_id}, which {safe_uri(client.tracking_uri)} does not have "
            f"({redact(e.message).splitlines()[0][:200]}); pass the id the first step returned, or unset it"
        ) from None


def kfp_task_run(client: Any) -> Optional[Any]:
    """The run KFP's MLflow integration made for this task: $MLFLOW_RUN_ID when that run is nested (its parent is the
    pipeline run KFP made). None when $MLFLOW_RUN_ID is unset or names a top-level run (then it is only a parent)."""
    env_run = os.environ.get("MLFLOW_RUN_ID")
    if not env_run:
        return None
    run = _get_run(client, env_run, "$MLFLOW_RUN_ID")
    return run if run.data.tags.get(TAG_PARENT) else None


def finish_pipeline_run(cfg: Optional[TrackingSource], run_id: str, *, status: str = "FINISHED") -> None:
    """Mark the parent run ended (FINISHED, FAILED or KILLED), unless KFP's plugin owns it (it ends it itself)."""
    client = tracking_client(cfg)
    run = _get_run(client, run_id, "finish_pipeline_run")
    if run.data.tags.get(TAG_CREATED_BY) == "rangefinder":
        _end_run(client, run_id, status)


def _end_run(client: Any, run_id: str, status: str) -> None:
    apply_record(client, {"kind": "end", "run_id": run_id, "status": status})


# ---------------------------------------------------------------------------------------------------------------
# A step's run


@dataclass
class StepRun:
    """An open child run of one step. Use it inside `with step_run(...) as run:`.

    Each logging call is a record (tracking/spool.py) handed to the run's outbox (tracking/outbox.py): sent now, or
    kept in the run's spool while the server is away and sent in order when it answers; `finish` waits a bounded
    time for the server before leaving what is still kept there for `rangefinder relog`.
    """

    client: Any
    run_id: str
    experiment_id: str
    step_name: str
    parent_run_id: Optional[str]
    tracking_uri: str
    cfg: Optional[TrackingSource] = None
    spool_dir: Optional[Path] = None  # None: tracking.spool.spool_dir() (env, data volume or ./mlflow-spool)
    # False for the task run KFP's MLflow integration made: KFP ends it when the task ends, so `finish` does not.
    owned: bool = True
    logged_through: Optional[Mapping[str, int]] = None  # a continued run: the last update each metric reached
    source: Optional[str] = None  # MLflow's mlflow.source.name of the run (step_source), for what it logs (a model)
    # A child run's: the link to the server of the step whose run it is under (its outbox's), so one outage is the
    # step's (tracking/outbox.py StepLink); None for a step's own run.
    link: Optional[StepLink] = None
    # The data tags log_dataset_manifest set (the split's and validation set's digests, train_on), which the run's
    # child runs carry too (child_run): their val_loss compares with another run's only on the same validation set.
    data_tags: dict[str, str] = field(init=False, default_factory=dict)
    metrics: BatchedMetricLogger = field(init=False)
    spool: Spool = field(init=False)
    outbox: Outbox = field(init=False)

    def __post_init__(self) -> None:
        every = tracking_settings(self.cfg).log_every_updates if self.cfg is not None else 1
        self.spool = run_spool(self.tracking_uri, self.run_id, self.step_name, self.spool_dir)
        self.outbox = Outbox(self.client, self.spool, link=self.link)
        self.metrics = BatchedMetricLogger(self.outbox, every_updates=every, logged_through=self.logged_through)

    @property
    def offline(self) -> bool:
        """The last try to reach the server failed; records go to the spool until a later try gets an answer."""
        return self.outbox.away

    def _deliver(self, record: Mapping[str, Any]) -> None:
        self.outbox.send(record)

    # --- the engine's MetricSink: the run itself can be passed as the sink
    def log_metrics(self, metrics: Mapping[str, Optional[float]], step: int) -> None:
        """Buffered; the update number is the MLflow step."""
        self.metrics.log_metrics(metrics, step)

    # --- settings
    def log_config(
        self, cfg: Optional[TrackingSource] = None, *, plan: Any = None, extra: Optional[Mapping[str, Any]] = None,
        trained: Optional[TrackingSource] = None,
    ) -> None:
        """The resolved settings that apply to this run as flat params (`training.batch_size`, ...;
        `applicable_params`), the whole config as the artifact config.yaml, the planner's figures as `plan.*`.

        `plan` is a rangefinder.planning.Plan (effective_batch, updates_per_epoch, lr = the scaled LR, ...);
        `extra` holds any other figures a step worked out (logged under their own names). `trained`: the config the
        step trained when it made one of its own from `cfg` (the prodigy_step finder's Prodigy run), whose settings
        are then the params; config.yaml is `cfg` still, the pipeline run's as given, which a person copies to run
        it again (the probe's would run a Prodigy fine-tune, no LR discovered).
        """
        params: dict[str, str] = {}
        cfg = cfg if cfg is not None else self.cfg
        if cfg is not None:
            params.update(applicable_params(trained if trained is not None else cfg))
            if hasattr(cfg, "kubernetes"):  # a whole RangefinderConfig
                self.log_text(config_text(cfg), CONFIG_ARTIFACT)
        if plan is not None:
            params.update(flatten_params(plan, "plan."))
        if extra:
            params.update(flatten_params(dict(extra)))
        self._deliver({"kind": "params", "run_id": self.run_id, "params": params})

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._deliver({"kind": "params", "run_id": self.run_id, "params": flatten_params(dict(params))})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._set_tags(self.run_id, {k: v for k, v in tags.items() if not is_secret_key(k)})

    def set_run_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        """Tags on another run of this step's tree, ended or not (a child's outcome, known after it ended), through
        this run's outbox."""
        self._set_tags(run_id, {k: v for k, v in tags.items() if not is_secret_key(k)})

    def _set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        clean = _tag_values(tags)
        if clean:
            self._deliver({"kind": "tags", "run_id": run_id, "tags": clean})

    # --- descriptions
    def describe(self, text: str, *, pipeline: Optional[str] = None) -> None:
        """`text` as the run's description (the step's decision in one line, shown in MLflow's UI), and `pipeline`
        as the parent run's (the pipeline's decision; the step that knows it last sets it)."""
        self._set_tags(self.run_id, {TAG_NOTE: text})
        if pipeline is not None and self.parent_run_id:
            self._set_tags(self.parent_run_id, {TAG_NOTE: pipeline})

    # --- decisions
    def log_decisions(
        self, decisions: Mapping[str, Any], *, prefix: str = "", to_parent: bool = True, step: Optional[int] = None,
        numbers_to_parent: bool = True, parent_only: bool = False,
    ) -> None:
        """Numbers become metrics (quality, recommended_epochs, ...); learning rates (`lr`, `lr_*`: lr_low, lr_mid,
        lr_used, ...), strings, booleans and lists become tags (status, flags, ...): MLflow draws a single-value
        metric as a bar chart rounded to 2 decimals, where an LR of 2.09e-04 reads "0.00". Nested mappings are
        flattened with dots; None is skipped.

        With `to_parent`, the parent run gets the same keys (one row per pipeline run in MLflow's table, one key per
        quantity on parent and child). `numbers_to_parent=False` keeps the numbers and LRs on this run: a step whose
        numbers are not the ones the pipeline used (a range test's bounds, before choose_lr) would otherwise mix
        decisions on the parent. `parent_only`: the parent alone gets them, for its row in MLflow's run list, where
        this run holds them already as params (the bounds a fine-tune was given, the LR it kept).
        """
        numbers: dict[str, float] = {}
        rates: dict[str, str] = {}
        words: dict[str, Any] = {}
        for k, v in _flatten_any(decisions, prefix).items():
            if hasattr(v, "item") and getattr(v, "ndim", None) == 0:
                v = v.item()  # numpy scalars as the Python number or bool they are
            if v is None:
                continue
            if isinstance(v, numbers_abc.Real) and not isinstance(v, bool):
                if is_lr_key(k):
                    rates[k] = lr_text(float(v))
                else:
                    numbers[k] = float(v)
            else:
                words[k] = v
        ts = int(time.time() * 1000)
        rows = [[metric_name(k), v, ts, step or 0] for k, v in numbers.items()]
        targets = [] if parent_only else [(self.run_id, {**rates, **words})]
        if (to_parent or parent_only) and self.parent_run_id:
            targets.append((self.parent_run_id, {**rates, **words} if numbers_to_parent else words))
        for run_id, tags in targets:
            if rows and (run_id == self.run_id or numbers_to_parent):
                self._deliver({"kind": "metrics", "run_id": run_id, "metrics": rows})
            self._set_tags(run_id, tags)

    # --- artifacts
    def log_artifact(self, path: str | os.PathLike, artifact_path: Optional[str] = None) -> None:
        """A file, or a folder's contents, under `artifact_path` (plots, reports, curve CSVs, manifests)."""
        p = Path(path)
        if not p.exists():
            raise TrackingError(f"cannot log {p} to MLflow: no such file or folder")
        self._deliver({"kind": "artifact", "run_id": self.run_id, "path": str(p.absolute()),
                       "artifact_path": artifact_path})

    def log_report(self, report_dir: str | os.PathLike, *, held_elsewhere: Sequence[str | os.PathLike]) -> None:
        """A step's report folder as the run's `report/`, less the files the run already holds in another form
        (`held_elsewhere`: the curve under curves/, the report's JSON where the step's decision JSON holds all of
        it). The step's KFP output keeps them all; in MLflow one file of each made two to tell apart (a
        report/metrics.csv beside curves/metrics.csv, a report/lr_bounds.json beside analysis/bounds.json)."""
        skip = {Path(p).name for p in held_elsewhere}
        for p in sorted(Path(report_dir).iterdir()):
            if p.name not in skip:
                self.log_artifact(p, REPORT_ARTIFACT)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._deliver({"kind": "text", "run_id": self.run_id, "text": text, "artifact_file": artifact_file})

    def log_image(self, image: Any, artifact_file: Optional[str] = None, *, key: Optional[str] = None,
                  step: Optional[int] = None) -> None:
        """A PIL image, (H, W[, C]) array or image file: as one file (`artifact_file`), or as a step of the image
        series `key` (shown in MLflow's UI with a step slider, e.g. the sample grid)."""
        if (artifact_file is None) == (key is None):
            raise ValueError("give either artifact_file or key")
        record: dict[str, Any] = {"kind": "image", "run_id": self.run_id, "artifact_file": artifact_file,
                                  "key": key, "step": step or 0}
        if isinstance(image, (str, os.PathLike)):
            record["path"] = str(Path(image).absolute())
        else:
            record["image"] = image
        self._deliver(record)

    def log_dataset_manifest(self, split_dir: str | os.PathLike, artifact_path: str = "dataset", *,
                             train_on: str = "train") -> str:
        """The split folder's manifests (train/val/stabilize.jsonl, split.json) as artifacts, and each part the run
        reads as an MLflow dataset input (the run's "Datasets" column: name, digest, row count, context:
        DATASET_CONTEXTS). Returns the digest of the whole split, also set as the tag `rangefinder.dataset_digest`
        here and on the parent run, with the split's image count and the files it skipped (`rangefinder.dataset_images`,
        `rangefinder.skipped_files`), beside the validation part's digest, `rangefinder.validation_digest`: the
        parent's row has no Datasets, and its chosen_val_loss compares with another run's only on the same
        validation images. `train_on` ("train" or "train+val", training.spec.TrainOn, also the run's tag
        `rangefinder.train_on`): with "train+val" (the full-data retrain) the validation part is training data, and
        no validation set's digest is set."""
        folder = Path(split_dir)
        files = [p for p in sorted(folder.iterdir()) if p.suffix in (".jsonl", ".json") and p.is_file()] \
            if folder.is_dir() else []
        if not files:
            raise TrackingError(f"{folder} holds no split manifests (*.jsonl, split.json); run `rangefinder split`")
        for p in files:
            self.log_artifact(p, artifact_path)
        digest = folder_digest(folder, "*.jsonl")
        try:
            summary = json.loads((folder / "split.json").read_text())
        except (OSError, ValueError):
            summary = {}
        summary = summary if isinstance(summary, dict) else {}
        root = summary.get("root") or str(folder)
        name = Path(root).name or "dataset"
        datasets = []
        digests = {TAG_DATASET_DIGEST: digest}
        # What this run's data was, beside its digest, in the runs table: how many images the split found, and how
        # many files it left out (data.split.SKIPPED_KINDS: unreadable, no caption, ...), so a week whose
        # folder took a bad file shows it without opening split.json.
        if isinstance(summary.get("images"), int):
            digests[TAG_DATASET_IMAGES] = str(summary["images"])
        if isinstance(summary.get("skipped"), list):
            digests[TAG_SKIPPED_FILES] = str(len(summary["skipped"]))
        for part, context in DATASET_CONTEXTS[train_on].items():
            manifest = folder / f"{part}.jsonl"
            if not manifest.is_file():
                continue
            rows = sum(1 for line in manifest.read_text().splitlines() if line.strip())
            part_digest = folder_digest(folder, manifest.name)
            if context == "validation":
                digests[TAG_VALIDATION_DIGEST] = part_digest
            datasets.append({"name": f"{name}-{part}", "digest": part_digest,
                             "source_type": "local", "source": json.dumps({"uri": redact(root)}),
                             "profile": json.dumps({"num_rows": rows}), "context": context})
        if datasets:
            self._deliver({"kind": "inputs", "run_id": self.run_id, "datasets": datasets})
        for run_id in filter(None, (self.run_id, self.parent_run_id)):
            self._set_tags(run_id, digests)
        self._set_tags(self.run_id, {TAG_TRAIN_ON: train_on})  # the parent's steps train on either
        self.data_tags = {**digests, TAG_TRAIN_ON: train_on}
        return digest

    # --- models
    def log_diffusers_model(self, pipeline_dir: str | os.PathLike, *, source_step: Optional[str] = None,
                            **kwargs: Any):
        """See rangefinder.tracking.registry.log_diffusers_model. `source_step`: the step that trained the weights
        (finetune, retrain_full); its newest run under the same parent becomes the version's source run (this run
        when there is no parent or no such run)."""
        from rangefinder.tracking.registry import log_diffusers_model

        found = None
        if source_step and self.parent_run_id:
            found = latest_step_run(self.client, self.experiment_id, self.parent_run_id, source_step)
            if found is not None:
                kwargs.setdefault("source_run_id", found.info.run_id)
        kwargs.setdefault("registered_model_name", tracking_settings(self.cfg).registered_model_name)
        kwargs["tags"] = {**self.lineage(found), **(kwargs.get("tags") or {})}
        return log_diffusers_model(self, pipeline_dir, **kwargs)

    def lineage(self, source: Any = None) -> dict[str, str]:
        """What made the weights this run registers, as their version's tags (registry's TAG_METHOD and the tags
        beside it): the base model, the revision it resolved to and its family (the config's, which every step of a
        pipeline run shares and a LoRA's pipeline is exported on), the method (the `source` run's param, else the
        config's), and the data: the split's digest (the source run's tag, else the parent run's: a source run of
        earlier code may have none), the parts the weights trained on (the source run's `rangefinder.train_on`:
        train+val for the full-data retrain), and its validation part's digest and image count (the source run's
        MLflow Dataset in context validation, as log_dataset_manifest logged it; a retrain validates nothing), with
        the settings that define what its val_loss measures (registry.validation_settings of the source run's params).
        `source`: the run that trained the weights, as search_runs returns it, or None (a registration by hand):
        then what the config says."""
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        base = common_tags(self.cfg)
        tags = {k: base[k] for k in (TAG_BASE_MODEL, TAG_BASE_MODEL_REVISION, TAG_MODEL_FAMILY) if k in base}
        method = (source.data.params.get("training.method") if source is not None else None) or \
            _get(self.cfg, "training", "method")
        if method:
            tags[TAG_METHOD] = str(method)
        digest = source.data.tags.get(TAG_DATASET_DIGEST) if source is not None else None
        if digest is None and self.parent_run_id:
            digest = _get_run(self.client, self.parent_run_id, "the parent run id").data.tags.get(TAG_DATASET_DIGEST)
        if digest:
            tags[TAG_DATASET_DIGEST] = digest
        train_on = source.data.tags.get(TAG_TRAIN_ON) if source is not None else None
        if train_on:
            tags[TAG_TRAIN_ON] = train_on
        for given in (source.inputs.dataset_inputs if source is not None and source.inputs else []):
            if {t.key: t.value for t in given.tags}.get(MLFLOW_DATASET_CONTEXT) == "validation":
                tags[TAG_VALIDATION_DIGEST] = given.dataset.digest
                with contextlib.suppress(ValueError, TypeError, AttributeError):
                    tags[TAG_VALIDATION_IMAGES] = str(json.loads(given.dataset.profile)["num_rows"])
                # How that val_loss was measured: the source run's settings, as it logged them.
                settings = validation_settings(source.data.params)
                if settings:
                    tags[TAG_VALIDATION_SETTINGS] = settings
        return tags

    @property
    def source_tags(self) -> dict[str, str]:
        """MLflow's source tags of this run (`source_tags`), for what it logs (the model it registers); none for a
        run opened elsewhere without a source."""
        return source_tags(self.source) if self.source else {}

    @property
    def artifact_uri(self) -> str:
        return self.client.get_run(self.run_id).info.artifact_uri

    # --- the end
    def finish(self, status: str = "FINISHED", *, error: Optional[str] = None, wait: bool = True) -> None:
        """Send what waits (buffered metrics, the spool), record `error` and end the run as `status`.

        When records wait (the server stopped answering, here or in a worker process), wait up to
        tracking.server_wait_seconds for it (not with `wait=False`); if it is still away, everything not logged
        stays in the spool and a warning says what and how to log it later. Never raises for a server that is away.
        A child run's end does neither: the step goes on, sends the child's spool with its own when the server
        answers, and its own end waits once and names what is left of all its runs.
        """
        if error:
            self._set_tags(self.run_id, {TAG_ERROR: error})  # redacted and cut as every tag is
        self.metrics.close()
        if self.outbox.holding and self.outbox.leads:
            self.outbox.wait_for_server(tracking_settings(self.cfg).server_wait_seconds if wait else 0.0)
        if self.owned:
            self.outbox.send({"kind": "end", "run_id": self.run_id, "status": status})
        left = [o.spool for o in self.outbox.link.outboxes if o.spool.exists()] if self.outbox.leads else []
        # Credentials the server refused come back by being set again, not by waiting for it.
        when = ("once the server allows the Host header it is reached by (--allowed-hosts)"
                if self.outbox.link.host_refused else CREDENTIALS_AGAIN if self.outbox.link.refused
                else "when the server answers again")
        if len(left) == 1:
            _log.warning("MLflow at %s did not take everything step %s logged: %s of run %s are not in MLflow. "
                         "They are kept in %s; %s, run: rangefinder relog %s",
                         safe_uri(self.tracking_uri), self.step_name, describe(read_spool(left[0].path).counts()),
                         left[0].run_id, left[0].path, when, left[0].path)
        elif left:
            counts = sum((read_spool(spool.path).counts() for spool in left), Counter())
            _log.warning("MLflow at %s did not take everything step %s logged for %d of its runs: %s are not in "
                         "MLflow. They are kept in %s; %s, run: rangefinder relog %s",
                         safe_uri(self.tracking_uri), self.step_name, len(left), describe(counts),
                         left[0].path.parent, when, " ".join(str(spool.path) for spool in left))


CREDENTIALS_AGAIN = ("with MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) set to "
                     "credentials the server takes")


def _flatten_any(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if isinstance(v, Mapping):
            out.update(_flatten_any(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


Sink = TypeVar("Sink")


@contextlib.contextmanager
def child_run(cfg: Optional[TrackingSource], sink: Sink, step_name: str, *, run_name: str, tags: Mapping[str, Any],
              description: str, params: Optional[Mapping[str, Any]] = None) -> Iterator[Union[Sink, StepRun]]:
    """A child run of `sink`'s run for one part of a step (a successive-halving candidate, the fine-tune's cooldown),
    named, tagged and described, its source the step's, when `sink` is a step's MLflow run; otherwise `sink` as it is
    (None, or a bench's own sink). It carries the step run's data tags (StepRun.data_tags): the same images, and a
    search by validation set finds its val_loss curve beside the step's. `params`: what sets it apart from its
    siblings (a candidate's `lr`), named as the step run's own param, so MLflow's compare view lines them up."""
    if not isinstance(sink, StepRun):
        yield sink
        return
    tags = {**sink.data_tags, **tags}
    # The server away: the part goes on in a run made when the server answers (its spool's first record), as every
    # record of the step waits for it. It failed the step, once the fine-tune had trained to the race.
    with contextlib.ExitStack() as stack:
        run: Optional[StepRun] = None
        if not sink.offline and _answers(sink):
            try:
                run = stack.enter_context(step_run(cfg, step_name, parent_run_id=sink.run_id, run_name=run_name,
                                                   tags=tags, source=sink.source, spool_dir=sink.spool.path.parent,
                                                   link=sink.outbox.link))
            except (StoreLocked, CredentialsRefused):
                # A SQLite file another program holds locked, met as the run is made (its check sends no query), or
                # credentials refused since the check: what the step's records wait out, where it failed the step.
                run = None
        if run is None:
            run = stack.enter_context(_pending_child_run(cfg, sink, step_name, run_name=run_name, tags=tags))
        run.describe(description)
        if params:
            run.log_params(params)
        yield run


def _answers(run: StepRun) -> bool:
    """Whether the server of `run` answers now and takes its credentials (one bounded check: tracking/target.py
    HTTP_LIMITS). Credentials it stopped taking while the step trained failed the step as the part opened; its
    records wait for ones it takes, as the step's own do."""
    try:
        check_tracking_server(run.tracking_uri)
    except (ServerAway, CredentialsRefused):
        return False
    return True


def _step_tags(cfg: Optional[TrackingSource], step_name: str, source: str, tags: Mapping[str, Any]) -> dict[str, Any]:
    """The tags every step's run starts with (step_run's, and a child run's made later from its spool)."""
    return {**common_tags(cfg, source=source), TAG_STEP: step_name, **tags}


def _tag_values(tags: Mapping[str, Any]) -> dict[str, str]:
    """`tags` as MLflow takes them (a run's when it is created, a step's later): each value a tag's text, the unset
    ones left out, each key one MLflow keeps (mlflow_key: a user's own step's key over 250 characters failed it)."""
    return {mlflow_key(k): _tag_value(v) for k, v in tags.items() if v is not None}


@contextlib.contextmanager
def _pending_child_run(cfg: Optional[TrackingSource], parent: StepRun, step_name: str, *, run_name: str,
                       tags: Mapping[str, Any]) -> Iterator[StepRun]:
    """A child run of `parent` while the server is away: named by a pending id (tracking.spool.PENDING) until the
    first record of its spool makes it, with the tags step_run gives a run (a retried step then goes on in it)."""
    import uuid

    all_tags = {**_step_tags(cfg, step_name, parent.source or step_source(step_name), tags),
                TAG_PARENT: parent.run_id, TAG_ATTEMPT: 1}
    step = StepRun(client=parent.client, run_id=f"{PENDING}{uuid.uuid4().hex}", experiment_id=parent.experiment_id,
                   step_name=step_name, parent_run_id=parent.run_id, tracking_uri=parent.tracking_uri, cfg=cfg,
                   spool_dir=parent.spool.path.parent, source=parent.source, link=parent.outbox.link)
    step.outbox.send({"kind": "create", "run_id": step.run_id, "experiment_id": parent.experiment_id,
                      "run_name": _run_name(run_name), "run_tags": _tag_values(all_tags)})
    with _ended(step):
        yield step


@contextlib.contextmanager
def step_run(
    cfg: Optional[TrackingSource],
    step_name: str,
    *,
    parent_run_id: Optional[str] = None,
    pipeline_run_name: Optional[str] = None,
    kfp_run_id: Optional[str] = None,
    run_name: Optional[str] = None,
    tags: Optional[Mapping[str, Any]] = None,
    spool_dir: Optional[str | os.PathLike] = None,
    source: Optional[str] = None,
    link: Optional[StepLink] = None,
) -> Iterator[StepRun]:
    """Open a child run for one step; end it FINISHED, or FAILED (KILLED on Ctrl-C) with the error as a tag.

    Under KFP's MLflow integration (`kfp_task_run`), the step's run is the one KFP made for the task, unless
    `parent_run_id` names another parent (a step's own child runs). Otherwise the parent is, in order:
    `parent_run_id`; $MLFLOW_RUN_ID; the pipeline run's parent found or made by
    `ensure_parent_run(name=pipeline_run_name, kfp_run_id=...)` when either is given; else none (a step run from
    the CLI on its own is a top-level run). The tracking server is checked before anything else. If it stops
    answering later, the step goes on; see StepRun.finish. `spool_dir`: where the run's spool goes if needed.
    `source`: the run's MLflow source (`source_tags`), the module that runs the step (default `step_source`).
    `link`: a child run's, the step's link to the server (child_run; tracking/outbox.py StepLink).

    A step whose earlier attempt under the same parent did not finish (a KFP retry, a step run again to resume its
    training) goes on in that attempt's run, so MLflow shows one whole curve; a finished one is left as it is.
    """
    uri = resolve_tracking_uri(cfg)
    # A user the check let in (READ) may still be denied making the run, and a SQLite store another program holds
    # locked lets the check's reads through: each said as what to fix, not a traceback.
    with refusals_named(uri), _lock_named(uri):
        client = tracking_client(cfg)
        source = source or step_source(step_name)
        all_tags = _step_tags(cfg, step_name, source, tags or {})
        kfp_task = kfp_task_run(client)
        if kfp_task is not None and parent_run_id in (None, kfp_task.data.tags[TAG_PARENT]):
            # KFP made this step's run, nested under its pipeline run: log into it; a run of our own would be a third
            # level under KFP's task run.
            run, parent = kfp_task, kfp_task.data.tags[TAG_PARENT]
        else:
            run = None
            parent = parent_run_id or os.environ.get("MLFLOW_RUN_ID") or None
            if parent is None and (pipeline_run_name or kfp_run_id):
                parent = ensure_parent_run(cfg, name=pipeline_run_name, kfp_run_id=kfp_run_id)
        if run is not None:
            exp_id = run.info.experiment_id
        elif parent:
            exp_id = _get_run(client, parent, "the parent run id").info.experiment_id
        else:
            exp_id = default_experiment_id(client, cfg)

        folder = Path(spool_dir) if spool_dir is not None else None
        if parent:
            all_tags[TAG_PARENT] = parent
        if run is not None:  # KFP's task run: KFP ends it, so the step does not
            step = StepRun(client=client, run_id=run.info.run_id, experiment_id=exp_id, step_name=step_name,
                           parent_run_id=parent, tracking_uri=uri, cfg=cfg, spool_dir=folder, owned=False,
                           source=source, link=link)
            step.set_tags(all_tags)
        else:
            earlier = _unfinished_attempt(client, exp_id, parent, step_name) if parent else None
            if earlier is not None:
                step = _continue(client, earlier, cfg, uri, folder, source, link)
            else:
                all_tags[TAG_ATTEMPT] = 1
                run = client.create_run(exp_id, run_name=_run_name(run_name or step_name),
                                        tags=_tag_values(all_tags))
                step = StepRun(client=client, run_id=run.info.run_id, experiment_id=exp_id, step_name=step_name,
                               parent_run_id=parent, tracking_uri=uri, cfg=cfg, spool_dir=folder, source=source,
                               link=link)
    with _ended(step):
        yield step


class StoreLocked(TrackingError):
    """_lock_named's: a SQLite store that cannot run a query (another program holds it locked, its file cannot be
    written), met as a step's run is made."""


@contextlib.contextmanager
def _lock_named(uri: str) -> Iterator[None]:
    """Raise a SQLite store's lock met in the block as the TrackingError that says what to end: another program
    writing to it past MLflow's 20 s (a sqlite3 shell left in a transaction, `mlflow gc`), met while a step makes its
    run (the check before only reads), stopped the step in MLflow's traceback with the query it ran. Once the run is
    open the same lock is an outage its records wait out (tracking/outbox.py)."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as e:
        db = sqlite_path(uri)
        if db is None or not store_error(e):
            raise
        why = away_reason(e)
        if not why.startswith("database is locked"):  # every query SQLite cannot run is the same error code
            raise StoreLocked(f"the MLflow database {db} cannot take the step's run ({why}); make sure this process "
                              "can write it, its folder and the disk they are on, then run the step again") from None
        # `why` names the program (away_reason): said once, where the line said it twice over.
        raise StoreLocked(f"the MLflow database {db}: {why}, for longer than MLflow waits; end that program's "
                          "transaction, then run the step again") from None


@contextlib.contextmanager
def _ended(step: StepRun) -> Iterator[StepRun]:
    """`step` until the block ends, then ended FINISHED, or FAILED (KILLED on Ctrl-C) with the error as a tag."""
    try:
        with on_sigint():  # a Ctrl-C ends the run KILLED, whatever error it surfaced as (a model load's)
            yield step
    except BaseException as e:
        interrupted = isinstance(e, KeyboardInterrupt)
        msg = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        with contextlib.suppress(Exception):  # the step's own error matters more than a lost record of it
            step.finish("KILLED" if interrupted else "FAILED", error=msg, wait=not interrupted)
        raise
    else:
        step.finish("FINISHED")


def _unfinished_attempt(client: Any, exp_id: str, parent: str, step_name: str) -> Any:
    """The newest run of this step under this parent when it did not finish (an earlier attempt that failed, was
    killed, or lost its pod while RUNNING), else None: a KFP retry or a resumed step goes on in that run."""
    run = latest_step_run(client, exp_id, parent, step_name)
    return run if run is not None and run.info.status != "FINISHED" else None


def latest_step_run(client: Any, exp_id: str, parent: str, step_name: str) -> Any:
    """The newest run of step `step_name` under the parent run `parent`, or None."""
    if not SAFE_TAG_VALUE.match(step_name) or not SAFE_TAG_VALUE.match(parent):
        return None
    runs = client.search_runs([exp_id], filter_string=f"tags.`{TAG_PARENT}` = '{parent}' and "
                              f"tags.`{TAG_STEP}` = '{step_name}'", max_results=1,
                              order_by=["attributes.start_time DESC"])
    return runs[0] if runs else None


def _continue(client: Any, earlier: Any, cfg: Optional[TrackingSource], uri: str,
              folder: Optional[Path], source: str, link: Optional[StepLink] = None) -> StepRun:
    """Reopen an earlier attempt's run: RUNNING again, its error tag gone, its attempt counted, and the curve it
    holds kept (what the resumed training logs again up to there is not logged twice)."""
    run_id = earlier.info.run_id
    tags = earlier.data.tags
    attempt = int(tags.get(TAG_ATTEMPT, "1")) + 1 if str(tags.get(TAG_ATTEMPT, "1")).isdigit() else 2
    client.update_run(run_id, status="RUNNING")
    if TAG_ERROR in tags:
        client.delete_tag(run_id, TAG_ERROR)
    client.set_tag(run_id, TAG_ATTEMPT, str(attempt))
    _log.info("MLflow run %s of step %s goes on (attempt %d)", run_id, tags.get(TAG_STEP), attempt)
    return StepRun(client=client, run_id=run_id, experiment_id=earlier.info.experiment_id,
                   step_name=tags[TAG_STEP], parent_run_id=tags.get(TAG_PARENT), tracking_uri=uri, cfg=cfg,
                   spool_dir=folder, logged_through=logged_through(client, run_id), source=source, link=link)


def logged_through(client: Any, run_id: str) -> dict[str, int]:
    """The last step each metric of the run reached."""
    keys = client.get_run(run_id).data.metrics
    return {k: max((m.step for m in client.get_metric_history(run_id, k)), default=-1) for k in keys}


def run_spool(tracking_uri: str, run_id: str, step_name: str, folder: Optional[Path] = None) -> Spool:
    """The spool of a step's run: one file that every process of the step appends to (`<step>-<run id>.jsonl`)."""
    return Spool(spool_dir(folder) / f"{step_name}-{run_id}.jsonl", tracking_uri=tracking_uri, run_id=run_id,
                 step=step_name)


def step_metric_sink(cfg: Optional[TrackingSource], run_id: str, step_name: str) -> BatchedMetricLogger:
    """The engine's MetricSink for a step run that another process opened: rank 0 of a multi-process training run
    logs its curve into the step's run this way (the step's own process opens and ends the run). It sends through an
    outbox on the step run's spool, so an outage is handled as in the step's own process; `close()` it when
    training ends. A child run opened while the server was away (a pending id, made from its spool's first record)
    has no curve yet, and MLflow does not know the id: it is not asked."""
    client = tracking_client(cfg, check=False)
    outbox = Outbox(client, run_spool(resolve_tracking_uri(cfg), run_id, step_name))
    every = tracking_settings(cfg).log_every_updates if cfg is not None else 1
    logged = None
    try:
        run = None if run_id.startswith(PENDING) else client.get_run(run_id)
        # A continued run: its curve holds the first attempt's.
        if run is not None and run.data.tags.get(TAG_ATTEMPT, "1") != "1":
            logged = logged_through(client, run_id)
    except Exception as e:
        if not is_away_error(e):
            raise
    return BatchedMetricLogger(outbox, every_updates=every, logged_through=logged)
