"""SDXL through the whole pipeline (issue 22), without the whole demo's minutes (issue 32, item 5).

Two proofs replace the run of the unchanged `rangefinder demo --family sdxl`:
- a small SDXL pipeline run, the smallest SD pipeline config (tests/pipelines/tiny_run.py) on the tiny SDXL model,
  through kfp.local as the demo runs: lr_finder auto measures SDXL's full fine-tune with prodigy_step
  (config.LR_FINDER_AUTO_PRODIGY; bench/RESULTS.md, "SDXL's full fine-tune at Prodigy's step size"), so it takes the
  DAG's prodigy branch, fine-tunes at four times the step size the Prodigy run ended on (config.PRODIGY_STEP_FACTOR;
  "SDXL's full fine-tune at four times the step size"), writes the SD run's reports with the Prodigy run's for the
  range test's, and records the family, read from the model, in every tracked step's MLflow run;
- `rangefinder demo --family sdxl` compiles the pipeline the SD demo compiles, but for the base model and the range
  test's bounds, which it leaves unset there (the prodigy branch has no use for them, as on SD3 and Flux): so the demo
  on SDXL is the small run's pipeline with the demo's settings, which tests/pipelines/test_demo_learns.py runs whole.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest

from tests.mlflow_store import seed
from tests.pipelines.tiny_run import PRODIGY_REPORTS, tiny_config
from tests.tracking.fixtures import free_port

pytestmark = pytest.mark.slow


def test_a_small_sdxl_run_takes_the_prodigy_branch_and_writes_the_reports_of_the_sd_run(
        tiny_sdxl_dir, shapes_dataset_dir, tmp_path):
    from rangefinder.analysis import read_curve_csv
    from rangefinder.pipelines.local_run import run_pipeline_locally

    out = tmp_path / "sdxl"
    # As `demo --family sdxl` runs it: lr_finder auto, the range test's bounds unset (auto would not use them); 3
    # epochs (12 updates) for Prodigy's d to leave d0, as the SD3 and Flux runs of test_local_run_prodigy_step.py.
    cfg = tiny_config(shapes_dataset_dir, tiny_sdxl_dir, lr_finder="auto",
                      lr_range_test={"lr_min": None, "lr_max": None}, finetune={"epochs": 3})
    seed(out / "mlflow.db")  # the run's default store, migrated: its first step skips MLflow's migrations
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("MLFLOW_RUN_ID", raising=False)
        run = run_pipeline_locally(cfg, out, quiet=True)
    s = run.summary()
    probe = run.task("prodigy-step-size")
    assert probe and not run.task("lr-range-test"), sorted(run.outputs)
    # choose-lr collapsed the bounds onto four times the Prodigy run's last step size; the fine-tune trained that LR.
    updates = read_curve_csv(next(run.run_dir.glob(f"**/{probe}/curve/run/updates.csv")), required=("prodigy_d_lr",))
    lr = run.outputs[probe]["lr"]
    assert lr == 4 * updates["prodigy_d_lr"][-1] == 4 * run.outputs[probe]["d"] > 0
    assert s["lr_source"] == "prodigy-step" and s["lr_low"] == s["lr_mid"] == s["lr_high"] == s["lr_used"] == lr
    assert s["recommended_epochs"] >= 1 and s["registered_model"] == "models:/rangefinder-sd/1"
    decision = next(Path(p) for p in s["reports"] if os.path.basename(p) == "choose-lr-decision.md").read_text()
    assert "(lr_finder: auto, which measures full on Stable Diffusion XL with prodigy_step)" in decision, decision
    assert f"d x lr = {lr / 4:.3g}, 12 updates, times 4 = {lr:.3g}" in decision, decision
    # The discovery run's reports, by name: PRODIGY_REPORTS, the SD demo's run's (test_local_run.py,
    # tiny_run.DISCOVERY_REPORTS) with the Prodigy run's two for the range test's (this config has no zoom; no
    # retrain, whose column would be within sample-images-grid.html). Reading the set, not that run, keeps this test
    # from building the shared run on an xdist worker that has no other use for it.
    sdxl = {os.path.basename(p) for p in s["reports"]}
    assert sdxl == PRODIGY_REPORTS, sdxl
    # The model was SDXL all along: the family came from the model, into every tracked step's MLflow run.
    with sqlite3.connect(out / "mlflow.db") as con:
        families = con.execute("select r.name, t.value from runs r join tags t on t.run_uuid = r.run_uuid "
                               "where t.key = 'rangefinder.model_family'").fetchall()
        (factor,) = con.execute("select p.value from params p join runs r on p.run_uuid = r.run_uuid "
                                "where r.name = 'prodigy_step_size' and p.key = 'prodigy_step_factor'").fetchone()
    assert float(factor) == 4  # the Prodigy run's MLflow run says the LR trained is 4x its step size
    assert families and {value for _, value in families} == {"sdxl"}, families
    assert {name for name, _ in families} >= {"prodigy_step_size", "finetune"}, families
    assert "lr_range_test" not in {name for name, _ in families}, families


def test_demo_family_sdxl_changes_only_the_base_model_and_the_unused_bounds(tiny_model_dir, tiny_sdxl_dir, tmp_path,
                                                                          monkeypatch, capsys):
    """`rangefinder demo --family sdxl` compiles OUT/pipeline.yaml before it runs it; here the run is refused before
    its first step starts, since the MLflow URI holds credentials (pipelines.local_run: one line, no step process,
    the secret not printed). The SD demo's pipeline, compiled as `demo` compiles it, into the same folder (so every
    other path is the same), differs only in the model and in the range test's bounds: lr_finder auto measures
    SDXL's full fine-tune with prodigy_step, so the SDXL demo leaves them unset (as on SD3 and Flux)."""
    from rangefinder.cli.commands.demo import prepare_demo
    from rangefinder.cli.main import main
    from rangefinder.config import auto_lr_finder
    from rangefinder.pipelines.pipeline import compile_pipeline

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://someone:hunter2@127.0.0.1:{free_port()}")
    out = tmp_path / "demo"
    assert main(["demo", "--family", "sdxl", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "MLFLOW_TRACKING_URI" in err and "holds" in err and "hunter2" not in err, err[-3000:]
    assert not (out / "pipeline-root").exists()  # refused before kfp.local made its root: no step ran
    sdxl = (out / "pipeline.yaml").read_text()
    sd_cfg = prepare_demo(out)
    assert (sd_cfg.lr_range_test.lr_min, sd_cfg.lr_range_test.lr_max) == (1e-5, 1e-2)  # the SD demo's, used there
    assert auto_lr_finder("sd1", "full") == "range_test" and auto_lr_finder("sdxl", "full") == "prodigy_step"
    sd = Path(compile_pipeline(sd_cfg, str(tmp_path / "sd.yaml"))).read_text()
    assert str(tiny_model_dir) in sd and str(tiny_sdxl_dir) not in sd
    assert str(tiny_sdxl_dir) in sdxl and str(tiny_model_dir) not in sdxl
    assert sdxl.replace(str(tiny_sdxl_dir), str(tiny_model_dir)) != sd
    # The same config with the bounds unset compiles to the SDXL demo's pipeline but for the model.
    sd_cfg.lr_range_test.lr_min = sd_cfg.lr_range_test.lr_max = None
    unbounded = Path(compile_pipeline(sd_cfg, str(tmp_path / "sd-unbounded.yaml"))).read_text()
    assert sdxl.replace(str(tiny_sdxl_dir), str(tiny_model_dir)) == unbounded
