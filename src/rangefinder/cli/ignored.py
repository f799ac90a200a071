"""The settings of a config file that a command does not use, said in one line instead of dropped without a word.

One config file serves every command (`train`, `run --local`, `compile`, `submit`, `schedule`), and each command
uses part of it: `train` trains one run on a split that exists already, so the pipeline's sections mean nothing to
it; the pipeline sets each run's budget, LR, schedule and process count itself (training/spec.py: `TrainSpec.ramp`,
`.finetune`, `.retrain`), so the same `training:` fields mean nothing to it; a local run has no pods. A setting
counts as given when the file sets it to something other than its default: a default changes nothing whichever
command reads it, and a config written out whole (`model_dump`) sets every field.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from rangefinder.config import RangefinderConfig, given_settings
from rangefinder.formats.text import warn


@dataclass(frozen=True)
class Unused:
    """Settings a command does not use (dotted names; a section's name covers all of it), and why, in its words
    (no parentheses: the warning puts it in some)."""

    settings: tuple[str, ...]
    why: str


# Read only with distributed.num_nodes > 1 (a Kubeflow Trainer TrainJob per training step).
MULTI_NODE = Unused(("distributed.runtime", "distributed.namespace", "distributed.timeout_hours",
                     "distributed.poll_seconds"), "they apply with distributed.num_nodes > 1")

# What a run's base model resolved to (the pipeline's first step sets them): a config copied from an earlier run, its
# config.yaml, holds that run's. Every command that starts a run resolves model.base_model afresh
# (RangefinderConfig.unresolved).
RESOLVED = Unused(("model.resolved_dir", "model.resolved_revision"),
                  "each run resolves model.base_model afresh, and these are what an earlier run resolved it to; "
                  "pin a hub model's commit with model.revision")

# What the pipeline's three training runs set themselves, whatever `training:` says.
PIPELINE = (
    Unused(("training.epochs", "training.steps", "training.steps_unit"),
           "the pipeline's runs train for lr_range_test.epochs, finetune.epochs and retrain.epochs"),
    Unused(("training.lr", "training.scale_lr", "training.schedule", "training.lr_min", "training.lr_max",
            "training.warmup_updates", "training.decay_fraction"),
           "the pipeline's LR comes from its range test or the top-level lr, its schedules from finetune.schedule "
           "and retrain.schedule; these apply to `rangefinder train`"),
    Unused(("training.world_size",),
           "the pipeline counts the processes: training.processes_per_node x distributed.num_nodes"),
    Unused(("training.resume",), "a retried training step always resumes from its newest checkpoint"),
    RESOLVED,
    MULTI_NODE,
)

# What `run --local` (and `demo`) cannot use on top of that: kfp.local runs no pods.
LOCAL = (Unused(("kubernetes",), "pod settings: they apply to `compile`, `submit` and `schedule`"),)

TRAIN = (
    Unused(("split", "data.dataset_dir", "data.min_image_size", "data.min_images"),
           "the split in --data is made already; `rangefinder split` takes them as flags"),
    Unused(("lr", "lr_finder", "lr_range_test", "finetune", "retrain"),
           "they apply to the pipeline: `run`, `compile`, `submit`, `schedule`; `train` trains at training.lr for "
           "training.epochs or training.steps"),
    Unused(("tracking",), "`rangefinder train` logs to no MLflow server; its curve is OUT/metrics.csv"),
    Unused(("training.resume",), "`rangefinder train` resumes with --resume only, which checks the output folder "
                                 "holds a run to resume"),
    Unused(("kubernetes",), "pod settings of the pipeline: `compile`, `submit`, `schedule`"),
    RESOLVED,
    MULTI_NODE,
)


def unused_settings(cfg: RangefinderConfig, rules: Sequence[Unused]) -> list[tuple[list[str], str]]:
    """(the given settings a rule covers, its why), for each rule that covers any."""
    given = given_settings(cfg)
    found = []
    for rule in rules:
        names = [g for g in given if any(g == s or g.startswith(s + ".") for s in rule.settings)]
        if names:
            found.append((names, rule.why))
    return found


def ignored_by_pipeline(cfg: RangefinderConfig, *, local: bool) -> list[tuple[list[str], str]]:
    rules = PIPELINE + LOCAL if local else PIPELINE
    return unused_settings(cfg, rules if cfg.distributed.num_nodes == 1 else tuple(r for r in rules
                                                                                    if r is not MULTI_NODE))


def ignored_by_submit(cfg: RangefinderConfig, dataset_uri: str) -> list[tuple[list[str], str]]:
    """The pipeline's, and data.dataset_dir when --dataset-uri is given: the pipeline imports the URI instead."""
    ignored = ignored_by_pipeline(cfg, local=False)
    if dataset_uri and cfg.data.dataset_dir is not None:
        ignored.append((["data.dataset_dir"], "--dataset-uri is imported instead"))
    return ignored


def ignored_by_train(cfg: RangefinderConfig) -> list[tuple[list[str], str]]:
    return unused_settings(cfg, TRAIN)


def off_the_data_volume(cfg: RangefinderConfig, dataset_uri: str = "") -> list[str]:
    """A warning's line for each path of the config that a cluster's pods cannot read: not under
    kubernetes.data_mount_path, the one volume they mount (a relative one, read from a pod's own working folder,
    too). Compiled and submitted with a path of the machine it was written on, the run failed in its first steps on
    the cluster. A base model's value counts only where it reads as a path (a hub id does not). None without a data
    volume (kubernetes.data_pvc null): the paths are then the image's own."""
    if not cfg.kubernetes.data_pvc:
        return []
    mount = PurePosixPath(cfg.kubernetes.data_mount_path)
    base = cfg.model.base_model
    paths = {
        "data.dataset_dir": None if dataset_uri else cfg.data.dataset_dir,
        "split.val_dir": cfg.split.val_dir,
        "model.base_model": base if base and base.startswith(("/", "./", "../", "~")) else None,
        "model.single_file_config": cfg.model.single_file_config,
    }
    lines = []
    for name, value in paths.items():
        if value is None:
            continue
        path = PurePosixPath(posixpath.normpath(value))
        if path == mount or mount in path.parents:
            continue
        where = "is a relative path, read from a pod's own working folder" if not path.is_absolute() else (
            f"is not under kubernetes.data_mount_path ({mount})")
        also = " (or import it: `rangefinder submit --dataset-uri`)" if name == "data.dataset_dir" else ""
        lines.append(f"{name} {value} {where}, and the pipeline's pods mount only the data volume "
                     f"({cfg.kubernetes.data_pvc}) at {mount}: unless the step images hold it, the run will not find "
                     f"it there; copy it onto the volume and give its path under {mount}{also}")
    return lines


def tracking_off_the_cluster(cfg: RangefinderConfig) -> list[str]:
    """A warning's line where tracking.tracking_uri names a store the pipeline's pods cannot share: the setting
    travels in base_config and wins over the MLFLOW_TRACKING_URI the pods are given (kubernetes.mlflow_tracking_uri or
    the MLflow Secret), so a laptop's `sqlite:///mlflow.db` or `http://localhost:5000` compiled into a package had each
    step log to a file in its own pod, lost with it, or wait for a server on the pod's own loopback, and the model was
    registered nowhere anyone could read. A SQLite file on the data volume is shared by the pods, and passes."""
    import ipaddress
    from urllib.parse import urlsplit

    uri = (cfg.tracking.tracking_uri or "").strip()
    if not uri or uri == "databricks":  # MLflow's name of the Databricks workspace the profile says, not a path
        return []
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    why = None
    if scheme in ("", "file", "sqlite"):
        path = parts.path if scheme == "file" or not scheme else uri.split("://", 1)[-1].split("?", 1)[0][1:]
        mount = PurePosixPath(cfg.kubernetes.data_mount_path)
        posix = PurePosixPath(posixpath.normpath(path or "."))
        if not (cfg.kubernetes.data_pvc and posix.is_absolute() and mount in posix.parents):
            why = ("names a store in each pod's own files, lost when the pod ends" if not cfg.kubernetes.data_pvc else
                   f"names a store outside the data volume ({mount}), in each pod's own files, lost when the pod ends")
    else:
        host = (parts.hostname or "").lower()
        try:
            loopback = host == "localhost" or host.endswith(".localhost") or ipaddress.ip_address(host).is_loopback \
                or ipaddress.ip_address(host).is_unspecified
        except ValueError:
            loopback = False
        if loopback:
            why = f"names {host}, which in a pod is the pod itself, where no MLflow server listens"
    if why is None:
        return []
    return [f"tracking.tracking_uri {uri} {why}: in the pipeline's pods it replaces kubernetes.mlflow_tracking_uri "
            f"({cfg.kubernetes.mlflow_tracking_uri}) and the MLflow Secret's, so each step's records and the "
            "registered model would not reach the cluster's MLflow; leave tracking.tracking_uri out of the cluster's "
            "config"]


def warn_ignored(command: str, ignored: list[tuple[list[str], str]]) -> None:
    """One line on stderr, as every warning: `rangefinder: warning: ignored by `rangefinder run`: training.lr, ...
    (why); ...`."""
    if ignored:
        said = "; ".join(f"{', '.join(names)} ({why})" for names, why in ignored)
        warn([f"ignored by `rangefinder {command}`: {said}"])


def warn_conflicts(cfg: RangefinderConfig) -> None:
    """config.setting_conflicts' lines as warnings, told the base model's family where it can be read without
    fetching or converting anything (a hub id not in the cache yet: not), of model.base_model as the run will
    resolve it."""
    from rangefinder.config import setting_conflicts
    from rangefinder.training.family_detection import family_of

    cfg = cfg.unresolved()  # the model the run will resolve, not an earlier run's (a copied config.yaml holds its)
    warn(setting_conflicts(cfg, family_of(cfg.model)))
