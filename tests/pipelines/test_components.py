"""The KFP components' own functions (`component.python_func`), called as kfp calls them in a step: the pipeline's
typed parameters in, real artifact objects (kfp.dsl Input/Output) on real folders, the outputs read back.

What a whole kfp.local run would prove about one wrapper, in seconds; kfp.local is kept for the DAG's wiring
(tests/pipelines/test_local_run.py: the default run, the retrain branch and the fixed LR).
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


def _resolve(cfg) -> tuple:
    """resolve_config's function with the pipeline's parameters for `cfg`, as kfp.local hands them over (no KFP run
    id: no MLflow parent run)."""
    params = parameters_from_config(cfg)
    params.pop("dataset_uri")
    return c.resolve_config.python_func(**params, pipeline_job_id="")


def test_resolve_config_resolves_a_hub_id_from_the_offline_cache(fake_hub_cache, shapes_dataset_dir, monkeypatch):
    """A real user's hub id on an air-gapped cluster (tests/pipelines/test_local_run_base_models.py runs it through
    every step): the snapshot folder is in the config every later step reads."""
    cache, commit = fake_hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = _resolve(demo_config(data={"dataset_dir": str(shapes_dataset_dir)}, model={"base_model": HUB_REPO},
                             lr=4e-3, retrain={"enabled": True}))
    assert (r.fixed_lr, r.retrain, r.mlflow_parent_run_id) == (4e-3, True, "")
    model = load_step_config(r.config_json).model
    snapshot = cache / f"models--{HUB_REPO.replace('/', '--')}" / "snapshots" / commit
    assert (model.base_model, model.resolved_dir) == (HUB_REPO, str(snapshot))


def test_resolve_config_converts_a_single_file_once(tiny_model_dir, tmp_path):
    """A downloaded single-file checkpoint (no rangefinder metadata; model.single_file_config names the
    architecture), converted by the first step into the cache, once. tests/models/test_loading.py shows the
    converted folder holds the file's weights."""
    from rangefinder.formats.export import export_full

    single = export_full(tiny_model_dir, tmp_path / "tiny-sd.safetensors")
    cfg = demo_config(model={"base_model": str(single), "single_file_config": str(tiny_model_dir),
                             "cache_dir": str(tmp_path / "cache")})
    first = load_step_config(_resolve(cfg).config_json).model
    (converted,) = [p for p in (tmp_path / "cache" / "base-models").glob("tiny-sd-*") if p.is_dir()]
    assert first.base_model == str(single) and first.resolved_dir == str(converted)
    stamp = (converted / "model_index.json").stat().st_mtime_ns
    again = load_step_config(_resolve(cfg).config_json).model
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
