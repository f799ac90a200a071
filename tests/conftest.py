"""Session fixtures shared by every test: the embedded tiny model, a small shapes dataset and its split.

The model and the dataset are cached on disk across sessions (under $RANGEFINDER_CACHE or ~/.cache/rangefinder),
keyed by the code that makes them, so only the first session pays for building them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadscope`). The scheduler below hands out
# whole test files, so a file's module fixtures are made once, on one worker; the files below share the
# session-scoped whole run of the unchanged demo (`demo_run`, tests/pipelines/conftest.py) and go together, so that
# run is made once too. (xdist's own `loadgroup` marks do not work with pytest 9.2: they rename `item._nodeid`, which
# pytest no longer reads.) (test_demo_sdxl.py does not read that run: it is its own group, free to go to the
# other worker.)
# The same for bench.versus's SD 1.x smoke case (`sd1_versus_smoke`, tests/bench/conftest.py): checked whole by
# test_versus.py, and the case the probes of the other two files re-run (a) from. group -> its files.
SHARED_FIXTURE_GROUPS = {
    "pipelines:demo-run": ("tests/pipelines/test_demo_learns.py", "tests/pipelines/test_local_run.py",
                           "tests/pipelines/test_reports_in_browser.py"),
    "bench:versus-smoke": ("tests/bench/test_versus.py", "tests/bench/test_timesteps_probe.py",
                           "tests/bench/test_seed_soup_probe.py"),
}
_GROUP_OF = {path: group for group, paths in SHARED_FIXTURE_GROUPS.items() for path in paths}
# The groups that take minutes go first, so that neither worker is left with one at the end. xdist's scope
# scheduling hands a worker its next group whenever it has 2 tests or fewer left, in the order of the queue, so the
# longest first is the classic longest-processing-time packing. That order is this hook's only if xdist does not
# re-sort the groups: by default (`--loadscope-reorder`) it queues them by their number of tests, most first. In the
# 858-test 2-worker run of 2026-11-26 that dealt the 304 s one-test demo group (tests/pipelines/test_demo_learns.py)
# 34th of gw1's 37 groups; the workers still ended within about 30 s of each other only because gw0's last groups
# (test_outbox, test_server_loss, ...) happened to add up to about as long. `FileGroups` turns the re-sort off.
# After it, the groups in the order of their time in the 1096-test 2-worker run of 2026-11-29 (--durations, all
# groups of half a minute or more), so that the last groups dealt are the many short ones.
LONG_FIRST = ("pipelines:demo-run", "bench:versus-smoke", "tests/pipelines/test_local_run_prodigy_step.py",
              "tests/steps/test_processes.py", "tests/pipelines/test_local_run_errors.py",
              "tests/pipelines/test_components.py", "tests/steps/test_halving.py",
              "tests/bench/test_discovery_quality.py", "tests/training/test_resume.py", "tests/tracking/test_outbox.py",
              "tests/methods/test_discovery_by_method.py", "tests/methods/test_with_engine.py",
              "tests/steps/test_trainjob_lifecycle.py", "tests/bench/test_range_noise.py",
              "tests/training/test_samples.py", "tests/cli/test_train.py", "tests/tracking/test_server_loss.py",
              "tests/bench/test_speed_vs_reference.py", "tests/training/test_compile.py",
              "tests/steps/test_average.py", "tests/training/test_optimizers.py", "tests/analysis/test_lr_bounds.py")


def _group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return _GROUP_OF.get(path, path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {g: i for i, g in enumerate(LONG_FIRST)}
    items.sort(key=lambda it: rank.get(_group(it.nodeid), len(rank)))  # stable: every file keeps its own order


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        """xdist's scope scheduling, one scope per group of `_group`."""

        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    config.option.loadscopereorder = False  # keep LONG_FIRST's order (see above)
    return FileGroups(config, log)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread_per_worker():
    """Two workers on two cores: each computes on one torch thread, else the four threads spin waiting for each
    other's cores. A plain `pytest` run keeps torch's default. Child processes are left alone (OMP_NUM_THREADS is
    not set): the tests that start training processes set their threads themselves, and tests/pipelines reads a
    local run's thread count back, which an inherited setting would make pass for any code."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def mlflow_environment_put_back():
    """What a test leaves in the process's MLFLOW_* environment is put back after it, so no test reads another's:
    46 tests left $MLFLOW_TRACKING_URI (tracking.step_run and tracking_client set it; a run_<step>() and the CLI's
    main() put back what they set, steps.kept_settings) or the $MLFLOW_HTTP_REQUEST_* limits
    (tracking.target.bound_http_requests) to every later test in their worker, and an experiment id there
    ($MLFLOW_EXPERIMENT_ID, which mlflow.set_experiment sets) wins over a test's own experiment. Fixtures of a wider
    scope are set up before it, so what they set stays."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    yield
    for k in [k for k in os.environ if k.startswith("MLFLOW_") and k not in saved]:
        del os.environ[k]
    os.environ.update(saved)


@pytest.fixture
def one_thread_as_a_local_run(monkeypatch):
    """The training steps on one torch thread, as a local run's step processes train (pipelines.local_run sets
    RANGEFINDER_TORCH_THREADS=1; launch.processes applies it): on two busy cores torch's default threads wait for each
    other (161 s for the full fine-tune's chain instead of 30 s). The test process's own count is put back."""
    import torch

    from rangefinder.launch.processes import THREADS_ENV

    before = torch.get_num_threads()
    monkeypatch.setenv(THREADS_ENV, "1")
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def new_mlflow_stores_from_a_template():
    """Every new SQLite MLflow store this process opens starts as a copy of one migrated, empty store instead of
    running MLflow's migrations again (about 10 s each; tests/mlflow_store.py). Child processes migrate as usual. And
    each fork of this process first closes MLflow's open SQLite connections (mlflow_store.close_sqlite_connections)."""
    from tests import mlflow_store

    mlflow_store.install()
    yield


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The embedded tiny Stable Diffusion folder (diffusers layout), copied from the shipped weights once and cached."""
    from rangefinder.models.tiny import ensure_tiny_base_model

    return ensure_tiny_base_model()


@pytest.fixture(scope="session")
def tiny_sdxl_dir() -> Path:
    """The embedded tiny SDXL folder (diffusers layout; models/tiny_sdxl.py), copied from the shipped weights once."""
    from rangefinder.models.tiny_sdxl import ensure_tiny_sdxl_model

    return ensure_tiny_sdxl_model()


@pytest.fixture(scope="session")
def tiny_sd3_dir() -> Path:
    """The embedded tiny SD3 folder (diffusers layout; models/tiny_sd3.py), copied from the shipped weights once."""
    from rangefinder.models.tiny_sd3 import ensure_tiny_sd3_model

    return ensure_tiny_sd3_model()


@pytest.fixture(scope="session")
def tiny_flux_dir() -> Path:
    """The embedded tiny Flux folder (diffusers layout; models/tiny_flux.py), copied from the shipped weights once."""
    from rangefinder.models.tiny_flux import ensure_tiny_flux_model

    return ensure_tiny_flux_model()


@pytest.fixture(scope="session")
def tiny_schnell_dir(tiny_flux_dir, tmp_path_factory) -> Path:
    """The tiny Flux folder as FLUX.1-schnell has it: a transformer without the guidance embedding (its config's
    guidance_embeds false; diffusers leaves the dev model's guidance weights unread)."""
    import json
    import shutil

    folder = tmp_path_factory.mktemp("tiny-schnell") / "model"
    shutil.copytree(tiny_flux_dir, folder)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "guidance_embeds": False}))
    return folder


@pytest.fixture
def base_model_dir(request: pytest.FixtureRequest) -> Path:
    """The tiny model of the family a test is parametrised with (`family`: "sd1" or "sdxl")."""
    family = request.getfixturevalue("family")
    return request.getfixturevalue({"sd1": "tiny_model_dir", "sdxl": "tiny_sdxl_dir"}[family])


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


# Mixed shapes for aspect-ratio buckets: (width, height) px of each image. At 32 px with the default bucket step
# (8) and max aspect (2) the buckets are 24x40, 32x32 and 40x24: portraits, squares and landscapes, five of each,
# with odd sizes, a 3:1 strip (cropped to 5:3) and images smaller than the bucket (enlarged).
MIXED_SIZES = (
    (48, 80), (30, 50), (45, 61), (20, 41), (33, 100),  # portrait
    (64, 64), (40, 40), (37, 33), (29, 31), (32, 32),  # square-ish
    (80, 48), (64, 36), (61, 45), (41, 23), (100, 33),  # landscape
)


@pytest.fixture(scope="session")
def mixed_aspect_dataset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """15 real PNGs of portrait, landscape, square and odd sizes (MIXED_SIZES) with .txt captions: the synthetic
    shapes, each drawn at 96 px and resized to its size (so it is squashed or stretched, as a photo's content
    would not be, but every pixel is a real decoded image)."""
    from rangefinder.data.synthetic import render_item

    out = tmp_path_factory.mktemp("mixed-aspect")
    for i, size in enumerate(MIXED_SIZES):
        img, caption = render_item("shapes", 3, i, resolution=96)
        img.resize(size).save(out / f"img{i:02d}_{size[0]}x{size[1]}.png")
        (out / f"img{i:02d}_{size[0]}x{size[1]}.txt").write_text(caption + "\n")
    return out


def set_up_engine(spec, out_dir: Path):
    """A run's settings, accelerator, model and family, set up as the engine sets them up before it encodes anything
    (`training.setup`: check_settings, start_accelerator, load_model), for tests of what comes after."""
    from rangefinder.training.setup import check_settings, load_model, start_accelerator

    settings = check_settings(spec, out_dir)
    accelerator = start_accelerator(settings.cfg)
    return settings, accelerator, *load_model(settings, accelerator)


def delivered_files(base_model: Path, method: str, out: Path) -> Path:
    """`out` holding the files `method` delivers on the base model folder `base_model`, written through the method's own
    `save_final` as a run's end writes them (the adapters as they start: what is read is the files' names, layout and
    metadata, which name `base_model`)."""
    import torch

    from rangefinder.config import ModelConfig, TrainingConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.methods import make_method

    sd = load_sd_components(ModelConfig(base_model=str(base_model)))
    trainer = make_method(TrainingConfig(method=method))
    trainer.setup(sd, torch.float32)
    trainer.save_final(sd, out)
    return out
