"""What the KFP components' bodies share (their errors in one line, their metrics), in a module of its own: a body
imports it in the step's process, where importing rangefinder.pipelines.kfp_components would build every component
again (~0.2 s a step)."""

from __future__ import annotations

import contextlib
import errno
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from safetensors import SafetensorError

from rangefinder.errors import RangefinderError, one_line_errors
from rangefinder.formats.atomic import refused_file
from rangefinder.formats.text import warn
from rangefinder.training.disk import AGAIN_ENV, ELSEWHERE_ENV, disk_problem, write_errno

if TYPE_CHECKING:
    from kfp.dsl import Artifact, Metrics


# What only a write raises: said as a refused write wherever it was (write() names no file). Permission denied or a
# file in the way only where the path is under the task's folder: reading an input raises those too.
ONLY_WRITES = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, -1)  # -1: torch.save's failed write

# What a failed write says to do in a step outside a local run (a pod): it has no --out to choose and no --resume to
# pass, which a command's words (training.disk) offer; a retried run's training steps go on from their newest
# checkpoint (the README on retries). A local run sets its own words (local_run.local_step_env), which stand.
CLUSTER_WORDS = {ELSEWHERE_ENV: "or give the step a larger volume",
                 AGAIN_ENV: "then retry the run (its training steps go on from their newest checkpoint)"}
# The same in a user's own kfp.local run of the components (an artifact's uri a local path, as a cluster's never is:
# gs://, s3://, minio://): there is no volume to grow, and kfp.local runs a pipeline over in a new run folder.
KFP_LOCAL_WORDS = {ELSEWHERE_ENV: "or give kfp.local.init() another pipeline_root",
                   AGAIN_ENV: "then run the pipeline again (kfp.local starts it over, in a new run folder)"}


@contextlib.contextmanager
def _cluster_words(output: Artifact) -> Iterator[None]:
    """CLUSTER_WORDS (KFP_LOCAL_WORDS where `output`, one of the step's output artifacts, is in a local folder) in
    the environment while inside, where no local run has set its own: the environment, so that the processes the step
    launches (torchrun's ranks) say them too; as it was again after, for a caller that goes on (a test, a user's own
    Python calling a component's function)."""
    words = CLUSTER_WORDS if "://" in output.uri else KFP_LOCAL_WORDS
    added = {} if AGAIN_ENV in os.environ else {k: v for k, v in words.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@contextlib.contextmanager
def step_errors(step: str, output: Artifact) -> Iterator[None]:
    """A component's step, its errors in one line (rangefinder.errors.one_line_errors), and a write the file system
    refused (a full disk, a quota, a read-only volume) said as the training steps' own writes say it
    (training.disk.disk_problem, under the task's folder, where `output`, one of its output artifacts, lies: the
    free space, the fix, and what to do then: in a local run the command to run again, elsewhere CLUSTER_WORDS or
    KFP_LOCAL_WORDS).
    Outside the engine such a write reached the log as an OSError's traceback, which a local run quoted as "OSError:
    [Errno 28] No space left on device", naming neither the disk nor what to do."""
    folder = Path(output.path).parent
    with one_line_errors(step), _cluster_words(output):
        try:
            yield
        except (OSError, SafetensorError, RuntimeError) as e:
            named = refused_file(e)
            path = Path(named).absolute() if named is not None else None
            if not (path is not None and _under(path, folder)) and write_errno(e) not in ONLY_WRITES:
                raise
            problem = step_write_problem(step, folder, path, e)
            if problem is None:
                raise
            raise problem from None


def step_write_problem(step: str, folder: Path, path: Optional[Path], e: BaseException, *,
                       again: Optional[str] = None) -> Optional[RangefinderError]:
    """disk_problem for a write of step `step` the file system refused, to `path`: said as the step's outputs where it
    lies under the task's `folder` or names no file (write() names none: the task's own outputs are what it writes),
    else as that file where it was (a cache, a converted model). `again`: disk_problem's."""
    if path is None or _under(path, folder):
        return disk_problem(f"the {step} step's outputs", folder, e, again=again)
    return disk_problem(f"the {step} step's file {path.name}", path.parent, e, again=again)


def _under(path: Path, folder: Path) -> bool:
    return path.absolute().is_relative_to(folder.absolute())


def log_step_metrics(metrics: Metrics, values: Mapping[str, float]) -> None:
    """A step's numbers into its KFP Metrics artifact, the finite ones: KFP writes the artifact's metadata into the
    executor output with Python's json (kfp.dsl.executor), which spells NaN and inf `NaN` and `Infinity`, no JSON
    that a cluster's launcher, MLMD or the UI's metrics table reads. One left out is named in a warning; the step's
    MLflow run and report hold the curve it came from."""
    left_out = {name: value for name, value in values.items() if not math.isfinite(value)}
    for name, value in values.items():
        if name not in left_out:
            metrics.log_metric(name, float(value))
    if left_out:
        named = ", ".join(f"{name} ({value})" for name, value in left_out.items())
        warn([f"{named} left out of the step's KFP metrics: not a finite number (KFP's metrics are JSON); the step's "
              "MLflow run and report show where it came from"])
