"""bench.seed_soup_probe: two runs of (a) averaged, weighed against the arms (random search at two runs' budget)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.seed_soup_probe import random_at_equal_compute, soup_of, tally


def test_a_lora_soup_adds_half_of_each_runs_update_at_twice_the_rank():
    """Two seeds start from different A matrices, so averaging the factors would not average the updates; the soup's
    rank-2r adapter at the same alpha (scale alpha / 2r) adds exactly half of each run's scaled B A."""
    g = torch.Generator().manual_seed(0)
    r, alpha = 4, 4.0
    runs = [{"m.lora_A.weight": torch.randn(r, 6, generator=g), "m.lora_B.weight": torch.randn(5, r, generator=g),
             "m.bias": torch.randn(5, generator=g), "updates": torch.tensor(7 + i)} for i in range(2)]
    soup = soup_of(*runs)
    assert soup["m.lora_A.weight"].shape == (2 * r, 6) and soup["m.lora_B.weight"].shape == (5, 2 * r)
    delta = (alpha / (2 * r)) * soup["m.lora_B.weight"] @ soup["m.lora_A.weight"]
    half_each = sum((alpha / r) * x["m.lora_B.weight"] @ x["m.lora_A.weight"] for x in runs) / 2
    torch.testing.assert_close(delta, half_each)
    torch.testing.assert_close(soup["m.bias"], (runs[0]["m.bias"] + runs[1]["m.bias"]) / 2)
    assert soup["updates"].item() == 7  # a count is the first run's, not averaged
    with pytest.raises(ValueError, match="other tensors"):
        soup_of(runs[0], {"x": torch.zeros(1)})


def test_random_search_at_equal_compute_is_the_better_of_its_two_runs():
    first = {"random_best": 0.5, "unseen_random_best": 0.7}
    second = {"random_best": 0.4, "unseen_random_best": 0.9}
    assert random_at_equal_compute(first, second) == (0.4, 0.9, "second")
    assert random_at_equal_compute(first, {}) == (0.5, 0.7, "first")


def test_the_reading_needs_a_majority_against_prodigy_and_70_percent_against_random_on_both_image_sets():
    def row(pb, rnd, reproduces=True):
        r = {"family": "sd1", "method": "full", "kind": "shapes", "seed": 0, "reproduces": reproduces,
             "replicate_reproduces": True}
        for w in ("", "unseen_"):
            r[f"soup_{w}vs_prodigy_best"], r[f"soup_{w}vs_random_equal_compute"] = pb, rnd
        return r

    rows = [row("win", "win")] * 7 + [row("loss", "tie")] * 3
    t = tally(rows)
    assert (t["read"], t["soup_better_than_prodigy_best_pct"], t["soup_unseen_beats_random_equal_compute_pct"]) == (
        10, 70.0, 70.0)
    assert t["reading_met"] is True
    assert tally(rows + [row("loss", "loss")])["reading_met"] is False  # 7 of 11 beat random: under 70 %
    # A case whose first run did not reproduce the saved (a) is reported and left out of the reading.
    t = tally(rows + [row("loss", "loss", reproduces=False)])
    assert t["read"] == 10 and t["reading_met"] is True and len(t["not_reproduced"]) == 1


@pytest.mark.slow
@pytest.mark.probe
def test_the_probe_rebuilds_both_runs_and_measures_their_soup(tmp_path, sd1_versus_smoke):
    """On the smoke case (the session's, tests/bench/conftest.py) and its replicate: the probe's first run is the
    saved (a) and its second the replicate's (a) (the same weights: the same validation loss), and the soup of the
    two is measured on both image sets."""
    from bench.seed_soup_probe import main as probe
    from bench.versus import main as versus

    saved, rep = sd1_versus_smoke.out, tmp_path / "replicate.json"
    versus(["--smoke", "--no-grid", "--out", str(rep), "--work-dir", str(tmp_path / rep.stem), "--unseen-images", "4",
            "--training-seed", "1235"])
    result = probe(["--from", str(saved), "--replicate", str(rep), "--seeds", "0", "--out", str(tmp_path / "p.json")])
    (row,) = result["cases"]
    assert row["reproduces"] and row["replicate_reproduces"], row
    assert row["first_val_loss"] != row["second_val_loss"]
    assert row["soup_val_loss"] is not None and row["soup_unseen_loss"] is not None
    assert row["soup_vs_better_run"] in ("win", "tie", "loss")
    assert json.loads((tmp_path / "p.json").read_text())["tally"]["read"] == 1
