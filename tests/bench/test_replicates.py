"""bench.replicates: a first run and its replicate (another training seed) read side by side and together."""

from __future__ import annotations

import json

import pytest

from bench.replicates import arm_changes, main, mean_summary, read_together
from bench.unseen import UNSEEN_ARMS
from bench.versus import OPPONENTS, verdict_of


def _summary(method: str, kind: str, a: float | None, others: float, unseen: bool = True) -> dict:
    s = {"family": "sd1", "method": method, "kind": kind, "seed": 14, "held_out": True, "rangefinder": a}
    s.update({arm: others for arm in UNSEEN_ARMS if arm != "rangefinder"})
    s.update({f"vs_{o}": verdict_of(a, others) for o in OPPONENTS})
    if unseen:
        s["unseen_images"] = 20
        s.update({f"unseen_{arm}": 1.4 * s[arm] if s[arm] is not None else None for arm in UNSEEN_ARMS})
        s.update({f"unseen_vs_{o}": verdict_of(s["unseen_rangefinder"], s[f"unseen_{o}"]) for o in OPPONENTS})
    return s


def test_the_two_runs_read_together_average_each_arm_and_recount_the_verdicts():
    # (a) wins by 5 % in the first run and loses by 4 % in the replicate: together it is 0.5 % lower, a tie.
    first, second = _summary("lora", "shapes", 0.095, 0.100), _summary("lora", "shapes", 0.104, 0.100)
    m = mean_summary(first, second)
    assert m["rangefinder"] == pytest.approx(0.0995) and m["vs_prodigy_best"] == "tie"
    assert m["unseen_rangefinder"] == pytest.approx(1.4 * 0.0995) and m["unseen_vs_random_best"] == "tie"
    # A failed (a) leaves no mean: a loss, as in a single run. Unseen images only where both runs scored them.
    failed = mean_summary(first, _summary("lora", "shapes", None, 0.100))
    assert failed["rangefinder"] is None and failed["vs_prodigy_best"] == "loss"
    assert "unseen_rangefinder" not in mean_summary(first, _summary("lora", "shapes", 0.1, 0.1, unseen=False))

    pairs = [(first, second), (_summary("full", "glyphs", 0.090, 0.100), _summary("full", "glyphs", 0.091, 0.100))]
    t = read_together(pairs)
    assert t["first"]["validation"]["vs_prodigy_best"] == {"n": 2, "win": 2, "tie": 0, "loss": 0}
    assert t["replicate"]["validation"]["vs_prodigy_best"] == {"n": 2, "win": 1, "tie": 0, "loss": 1}
    assert t["mean_of_two"]["validation"]["vs_prodigy_best"] == {"n": 2, "win": 1, "tie": 1, "loss": 0}
    assert t["mean_of_two"]["unseen"]["vs_random_best"]["win"] == 1
    assert t["mean_of_two"]["by_method"]["full"]["vs_prodigy_best"]["win"] == 1

    c = arm_changes(pairs)
    # (a)'s replicate against its first run: +9.5 % (a loss) and +1.1 % (a loss); the other arms did not move.
    assert c["validation_arms"]["rangefinder"] == {
        "n": 2, "win": 0, "tie": 0, "loss": 2, "median_abs_change_pct": pytest.approx((9.47368 + 1.11111) / 2, 1e-4),
        "largest_abs_change_pct": pytest.approx(9.47368, 1e-4)}
    assert c["validation_arms"]["prodigy_best"]["tie"] == 2
    assert c["validation_verdicts_changed"]["prodigy_best"] == {"changed": 1, "of": 2}


def test_a_replicate_with_the_first_runs_seed_is_refused(tmp_path):
    case = {"family": "sd1", "method": "lora", "kind": "shapes", "seed": 14,
            "summary": _summary("lora", "shapes", 0.1, 0.1)}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"cases": [case]}))
    # A first run saved before the seed was recorded trained with its data seed (set_up_case), not TrainingConfig's
    b.write_text(json.dumps({"cases": [{**case, "training_seed": 14}]}))
    with pytest.raises(SystemExit, match="same run again"):
        main(["--first", str(a), "--second", str(b), "--out", str(tmp_path / "o.json")])
    b.write_text(json.dumps({"cases": [{**case, "training_seed": 1234}]}))
    assert main(["--first", str(a), "--second", str(b), "--out", str(tmp_path / "o.json")])["standings"]["cases"] == 1
    b.write_text(json.dumps({"cases": [{**case, "training_seed": 1235}]}))
    out = main(["--first", str(a), "--second", str(b), "--out", str(tmp_path / "o.json")])
    assert out["standings"]["cases"] == 1 and json.loads((tmp_path / "o.json").read_text())["benchmark"] == "replicates"
