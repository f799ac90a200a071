"""bench.lever_probe sets each lever on the case bench.versus would train, and reads the grids' best LRs."""

import json

import pytest

from bench.lever_probe import LEVERS, lever_case, lr_stakes, main, planned, readings, sensitivity


def test_each_lever_reaches_the_case_s_config_and_data(tmp_path):
    shipped = lever_case("lora", "shapes", 30, "shipped", tmp_path)
    batch = lever_case("lora", "shapes", 30, "batch16", tmp_path)
    more = lever_case("lora", "shapes", 30, "images40", tmp_path)
    assert (shipped[1].training.batch_size, batch[1].training.batch_size) == (4, 16)
    assert batch[1].training.method == "lora" and batch[1].lr_range_test.lr_min is None  # the method's own sweep
    assert len(list((shipped[0] / "dataset").glob("*.png"))) == 20
    assert len(list((more[0] / "dataset").glob("*.png"))) == 40


def test_readings_are_each_lever_s_best_lr_over_the_shipped_grid_s(tmp_path, capsys):
    rows = [{"method": "lora", "kind": k, "lever": lever, "best_lr": lr}
            for k, lever, lr in [("shapes", "shipped", 1e-2), ("shapes", "batch16", 3e-2), ("shapes", "images40", 1e-2),
                                 ("subject", "shipped", 1e-2), ("subject", "batch16", 1e-1)]]
    got = {r["lever"]: r for r in readings(rows)}
    assert got["batch16"]["median_ratio"] == pytest.approx((3 + 10) / 2) and got["batch16"]["moved"] == 2
    assert got["images40"]["cases"] == 1 and got["images40"]["moved"] == 0
    assert set(LEVERS) == {"shipped", "batch16", "images40", "vectors4"}
    with pytest.raises(SystemExit):
        main(["--levers", "shipped,nope", "--out", str(tmp_path / "never.json")])
    assert "unknown lever nope" in capsys.readouterr().err and not (tmp_path / "never.json").exists()


def test_four_vectors_reach_a_textual_inversion_case_and_no_other_method_is_planned_with_them(tmp_path):
    _, cfg, _ = lever_case("textual_inversion", "shapes", 30, "vectors4", tmp_path)
    assert cfg.training.method == "textual_inversion" and cfg.training.textual_inversion.num_vectors == 4
    plan = planned(["lora", "textual_inversion"], ["shapes"], ["shipped", "vectors4"])
    assert plan == [("lora", "shapes", "shipped"), ("textual_inversion", "shapes", "shipped"),
                    ("textual_inversion", "shapes", "vectors4")]
    assert planned(["lora", "textual_inversion"], ["shapes"], ["shipped", "vectors4"], (2, 2)) == plan[1::2]


def test_what_a_half_decade_miss_costs_is_read_from_the_grid_around_its_best(tmp_path, capsys):
    arms = [{"lr": 10.0 ** (-4 + i / 2), "best_val_loss": x}
            for i, x in enumerate([0.110, 0.104, 0.101, 0.100, 0.1005, None, 0.2])]
    got = sensitivity(arms)
    assert got["near_pct"] == pytest.approx(0.5)  # the cheaper neighbour: 0.1005, not 0.101
    assert got["decade_pct"] == float("inf")  # two points above the best, one failed
    assert sensitivity([{"lr": 1.0, "best_val_loss": None}]) == {"near_pct": None, "decade_pct": None}
    rows = [{"method": "textual_inversion", "kind": k, "lever": lv, "near_pct": x}
            for k, lv, x in [("shapes", "shipped", 0.2), ("subject", "shipped", 0.4), ("shapes", "vectors4", 2.5)]]
    stakes = {r["lever"]: r for r in lr_stakes(rows)}
    assert stakes["shipped"]["median_near_pct"] == pytest.approx(0.3) and stakes["shipped"]["above_band"] == 0
    assert stakes["vectors4"]["above_band"] == 1
    # A result saved before near_pct existed is read from its own grid.
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"benchmark": "lever_probe", "rows": [
        {"method": "lora", "kind": "shapes", "lever": "shipped", "best_lr": 1e-2, "arms": arms}]}))
    merged = main(["--report", str(old), "--out", str(tmp_path / "merged.json")])
    assert merged["rows"][0]["near_pct"] == pytest.approx(0.5) and "half a decade" in capsys.readouterr().out
