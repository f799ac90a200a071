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
    assert saved["smoke"] is True
    assert {k: saved["settings"][k] for k in ("kinds", "seeds", "images", "grid_points")} == {
        "kinds": ["shapes"], "seeds": [0], "images": 10, "grid_points": 2}
    (case,) = saved["cases"]
    # 10 images leave 8 to train on at batch 4: 2 updates an epoch. A range test runs 3 epochs (6 updates), a fixed-LR
    # run the fine-tune's 2 epochs (4 updates).
    d = case["discovery"]
    tests = d["range_tests"]
    assert [t["stage"] for t in tests] in (["first"], ["first", "zoom"])
    assert (tests[0]["lr_min"], tests[0]["lr_max"]) == (1e-5, 1e-2)  # the demo config's sweep
    assert all(t["updates"] == 6 for t in tests)
    assert d["updates"] == 6 * len(tests) + d.get("finetune_updates", 0)  # what discovery cost, all of it
    last = tests[-1]
    if d["status"] == "ok":
        assert last["status"] == "ok" and d["lr_source"] == ("zoom" if len(tests) == 2 else "range-test")
        assert last["lr_min"] <= d["lr_low"] <= d["lr_mid"] <= d["lr_high"] <= last["lr_max"]
        assert d["finetune_updates"] == 4 and 1 <= d["recommended_updates"] <= 4
    else:
        # No usable bounds: the pipeline stops, and says which test failed and how.
        assert d["status"] == "failed" and last["status"] != "ok"
        assert f"({last['status']})" in d["error"] and "finetune_updates" not in d
    # The grid: two constant LRs at the ends of the range, each trained for the fine-tune's 2 epochs.
    assert [round(g["lr"], 12) for g in case["grid"]] == [1e-5, 1e-2]
    assert all(g["updates"] == 4 and g["best_val_loss"] > 0 for g in case["grid"])
    # The classic suggestions come from the first test and are trained like a grid point.
    for name in ("lr_steepest", "lr_min_div10"):
        row = case["classic"][name]
        if tests[0][name] is None:
            assert row["lr"] is None
            continue
        assert row["lr"] == tests[0][name] and 1e-5 <= row["lr"] <= 1e-2
        assert row["updates"] == 4 and row["updates_with_range_test"] == 4 + 6
    # Every fixed-LR run starts from the same model and validates on the same images: one update-0 loss.
    starts = {r["baseline_val_loss"] for r in case["grid"] + [r for r in case["classic"].values() if r["lr"]]}
    assert len(starts) == 1 and starts.pop() > 0
    s = case["summary"]
    assert s["discovery_status"] == d["status"] and s["grid_updates"] == 8
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
