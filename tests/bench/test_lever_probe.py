"""bench.lever_probe sets each lever on the case bench.versus would train, and reads the grids' best LRs."""

import pytest

from bench.lever_probe import LEVERS, lever_case, main, readings


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
    assert set(LEVERS) == {"shipped", "batch16", "images40"}
    with pytest.raises(SystemExit):
        main(["--levers", "shipped,nope", "--out", str(tmp_path / "never.json")])
    assert "unknown lever nope" in capsys.readouterr().err and not (tmp_path / "never.json").exists()
