"""The discovery-quality benchmark keeps working (a tiny smoke case), and its summary arithmetic is right."""

import json

import pytest


@pytest.mark.slow
def test_discovery_quality_smoke(tmp_path, capsys):
    from bench.discovery_quality import main
    from rangefinder.data.synthetic import make_synthetic_dataset

    # Any folder of images and captions runs the same comparison (--dataset); here one of the subject kind.
    folder = tmp_path / "my-subject"
    make_synthetic_dataset(folder, kind="subject", count=10, seed=5)
    out = tmp_path / "dq.json"
    result = main(["--smoke", "--kinds", "shapes", "--dataset", str(folder), "--held-out", "my-subject",
                   "--out", str(out), "--work-dir", str(tmp_path / "work")])
    saved = json.loads(out.read_text())
    assert saved["aggregate"] == json.loads(json.dumps(result["aggregate"]))
    assert saved["smoke"] is True and saved["partial"] is False
    assert {k: saved["settings"][k] for k in ("kinds", "seeds", "images", "grid_points", "held_out")} == {
        "kinds": ["shapes"], "seeds": [0], "images": 10, "grid_points": 2, "held_out": ["my-subject"]}
    case, other = saved["cases"]
    assert (case["kind"], case["held_out"], other["kind"], other["held_out"]) == ("shapes", False, "my-subject", True)
    assert other["dataset_dir"] == str(folder.resolve()) and other["images"] == 10 and other["synthetic_kind"] is None
    assert other["summary"]["grid_updates"] == 8 and set(saved["aggregate_by_kind"]) == {"shapes", "my-subject"}
    # A smoke trains the other arms on its first case only (bench.discovery_quality.main).
    assert other["classic"] == {} and other["midpoint_arms"] == {} and "diagnostic_lr_high" not in other
    assert saved["aggregate_held_out"]["cases"] == 1 and saved["aggregate_tuned_on"]["cases"] == 1
    # The headline has a column per dataset (and all together), the held-out one marked.
    printed = capsys.readouterr().out
    head = next(line for line in printed.splitlines() if line.startswith("| ") and "shapes" in line)
    assert "my-subject (held out)" in head and "all" in head
    # 10 images leave 8 to train on at batch 4: 2 updates an epoch. A range test runs 3 epochs (6 updates), a fixed-LR
    # run the fine-tune's 2 epochs (4 updates).
    d = case["discovery"]
    tests = d["range_tests"]
    assert [t["stage"] for t in tests] in (["first"], ["first", "zoom"])
    assert (tests[0]["lr_min"], tests[0]["lr_max"]) == (1e-5, 1e-2)  # the demo config's sweep
    assert all(t["updates"] == 6 for t in tests)
    assert d["updates"] == 6 * len(tests) + d.get("finetune_updates_trained", 0)  # what discovery cost, all of it
    last = tests[-1]
    if d["status"] == "ok":
        assert last["status"] == "ok" and d["lr_source"] == ("zoom" if len(tests) == 2 else "range-test")
        assert last["lr_min"] <= d["lr_low"] <= d["lr_mid"] <= d["lr_high"] <= last["lr_max"]
        assert d["finetune_updates"] == 4 and 1 <= d["recommended_updates"] <= 4
        # Successive halving: lr_mid and lr_high both to the pause (update 2), the kept one on to 4.
        assert d["halving"]["pause_update"] == 2 and d["finetune_updates_trained"] == 4 + 2
        assert d["lr_used"] == d[d["halving"]["kept"]]
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
    # The other midpoint rules between the same bounds, each trained like a grid point; the chosen one is the
    # discovery's own fine-tune.
    if d["status"] == "ok":
        assert last["midpoint"] == "tuned" and set(case["midpoint_arms"]) == {"geometric", "arithmetic"}
        for rule, row in case["midpoint_arms"].items():
            assert row["lr"] == pytest.approx(last["midpoints"][rule])
            assert last["lr_low"] <= row["lr"] <= last["lr_high"]
            assert row["updates"] == 4 or row.get("same_as") == "tuned"
    else:
        assert case["midpoint_arms"] == {}
    s = case["summary"]
    assert s["discovery_status"] == d["status"] and s["grid_updates"] == 8
    assert s["quality"] == (last["quality"] if d["status"] == "ok" else 0.0) and s["flags"] == last["flags"]
    # The tuned midpoint's arm is the discovery's fine-tune, unless successive halving kept lr_high: then lr_mid
    # trained only half-way and has no whole arm to score.
    kept_mid = d.get("halving") is None or d["halving"]["kept"] == "lr_mid"
    assert s["mid_tuned_gap_pct"] == (s["discovery_gap_pct"] if kept_mid else None)
    assert s["cost_fraction_updates"] == pytest.approx(d["updates"] / 8)
    assert s["grid_best_val_loss"] == min(g["best_val_loss"] for g in case["grid"])

    # A variant reuses that grid instead of training it: the same arms, no grid run, and the same discovery (the
    # losses are deterministic on CPU, and the fine-tune's update-0 loss is checked against the grid's). One case of
    # the two is enough (each case is looked up on its own): the folder's, whose match (its path and image count)
    # is the one with more to check; a case the earlier result lacks is refused (test_reuse_grid_refuses_...).
    out2, work2 = tmp_path / "dq-reused.json", tmp_path / "work2"
    again = main(["--smoke", "--dataset", str(folder), "--held-out", "my-subject",
                  "--no-classic", "--no-midpoint-arms", "--no-diagnose-lr-high", "--reuse-grid", str(out),
                  "--out", str(out2), "--work-dir", str(work2), "--keep"])
    assert again["settings"]["reuse_grid"] == str(out)
    for new_case, old_case in zip(again["cases"], saved["cases"][1:], strict=True):
        assert new_case["grid_reused"] is True
        assert [{k: v for k, v in g.items() if k != "reused"} for g in new_case["grid"]] == old_case["grid"]
        assert all(g["reused"] for g in new_case["grid"])
        assert new_case["discovery"].get("best_val_loss") == old_case["discovery"].get("best_val_loss")
        assert new_case["summary"]["grid_best_val_loss"] == old_case["summary"]["grid_best_val_loss"]
        kept = {p.name for p in (work2 / f"{new_case['kind']}-seed0").iterdir()}
        assert "discovery" in kept and not any(name.startswith("grid-") for name in kept)  # nothing trained
    # A run whose grid would differ refuses before it trains anything, and says which setting and the way out.
    with pytest.raises(SystemExit) as exc:
        main(["--smoke", "--kinds", "shapes", "--grid-lr-max", "1e-3", "--reuse-grid", str(out),
              "--out", str(tmp_path / "dq-bad.json"), "--work-dir", str(tmp_path / "work3")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "grid_lr_max is 0.01, this run's 0.001" in err and "run without --reuse-grid" in err
    assert not (tmp_path / "dq-bad.json").exists() and not (tmp_path / "work3").exists()


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


def test_midpoint_rules_in_the_summary():
    from bench.discovery_quality import aggregate, summarize_case

    grid = [{"lr": 1e-4, "updates": 10, "seconds": 1.0, "best_val_loss": 0.5, "baseline_val_loss": 1.0},
            {"lr": 1e-3, "updates": 10, "seconds": 1.0, "best_val_loss": 0.4, "baseline_val_loss": 1.0}]
    used = {"midpoint": "tuned", "quality": 0.8, "flags": ["upper_censored"],
            "midpoints": {"tuned": 8e-4, "geometric": 4e-4, "arithmetic": 6e-4}}
    disc = {"status": "ok", "updates": 5, "seconds": 0.5, "best_val_loss": 0.404, "lr_mid": 8e-4,
            "range_tests": [{"quality": 0.3, "flags": [], "status": "ok"}, used]}
    case = {"kind": "textures", "seed": 0, "held_out": False, "grid": grid, "discovery": disc, "classic": {},
            "midpoint_arms": {"geometric": {"lr": 4e-4, "best_val_loss": 0.42},
                              "arithmetic": {"lr": 6e-4, "best_val_loss": 0.41}}}
    s = summarize_case(case)
    assert s["mid_tuned_gap_pct"] == pytest.approx(1.0) and s["mid_tuned_lr"] == 8e-4
    assert s["mid_geometric_gap_pct"] == pytest.approx(5.0) and s["mid_arithmetic_gap_pct"] == pytest.approx(2.5)
    # The score and flags of the test the LR came from (the zoom), and of the first.
    assert (s["quality"], s["flags"], s["censored"], s["zoomed"]) == (0.8, ["upper_censored"], True, True)
    assert (s["first_quality"], s["first_flags"]) == (0.3, [])
    agg = aggregate([s], within_pct=3.0)
    assert agg["mid_tuned_within_3pct"] == 1 and agg["mid_arithmetic_within_3pct"] == 1
    assert agg["mid_geometric_within_3pct"] == 0


def test_spearman_and_score_vs_gap():
    from bench.discovery_quality import score_vs_gap, spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties share their mean rank; an infinite gap (a failed discovery) ranks last.
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)
    assert spearman([0.1, 0.5, 0.9], [float("inf"), 2.0, 1.0]) == pytest.approx(-1.0)
    assert spearman([1, 1, 1], [1, 2, 3]) is None and spearman([1, 2], [1, 2]) is None
    rows = [{"quality": q, "discovery_gap_pct": g, "censored": c, "discovery_still_improving": False,
             "discovery_lr_decades_from_grid_best": d}
            for q, g, c, d in ((0.9, 0.1, False, 0.0), (0.8, 0.5, False, -0.1), (0.45, 4.0, True, -0.5),
                               (0.35, 1.0, False, 0.2))]
    rows.append({"quality": 0.0, "discovery_gap_pct": None, "censored": False})  # failed: a miss at score 0
    out = score_vs_gap(rows, 3.0, thresholds=(0.5,))
    assert out["n"] == 5 and out["spearman_score_gap"] == pytest.approx(-0.9)
    assert out["thresholds"] == [{"threshold": 0.5, "below": 3, "below_misses": 2, "at_or_above": 2,
                                  "above_misses": 0}]
    assert out["censored"] == {"flagged": 1, "flagged_misses": 1, "not_flagged": 4, "not_flagged_misses": 1}
    assert out["spearman_score_abs_decades"] == pytest.approx(-0.8)


def test_dataset_sources_name_the_problem(tmp_path):
    from bench.discovery_quality import dataset_sources
    from rangefinder.errors import RangefinderError

    (tmp_path / "a" / "photos").mkdir(parents=True)
    (tmp_path / "b" / "photos").mkdir(parents=True)
    got = dataset_sources(["shapes"], [tmp_path / "a" / "photos", tmp_path / "b" / "photos"], ["photos"])
    assert [(g["name"], g["held_out"]) for g in got] == [("shapes", False), ("photos", True), ("photos'", False)]
    with pytest.raises(RangefinderError, match="unknown synthetic kind 'faces'"):
        dataset_sources(["faces"], [], [])
    with pytest.raises(RangefinderError, match="is not a folder"):
        dataset_sources([], [tmp_path / "missing"], [])
    with pytest.raises(RangefinderError, match="--held-out names subject"):
        dataset_sources(["shapes"], [], ["subject"])


def _reusable_result(tmp_path, **case_update):
    case = {"kind": "shapes", "synthetic_kind": "shapes", "dataset_dir": None, "seed": 0, "images": 20,
            "finetune_epochs": 40, "grid": [{"lr": 1e-4, "best_val_loss": 0.5, "baseline_val_loss": 1.0},
                                            {"lr": 1e-3, "best_val_loss": 0.4, "baseline_val_loss": 1.0}]}
    case.update(case_update)
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"settings": {"grid_points": 2, "grid_lr_min": 1e-4, "grid_lr_max": 1e-3},
                                "smoke": False, "cases": [case]}))
    return path


def test_reuse_grid_refuses_a_grid_trained_otherwise(tmp_path):
    from argparse import Namespace

    from bench.discovery_quality import check_reused_baseline, load_reusable_grid
    from rangefinder.errors import RangefinderError

    src = [{"name": "shapes", "kind": "shapes", "dataset": None, "held_out": False}]
    args = Namespace(grid_points=2, grid_lr_min=1e-4, grid_lr_max=1e-3, images=20, smoke=False)
    got = load_reusable_grid(_reusable_result(tmp_path), src, [0], args, finetune_epochs=40)
    assert list(got) == [("shapes", 0)] and [g["lr"] for g in got["shapes", 0]] == [1e-4, 1e-3]
    assert all(g["reused"] for g in got["shapes", 0])
    for update, seeds, epochs, match in (
            ({"images": 10}, [0], 40, "case shapes seed 0 has images 10, this run 20"),
            ({}, [1], 40, "has no case shapes seed 1"),
            ({}, [0], 30, "has finetune_epochs 40, this run 30"),
            ({"synthetic_kind": "stripes"}, [0], 40, "has synthetic_kind 'stripes', this run 'shapes'")):
        with pytest.raises(RangefinderError, match=match):
            load_reusable_grid(_reusable_result(tmp_path, **update), src, seeds, args, finetune_epochs=epochs)
    with pytest.raises(RangefinderError, match="grid_points is 2, this run's 3"):
        load_reusable_grid(_reusable_result(tmp_path), src, [0], Namespace(**{**vars(args), "grid_points": 3}), 40)
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(RangefinderError, match="not a readable discovery_quality result"):
        load_reusable_grid(tmp_path / "junk.json", src, [0], args, 40)
    # At run time: the fine-tune's update-0 loss must be the grid's (same model, split and validation).
    grid = got["shapes", 0]
    check_reused_baseline(grid, {"baseline_val_loss": 1.0}, "shapes seed 0")
    check_reused_baseline(grid, {"status": "failed"}, "shapes seed 0")  # no fine-tune ran: nothing to compare
    with pytest.raises(RangefinderError, match="update-0 validation loss is 0.9, the reused grid's 1.0"):
        check_reused_baseline(grid, {"baseline_val_loss": 0.9}, "shapes seed 0")
