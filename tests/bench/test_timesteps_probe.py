"""bench.timesteps_probe: (a) re-run with another validation.timesteps, scored as the saved arms were."""

from __future__ import annotations

import json

import pytest

from bench.timesteps_probe import tally


def without_unseen_images(saved, out):
    """The saved smoke case as if it had been scored on no unseen images, written to `out`."""
    plain = json.loads(saved.read_text())
    del plain["cases"][0]["unseen"]
    plain["cases"][0]["summary"] = {k: v for k, v in plain["cases"][0]["summary"].items() if not k.startswith("unseen")}
    out.write_text(json.dumps(plain))
    return out


@pytest.mark.slow
@pytest.mark.probe
def test_the_probe_at_the_shipped_timesteps_rebuilds_the_saved_case(tmp_path, sd1_versus_smoke):
    """At validation.timesteps 4 (as shipped) the probe's (a) is the saved (a): the same weights, so the same loss on
    the case's validation images and on the unseen ones, the same prompt score and the same verdicts. It re-runs (a)
    (37 s of the 2-worker suite), so `make bench-test` runs it, not `make test`, as the probe's other options' test."""
    from bench.timesteps_probe import main as probe

    saved = sd1_versus_smoke.out  # the session's smoke case (tests/bench/conftest.py)
    case = json.loads(saved.read_text())["cases"][0]
    s = case["summary"]
    # --methods and --seeds keep the cases they name (here the one case), and leave out the rest.
    same = probe(["--from", str(saved), "--out", str(tmp_path / "p4.json"), "--timesteps", "4",
                  "--methods", f"textual_inversion,{case['method']}", "--seeds", f"{case['seed']},{case['seed'] + 1}"])
    (row,) = same["cases"]
    assert row["unseen_loss"] == s["unseen_rangefinder"] and row["val_loss"] == row["val_loss_k"] == s["rangefinder"]
    assert all(row[f"unseen_vs_{o}"] == row[f"saved_unseen_vs_{o}"] for o in ("prodigy_best", "random_best"))
    assert (row["self_vs_base"], row["self_change_pct"], row["unseen_self_change_pct"]) == ("tie", 0.0, 0.0)
    assert same["tally"]["verdicts_changed_vs_prodigy_best"]["changed"] == 0
    # The prompt score of the re-run (a), on the case's prompts and seeds, beside the base model rendered again: the
    # same weights score what the case recorded, and the case with this (a) in it gives every verdict it gave.
    assert s["prompt_score"] == "measured" and row["prompt_reproduces"] is True
    assert row["prompt_shape"] == s["prompt_shape_rangefinder"]
    assert row["prompt_colour"] == s["prompt_colour_rangefinder"]
    assert same["tally"]["prompt_shape_vs_saved_rangefinder"]["same"] == 1 == same["tally"]["prompt_cases"]
    assert {k: v for k, v in row["variant_summary"].items() if k.startswith("vs_")} == \
        {k: v for k, v in s.items() if k.startswith("vs_")}


@pytest.mark.slow
def test_the_probe_leaves_out_the_cases_its_options_do_not_name(tmp_path, sd1_versus_smoke):
    """What the probe would re-run is chosen before it trains anything: none of these calls trains."""
    from bench.timesteps_probe import main as probe

    saved = sd1_versus_smoke.out
    case = json.loads(saved.read_text())["cases"][0]
    # A case scored on no unseen images is not probed without --every-case.
    plain = without_unseen_images(saved, tmp_path / "plain.json")
    assert probe(["--from", str(plain), "--out", str(tmp_path / "none.json")])["cases"] == []
    other = "lora" if case["method"] != "lora" else "full"
    assert probe(["--from", str(saved), "--out", str(tmp_path / "m.json"), "--methods", other])["cases"] == []
    next_seed = str(case["seed"] + 1)
    assert probe(["--from", str(saved), "--out", str(tmp_path / "s.json"), "--seeds", next_seed])["cases"] == []


@pytest.mark.slow
@pytest.mark.probe
def test_each_option_of_the_probe_trains_what_it_names(tmp_path, sd1_versus_smoke):
    """Each of the probe's options re-runs the smoke case's (a) as it says (seven runs of (a), so `make bench-test`
    runs this, not `make test`). At 8 timesteps it is another run: on the smoke case's 2-epoch zoom its validation
    loss never falls by more than its noise, so (a) fails, and a failed (a) counts as a loss against every arm, as in
    bench.versus."""
    from bench.timesteps_probe import main as probe

    saved = sd1_versus_smoke.out
    s = json.loads(saved.read_text())["cases"][0]["summary"]
    # Settings of other sections than `training` (--setting): the fine-tune at the range test's lr_low, one
    # candidate (no halving).
    low = probe(["--from", str(saved), "--out", str(tmp_path / "low.json"), "--timesteps", "4",
                 "--setting", "lr_range_test.mid_position=0", "--setting", "finetune.successive_halving=false"])
    (rl,) = low["cases"]
    saved_a = json.loads(saved.read_text())["cases"][0]["rangefinder"]
    assert rl["settings"] == {"lr_range_test": {"mid_position": 0}, "finetune": {"successive_halving": False}}
    assert rl["lr_used"] == pytest.approx(saved_a["lr_low"], rel=1e-9) and rl["lr_used"] < saved_a["lr_mid"]
    assert rl["variant_summary"]["updates"]["rangefinder"] < s["updates"]["rangefinder"]  # no second candidate
    # A case scored on no unseen images is probed with --every-case: (a) read on its own validation loss.
    plain = without_unseen_images(saved, tmp_path / "plain.json")
    # And here (a) delivers its earliest checkpoint tied with its pick (--deliver earliest_tied, the engine's picker
    # for finetune.deliver, whose band is the Goal's tie): within the 1 % band of the pick, no later than it, and
    # that checkpoint's own loss is what is read and rendered.
    from bench.versus import TIE_PCT
    from rangefinder.analysis.step_window import TIE_BAND

    assert TIE_BAND * 100 == TIE_PCT
    every = probe(["--from", str(plain), "--out", str(tmp_path / "every.json"), "--timesteps", "4",
                   "--every-case", "--deliver", "earliest_tied"])
    (rv,) = every["cases"]
    assert rv["unseen_loss"] is None and rv["unseen_vs_prodigy_best"] is None and rv["rule"] == "earliest_tied"
    v = rv["variant_summary"]
    assert v["rangefinder_chosen_update"] <= s["rangefinder_chosen_update"]
    assert rv["val_loss"] == v["rangefinder"] == dict(map(tuple, saved_a["curve"]))[v["rangefinder_chosen_update"]]
    assert rv["val_loss"] <= s["rangefinder"] * 1.01 and rv["self_vs_base"] in ("tie", "win")
    assert rv["prompt_reproduces"] is True
    # Another training.seed is another run of the same method, weighed against the saved (a) as if it were an arm;
    # and against that run as the baseline (--against), the same run again is itself. The second asks for the seed
    # through --training, which sets any of (a)'s training settings: the same run again shows it reached (a).
    reseeded = probe(["--from", str(saved), "--out", str(tmp_path / "s.json"), "--timesteps", "4",
                      "--training-seed", "1235"])
    (r1,) = reseeded["cases"]
    assert r1["training_seed"] == 1235 and r1["unseen_self_change_pct"] != 0.0 and r1["unseen_loss"] is not None
    again = probe(["--from", str(saved), "--out", str(tmp_path / "s2.json"), "--timesteps", "4",
                   "--training", "seed=1235", "--against", str(tmp_path / "s.json")])
    (r2,) = again["cases"]
    assert r2["training_settings"] == {"seed": 1235} and r2["training_seed"] == 1235
    assert r2["unseen_loss"] == r1["unseen_loss"] and r2["unseen_self_vs_base"] == "tie"
    assert r2["base_unseen_vs_prodigy_best"] == r1["unseen_vs_prodigy_best"]
    # With an EMA average (a) validates and delivers the average, not the checkpoint's own weights: scored as the
    # arms are, the delivered weights give back the loss (a) recorded (scoring the raw weights did not).
    ema = probe(["--from", str(saved), "--out", str(tmp_path / "ema.json"), "--timesteps", "4",
                 "--training", "use_ema=true"])
    (re,) = ema["cases"]
    assert re["status"] == "ok" and re["val_loss"] != s["rangefinder"]
    assert re["val_loss"] == pytest.approx(re["val_loss_k"], rel=1e-5)
    other = probe(["--from", str(saved), "--out", str(tmp_path / "p8.json"), "--timesteps", "8"])
    (row8,) = other["cases"]
    assert (row8["timesteps"], row8["status"], row8["unseen_loss"]) == (8, "failed", None)
    assert "found no usable bounds" in row8["error"]
    assert row8["unseen_vs_prodigy_best"] == row8["unseen_vs_random_best"] == "loss"


def test_the_rule_counts_verdicts_turned_on_unseen_images():
    def row(was_p, now_p, was_r, now_r):
        r = {"seconds": 2.0, "saved_seconds": 1.0, "unseen_loss": 0.99, "saved_unseen_loss": 1.0}
        for o in ("prodigy_final", "folk_final", "folk_best"):
            r.update({f"vs_{o}": "win", f"saved_vs_{o}": "win", f"unseen_vs_{o}": "win", f"saved_unseen_vs_{o}": "win"})
        for o, was, now in (("prodigy_best", was_p, now_p), ("random_best", was_r, now_r)):
            r.update({f"vs_{o}": now, f"saved_vs_{o}": was, f"unseen_vs_{o}": now, f"saved_unseen_vs_{o}": was})
        return r

    rows = [row("tie", "win", "win", "win"), row("win", "win", "tie", "win"), row("loss", "win", "tie", "tie")]
    t = tally(rows)
    assert t["unseen_non_wins_turned_into_wins"] == 3 and t["unseen_wins_turned_into_non_wins"] == 0
    assert t["rule_met"] is True and t["median_seconds_ratio"] == 2.0
    assert t["median_unseen_change_pct"] == pytest.approx(-1.0)
    rows.append(row("win", "tie", "win", "win"))
    rows.append(row("win", "win", "win", "loss"))
    assert tally(rows)["unseen_wins_turned_into_non_wins"] == 2 and tally(rows)["rule_met"] is False
