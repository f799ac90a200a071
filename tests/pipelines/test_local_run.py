"""The whole pipeline through kfp.local (SubprocessRunner, no containers) on the tiny model and shapes dataset.

Two runs cover the DAG's branches: the unchanged demo's (discovery with the zoom, successive halving, the kept
checkpoint registered, on the default SQLite store; the run tests/pipelines/conftest.py shares), and a fixed LR (no
discovery) then the full-data retrain, with LoRA from a hub id, through the CLI on a terminal: a real user's first
run. Each component's own function, and the other methods from a hub id, are proven in
tests/pipelines/test_components.py.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path

import pytest
import yaml

from rangefinder.config import demo_config
from rangefinder.tracking.target import mlflow_executable
from tests.conftest import HUB_REPO
from tests.mlflow_store import seed
from tests.pipelines.registered_model import check_registered_is_the_retrain, check_the_kept_checkpoint, task_dir
from tests.pipelines.terminal import run_on_terminal
from tests.pipelines.tiny_run import DISCOVERY_REPORTS, RETRAIN, TINY
from tests.tracking.pipeline_record import check_pipeline_record

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _local_mlflow(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)


def _mlflow_runs(db: Path) -> dict[str, str]:
    """run name -> status, from the SQLite store the run wrote."""
    with sqlite3.connect(db) as con:
        return dict(con.execute("select name, status from runs").fetchall())


def test_the_demos_run_on_default_sqlite_reads_back_whole(demo_run, demo_run_mlflow):
    """The local default: no tracking URI anywhere, so the run writes sqlite:///<out>/mlflow.db; discovery with the
    zoom, successive halving, the kept checkpoint registered. The run is the unchanged demo's, shared
    (tests/pipelines/conftest.py): test_demo_learns.py scores it, test_reports_in_browser.py opens its reports. The
    whole record reads back through MlflowClient from a real `mlflow server` on the run's store, model included.
    The retrain branch: the fixed-LR run below."""
    from mlflow import MlflowClient

    from rangefinder.pipelines.progress import step_name

    s, run = demo_run.summary, demo_run.run
    out = demo_run.out_dir
    cfg = demo_config()
    # The first range test asked for the zoom, and the LR is read off the zoomed test (the second, which did not).
    range_tests = {t: o for t, o in run.outputs.items() if step_name(t) == "lr-range-test"}
    assert len(range_tests) == 2 and sorted(o["needs_zoom"] for o in range_tests.values()) == [False, True], \
        range_tests
    (zoom,) = [o for o in range_tests.values() if not o["needs_zoom"]]
    assert s["lr_source"] == "zoom" and all(s[k] == zoom[k] for k in ("lr_low", "lr_mid", "lr_high")), (s, zoom)
    assert 0 < s["lr_low"] <= s["lr_mid"] <= s["lr_high"] < 1e-2
    assert s["recommended_epochs"] >= 1 and "retrained_epochs" not in s
    # Successive halving kept lr_mid or lr_high; that LR is the fine-tune's and the registry's.
    assert s["halving_kept"] in ("lr_mid", "lr_high") and s["lr_used"] == s[s["halving_kept"]]
    # By name and version, as a person loads it.
    assert s["registered_model"] == f"models:/{cfg.tracking.registered_model_name}/1"
    # The reports are copied under OUT/reports with extensions a browser or editor opens.
    reports = sorted(Path(p).name for p in s["reports"])
    # Named after the step, not kfp.local's task folder (lr-range-test-3): the first range test and the zoom it asked
    # for, each by what it is. Every report, and no other: the discovery set (tiny_run.DISCOVERY_REPORTS; the Flux
    # run of test_local_run_prodigy_step.py writes it with the Prodigy run's reports for the range test's, zoom off)
    # and the zoom's two.
    assert set(reports) == DISCOVERY_REPORTS | {"lr-range-test-zoom.html", "lr-range-test-zoom.md"}, reports
    assert all(Path(p).parent == out / "reports" for p in s["reports"])
    # The reports exist and the HTML embeds its plot (the KFP UI shows no image files).
    html = Path(run.artifacts[run.task("lr-range-test")]["report_html"]).read_text()
    assert "data:image/png;base64," in html
    assert Path(run.artifacts[run.task("sample-images")]["grid"]).stat().st_size > 1000
    assert Path(s["pipeline_root"]).is_relative_to(out)
    db = out / "mlflow.db"
    assert db.is_file()
    # Issue 35: the summary (what `demo` and `run --local` print) serves the store and links its runs table.
    assert s["mlflow_ui"] == f"{mlflow_executable()} ui --backend-store-uri sqlite:///{db}"
    with sqlite3.connect(db) as con:
        (exp_id,) = con.execute("select distinct experiment_id from runs").fetchone()
    assert s["mlflow_link"] == f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs?workflowType=machine_learning"
    # The grid's prompt scores (data.prompt_score), under names that stay the same from run to run.
    with sqlite3.connect(db) as con:
        keys = {k for (k,) in con.execute("select m.key from metrics m join runs r on m.run_uuid = r.run_uuid "
                                          "where r.name = 'sample_images'")}
    assert {"prompt_colour.base", "prompt_shape.base", "prompt_colour.chosen", "prompt_shape.chosen",
            "prompt_colour.final", "prompt_shape.final"} <= keys, keys
    # The same scores in the run's summary (what `rangefinder demo` prints), per column.
    with sqlite3.connect(db) as con:
        logged = dict(con.execute("select m.key, m.value from metrics m join runs r on m.run_uuid = r.run_uuid "
                                  "where r.name = 'sample_images' and m.key like 'prompt_%'").fetchall())
    summed = {f"prompt_{k}.{column}": v for k in ("colour", "shape") for column, v in s[f"prompt_{k}"].items()}
    assert summed.keys() == logged.keys() and {"base", "final"} <= set(s["prompt_colour"]), (summed, logged)
    assert all(abs(summed[k] - logged[k]) <= 5e-4 for k in summed), (summed, logged)
    # A local run trains on one torch thread unless RANGEFINDER_TORCH_THREADS says otherwise (pipelines.local_run;
    # the demo's environment has none).
    summaries = list(run.run_dir.glob("finetune*/**/run_summary.json"))
    assert summaries and all(json.loads(p.read_text())["torch_threads"] == 1 for p in summaries), summaries
    # The store read as the printed `mlflow ui` reads it, without loading the model (the server's read-back does).
    check_pipeline_record(f"sqlite:///{db}", cfg.tracking.experiment_name, s,
                          model_name=cfg.tracking.registered_model_name, generate=False)
    uri = demo_run_mlflow  # a real `mlflow server` on <out>/mlflow.db, the run's store
    check_pipeline_record(uri, cfg.tracking.experiment_name, s, model_name=cfg.tracking.registered_model_name)
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment_name).experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    for step in ("lr_range_test", "finetune", "sample_images", "register_model"):
        assert by_name[step].info.status == "FINISHED", step
    # Without the retrain, the registered version is the fine-tune's kept checkpoint: its source run is finetune's.
    mv = client.get_model_version_by_alias(cfg.tracking.registered_model_name, "candidate")
    assert mv.run_id == by_name["finetune"].info.run_id
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    # Closed by the exit handler as a success: no failed task named.
    assert parent.info.status == "FINISHED" and "rangefinder.failed_task" not in parent.data.tags
    assert client.list_artifacts(by_name["sample_images"].info.run_id, "images")  # the grid via log_image


def test_the_demo_s_delivery_reason_names_the_band_that_drew_its_window(demo_run):
    """The reason chosen.json gives (the registered version's description) says how close to its minimum the window's
    smoothed loss stays as the band that drew the window: the demo's curve is noisy, so the band is the 2 % tolerance
    widened to 2 standard errors, and a reason saying "within 2 %" named a window narrower than its own updates."""
    import re

    ft = task_dir(demo_run.summary, "finetune")
    window = json.loads((ft / "curve" / "step_window.json").read_text())
    reason = json.loads((ft / "model" / "chosen.json").read_text())["reason"]  # a window average's quotes the pick's
    said = re.search(r"stays within ([0-9.e-]+)(%?) of its minimum", reason)
    assert said, reason
    band = float(said[1]) / 100 * window["best_val_loss"] if said[2] else float(said[1])
    assert band == pytest.approx(window["band"], rel=5e-3), (reason, window["band"], window["tolerance"])


def test_fixed_lr_from_a_hub_id_skips_discovery_then_retrains(tmp_path, shapes_dataset_dir, fake_hub_cache,
                                                               monkeypatch):
    """A real user's first run, whole: `rangefinder run --local --config FILE` on a terminal, the base model a hub
    id in a pre-filled, offline Hugging Face cache (an air-gapped cluster; tests/models/fake_hub.py), LoRA at a fixed
    LR, validated every update so the step window is read and its checkpoint kept, then the full-data retrain
    (1 epoch), whose weights are registered: the DAG's retrain branch (the demo's run, shared by the other tests
    here, has none). The fine-tune runs as 2 processes (torchrun, gloo) of batch 2: the demo's global batch of 4.
    The full fine-tune and textual inversion from the hub id go through every step's function, to the registry of
    the kept checkpoint, in tests/pipelines/test_components.py."""
    cache, commit = fake_hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    snapshot = cache / f"models--{HUB_REPO.replace('/', '--')}" / "snapshots" / commit
    cfg = demo_config(data={"dataset_dir": str(shapes_dataset_dir), "resolution": 32},
                      model={"base_model": HUB_REPO}, lr=2e-4,
                      training={"method": "lora", "processes_per_node": 2, "batch_size": 2},
                      validation={"every_updates": 1},
                      # The MLflow UI's address as the browser sees it, copied from a page of it (tracking.ui_url).
                      tracking={"ui_url": "https://mlflow.example.org/#/experiments/0"}, **{**TINY, **RETRAIN})
    config = tmp_path / "mine.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude={"kubernetes"})))
    out = tmp_path / "out"
    seed(out / "mlflow.db")  # where the run's default store goes, migrated: its first step skips MLflow's migrations
    # No thread setting either: the steps' own default (one torch thread) is read back below.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k != "RANGEFINDER_TORCH_THREADS"}
    # On a terminal, as a person runs it: stderr is a pseudo-terminal, stdout (the --json result) a pipe.
    code, stdout, terminal = run_on_terminal([sys.executable, "-m", "rangefinder.cli.main", "run", "--local",
                                              "--config", str(config), "--out", str(out), "--json"], env)
    assert code == 0, terminal[-3000:]
    s = json.loads(stdout)  # the steps' logs went to OUT/pipeline.log: stdout is the result only
    # A line per step as it starts and ends, with its duration and headline result; the training bar redrawn in
    # place (carriage returns) with the update count, loss and LR.
    lines = [ln.strip() for ln in terminal.replace("\r", "\n").splitlines()]
    for step in ("resolve-config", "prepare-dataset", "choose-lr", "finetune", "retrain-full", "register-model",
                 "sample-images"):
        assert f"rangefinder: {step} started" in lines, terminal
        assert any(ln.startswith(f"rangefinder: {step} done in ") for ln in lines), terminal
    assert any(ln.startswith("rangefinder: choose-lr done in ") and "source fixed, lr_low 0.0002" in ln
               for ln in lines), terminal
    (ft_done,) = [ln for ln in lines if ln.startswith("rangefinder: finetune done in ")]
    assert f"recommended_epochs {s['recommended_epochs']}" in ft_done
    assert s["chosen_rule"] and f"chosen_rule {s['chosen_rule']}" in ft_done  # the rule that picked the weights
    # A fixed LR: nothing for successive halving to compare, so no halving_kept on the line; the LR used is it.
    assert "halving_kept" not in ft_done and s["halving_kept"] is None and s["lr_used"] == 2e-4
    assert any(ln.startswith("rangefinder: register-model done in ") and ln.endswith("model_uri "
               "models:/rangefinder-sd/1") for ln in lines), terminal
    bars = [ln for ln in lines if ln.startswith("train (constant):") and "update" in ln]
    assert len(bars) >= 2 and "loss=" in bars[-1] and "lr=0.0002" in bars[-1], terminal
    assert "\r" in terminal and "Traceback" not in terminal
    assert Path(s["log"]).is_file() and "finetune" in Path(s["log"]).read_text()
    assert (s["lr_source"], s["lr_low"], s["lr_mid"], s["lr_high"]) == ("fixed", 2e-4, 2e-4, 2e-4)
    run_dir = Path(s["pipeline_root"])
    tasks = {p.name for p in run_dir.iterdir()}
    assert not [t for t in tasks if t.startswith("lr-range-test")], tasks
    assert [t for t in tasks if t.startswith("finetune")] and [t for t in tasks if t.startswith("retrain-full")]
    assert s["retrained_epochs"] == 1
    # The retrain's report, published as the other steps' are, with its training loss plotted in the page (the KFP UI
    # shows no image files): the retrain step showed nothing of its run.
    retrain_page = out / "reports" / "retrain-full.html"
    assert {str(retrain_page), str(out / "reports" / "retrain-full.md")} <= set(s["reports"]), s["reports"]
    assert "data:image/png;base64," in retrain_page.read_text()
    runs = _mlflow_runs(out / "mlflow.db")
    assert "lr_range_test" not in runs and runs.get("finetune") == runs.get("retrain_full") == "FINISHED", runs
    # The retrain trains at the LR the fine-tune used, and its run says so by that name.
    with sqlite3.connect(out / "mlflow.db") as con:
        params = dict(con.execute("select p.key, p.value from params p join runs r on p.run_uuid = r.run_uuid "
                                  "where r.name = 'retrain_full'").fetchall())
        keys = {k for (k,) in con.execute("select m.key from metrics m join runs r on m.run_uuid = r.run_uuid "
                                          "where r.name = 'sample_images'")}
    assert float(params["lr"]) == pytest.approx(s["lr_used"], rel=1e-5) and "lr_mid" not in params, params
    # The grid's retrained column is scored too (data.prompt_score), under the column's name.
    assert {"prompt_colour.retrained", "prompt_shape.retrained"} <= keys, keys
    # Every training step trains on one torch thread unless RANGEFINDER_TORCH_THREADS says otherwise.
    summaries = [*run_dir.glob("finetune*/**/run_summary.json"), *run_dir.glob("retrain-full*/**/run_summary.json")]
    assert {p.relative_to(run_dir).parts[0].split("-")[0] for p in summaries} == {"finetune", "retrain"}, summaries
    assert all(json.loads(p.read_text())["torch_threads"] == 1 for p in summaries), summaries
    # Resolved once, by the first step, into the config every later step read (the grid's base column included).
    resolved = json.loads(json.loads((task_dir(s, "resolve-config") / "executor_output.json").read_text())
                          ["parameterValues"]["config_json"])["model"]
    assert (resolved["base_model"], resolved["resolved_dir"]) == (HUB_REPO, str(snapshot))
    # The fine-tune kept its window's checkpoint; the retrain's weights, fused on the snapshot, are registered.
    kept, _, chosen = check_the_kept_checkpoint(s)
    # LoRA by AdamW keeps an EMA by default (training.use_ema auto): the kept checkpoint holds it, both training steps
    # say so in MLflow, and no window average was measured (the run already delivers averaged weights).
    from rangefinder.formats import checkpoints

    assert checkpoints.read_ema(kept) is not None and chosen["rule"] != "window_average"
    with sqlite3.connect(out / "mlflow.db") as con:
        used = con.execute("select r.name, p.key, p.value from params p join runs r on p.run_uuid = r.run_uuid "
                           "where p.key like 'training.%_used'").fetchall()
    assert sorted(used) == [(step, f"training.{key}_used", value) for step in ("finetune", "retrain_full")
                            for key, value in (("mixed_precision", "no"), ("use_ema", "True"))], used
    check_registered_is_the_retrain(s, out, snapshot)
    # register-model's `result` through the DAG's retrain branch, the run's outcome on its graph: the version, the
    # retrain's weights at the LR the fine-tune used and the epochs the retrain ran, the pipeline's MLflow run.
    (result,) = task_dir(s, "register-model").rglob("result")
    text = result.read_text()
    for row in ("| Model | `models:/rangefinder-sd/1` |", "| Weights | the full-data retrain's final weights |",
                "| Learning rate | 0.0002 |", "| Epochs trained | 1 |", "](https://mlflow.example.org/#/experiments/"):
        assert row in text, text
    # The config's tracking.ui_url, through the run form's mlflow_ui_url, is where the links point, the printed one too.
    assert s["mlflow_link"].startswith("https://mlflow.example.org/#/experiments/"), s["mlflow_link"]
    # Two processes, one curve: rank 0 logged it into the step's MLflow run; the report names the global batch.
    ft = task_dir(s, "finetune")
    summary = json.loads((ft / "model" / "run_summary.json").read_text())
    assert summary["plan"]["world_size"] == 2 and summary["plan"]["effective_batch"] == 4
    assert (ft / "model" / "checkpoints").is_dir()
    decision = json.loads(next(ft.rglob("decision.json")).read_text())
    assert decision["world_size"] == 2 and decision["global_batch"] == 4
    assert "global batch 4 = 2 per device x 2 process(es)" in next(ft.rglob("step_report.html")).read_text()
    with sqlite3.connect(out / "mlflow.db") as con:
        (val_points,) = con.execute("select count(*) from metrics m join runs r on m.run_uuid = r.run_uuid "
                                    "where r.name = 'finetune' and m.key = 'validation/val_loss'").fetchone()
    assert val_points == summary["updates"] + 1  # every update and the baseline, each logged once (rank 0)


def test_several_nodes_are_refused_locally(tmp_path):
    from rangefinder.errors import ConfigError
    from rangefinder.pipelines.local_run import run_pipeline_locally

    with pytest.raises(ConfigError, match="kfp.local.*single-node.*num_nodes: 1"):
        run_pipeline_locally(demo_config(distributed={"num_nodes": 2}), tmp_path)
    assert not any(tmp_path.iterdir())


def _laid_out(out, run_dir, tasks):
    """A LocalRun of a run folder laid out as kfp.local writes it: per task, its executor output and two reports
    (`tasks`: task -> output parameters), read back as run_pipeline_locally reads them."""
    import json

    from rangefinder.pipelines.local_run import LocalRun, _collect

    for task, outputs in tasks.items():
        (run_dir / task).mkdir(parents=True)
        (run_dir / task / "executor_output.json").write_text(json.dumps({"parameterValues": outputs}))
        (run_dir / task / "report_html").write_text(f"<!DOCTYPE html><p>{run_dir.name} {task}</p>")
        (run_dir / task / "report_md").write_text(f"# {run_dir.name} {task}\n")
    run = LocalRun(out_dir=out, run_dir=run_dir, tracking_uri="sqlite:///unused.db")
    out.mkdir(exist_ok=True)
    _collect(run)
    return run


ZOOMED = {  # the demo's tasks, with a zoom
    "lr-range-test-3": {"needs_zoom": True, "zoom_lr_min": 1e-5, "zoom_lr_max": 1e-3},
    "lr-range-test-2-2": {"needs_zoom": False, "zoom_lr_min": 0.0, "zoom_lr_max": 0.0},
    "finetune-2": {"recommended_epochs": 33},
}


def test_report_names_tell_the_first_range_test_from_the_zoom(tmp_path):
    """A run folder laid out as kfp.local writes it (the demo's, with a zoom): the copies say which test is which."""
    from rangefinder.pipelines.local_run import _publish_reports

    run = _laid_out(tmp_path / "out", tmp_path / "root" / "rangefinder-finetune-2026", ZOOMED)
    _publish_reports(run)
    names = {p.name: p.read_text() for p in run.reports}
    assert set(names) == {"lr-range-test-first.html", "lr-range-test-first.md", "lr-range-test-zoom.html",
                          "lr-range-test-zoom.md", "finetune.html", "finetune.md"}
    assert "lr-range-test-3" in names["lr-range-test-first.html"]
    assert "lr-range-test-2-2" in names["lr-range-test-zoom.md"]


def test_a_rerun_into_the_same_folder_replaces_the_earlier_run_s_reports_and_keeps_what_it_did_not_write(tmp_path):
    """`run --local --out OUT` twice, the second run without a zoom: the first run's zoom reports stayed in
    OUT/reports beside the second run's, which its printed list did not name. Now the second run's reports replace
    the first run's folder whole; what the first run did not write there (a user's notes, a report of the first run
    changed by hand since) is kept as it was and named in the summary; nothing is left half-written."""
    from rangefinder.pipelines.local_run import _publish_reports

    out = tmp_path / "out"
    reports = out / "reports"
    _publish_reports(_laid_out(out, tmp_path / "root" / "rangefinder-finetune-1", ZOOMED))
    (reports / "notes.txt").write_text("my notes on the first run")
    (reports / "lr-range-test-zoom.md").write_text("# the zoom, annotated by hand\n")
    (reports / "mine").mkdir()
    (reports / "mine" / "plot.png").write_bytes(b"a user's plot")

    second = _laid_out(out, tmp_path / "root" / "rangefinder-finetune-2", {
        "lr-range-test-2": {"needs_zoom": False, "zoom_lr_min": 0.0, "zoom_lr_max": 0.0},
        "finetune-2": {"recommended_epochs": 20}})
    _publish_reports(second)
    written = {"lr-range-test-first.html", "lr-range-test-first.md", "finetune.html", "finetune.md"}
    assert {p.name for p in second.reports} == written and all(p.parent == reports for p in second.reports)
    assert all("rangefinder-finetune-2" in p.read_text() for p in second.reports)  # this run's, not the first's
    # The first run's zoom HTML, unchanged since it wrote it, is gone; the rest stays as it was.
    visible = {p.name for p in reports.iterdir() if not p.name.startswith(".")}
    assert visible == written | {"notes.txt", "lr-range-test-zoom.md", "mine"}, visible
    assert (reports / "notes.txt").read_text() == "my notes on the first run"
    assert (reports / "lr-range-test-zoom.md").read_text() == "# the zoom, annotated by hand\n"
    assert (reports / "mine" / "plot.png").read_bytes() == b"a user's plot"
    assert second.reports_kept == [reports / "lr-range-test-zoom.md", reports / "mine", reports / "notes.txt"]
    summary = second.summary()
    assert summary["reports"] == [str(p) for p in second.reports]
    assert summary["reports_kept"] == [f"{p} (not written by this run; left as it was)" for p in second.reports_kept]
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]  # nothing half-written left about

    # A third run with nothing new to keep: the kept files stay, and nothing is said about the reports it wrote.
    third = _laid_out(out, tmp_path / "root" / "rangefinder-finetune-3", {"finetune-2": {"recommended_epochs": 9}})
    _publish_reports(third)
    assert {p.name for p in reports.iterdir() if not p.name.startswith(".")} == {
        "finetune.html", "finetune.md", "notes.txt", "lr-range-test-zoom.md", "mine"}
    assert [p.name for p in third.reports_kept] == ["lr-range-test-zoom.md", "mine", "notes.txt"]


def test_a_reports_path_that_is_a_file_is_one_clear_error_before_anything_runs(tmp_path):
    """OUT/reports a file: the run said nothing until every step had run, then failed with FileExistsError's traceback
    (and a folder put in its place would have removed it). Now one line, before a step runs, and the file stays."""
    from rangefinder.errors import RangefinderError
    from rangefinder.pipelines.local_run import _publish_reports, run_pipeline_locally

    out = tmp_path / "out"
    out.mkdir()
    (out / "reports").write_text("not a folder")
    said = r"--out's reports folder .*reports cannot be made: it is a file, not a folder"
    with pytest.raises(RangefinderError, match=said):  # (a missing dataset: a run that got going would stop soon)
        run_pipeline_locally(demo_config(data={"dataset_dir": str(tmp_path / "missing")}), out)
    assert not (out / "pipeline-root").exists()  # before anything ran
    with pytest.raises(RangefinderError, match=said):
        _publish_reports(_laid_out(out, tmp_path / "root" / "rangefinder-finetune-1", ZOOMED))
    assert (out / "reports").read_text() == "not a folder"


def test_the_summary_says_where_the_earlier_runs_folders_are_and_how_much_they_hold(tmp_path):
    """Each `run --local` into an --out adds a run folder under pipeline-root/ (its final/, checkpoints, samples:
    gigabytes for a real model), a stopped or failed run's too, and nothing said so: they piled up unseen. Nothing
    reads them again, but a user may want an earlier final/, so they are kept, and the summary names them with their
    size; the first run into a folder says nothing of it."""
    from rangefinder.pipelines.local_run import earlier_runs

    root = tmp_path / "out" / "pipeline-root"
    sizes = {"rangefinder-finetune-2026-01-01": 3 * 2**20, "rangefinder-finetune-2026-01-02": 2**20 + 2**19}
    for name, size in sizes.items():
        (root / name / "finetune-2" / "model" / "final").mkdir(parents=True)
        (root / name / "finetune-2" / "model" / "final" / "model.safetensors").write_bytes(b"\0" * size)
    this = _laid_out(tmp_path / "out", root / "rangefinder-finetune-2026-01-03", ZOOMED)
    said = earlier_runs(root, [root / name for name in sizes])
    assert said == (f"2 earlier runs' folders under {root}, 4.5 MiB in all (their final/ and checkpoints; MLflow "
                    "keeps its own copy of what they logged): remove those you no longer need")
    assert earlier_runs(root, [root / "rangefinder-finetune-2026-01-01"]) == (
        f"1 earlier run's folder under {root}, 3.0 MiB in all (its final/ and checkpoints; MLflow keeps its own copy "
        "of what it logged): remove it once you no longer need it")
    this.earlier_runs = said
    assert this.summary()["earlier_runs"] == said and this.run_dir.is_dir()
    assert earlier_runs(root, []) is None and "earlier_runs" not in _laid_out(tmp_path / "o2", tmp_path / "r2" / "x",
                                                                              ZOOMED).summary()


def _earlier_runs_unprivileged(root: Path, names: list[str], conn) -> None:
    """In a forked child: earlier_runs as a user the folders' permissions apply to (root reads any folder), or what
    it raised."""
    from rangefinder.pipelines.local_run import earlier_runs

    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)  # nobody
    try:
        conn.send(earlier_runs(root, [root / name for name in names]))
    except BaseException as e:  # noqa: BLE001 (sent back: the test's failure names it)
        conn.send(repr(e))


def test_earlier_runs_it_cannot_read_whole_are_counted_as_at_least_and_named(tmp_path):
    """A run folder, or one inside it, that cannot be listed (its permissions; a failing disk) was left out of the sum
    without a word: 2 MiB held were said as 1.0 MiB. Folders that are not there (a dangling link) or hold nothing count
    as they are; nothing raises."""
    import multiprocessing
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp())  # tmp_path's folders are its owner's alone; `nobody` must reach these
    try:
        top.chmod(0o755)
        root = top / "pipeline-root"
        for name in ("rangefinder-finetune-1", "rangefinder-finetune-2"):
            (root / name / "finetune-2").mkdir(parents=True)
            (root / name / "finetune-2" / "model.safetensors").write_bytes(b"\0" * 2**20)
        (root / "rangefinder-finetune-3").mkdir()  # a run stopped before its first step wrote anything
        for path in (root, *root.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        (root / "rangefinder-finetune-4").symlink_to(top / "gone")
        (root / "rangefinder-finetune-2" / "finetune-2").chmod(0)
        fork = multiprocessing.get_context("fork")
        ours, theirs = fork.Pipe()
        child = fork.Process(target=_earlier_runs_unprivileged, args=(root, [f"rangefinder-finetune-{n}" for n in
                                                                              range(1, 5)], theirs))
        child.start()
        child.join(60)
        assert child.exitcode == 0 and ours.poll(), child.exitcode
        assert ours.recv() == (
            f"3 earlier runs' folders under {root}, at least 1.0 MiB in all (their final/ and checkpoints; MLflow "
            f"keeps its own copy of what they logged; {root}/rangefinder-finetune-2/finetune-2 could not be read: "
            "Permission denied): remove those you no longer need")
    finally:
        (root / "rangefinder-finetune-2" / "finetune-2").chmod(0o755)
        shutil.rmtree(top)
