"""Where a training step writes its run, so that a retried pod goes on from the preempted pod's checkpoints.

A KFP output artifact lives on the pod's own disk until the step ends; a pod killed by a preempted node takes its
checkpoints with it. When `$RANGEFINDER_WORK` is set, a training step runs in
`$RANGEFINDER_WORK/<MLflow parent run id>/<step>` instead, resumes from there on a retry (`training.resume`), and
copies the finished run into its artifact at the end; once the whole pipeline run has succeeded, its exit step
(record-status) removes `$RANGEFINDER_WORK/<MLflow parent run id>` (`remove_run_work`), which then only repeats the
artifacts, and keeps it after a failure, for the run's retry. The pipeline sets it to
`<kubernetes.data_mount_path>/work` (`/data/work` by default) on the training steps' pods (and record-status's) when
a data PVC is mounted (`configure_task` in rangefinder/pipelines/pipeline.py); kfp.local runs and the CLI leave it
unset. See docs/design.md, section 4.3.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

from rangefinder.config import expand_home

WORK_ENV = "RANGEFINDER_WORK"


def _work_root() -> Optional[Path]:
    """`$RANGEFINDER_WORK`, its `~` expanded, or None where it is unset."""
    root = os.environ.get(WORK_ENV, "").strip()
    return expand_home(root, f"${WORK_ENV}") if root else None


def work_dir(artifact_dir: Path, key: Optional[str]) -> Path:
    """The folder to train in: `$RANGEFINDER_WORK/<key>` when both are set, else the artifact folder itself."""
    root = _work_root()
    if root is None or not key:
        return Path(artifact_dir)
    return root / key


def publish(work: Path, artifact_dir: Path) -> None:
    """Copy a finished run from the work folder into the artifact folder (nothing to do when they are one)."""
    work, artifact_dir = Path(work), Path(artifact_dir)
    if work.resolve() == artifact_dir.resolve():
        return
    shutil.copytree(work, artifact_dir, dirs_exist_ok=True)


def remove_run_work(parent_run_id: str) -> Optional[Path]:
    """Remove a succeeded pipeline run's work folder, `$RANGEFINDER_WORK/<parent_run_id>` (every training step's
    run, copied into its artifact by `publish`): kept, each scheduled run's checkpoints and weights stayed on the data
    volume until it was full. The folder removed, or None where there is none (no $RANGEFINDER_WORK: kfp.local, the
    CLI). The spools beside it ($RANGEFINDER_WORK/mlflow-spool) stay."""
    root = _work_root()
    if root is None or not re.fullmatch(r"[0-9A-Za-z_-]+", parent_run_id or ""):  # an MLflow run id; never a path
        return None
    folder = root / parent_run_id
    if not folder.is_dir():
        return None
    shutil.rmtree(folder, ignore_errors=True)
    return folder
