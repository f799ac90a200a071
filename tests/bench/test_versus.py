"""bench.versus keeps working (a tiny smoke case), and its verdict arithmetic is the Goal's."""

import json
from pathlib import Path

import pytest

from bench.versus import (
    HELD_OUT_KINDS,
    HELD_OUT_SEEDS,
    OPPONENTS,
    SCORED_ARMS,
    aggregate,
    case_adapter,
    case_overrides,
    case_training_seed,
    delivered_weights,
    effective_lrs,
    finish,
    held_out_prompts,
    plain_finetune,
    random_at_compute,
    random_draws,
    random_lrs,
    rebuild_case,
    rechoose,
    report,
    reusable_arms,
    score_prompts,
    summarize,
    top_up_random,
    verdict_of,
)


def test_verdict_ties_within_one_percent():
    assert verdict_of(1.0, 1.0) == "tie"
    assert verdict_of(1.009, 1.0) == "tie" and verdict_of(0.991, 1.0) == "tie"
    assert verdict_of(0.98, 1.0) == "win" and verdict_of(1.02, 1.0) == "loss"
    assert verdict_of(1.0, None) is None and verdict_of(None, None) is None
    # (a) failed (no bounds, no model) where the other arm delivered one: a loss, not a case left out.
    assert verdict_of(None, 1.0) == "loss"


def test_a_failed_rangefinder_counts_against_it():
    rows = [_summary(1.0, 1.1, 1.1, 1.1, grid=0.99), _summary(None, 1.0, 1.0, 1.0, grid=0.99)]
    agg = aggregate(rows)
    assert agg["vs_prodigy_best"] == {"n": 2, "win": 1, "tie": 0, "loss": 1}
    assert agg["vs_random_best"]["loss"] == 1 and agg["goals"]["beats_random"]["share"] == 0.5
    # Within 3 % of the grid in 1 of 2: the failed case is a miss, not a case less.
    assert agg["gap_rangefinder_pct"]["n"] == 2 and agg["gap_rangefinder_pct"]["within_3pct"] == 1
    assert agg["gap_rangefinder_pct"]["failed"] == 1 and agg["goals"]["grid"]["share"] == 0.5


def _summary(a, b, c, d, grid=None, share=0.2):
    s = {"held_out": False, "rangefinder": a, "prodigy_best": b, "prodigy_final": b, "folk_final": c,
         "folk_best": c, "random_best": d}
    for opp in OPPONENTS:
        s[f"vs_{opp}"] = verdict_of(a, s[opp])
    if grid is not None:
        s["grid_best"], s["rangefinder_update_share"] = grid, share
        for arm in ("rangefinder", *OPPONENTS):
            s[f"gap_{arm}_pct"] = None if s[arm] is None else 100 * (s[arm] - grid) / grid
    return s


def test_goals_follow_the_thresholds():
    # 5 cases: (a) beats Prodigy in 3, ties 1, loses 1 (80 % as good, 60 % better: met); beats the folk default in
    # 2, ties 3 (100 % as good but only 40 % better: not met); beats random search in 3 of 5 (60 % < 70 %).
    rows = [_summary(1.0, 1.1, 1.1, 1.1, grid=0.99), _summary(1.0, 1.1, 1.1, 1.1, grid=0.99),
            _summary(1.0, 1.1, 1.0, 1.1, grid=0.99), _summary(1.0, 1.0, 1.0, 1.0, grid=0.99),
            _summary(1.0, 0.9, 1.0, 0.9, grid=0.90)]
    agg = aggregate(rows)
    assert agg["vs_prodigy_best"] == {"n": 5, "win": 3, "tie": 1, "loss": 1}
    # Beneath the band: (a)'s 1.0 is lower than Prodigy's 1.1 three times, equal once, higher once.
    assert agg["a_lower_than"]["prodigy_best"] == {"n": 5, "lower": 3}
    g = agg["goals"]
    assert g["as_good_as_prodigy_best"]["met"] is True
    assert g["as_good_as_folk_final"]["share"] == 1.0 and g["as_good_as_folk_final"]["met"] is False
    assert g["beats_random"]["share"] == 0.6 and g["beats_random"]["met"] is False
    # Within 3 % of the grid in 4 of 5 (80 % < 85 %): not met, whatever the cost.
    assert agg["gap_rangefinder_pct"]["within_3pct"] == 4 and g["grid"]["met"] is False


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sd1", "sdxl", "flux"])
def test_versus_smoke(tmp_path, capsys, family, request):
    """Every arm runs on the family's tiny model (sdxl: its full fine-tune measured by four times Prodigy's step size;
    flux: the flow-matching one, its own loss and sampler). The SD 1.x smoke is the session's
    (tests/bench/conftest.py), which the probes' tests start from too."""
    from bench.versus import main

    if family == "sd1":
        smoke = request.getfixturevalue("sd1_versus_smoke")
        out, result, printed = smoke.out, smoke.result, smoke.printed
    else:
        out = tmp_path / "versus.json"
        result = main(["--smoke", "--family", family, "--out", str(out), "--work-dir", str(tmp_path / "work"),
                       "--unseen-images", "4"])
        printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["smoke"] is True and saved["partial"] is False
    assert saved["aggregate"] == json.loads(json.dumps(result["aggregate"]))
    assert saved["settings"]["held_out_kinds"] == list(HELD_OUT_KINDS)
    assert saved["settings"]["held_out_seeds"] == list(HELD_OUT_SEEDS)
    assert saved["settings"]["family"] == family and saved["runs"][0]["family"] == family
    # The run's base model is the family's (the tiny models' cache folders are named tiny-sd-, tiny-flux-, ...).
    assert Path(saved["runs"][0]["base_model"]).name.startswith(
        {"sd1": "tiny-sd-", "sdxl": "tiny-sdxl-", "flux": "tiny-flux-"}[family])
    (case,) = saved["cases"]
    s = case["summary"]
    assert (s["family"], s["method"], s["kind"], s["seed"], s["held_out"]) == (family, "full", "shapes", 0, False)
    assert case["family"] == family and s["case"] == (
        "full shapes 0" if family == "sd1" else f"{family} full shapes 0")
    # 10 images leave 8 to train on at batch 4: 2 updates an epoch, 2 epochs (sdxl and flux: 6, for Prodigy's d to
    # move). Every arm trains (a)'s length.
    length = {"sd1": 4, "sdxl": 12, "flux": 12}[family]
    a = case["rangefinder"]
    # (a) as shipped: the range test on SD 1.x; on flux, lr_finder auto's Prodigy step size (no range test), which
    # the smoke's length lets d leave d0 for.
    assert a["status"] == "ok" or family == "sd1", a
    if a["status"] == "ok":
        assert bool(a["range_tests"]) == (family == "sd1")
        # (a) delivers the step window's checkpoint, or its final weights when the window chose none.
        assert a["finetune_updates"] == length
        assert s["rangefinder"] == (a["chosen"]["val_loss"] if a.get("chosen") else a["final_val_loss"])
        assert s["updates"]["prodigy"] == s["updates"]["folk"] == length
        # (a)'s probe is arm (b)'s Prodigy run (same length, settings and seed): (a) trained at its final step size
        # times the family's factor for full fine-tuning (config.PRODIGY_STEP_FACTOR: 4 on sdxl).
        if family != "sd1":
            factor = {"sdxl": 4.0, "flux": 1.0}[family]
            assert a["lr_used"] == pytest.approx(factor * case["prodigy"]["lr_effective_final"], rel=1e-6)
        assert all(r["updates"] == length for r in case["random"]["runs"]) and s["random_runs"] == 2
        lo, hi = case["random"]["span"]
        assert all(lo <= r["lr"] <= hi for r in case["random"]["runs"])
    assert case["folk"]["lr"] == 1e-4 and case["prodigy"]["lr"] == 1.0
    # The step size each took: AdamW's own LR; Prodigy's d x lr, its estimate (not the nominal 1.0).
    assert case["folk"]["lr_effective_final"] == pytest.approx(1e-4)
    assert 0 < case["prodigy"]["lr_effective_final"] < 1.0
    # At the halving's pause (update 2 of 4), what a Prodigy probe stopped there would read; d only grows.
    assert 0 < case["prodigy"]["lr_effective_at_pause"] <= case["prodigy"]["lr_effective_final"]
    assert s["grid_best"] > 0 and s["updates"]["grid"] == length and case["grid"]["reused_from"] is None
    # Every verdict is one of the three words, or missing only when an arm has no loss.
    for opp in OPPONENTS:
        assert s[f"vs_{opp}"] in ("win", "tie", "loss", None)
        assert set(saved["aggregate"][f"vs_{opp}"]) == {"n", "win", "tie", "loss"}
    assert set(saved["aggregate"]["goals"]) >= {"beats_random_equal", "beats_random", "grid", "as_good_as_prodigy_best"}
    # Random search read at exactly (a)'s updates: never more than (a) had, never better than every run whole.
    exact = random_at_compute(case["random"]["runs"], a["updates"])
    assert s["random_equal"] == exact["val_loss"] >= s["random_best"] and s["vs_random_equal"] in ("win", "tie", "loss")
    # Counted in whole runs only (what fits whole in (a)'s updates): never better than the exact reading.
    assert s["random_whole_fit"] is None or s["random_whole_fit"] >= s["random_equal"]
    assert s["random_equal_updates"] == exact["updates"] == min(a["updates"], s["updates"]["random"])
    assert "Validation loss of each arm's delivered checkpoint" in printed and "Compute" in printed
    assert f"| {s['case']} " in printed  # the case's row, under its family's name
    # shapes has a prompt score: every arm's delivered weights and the base model were rendered and scored, on
    # prompts no image of the case is captioned with.
    ps = case["prompt_score"]
    assert ps["prompts"] == held_out_prompts("shapes", 0, 10) and ps["seeds"] == [0, 1] and ps["steps"] == 1
    assert set(ps["arms"]) == {"base", *SCORED_ARMS}
    for arm, v in ps["arms"].items():
        assert 0.0 <= v["colour"] <= 1.0 and 0.0 <= v["shape"] <= 1.0, arm
        assert v["images"] == len(ps["prompts"]) * len(ps["seeds"]), arm
        assert s[f"prompt_colour_{arm}"] == v["colour"] and s[f"prompt_shape_{arm}"] == v["shape"]
    assert s["prompt_score"] == "measured" and "Prompt score (colour / shape" in printed
    # bench.unseen: each arm's delivered weights, measured again on the case's validation images, give the loss the
    # arm recorded (they are the delivered ones); on 4 images after the case's 10, other losses, and the standings.
    u = case["unseen"]
    assert (u["images"], u["first"], saved["settings"]["unseen_images"]) == (4, 10, 4)
    for arm in ("rangefinder", "prodigy_best", "prodigy_final", "folk_final", "folk_best", "random_best"):
        v = u["arms"][arm]
        assert v["reproduces"] is True and v["val_loss"] == pytest.approx(s[arm], rel=1e-5), arm
        assert s[f"unseen_{arm}"] == v["unseen_loss"] > 0 and v["unseen_loss"] != v["val_loss"], arm
    assert saved["aggregate_unseen"]["cases"] == 1 and "unseen images: 1 cases" in printed
    assert all(s[f"unseen_vs_{opp}"] in ("win", "tie", "loss") for opp in OPPONENTS)
    if family == "sd1":
        grid_trained_again_is_the_grid(out, case, tmp_path)
        a_cut_run_is_a_shorter_run(case, tmp_path)
        the_exact_pick_is_scored_on_the_unseen_images(case, tmp_path)


def the_exact_pick_is_scored_on_the_unseen_images(case, tmp_path):
    """bench.unseen_equal on this smoke case, its budget cut inside random search's runs so that the exact reading
    picks another checkpoint than the whole runs do: the run trained again gives the pick's validation loss (so the
    checkpoint scored on the unseen images is the pick), and the standings read it."""
    import copy

    from bench.unseen_equal import changed_pick, probe_case, standings

    first = case["random"]["runs"][0]["updates"]
    cut = None
    for budget in (first // 2, first + first // 2):
        c = copy.deepcopy(case)
        c["rangefinder"]["updates"] = budget
        if changed_pick(c) is not None:
            cut = c
            break
    assert cut is not None, "no budget changes the pick on this smoke case"
    row = probe_case(cut, tmp_path / "unseen-equal")
    assert row["reproduces"] is True and row["val_loss"] == pytest.approx(row["random_equal"], rel=1e-5)
    assert row["unseen_random_equal"] > 0 and row["update"] <= cut["rangefinder"]["updates"]
    read = standings({"cases": [cut]}, [row])
    assert (read["cases"], read["changed"], read["read"]) == (1, 1, 1)
    assert read["rows"][0]["unseen_vs_random_equal"] == verdict_of(cut["summary"]["unseen_rangefinder"],
                                                                   row["unseen_random_equal"])
    # A probe that did not reproduce the pick is not read.
    assert standings({"cases": [cut]}, [{**row, "reproduces": False}])["read"] == 0
    # (a) as bench.timesteps_probe re-ran it: its unseen loss in (a)'s place; where that run failed, a loss.
    key = {k: cut[k] for k in ("method", "kind", "seed")}
    half = row["unseen_random_equal"] / 2
    better = standings({"cases": [cut]}, [row], [{**key, "status": "ok", "unseen_loss": half}])
    assert better["rows"][0]["unseen_vs_random_equal"] == "win"
    failed = standings({"cases": [cut]}, [row], [{**key, "status": "failed", "unseen_loss": None}])
    assert failed["rows"][0]["unseen_vs_random_equal"] == failed["rows"][0]["unseen_vs_random_best"] == "loss"
    assert standings({"cases": [cut]}, [row], [])["cases"] == 0  # a case the probe did not run is not read


def a_cut_run_is_a_shorter_run(case, tmp_path):
    """The premise of reading random search at exactly (a)'s compute off the saved curves: a constant-LR run is the
    first part of a longer one at the same LR, checkpoint for checkpoint, so a run cut where (a)'s updates run out
    is read from its curve without training it again. (Here the saved run is the shorter: the smoke's 2 epochs are
    the fewest the step window takes.)"""
    from bench.discovery_quality import train_fixed_lr

    run = case["random"]["runs"][0]
    _, cfg, split_dir = rebuild_case(case, tmp_path / "cut")
    cfg = plain_finetune(cfg)
    twice = cfg.model_copy(update={"finetune": cfg.finetune.model_copy(update={"epochs": 2 * case["finetune_epochs"]})})
    longer = train_fixed_lr(twice, split_dir, run["lr"], tmp_path / "cut" / "longer")
    # The rebuilt case reproduces the saved one as bench.ceiling requires (the base model's loss to 1e-6).
    assert longer["updates"] == 2 * run["updates"]
    assert longer["baseline_val_loss"] == pytest.approx(run["baseline_val_loss"], rel=1e-6)
    first = [p for p in longer["curve"] if p[0] <= run["updates"]]
    assert [u for u, _ in first] == [u for u, _ in run["curve"]]
    assert [y for _, y in first] == pytest.approx([y for _, y in run["curve"]], rel=1e-6)
    assert random_at_compute([longer], run["updates"])["val_loss"] == pytest.approx(run["best_val_loss"], rel=1e-6)


def grid_trained_again_is_the_grid(out, case, tmp_path):
    """bench.ceiling on this smoke case (here, to spare the suite a second smoke): the grid it trains on the rebuilt
    case is the one bench.versus trained beside its arms: the same base-model loss and, training being deterministic
    on CPU, the same loss at the same LR. A grid that does not reproduce its case is not read."""
    from bench.ceiling import main as ceiling
    from bench.ceiling import with_grids

    (point,) = case["grid"]["arms"]
    result = json.loads(out.read_text())
    stripped = tmp_path / "no-grid.json"
    stripped.write_text(json.dumps({**result, "cases": [{**case, "grid": None}]}))
    grids = ceiling(["--from", str(stripped), "--out", str(tmp_path / "grids.json"), "--seeds", str(case["seed"]),
                     "--methods", "full", "--grid-points", "1"])
    (row,) = grids["cases"]
    (mine,) = row["grid"]["arms"]
    assert row["base_reproduces"] is True and row["folk_reproduces"] is None  # no grid point at the folk default's LR
    assert mine["lr"] == point["lr"] and mine["best_val_loss"] == point["best_val_loss"]
    read = ceiling(["--report", str(stripped), "--grids", str(tmp_path / "grids.json")])
    assert read["cases"] == 1 and read["rows"][0]["grid_best"] == point["best_val_loss"]
    row["base_reproduces"] = False
    assert not any(c.get("grid") for c in with_grids({"cases": [{**case, "grid": None}]}, [row]))


def test_the_step_sizes_recorded_are_prodigy_s_estimate_after_each_update_and_adamw_s_lr(tmp_path):
    """effective_lrs records what the prodigy_step finder reads, Prodigy's d x lr after each update (prodigy_d_lr),
    not the step each update took (lr_effective, the d from before it times the bias correction); AdamW's LR; and
    from an updates.csv written before prodigy_d_lr existed, lr_effective, which was that number then."""
    head = "update,epoch,lr,train_loss,grad_norm,lr_effective"
    files = {"prodigy": (f"{head},prodigy_d_lr\n1,0.5,1.0,0.5,1.0,1e-06,1e-06\n2,1.0,1.0,0.5,1.0,7.4e-07,3e-05\n"
                         "3,1.5,1.0,0.5,1.0,2.2e-05,4e-05\n"),
             "older": f"{head}\n1,0.5,1.0,0.5,1.0,1e-06\n2,1.0,1.0,0.5,1.0,3e-05\n3,1.5,1.0,0.5,1.0,4e-05\n",
             "adamw": f"{head},prodigy_d_lr\n1,0.5,1e-4,0.5,1.0,1e-4,\n2,1.0,1e-4,0.5,1.0,1e-4,\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.csv").write_text(text)
    want = {"lr_effective_at_best": 3e-05, "lr_effective_at_pause": 1e-06, "lr_effective_final": 4e-05}
    assert effective_lrs(tmp_path / "prodigy.csv", 2, 1) == effective_lrs(tmp_path / "older.csv", 2, 1) == want
    assert effective_lrs(tmp_path / "adamw.csv", 2, 1) == {"lr_effective_at_best": 1e-4, "lr_effective_at_pause": 1e-4,
                                                           "lr_effective_final": 1e-4}
    assert set(effective_lrs(tmp_path / "none.csv", 2, 1).values()) == {None}


def test_held_out_prompts_are_shapes_prompts_the_case_s_images_do_not_show():
    from rangefinder.data.prompt_score import parse_prompt
    from rangefinder.data.synthetic import render_item

    prompts = held_out_prompts("shapes", 3, 20)
    captions = {render_item("shapes", 3, i)[1] for i in range(20)}
    assert len(prompts) == 8 and len(set(prompts)) == 8 and not set(prompts) & captions
    assert all(parse_prompt(p) is not None for p in prompts)
    assert prompts == held_out_prompts("shapes", 3, 20)  # fixed: every arm and every re-run asks the same
    # Kinds whose captions name no colour and shape have no prompt score; shapes-on-white at 20 images shows every
    # pairing of its colours and shapes, so nothing unseen is left to ask for.
    for kind in ("stripes", "textures", "subject", "glyphs", "shapes-on-white"):
        assert held_out_prompts(kind, 3, 20) == [], kind


def test_a_kind_without_a_prompt_score_records_none_and_old_results_still_report(tmp_path):
    stripes = {**_case([[4, 0.1], [8, 0.09]], None), "kind": "stripes"}
    # Returns before it loads or renders anything: no config is needed.
    assert score_prompts(None, stripes, tmp_path) is None
    stripes["prompt_score"] = None
    assert summarize(stripes)["prompt_score"] == "none for this kind"
    # A case of a JSON written before the prompt score was measured, and one whose arms (b)-(d) were reused: their
    # weights are gone, so their scores are absent and the table says so.
    old = _case([[4, 0.1], [8, 0.09]], None)
    reused = {**_case([[4, 0.1], [8, 0.09]], None), "seed": 1, "reused_arms_from": "versus_old.json"}
    weights = delivered_weights(reused, tmp_path)
    assert all("reused from versus_old.json" in weights[arm] for arm in SCORED_ARMS[1:])
    reused["prompt_score"] = {"prompts": ["a red circle on a blue background"], "seeds": [0], "arms": {
        "base": {"colour": 0.3, "shape": 0.2, "images": 1}, "rangefinder": {"colour": 0.6, "shape": 0.5, "images": 1},
        **{arm: {"absent": weights[arm]} for arm in SCORED_ARMS[1:]}}}
    merged = {"cases": [{**c, "summary": summarize(c)} for c in (old, stripes, reused)]}
    finish(merged, partial=False)
    text = report(merged)
    scores = text.split("Prompt score (colour / shape")[1]
    row = next(line for line in scores.splitlines() if line.startswith("| lora shapes 1 "))
    assert "0.600 / 0.500" in row and row.count("absent (weights gone: reused arm)") == 4
    assert "prompt score not measured: 1 cases (lora shapes 0)" in text
    assert "prompt score none for this kind: 1 cases (lora stripes 0)" in text


def test_a_delivered_window_average_is_scored_as_its_chosen_model(tmp_path):
    """(a)'s window average (or cooldown) is no checkpoint: the prompt score renders the chosen/ model (a) delivers,
    not a checkpoint at its update (which the step removed); with the arms reused, a missing (a) is said, not None."""
    chosen = {"update": 16, "val_loss": 0.08, "rule": "window_average"}
    case = {**_case([[4, 0.1], [8, 0.09]], chosen), "seed": 1, "reused_arms_from": "versus_old.json"}
    assert delivered_weights(case, tmp_path)["rangefinder"] == "(a)'s chosen/ is gone"
    (tmp_path / "rangefinder" / "finetune" / "chosen").mkdir(parents=True)
    weights = delivered_weights(case, tmp_path)
    assert weights["rangefinder"] == tmp_path / "rangefinder" / "finetune" / "chosen"
    plain = {**case, "rangefinder": {**case["rangefinder"], "chosen": {**chosen, "rule": "window_lowest"}}}
    assert delivered_weights(plain, tmp_path)["rangefinder"] == "no checkpoint at its update"


def _case(curve, chosen):
    a = {"status": "ok", "updates": 24, "seconds": 1.0, "finetune_updates": 16, "baseline_val_loss": 0.2,
         "lr_used": 1e-3, "curve": curve, "chosen": chosen, "final_val_loss": curve[-1][1],
         "best_val_loss": min(y for _, y in curve)}
    arm = {"updates": 16, "seconds": 1.0, "best_val_loss": 0.1, "final_val_loss": 0.1, "lr": 1.0}
    return {"method": "lora", "kind": "shapes", "seed": 0, "held_out": False, "images": 20, "rangefinder": a,
            "prodigy": arm, "folk": arm, "random": {"span": [1e-6, 1.0], "runs": [arm], "updates": 16, "seconds": 1},
            "grid": None}


def test_rechoose_delivers_the_lowest_loss_inside_the_saved_window():
    curve = [[4, 0.05], [8, 0.09], [12, 0.11], [16, 0.095]]
    was = {"update": 12, "val_loss": 0.11, "window_start_update": 6.0, "window_end_update": 16.0,
           "recommended_updates": 11}
    c = rechoose(_case(curve, was))
    assert (c["rangefinder"]["chosen"]["update"], c["rangefinder"]["chosen"]["val_loss"]) == (8, 0.09)
    assert c["summary"]["rangefinder"] == 0.09 and c["summary"]["vs_prodigy_best"] == "win"  # was a loss at 0.11
    assert c["rangefinder"]["chosen"]["was"] == {"update": 12, "val_loss": 0.11}
    assert c["rangefinder"]["chosen"]["rule"] == "window_lowest"


def test_rechoose_without_a_window_delivers_the_run_s_lowest_loss_and_compares_it_with_the_base():
    """The saved case had no window and delivered its final weights (0.095); the rule now delivers update 4 (0.05),
    below the base model's 0.2 (baseline_val_loss, the curve's update 0)."""
    curve = [[4, 0.05], [8, 0.09], [12, 0.11], [16, 0.095]]
    c = rechoose(_case(curve, None))
    chosen = c["rangefinder"]["chosen"]
    assert (chosen["update"], chosen["val_loss"], chosen["rule"], chosen["improved_on_base"]) == (
        4, 0.05, "run_lowest", True)
    assert chosen["was"] == {"update": 16, "val_loss": 0.095} and c["summary"]["rangefinder"] == 0.05
    assert c["summary"]["rangefinder_chosen_rule"] == "run_lowest"
    failed = {**_case(curve, None), "rangefinder": {"status": "failed", "updates": 0, "seconds": 1.0}}
    assert rechoose(failed) is failed  # nothing to re-read


def test_saved_arms_are_reused_only_for_the_same_data_length_span_and_seed():
    old = _case([[4, 0.1], [8, 0.09]], None)
    a = dict(old["rangefinder"])
    own = old["seed"]  # a case saved before the training seed was recorded trained with its data seed
    assert reusable_arms(old, a, (1e-6, 1.0), 20, own)
    assert not reusable_arms(None, a, (1e-6, 1.0), 20, own)
    assert not reusable_arms(old, a, (1e-5, 1.0), 20, own)  # another span: (d) draws other LRs
    assert not reusable_arms(old, {**a, "finetune_updates": 20}, (1e-6, 1.0), 20, own)  # another length
    assert not reusable_arms(old, {**a, "baseline_val_loss": 0.21}, (1e-6, 1.0), 20, own)  # other data or split
    assert not reusable_arms(old, a, (1e-6, 1.0), 10, own)
    # A replicate with another training seed trains every arm afresh. TrainingConfig's default seed is not what an
    # unrecorded case ran with: bench.discovery_quality.set_up_case sets the data seed as the training seed.
    from rangefinder.config import TrainingConfig

    assert TrainingConfig().seed != own and case_training_seed(old) == own
    assert not reusable_arms(old, a, (1e-6, 1.0), 20, TrainingConfig().seed)
    assert not reusable_arms(old, a, (1e-6, 1.0), 20, 1235)
    assert reusable_arms({**old, "training_seed": 1235}, a, (1e-6, 1.0), 20, 1235)
    # An (a) that trained more (a rule that races a third candidate) keeps the arms: random search is topped up.
    assert reusable_arms(old, {**a, "updates": a["updates"] + 80}, (1e-6, 1.0), 20, own)
    assert not reusable_arms(old, {**a, "updates": a["updates"] - 1}, (1e-6, 1.0), 20, own)


def test_random_search_at_exactly_a_s_compute_cuts_the_run_under_way_where_a_s_updates_run_out():
    def run(lr, curve, updates=None):
        best = min((y, u) for u, y in curve)
        return {"lr": lr, "updates": updates or curve[-1][0], "curve": curve, "best_val_loss": best[0],
                "best_update": best[1]}

    first = run(1e-4, [[40, 0.30], [80, 0.25], [120, 0.24], [160, 0.26]])
    second = run(1e-3, [[40, 0.28], [80, 0.22], [120, 0.20], [160, 0.19]])
    # 264 updates: the first run whole, the second cut at 104 (its checkpoints at 40 and 80 count, not 120).
    got = random_at_compute([first, second], 264)
    assert (got["val_loss"], got["lr"], got["run"], got["update"]) == (0.22, 1e-3, 1, 80)
    assert (got["updates"], got["runs_counted"]) == (264, 2)
    # 320 updates: both whole, as the bench's ceil reading has it; 160: the second is not reached at all.
    assert random_at_compute([first, second], 320)["val_loss"] == 0.19 == second["best_val_loss"]
    assert random_at_compute([first, second], 160) == {"val_loss": 0.24, "lr": 1e-4, "run": 0, "update": 120,
                                                      "updates": 160, "runs_counted": 1}
    # A run that diverged spent only what it trained: the next one starts after its 71 updates and runs whole.
    diverged = run(1e-1, [[40, 0.5]], updates=71)
    assert random_at_compute([diverged, second], 264)["updates"] == 231
    # A cut before a run's first checkpoint leaves it nothing; budget under any checkpoint: nothing to deliver.
    assert random_at_compute([first, second], 190)["run"] == 0
    assert random_at_compute([first], 30) is None


def test_random_search_topped_up_keeps_its_draws_and_adds_the_next_of_the_same_sequence(tmp_path):
    from types import SimpleNamespace

    span = (1e-6, 1.0)
    two, three = random_lrs("lora", "shapes", 3, None, span, 2), random_lrs("lora", "shapes", 3, None, span, 3)
    assert three[:2] == two and len(set(three)) == 3
    assert random_lrs("lora", "shapes", 3, 1235, span, 2) != two  # a replicate draws afresh
    assert (random_draws(264, 160), random_draws(344, 160), random_draws(344, 160, smoke=True)) == (2, 3, 2)
    args = SimpleNamespace(smoke=False, training_seed=None)
    out = {"method": "lora", "kind": "shapes", "seed": 3, "folk": {"updates": 160},
           "random": {"span": list(span), "runs": [{"lr": lr, "updates": 160} for lr in two]}}
    a = {"updates": 264, "finetune_updates": 160}
    top_up_random(out, a, None, tmp_path, tmp_path, args, print, "[case]")  # (a) as saved: nothing to add
    assert len(out["random"]["runs"]) == 2 and "topped_up" not in out["random"]
    # Draws that are not this case's sequence (another case's file) are refused before anything trains.
    out["random"]["runs"][1]["lr"] = 0.5
    with pytest.raises(SystemExit, match="not this case's sequence"):
        top_up_random(out, {**a, "updates": 344}, None, tmp_path, tmp_path, args, print, "[case]")


def test_report_reads_results_from_before_family_as_sd1_and_keeps_each_family_s_case(tmp_path, capsys):
    """--report and --rechoose on a JSON written before --family (no "family": the SD 1.x model) beside a flux one:
    the same method, kind and seed on two families are two cases, not a re-run replacing the other."""
    from bench.versus import main

    curve = [[4, 0.05], [8, 0.09], [12, 0.11], [16, 0.095]]
    old, flow = tmp_path / "old.json", tmp_path / "flow.json"
    old.write_text(json.dumps({"cases": [_case(curve, None)]}))
    flow.write_text(json.dumps({"cases": [{**_case(curve, None), "family": "flux"}]}))
    merged = main(["--report", str(old), str(flow), "--rechoose"])
    assert [c["summary"]["case"] for c in merged["cases"]] == ["lora shapes 0", "flux lora shapes 0"]
    assert [c["summary"]["family"] for c in merged["cases"]] == ["sd1", "flux"]
    assert merged["aggregate"]["cases"] == 2 and "replaces" not in capsys.readouterr().out


def test_textual_inversion_on_a_flow_family_is_one_clear_error(capsys):
    from bench.versus import main

    with pytest.raises(SystemExit):
        main(["--family", "flux", "--methods", "textual_inversion", "--out", "/nonexistent/never-written.json"])
    err = capsys.readouterr().err
    assert "no textual inversion on flux" in err and "--methods full,lora" in err and "Traceback" not in err


def test_a_replicate_sets_the_training_seed_of_every_arm():
    """--training-seed goes into the case's config, which every arm's run starts from (and the case records it);
    without it the config's default stands, so the saved cases rebuild."""
    from types import SimpleNamespace

    args = SimpleNamespace(finetune_epochs=40, smoke=False, soup_tries=0, training_seed=None)
    assert "seed" not in case_overrides("lora", args)["training"]
    assert case_overrides("lora", SimpleNamespace(**{**vars(args), "training_seed": 1235}))["training"]["seed"] == 1235


def test_each_family_runs_on_its_tiny_model_and_only_a_flow_model_gets_its_own_sampler(tiny_sdxl_dir, tiny_flux_dir):
    """--family: the case's base model is the family's tiny model; SDXL samples with the demo's DDIM as SD 1.x does,
    a flow model with its own scheduler (and Flux at its distilled guidance)."""
    from types import SimpleNamespace

    from rangefinder.training.family_detection import detect_family

    args = SimpleNamespace(finetune_epochs=40, smoke=False, soup_tries=0, training_seed=None)
    assert "model" not in case_overrides("lora", args) and "sampling" not in case_overrides("lora", args)
    sdxl = case_overrides("lora", args, "sdxl")
    assert detect_family(Path(sdxl["model"]["base_model"])) == "sdxl" and "sampling" not in sdxl
    assert Path(sdxl["model"]["base_model"]).resolve() == tiny_sdxl_dir.resolve()
    flux = case_overrides("lora", args, "flux")
    assert detect_family(Path(flux["model"]["base_model"])) == "flux"
    assert flux["sampling"]["scheduler"] is None and flux["sampling"]["guidance_scale"] == 3.5


def test_the_rules_under_test_reach_a_s_config_only_when_asked():
    """--halving-below-margin and --range-test-epochs set (a)'s finetune.halving_below_margin and
    lr_range_test.epochs on top of the method's own sweep; left out, the case is as shipped."""
    from types import SimpleNamespace

    args = SimpleNamespace(finetune_epochs=40, smoke=False, soup_tries=0, training_seed=None)
    plain = case_overrides("lora", args)
    assert "halving_below_margin" not in plain["finetune"] and plain["lr_range_test"] == {"lr_min": None,
                                                                                           "lr_max": None}
    asked = case_overrides("lora", SimpleNamespace(**vars(args), halving_below_margin=0.1, range_test_epochs=12))
    assert asked["finetune"]["halving_below_margin"] == 0.1
    assert asked["lr_range_test"] == {"lr_min": None, "lr_max": None, "epochs": 12}
    full = case_overrides("full", SimpleNamespace(**vars(args), range_test_epochs=12))
    assert full["lr_range_test"] == {"epochs": 12}


def test_a_s_optimizer_reaches_a_alone_and_every_other_arm_trains_adamw():
    """--a-optimizer sets training.optimizer in the case's config, which (a) trains; plain_finetune, which every
    other arm starts from, gives them AdamW back (Prodigy's arm sets its own)."""
    from types import SimpleNamespace

    from rangefinder.config import demo_config

    args = SimpleNamespace(finetune_epochs=40, smoke=False, soup_tries=0, training_seed=None)
    assert "optimizer" not in case_overrides("lora", args)["training"]
    over = case_overrides("lora", SimpleNamespace(**vars(args), a_optimizer="adamw_schedule_free"))
    cfg = demo_config(**over)
    assert cfg.training.optimizer == "adamw_schedule_free"
    plain = plain_finetune(cfg)
    assert plain.training.optimizer == "adamw" and plain.training.method == "lora"
    assert (plain.finetune.average, plain.finetune.cooldown) == ("off", "off")
    # (a) keeps LoRA's default EMA (training.use_ema auto); every other arm is a plain run without one, as measured.
    assert demo_config(**case_overrides("lora", args)).training.keeps_ema("sd1") and not plain.training.keeps_ema("sd1")


def test_a_re_run_of_a_replaces_its_case_s_a_and_every_case_of_the_method_needs_one(tmp_path):
    """bench.versus.with_a_rerun (A_AS_SHIPPED): a probe's row becomes its case's (a) (loss, rule, LR, status, the
    unseen loss), the verdicts are recomputed against the saved arms, a stale prompt score is marked absent, other
    methods are left alone, and a case of the method with no re-run at the shipped timesteps is refused."""
    import copy

    from bench.common import case_key
    from bench.versus import RESULTS_DIR, with_a_rerun

    saved = json.loads((RESULTS_DIR / "versus_unseen_seed38.json").read_text())["cases"]
    lora = [c for c in saved if c["method"] == "lora" and c.get("prompt_score")][0]
    full = [c for c in saved if c["method"] == "full"][0]
    result = {"cases": [copy.deepcopy(lora), copy.deepcopy(full)]}
    b = summarize(lora)["prodigy_best"]
    row = {"method": "lora", "kind": lora["kind"], "seed": lora["seed"], "family": "sd1", "timesteps": 4,
           "status": "ok", "lr_used": 1e-3, "rule": "window_lowest", "val_loss": 0.9 * b, "unseen_loss": 0.5}
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"cases": [row]}))
    with_a_rerun(result, "lora", [probe])
    s = result["cases"][0]["summary"]
    assert (s["rangefinder"], s["rangefinder_lr"], s["rangefinder_chosen_rule"]) == (0.9 * b, 1e-3, "window_lowest")
    assert s["vs_prodigy_best"] == "win" and s["prodigy_best"] == b  # the arm as saved
    assert result["cases"][0]["unseen"]["arms"]["rangefinder"]["unseen_loss"] == 0.5
    assert "absent" in result["cases"][0]["prompt_score"]["arms"]["rangefinder"]
    assert result["cases"][1] == full  # another method: untouched
    # A failed re-run is a failed (a): a loss against every arm that delivered.
    probe.write_text(json.dumps({"cases": [{**row, "status": "failed", "val_loss": None}]}))
    with_a_rerun(result, "lora", [probe])
    s = result["cases"][0]["summary"]
    assert s["rangefinder"] is None and s["vs_prodigy_best"] == s["vs_random_equal"] == "loss"
    for wrong in ({**row, "timesteps": 16}, {**row, "seed": lora["seed"] + 1}):
        probe.write_text(json.dumps({"cases": [wrong]}))
        with pytest.raises(SystemExit, match=f"lora {lora['kind']} {lora['seed']}: no re-run of .a. at the shipped"):
            with_a_rerun({"cases": [copy.deepcopy(lora)]}, "lora", [probe])
    assert case_key(row) == case_key(lora)


def test_a_lora_setting_reaches_every_arm_and_is_a_case_of_its_own(tmp_path, capsys):
    """--lora-rank and --lora-alpha set the adapter of the case's config, which (a) trains and every other arm starts
    from (plain_finetune keeps it); a case records what the config built, its name says it, and a result holding it
    is resumed (nothing re-runs) while the same method, kind and seed at the shipped setting stay another case."""
    from types import SimpleNamespace

    from bench.versus import main
    from rangefinder.config import demo_config

    args = SimpleNamespace(finetune_epochs=40, smoke=False, soup_tries=0, training_seed=None)
    assert "lora" not in case_overrides("lora", args)["training"]
    kohya = SimpleNamespace(**vars(args), lora_rank=16, lora_alpha=1.0)
    assert "lora" not in case_overrides("full", kohya)["training"]
    cfg = plain_finetune(demo_config(**case_overrides("lora", kohya)))
    assert (cfg.training.lora.rank, cfg.training.lora.alpha, cfg.training.method) == (16, 1.0, "lora")
    assert case_adapter(kohya) == {"rank": 16, "alpha": 1.0}
    assert case_adapter(args) == {} == case_adapter(SimpleNamespace(**vars(args), lora_rank=4, lora_alpha=4.0))

    curve = [[4, 0.05], [8, 0.09]]
    shipped, set_ = _case(curve, None), {**_case(curve, None), "lora": {"rank": 16, "alpha": 1.0}}
    assert summarize(set_)["case"] == "lora shapes 0 (r16 a1)" and summarize(shipped)["case"] == "lora shapes 0"
    old, new = tmp_path / "shipped.json", tmp_path / "kohya.json"
    old.write_text(json.dumps({"cases": [shipped]}))
    new.write_text(json.dumps({"cases": [{**set_, "summary": summarize(set_)}]}))  # as bench.versus writes it
    merged = main(["--report", str(old), str(new)])
    assert [c["summary"]["lora"] for c in merged["cases"]] == [None, "r16 a1"]
    assert "replaces" not in capsys.readouterr().out

    resumed = main(["--methods", "lora", "--kinds", "shapes", "--seeds", "0", "--lora-rank", "16", "--lora-alpha",
                    "1", "--no-grid", "--out", str(new), "--work-dir", str(tmp_path / "work")])
    assert [c["summary"]["case"] for c in resumed["cases"]] == ["lora shapes 0 (r16 a1)"]
    assert resumed["runs"][-1]["cases"] == 0  # found done: nothing trained

    with pytest.raises(SystemExit):
        main(["--methods", "full,lora", "--lora-rank", "16", "--out", str(tmp_path / "never.json")])
    err = capsys.readouterr().err
    assert "give --methods lora" in err and "Traceback" not in err and not (tmp_path / "never.json").exists()
