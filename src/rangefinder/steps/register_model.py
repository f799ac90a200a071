"""Step `register_model`: log the final weights to MLflow with the LR and epochs that made them, and register them.

The new version gets the `candidate` alias; promotion to `champion` stays a person's decision.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rangefinder.config import RangefinderConfig


@dataclass(frozen=True)
class Registered:
    model_uri: str
    version: Optional[str]


def run_register_model(cfg: RangefinderConfig, *, model_dir: Path, lr_mid: float, epochs: int,
                       mlflow_parent_run_id: Optional[str] = None) -> Registered:
    from rangefinder import tracking

    final = Path(model_dir) / "final"
    weights = final if final.is_dir() else Path(model_dir)
    with tempfile.TemporaryDirectory(prefix="rangefinder-register-") as scratch:
        if not (weights / "model_index.json").is_file():
            # LoRA and textual inversion deliver a small file; the registry gets a whole pipeline that generates
            # on its own (the step's input artifact may be read-only, so it is built in scratch space).
            from rangefinder.models.tiny import ensure_tiny_base_model
            from rangefinder.sampling import export_pipeline

            base = Path(cfg.model.base_model) if cfg.model.base_model else ensure_tiny_base_model(cfg.model.cache_dir)
            weights = export_pipeline(weights, base, Path(scratch) / "pipeline")
        with tracking.step_run(cfg, "register_model", parent_run_id=mlflow_parent_run_id) as run:
            v = run.log_diffusers_model(weights, metrics={"lr_mid": lr_mid, "epochs": epochs},
                                        num_inference_steps=cfg.sampling.num_inference_steps,
                                        guidance_scale=cfg.sampling.guidance_scale, resolution=cfg.data.resolution)
    # The registry's name for it when registered (what a person loads or promotes), else the logged model's URI.
    uri = f"models:/{v.name}/{v.version}" if v.version else v.model_uri
    return Registered(model_uri=uri, version=v.version)
