"""`rangefinder demo`: the whole pipeline on the embedded default (synthetic shapes on white, tiny model), here.

It makes the dataset and the base model when missing, runs every step through kfp.local, and prints the LR bounds,
the midpoint, the recommended epochs and where the reports are. Everything it writes goes under --out, including the
MLflow store (`sqlite:///<out>/mlflow.db`) unless MLFLOW_TRACKING_URI is set.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rangefinder.cli.output import add_json_flag

# The embedded dataset: enough images for a 20 % validation split with several points per ramp on 2 CPU cores.
DEMO_IMAGES = 20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole pipeline on the embedded default dataset and tiny model",
        description="Make the synthetic dataset and the tiny base model if missing, run every step locally "
        "(kfp.local), and print the LR it trained at and where it came from (the LR range test's bounds and "
        "midpoint, or on sdxl, sd3 and flux a Prodigy run's step size), the recommended epochs and the report paths.",
    )
    p.add_argument("--out", default="rangefinder-demo", help="output folder (default ./rangefinder-demo)")
    p.add_argument("--retrain", action="store_true", help="also retrain on all data for the recommended epochs")
    p.add_argument("--lr", type=float, help="a fixed learning rate: skips LR discovery (the LR range test, or the "
                   "Prodigy run lr_finder auto makes on sdxl, sd3 and flux)")
    p.add_argument("--family", choices=("sd1", "sdxl", "sd3", "flux"), default="sd1",
                   help="which embedded tiny model to run on: SD 1.x (default), SDXL, SD3.5 or Flux.1; the engine "
                   "reads the family from the model, as for any base model")
    p.add_argument("--verbose", action="store_true",
                   help="stream every step's log on stderr instead of to OUT/pipeline.log")
    add_json_flag(p)
    p.set_defaults(func=run)


def demo_model_cache(out: Path, family: str = "sd1") -> Path:
    """Where the tiny model is read or built: $RANGEFINDER_CACHE, else the user cache when it already holds the
    model (reading it writes nothing), else a cache inside --out (everything the demo writes stays there)."""
    from rangefinder.models import tiny, tiny_flux, tiny_sd3, tiny_sdxl

    if os.environ.get("RANGEFINDER_CACHE"):
        return tiny.default_cache_dir()
    shared = tiny.default_cache_dir()
    name = {"sdxl": lambda: tiny_sdxl.cache_name(tiny_sdxl.TinySdxlSettings()),
            "sd3": lambda: tiny_sd3.cache_name(tiny_sd3.TinySd3Settings()),
            "flux": lambda: tiny_flux.cache_name(tiny_flux.TinyFluxSettings())}.get(
        family, lambda: tiny.cache_name(tiny.TinyModelSettings()))()
    if (shared / name / "model_index.json").is_file():
        return shared
    return out / "cache"


def demo_settings(out: Path, retrain: bool = False, lr: float | None = None, family: str = "sd1"):
    """The demo's config for `out`, validated, but for its base model, which prepare_demo makes: nothing written."""
    from rangefinder.config import auto_lr_finder, demo_run_config

    dataset = out / "dataset"
    overrides: dict = {"data": {"dataset_dir": str(dataset)}, "retrain": {"enabled": retrain}}
    if not os.environ.get("RANGEFINDER_CACHE"):
        # The encoded latents and captions are written too: keep them under --out with the rest.
        overrides["training"] = {"cache_dir": str(out / "cache")}
    if lr is not None:
        overrides["lr"] = lr
    if family == "sd3":  # the demo's DDIM samples DDPM models; SD3 samples with its own flow-matching Euler
        overrides["sampling"] = {"scheduler": None}
    if family == "flux":  # so does Flux, at its own guidance scale (FluxPipeline's: the distilled guidance input, 3.5)
        overrides["sampling"] = {"scheduler": None, "guidance_scale": None}
    # Where lr_finder auto measures the demo's full fine-tune with prodigy_step (SDXL, SD3, Flux), the range test's
    # bounds (the demo's, for SD 1.x) would go unused.
    if auto_lr_finder(family, "full") == "prodigy_step":
        overrides["lr_range_test"] = {"lr_min": None, "lr_max": None}
    return demo_run_config(**overrides)


def prepare_demo(out: Path, retrain: bool = False, lr: float | None = None, family: str = "sd1"):
    """The demo's config, with its dataset and base model made under `out` (or reused)."""
    from rangefinder.data.synthetic import EMBEDDED_KIND, make_synthetic_dataset
    from rangefinder.models.tiny import ensure_tiny_base_model

    cfg = demo_settings(out, retrain=retrain, lr=lr, family=family)
    make_synthetic_dataset(out / "dataset", kind=EMBEDDED_KIND, count=DEMO_IMAGES, seed=0, resolution=32)
    if family == "sdxl":
        from rangefinder.models.tiny_sdxl import ensure_tiny_sdxl_model

        cfg.model.base_model = str(ensure_tiny_sdxl_model(cache_dir=demo_model_cache(out, family)))
    elif family == "sd3":
        from rangefinder.models.tiny_sd3 import ensure_tiny_sd3_model

        cfg.model.base_model = str(ensure_tiny_sd3_model(cache_dir=demo_model_cache(out, family)))
    elif family == "flux":
        from rangefinder.models.tiny_flux import ensure_tiny_flux_model

        cfg.model.base_model = str(ensure_tiny_flux_model(cache_dir=demo_model_cache(out, family)))
    else:
        cfg.model.base_model = str(ensure_tiny_base_model(cache_dir=demo_model_cache(out)))
    return cfg


def run(args: argparse.Namespace) -> dict:
    from rangefinder.pipelines.local_run import check_environment_paths, run_pipeline_locally
    from rangefinder.pipelines.pipeline import compile_pipeline
    from rangefinder.training.outdir import OutDirLock

    out = Path(args.out).resolve()
    family = getattr(args, "family", "sd1")
    # Every check the input allows before --out, its dataset and its model are made (the run reads them all): a bad
    # --lr, a variable's path, credentials in MLFLOW_TRACKING_URI cost one line, and leave no folder behind.
    check_environment_paths(demo_settings(out, retrain=args.retrain, lr=args.lr, family=family), out)
    out.mkdir(parents=True, exist_ok=True)
    # One run at a time in --out, from the demo's first write (run_pipeline_locally takes this lock over): a second
    # demo on a running one's folder made the dataset and model there and compiled its pipeline over the running
    # one's pipeline.yaml before the local run's lock refused it.
    lock = OutDirLock(out)  # noqa: F841  (held until this returns)
    cfg = prepare_demo(out, retrain=args.retrain, lr=args.lr, family=family)
    compile_pipeline(cfg, str(out / "pipeline.yaml"))
    return run_pipeline_locally(cfg, out, quiet=not args.verbose).summary()
