"""bench.bounds_probe's rule: which cases it applies to and the bounds it gives them (no training here)."""

import math

import pytest


def _case(first: dict, zoom: dict) -> dict:
    return {"rangefinder": {"range_tests": [first, zoom]}}


def test_a_censored_zoom_is_capped_at_the_first_test_s_upper_bound_and_the_midpoint_follows():
    from bench.bounds_probe import capped_bounds, censored_zoom
    from rangefinder.defaults import MID_POSITION

    # LoRA `subject` 4 as saved: the first test saw the rise, the zoom (flagged censored) moved lr_high up 1.4x.
    c = _case({"flags": ["rose_after_min", "diverged"], "lr_low": 0.00128, "lr_mid": 0.0117, "lr_high": 0.0243},
              {"flags": ["upper_censored"], "lr_low": 0.00351, "lr_mid": 0.0189, "lr_high": 0.0332})
    assert censored_zoom(c)
    low, mid, high = capped_bounds(c)
    assert (low, high) == (0.00351, 0.0243)
    assert mid == pytest.approx(math.exp((1 - MID_POSITION) * math.log(low) + MID_POSITION * math.log(high)))
    assert 0.0149 < mid < 0.0151  # was 0.0189


@pytest.mark.parametrize(("first_flags", "zoom_flags", "applies"), [
    (["rose_after_min"], ["upper_censored"], True),
    (["upper_censored"], ["upper_censored"], False),  # neither test saw the rise: nothing to cap with
    (["rose_after_min"], [], False),  # the zoom read its own upper bound
])
def test_it_applies_only_where_the_first_test_saw_what_the_zoom_could_not(first_flags, zoom_flags, applies):
    from bench.bounds_probe import censored_zoom

    c = _case({"flags": first_flags, "lr_high": 1e-2}, {"flags": zoom_flags, "lr_high": 2e-2})
    assert censored_zoom(c) is applies
    assert censored_zoom({"rangefinder": {"range_tests": [{"flags": first_flags}]}}) is False  # no zoom


def test_the_report_can_score_a_as_the_probe_delivered_it_in_the_cases_it_ran():
    """bench.versus --report --capped-bounds: LoRA `subject` 4 as saved lost to Prodigy's best; with the probe's run
    of the capped bounds in its place it ties, and every other case is left as it was."""
    import json
    from pathlib import Path

    from bench.versus import with_capped_bounds

    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    cases = {(c["method"], c["kind"], c["seed"]): c
             for c in json.loads((results / "versus_all_55.json").read_text())["cases"]}
    probed = {(r["method"], r["kind"], r["seed"]): r
              for r in json.loads((results / "bounds_probe.json").read_text())["cases"]}
    key = ("lora", "subject", 4)
    before, after = cases[key], with_capped_bounds(cases[key], probed[key])
    assert before["summary"]["vs_prodigy_best"] == "loss" and after["summary"]["vs_prodigy_best"] == "tie"
    assert after["summary"]["rangefinder"] == probed[key]["delivered"]
    assert after["rangefinder"]["lr_used"] == probed[key]["lr_used"] and after["rangefinder"]["chosen"]["capped_bounds"]
    other = ("full", "stripes", 3)
    assert other not in probed and with_capped_bounds(cases[other], None) is cases[other]
