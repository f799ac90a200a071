"""The latent cache at scale: encoded to disk batch by batch with progress, and a killed caching run keeps its work;
a Ctrl-C inside a read is not taken for a damaged entry."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.training.test_resume import ForkedChild


def _encode_until_killed(model: str, data: str, folder: str, kill_at: int) -> None:
    """A caching run that SIGKILLs itself (no cleanup) while loading image number kill_at."""
    from diffusers import AutoencoderKL

    from rangefinder.data.pixels import load_rgb, to_model_array
    from rangefinder.formats.digest import file_sha256
    from rangefinder.training.caching import LatentCache, VaeEncoder

    torch.set_num_threads(1)
    paths = sorted(Path(data).glob("*.png"))
    loaded = []

    def load(path):
        loaded.append(path)
        if len(loaded) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return to_model_array(load_rgb(path), 32)

    vae = AutoencoderKL.from_pretrained(os.path.join(model, "vae"))
    cache = LatentCache(VaeEncoder(vae, torch.device("cpu"), "sample", 3), load, Path(folder), batch_size=2)
    cache.ensure(paths, [file_sha256(p) for p in paths], flipped=True)


def _engine_child_with_its_stderr_a_pipe(settings: dict, path: Path) -> tuple[int | None, str]:
    """engine_child.main on `settings` in a fork of this process (its imports done: a fresh `python engine_child.py`
    spent ~9 CPU-s importing before it trained), its stdout /dev/null and its stderr a pipe read here, as the fresh
    child had them (`_as_a_fresh_process` reopens the pipe's write end by its /proc path): (exit status, stderr)."""
    import json
    import multiprocessing
    import threading

    import rangefinder.training.loop  # noqa: F401  (imported before the fork, which then has it too)
    from tests.training.test_resume import _as_a_fresh_process, _engine_child_main

    path.write_text(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}))
    read_end, write_end = os.pipe()
    child = multiprocessing.get_context("fork").Process(
        target=_as_a_fresh_process, args=(os.devnull, f"/proc/self/fd/{write_end}", _engine_child_main, str(path)))
    child.start()
    os.close(write_end)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(read_end, 65536), b"")), daemon=True)
    reader.start()
    child.join(600)
    if child.exitcode is None:
        child.kill()
        child.join()
    reader.join(60)
    os.close(read_end)
    return child.exitcode, b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_a_full_disk_under_the_cache_is_one_line_naming_the_cache_and_leaves_no_torn_entry(split_dir, tiny_model_dir,
                                                                                          tmp_path):
    """A cache entry the disk refuses (RLIMIT_FSIZE in the child: EFBIG, as a full disk fails with ENOSPC) is the
    run's one-line disk error naming the cache folder and the setting that moves it; it was safetensors' traceback
    ("No space left on device (os error 28)"). Nothing torn or temporary stays in the cache."""
    cache = tmp_path / "cache"
    settings = {"split_dir": split_dir, "model": tiny_model_dir, "out_dir": tmp_path / "out",
                "training": {"batch_size": 4, "steps": 1, "lr": 1e-4, "cache_dir": str(cache)},
                "validation": {"every_epochs": 0}, "max_file_bytes": 600}  # an entry at 32 px is over 1 KiB
    # A process of its own whose stderr is a pipe: the limit holds for every file it writes, a log file too.
    returncode, err = _engine_child_with_its_stderr_a_pipe(settings, tmp_path / "full.json")
    assert returncode == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"rangefinder train: error: cannot write the encoded-data cache under "
                           f"{cache / 'encoded' / 'latents'}/"), line
    assert "file too large" in line and "point training.cache_dir (or $RANGEFINDER_CACHE) at another disk" in line
    assert not [p for p in cache.rglob("*") if p.is_file()]  # no entry was whole, none is there


def _ensure(model: Path, data: Path, folder: Path, kill_at: int) -> subprocess.CompletedProcess:
    """That run in a process of its own: a fork of this one (its imports done; see test_resume.start_child)."""
    tmp = folder.parent
    child = ForkedChild(tmp / "caching", tmp / "caching.out", tmp / "caching.err", target=_encode_until_killed,
                        args=(str(model), str(data), str(folder), kill_at))
    out, err = child.communicate(timeout=600)
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


@pytest.mark.slow
def test_a_killed_caching_run_keeps_its_finished_entries_and_the_next_encodes_only_the_rest(
    shapes_dataset_dir, tiny_model_dir, tmp_path
):
    data = tmp_path / "data"
    data.mkdir()
    for png in sorted(Path(shapes_dataset_dir).glob("*.png"))[:8]:
        shutil.copy(png, data / png.name)
    folder = tmp_path / "cache"

    from diffusers import AutoencoderKL  # imported before the fork, which then has it too

    from rangefinder.data.pixels import load_rgb, to_model_array
    from rangefinder.formats.digest import file_sha256
    from rangefinder.training.caching import LatentCache, VaeEncoder

    # Killed while loading the 5th image: batches 1 and 2 (4 images) are written, batch 3 never is.
    killed = _ensure(tiny_model_dir, data, folder, kill_at=5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert "encode latents" in killed.stderr and "0/8" in killed.stderr  # progress, on stderr
    entries = sorted(folder.glob("*.safetensors"))
    assert len(entries) == 4
    assert all(set(load_file(str(e))) == {"latent", "flipped"} for e in entries)  # whole entries only

    # The next run (here, in this process) encodes the other four; its entries equal a never-killed run's.
    paths = sorted(data.glob("*.png"))
    keys = [file_sha256(p) for p in paths]
    vae = AutoencoderKL.from_pretrained(os.path.join(tiny_model_dir, "vae"))

    def cache(where: Path) -> LatentCache:
        return LatentCache(VaeEncoder(vae, torch.device("cpu"), "sample", 3),
                           lambda p: to_model_array(load_rgb(p), 32), where, batch_size=2)

    resumed, whole = cache(folder), cache(tmp_path / "whole")
    z, zf = resumed.latents(paths, keys, flipped=True)
    assert resumed.stats.as_dict() == {"encoded": 4, "reused": 4}
    wz, wzf = whole.latents(paths, keys, flipped=True)
    assert whole.stats.as_dict() == {"encoded": 8, "reused": 0}
    assert zf is not None and wzf is not None and torch.equal(z, wz) and torch.equal(zf, wzf)
    names = sorted(p.name for p in folder.glob("*.safetensors"))
    assert names == sorted(f"{k}.safetensors" for k in keys)
    assert sorted(p.name for p in folder.iterdir()) == names  # no temporary file left behind


def sigint_inside_the_next_cache_read(inside: object = None) -> None:
    """A real SIGINT, raised in this process at the moment a Ctrl-C surfaced as another error: while safetensors
    builds a tensor from an entry, torch sizes it by reading the storage's first element, UntypedStorage.__getitem__
    (0), Python code torch calls from C; a KeyboardInterrupt raised there comes out as torch's ValueError. A profile
    hook finds that moment (with `inside`, a code object: the first such read under a frame running it)."""
    getitem = torch.UntypedStorage.__getitem__.__code__

    def under(frame) -> bool:
        while frame is not None and frame.f_code is not inside:
            frame = frame.f_back
        return frame is not None

    def hook(frame, event, arg) -> None:
        if (event == "call" and frame.f_code is getitem and frame.f_locals.get("args") == (0,)
                and (inside is None or under(frame))):
            sys.setprofile(None)
            signal.raise_signal(signal.SIGINT)

    sys.setprofile(hook)


@pytest.fixture
def sigint_at_pythons_default():
    """SIGINT raises KeyboardInterrupt here, as in a command in a terminal's foreground (a suite started in the
    background ignores it; tests/cli/test_train.py)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_inside_a_cache_read_is_not_taken_for_a_damaged_entry(tmp_path, sigint_at_pythons_default):
    """A deleted or torn entry is the cache's problem: a DataError naming it (an entry read per micro-batch), or
    encoded again (one read while encoding). A Ctrl-C that lands inside the read of a whole entry is not: it came out
    as torch's ValueError, was reported as a damaged cache and the step's MLflow run ended FAILED. Under on_sigint, as
    train() runs, it leaves as KeyboardInterrupt; an error without a SIGINT leaves as it is."""
    from rangefinder.errors import DataError, on_sigint
    from rangefinder.training.caching import _read_tensor, _try_load

    entry = tmp_path / "entry.safetensors"
    save_file({"latent": torch.randn(4, 8, 8)}, str(entry))
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(entry.read_bytes()[:-1])
    for bad in (torn, tmp_path / "deleted.safetensors"):
        with pytest.raises(DataError, match=f"cache entry {bad} cannot be read any more"):
            _read_tensor(bad, "latent")
        assert _try_load(bad) is None

    for read in (lambda: _read_tensor(entry, "latent"), lambda: _try_load(entry)):
        sigint_inside_the_next_cache_read()
        try:
            with pytest.raises(BaseException) as interrupted:  # torch's ValueError (KeyboardInterrupt in a later torch)
                read()
        finally:
            sys.setprofile(None)
        assert not isinstance(interrupted.value, DataError), interrupted.value
        sigint_inside_the_next_cache_read()
        try:
            with pytest.raises(KeyboardInterrupt), on_sigint():
                read()
        finally:
            sys.setprofile(None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    with pytest.raises(DataError, match="cannot be read any more"), on_sigint():
        _read_tensor(torn, "latent")


def test_every_setting_a_latent_depends_on_keys_its_folder(tiny_model_dir):
    """A latent is made by the VAE's weights, the square's resolution or the bucket, the crop, and the distribution's
    mode or a sample with its seed: change any one and the latents are another folder's, never the ones made before
    (a stale latent trains silently at the wrong size, crop or noise). The mode draws nothing: its seed is no part."""
    import copy

    from diffusers import AutoencoderKL

    from rangefinder.training.caching import VaeEncoder, latent_cache_dir

    vae = AutoencoderKL.from_pretrained(os.path.join(tiny_model_dir, "vae"))
    retrained = copy.deepcopy(vae)  # the same VAE but one weight: another base model's
    with torch.no_grad():
        next(retrained.parameters()).view(-1)[0] += 0.5

    def folder(vae=vae, sampling="sample", seed=3, resolution=32, crop=True, bucket=None) -> Path:
        encoder = VaeEncoder(vae, torch.device("cpu"), sampling, seed)
        return latent_cache_dir(Path("cache"), encoder, resolution, crop, bucket=bucket)

    first = folder()
    assert folder() == first and folder(sampling="mode", seed=4) == folder(sampling="mode")
    others = [folder(vae=retrained), folder(sampling="mode"), folder(seed=4), folder(resolution=40),
              folder(crop=False), folder(bucket=(40, 24)), folder(bucket=(24, 40)), folder(bucket=(40, 24), crop=False),
              folder(bucket=(40, 24), seed=4)]
    assert len({first, *others}) == 1 + len(others)


def test_a_run_with_flips_encodes_the_mirrored_latents_a_run_without_them_left_out(shapes_dataset_dir, tiny_model_dir,
                                                                                  tmp_path):
    """One cache for a run without random_flip, then one with it: the entries lack the mirrored images' latents, so
    the second run encodes them (never reads an entry that does not hold them); a third finds everything."""
    from diffusers import AutoencoderKL

    from rangefinder.data.pixels import load_rgb, to_model_array
    from rangefinder.formats.digest import file_sha256
    from rangefinder.training.caching import LatentCache, VaeEncoder

    paths = sorted(Path(shapes_dataset_dir).glob("*.png"))[:2]
    keys = [file_sha256(p) for p in paths]
    vae = AutoencoderKL.from_pretrained(os.path.join(tiny_model_dir, "vae"))

    def cache() -> LatentCache:
        return LatentCache(VaeEncoder(vae, torch.device("cpu"), "sample", 3),
                           lambda p: to_model_array(load_rgb(p), 32), tmp_path / "cache", batch_size=2)

    plain = cache()
    assert plain.latents(paths, keys, flipped=False, progress=False)[1] is None
    flipping = cache()
    z, mirrored = flipping.latents(paths, keys, flipped=True, progress=False)
    assert flipping.stats.as_dict() == {"encoded": 2, "reused": 0}
    assert mirrored is not None and mirrored.shape == z.shape and not torch.equal(mirrored, z)
    again = cache()
    again.latents(paths, keys, flipped=True, progress=False)
    assert again.stats.as_dict() == {"encoded": 0, "reused": 2}


def test_a_run_without_flips_keeps_the_mirrored_latents_another_run_wrote_meanwhile(shapes_dataset_dir,
                                                                                     tiny_model_dir, tmp_path):
    """Two runs at once on one cache, one with random_flip: the one without it found the entries missing, encoded
    them, and wrote its latent alone over the entry the other had written meanwhile with its mirrored latent, so the
    other's training then failed on an entry it had made ('cache entry ... cannot be read any more')."""
    from diffusers import AutoencoderKL
    from safetensors import safe_open

    from rangefinder.data.pixels import load_rgb, to_model_array
    from rangefinder.formats.digest import file_sha256
    from rangefinder.training.caching import LatentCache, VaeEncoder

    paths = sorted(Path(shapes_dataset_dir).glob("*.png"))[:2]
    keys = [file_sha256(p) for p in paths]
    vae = AutoencoderKL.from_pretrained(os.path.join(tiny_model_dir, "vae"))
    flipping = LatentCache(VaeEncoder(vae, torch.device("cpu"), "sample", 3),
                           lambda p: to_model_array(load_rgb(p), 32), tmp_path, batch_size=2)

    def load_while_the_other_run_caches(path: Path):
        if not flipping.stats.encoded:  # after this run's look at the cache, before its writes
            flipping.ensure(paths, keys, flipped=True, progress=False)
        return to_model_array(load_rgb(path), 32)

    plain = LatentCache(VaeEncoder(vae, torch.device("cpu"), "sample", 3), load_while_the_other_run_caches, tmp_path,
                        batch_size=2)
    plain.ensure(paths, keys, flipped=False, progress=False)
    assert flipping.stats.encoded == 2
    for key in keys:
        with safe_open(str(flipping.entry_path(key)), framework="pt") as f:
            assert set(f.keys()) == {"latent", "flipped"}
