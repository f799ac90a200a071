"""The latent cache at scale: encoded to disk batch by batch with progress, and a killed caching run keeps its work."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

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
