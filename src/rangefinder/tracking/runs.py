"""The run tree: one parent run per pipeline run, one child run per step, and what a step logs into its run.

Each KFP step is its own process (often its own pod), so nothing is shared in memory: a step finds its parent by id.
`ensure_parent_run` is idempotent: it looks the parent up by the tag `rangefinder.pipeline_run` (the KFP run id, or
the pipeline run's name) and creates it only when missing, so any step, in any order, gets the same parent. When
KFP's MLflow plugin has made a run for us ($MLFLOW_RUN_ID), that run is the parent.

Everything here goes through `MlflowClient` with explicit run ids, never mlflow's global "active run", because the
fluent API would silently resume $MLFLOW_RUN_ID instead of opening a child.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import numbers as numbers_abc
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rangefinder.errors import TrackingError
from rangefinder.tracking.metrics import BatchedMetricLogger, metric_name
from rangefinder.tracking.redaction import REDACTED, is_secret_key, redact, safe_uri
from rangefinder.tracking.target import (
    TrackingSource,
    default_experiment_id,
    ensure_tracking_server,
    resolve_experiment_name,
    resolve_tracking_uri,
    tracking_settings,
)

_log = logging.getLogger(__name__)

# Tags (mlflow.* are MLflow's own, shown in its UI).
TAG_PARENT = "mlflow.parentRunId"
TAG_PIPELINE_RUN = "rangefinder.pipeline_run"  # the key a parent is found by
TAG_STEP = "rangefinder.step"
TAG_CREATED_BY = "rangefinder.created_by"
TAG_ERROR = "rangefinder.error"
MAX_PARAM_CHARS = 500  # MLflow takes 6000; longer values (prompt lists) are unreadable in its table anyway
MAX_TAG_CHARS = 5000
_SAFE_TAG_VALUE = re.compile(r"^[\w.:/@+ -]{1,200}$")


# ---------------------------------------------------------------------------------------------------------------
# Client and the facts every run is tagged with


def tracking_client(cfg: Optional[TrackingSource] = None, *, check: bool = True):
    """An MlflowClient for the resolved tracking URI, after the fail-fast check (see target.py)."""
    import mlflow
    from mlflow import MlflowClient

    uri = resolve_tracking_uri(cfg)
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


def common_tags(cfg: Optional[TrackingSource] = None) -> dict[str, str]:
    """Pipeline version, git revision, image and base model: the facts that make a run reproducible."""
    from rangefinder import __version__

    tags = {"rangefinder.version": __version__, "mlflow.source.name": "rangefinder", "mlflow.source.type": "JOB"}
    rev = git_revision()
    if rev:
        tags["mlflow.source.git.commit"] = rev  # MLflow's UI links this
    image = os.environ.get("RANGEFINDER_IMAGE") or _get(cfg, "kubernetes", "image")
    if image:
        tags["rangefinder.image"] = image
    model = _get(cfg, "model", "base_model")
    if cfg is not None and hasattr(cfg, "model"):
        tags["rangefinder.base_model"] = model or "embedded-tiny"
    return tags


def _get(cfg: Optional[TrackingSource], section: str, name: str) -> Any:
    return getattr(getattr(cfg, section, None), name, None)


def folder_digest(folder: str | os.PathLike, pattern: str = "*") -> str:
    """A short sha256 over the relative paths and bytes of the files under `folder` (the dataset digest tag)."""
    root = Path(folder)
    h = hashlib.sha256()
    for p in sorted(x for x in root.rglob(pattern) if x.is_file()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------------
# Params: flat, truncated, secret-free


def flatten_params(obj: Any, prefix: str = "") -> dict[str, str]:
    """Nested settings as flat `section.field` -> string params. Secret-named keys are dropped to ***."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(mode="json")
    out: dict[str, str] = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            key = f"{prefix}{k}"
            if is_secret_key(str(k)):
                out[key] = REDACTED
            elif isinstance(v, Mapping) or hasattr(v, "model_dump"):
                out.update(flatten_params(v, key + "."))
            else:
                out[key] = _param_value(v)
    else:
        out[prefix.rstrip(".") or "value"] = _param_value(obj)
    return out


def _param_value(v: Any) -> str:
    if isinstance(v, (list, tuple, dict)):
        s = json.dumps(v, default=str, separators=(",", ":"))
    elif isinstance(v, float):
        s = repr(v)
    else:
        s = str(v)
    s = redact(s)
    if len(s) > MAX_PARAM_CHARS:
        s = s[: MAX_PARAM_CHARS - 20] + f"...(+{len(s) - MAX_PARAM_CHARS + 20} chars)"
    return s


def _tag_value(v: Any) -> str:
    if isinstance(v, bool):
        s = "true" if v else "false"
    elif isinstance(v, (list, tuple)):
        s = ",".join(str(x) for x in v)
    elif isinstance(v, dict):
        s = json.dumps(v, default=str, sort_keys=True)
    else:
        s = str(v)
    return redact(s)[:MAX_TAG_CHARS]


def _batched_params(client: Any, run_id: str, params: Mapping[str, str]) -> None:
    """Log params 100 at a time; skip those already logged with the same value (a resumed run)."""
    from mlflow.entities import Param

    existing = client.get_run(run_id).data.params
    new = []
    for k, v in params.items():
        if k in existing:
            if existing[k] != v:
                _log.warning("param %s already logged as %r; keeping it (MLflow params cannot change), not %r",
                             k, existing[k], v)
            continue
        new.append(Param(k, v))
    for i in range(0, len(new), 100):
        client.log_batch(run_id, params=new[i: i + 100], synchronous=True)


def _batched_tags(client: Any, run_id: str, tags: Mapping[str, Any]) -> None:
    from mlflow.entities import RunTag

    items = [RunTag(k, _tag_value(v)) for k, v in tags.items() if v is not None]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, tags=items[i: i + 100], synchronous=True)


# ---------------------------------------------------------------------------------------------------------------
# The parent run of a pipeline run


def _pipeline_key(kfp_run_id: Optional[str], name: Optional[str]) -> str:
    key = kfp_run_id or name
    if not key:
        raise TrackingError("a pipeline run needs a name or a KFP run id to be found by its steps; pass name=...")
    # The key goes into a search filter; anything outside a safe alphabet is replaced by its digest.
    return key if _SAFE_TAG_VALUE.match(key) else "sha1:" + hashlib.sha1(key.encode()).hexdigest()


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

    $MLFLOW_RUN_ID (set by KFP's MLflow plugin) wins: that run is the parent. Otherwise the parent is found by
    `kfp_run_id` (or `name`; $KFP_RUN_ID / $KFP_RUN_NAME fill them in when not given) and made when missing:
    named `name`, tagged with the KFP run, pipeline version, git revision, image, base model and `tags` (e.g.
    `{"rangefinder.dataset_digest": ...}`), with `cfg`'s settings as params when it is a whole RangefinderConfig.
    """
    client = tracking_client(cfg)
    env_run = os.environ.get("MLFLOW_RUN_ID")
    if env_run:
        _get_run(client, env_run, "$MLFLOW_RUN_ID")
        return env_run

    kfp_run_id = kfp_run_id or os.environ.get("KFP_RUN_ID") or None
    kfp_run_name = kfp_run_name or os.environ.get("KFP_RUN_NAME") or None
    name = name or kfp_run_name or kfp_run_id
    key = _pipeline_key(kfp_run_id, name)
    exp_id = default_experiment_id(client, cfg)
    found = _find_parent(client, exp_id, key)
    if found:
        return found

    all_tags: dict[str, Any] = {**common_tags(cfg), TAG_PIPELINE_RUN: key, TAG_CREATED_BY: "rangefinder"}
    if kfp_run_id:
        all_tags["kfp.run_id"] = kfp_run_id
    if kfp_run_name:
        all_tags["kfp.run_name"] = kfp_run_name
    all_tags.update(tags or {})
    run = client.create_run(exp_id, run_name=redact(name), tags={k: _tag_value(v) for k, v in all_tags.items()
                                                                 if v is not None})
    run_id = run.info.run_id
    # Two steps racing to create the parent: the earliest one wins, the loser's run is deleted.
    first = _find_parent(client, exp_id, key)
    if first and first != run_id:
        client.delete_run(run_id)
        return first
    if log_config and cfg is not None and hasattr(cfg, "tracking"):
        _batched_params(client, run_id, flatten_params(cfg))
    _log.info("MLflow parent run %s (%s) in %s", run_id, name, safe_uri(resolve_tracking_uri(cfg)))
    return run_id


def _find_parent(client: Any, exp_id: str, key: str) -> Optional[str]:
    runs = client.search_runs(
        [exp_id],
        filter_string=f"tags.`{TAG_PIPELINE_RUN}` = '{key}'",
        max_results=1,
        order_by=["attributes.start_time ASC"],
    )
    return runs[0].info.run_id if runs else None


def _get_run(client: Any, run_id: str, what: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as e:
        raise TrackingError(
            f"{what} names MLflow run {run_id}, which {safe_uri(client.tracking_uri)} does not have "
            f"({redact(e.message).splitlines()[0][:200]}); pass the id the first step returned, or unset it"
        ) from None


def finish_pipeline_run(cfg: Optional[TrackingSource], run_id: str, *, status: str = "FINISHED") -> None:
    """Mark the parent run ended (FINISHED, FAILED or KILLED), unless KFP's plugin owns it (it ends it itself)."""
    client = tracking_client(cfg)
    run = _get_run(client, run_id, "finish_pipeline_run")
    if run.data.tags.get(TAG_CREATED_BY) == "rangefinder":
        _end_run(client, run_id, status)


def _end_run(client: Any, run_id: str, status: str) -> None:
    # mlflow prints the run's URL on stdout, where it would break a command's --json output; stderr still shows it.
    with contextlib.redirect_stdout(sys.stderr):
        client.set_terminated(run_id, status=status)


# ---------------------------------------------------------------------------------------------------------------
# A step's run


@dataclass
class StepRun:
    """An open child run of one step. Use it inside `with step_run(...) as run:`."""

    client: Any
    run_id: str
    experiment_id: str
    step_name: str
    parent_run_id: Optional[str]
    tracking_uri: str
    cfg: Optional[TrackingSource] = None
    metrics: BatchedMetricLogger = field(init=False)

    def __post_init__(self) -> None:
        every = tracking_settings(self.cfg).log_every_updates if self.cfg is not None else 1
        self.metrics = BatchedMetricLogger(self.client, self.run_id, every_updates=every)

    # --- the engine's MetricSink: the run itself can be passed as the sink
    def log_metrics(self, metrics: Mapping[str, Optional[float]], step: int) -> None:
        """Buffered; the update number is the MLflow step."""
        self.metrics.log_metrics(metrics, step)

    # --- settings
    def log_config(
        self, cfg: Optional[TrackingSource] = None, *, plan: Any = None, extra: Optional[Mapping[str, Any]] = None
    ) -> None:
        """All resolved settings as flat params (`training.batch_size`, ...), the planner's figures as `plan.*`.

        `plan` is a rangefinder.config.Plan (effective_batch, updates_per_epoch, lr = the scaled LR, ...);
        `extra` holds any other figures a step worked out (logged under their own names).
        """
        params: dict[str, str] = {}
        cfg = cfg if cfg is not None else self.cfg
        if cfg is not None:
            params.update(flatten_params(cfg))
        if plan is not None:
            params.update(flatten_params(plan, "plan."))
        if extra:
            params.update(flatten_params(dict(extra)))
        _batched_params(self.client, self.run_id, params)

    def log_params(self, params: Mapping[str, Any]) -> None:
        _batched_params(self.client, self.run_id, flatten_params(dict(params)))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        _batched_tags(self.client, self.run_id, {k: v for k, v in tags.items() if not is_secret_key(k)})

    # --- decisions
    def log_decisions(
        self, decisions: Mapping[str, Any], *, prefix: str = "", to_parent: bool = True, step: Optional[int] = None
    ) -> None:
        """Numbers become metrics (lr_low, lr_high, lr_mid, quality, recommended_epochs, ...); strings, booleans and
        lists become tags (status, flags, ...). Nested mappings are flattened with dots; None is skipped.

        With `to_parent`, the parent run gets the numbers under the same names (one row per pipeline run in
        MLflow's table) and the tags prefixed by the step name (`analyze_lr.status`), since every step has a status.
        """
        from mlflow.entities import Metric

        numbers: dict[str, float] = {}
        words: dict[str, Any] = {}
        for k, v in _flatten_any(decisions, prefix).items():
            if hasattr(v, "item") and getattr(v, "ndim", None) == 0:
                v = v.item()  # numpy scalars as the Python number or bool they are
            if v is None:
                continue
            if isinstance(v, numbers_abc.Real) and not isinstance(v, bool):
                numbers[k] = float(v)
            else:
                words[k] = v
        ts = int(time.time() * 1000)
        metrics = [Metric(metric_name(k), v, ts, step or 0) for k, v in numbers.items()]
        targets = [(self.run_id, words)]
        if to_parent and self.parent_run_id:
            targets.append((self.parent_run_id, {f"{self.step_name}.{k}": v for k, v in words.items()}))
        for run_id, tags in targets:
            for i in range(0, len(metrics), 1000):
                self.client.log_batch(run_id, metrics=metrics[i: i + 1000], synchronous=True)
            _batched_tags(self.client, run_id, tags)

    # --- artifacts
    def log_artifact(self, path: str | os.PathLike, artifact_path: Optional[str] = None) -> None:
        """A file, or a folder's contents, under `artifact_path` (plots, reports, curve CSVs, manifests)."""
        p = Path(path)
        if p.is_dir():
            self.client.log_artifacts(self.run_id, str(p), artifact_path)
        elif p.is_file():
            self.client.log_artifact(self.run_id, str(p), artifact_path)
        else:
            raise TrackingError(f"cannot log {p} to MLflow: no such file or folder")

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_image(self, image: Any, artifact_file: Optional[str] = None, *, key: Optional[str] = None,
                  step: Optional[int] = None) -> None:
        """A PIL image, (H, W[, C]) array or image file: as one file (`artifact_file`), or as a step of the image
        series `key` (shown in MLflow's UI with a step slider, e.g. the sample grid)."""
        if (artifact_file is None) == (key is None):
            raise ValueError("give either artifact_file or key")
        if isinstance(image, (str, os.PathLike)):
            from PIL import Image

            with Image.open(image) as im:
                image = im.convert("RGB")
        if key is not None:
            self.client.log_image(self.run_id, image, key=key, step=step or 0, synchronous=True)
        else:
            self.client.log_image(self.run_id, image, artifact_file=artifact_file)

    def log_dataset_manifest(self, split_dir: str | os.PathLike, artifact_path: str = "dataset") -> str:
        """The split folder's manifests (train/val/stabilize.jsonl, split.json) as artifacts, and each part as an
        MLflow dataset input (the run's "Datasets" column: name, digest, row count, context). Returns the digest of
        the whole split, also set as the tag `rangefinder.dataset_digest` here and on the parent run."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        folder = Path(split_dir)
        files = [p for p in sorted(folder.iterdir()) if p.suffix in (".jsonl", ".json") and p.is_file()] \
            if folder.is_dir() else []
        if not files:
            raise TrackingError(f"{folder} holds no split manifests (*.jsonl, split.json); run `rangefinder split`")
        for p in files:
            self.client.log_artifact(self.run_id, str(p), artifact_path)
        digest = folder_digest(folder, "*.jsonl")
        try:
            root = json.loads((folder / "split.json").read_text()).get("root") or str(folder)
        except (OSError, ValueError):
            root = str(folder)
        name = Path(root).name or "dataset"
        inputs = []
        for part, context in (("train", "training"), ("val", "validation"), ("stabilize", "stabilize")):
            manifest = folder / f"{part}.jsonl"
            if not manifest.is_file():
                continue
            rows = sum(1 for line in manifest.read_text().splitlines() if line.strip())
            ds = Dataset(name=f"{name}-{part}", digest=folder_digest(folder, manifest.name), source_type="local",
                         source=json.dumps({"uri": redact(root)}), profile=json.dumps({"num_rows": rows}))
            inputs.append(DatasetInput(ds, tags=[InputTag("mlflow.data.context", context)]))
        if inputs:
            self.client.log_inputs(self.run_id, datasets=inputs)
        for run_id in filter(None, (self.run_id, self.parent_run_id)):
            _batched_tags(self.client, run_id, {"rangefinder.dataset_digest": digest})
        return digest

    # --- models
    def log_diffusers_model(self, pipeline_dir: str | os.PathLike, **kwargs: Any):
        """See rangefinder.tracking.registry.log_diffusers_model."""
        from rangefinder.tracking.registry import log_diffusers_model

        kwargs.setdefault("registered_model_name", tracking_settings(self.cfg).registered_model_name)
        return log_diffusers_model(self, pipeline_dir, **kwargs)

    @property
    def artifact_uri(self) -> str:
        return self.client.get_run(self.run_id).info.artifact_uri


def _flatten_any(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if isinstance(v, Mapping):
            out.update(_flatten_any(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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
) -> Iterator[StepRun]:
    """Open a child run for one step; end it FINISHED, or FAILED (KILLED on Ctrl-C) with the error as a tag.

    The parent is, in order: `parent_run_id`; $MLFLOW_RUN_ID; the pipeline run's parent found or made by
    `ensure_parent_run(name=pipeline_run_name, kfp_run_id=...)` when either is given; else none (a step run from
    the CLI on its own is a top-level run). The tracking server is checked before anything else.
    """
    client = tracking_client(cfg)
    parent = parent_run_id or os.environ.get("MLFLOW_RUN_ID") or None
    if parent is None and (pipeline_run_name or kfp_run_id):
        parent = ensure_parent_run(cfg, name=pipeline_run_name, kfp_run_id=kfp_run_id)
    if parent:
        exp_id = _get_run(client, parent, "the parent run id").info.experiment_id
    else:
        exp_id = default_experiment_id(client, cfg)

    all_tags: dict[str, Any] = {**common_tags(cfg), TAG_STEP: step_name, **(tags or {})}
    if parent:
        all_tags[TAG_PARENT] = parent
    run = client.create_run(exp_id, run_name=run_name or step_name,
                            tags={k: _tag_value(v) for k, v in all_tags.items() if v is not None})
    step = StepRun(client=client, run_id=run.info.run_id, experiment_id=exp_id, step_name=step_name,
                   parent_run_id=parent, tracking_uri=resolve_tracking_uri(cfg), cfg=cfg)
    try:
        yield step
    except BaseException as e:
        status = "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED"
        with contextlib.suppress(Exception):  # the step's own error matters more than a lost record of it
            step.metrics.close()
        with contextlib.suppress(Exception):
            msg = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
            client.set_tag(step.run_id, TAG_ERROR, redact(msg)[:MAX_TAG_CHARS])
            _end_run(client, step.run_id, status)
        raise
    else:
        try:
            step.metrics.close()
        except TrackingError:
            with contextlib.suppress(Exception):
                _end_run(client, step.run_id, "FAILED")
            raise
        _end_run(client, step.run_id, "FINISHED")
