"""The run's writes under its output folder, and the one rule for a write that failed.

A failed write is one sentence: what, where, why in the file system's own terms, the free space there, and what to
do. `disk_problem` is that rule, the same for a checkpoint (checkpointing.save_checkpoint) and for the run's other
outputs (`outputs_written`: the curve CSVs, final/, run_summary.json). It knows the errnos a storage problem raises;
any other error is not a storage problem and is not dressed as one (it goes on up as it is).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from safetensors import SafetensorError

from rangefinder.errors import RangefinderError
from rangefinder.formats import checkpoints
from rangefinder.formats.atomic import REFUSED_WRITES, failed_copy, free_space, refused_file

_ELSEWHERE = "or choose another --out"

# Set by a local pipeline run for its steps (pipelines/local_run.py): what to do once space is freed, where `--resume`
# is no way on: `run --local` and `demo` take no --resume, and the same command again starts the pipeline over.
AGAIN_ENV = "RANGEFINDER_AGAIN"
# Set with it by a pipeline step on a cluster (pipelines/component_support.py): the way out besides freeing space,
# where a pod has no --out to choose. Both are environment variables so that a step's launched processes (torchrun's
# ranks) say the same.
ELSEWHERE_ENV = "RANGEFINDER_ELSEWHERE"


# What torch.save's writer says of a write the file system refused, with no errno: "file write failed" (older torch),
# or "basic_ios::clear: iostream error" and then, as the zip writer closes the file, "unexpected pos N vs M" (the
# error raised, the first as its context). A full disk under a checkpoint's optimizer.pt read as a traceback.
_TORCH_WRITE_FAILED = re.compile(r"file write failed|iostream error|unexpected pos \d+ vs \d+")


def write_errno(e: BaseException) -> Optional[int]:
    """The errno of a failed write: OSError carries it; safetensors (SafetensorError) and torch.save (RuntimeError)
    only name it in their message, as "(os error 28)", or not at all (_TORCH_WRITE_FAILED: -1 here); shutil.copytree
    (shutil.Error, errno None) in the reason of its first failed file, as "[Errno 28] No space left on device"."""
    if isinstance(e, shutil.Error):
        copied = failed_copy(e)
        return copied[0] if copied else None
    if isinstance(e, OSError):
        return e.errno
    if not isinstance(e, (SafetensorError, RuntimeError)):
        return None
    m = re.search(r"\(os error (\d+)\)", str(e))
    if m:
        return int(m.group(1))
    said = f"{e} {e.__context__ or ''}"
    return -1 if _TORCH_WRITE_FAILED.search(said) else None


def disk_problem(what: str, path: Path, e: BaseException, *, elsewhere: Optional[str] = None,
                 again: Optional[str] = None) -> Optional[RangefinderError]:
    """The one sentence for `e` raised while writing `what` under the folder `path`; None when `e` is not a storage
    problem (a bug or a bad input, which must not read as one). `elsewhere` and `again`: the way out besides freeing
    space there, and what to do then; by default those of a run's outputs (another --out; then --resume where a
    checkpoint is there to resume from; in a pipeline's step, $RANGEFINDER_AGAIN's and $RANGEFINDER_ELSEWHERE's)."""
    code = write_errno(e)
    if code is None or (code != -1 and code not in REFUSED_WRITES):
        return None
    where = Path(refused_file(e) or path)
    probe, free = free_space(where)
    # `path` is the checkpoints folder (a checkpoint's save) or the run's folder (its outputs, its lock file), whose
    # checkpoints are under RUN_DIR: they were not looked for there, and a run that had them was told of none.
    previous = next(filter(None, (checkpoints.latest_checkpoint(folder)
                                  for folder in (Path(path), Path(path) / checkpoints.RUN_DIR))), None)
    kept = f"; the previous checkpoint {previous} is intact" if previous else ""
    # --resume goes on from a checkpoint: with none (a new run's lock file, a write before the first checkpoint) it is
    # refused ("holds no run to resume"), and a local pipeline run (run --local, demo) has no --resume at all: its
    # steps are told what to say instead (AGAIN_ENV).
    again = again or os.environ.get(AGAIN_ENV) or None
    if again is None and previous:  # another --out has nothing to resume: said apart from --resume
        elsewhere, again = "", "then run again with --resume (another --out starts anew)"
    elsewhere = os.environ.get(ELSEWHERE_ENV, _ELSEWHERE) if elsewhere is None else elsewhere
    again = again or "then run again"
    if code == -1:  # torch.save names no reason; the usual one is a full disk
        why = "the write failed (torch.save names no reason: a full disk, a quota or a file-size limit)"
        fix = "free some space at {at} {elsewhere}"
    else:
        why, fix = REFUSED_WRITES[code]
    fmt = dict(at=probe, uid=os.getuid(), file=where, elsewhere=elsewhere)
    return RangefinderError(
        f"cannot write {what} under {path}: {why.format(**fmt)} ({free}){kept}; {fix.format(**fmt).rstrip()}, {again}"
    )


@contextlib.contextmanager
def outputs_written(out_dir: Path, what: str = "the run's outputs") -> Iterator[None]:
    """Writes of `what` under `out_dir` (the run's curve CSVs, final/, run_summary.json; or a checkpoint): a
    storage failure is one sentence (`disk_problem`) instead of a traceback; anything else goes on up."""
    try:
        yield
    except (OSError, SafetensorError, RuntimeError) as e:
        problem = disk_problem(what, out_dir, e)
        if problem is None:
            raise
        raise problem from None
