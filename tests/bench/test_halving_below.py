"""bench.halving_below pairs (a) re-run under the third halving candidate with (a) as saved, and reads R1 and R2
as bench/RESULTS.md wrote them down before the test cases were read."""

import copy
import json

import pytest

from bench.halving_below import main, readings, turned
from tests.bench.test_versus import _case


def _race(mid, high, below=None, kept="lr_mid"):
    race = {"kept": kept, "pause_update": 8, "lr_mid": {"lr": 1e-3, "best_val_loss": mid},
            "lr_high": {"lr": 2e-3, "best_val_loss": high}}
    if below is not None:
        race["lr_below"] = {"lr": 5e-4, "best_val_loss": below}
    return race


def _pair(delivered_before, delivered_after, *, seed=0, reproduces=True):
    saved = _case([[4, 0.12], [8, 0.11]], {"val_loss": delivered_before})
    saved["seed"] = seed
    saved["rangefinder"]["halving"] = _race(0.10, 0.12)
    rerun = copy.deepcopy(saved)
    rerun["rangefinder"]["chosen"] = {"val_loss": delivered_after}
    rerun["rangefinder"]["halving"] = _race(0.10 if reproduces else 0.101, 0.12, below=0.09, kept="lr_below")
    rerun["rangefinder"].update(updates=32, lr_used=5e-4)
    return saved, rerun


def test_verdicts_turn_better_or_worse_by_rank():
    assert turned("loss", "tie") == turned("tie", "win") == turned("loss", "win") == "better"
    assert turned("win", "tie") == "worse" and turned("tie", "tie") == "same" and turned(None, "win") == "same"


def test_the_readings_pair_each_re_run_with_its_saved_case(tmp_path, capsys):
    # The arms all score 0.1: (a) at 0.105 loses to each; at 0.095 it wins.
    pairs = [_pair(0.105, 0.095, seed=0), _pair(0.0995, 0.0992, seed=1), _pair(0.095, 0.102, seed=2)]
    saved, rerun = tmp_path / "saved.json", tmp_path / "rerun.json"
    saved.write_text(json.dumps({"cases": [p[0] for p in pairs]}))
    rerun.write_text(json.dumps({"cases": [p[1] for p in pairs]}))
    out = main(["--saved", str(saved), "--rerun", str(rerun), "--out", str(tmp_path / "out.json")])
    r = out["readings"]
    assert (r["cases"], r["fired"], r["all_reproduce"]) == (3, 3, True)
    assert (r["r1"]["lower"], r["r1"]["of"], r["r1"]["met"]) == (2, 3, True)
    assert r["r1"]["median_change_pct"] == pytest.approx(100 * (0.0992 / 0.0995 - 1))
    # Against each arm: seed 0 turns a loss into a win, seed 1 stays a tie, seed 2 turns a win into a loss.
    assert r["by_arm"]["prodigy_best"] == {"better": 1, "worse": 1, "same": 1}
    assert (r["r2"]["better"], r["r2"]["worse"], r["r2"]["met"]) == (3, 3, False)
    assert "| lora shapes 0 | lr_below |" in capsys.readouterr().out
    assert json.loads((tmp_path / "out.json").read_text())["readings"] == json.loads(json.dumps(r))


def test_a_re_run_that_raced_differently_is_flagged():
    saved, rerun = _pair(0.1, 0.09, reproduces=False)
    from bench.halving_below import pair

    row = pair(saved, rerun)
    assert row["reproduces"] is False and readings([row])["all_reproduce"] is False


def test_all_cases_reads_every_pair_for_a_change_that_applies_everywhere():
    saved, rerun = _pair(0.105, 0.095)
    rerun["rangefinder"]["halving"] = _race(0.10, 0.12)  # no third candidate: the change was elsewhere
    from bench.halving_below import pair

    row = pair(saved, rerun)
    assert readings([row])["fired"] == 0 and readings([row])["r1"]["of"] == 0
    assert readings([row], all_cases=True)["all_reproduce"] is None  # the change moved the race: nothing to match
    assert readings([row], all_cases=True)["r1"] == {"lower": 1, "of": 1, "median_change_pct": row["change_pct"],
                                                     "met": True}
