"""The smallest whole-pipeline config the pipeline tests run (test_local_run.py, test_local_run_prodigy_step.py,
and every step's function in test_components.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rangefinder.config import RangefinderConfig, demo_config

# The smallest run that still reads a curve: 4 epochs of 4 updates, validated every 2 (9 points); 2 fine-tune
# epochs (3 points); one prompt, 2 denoising steps.
TINY = {
    "lr_range_test": {"epochs": 4, "validate_every_updates": 2, "zoom": False},
    "finetune": {"epochs": 2},
    "retrain": {"epochs": 1},
    "sampling": {"prompts": ["a red circle"], "seeds": [0], "num_inference_steps": 2},
}

# The reports a discovery run of TINY writes under OUT/reports (no zoom; a retrain has no report of its own, its
# column is in the grid's): the demo's run (test_local_run.py, the session's shared run) is held to this set and the
# zoom's two reports.
DISCOVERY_REPORTS = frozenset({"resolve-config-report.md", "prepare-dataset-report.md", "lr-range-test-first.html",
                               "lr-range-test-first.md", "choose-lr-decision.md", "finetune.html", "finetune.md",
                               "sample-images-grid.html"})
# The same run on the prodigy_step branch (lr_finder auto's choice for SDXL's, SD3's and Flux's full fine-tune): the
# Prodigy run's two reports where the range test's were, the rest alike. The Flux run
# (test_local_run_prodigy_step.py) is held to this set, so the SD and flow runs write the same reports but for the
# finder's, without the Flux test reading the SD run.
PRODIGY_REPORTS = (DISCOVERY_REPORTS - {"lr-range-test-first.html", "lr-range-test-first.md"}) | {
    "prodigy-step-size.html", "prodigy-step-size.md"}


def prodigy_branch_params(con) -> tuple[dict, str, dict]:
    """From a run's SQLite MLflow store (`con`, open), what the prodigy branch records as params: the Prodigy run's
    `lr_finder` and `lr_finder_used`, its `prodigy_step_factor`, and each run's `sampling.guidance_scale_used`."""
    def params(where: str):
        return con.execute("select r.name, p.key, p.value from params p join runs r on p.run_uuid = r.run_uuid "
                           f"where {where}").fetchall()

    finder = {k: v for _, k, v in params("r.name = 'prodigy_step_size' and p.key like 'lr_finder%'")}
    ((_, _, factor),) = params("r.name = 'prodigy_step_size' and p.key = 'prodigy_step_factor'")
    guidance = {name: v for name, _, v in params("p.key = 'sampling.guidance_scale_used'")}
    return finder, factor, guidance


# The retrain the fixed-LR run turns on (test_local_run.py, the DAG's retrain branch): one epoch on train + validation.
RETRAIN = {"retrain": {"enabled": True, "epochs": 1}}


def tiny_config(dataset: Path, model: Path, **extra: Any) -> RangefinderConfig:
    return demo_config(data={"dataset_dir": str(dataset), "resolution": 32}, model={"base_model": str(model)},
                       **{**TINY, **extra})
