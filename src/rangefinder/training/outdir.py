"""One run at a time in an output folder: the folder lock (`OutDirLock`) and the probe a run takes before it
starts (`check_out_dir_free`)."""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import weakref
from pathlib import Path

from rangefinder.errors import ConfigError
from rangefinder.training.disk import disk_problem

LOCK_NAME = ".rangefinder.lock"


class OutDirLock:
    """One run at a time in an output folder: an exclusive flock on `OUT_DIR/.rangefinder.lock`, which records the
    holder's pid, host and start time for the error the next run gets. The kernel drops a flock when its process
    dies, so a run killed with SIGKILL leaves no lock that blocks its resume (the file stays; only the flock counts).
    flock works between processes of one host and, on most network file systems (NFS v4, Lustre), between hosts.
    A lock this process still holds for the folder (a train() that raised) belongs to the same owner: it is taken over.
    """

    def __init__(self, out_dir: Path, hold: bool = True) -> None:
        self.path, self._fd = Path(out_dir) / LOCK_NAME, None
        if hold:
            earlier = _held.pop(self.path.resolve(), None)
            if earlier is not None and earlier._fd is not None:
                # Its descriptor, flock and all: released and taken again, the folder was free a moment, in which
                # another run could take it (demo holds it from its first write, then run_pipeline_locally takes it).
                self._fd, earlier._fd = earlier._fd, None
            else:
                self._fd = _open_lock(self.path)
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _holder(self._fd)
                    self.release()
                    raise _held_error(out_dir, holder) from None
            info = {"pid": os.getpid(), "host": socket.gethostname(),
                    "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, json.dumps(info).encode(), 0)
            _held[self.path.resolve()] = self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


def check_out_dir_free(out_dir: Path) -> None:
    """Fail at once when another live run holds `out_dir` (a shared probe: processes of one run do not clash)."""
    path = Path(out_dir) / LOCK_NAME
    if path.resolve() in _held:  # this process's own, see OutDirLock
        return
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _held_error(out_dir, _holder(fd)) from None
    finally:
        os.close(fd)


_held: weakref.WeakValueDictionary[Path, OutDirLock] = weakref.WeakValueDictionary()


def _open_lock(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        problem = disk_problem("the run's lock file", path.parent, e)
        if problem is None:
            raise
        raise problem from None


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError):
        return "another process"


def _held_error(out_dir: Path, holder: str) -> ConfigError:
    return ConfigError(
        f"output folder {out_dir} is in use by another rangefinder run ({holder}); wait for it to finish or stop it, "
        "or choose another --out"
    )
