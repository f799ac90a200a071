"""The discovery-quality benchmark keeps working (a tiny smoke case), and its summary arithmetic is right."""

import json

import pytest


@pytest.mark.slow
def test_discovery_quality_smoke(tmp_path):
    from bench.discovery_quality import main

    out = tmp_path / "dq.json"
    result = main(["--smoke", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    saved = json.loads(out.read_text())
    assert saved["aggregate"] == json.loads(json.dumps(result["aggregate"]))
    (case,) = saved["cases"]
    # The grid: two constant LRs at the ends of the range, each trained for the fine-tune's 2 epochs (4 updates).
    assert [round(g["lr"], 12) for g in case["grid"]] == [1e-5, 1e-2]
    assert all(g["updates"] == 4 and g["best_val_loss"] > 0 for g in case["grid"])
    d = case["discovery"]
    assert d["status"] in ("ok", "failed") and d["range_tests"] and d["updates"] > 0
    s = case["summary"]
    assert s["grid_updates"] == 8
    assert s["cost_fraction_updates"] == pytest.approx(d["updates"] / 8)
    assert s["grid_best_val_loss"] == min(g["best_val_loss"] for g in case["grid"])


def test_gap_and_aggregate():
    from bench.discovery_quality import aggregate, gap_pct, summarize_case

    assert gap_pct(1.02, 1.0) == pytest.approx(2.0)
    assert gap_pct(None, 1.0) is None
    grid = [{"lr": 1e-4, "updates": 10, "seconds": 1.0, "best_val_loss": 0.5, "baseline_val_loss": 1.0},
            {"lr": 1e-3, "updates": 10, "seconds": 1.0, "best_val_loss": 0.4, "baseline_val_loss": 1.0}]
    disc = {"status": "ok", "updates": 5, "seconds": 0.5, "best_val_loss": 0.404, "lr_mid": 8e-4}
    case = {"kind": "shapes", "seed": 0, "grid": grid, "discovery": disc,
            "classic": {"lr_steepest": {"lr": 1e-4, "best_val_loss": 0.5, "updates_with_range_test": 13}}}
    s = summarize_case(case)
    assert s["grid_best_lr"] == 1e-3 and s["grid_best_at_edge"]
    assert s["discovery_gap_pct"] == pytest.approx(1.0)
    assert s["cost_fraction_updates"] == pytest.approx(0.25)
    assert s["share_of_grid_improvement"] == pytest.approx(0.596 / 0.6)
    assert s["lr_steepest_gap_pct"] == pytest.approx(25.0)
    agg = aggregate([s], within_pct=2.0)
    assert agg["discovery_within_2pct"] == 1 and agg["lr_steepest_within_2pct"] == 0
