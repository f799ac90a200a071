"""The validation-overhead benchmark keeps working: one round of one-epoch runs on 10 images."""

import json

import pytest


@pytest.mark.slow
def test_validation_overhead_smoke(tmp_path):
    from bench.validation_overhead import main

    out = tmp_path / "val.json"
    result = main(["--smoke", "--threads", "1", "--out", str(out), "--work-dir", str(tmp_path / "work"),
                   "--variant", "sparse:every_updates=1,stabilize_every=3",
                   "--variant", "samples:sampling.every_validations=auto"])
    saved = json.loads(out.read_text())
    assert saved["summary"] == result["summary"]
    assert saved["split"] == {"train": 8, "val": 2, "stabilize": 2}
    on = next(r for r in saved["runs"] if r["arm"] == "on")
    off = next(r for r in saved["runs"] if r["arm"] == "off")
    # One epoch validated every epoch: the baseline and the end; each validation measures val and stabilize.
    assert on["validation_rows"] == 2 and on["measure_calls"] == 4 and on["measure_seconds"] > 0
    assert off["measure_calls"] == 0 and off["updates"] == on["updates"] == 2
    assert on["cache"]["latents"]["encoded"] == 0  # latents came from the cache the warm-up filled
    s = saved["summary"]
    assert s["share_direct_pct"] > 0 and s["seconds_per_pass"] > 0
    # K=4 x (2 val + 2 stabilize) forwards per validation vs ~3 x 8 per epoch of training.
    assert s["expected_share_pct"] == pytest.approx(100 * 4 * 4 / (3 * 8))
    # The variant is its own arm in the same rounds: every update (rows 0, 1, 2), stabilize at rows 0 and 2 (the last).
    sparse = next(r for r in saved["runs"] if r["arm"] == "sparse")
    assert sparse["validation_rows"] == 3 and sparse["stabilize_rows"] == 2 and sparse["measure_calls"] == 5
    assert sparse["validation"]["stabilize_every"] == 3 and sparse["updates"] == on["updates"]
    v = s["variants"]["sparse"]
    assert v["validation_passes"] == 3 and v["stabilize_passes"] == 2
    # Half an epoch per validation (2 updates per epoch), val every time, stabilize at 2 of 3.
    assert v["expected_share_pct"] == pytest.approx(100 * 4 * (2 + 2 * 2 / 3) / (3 * 8 * 0.5))
    # Samples during training (the demo's settings): an arm of its own, at the baseline and the last validation.
    samples = next(r for r in saved["runs"] if r["arm"] == "samples")
    assert samples["sample_grids"] == 2 and samples["samples_seconds"] > 0 and on["sample_grids"] == 0
    assert samples["validation_rows"] == on["validation_rows"] and samples["updates"] == on["updates"]
    sv = s["variants"]["samples"]
    assert sv["sampling"] == {"every_validations": "auto"} and sv["sample_grids"] == 2
    assert sv["samples_share_direct_pct"] > 0 and sv["seconds_per_grid"] > 0 and "samples_share_paired_pct" in sv
