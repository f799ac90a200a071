"""The latent cache at scale: encoded to disk batch by batch with progress, and a killed caching run keeps its work."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import torch
    from diffusers import AutoencoderKL
    from rangefinder.data.pixels import load_rgb, to_model_array
    from rangefinder.formats.digest import file_sha256
    from rangefinder.training.caching import LatentCache, VaeEncoder

    torch.set_num_threads(1)
    model, data, folder, kill_at = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    paths = sorted(data.glob("*.png"))
    loaded = []

    def load(path):  # the crash: SIGKILL (no cleanup) while loading image number kill_at
        loaded.append(path)
        if len(loaded) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return to_model_array(load_rgb(path), 32)

    vae = AutoencoderKL.from_pretrained(os.path.join(model, "vae"))
    cache = LatentCache(VaeEncoder(vae, torch.device("cpu"), "sample", 3), load, folder, batch_size=2)
    cache.ensure(paths, [file_sha256(p) for p in paths], flipped=True)
    """
)


def _ensure(model: Path, data: Path, folder: Path, kill_at: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", CHILD, str(model), str(data), str(folder), str(kill_at)],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_a_killed_caching_run_keeps_its_finished_entries_and_the_next_encodes_only_the_rest(
    shapes_dataset_dir, tiny_model_dir, tmp_path
):
    data = tmp_path / "data"
    data.mkdir()
    for png in sorted(Path(shapes_dataset_dir).glob("*.png"))[:8]:
        shutil.copy(png, data / png.name)
    folder = tmp_path / "cache"

    # Killed while loading the 5th image: batches 1 and 2 (4 images) are written, batch 3 never is.
    killed = _ensure(tiny_model_dir, data, folder, kill_at=5)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert "encode latents" in killed.stderr and "0/8" in killed.stderr  # progress, on stderr
    entries = sorted(folder.glob("*.safetensors"))
    assert len(entries) == 4
    assert all(set(load_file(str(e))) == {"latent", "flipped"} for e in entries)  # whole entries only

    # The next run (here, in this process) encodes the other four; its entries equal a never-killed run's.
    from diffusers import AutoencoderKL

    from rangefinder.data.pixels import load_rgb, to_model_array
    from rangefinder.formats.digest import file_sha256
    from rangefinder.training.caching import LatentCache, VaeEncoder

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
