"""Session fixtures shared by every test: the embedded tiny model, a small shapes dataset and its split.

The model and the dataset are cached on disk across sessions (under $RANGEFINDER_CACHE or ~/.cache/rangefinder),
keyed by the code that makes them, so only the first session pays for building them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The embedded tiny Stable Diffusion folder (diffusers layout), built once (about a minute) and cached."""
    from rangefinder.models.tiny import ensure_tiny_base_model

    return ensure_tiny_base_model()


@pytest.fixture(scope="session")
def shapes_dataset_dir() -> Path:
    """20 synthetic 32 px images with .txt captions (`rangefinder make-dataset --kind shapes --count 20 --seed 0`)."""
    from rangefinder.data import synthetic
    from rangefinder.models.tiny import default_cache_dir

    code = hashlib.sha256(Path(synthetic.__file__).read_bytes()).hexdigest()[:12]
    out = default_cache_dir() / "datasets" / f"shapes-20-seed0-32px-{code}"
    synthetic.make_synthetic_dataset(out, kind="shapes", count=20, seed=0, resolution=32)
    return out


@pytest.fixture(scope="session")
def split_dir(shapes_dataset_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default split of `shapes_dataset_dir` (val 0.2, stabilize 0.2, seed 555): 16 train, 4 val, 4 stabilize."""
    from rangefinder.data.split import split_dataset

    out = tmp_path_factory.mktemp("split")
    split_dataset(shapes_dataset_dir, out, val_split=0.2, stabilize_split=0.2, seed=555)
    return out


HUB_REPO = "rangefinder-tests/tiny-sd"  # the tiny model as a hub repo in a fake, offline Hugging Face cache


@pytest.fixture(scope="session")
def fake_hub_cache(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(cache folder, commit): the tiny model as hub repo HUB_REPO in the Hugging Face cache layout (refs main and
    v1 at one commit). Point HF_HUB_CACHE at the folder and set HF_HUB_OFFLINE=1 to load it by its id."""
    from tests.models.fake_hub import make_cached_repo

    cache = tmp_path_factory.mktemp("hf-hub-cache")
    commit = make_cached_repo(cache, HUB_REPO, tiny_model_dir, refs=("main", "v1"))
    return cache, commit
