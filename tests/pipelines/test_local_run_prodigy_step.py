"""The DAG's prodigy_step branch through kfp.local (the same DAG `rangefinder run --local` runs), on the smallest
whole-run settings (tests/pipelines/tiny_run.py): the Prodigy run's step size becomes the one LR the fine-tune trains
at, and every step of the branch logs to MLflow under the pipeline's run. On the tiny Flux model it is what
lr_finder auto resolves to (read off the model by resolve-config), so the same run covers the flow-matching family
end to end: its loss, its sampler and its registered model. SD3's is proved on every step's function
(tests/pipelines/test_components.py); it ran here whole too until 2026-12-07. The run is `rangefinder run --local
--verbose --json` in a process of its own, so it also shows what --verbose does with the steps' logs and the result."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rangefinder.config import FAMILY_NAMES
from tests.pipelines.tiny_run import PRODIGY_REPORTS, TINY, prodigy_branch_params, tiny_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["flux"])
def test_lr_finder_auto_on_a_flow_model_runs_the_prodigy_branch_and_fine_tunes_at_its_step_size(
        tmp_path, shapes_dataset_dir, family, request):
    """The branch, run as `run --local --verbose --json`: the steps' whole logs stream on stderr, and stdout is the
    JSON result alone (the logs went to stdout, so `--verbose --json | jq` read kfp.local's log lines). The result
    names no `log` when an earlier run's OUT/pipeline.log is there (it named that file)."""
    from rangefinder.analysis import read_curve_csv
    from rangefinder.config import prodigy_step_factor
    from rangefinder.pipelines.local_run import LocalRun, _collect
    from tests.mlflow_store import seed

    # 3 epochs (12 updates): long enough for Prodigy's d to grow from d0 (at update 9 on SD3), as it must to be read.
    # Each samples with its own flow-matching scheduler, not the demo's DDIM (as `rangefinder demo --family F`), and at
    # its own pipeline's guidance scale, not the demo's 5.
    # Flux sets its own factor (prodigy_step_factor: 2, where the family's is 1); SD3 keeps its family's (4).
    model = request.getfixturevalue(f"tiny_{family}_dir")
    own = {"prodigy_step_factor": 2.0} if family == "flux" else {}
    cfg = tiny_config(shapes_dataset_dir, model, lr_finder="auto",
                      lr_range_test={"lr_min": None, "lr_max": None}, finetune={"epochs": 3},
                      sampling={**TINY["sampling"], "scheduler": None, "guidance_scale": None}, **own)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"kubernetes"})))
    out = tmp_path / "out"
    out.mkdir()
    (out / "pipeline.log").write_text("an earlier run's log\n")  # the same --out, run before without --verbose
    seed(out / "mlflow.db")  # the run's default store, migrated: its first step skips MLflow's migrations
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    r = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "run", "--local", "--config", str(config),
                        "--out", str(out), "--verbose", "--json"], capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert Path(s["pipeline_root"]).is_dir()
    # kfp.local's own lines (coloured), every step's: the whole log, as it streams.
    log = re.sub(r"\x1b\[[0-9;]*m", "", r.stderr)
    assert "Executing task 'finetune" in log and "Pipeline 'rangefinder-finetune' finished" in log
    assert "train (constant):" in log
    # No `log` line: this run's log is the stream above; OUT/pipeline.log is an earlier run's, and left as it was.
    assert "log" not in s, s["log"]
    assert (out / "pipeline.log").read_text() == "an earlier run's log\n"
    # The run's task outputs, read back from its folder as the run read them before it printed its result.
    run = LocalRun(out_dir=out, run_dir=Path(s["pipeline_root"]), tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    _collect(run)

    probe = run.task("prodigy-step-size")
    assert probe and not run.task("lr-range-test"), sorted(run.outputs)
    lr = run.outputs[probe]["lr"]
    updates = read_curve_csv(next(run.run_dir.glob(f"**/{probe}/curve/run/updates.csv")), required=("prodigy_d_lr",))
    # The LR is the last step size (d x lr after the last update), times the family's factor for full fine-tuning
    # (config.PRODIGY_STEP_FACTOR), or the config's own.
    factor = own.get("prodigy_step_factor") or prodigy_step_factor(family, "full")
    assert factor == {"sd3": 4.0, "flux": 2.0}[family] and run.outputs[probe]["factor"] == factor
    assert lr == factor * updates["prodigy_d_lr"][-1] and run.outputs[probe]["updates"] == len(updates["update"]) == 12
    # choose-lr collapsed the bounds onto it; the fine-tune trained that one LR (no halving) and it was registered.
    assert (s["lr_source"], s["lr_low"], s["lr_mid"], s["lr_high"]) == ("prodigy-step", lr, lr, lr)
    assert s["lr_used"] == lr and s["halving_kept"] is None
    assert s["registered_model"] == "models:/rangefinder-sd/1"
    reports = {Path(p).name for p in s["reports"]}
    # Every report of the branch and no other: the SD run's set with the Prodigy run's for the range test's.
    assert reports == PRODIGY_REPORTS, reports
    decision = next(Path(p) for p in s["reports"] if Path(p).name == "choose-lr-decision.md").read_text()
    assert "read off a Prodigy run's final step size d x lr" in decision and "12 updates" in decision
    assert f"(lr_finder: auto, which measures full on {FAMILY_NAMES[family]} with prodigy_step)" in decision
    assert f", times {factor:g} = {lr:.3g} (" + ("prodigy_step_factor: 2, as set)" if own else
                                                 "full on this family trains at 4 times") in decision, decision

    with sqlite3.connect(out / "mlflow.db") as con:
        runs = dict(con.execute("select name, status from runs").fetchall())
        (parent,) = [n for n in runs if n.startswith("rangefinder-")]
        nested = dict(con.execute(
            "select r.name, t.value from runs r join tags t on t.run_uuid = r.run_uuid "
            "where t.key = 'mlflow.parentRunId'").fetchall())
        finder, factor_param, guidance = prodigy_branch_params(con)
    assert runs["prodigy_step_size"] == runs["finetune"] == runs[parent] == "FINISHED", runs
    assert "lr_range_test" not in runs and float(factor_param) == factor
    # The setting as the config says it, what it resolved to beside it (as every *_used param).
    assert finder == {"lr_finder": "auto", "lr_finder_used": "prodigy_step"}, finder
    assert nested["prodigy_step_size"] == nested["finetune"]  # both children of the pipeline's run
    # The guidance unset is the family's pipeline's own (FluxPipeline's distilled guidance 3.5, SD3's 7.0): the
    # pipeline's run and each step's show it beside the setting, and the grid and the registered model sample at it.
    own_guidance = {"sd3": 7.0, "flux": 3.5}[family]
    assert {float(v) for v in guidance.values()} == {own_guidance} and {parent, "finetune"} <= set(guidance), guidance
    grid = json.loads(next(run.run_dir.glob("sample-images*/images/grid.json")).read_text())
    during = json.loads(next(run.run_dir.glob("finetune*/model/samples/index.json")).read_text())
    assert grid["settings"]["guidance_scale"] == during["settings"]["guidance_scale"] == own_guidance
