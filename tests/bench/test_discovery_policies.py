"""bench.discovery_policies: the policies are scored as defined, and the committed results give RESULTS.md's table."""

from __future__ import annotations

import json
from pathlib import Path

from bench.discovery_policies import main, score_case

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _case(improving: bool, mid_curve: list[list[float]], high_curve: list[list[float]]) -> tuple[dict, dict]:
    grid = [{"lr": lr, "updates": 160, "best_val_loss": loss} for lr, loss in ((1e-4, 0.11), (3e-4, 0.10))]
    base = {"kind": "k", "seed": 0, "held_out": False, "grid": grid,
            "discovery": {"lr_mid": 1e-4, "best_val_loss": 0.11, "updates": 208}}
    variant = {"kind": "k", "seed": 0,
               "discovery": {"status": "ok", "lr_low": 5e-5, "lr_mid": 1e-4, "lr_high": 2e-4, "updates": 184,
                             "finetune_updates": 160, "still_improving": improving,
                             "best_val_loss": min(v for _, v in mid_curve), "curve": mid_curve},
               "diagnostic_lr_high": {"lr": 2e-4, "updates": 160, "best_val_loss": min(v for _, v in high_curve),
                                      "curve": high_curve}}
    return base, variant


def test_p2_retries_only_when_still_improving_and_p3_halves_at_half_the_budget():
    # lr_high is ahead at update 80 and ends better: P3 picks it; P2 takes it only when the fine-tune still improved.
    mid = [[40, 0.13], [80, 0.12], [160, 0.105]]
    high = [[40, 0.12], [80, 0.11], [160, 0.101]]
    base, variant = _case(True, mid, high)
    row = score_case(base, variant)
    assert round(row["P1"]["gap"], 6) == 5.0 and row["P2"]["lr"] == 2e-4 and round(row["P2"]["gap"], 6) == 1.0
    assert row["P2"]["updates"] == 184 + 160 and row["P3"]["picked"] == "lr_high" and row["P3"]["updates"] == 184 + 80
    base, variant = _case(False, mid, high)
    assert round(score_case(base, variant)["P2"]["gap"], 6) == 5.0  # no retry: the fine-tune had found its window
    # lr_mid ahead at update 80 keeps lr_mid, even if lr_high would have ended lower; a tie keeps lr_mid too.
    late = [[40, 0.14], [80, 0.125], [160, 0.100]]
    assert score_case(*_case(True, mid, late))["P3"]["picked"] == "lr_mid"
    assert score_case(*_case(True, mid, [[40, 0.15], [80, 0.12], [160, 0.1]]))["P3"]["picked"] == "lr_mid"


def test_the_committed_v3_results_give_the_table_in_results_md(tmp_path, capsys):
    base = [RESULTS / f"discovery_quality_v3_p0_{s}.json" for s in ("tuning", "heldout")]
    variant = [RESULTS / f"discovery_quality_v3_p1_{s}.json" for s in ("heldout", "tuning01", "tuning2a", "tuning2b")]
    out = main(["--base", *map(str, base), "--variant", *map(str, variant), "--out", str(tmp_path / "p.json")])
    summary = {line["policy"]: line for line in out["summary"]}
    assert {p: summary[p]["all"] for p in ("P0", "P1", "P2", "P3")} == {
        "P0": "9/15", "P1": "11/15", "P2": "12/15", "P3": "13/15"}
    assert summary["P3"]["held out"] == "5/6" and summary["P3"]["largest share"] == 0.206
    assert json.loads((tmp_path / "p.json").read_text())["summary"] == out["summary"]
    assert "| P3 " in capsys.readouterr().out
