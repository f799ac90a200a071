"""Whole or absent: every file and folder the project writes goes to a temporary sibling first, then is renamed.

A rename within one folder is atomic on POSIX file systems, so a reader (a resumed run, the next pipeline step, a
user's tool) sees the old content or the new one, never half of it; a killed writer leaves only a dot-named `.tmp`
sibling behind. The temporary name carries the process id and a random token, so two writers of the same path never
share one: not even two pods of runs at once on the shared data volume (the encoded cache), whose processes, each
numbered in its own container, often have the same id.

A folder that is already there cannot be renamed over; on Linux the two are swapped in one step (renameat2's
RENAME_EXCHANGE). Elsewhere, and on file systems that refuse the swap (NFS, some FUSE mounts), the old one is renamed
aside to `.NAME.PID.old.tmp` before the new one is renamed in: a kill between the two leaves no NAME, and whoever
sweeps that folder's `.tmp` siblings puts the old one back first (`restore_moved_aside`).

A rename is atomic, not durable: after a power loss the file system may hold the new name over data never written
(ext4 and XFS write a file's blocks back later than its rename), a "finished" file that is empty. So what is renamed
into place is flushed to the disk first (`fsync_file`, `fsync_tree`), and the folder holding the new name after
(`fsync_dir`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional, Union

from rangefinder.config import expand_home
from rangefinder.errors import RangefinderError

PathLike = Union[str, "os.PathLike[str]"]


# A write the file system refused, in words: errno -> (what happened, what to do). `{at}` is the nearest existing
# folder (free_space), `{file}` the path the error names, `{uid}` this process's user id, `{elsewhere}` the caller's
# other way out (another --out, another file system). A run's writes (training.disk) and every other command's
# (cli.storage) say it with these words; an errno not here is not a storage problem.
REFUSED_WRITES: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("disk full", "free some space at {at} {elsewhere}"),
    errno.EDQUOT: ("disk quota exceeded", "free some space at {at} or raise the quota {elsewhere}"),
    errno.EFBIG: ("file too large (the file-size limit, `ulimit -f`, or the file system's largest file)",
                  "raise the limit {elsewhere}"),
    errno.EIO: ("input/output error: the disk or network file system under {at} failed",
                "check that volume (dmesg, the storage's health) {elsewhere}"),
    errno.EROFS: ("read-only file system", "mount {at} writable {elsewhere}"),
    errno.EACCES: ("permission denied", "make {at} writable for user id {uid} {elsewhere}"),
    errno.EPERM: ("operation not permitted", "make {at} writable for user id {uid} {elsewhere}"),
    errno.ENOTDIR: ("a file is in the way: a folder on the path {file} is a file", "move it away {elsewhere}"),
    errno.EEXIST: ("a file is in the way: {file} is a file, not a folder", "move it away {elsewhere}"),
}


_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")


def failed_copy(e: BaseException) -> Optional[tuple[Optional[int], str]]:
    """shutil.copytree's Error (errno None, a list of (source, target, reason) rows), by its first row: the errno its
    reason names ("[Errno 28] No space left on device"; None where it names none) and the file it was copying to.
    None for any other error."""
    rows = e.args[0] if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) else []
    if not rows or not (isinstance(rows[0], tuple) and len(rows[0]) == 3):
        return None
    m = _ERRNO_IN_TEXT.search(str(rows[0][2]))
    return (int(m.group(1)) if m else None), rows[0][1]


def refused_file(e: BaseException) -> Optional[str]:
    """The file a refused write was writing, as the error names it: a copy's or a link's OSError (shutil.copyfile,
    os.link) names its source first (`filename`) and the file it wrote second (`filename2`), and a full disk under
    the copy was said as the source's, with the free space of the disk the source is on."""
    named = getattr(e, "filename2", None) or getattr(e, "filename", None)
    return os.fsdecode(named) if isinstance(named, (str, bytes, os.PathLike)) else None


def free_space(path: PathLike) -> tuple[Path, str]:
    """The nearest existing folder at or above `path`, and the free space on it in words."""
    probe = Path(path)
    while not probe.is_dir() and probe != probe.parent:
        probe = probe.parent
    try:
        return probe, f"{shutil.disk_usage(probe).free / 2**30:.2f} GiB free on {probe}"
    except OSError:
        return probe, f"free space on {probe} unknown"


def usable_folder(path: PathLike, what: str) -> Path:
    """`path` as a Path; RangefinderError naming `what` when it, or a folder above it, is a file (so it can never
    be a folder: mkdir would fail with FileExistsError or NotADirectoryError, far from the setting that named it)."""
    p = expand_home(path, what)
    for q in (p, *p.parents):
        if q.exists() or q.is_symlink():
            if not q.is_dir():
                where = "it is a file" if q == p else f"{q}, a folder above it, is a file"
                raise RangefinderError(f"{what} {p} cannot be made: {where}, not a folder; pass another folder "
                                       "path, or move the file away")
            break
    return p


def process_umask() -> int:
    """This process's umask, read without changing it where Linux says it (/proc/self/status, Linux 4.7+); elsewhere
    set and put straight back (os.umask has no read-only form)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_usual_mode(path: PathLike) -> None:
    """The mode `path` would have had if opened for writing as usual (0666 less the umask: 0644 at the usual 022).
    safetensors' writer (and diffusers' save_pretrained, through it) creates its file 0600, so a delivered weights
    file was unreadable to the group and others that a user, their serving tools or a shared volume's readers
    expect to read it."""
    os.chmod(path, 0o666 & ~process_umask())


# What a file system that cannot flush a folder (or this kind of file) answers to fsync: nothing to make durable there.
_NO_FSYNC = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF})


def _fsync(path: PathLike, flags: int) -> None:
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):  # a folder or file this user may not open: cannot be flushed here
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_FSYNC:
            raise  # EIO, ENOSPC: the data did not reach the disk, which a finished file must not hide
    finally:
        os.close(fd)


def fsync_file(path: PathLike) -> None:
    """Flush the file's data to the disk, before it is renamed into place."""
    _fsync(path, os.O_RDONLY)


def fsync_dir(path: PathLike) -> None:
    """Flush the folder's entries (a rename into it) to the disk."""
    _fsync(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def fsync_tree(folder: PathLike) -> None:
    """Flush every file and folder under `folder` (itself included), before it is renamed into place."""
    for parent, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                fsync_file(path)
        fsync_dir(parent)


@contextlib.contextmanager
def atomic_path(path: PathLike, *, suffix: str = "", durable: bool = True) -> Iterator[Path]:
    """A temporary sibling of `path` to write; renamed onto `path` when the block ends, removed if it raises.

    `suffix` ends the temporary name, for writers that choose the format by extension (e.g. `.yaml`). `durable`
    False: not flushed to the disk (a cache entry its reader rebuilds when torn, one of thousands).
    """
    path = Path(path)
    if path.is_dir():
        raise RangefinderError(f"{path} is a folder; pass the path of a file to write (e.g. {path / 'out'})")
    usable_folder(path.parent, "output folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp{suffix}")
    try:
        yield tmp
        if durable:
            fsync_file(tmp)  # its data on the disk before its name is: never a finished name over an empty file
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def sweep_dead_writers(path: PathLike) -> list[Path]:
    """Remove the temporary files `atomic_path(path)` left beside `path` from writers killed mid-write (kill -9, the
    OOM killer, a power cut: the block's `finally` never ran), each of which stayed beside the file for ever, and
    those a writer of that temporary file left in turn (`..NAME.PID.TOKEN.tmp.yaml.PID.TOKEN.tmp`: the compile's
    header rewritten into kfp's output). Only a temporary whose process (the PID in its name) is not running on this
    machine goes: one a writer is filling now, here, is left to it. The paths removed."""
    path = Path(path)
    mine = re.compile(rf"^\.+{re.escape(path.name)}\.(\d+)(\.[0-9a-f]{{8}})?\.tmp")
    removed: list[Path] = []
    try:
        siblings = list(path.parent.iterdir())
    except OSError:
        return removed
    for p in siblings:
        found = mine.match(p.name)
        if found and not _running(int(found.group(1))) and not p.is_dir():
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _running(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (another user's too)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def write_bytes(path: PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text(path: PathLike, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: PathLike, obj: Any, *, indent: int = 2) -> Path:
    """JSON with a trailing newline; objects json cannot encode (paths, numpy scalars) are written as str()."""
    return write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")


def read_written_json(path: PathLike, valid: Callable[[Any], bool], not_valid: str, fix: str) -> Any:
    """A JSON file write_json wrote whole, read back; RangefinderError `PATH cannot be read: WHY; FIX` where it is
    no JSON (damaged, or edited since) or, by `valid`, not what it should hold (WHY: `not_valid`)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = f"not valid JSON ({e})"
    else:
        if valid(data):
            return data
        why = not_valid
    raise RangefinderError(f"{path} cannot be read: {why}; {fix}")


def replace_dir(src: PathLike, dst: PathLike) -> Path:
    """Put the finished folder `src` in the place of `dst` (which may exist), and remove the old one.

    The two are swapped in one step where the system can (`exchange`), so a kill leaves the old folder or the new one
    at `dst`, never neither. Elsewhere the old one is renamed aside to `.NAME.PID.old.tmp` first: a kill before the
    second rename leaves it there and no `dst`, which `restore_moved_aside` undoes."""
    src, dst = Path(src), Path(dst)
    fsync_tree(src)  # its files on the disk before the folder's name is (module docstring)
    if not dst.exists():
        os.replace(src, dst)
    elif dst.is_dir() and not dst.is_symlink() and exchange(src, dst):
        shutil.rmtree(src, ignore_errors=True)  # the old folder, now under the temporary name
    else:
        old = dst.with_name(f".{dst.name}.{os.getpid()}.old.tmp")
        os.replace(dst, old)
        try:
            os.replace(src, dst)
        except OSError:
            os.replace(old, dst)  # the new one could not go in: the old one goes back
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(dst.parent)
    return dst


# renameat2(2) (Linux 3.15, glibc 2.28; Python has no binding): RENAME_EXCHANGE swaps two existing paths atomically.
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
# What a system or file system without the swap answers (NFS, some FUSE mounts: EINVAL); the caller renames twice.
_NO_EXCHANGE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
# A folder replace_dir renamed aside: `.NAME.PID.old.tmp`.
_MOVED_ASIDE = re.compile(r"^\.(?P<name>.+)\.\d+\.old\.tmp$")
# What these writers fill or set aside, named after what they write (NAME): `.NAME.PID.TOKEN.tmp...` (atomic_path),
# `.NAME.PID.tmp...` (atomic_dir) and `.NAME.PID.old.tmp` (replace_dir). A writer killed mid-write leaves it behind.
TEMPORARY = re.compile(r"^\.(?P<name>.+?)\.\d+(\.[0-9a-f]{8})?\.(old\.)?tmp")


@functools.cache
def _renameat2() -> Optional[Callable[..., int]]:
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without it (glibc before 2.28)
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def exchange(a: PathLike, b: PathLike) -> bool:
    """Swap the existing paths `a` and `b` in one atomic step; False where this system or file system cannot (then
    nothing was done). Another failure (a missing path, another file system) is the OSError a rename raises."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), None, os.fspath(b))


def restore_moved_aside(folder: PathLike, whole: Callable[[Path], bool] = Path.is_dir) -> None:
    """Put back, under its own name, each folder in `folder` that `replace_dir` renamed aside and a kill kept from
    replacing (`.NAME.PID.old.tmp`, with no NAME): call it before sweeping `.tmp` siblings away. Only one that is
    `whole` goes back; a rename refused (a read-only folder, another process first) leaves things as they are."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for old in folder.glob(".*.old.tmp"):
        m = _MOVED_ASIDE.match(old.name)
        dst = folder / m.group("name") if m else None
        if dst is not None and not (dst.exists() or dst.is_symlink()) and whole(old):
            with contextlib.suppress(OSError):
                os.rename(old, dst)


def sweep_leftovers(folder: PathLike) -> list[Path]:
    """Remove what writers killed mid-write left in `folder` (TEMPORARY: a `.final.PID.tmp...` as large as the model
    it was filling, which nothing removed, one more on every kill), after putting back a folder renamed aside whose
    NAME is gone (restore_moved_aside). Only for a folder the caller holds (a run's output folder under its lock), so
    that no live writer's file is taken; never a folder several processes fill at once (the encoded cache). The
    paths removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    restore_moved_aside(folder)
    removed = [p for p in folder.iterdir() if TEMPORARY.match(p.name)]
    for p in removed:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return removed


def rename_into_place(src: PathLike, dst: PathLike) -> Path:
    """Move the finished file or folder `src` to `dst` on the same file system, in one rename, replacing what is
    there (a folder through `replace_dir`: a kill leaves the old or the new one at `dst`, or, where the system cannot
    swap folders, the old one renamed aside for `restore_moved_aside`)."""
    src, dst = Path(src), Path(dst)
    if src.is_dir() and not src.is_symlink() and dst.is_dir() and not dst.is_symlink():
        return replace_dir(src, dst)
    if dst.is_dir() and not dst.is_symlink():
        shutil.rmtree(dst)  # a file in a folder's place: os.replace cannot put it over a folder
    if src.is_dir() and not src.is_symlink():
        fsync_tree(src)
    else:
        fsync_file(src)
    os.replace(src, dst)
    fsync_dir(dst.parent)
    return dst


@contextlib.contextmanager
def atomic_dir(path: PathLike, *, replace: bool = True) -> Iterator[Path]:
    """A fresh temporary folder beside `path` to fill; it takes the place of `path` when the block ends, and is
    removed if the block raises (an existing `path` is then left as it was).

    `replace=False` is for shared caches that several processes may fill at once: `path` must then be absent or
    empty, and OSError says another writer finished first (its folder stays; the caller may use it).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; what we publish is read like any other folder
        if replace:
            replace_dir(tmp, path)
        else:
            if path.exists():
                path.rmdir()  # only an empty folder: a finished one fails here
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
