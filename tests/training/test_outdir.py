"""The output folder's lock (training/outdir.py) between real processes: a live holder is refused in one line naming
it, a killed holder's lock is taken over, and the run that took it over is then refused to the next live one; a lock
this process still holds (a train() that raised) is its own next run's, and a released or dropped lock frees the
folder for another process. The lock is exercised directly, in processes that import only it (no training run)."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rangefinder.errors import ConfigError
from rangefinder.training.outdir import LOCK_NAME, OutDirLock, check_out_dir_free

# Another process's attempt: takes the lock, says "held" (and with "hold" keeps it until killed), or prints the
# refusal and exits 2.
TAKE = """
import sys, time
from pathlib import Path
from rangefinder.errors import ConfigError
from rangefinder.training.outdir import OutDirLock
try:
    lock = OutDirLock(Path(sys.argv[1]))
except ConfigError as e:
    print(e, flush=True)
    sys.exit(2)
print("held", flush=True)
if sys.argv[2] == "hold":
    time.sleep(600)
"""


def _env() -> dict[str, str]:
    import rangefinder

    return {**os.environ, "PYTHONPATH": str(Path(rangefinder.__file__).parents[1])}  # the code under test


def _try(out: Path) -> subprocess.CompletedProcess:
    """Another process's try at the lock, released as it exits."""
    return subprocess.run([sys.executable, "-c", TAKE, str(out), "once"], capture_output=True, text=True,
                          env=_env(), timeout=60)


def _refused(said: str, out: Path, pid: int) -> None:
    host = socket.gethostname()
    assert said.startswith(f"output folder {out} is in use by another rangefinder run (pid {pid} on host {host}, "
                           "started "), said
    assert said.endswith("; wait for it to finish or stop it, or choose another --out") and "\n" not in said, said


def test_a_live_holder_is_refused_and_a_killed_one_s_lock_is_taken_over_by_one_run_only(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # A longer record than any below, as a run on a host with a long name left it: each holder's record replaces it.
    (out / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "h" * 200, "started": "2001-02-03T04:05:06+00:00"}))
    holder = subprocess.Popen([sys.executable, "-c", TAKE, str(out), "hold"], stdout=subprocess.PIPE, text=True,
                              env=_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # The probe before a run's setup and the lock itself (taken after it: a run that started between the two)
        # both refuse the live holder.
        for attempt in (check_out_dir_free, OutDirLock):
            with pytest.raises(ConfigError) as e:
                attempt(out)
            _refused(str(e.value), out, holder.pid)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / LOCK_NAME).exists()  # the killed holder's file stays; only its flock went with it

    check_out_dir_free(out)
    mine = OutDirLock(out)
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    # The folder is this run's now: another live run is refused, naming it.
    other = _try(out)
    assert other.returncode == 2, other.stderr
    _refused(other.stdout.strip(), out, os.getpid())
    mine.release()
    assert _try(out).stdout.strip() == "held"


def test_a_lock_this_process_holds_is_its_next_run_s_and_a_dropped_lock_frees_the_folder(tmp_path):
    """A train() that raised leaves its lock alive (its frames hold it): the next run in this process takes it over
    instead of being refused as another run; and a lock released, or dropped with the last reference to it, lets
    another process in."""
    out = tmp_path / "out"
    first = OutDirLock(out)
    check_out_dir_free(out)  # this process's own lock: no other run
    second = OutDirLock(out)  # takes the first one's over
    assert _try(out).returncode == 2  # held still, by the second
    second.release()
    assert _try(out).stdout.strip() == "held"
    del first, second

    dropped = OutDirLock(out)
    assert _try(out).returncode == 2
    del dropped
    gc.collect()
    assert _try(out).stdout.strip() == "held"


# Another process trying the lock over and over (as a second run on the same --out would, at any moment) until its
# stdin closes: says "free" the first time it gets it, else "never free".
WATCH = """
import fcntl, os, select, sys
print("watching", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    fd = os.open(sys.argv[1], os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        continue
    else:
        print("free", flush=True)
        sys.exit(0)
    finally:
        os.close(fd)
print("never free", flush=True)
"""


def test_a_lock_taken_over_in_this_process_never_frees_the_folder_meanwhile(tmp_path):
    """demo holds --out's lock from its first write, and run_pipeline_locally takes it over: released and taken again,
    the folder was free for a moment, in which a second demo on it could take it and refuse the first."""
    import time

    out = tmp_path / "out"
    lock = OutDirLock(out)
    watcher = subprocess.Popen([sys.executable, "-c", WATCH, str(out / LOCK_NAME)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert watcher.stdout is not None and watcher.stdin is not None
    try:
        assert watcher.stdout.readline().strip() == "watching"
        end = time.monotonic() + 0.5
        while time.monotonic() < end and watcher.poll() is None:
            lock = OutDirLock(out)
        watcher.stdin.close()
        assert watcher.stdout.read().strip() == "never free"
    finally:
        watcher.kill()
        watcher.wait()
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    del lock


def test_the_probes_of_one_run_s_processes_do_not_clash(tmp_path):
    """Every process of a multi-process run probes the folder in its setup, at about the same moment (they meet
    before rank 0 takes the lock): a probe that finds another process's probe under way goes on."""
    out = tmp_path / "out"
    probe = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
             "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)\nprint('probing', flush=True)\ntime.sleep(600)\n")
    out.mkdir()
    other = subprocess.Popen([sys.executable, "-c", probe, str(out / LOCK_NAME)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "probing"
        check_out_dir_free(out)
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
