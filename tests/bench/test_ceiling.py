"""bench.ceiling: the best constant-LR run of each case, weighed against the arms as (a) is. That the grids it trains
reproduce bench.versus's is checked on the versus smoke case (tests/bench/test_versus.py)."""

from __future__ import annotations

import pytest

from bench.ceiling import ceiling


def case(method, a, a_lr, prodigy, randoms, grid, folk=None, seed=1):
    """A saved bench.versus case as far as the ceiling reads it (its summary as bench.versus.summarize writes it)."""
    # Runs of 160 updates validated at the end only; (a) trained 264, so a second run is cut before its checkpoint.
    runs = [{"lr": lr, "best_val_loss": loss, "best_update": 160, "updates": 160, "curve": [[160, loss]]}
            for lr, loss in randoms]
    return {"method": method, "kind": "shapes", "seed": seed, "folk": {"lr": 1e-4},
            "random": {"runs": runs}, "rangefinder": {"updates": 264},
            "grid": {"arms": [{"lr": lr, "best_val_loss": loss} for lr, loss in grid]} if grid else None,
            "summary": {"case": f"{method} shapes {seed}", "rangefinder": a, "rangefinder_lr": a_lr,
                        "prodigy_best": prodigy, "folk_best": folk,
                        "random_best": min(loss for _, loss in randoms),
                        "grid_best": min(loss for _, loss in grid) if grid else None}}


def test_the_oracle_is_the_best_constant_lr_run_and_never_loses_to_random_search():
    cases = [
        # (a) ties Prodigy's best and random search; a grid point 3x higher beats both by more than 1 %.
        case("full", 1.000, 1e-4, 1.005, [(5e-5, 1.004)], [(1e-5, 1.2), (3e-4, 0.95)]),
        # (a) is the best run: the oracle is (a) itself.
        case("lora", 0.90, 1e-3, 1.0, [(3e-4, 1.0), (3e-3, 0.97)], [(1e-4, 1.1)], folk=1.05),
        # Random search drew the best LR: the oracle ties it and cannot beat it.
        case("textual_inversion", 1.02, 1e-2, 1.0, [(2e-2, 1.0)], [(1e-4, 1.03)]),
        # Without a grid a case is not read.
        case("full", 1.0, 1e-4, 1.0, [(1e-4, 1.0)], None),
    ]
    got = ceiling(cases)
    assert got["cases"] == 3
    rows = {r["method"]: r for r in got["rows"]}
    assert (rows["full"]["oracle"], rows["full"]["oracle_run"], rows["full"]["oracle_lr"]) == (0.95, "grid", 3e-4)
    assert rows["lora"]["oracle_run"] == "rangefinder" and rows["lora"]["oracle_vs_random_best"] == "win"
    # At exactly (a)'s 264 updates the second draw (160 + 104) never reached its checkpoint: random search's best is
    # the first draw's, read off the saved runs where the summary predates the exact reading.
    assert (rows["lora"]["random_best"], rows["lora"]["random_equal"]) == (0.97, 1.0)
    assert rows["lora"]["oracle_vs_random_equal"] == "win"
    assert rows["textual_inversion"]["oracle_run"] == "random"
    assert rows["textual_inversion"]["rangefinder_vs_random_best"] == "loss"
    assert rows["textual_inversion"]["oracle_vs_random_best"] == "tie"
    every = got["by"]["all"]
    assert every["rangefinder_vs_random_best"] == {"win": 1, "tie": 1, "loss": 1}
    assert every["oracle_vs_random_best"] == {"win": 2, "tie": 1, "loss": 0}
    assert every["oracle_vs_random_best_better_share"] == pytest.approx(2 / 3)
    # (a)'s non-wins the oracle turns into wins, and on which side of (a)'s LR its LR lies.
    assert every["turned_vs_prodigy_best"] == {"n": 1, "higher": 1, "lower": 0, "median_lr_ratio": pytest.approx(3.0)}
    # (a) is 1000/950 - 1 = 5.3 % above the full case's oracle, the oracle itself in LoRA, 2 % above it in TI.
    assert every["rangefinder_over_oracle_pct"] == {"median": pytest.approx(2.0), "max": pytest.approx(100 / 19),
                                                    "within_1pct": 1}
    assert every["oracle_run"] == {"rangefinder": 1, "grid": 1, "folk": 0, "random": 1}
    assert got["readings"] == {"random_line_reachable": False, "random_line_reachable_at_equal_compute": False,
                               "prodigy_line_reachable": True}
