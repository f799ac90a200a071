"""bench.range_noise runs the pipeline's range tests alone at two training seeds and lengths, and tallies how far
their bounds moved."""

import json
import math
from pathlib import Path

import pytest

from bench.range_noise import OTHER_SEED, move, probe_case, tally

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _run(epochs, seed, mid, high, updates=24, zoomed=True):
    return {"epochs": epochs, "training_seed": seed, "status": "ok", "updates": updates, "zoomed": zoomed,
            "lr_low": mid / 4, "lr_mid": mid, "lr_high": high}


def test_the_tally_reads_each_length_s_moves_in_decades():
    rows = [{"runs": [_run(10, 14, 1e-2, 2e-2), _run(10, OTHER_SEED, 1e-3, 2e-2),
                      _run(40, 14, 1e-2, 2e-2, 96), _run(40, OTHER_SEED, 1.2e-2, 2e-2, 96, zoomed=False)]},
            {"runs": [_run(10, 15, 4e-3, 8e-3), _run(10, OTHER_SEED, 4e-3, 1.6e-2),
                      _run(40, 15, 4e-3, 8e-3, 96), _run(40, OTHER_SEED, 4e-3, 8e-3, 96)]}]
    rows[0]["reproduces"] = True
    t = tally(rows)
    assert t["reproduce_saved"] == 1
    assert t["epochs_10"]["lr_mid_median_move_decades"] == pytest.approx(0.5)  # 1 decade and 0
    assert t["epochs_10"]["lr_mid_moved_over_1_5x"] == 1 and t["epochs_10"]["lr_high_moved_over_1_5x"] == 1
    assert t["epochs_40"]["lr_mid_largest_move_decades"] == pytest.approx(math.log10(1.2))
    assert (t["epochs_40"]["zoomed"], t["epochs_40"]["median_updates"]) == (3, 96)
    assert move(None, 1e-3) is None and move(1e-3, 1e-2) == pytest.approx(1.0)


@pytest.mark.probe
def test_a_saved_case_s_range_tests_run_at_each_seed_and_length(tmp_path):
    """LoRA `shapes` 14 rebuilt from the standings: the range tests alone, at its own seed and the replicate's, at 2
    and 4 epochs (the probe's default is 3 and 12: kept short here). Longer tests train more; each run gives ordered
    bounds."""
    case = next(c for c in json.loads((RESULTS / "versus_all_215.json").read_text())["cases"]
                if (c["method"], c["kind"], c["seed"]) == ("lora", "shapes", 14))
    row = probe_case(case, tmp_path, epochs=(2, 4))
    assert [(r["epochs"], r["training_seed"]) for r in row["runs"]] == [(2, 14), (2, OTHER_SEED), (4, 14),
                                                                        (4, OTHER_SEED)]
    for r in row["runs"]:
        assert r["status"] == "ok" and 0 < r["lr_low"] <= r["lr_mid"] <= r["lr_high"], r
    assert row["runs"][2]["updates"] > row["runs"][0]["updates"]
    assert row["saved_lr_mid"] == case["rangefinder"]["lr_mid"]
    assert row["reproduces"] is None  # neither length is the case's own (3): nothing to compare with
    assert not (tmp_path / "lora-shapes-seed14").exists()  # the case's runs are gone; the encoding cache stays
