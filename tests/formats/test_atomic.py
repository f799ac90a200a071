"""A folder replaced in place survives a SIGKILL at any point: a real writer process, killed at the step after the
old folder left its place, on this machine's file system; then the readers and sweeps a resume goes through."""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rangefinder.formats import checkpoints

# Commits checkpoint-000004.tmp over checkpoint-000004 (a save of an update already saved), SIGKILLed at the first
# step after the old checkpoint left its place: the rename of the new folder into it, or else the removal of the old
# one (audit events fire before the operation). "renames": as on a system without renameat2.
WRITER = """
import os, signal, sys
from pathlib import Path
from rangefinder.formats import atomic, checkpoints

root, how = Path(sys.argv[1]), sys.argv[2]
if how == "renames":
    atomic._renameat2 = lambda: None
new = root / "checkpoint-000004.tmp"

def killed_there(event, args):
    if (event == "os.rename" and Path(args[0]) == new) or event == "shutil.rmtree":
        os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(killed_there)
checkpoints.commit(new, keep=5)
"""


def write_checkpoint(folder: Path, update: int, written: str) -> Path:
    """A real checkpoint (the engine's writer, tiny tensors) whose state says which save `written` it was."""
    folder.mkdir()
    checkpoints.write_main(folder, weights={"w": torch.full((4,), float(update))}, optimizer={"state": {}},
                           state={"update": update, "written": written})
    return folder


def killed_mid_replace(root: Path, how: str) -> int:
    """checkpoint-000002 and -000004 written, then a second save of update 4 killed inside its replace; the pid."""
    root.mkdir()
    write_checkpoint(root / "checkpoint-000002", 2, "first")
    write_checkpoint(root / "checkpoint-000004", 4, "first")
    write_checkpoint(root / "checkpoint-000004.tmp", 4, "again")
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(root), how], stderr=subprocess.PIPE, text=True)
    _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, err
    return child.pid


def written(ckpt: Path) -> str:
    assert checkpoints.verify(ckpt) is None
    return json.loads((ckpt / checkpoints.STATE_NAME).read_text())["written"]


@pytest.mark.skipif(sys.platform != "linux", reason="renameat2 is Linux's")
def test_exchange_swaps_two_folders_in_one_step_on_this_file_system(tmp_path):
    from rangefinder.formats.atomic import exchange

    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "name").write_text(folder.name)
    assert exchange(a, b) is True
    assert ((a / "name").read_text(), (b / "name").read_text()) == ("b", "a")


@pytest.mark.skipif(sys.platform != "linux", reason="renameat2 is Linux's")
def test_a_kill_inside_a_replace_leaves_the_new_checkpoint_in_place(tmp_path):
    root = tmp_path / "checkpoints"
    killed_mid_replace(root, "exchange")
    # Swapped in one step: the new save is in place, the old one under the temporary name, none ever renamed aside.
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-000002", "checkpoint-000004",
                                                      "checkpoint-000004.tmp"]
    assert written(root / "checkpoint-000004") == "again" and written(root / "checkpoint-000004.tmp") == "first"
    assert checkpoints.latest_checkpoint(root) == root / "checkpoint-000004"
    checkpoints.begin(root, 6)  # the next save sweeps the old one away
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-000002", "checkpoint-000004",
                                                      "checkpoint-000006.tmp"]


@pytest.mark.parametrize("reader", ["latest_checkpoint", "the next save's sweep"])
def test_a_kill_between_the_two_renames_gives_the_old_checkpoint_back(tmp_path, reader):
    """Where folders cannot be swapped, the old checkpoint is renamed aside first: killed before the new one is
    renamed in, no checkpoint-000004 is left; the resume's reader, or the next save, puts the old one back."""
    root = tmp_path / "checkpoints"
    pid = killed_mid_replace(root, "renames")
    assert sorted(p.name for p in root.iterdir()) == [f".checkpoint-000004.{pid}.old.tmp", "checkpoint-000002",
                                                      "checkpoint-000004.tmp"]
    if reader == "latest_checkpoint":
        assert checkpoints.latest_checkpoint(root) == root / "checkpoint-000004"
    else:
        checkpoints.begin(root, 6)
        assert sorted(p.name for p in root.iterdir()) == ["checkpoint-000002", "checkpoint-000004",
                                                          "checkpoint-000006.tmp"]
    assert written(root / "checkpoint-000004") == "first"


@pytest.mark.parametrize("replace", [True, False])
def test_a_folder_written_whole_is_readable_as_any_other_folder(tmp_path, replace):
    """atomic_dir fills a private temporary folder (mkdtemp's 0700); what it publishes (a run's final/, a shared
    cache's model) is listed and read by other users like any folder made with the usual umask: 0755."""
    import stat

    from rangefinder.formats.atomic import atomic_dir

    with atomic_dir(tmp_path / "out", replace=replace) as tmp:
        (tmp / "weights.safetensors").write_bytes(b"w")
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert (tmp_path / "out" / "weights.safetensors").read_bytes() == b"w"


def test_a_shared_folder_another_writer_finished_first_is_kept(tmp_path):
    """replace=False (a shared cache several processes fill at once): the writer that finishes second gets OSError
    and the first one's folder stays as it was, whole; its own temporary folder is gone."""
    from rangefinder.formats.atomic import atomic_dir

    with atomic_dir(tmp_path / "model", replace=False) as tmp:
        (tmp / "weights.safetensors").write_bytes(b"first")
    with pytest.raises(OSError), atomic_dir(tmp_path / "model", replace=False) as tmp:
        (tmp / "weights.safetensors").write_bytes(b"second")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert [p.name for p in (tmp_path / "model").iterdir()] == ["weights.safetensors"]
    assert (tmp_path / "model" / "weights.safetensors").read_bytes() == b"first"


def test_two_writers_of_one_file_with_the_same_process_id_each_write_their_own_temporary_file(tmp_path):
    """Two writers of one encoded-cache entry in the same process, as two pods of runs at once on the shared data
    volume are (each container numbers its processes from 1, so their writers often have the same id): each fills a
    file of its own, and both renames succeed, the last one's content in place and nothing left beside it. With the
    process id alone in the temporary name they shared one file, and the second rename failed (FileNotFoundError:
    the first had moved it), failing that run's step."""
    from rangefinder.formats.atomic import atomic_path, sweep_leftovers

    entry = tmp_path / "0f1e.safetensors"
    with atomic_path(entry, durable=False) as first:
        first.write_bytes(b"first")
        with atomic_path(entry, durable=False) as second:
            second.write_bytes(b"second")
            assert {p.name for p in tmp_path.iterdir()} == {first.name, second.name}
        assert entry.read_bytes() == b"second"
    assert entry.read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]
    (tmp_path / first.name).write_bytes(b"left by a killed writer")
    assert sweep_leftovers(tmp_path) == [tmp_path / first.name]  # its name is still one a sweep knows


def test_a_file_renamed_into_a_folder_s_place_replaces_it(tmp_path):
    """rename_into_place moves a finished file where a folder of that name is (os.replace cannot put a file over a
    folder): the file is there afterwards, the folder gone."""
    from rangefinder.formats.atomic import rename_into_place

    (tmp_path / "metrics.csv").mkdir()
    (tmp_path / "metrics.csv" / "stale").write_text("old")
    (tmp_path / ".metrics.csv.tmp").write_text("update,val_loss\n")
    assert rename_into_place(tmp_path / ".metrics.csv.tmp", tmp_path / "metrics.csv") == tmp_path / "metrics.csv"
    assert (tmp_path / "metrics.csv").read_text() == "update,val_loss\n"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]


def _unflushable_writes(root: Path, conn) -> None:
    """In a forked child: fsync and fdatasync return EIO from now on, as a disk reports its failed writes there (the
    write-back of a file's blocks happens after write() returned, and a rename does not wait for it); then chosen.json
    and a checkpoint are written over the earlier ones. What each write raised (its errno's name) or "written"."""
    import errno

    from rangefinder.formats.atomic import write_json
    from tests.training.engine_child import fail_with_eio

    fail_with_eio(74, 75)  # fsync, fdatasync
    said = {}
    for what, write in (("chosen.json", lambda: write_json(root / "chosen.json", {"update": 8})),
                        ("checkpoint", lambda: checkpoints.commit(root / "checkpoint-000004.tmp", keep=5))):
        try:
            write()
            said[what] = "written"
        except OSError as e:
            said[what] = errno.errorcode.get(e.errno or 0, str(e.errno))
    conn.send(said)


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="a seccomp filter of x86_64's")
def test_a_file_or_checkpoint_whose_data_did_not_reach_the_disk_is_not_renamed_into_place(tmp_path):
    """A rename is atomic but not durable: renamed before its data was flushed, a file can be found empty under its
    finished name after a power loss, and a write-back that failed was never seen. The data is flushed (fsync) before
    the rename: where that fails, the write fails with the disk's error and the earlier file or checkpoint stays."""
    import multiprocessing

    root = tmp_path / "run"
    root.mkdir()
    (root / "chosen.json").write_text('{"update": 4}\n')
    write_checkpoint(root / "checkpoint-000004", 4, "first")
    write_checkpoint(root / "checkpoint-000004.tmp", 4, "again")
    fork = multiprocessing.get_context("fork")  # the filter is the child's alone, for its lifetime
    ours, theirs = fork.Pipe()
    child = fork.Process(target=_unflushable_writes, args=(root, theirs))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and ours.poll(), child.exitcode
    assert ours.recv() == {"chosen.json": "EIO", "checkpoint": "EIO"}
    assert (root / "chosen.json").read_text() == '{"update": 4}\n'
    assert written(root / "checkpoint-000004") == "first"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-000004", "checkpoint-000004.tmp", "chosen.json"]
