"""A write the file system refused (a full disk, a read-only mount, a quota, a file-size limit), said in one line.

Training says it with the checkpoint that is intact (training/disk.py), in the same words (the atomic writer's
table, formats.atomic.REFUSED_WRITES). Every other command (`make-dataset`, `make-base-model`, `split`, `sample`, the
reports of `analyze-lr` and `select-steps`) writes through the atomic writer (formats/atomic.py), so what it leaves
behind is a dot-named `.tmp` sibling, never a folder that looks finished. What was missing was the line: the OSError
reached the user as a traceback, naming that `.tmp` sibling. Any other OSError is not a storage problem and is not
dressed as one.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Optional

from rangefinder.formats.atomic import REFUSED_WRITES, TEMPORARY, failed_copy, free_space, refused_file

_ELSEWHERE = "or pass a path on another file system"


def storage_problem(e: OSError, out: Optional[str] = None) -> Optional[str]:
    """One sentence for `e`, where `out` is the command's --out (named when the error names no file); None when `e`
    is not a storage problem. shutil.copytree's Error (errno None, a list of (source, target, reason) rows) counts
    by its first row."""
    code, where = e.errno, refused_file(e)
    if isinstance(e, shutil.Error):
        code, where = failed_copy(e) or (None, None)
    if code not in REFUSED_WRITES:
        return None
    path = _as_named(Path(os.fsdecode(where))) if where is not None else Path(out) if out else None
    probe, free = free_space(path if path is not None else Path.cwd())
    why, fix = REFUSED_WRITES[code]
    fmt = dict(at=probe, uid=os.getuid(), file=path, elsewhere=_ELSEWHERE)
    why = why.format(**fmt) + (f" ({free})" if code in (errno.ENOSPC, errno.EDQUOT) else "")
    return f"cannot write {path if path is not None else 'the output'}: {why}; {fix.format(**fmt)}"


def _as_named(path: Path) -> Path:
    """`path` up to the first temporary sibling in it, named as the user named it (`/x/.ds.123.tmpab/1.png` ->
    `/x/ds`); `path` itself when it holds none."""
    for i, part in enumerate(path.parts):
        m = TEMPORARY.match(part)  # the atomic writer's sibling: the user named NAME
        if m:
            return Path(*path.parts[:i], m.group("name"))
    return path
