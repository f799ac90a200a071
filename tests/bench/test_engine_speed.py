"""The engine speed benchmark keeps working: a two-update smoke run of both variants on the tiny model."""

import json

import pytest


@pytest.mark.slow
def test_engine_speed_smoke(tmp_path):
    from bench.engine_speed import main

    result = main(["--smoke", "--updates", "2", "--rounds", "1", "--threads", "1", "--out", str(tmp_path / "r.json"),
                   "--work", str(tmp_path / "work")])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["rows"] == result["rows"]
    assert {r["latent_cache"] for r in result["rows"]} == {"on", "off"}
    assert all(
        r["updates"] == 2 and r["updates_per_s"] > 0 and r["cpu_s_per_update"] > 0 and r["peak_mib"] > 0
        for r in result["rows"]
    )
