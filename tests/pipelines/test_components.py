"""The KFP components' own functions (`component.python_func`), called as kfp calls them in a step: the pipeline's
typed parameters in, real artifact objects (kfp.dsl Input/Output) on real folders, the outputs read back.

What a whole kfp.local run would prove about one wrapper, in seconds; kfp.local is kept for the DAG's wiring
(tests/pipelines/test_local_run.py: the default run, the retrain branch, and the fixed LR from a hub id through the
CLI on a terminal).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kfp.dsl import Dataset, Markdown

from rangefinder.config import demo_config
from rangefinder.pipelines import kfp_components as c
from rangefinder.steps.resolve_config import load_step_config, parameters_from_config
from tests.conftest import HUB_REPO


def _report(out: Path) -> Markdown:
    """resolve-config's `report` artifact in `out`'s resolve-config task folder, as a pipeline root holds it."""
    (out / "resolve-config").mkdir(parents=True, exist_ok=True)
    return Markdown(name="report", uri=str(out / "resolve-config" / "report"))


def _resolve(cfg, out: Path) -> tuple:
    """resolve_config's function with the pipeline's parameters for `cfg`, as kfp.local hands them over (no KFP run
    id: no MLflow parent run); its report under `out`."""
    params = parameters_from_config(cfg)
    params.pop("dataset_uri")
    return c.resolve_config.python_func(**params, pipeline_job_id="", report=_report(out))


def test_resolve_config_resolves_a_hub_id_from_the_offline_cache(fake_hub_cache, shapes_dataset_dir, monkeypatch,
                                                                  tmp_path):
    """A real user's hub id on an air-gapped cluster (test_a_hub_id_through_every_step_registers_the_kept_checkpoint
    below runs it through every step's function): the snapshot folder is in the config every later step reads, and
    its commit, the revision main named when this run resolved it (tracking tags every run with it)."""
    cache, commit = fake_hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = _resolve(demo_config(data={"dataset_dir": str(shapes_dataset_dir)}, model={"base_model": HUB_REPO},
                             lr=4e-3, retrain={"enabled": True}), tmp_path)
    assert (r.fixed_lr, r.retrain, r.mlflow_parent_run_id) == (4e-3, True, "")
    model = load_step_config(r.config_json).model
    snapshot = cache / f"models--{HUB_REPO.replace('/', '--')}" / "snapshots" / commit
    assert (model.base_model, model.resolved_dir, model.resolved_revision) == (HUB_REPO, str(snapshot), commit)
    report = (tmp_path / "resolve-config" / "report").read_text()
    assert f"- base model: `{HUB_REPO}`\n- resolved to: `{snapshot}`, revision `{commit}`\n" in report, report
    assert "- learning rate: fixed by hand at 0.004" in report, report
    assert "- retrain: on, for the epochs the fine-tune recommends" in report, report


def test_resolve_config_s_report_says_what_the_run_resolved_to_and_what_it_leaves_unused(tiny_model_dir, tmp_path,
                                                                                          capsys):
    """The KFP UI shows the first step's `report`, as it shows the other steps': the model, its family, the method,
    how the LR will be found and the retrain, and the parameters the run leaves unused in the log's words (a
    retrain_epochs typed with the retrain off did nothing, and only the step's log said so)."""
    r = _resolve(demo_config(model={"base_model": str(tiny_model_dir)}, lr=1e-4, retrain={"epochs": 3}), tmp_path)
    assert (r.fixed_lr, r.retrain) == (1e-4, False)
    report = (tmp_path / "resolve-config" / "report").read_text()
    logged = [ln.removeprefix("rangefinder: warning: ") for ln in capsys.readouterr().err.splitlines()
              if ln.startswith("rangefinder: warning: ")]
    assert any("retrain.epochs (3) is not used" in ln for ln in logged), logged
    from rangefinder.formats.text import markdown_text
    from rangefinder.models.fingerprint import folder_revision

    assert report.startswith("# Resolved config\n\n"), report
    for line in (f"- base model: `{tiny_model_dir}`",
                 f"- resolved to: `{tiny_model_dir}`, revision `{folder_revision(tiny_model_dir)}` (a fingerprint of "
                 "the folder's weights and configs)",
                 "- family: Stable Diffusion 1.x/2.x", "- method: full", "- retrain: off", f"- warnings: {len(logged)}",
                 "- learning rate: fixed by hand at 0.0001; discovery skipped (lr\\_finder auto has nothing to "
                 "measure)",
                 *(f"  - {markdown_text(ln)}" for ln in logged)):
        assert f"{line}\n" in report, (line, report)
    shown = report.replace("\\", "")  # as the KFP UI renders it
    assert "retrain.epochs (3) is not used" in shown and "lr (pipeline parameter fixed_lr): 0.0001 is fixed" in shown
    # What a person typed is shown as text and without its secrets: the UI renders the report for whoever can see
    # the run, as it renders the log.
    from rangefinder.steps.resolve_config import resolved_report

    cfg = load_step_config(r.config_json)
    typed = cfg.model.model_copy(update={"base_model": "https://me:hunter2-pw@models.example/<b>x</b>.safetensors"})
    report = resolved_report(cfg.model_copy(update={"model": typed}), "sd1", [])
    assert "hunter2" not in report and "`https://models.example/<b>x</b>.safetensors`" in report, report


def test_resolve_config_converts_a_single_file_once(tiny_model_dir, tmp_path):
    """A downloaded single-file checkpoint (no rangefinder metadata; model.single_file_config names the
    architecture), converted by the first step into the cache, once. tests/models/test_loading.py shows the
    converted folder holds the file's weights. The file's sha256 (read to find the conversion) is its revision: the
    checksum a model page lists, which tells two files of one name apart."""
    from rangefinder.formats.digest import file_sha256
    from rangefinder.formats.single_file import export_full

    single = export_full(tiny_model_dir, tmp_path / "tiny-sd.safetensors")
    cfg = demo_config(model={"base_model": str(single), "single_file_config": str(tiny_model_dir),
                             "cache_dir": str(tmp_path / "cache")})
    first = load_step_config(_resolve(cfg, tmp_path).config_json).model
    (converted,) = [p for p in (tmp_path / "cache" / "base-models").glob("tiny-sd-*") if p.is_dir()]
    assert first.base_model == str(single) and first.resolved_dir == str(converted)
    assert first.resolved_revision == f"sha256:{file_sha256(single)}"
    stamp = (converted / "model_index.json").stat().st_mtime_ns
    again = load_step_config(_resolve(cfg, tmp_path).config_json).model
    assert again.resolved_dir == str(converted)
    assert (converted / "model_index.json").stat().st_mtime_ns == stamp  # found, not converted again


def test_prepare_dataset_writes_the_split_artifact_and_its_report(shapes_dataset_dir, tiny_model_dir, tmp_path):
    cfg = demo_config(data={"dataset_dir": str(shapes_dataset_dir), "resolution": 32},
                      model={"base_model": str(tiny_model_dir)})
    split = Dataset(name="split", uri=str(tmp_path / "split"))
    report = Markdown(name="report", uri=str(tmp_path / "report.md"))
    r = c.prepare_dataset.python_func(config_json=cfg.model_dump_json(), split=split, report=report)
    # 20 images: 20 % validation, the rest train (the stabilize set is a subset of train).
    assert (r.train_images, r.val_images, r.skipped_files) == (16, 4, 0)
    from rangefinder.data.split import read_split

    written = read_split(Path(split.path))
    assert (len(written.train), len(written.val), len(written.stabilize)) == (16, 4, 4)
    assert Path(report.path).read_text().strip()
    # skipped_files and the report name the same kinds of file left out, from one list: the UI's description said
    # "unreadable, too small, no caption", where the report also lists animated images, files not trained on, broken
    # links, metadata rows and copies of a split.val_dir image.
    from rangefinder.data.split import SKIPPED_KINDS

    described = c.prepare_dataset.component_spec.outputs["skipped_files"].description
    assert SKIPPED_KINDS in " ".join(described.split()), described
    # The pod's copy of the body (the YAML's embedded source, which a reader of the package sees) says the same, not a
    # `{placeholder}` filled in only on the laptop that compiled it.
    shipped = " ".join(c.prepare_dataset.component_spec.implementation.container.command[-1].split())
    assert SKIPPED_KINDS in shipped and "{skipped_kinds}" not in shipped
    assert f"- skipped files ({SKIPPED_KINDS}): 0" in Path(report.path).read_text()


def test_choose_lr_passes_the_bounds_on_and_writes_the_decision(tmp_path):
    decision = Markdown(name="decision", uri=str(tmp_path / "decision.md"))
    r = c.choose_lr.python_func(config_json=demo_config().model_dump_json(), source="range-test", lr_low=1e-4,
                                lr_high=1e-3, lr_mid=3e-4, decision=decision)
    assert (r.lr_low, r.lr_high, r.lr_mid, r.source) == (1e-4, 1e-3, 3e-4, "range-test")
    assert "range test" in Path(decision.path).read_text()
    json.dumps(r._asdict())  # the outputs are plain values kfp writes into executor_output.json


def test_a_component_ends_on_bad_input_with_exit_2_and_one_line(tmp_path, capsys):
    """Bounds out of order: the step's one line on stderr, exit status 2 (what the local runner quotes)."""
    decision = Markdown(name="decision", uri=str(tmp_path / "decision.md"))
    with pytest.raises(SystemExit) as stopped:
        c.choose_lr.python_func(config_json=demo_config().model_dump_json(), source="range-test", lr_low=1e-3,
                                lr_high=1e-4, lr_mid=3e-4, decision=decision)
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("rangefinder step choose-lr: error: RangefinderError: the bounds from the range-test step "
                           "are out of order"), line


def _reports(out: Path) -> dict:
    """A training component's report outputs (HTML and Markdown) in `out`, as a task folder holds them."""
    from kfp.dsl import HTML

    return {"report_html": HTML(name="report_html", uri=str(out / "report_html")),
            "report_md": Markdown(name="report_md", uri=str(out / "report_md"))}


def test_a_range_test_that_read_no_bounds_leaves_them_out_of_its_kfp_metrics(tmp_path, monkeypatch):
    """A range test whose curve diverged before the loss fell reads no bounds and proposes a zoom; its outputs carry
    0.0 (a KFP output cannot be None), and its KFP metrics showed lr_low, lr_high and lr_mid 0 in the UI's table,
    where its MLflow run has none. The step's result is the one the tiny model's sweep over 1e-3..1e4 returned (the
    sweep itself, ~25 s, is the range test's own business: what is under test is what the component copies)."""
    from kfp.dsl import Metrics

    from rangefinder.steps import lr_range_test

    diverged = lr_range_test.RangeTestResult(
        stage="first", lr_min=1e-3, lr_max=1e4, status="diverged", lr_low=0.0, lr_high=0.0, lr_mid=0.0, quality=0.0,
        flags=["diverged"], points_between=0, needs_zoom=True, zoom_lr_min=1e-4, zoom_lr_max=100.0,
        curve_csv=tmp_path / "metrics.csv", bounds_json=tmp_path / "bounds.json")
    monkeypatch.setattr(lr_range_test, "run_lr_range_test", lambda *a, **k: diverged)
    metrics = Metrics(name="metrics", uri=str(tmp_path / "metrics"))
    r = c.lr_range_test.python_func(config_json=demo_config().model_dump_json(),
                                    split=Dataset(name="split", uri=str(tmp_path / "split")),
                                    curve=Dataset(name="curve", uri=str(tmp_path / "curve")), metrics=metrics,
                                    **_reports(tmp_path))
    assert (r.needs_zoom, r.zoom_lr_min, r.zoom_lr_max) == (True, 1e-4, 100.0)
    assert metrics.metadata == {"quality": 0.0, "points_between": 0.0}


def test_a_metric_that_is_not_finite_is_left_out_of_kfp_s_metrics_with_one_warning(tmp_path, monkeypatch, capsys):
    """KFP writes a Metrics artifact's metadata into the executor output with Python's json, NaN as `NaN`: no JSON
    for a cluster's launcher, MLMD or the UI. A value that is not a finite number stays out, and the step's log says
    which and why; the finite ones are all there."""
    from kfp.dsl import Metrics, Model

    from rangefinder.steps import finetune

    result = finetune.FinetuneResult(
        recommended_epochs=3, recommended_updates=12, still_improving=False, best_val_loss=float("nan"),
        model_dir=tmp_path / "model", curve_csv=tmp_path / "metrics.csv", checkpoints=[],
        chosen={"update": 12, "epoch": 3.0, "val_loss": float("inf")}, lr=1e-4, updates_trained=16)
    monkeypatch.setattr(finetune, "run_finetune", lambda *a, **k: result)
    metrics = Metrics(name="metrics", uri=str(tmp_path / "metrics"))
    c.finetune.python_func(config_json=demo_config().model_dump_json(),
                           split=Dataset(name="split", uri=str(tmp_path / "split")), lr_low=1e-5, lr_high=1e-3,
                           lr_mid=1e-4, lr_source="range-test", model=Model(name="model", uri=str(tmp_path / "m")),
                           curve=Dataset(name="curve", uri=str(tmp_path / "curve")), metrics=metrics,
                           **_reports(tmp_path))
    json.dumps(metrics.metadata, allow_nan=False)  # as strict JSON as the launcher reads
    assert metrics.metadata == {"recommended_epochs": 3.0, "recommended_updates": 12.0, "lr_used": 1e-4,
                                "updates_trained": 16.0, "chosen_update": 12.0, "chosen_epoch": 3.0}
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("rangefinder: warning: best_val_loss (nan), chosen_val_loss (inf) left out of the step's KFP "
                    "metrics: not a finite number (KFP's metrics are JSON); the step's MLflow run and report show "
                    "where it came from"), line


@pytest.mark.parametrize(("typed", "said"), [
    ("/data/datasets/mine", "pipeline parameter dataset_uri '/data/datasets/mine' is not an object-store URI (s3://, "
                            "gs://, minio://), which KFP's importer downloads; for a folder on the data volume give "
                            "its path as dataset_dir and leave dataset_uri empty"),
    ("s3://AKIAEXAMPLE:hunter2-pw@bucket/cats", "pipeline parameter dataset_uri holds a user name and password"),
])
def test_a_dataset_uri_the_importer_cannot_read_is_resolve_config_s_one_line(typed, said, capsys, tmp_path):
    """The run form's dataset_uri, checked as `submit --dataset-uri` is: a folder's path typed there (dataset_dir's
    kind of value) failed in the importer in KFP's own words, and a URI holding a password went on to it. The
    importer runs after resolve-config (test_pipeline.py), so this line is the run's error; the secret is not in it."""
    params = parameters_from_config(demo_config(), dataset_uri=typed)
    with pytest.raises(SystemExit) as stopped:
        c.resolve_config.python_func(**params, pipeline_job_id="", report=_report(tmp_path))
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"rangefinder step resolve-config: error: ConfigError: {said}"), line
    assert "hunter2" not in line


def _through_every_step(cfg, out: Path, *, finder: str) -> dict:
    """The keep-finetuned branch, component by component: resolve-config, prepare-dataset, the LR's source (`finder`:
    the range test, prodigy-step-size or the fixed LR) and choose-lr, finetune, sample-images and register-model,
    each function on the outputs of the ones before it, in task folders as a pipeline root holds them. Returns the
    fields of a local run's summary that the registry check reads (tests/pipelines/registered_model.py), and the
    prodigy run's outputs under `prodigy`."""
    from kfp.dsl import HTML, Metrics, Model

    root = out / "pipeline-root"

    def artifact(kind, task: str, name: str):
        (root / task).mkdir(parents=True, exist_ok=True)
        return kind(name=name, uri=str(root / task / name))

    resolved = _resolve(cfg, out / "pipeline-root")
    config_json = resolved.config_json
    split = artifact(Dataset, "prepare-dataset", "split")
    c.prepare_dataset.python_func(config_json=config_json, split=split,
                                  report=artifact(Markdown, "prepare-dataset", "report"))
    prodigy = None
    chosen: dict = {}
    if finder == "prodigy-step":
        prodigy = c.prodigy_step_size.python_func(
            config_json=config_json, split=split, mlflow_parent_run_id="",
            curve=artifact(Dataset, "prodigy-step-size", "curve"),
            metrics=artifact(Metrics, "prodigy-step-size", "metrics"),
            report_html=artifact(HTML, "prodigy-step-size", "report_html"),
            report_md=artifact(Markdown, "prodigy-step-size", "report_md"))
        bounds = (prodigy.lr,) * 3 + ("prodigy-step",)
        chosen = {"updates": prodigy.updates, "factor": prodigy.factor}
    elif finder == "range-test":
        found = c.lr_range_test.python_func(
            config_json=config_json, split=split, stage="first", mlflow_parent_run_id="",
            curve=artifact(Dataset, "lr-range-test", "curve"), metrics=artifact(Metrics, "lr-range-test", "metrics"),
            report_html=artifact(HTML, "lr-range-test", "report_html"),
            report_md=artifact(Markdown, "lr-range-test", "report_md"))
        bounds = (found.lr_low, found.lr_high, found.lr_mid, "range-test")
    else:
        bounds = (resolved.fixed_lr,) * 3 + ("fixed",)
    lr = c.choose_lr.python_func(config_json=config_json, lr_low=bounds[0], lr_high=bounds[1], lr_mid=bounds[2],
                                 source=bounds[3], decision=artifact(Markdown, "choose-lr", "decision"), **chosen)
    model = artifact(Model, "finetune", "model")
    ft = c.finetune.python_func(
        config_json=config_json, split=split, lr_low=lr.lr_low, lr_high=lr.lr_high, lr_mid=lr.lr_mid,
        lr_source=lr.source, mlflow_parent_run_id="", model=model, curve=artifact(Dataset, "finetune", "curve"),
        metrics=artifact(Metrics, "finetune", "metrics"), report_html=artifact(HTML, "finetune", "report_html"),
        report_md=artifact(Markdown, "finetune", "report_md"))
    c.sample_images.python_func(config_json=config_json, finetuned=model, mlflow_parent_run_id="",
                                grid=artifact(HTML, "sample-images", "grid"),
                                images=artifact(Dataset, "sample-images", "images"))
    result = artifact(Markdown, "register-model", "result")
    registered = c.register_model.python_func(config_json=config_json, model=model, lr=ft.lr_used,
                                              epochs=ft.recommended_epochs, mlflow_parent_run_id="", result=result)
    return {"pipeline_root": str(root), "lr_source": lr.source, "registered_model": registered.model_uri,
            "result": Path(result.path).read_text(), "lr_used": ft.lr_used,
            "recommended_epochs": ft.recommended_epochs,
            "chosen_update": ft.chosen_update, "chosen_rule": ft.chosen_rule,
            "recommended_updates": ft.recommended_updates,
            "mixed_precision": ft.mixed_precision, "config_json": config_json, "prodigy": prodigy,
            "lr_finder": resolved.lr_finder, "lr_mid": lr.lr_mid, "lr_low": lr.lr_low, "lr_high": lr.lr_high}


# A fixed LR per method near the tiny model's measured midpoints (config.DEFAULT_LR_RANGE's comment); textual
# inversion 2e-2 since the tiny model reads its captions (BUILDER_VERSION 3): at 6e-3 its 8 updates recommended no
# window. The full fine-tune discovers its LR (4 range-test epochs, the fewest that give readable bounds).
FIXED_LR = {"textual_inversion": 2e-2}


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread_as_a_local_run")
@pytest.mark.parametrize("method", ["full", "textual_inversion"])
def test_a_hub_id_through_every_step_registers_the_kept_checkpoint(method, fake_hub_cache, shapes_dataset_dir,
                                                                    tmp_path, monkeypatch):
    """A real user's hub id on an air-gapped cluster, per method, through every step's function to the registry (a
    real SQLite MLflow store, the registered version downloaded and read back). Each as small as the pipeline
    allows: 2 fine-tune epochs validated every update (9 points: with 5, a steady fall is not yet significant and no
    window is read), one prompt, one seed, 2 denoising steps. Checked: the first step resolved the model once and
    every later step used that folder (the grid's base column included); the registered version holds exactly the
    kept checkpoint's weights at the recommended update, and its tags and description say which and why. The DAG
    that hands these outputs on is run whole in tests/pipelines/test_local_run.py (LoRA from this hub id through
    `rangefinder run --local`, and the default and retrain runs)."""
    from tests.pipelines.registered_model import check_registered_is_the_kept_checkpoint

    cache, commit = fake_hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "out"
    out.mkdir()
    lr = {"lr": FIXED_LR[method]} if method in FIXED_LR else {}
    cfg = demo_config(data={"dataset_dir": str(shapes_dataset_dir), "resolution": 32},
                      model={"base_model": HUB_REPO}, training={"method": method},
                      tracking={"tracking_uri": f"sqlite:///{out / 'mlflow.db'}"},
                      lr_range_test={"epochs": 4, "zoom": False}, finetune={"epochs": 2},
                      validation={"every_updates": 1},
                      sampling={"prompts": ["a red circle"], "seeds": [0], "num_inference_steps": 2}, **lr)
    s = _through_every_step(cfg, out, finder="fixed" if method in FIXED_LR else "range-test")
    assert s["lr_source"] == ("fixed" if method in FIXED_LR else "range-test")
    assert s["registered_model"] == "models:/rangefinder-sd/1"
    # register-model's result, the run's outcome on its graph in the Kubeflow UI: the model, the kept checkpoint, the
    # LR and length, and the MLflow run (a local store: its UI's link, and the command that serves it).
    result = s["result"]
    assert "| Model | `models:/rangefinder-sd/1` |" in result, result
    assert f"| Learning rate | {s['lr_used']:.3g} |" in result, result
    assert f"| Recommended epochs | {s['recommended_epochs']} |" in result, result
    assert f"update {s['chosen_update']}" in result and "](http://127.0.0.1:5000/#/experiments/" in result, result
    assert "mlflow ui --backend-store-uri sqlite:///" in result, result
    snapshot = cache / f"models--{HUB_REPO.replace('/', '--')}" / "snapshots" / commit
    resolved = load_step_config(s["config_json"]).model
    assert (resolved.base_model, resolved.resolved_dir) == (HUB_REPO, str(snapshot))
    check_registered_is_the_kept_checkpoint(s, out, snapshot, method)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread_as_a_local_run")
def test_retrain_full_in_a_users_pipeline_registers_the_retrain_s_weights(shapes_dataset_dir, tiny_model_dir,
                                                                          tmp_path, monkeypatch):
    """A user's own pipeline: prepare-dataset, retrain-full and register-model, handed the config as the user wrote
    it (no resolve-config, so retrain.enabled is not set). retrain-full returns its epochs under both names, and
    register-model tells the retrain's weights by the model artifact retrain-full wrote, not by the config: with the
    config's flag it said "The fine-tune's final weights" of the retrain's. The published files run such a pipeline
    under kfp.local (test_reuse.py, the range test); the retrain branch's outputs go through kfp.local's DAG in
    test_local_run.py."""
    from kfp.dsl import HTML, Metrics, Model
    from mlflow import MlflowClient

    from tests.mlflow_store import seed
    from tests.pipelines.tiny_run import tiny_config

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    seed(tmp_path / "mlflow.db")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("RANGEFINDER_MLFLOW_SPOOL", str(tmp_path / "spool"))
    cfg = tiny_config(shapes_dataset_dir, tiny_model_dir)
    assert not cfg.retrain.enabled
    config_json = cfg.model_dump_json()
    root = tmp_path / "root"

    def artifact(kind, task: str, name: str):
        (root / task).mkdir(parents=True, exist_ok=True)
        return kind(name=name, uri=str(root / task / name))

    split = artifact(Dataset, "prepare-dataset", "split")
    c.prepare_dataset.python_func(config_json=config_json, split=split,
                                  report=artifact(Markdown, "prepare-dataset", "report"))
    model = artifact(Model, "retrain-full", "model")
    report_html = artifact(HTML, "retrain-full", "report_html")
    report_md = artifact(Markdown, "retrain-full", "report_md")
    kfp_metrics = artifact(Metrics, "retrain-full", "metrics")
    full = c.retrain_full.python_func(config_json=config_json, split=split, lr_low=1e-4, lr_high=1e-4, lr=1e-4,
                                      recommended_epochs=1, model=model,
                                      metrics=kfp_metrics, report_html=report_html, report_md=report_md)
    assert (full.epochs, full.Output) == (1, 1)
    # Its KFP metrics are the ones their description names: it promised the training loss, which they never held.
    described = c.retrain_full.component_spec.outputs["metrics"].description
    assert set(kfp_metrics.metadata) == {"retrain_epochs", "retrain_updates"}, kfp_metrics.metadata
    assert all(name in described for name in kfp_metrics.metadata) and "loss as" not in described, described
    # The retrain shows its curve in the KFP UI as the other training steps do: a report whose HTML embeds the plot
    # of its training loss (the UI shows no image files), and the same in Markdown; it showed nothing of its run.
    page, md = Path(report_html.path).read_text(), Path(report_md.path).read_text()
    assert "data:image/png;base64," in page and "Retrained on train + validation for 1 epochs" in page, page[:2000]
    assert md.startswith("## Full-data retrain") and "| train loss, last epoch |" in md, md
    c.register_model.python_func(config_json=config_json, model=model, lr=1e-4, epochs=full.epochs,
                                 mlflow_parent_run_id="", result=artifact(Markdown, "register-model", "result"))
    mv = MlflowClient(uri).get_model_version(cfg.tracking.registered_model_name, "1")
    assert mv.tags["rangefinder.weights"] == "retrain_full final"
    assert mv.description.startswith("Retrained on train + validation for 1 epochs")
    # The retrain's MLflow run holds the same report, and the curve it names (curves/updates.csv).
    client = MlflowClient(uri)
    (retrain,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                    "attributes.run_name = 'retrain_full'")
    logged = {a.path for folder in ("report", "curves") for a in client.list_artifacts(retrain.info.run_id, folder)}
    assert {"report/retrain_report.html", "report/retrain.png", "curves/updates.csv"} <= logged, logged


# Each family's own pipeline's guidance, which the run samples at with sampling.guidance_scale unset.
OWN_GUIDANCE = {"sd3": 7.0, "sdxl": 5.0}


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread_as_a_local_run")
@pytest.mark.parametrize("family", ["sd3", "sdxl"])
def test_lr_finder_auto_fine_tunes_at_the_prodigy_step_size_and_registers_it(family, shapes_dataset_dir, tmp_path,
                                                                              monkeypatch, request):
    """SD3 and SDXL, end to end on the branch lr_finder auto takes for their full fine-tune (prodigy_step, read off
    the model by resolve-config): the family's loss, its sampler at its own pipeline's guidance, and its registered
    model, through every step's function with the whole run's tiny settings, the family read from the model into
    every step's MLflow run. The same branch runs whole under kfp.local on Flux (test_local_run_prodigy_step.py,
    which also holds the branch's reports to tiny_run.PRODIGY_REPORTS); SD3 ran there whole and SDXL in
    test_demo_sdxl.py until 2026-12-07, and showed nothing these functions do not."""
    import sqlite3

    from rangefinder.analysis import read_curve_csv
    from rangefinder.config import FAMILY_NAMES, prodigy_step_factor
    from tests.mlflow_store import seed
    from tests.pipelines.tiny_run import TINY, prodigy_branch_params, tiny_config

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "out"
    out.mkdir()
    seed(out / "mlflow.db")
    # 3 epochs (12 updates): long enough for Prodigy's d to grow from d0 (at update 9 on SD3), as it must to be read;
    # the sampler and guidance the family's own (the scheduler and guidance unset).
    model = request.getfixturevalue(f"tiny_{family}_dir")
    cfg = tiny_config(shapes_dataset_dir, model, lr_finder="auto",
                      lr_range_test={"lr_min": None, "lr_max": None}, finetune={"epochs": 3},
                      sampling={**TINY["sampling"], "scheduler": None, "guidance_scale": None},
                      tracking={"tracking_uri": f"sqlite:///{out / 'mlflow.db'}"})
    s = _through_every_step(cfg, out, finder="prodigy-step")
    assert s["lr_finder"] == "prodigy_step"  # what resolve-config read auto as, on this model
    probe = s["prodigy"]
    updates = read_curve_csv(next((out / "pipeline-root" / "prodigy-step-size" / "curve").glob("**/updates.csv")),
                             required=("prodigy_d_lr",))
    # The LR is the last step size (d x lr after the last update), times the family's factor for full fine-tuning.
    factor = prodigy_step_factor(family, "full")
    assert factor == 4.0 == probe.factor
    assert probe.lr == factor * updates["prodigy_d_lr"][-1] == factor * probe.d > 0
    assert probe.updates == len(updates["update"]) == 12
    # choose-lr collapsed the bounds onto it; the fine-tune trained that one LR (no halving) and it was registered.
    assert (s["lr_source"], s["lr_low"], s["lr_mid"], s["lr_high"]) == ("prodigy-step", probe.lr, probe.lr, probe.lr)
    assert s["lr_used"] == probe.lr and s["registered_model"] == "models:/rangefinder-sd/1"
    assert s["recommended_epochs"] >= 1
    decision = (out / "pipeline-root" / "choose-lr" / "decision").read_text()
    assert "read off a Prodigy run's final step size d x lr" in decision
    assert f"(lr_finder: auto, which measures full on {FAMILY_NAMES[family]} with prodigy_step)" in decision
    assert f"d x lr = {probe.lr / 4:.3g}, 12 updates, times 4 = {probe.lr:.3g} (full on this family trains at 4 " \
           "times" in decision, decision
    with sqlite3.connect(out / "mlflow.db") as con:
        runs = dict(con.execute("select name, status from runs").fetchall())
        finder, factor_param, guidance = prodigy_branch_params(con)
        families = con.execute("select r.name, t.value from runs r join tags t on t.run_uuid = r.run_uuid "
                               "where t.key = 'rangefinder.model_family'").fetchall()
    assert runs["prodigy_step_size"] == runs["finetune"] == "FINISHED" and "lr_range_test" not in runs, runs
    assert finder == {"lr_finder": "auto", "lr_finder_used": "prodigy_step"}, finder
    assert float(factor_param) == factor  # the Prodigy run's MLflow run says the LR trained is 4x its step size
    # The model was this family all along: read from the model, into every tracked step's MLflow run.
    assert {v for _, v in families} == {family} and {n for n, _ in families} >= {"prodigy_step_size", "finetune"}
    # The guidance unset is the family's pipeline's own: the step's run shows it beside the setting, and the grid and
    # the samples during training are drawn at it.
    own = OWN_GUIDANCE[family]
    assert {float(v) for v in guidance.values()} == {own} and "finetune" in guidance, guidance
    grid = json.loads(next((out / "pipeline-root" / "sample-images").glob("**/grid.json")).read_text())
    during = json.loads(next((out / "pipeline-root" / "finetune").glob("**/samples/index.json")).read_text())
    assert grid["settings"]["guidance_scale"] == during["settings"]["guidance_scale"] == own
