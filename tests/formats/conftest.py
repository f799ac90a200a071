"""A throwaway virtual environment with transformers 4.x, to load our diffusers folders with the real 4.x loaders.

Built once per cache (under $RANGEFINDER_CACHE or ~/.cache/rangefinder, a minute or two) with pip from the package
index this machine is configured for: the same torch release as here, transformers 4.57. When it cannot be built
(no index reachable), the tests that need it are skipped, saying why.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

TRANSFORMERS_4 = "transformers==4.57.*"


@pytest.fixture(scope="session")
def transformers4_python() -> Path:
    import torch
    from filelock import FileLock

    from rangefinder.models.tiny import default_cache_dir

    torch_release = torch.__version__.split("+", 1)[0]  # the public release; pip takes the local wheel for it
    root = default_cache_dir() / "venvs" / f"transformers4.57-torch{torch_release}"
    python = root / "bin" / "python"
    done = root / ".complete"
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if not done.is_file():
            venv.EnvBuilder(clear=True, with_pip=True).create(root)
            cmd = [str(python), "-m", "pip", "install", "--quiet", f"torch=={torch_release}", TRANSFORMERS_4,
                   "safetensors"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            if proc.returncode != 0:
                pytest.skip(f"could not build a transformers 4.x venv in {root} (pip said: "
                            f"{proc.stderr.strip().splitlines()[-1:]}); the 4.x loading test needs one")
            done.write_text(sys.version + "\n")
    return python
