"""A throwaway virtual environment with transformers 4.x, to load our diffusers folders with the real 4.x loaders.

Built once per cache (under $RANGEFINDER_CACHE or ~/.cache/rangefinder) with pip from the package index this machine
is configured for: transformers 4.57 and what it needs at other versions than here (huggingface_hub, tokenizers).
Everything else, torch included, is this interpreter's own, read through a `.pth` file after the venv's own
site-packages: so the 4.x loaders run on the torch the tests run on, and building the venv downloads a few MB, not a
second torch (on a clean machine that install was a minute of the suite). When it cannot be built (no index
reachable), the tests that need it are skipped, saying why.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

TRANSFORMERS_4 = "transformers==4.57.*"


@pytest.fixture(scope="session")
def transformers4_python() -> Path:
    from filelock import FileLock

    from rangefinder.models.tiny import default_cache_dir

    # This interpreter's packages, by path: a venv made for one environment is not reused by another.
    ours = list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    key = hashlib.sha256("\n".join(ours).encode()).hexdigest()[:12]
    root = default_cache_dir() / "venvs" / f"transformers4.57-over-{key}"
    python = root / "bin" / "python"
    done = root / ".complete"
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if not done.is_file():
            venv.EnvBuilder(clear=True, with_pip=True).create(root)
            site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True, timeout=60).stdout.strip()
            (Path(site) / "rangefinder-tests-base.pth").write_text("".join(f"{p}\n" for p in ours))
            # pip sees this interpreter's packages as installed and keeps them (torch, numpy, safetensors, ...); what
            # transformers 4.57 pins otherwise goes into the venv, ahead of ours on its path.
            cmd = [str(python), "-m", "pip", "install", "--quiet", TRANSFORMERS_4, "safetensors"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            if proc.returncode != 0:
                pytest.skip(f"could not build a transformers 4.x venv in {root} (pip said: "
                            f"{proc.stderr.strip().splitlines()[-1:]}); the 4.x loading test needs one")
            done.write_text(sys.version + "\n")
    return python
