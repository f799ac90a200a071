"""bench.average_probe's selection and rule, and bench.versus scoring (a) as the probe delivered it (no training)."""

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_only_cases_not_won_against_both_are_probed():
    from bench.average_probe import candidate

    def case(prodigy, random):
        return {"rangefinder": {"status": "ok"}, "summary": {"vs_prodigy_best": prodigy, "vs_random_best": random}}

    assert not candidate(case("win", "win"))  # the average can only lower the loss: nothing to change
    assert candidate(case("win", "tie")) and candidate(case("loss", "win")) and candidate(case("tie", "tie"))
    assert not candidate({"rangefinder": {"status": "failed"}, "summary": {}})


def test_the_rule_counts_deliveries_where_it_applies_and_non_wins_turned_into_wins():
    from bench.average_probe import OPPONENTS, tally

    def row(applies, delivered, was, now, reproduces=True):
        r = {"reproduces": reproduces, "applies": applies, "average_delivered": delivered,
             "gain_pct": -2.0 if delivered else 0.0}
        for o in OPPONENTS:
            r[f"vs_{o}"], r[f"saved_vs_{o}"] = now, was
        return r

    rows = [row(True, True, "tie", "win") for _ in range(5)] + [row(True, False, "tie", "tie") for _ in range(5)]
    t = tally(rows + [row(False, False, "tie", "tie"), row(True, True, "tie", "win", reproduces=False)])
    assert (t["reproduced"], t["applies"], t["delivered"], t["non_wins_turned_into_wins"]) == (11, 10, 5, 5)
    assert t["rule_met"] and t["worse_than_saved"] == 0  # half delivered, 5 turned: met
    assert not tally(rows[1:])["rule_met"]  # 4 turned


def test_the_report_can_score_a_as_the_probe_delivered_it():
    """bench.versus --report --averaged: LoRA `subject` 4 lost to Prodigy's best with the window's pick; the probe's
    average (7.4 % lower) wins; a case the probe did not run is left as it was."""
    from bench.versus import with_window_average

    cases = {(c["method"], c["kind"], c["seed"]): c
             for c in json.loads((RESULTS / "versus_all_70.json").read_text())["cases"]}
    probed = {(r["method"], r["kind"], r["seed"]): r
              for r in json.loads((RESULTS / "average_probe.json").read_text())["cases"]}
    key = ("lora", "subject", 4)
    before, after = cases[key], with_window_average(cases[key], probed[key])
    assert before["summary"]["vs_prodigy_best"] == "loss" and after["summary"]["vs_prodigy_best"] == "win"
    assert after["summary"]["rangefinder"] == probed[key]["delivered"] < before["summary"]["rangefinder"]
    assert after["summary"]["rangefinder_window_pick"] == pytest.approx(before["summary"]["rangefinder"], rel=1e-6)
    assert after["summary"]["rangefinder_average_delivered"] is True
    assert after["rangefinder"]["chosen"]["rule"] == "window_average"
    other = ("full", "shapes", 3)  # won against both: not probed
    assert other not in probed and with_window_average(cases[other], None) is cases[other]
