"""What a resume must survive (issue 16): a planted pickle, a corrupt newest checkpoint, a second run on the same
folder, a full disk mid-save, and a run whose weights blow up with validation off. Real tiny-model runs, real files
and real processes throughout."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.errors import RangefinderError
from rangefinder.formats import checkpoints
from rangefinder.training.loop import TrainSpec, train
from tests.training.test_resume import start_child  # a forked engine_child.py run

NO_VALIDATION = dict(every_epochs=0)


@pytest.fixture(scope="module")
def base(split_dir, tiny_model_dir, tmp_path_factory) -> dict:
    """16 images, batch 4, one epoch: 4 updates, checkpoints at 2 and 4 (with EMA, so ema.pt is there too)."""
    training = dict(batch_size=4, epochs=1, lr=2e-4, seed=5, checkpoint_every_updates=2, keep_checkpoints=5,
                    use_ema=True, ema_decay=0.9, random_flip=True,
                    cache_dir=str(tmp_path_factory.mktemp("encoded")))
    return dict(split_dir=str(split_dir), model=str(tiny_model_dir), training=training, validation=NO_VALIDATION)


def run_here(base: dict, out_dir: Path, **training):
    spec = TrainSpec(TrainingConfig(**{**base["training"], **training}), ValidationConfig(**base["validation"]),
                     split_dir=base["split_dir"], model=base["model"])
    return train(spec, out_dir=out_dir)


@pytest.fixture(scope="module")
def finished(base, tmp_path_factory) -> Path:
    """A whole uninterrupted run (its checkpoints and final/), which the tests copy and damage."""
    out = tmp_path_factory.mktemp("runs") / "whole"
    result = run_here(base, out)
    assert result.status == "ok" and [p.name for p in result.checkpoints] == ["checkpoint-000002",
                                                                               "checkpoint-000004"]
    return out


def copy_run(finished: Path, dst: Path) -> Path:
    shutil.copytree(finished, dst)
    return dst


def unet(out_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out_dir / "final" / "unet" / "diffusion_pytorch_model.safetensors"))


def rewrite_checksum(ckpt: Path, name: str) -> None:
    """Make the manifest agree with a changed file: the attacker's best case, so only the loader stands in the way."""
    manifest = json.loads((ckpt / checkpoints.MANIFEST_NAME).read_text())
    manifest["sha256"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / checkpoints.MANIFEST_NAME).write_text(json.dumps(manifest))


class Payload:
    """Unpickling this calls open(marker, "w"): the marker file is created by whoever unpickles it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# ---------------------------------------------------------------------------------------------------------------
# Item 5: resuming never unpickles arbitrary objects


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["optimizer.pt", "rng-0.pt"])
def test_a_planted_pickle_is_refused_and_never_run(base, finished, tmp_path, planted):
    cut = copy_run(finished, tmp_path / "cut")
    newest = cut / "checkpoints" / "checkpoint-000004"
    marker = tmp_path / "code-ran"
    torch.save({"state": Payload(marker)}, newest / planted)
    rewrite_checksum(newest, planted)

    with pytest.raises(RangefinderError, match=f"refusing to load .*{planted}.*could run code"):
        run_here(base, cut, resume=True)
    assert not marker.exists()
    # The test can fail: loading the same file the unsafe way runs the payload.
    torch.load(newest / planted, weights_only=False)
    assert marker.exists()


# ---------------------------------------------------------------------------------------------------------------
# Item 3: checksums; a corrupt newest checkpoint falls back to the previous intact one


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: the file still parses, only its numbers are wrong
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped", "deleted"])
def test_corrupt_newest_checkpoint_falls_back_to_previous_and_ends_bit_identical(base, finished, tmp_path, caplog,
                                                                                  damage):
    """A byte flipped in the newest checkpoint's weights, or one of its files deleted (which made it no checkpoint:
    the resume went back one without a word), is named as the resume passes over it."""
    cut = copy_run(finished, tmp_path / "cut")
    shutil.rmtree(cut / "final")
    (cut / "run_summary.json").unlink()
    if damage == "flipped":
        flip_a_byte(cut / "checkpoints" / "checkpoint-000004" / checkpoints.WEIGHTS_NAME)
    else:
        (cut / "checkpoints" / "checkpoint-000004" / checkpoints.OPTIMIZER_NAME).unlink()

    with caplog.at_level(logging.WARNING):
        resumed = run_here(base, cut, resume=True)
    assert resumed.resumed_from == 2 and resumed.updates == 4 and resumed.status == "ok"
    said = ("weights.safetensors does not match its checksum" if damage == "flipped" else "optimizer.pt is missing")
    assert f"skipping checkpoint {cut / 'checkpoints' / 'checkpoint-000004'}: {said}" in caplog.text, caplog.text
    a, b = unet(finished), unet(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The bad one was replaced by a good save of the same update.
    assert checkpoints.verify(cut / "checkpoints" / "checkpoint-000004") is None


@pytest.mark.slow
def test_a_save_killed_between_its_two_renames_resumes_from_the_checkpoint_it_replaced(base, finished, tmp_path):
    """Where folders cannot be swapped in one step, a save of an update already saved (after a resume that passed over
    a damaged newest checkpoint) renames the old checkpoint aside, then the new one in: killed between the two, no
    checkpoint-000004 is left, only the old one renamed aside and the new one at its temporary name
    (tests/formats/test_atomic.py kills a real writer there). The resume goes on from update 4, not 2."""
    cut = copy_run(finished, tmp_path / "cut")
    shutil.rmtree(cut / "final")
    (cut / "run_summary.json").unlink()
    root = cut / "checkpoints"
    (root / "checkpoint-000004").rename(root / ".checkpoint-000004.4242.old.tmp")
    shutil.copytree(root / ".checkpoint-000004.4242.old.tmp", root / "checkpoint-000004.tmp")

    resumed = run_here(base, cut, resume=True)
    assert resumed.resumed_from == 4 and resumed.updates == 4 and resumed.status == "ok"
    # Put back under its name (the new one at the temporary name is left for the next save's sweep, as ever).
    assert [p.name for p in checkpoints.list_checkpoints(root)] == ["checkpoint-000002", "checkpoint-000004"]
    assert not list(root.glob(".*.old.tmp")) and checkpoints.verify(root / "checkpoint-000004") is None
    a, b = unet(finished), unet(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Fills final/ as the engine does (formats.atomic.atomic_dir) and is SIGKILLed half-way, as a preempted run would be.
FINAL_WRITER = """
import os, signal, sys
from pathlib import Path
from rangefinder.formats.atomic import atomic_dir

with atomic_dir(Path(sys.argv[1]) / "final") as tmp:
    (tmp / "unet").mkdir()
    (tmp / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(bytes(1 << 20))
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_final_write_killed_half_way_is_swept_by_the_resume(base, finished, tmp_path):
    """A run killed while it wrote final/ leaves its half under a hidden temporary name (never as final/). The resume
    writes final/ whole and removes that half: it stayed, one more on every such kill, as large as the model."""
    import subprocess
    import sys

    cut = copy_run(finished, tmp_path / "cut")
    shutil.rmtree(cut / "final")
    (cut / "run_summary.json").unlink()
    writer = subprocess.run([sys.executable, "-c", FINAL_WRITER, str(cut)], capture_output=True, text=True,
                            timeout=60)
    assert writer.returncode == -signal.SIGKILL, writer.stderr
    (half,) = cut.glob(".final.*")
    assert not (cut / "final").exists() and (half / "unet").is_dir()

    resumed = run_here(base, cut, resume=True)
    assert resumed.resumed_from == 4 and resumed.status == "ok"
    assert not half.exists() and sorted(p.name for p in cut.iterdir() if p.name.startswith(".")) == [
        ".rangefinder.lock"]
    a, b = unet(finished), unet(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_no_intact_checkpoint_is_a_clear_error(base, finished, tmp_path):
    cut = copy_run(finished, tmp_path / "cut")
    for ckpt in checkpoints.list_checkpoints(cut / "checkpoints"):
        flip_a_byte(ckpt / checkpoints.WEIGHTS_NAME)
    with pytest.raises(RangefinderError, match="no intact checkpoint under .*checkpoints") as refused:
        run_here(base, cut, resume=True)
    # The one line says what is wrong with each: the run checks before it warns, so no warning precedes it.
    message = str(refused.value)
    for name in ("checkpoint-000004", "checkpoint-000002"):
        assert f"{name}: weights.safetensors does not match its checksum" in message, message
    assert "above" not in message, message


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["weights", "ema", "state", "manifest"])
def test_sampling_and_export_refuse_a_damaged_checkpoint(base, finished, tmp_path, capsys, damage):
    """Sampling (the grid, `rangefinder sample`) and export (a checkpoint's model written out, as the fine-tune's
    `chosen/` is) check the files they read against the manifest first. A flipped byte inside the tensor data still
    parses, so without the check each of these would quietly use wrong weights."""
    from rangefinder.cli.main import main as cli_main
    from rangefinder.sampling import export_pipeline, render_grid
    from rangefinder.training.restore import save_checkpoint_model

    ckpt = Path(shutil.copytree(finished / "checkpoints" / "checkpoint-000002", tmp_path / "checkpoint-000002"))
    if damage == "weights":
        flip_a_byte(ckpt / checkpoints.WEIGHTS_NAME)
        problem = "weights.safetensors does not match its checksum"
    elif damage == "ema":
        flip_a_byte(ckpt / checkpoints.EMA_NAME)
        problem = "ema.pt does not match its checksum"
    elif damage == "state":
        state = checkpoints.read_state(ckpt)
        state["training"]["lr"] = 1.0  # another run's settings: a method rebuilt from them would differ
        (ckpt / checkpoints.STATE_NAME).write_text(json.dumps(state))
        problem = "state.json does not match its checksum"
    else:
        (ckpt / checkpoints.MANIFEST_NAME).unlink()
        problem = "it has no manifest.json"
    model = Path(base["model"])
    expected = f"checkpoint {ckpt} is damaged: {problem}.*another checkpoint"

    with pytest.raises(RangefinderError, match=expected):
        save_checkpoint_model(ckpt, model, tmp_path / "chosen")
    assert not (tmp_path / "chosen").exists()
    with pytest.raises(RangefinderError, match=expected):
        export_pipeline(ckpt, model, tmp_path / "whole")
    assert not (tmp_path / "whole").exists()

    grid = tmp_path / "grid"
    grid.mkdir()
    (grid / "grid.json").write_text("{}")  # an earlier grid: refused before anything is rendered, it stays whole
    with pytest.raises(RangefinderError, match=expected):
        render_grid([model, ckpt], ["a red circle"], [0], out_dir=grid, steps=1, device="cpu")
    assert sorted(p.name for p in grid.iterdir()) == ["grid.json"]
    capsys.readouterr()
    assert cli_main(["sample", "--model", str(model), "--checkpoints", str(ckpt), "--out", str(tmp_path / "cli"),
                     "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and problem in err and "Traceback" not in err, err


def drop_from_manifest(ckpt: Path, name: str) -> None:
    manifest = json.loads((ckpt / checkpoints.MANIFEST_NAME).read_text())
    del manifest["sha256"][name]
    (ckpt / checkpoints.MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["unlisted ema", "unlisted weights", "listed rng gone"])
def test_the_manifest_and_the_files_must_agree_both_ways(finished, tmp_path, damage):
    """A file the manifest does not list (an ema.pt planted in a checkpoint written without one: read_ema would load
    it) is refused where a reader reads it; a manifest without one of the required files' checksums, or listing a file
    that is gone (the resume reads every process's RNG state), fails `verify`, the resume's check."""
    ckpt = Path(shutil.copytree(finished / "checkpoints" / "checkpoint-000002", tmp_path / "checkpoint-000002"))
    if damage == "unlisted ema":
        drop_from_manifest(ckpt, checkpoints.EMA_NAME)
        with pytest.raises(RangefinderError, match="damaged: ema.pt is not in its manifest.json"):
            checkpoints.require_intact(ckpt)
        return
    if damage == "unlisted weights":
        drop_from_manifest(ckpt, checkpoints.WEIGHTS_NAME)
        assert checkpoints.verify(ckpt) == "the manifest lists no checksum for weights.safetensors"
    else:
        (ckpt / "rng-0.pt").unlink()
        assert checkpoints.verify(ckpt) == "rng-0.pt is missing"


@pytest.mark.slow
def test_a_checkpoint_found_intact_is_checked_again_once_a_file_changes(finished, tmp_path):
    """require_intact remembers a checkpoint it hashed (a grid checks its columns, then loads each), by each file's
    size and modification time: a file changed since is hashed again, not passed on the earlier check."""
    ckpt = Path(shutil.copytree(finished / "checkpoints" / "checkpoint-000002", tmp_path / "checkpoint-000002"))
    checkpoints.require_intact(ckpt)
    flip_a_byte(ckpt / checkpoints.WEIGHTS_NAME)
    with pytest.raises(RangefinderError, match="weights.safetensors does not match its checksum"):
        checkpoints.require_intact(ckpt)


@pytest.mark.slow
def test_the_checkpoint_folder_s_bookkeeping(finished, tmp_path):
    """list_checkpoints lists whole checkpoints only, keep_newest keeps exactly that many, keep_only removes every other
    checkpoint and a half-written `.tmp` one, and a chosen.json without its chosen/ is no chosen model."""
    root = Path(shutil.copytree(finished / "checkpoints", tmp_path / "checkpoints"))
    shutil.copytree(root / "checkpoint-000004", root / "checkpoint-000006")
    (root / "checkpoint-000006" / checkpoints.STATE_NAME).unlink()  # not whole
    assert [p.name for p in checkpoints.list_checkpoints(root)] == ["checkpoint-000002", "checkpoint-000004"]
    checkpoints.keep_newest(root, 1)
    assert [p.name for p in checkpoints.list_checkpoints(root)] == ["checkpoint-000004"]

    shutil.copytree(finished / "checkpoints" / "checkpoint-000002", root / "checkpoint-000002")
    shutil.copytree(root / "checkpoint-000004", root / "checkpoint-000008.tmp")
    checkpoints.keep_only(root, root / "checkpoint-000002")
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-000002"]

    run = tmp_path / "run"
    run.mkdir()
    (run / checkpoints.CHOSEN_INFO).write_text(json.dumps({"update": 2}))
    assert checkpoints.read_chosen(run) is None
    (run / checkpoints.CHOSEN_DIR).mkdir()
    assert checkpoints.read_chosen(run) == {"update": 2}


# ---------------------------------------------------------------------------------------------------------------
# Item 2: one run per output folder; a SIGKILLed run's lock does not block its resume


@pytest.mark.slow
def test_second_run_on_the_same_out_fails_naming_the_holder_and_a_killed_holder_does_not_block(base, tmp_path):
    out, marker = tmp_path / "out", tmp_path / "first-is-training"
    first = start_child({**base, "out_dir": str(out), "pause_at_update": 1, "pause_marker": str(marker)},
                        tmp_path, "first")
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.5)
        for name, resume in (("second", False), ("second-resume", True)):
            settings = {**base, "out_dir": str(out), "training": {**base["training"], "resume": resume}}
            second = start_child(settings, tmp_path, name)
            _, err = second.communicate(timeout=300)
            assert second.returncode == 2, err
            assert "is in use by another rangefinder run" in err and f"pid {first.pid} on host" in err, err
            assert "Traceback" not in err
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    assert (out / ".rangefinder.lock").exists()  # the file stays; the kernel dropped the flock with the process

    resumed = run_here(base, out, resume=True)
    assert resumed.status == "ok" and resumed.updates == 4


# ---------------------------------------------------------------------------------------------------------------
# Item 4: a save that cannot be written is one clear error; the previous checkpoint stays intact


@pytest.mark.slow
@pytest.mark.parametrize("failing", [checkpoints.WEIGHTS_NAME, checkpoints.OPTIMIZER_NAME])
def test_full_disk_mid_save_is_a_clear_error_and_the_previous_checkpoint_stays_intact(base, finished, tmp_path,
                                                                                       failing):
    # As root, chmod does not stop a write; RLIMIT_FSIZE does: no file the child writes may grow past the limit,
    # and a write past it fails with EFBIG, as a full disk fails with ENOSPC. safetensors (the weights) says so
    # with the errno; torch.save (optimizer.pt, larger than the weights: the limit lets those through) names none,
    # and its "iostream error" / "unexpected pos" was a traceback.
    cut = copy_run(finished, tmp_path / "cut")
    for p in ("final", "checkpoints/checkpoint-000004"):
        shutil.rmtree(cut / p)
    (cut / "run_summary.json").unlink()
    previous = cut / "checkpoints" / "checkpoint-000002"
    before = {p.name: p.read_bytes() for p in previous.iterdir()}
    sizes = [(previous / name).stat().st_size for name in (checkpoints.WEIGHTS_NAME, checkpoints.OPTIMIZER_NAME)]
    limit = sizes[0] // 2 if failing == checkpoints.WEIGHTS_NAME else sum(sizes) // 2

    settings = {**base, "out_dir": str(cut), "training": {**base["training"], "resume": True},
                "max_file_bytes": limit}
    child = start_child(settings, tmp_path, "full")
    _, err = child.communicate(timeout=600)
    assert child.returncode == 2, err
    assert "Traceback" not in err
    assert "cannot write checkpoint checkpoint-000004 under" in err and "GiB free" in err, err
    assert ("file too large" if failing == checkpoints.WEIGHTS_NAME else "torch.save names no reason") in err, err
    assert "checkpoint-000002 is intact" in err, err
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == before
    assert checkpoints.verify(previous) is None
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["checkpoint-000002"]  # no partial folder
    assert not (cut / "final").exists()


@pytest.mark.slow
def test_checkpoints_path_occupied_by_a_file_is_a_clear_error(base, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").write_text("not a folder")
    in_the_way = "cannot write checkpoint checkpoint-000002 under .*checkpoints: a file is in the way: .*checkpoints is"
    with pytest.raises(RangefinderError, match=in_the_way + " a file, not a folder"):
        run_here(base, out, epochs=None, steps=2)


def test_a_run_folder_mounted_read_only_names_its_intact_checkpoint_and_resume(base, finished, tmp_path):
    """A run's folder remounted read-only, then resumed: refused at its lock file, in one line that names the
    newest checkpoint as intact and says to run again with --resume. The run's folder was searched for checkpoints
    itself, not its checkpoints/ (the lock file's and the outputs' writes name the run's folder): the line named
    none. A run with none is told to run again without --resume (tests/cli/test_bad_input.py)."""
    import os
    import subprocess
    import sys

    from tests.cli.test_bad_input import read_only_mount

    out = copy_run(finished, tmp_path / "out")
    args = ["train", "--data", base["split_dir"], "--model", base["model"], "--out", str(out), "--resume",
            "--epochs", "1", "--batch-size", "4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.run([*read_only_mount(out), sys.executable, "-m", "rangefinder.cli.main", *args],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"rangefinder train: error: cannot write the run's lock file under {out}: read-only file "
                           "system"), line
    assert f"the previous checkpoint {out / 'checkpoints' / 'checkpoint-000004'} is intact" in line, line
    # Another --out has nothing to resume: said apart from --resume.
    assert line.endswith(f"mount {out} writable, then run again with --resume (another --out starts anew)"), line


@pytest.mark.slow
@pytest.mark.parametrize("writing", ["checkpoint", "outputs"])
def test_an_io_error_reads_as_one_and_the_same_on_both_write_paths(base, tmp_path, writing):
    """EIO (a failing disk or network file system), from the kernel itself: after update 1 every rename the run
    makes fails (a seccomp filter in the child). Both the checkpoint at update 2 and, with checkpoints off, final/
    are renamed into place, so each path meets it; each says "input/output error" and names the folder, neither
    calls it a full disk, neither is a traceback."""
    out = tmp_path / "out"
    training = {**base["training"], "checkpoint_every_updates": 2 if writing == "checkpoint" else None}
    child = start_child({**base, "out_dir": str(out), "training": training, "eio_at_update": 1}, tmp_path, writing)
    _, err = child.communicate(timeout=600)
    assert child.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    line = err[err.index("rangefinder train: error:"):].splitlines()[0]
    what = "checkpoint checkpoint-000002" if writing == "checkpoint" else "the run's outputs"
    where = out / "checkpoints" if writing == "checkpoint" else out
    assert f"cannot write {what} under {where}: input/output error" in line, line
    assert "GiB free" in line and "check that volume" in line and "free some space" not in line, line
    assert not (out / "final").exists() and not (out / "run_summary.json").exists()
    assert not checkpoints.list_checkpoints(out / "checkpoints")  # nothing half-written looks finished


def test_an_error_that_is_no_storage_problem_goes_on_up_as_it_is(tmp_path):
    """The write rule dresses only the errnos a storage problem raises: another OSError raised while writing (a bad
    file descriptor: a bug) is not called a full disk or a quota; it goes on up as it is (None here)."""
    import errno

    from rangefinder.training.disk import disk_problem

    assert disk_problem("checkpoint checkpoint-000002", tmp_path, OSError(errno.EBADF, "Bad file descriptor")) is None
    assert disk_problem("checkpoint checkpoint-000002", tmp_path, RuntimeError("size mismatch for conv.weight")) is None
    full = disk_problem("checkpoint checkpoint-000002", tmp_path, OSError(errno.ENOSPC, "No space left on device"))
    assert full is not None and f"cannot write checkpoint checkpoint-000002 under {tmp_path}: disk full" in str(full)

# ---------------------------------------------------------------------------------------------------------------
# Item 8: a NaN or inf loss or weight stops the run as diverged, validation off


@pytest.mark.slow
@pytest.mark.parametrize("lr", [1e30])  # an infinite LR is refused when the config is read (tests/test_config.py)
def test_huge_lr_with_validation_off_stops_as_diverged_and_saves_nothing_nan(base, tmp_path, lr):
    out = tmp_path / "out"
    result = run_here(base, out, lr=lr, checkpoint_every_updates=1, use_ema=False)
    assert result.status == "diverged" and result.updates < 4
    assert result.final_dir is None and not (out / "final").exists()
    assert json.loads((out / "run_summary.json").read_text())["status"] == "diverged"
    for ckpt in checkpoints.list_checkpoints(out / "checkpoints"):
        assert all(torch.isfinite(t).all() for t in checkpoints.read_weights(ckpt).values()), ckpt


@pytest.mark.parametrize("scaler", [None, "fp16"])
def test_an_update_is_finite_only_when_its_loss_lr_and_gradient_norm_are_and_the_weights_only_when_all_are(scaler):
    """Each of the loss, the LR and the gradient norm stops the run on its own (a NaN in one need not reach the
    others in the same update); with fp16's grad scaler an inf norm is a skipped step, not a divergence. Every trained
    tensor must be finite, not just one."""
    from types import SimpleNamespace

    from rangefinder.training.divergence import trainable_finite, update_finite

    run = SimpleNamespace(accelerator=SimpleNamespace(scaler=scaler))
    ok = {"train_loss": 0.1, "lr": 1e-4, "grad_norm": 2.0}
    assert update_finite(run, ok)
    for key in ("train_loss", "lr"):
        for bad in (float("nan"), float("inf")):
            assert not update_finite(run, {**ok, key: bad}), (key, bad)
    assert update_finite(run, {**ok, "grad_norm": float("inf")}) == (scaler is not None)
    tensors = [torch.zeros(2), torch.tensor([0.0, float("nan")])]
    assert not trainable_finite(SimpleNamespace(trainable=tensors))
    assert trainable_finite(SimpleNamespace(trainable=tensors[:1]))


@pytest.mark.slow
def test_full_disk_while_writing_final_is_a_clear_error(base, finished, tmp_path):
    # No checkpoints here: the first large file the run writes is final/'s UNet, and it cannot grow past the limit.
    # The curve CSVs, final/ and run_summary.json fail as one sentence too, not only the checkpoints.
    limit = (finished / "final" / "unet" / "diffusion_pytorch_model.safetensors").stat().st_size // 2
    out = tmp_path / "out"
    settings = {**base, "out_dir": str(out), "training": {**base["training"], "checkpoint_every_updates": None},
                "max_file_bytes": limit}
    child = start_child(settings, tmp_path, "final")
    _, err = child.communicate(timeout=600)
    assert child.returncode == 2, err
    assert "Traceback" not in err
    assert f"cannot write the run's outputs under {out}" in err and "GiB free" in err, err
    assert not (out / "final").exists() and not (out / "run_summary.json").exists()  # nothing looks finished


class _SigtermAt:
    """A metric sink that sends this process SIGTERM as it logs update `update` (an eviction mid-run)."""

    def __init__(self, update: int) -> None:
        self.update = update

    def log_metrics(self, metrics, step):
        if step == self.update and "train_loss" in metrics:
            signal.raise_signal(signal.SIGTERM)


def test_the_preempted_lines_start_lines_of_their_own_in_a_log(base, tmp_path, capfd):
    """In a log that is no terminal (a pod's, CI's, `2> file`) a bar's line ends in a carriage return: the SIGTERM
    notice and the line saying the run was preempted (printed by the CLI and a step as they catch Preempted) were
    written onto the bar's state. Each starts a line of its own: the bar is closed once the loop stops, before the
    error is caught."""
    from rangefinder.errors import Preempted

    spec = TrainSpec(TrainingConfig(**base["training"]), ValidationConfig(**base["validation"]),
                     split_dir=base["split_dir"], model=base["model"])
    try:
        train(spec, out_dir=tmp_path / "out", metric_sink=_SigtermAt(1))
    except Preempted as e:
        assert "stopped by SIGTERM at update 1 of 4" in str(e)
        err = capfd.readouterr().err  # what is written when the CLI writes its line (the error still alive)
    else:
        raise AssertionError("not preempted")
    lines = err.split("\n")
    assert "rangefinder: SIGTERM: finishing the current update, then writing a checkpoint" in lines, err[-600:]
    assert "train (constant)" in err and err.endswith("\n"), repr(err[-300:])


def test_a_checkpoint_s_model_is_rebuilt_on_the_base_model_s_variant(finished, tiny_model_dir, tmp_path):
    """model.variant on a base folder holding the variant beside the plain weights: the run trained on the variant,
    and its checkpoints were rebuilt (chosen/, the window average's final/, a checkpoint's grid column) on the plain
    weights, which diffusers loads unless told. The parts the run did not train (the VAE here) are the variant's."""
    from safetensors.torch import save_file

    from rangefinder.training.restore import method_from_checkpoint

    both = tmp_path / "both"
    shutil.copytree(tiny_model_dir, both)
    key = "decoder.conv_out.weight"
    for weights in both.glob("*/*.safetensors"):
        tensors = {k: v.half() for k, v in load_file(str(weights)).items()}
        if weights.parent.name == "vae":
            tensors[key] = -tensors[key]  # the variant is other weights than the plain
        save_file(tensors, str(weights.with_name(weights.name.replace(".safetensors", ".fp16.safetensors"))))
    ckpt = finished / "checkpoints" / "checkpoint-000004"
    plain = load_file(str(both / "vae" / "diffusion_pytorch_model.safetensors"))[key]
    assert torch.equal(method_from_checkpoint(ckpt, both)[1].vae.state_dict()[key], plain)
    rebuilt = method_from_checkpoint(ckpt, both, "fp16")[1].vae.state_dict()[key]
    assert torch.equal(rebuilt, -plain.half().float())
