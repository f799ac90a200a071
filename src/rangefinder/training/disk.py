"""The run's writes under its output folder, and the one rule for a write that failed.

A failed write is one sentence: what, where, why in the file system's own terms, the free space there, and what to
do. `disk_problem` is that rule, the same for a checkpoint (checkpointing.save_checkpoint) and for the run's other
outputs (`outputs_written`: the curve CSVs, final/, run_summary.json). It knows the errnos a storage problem raises;
any other error is not a storage problem and is not dressed as one (it goes on up as it is).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from safetensors import SafetensorError

from rangefinder.errors import RangefinderError
from rangefinder.formats import checkpoints

_AGAIN = "then run again with --resume"
_ELSEWHERE = "or choose another --out"

# errno -> (what happened, what to do). Full and quota share a fix; the others each name their own.
_PROBLEMS: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("disk full", "free some space at {at} " + _ELSEWHERE),
    errno.EDQUOT: ("disk quota exceeded", "free some space at {at} or raise the quota " + _ELSEWHERE),
    errno.EFBIG: ("file too large (the file-size limit, `ulimit -f`, or the file system's largest file)",
                  "raise the limit " + _ELSEWHERE),
    errno.EIO: ("input/output error: the disk or network file system under {at} failed",
                "check that volume (dmesg, the storage's health) " + _ELSEWHERE),
    errno.EROFS: ("read-only file system", "mount {at} writable " + _ELSEWHERE),
    errno.EACCES: ("permission denied", "make {at} writable for user id {uid} " + _ELSEWHERE),
    errno.EPERM: ("operation not permitted", "make {at} writable for user id {uid} " + _ELSEWHERE),
    errno.ENOTDIR: ("a file is in the way: a folder on the path {file} is a file", "move it away " + _ELSEWHERE),
    errno.EEXIST: ("a file is in the way: {file} is a file, not a folder", "move it away " + _ELSEWHERE),
}


def write_errno(e: BaseException) -> Optional[int]:
    """The errno of a failed write: OSError carries it; safetensors (SafetensorError) and torch.save (RuntimeError)
    only name it in their message, as "(os error 28)", or not at all ("file write failed": -1 here)."""
    if isinstance(e, OSError):
        return e.errno
    if not isinstance(e, (SafetensorError, RuntimeError)):
        return None
    m = re.search(r"\(os error (\d+)\)", str(e))
    if m:
        return int(m.group(1))
    return -1 if "file write failed" in str(e) else None


def disk_problem(what: str, path: Path, e: BaseException) -> Optional[RangefinderError]:
    """The one sentence for `e` raised while writing `what` under the folder `path`; None when `e` is not a storage
    problem (a bug or a bad input, which must not read as one)."""
    code = write_errno(e)
    if code is None or (code != -1 and code not in _PROBLEMS):
        return None
    where = Path(getattr(e, "filename", None) or path)
    probe = where
    while not probe.is_dir() and probe != probe.parent:
        probe = probe.parent
    try:
        free = f"{shutil.disk_usage(probe).free / 2**30:.2f} GiB free on {probe}"
    except OSError:
        free = f"free space on {probe} unknown"
    previous = checkpoints.latest_checkpoint(path) if Path(path).is_dir() else None
    kept = f"; the previous checkpoint {previous} is intact" if previous else ""
    if code == -1:  # torch.save names no reason; the usual one is a full disk
        why, fix = f"the write failed ({e})", "free some space at {at} " + _ELSEWHERE
    else:
        why, fix = _PROBLEMS[code]
    fmt = dict(at=probe, uid=os.getuid(), file=where)
    return RangefinderError(
        f"cannot write {what} under {path}: {why.format(**fmt)} ({free}){kept}; {fix.format(**fmt)}, {_AGAIN}"
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
