"""SDXL through the whole pipeline (issue 22), without the whole demo's minutes (issue 32, item 5).

Two proofs replace the run of the unchanged `rangefinder demo --family sdxl`:
- SDXL through every step's function (tests/pipelines/test_components.py,
  `test_lr_finder_auto_fine_tunes_at_the_prodigy_step_size_and_registers_it[sdxl]`), the smallest SD pipeline config
  (tests/pipelines/tiny_run.py) on the tiny SDXL model: lr_finder auto measures SDXL's full fine-tune with
  prodigy_step (config.LR_FINDER_AUTO_PRODIGY; bench/RESULTS.md, "SDXL's full fine-tune at Prodigy's step size"),
  so it takes the DAG's prodigy branch, fine-tunes at four times the step size the Prodigy run ended on
  (config.PRODIGY_STEP_FACTOR; "SDXL's full fine-tune at four times the step size") and records the family, read
  from the model, in every tracked step's MLflow run. The branch's DAG and its reports run whole under kfp.local on
  Flux (test_local_run_prodigy_step.py). Until 2026-12-07 a small SDXL kfp.local run here proved the same (41 s);
- `rangefinder demo --family sdxl` compiles the pipeline the SD demo compiles, but for the base model and the range
  test's bounds, which it leaves unset there (the prodigy branch has no use for them, as on SD3 and Flux): so the demo
  on SDXL is the SD demo's pipeline with the SDXL model, which tests/pipelines/test_demo_learns.py runs whole.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_demo_family_sdxl_changes_only_the_base_model_and_the_unused_bounds(tiny_model_dir, tiny_sdxl_dir, tmp_path,
                                                                          monkeypatch, capsys):
    """`rangefinder demo --family sdxl` compiles OUT/pipeline.yaml before it runs it; here the run is refused after
    that, before its first step starts, since --out's reports folder is a file (pipelines.local_run: one line, no
    step process). The SD demo's pipeline, compiled as `demo` compiles it, into the same folder (so every other path
    is the same), differs only in the model and in the range test's bounds: lr_finder auto measures SDXL's full
    fine-tune with prodigy_step, so the SDXL demo leaves them unset (as on SD3 and Flux). (A URI holding credentials
    stopped it here until e173547, since when the demo refuses it before writing anything, the YAML included.)"""
    from rangefinder.cli.commands.demo import prepare_demo
    from rangefinder.cli.main import main
    from rangefinder.config import auto_lr_finder
    from rangefinder.pipelines.pipeline import compile_pipeline

    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    out = tmp_path / "demo"
    out.mkdir()
    (out / "reports").write_text("not a folder\n")
    assert main(["demo", "--family", "sdxl", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out's reports folder" in err and "is a file" in err, err[-3000:]
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
