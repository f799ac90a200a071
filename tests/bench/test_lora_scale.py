"""bench.lora_scale reads bench.versus cases run at several LoRA adapters as written down before they ran."""

import json

import pytest

from bench.lora_scale import loss_at, main, readings

GRID = [1e-3, 1e-2, 1e-1]


def _case(kind, lora, a_lr, grid_losses, prodigy_d, a_loss=0.10):
    """A saved bench.versus LoRA case: (a) at `a_lr`, Prodigy's best 0.10 (d x lr `prodigy_d`), the folk default
    0.2, random search's best draw 0.105 at 2 x (a)'s LR, a 3-LR grid with `grid_losses`."""
    arm = {"updates": 160, "seconds": 1.0, "final_val_loss": 0.2, "best_val_loss": 0.2, "lr": 1e-4}
    c = {"method": "lora", "kind": kind, "seed": 30, "held_out": True, "images": 20,
         "rangefinder": {"status": "ok", "updates": 264, "seconds": 1.0, "finetune_updates": 160,
                         "baseline_val_loss": 0.3, "lr_used": a_lr, "chosen": {"val_loss": a_loss, "update": 80},
                         "final_val_loss": a_loss, "best_val_loss": a_loss},
         "prodigy": {**arm, "lr": 1.0, "best_val_loss": 0.10, "final_val_loss": 0.11,
                     "lr_effective_at_best": prodigy_d, "lr_effective_final": prodigy_d},
         "folk": arm,
         "random": {"span": [1e-6, 1.0], "updates": 320, "seconds": 2.0,
                    "runs": [{**arm, "lr": 2 * a_lr, "best_val_loss": 0.105}]},
         "grid": {"reused_from": None, "arms": [{"lr": lr, "best_val_loss": y, "updates": 160, "seconds": 1.0}
                                                for lr, y in zip(GRID, grid_losses, strict=True)]}}
    if lora:
        c["lora"] = lora
    return c


def test_the_grid_is_read_linearly_in_log_lr_and_nothing_outside_it():
    points = list(zip(GRID, [0.3, 0.1, 0.2], strict=True))
    assert loss_at(points, 1e-2) == 0.1 and loss_at(points, 1e-1) == 0.2
    assert loss_at(points, 10 ** -1.5) == pytest.approx(0.15)  # half-way in log LR
    assert loss_at(points, 1e-4) is None and loss_at(points, 1.0) is None and loss_at(points, None) is None


def test_readings_follow_the_scale_pick_a_constant_in_hindsight_and_weigh_prodigy_s_d(tmp_path, capsys):
    shipped = [_case("shapes", None, 1e-2, [0.3, 0.08, 0.2], 1e-2),
               _case("stripes", None, 2e-3, [0.3, 0.08, 0.2], 1e-2, a_loss=0.09)]
    kohya = [_case("shapes", {"rank": 16, "alpha": 1.0}, 4e-2, [0.4, 0.2, 0.09], 1e-1),
             _case("stripes", {"rank": 16, "alpha": 1.0}, 1e-1, [0.4, 0.2, 0.09], 3e-2, a_loss=0.12)]
    r = readings(shipped + kohya)
    assert r["cases"] == 4 and list(r["v1"]) == ["r4 a4", "r16 a1", "away_from_scale_1"]
    # (a) 0.10 against Prodigy's best 0.10 is a tie, 0.09 a win, 0.12 a loss; random search's 0.105 is beaten by 0.09
    assert r["v1"]["r4 a4"]["prodigy_best"] == {"win": 1, "tie": 1, "loss": 0}
    assert r["v1"]["away_from_scale_1"]["prodigy_best"] == {"win": 0, "tie": 1, "loss": 1}
    v2 = r["v2"]["r16 a1"]
    assert v2["one_over_scale"] == 16
    assert v2["rangefinder"] == pytest.approx((4 + 50) / 2) and v2["rangefinder_pairs"] == 2  # 4x and 50x
    assert v2["prodigy_d_lr"] == pytest.approx((10 + 3) / 2) and v2["grid_best"] == pytest.approx(10)
    v3 = r["v3_v4"]
    # Over all four, 1e-2 is best for two and 1e-1 for the other two: 1e-2's median gap (0 and 122 %) is the lower
    assert v3["all"]["constant_lr"] == 1e-2 and v3["r16 a1"]["constant_lr"] == 1e-1
    assert v3["r16 a1"]["constant_gap_pct"] == 0
    # (a) at 4e-2 and 1e-1 against d x lr at 1e-1 and 3e-2: each is closer once on the adapter's two cases
    assert (v3["r16 a1"]["a_lr_closer"], v3["r16 a1"]["prodigy_d_closer"]) == (1, 1)
    # shipped: (a) at 1e-2 sits on the best point in one, at 2e-3 between points in the other; d x lr is on it in both
    assert (v3["r4 a4"]["a_lr_closer"], v3["r4 a4"]["prodigy_d_closer"]) == (0, 1)

    path = tmp_path / "cases.json"
    path.write_text(json.dumps({"cases": shipped + kohya}))
    out = tmp_path / "readings.json"
    assert main([str(path), "--out", str(out)])["v2"] == json.loads(out.read_text())["v2"]
    printed = capsys.readouterr().out
    assert "V1: (a) win / tie / loss" in printed and "r16 a1" in printed
