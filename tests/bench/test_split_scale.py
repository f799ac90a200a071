"""The split benchmark keeps working: one size of 1,000 images, duplicates grouped and the too-small one skipped."""

import json

import pytest


@pytest.mark.slow
def test_split_scale_smoke(tmp_path):
    from bench.split_scale import main

    out = tmp_path / "split.json"
    result = main(["--smoke", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"] and saved["machine"]["python"]
    (row,) = saved["rows"]
    assert row["images_written"] == 1000 and row["images"] == 999 and row["skipped"] == 1
    assert row["duplicate_groups"] == 1 and row["train"] + row["val"] == 999
    assert row["seconds"] > 0 and row["peak_rss_mib"] >= row["rss_after_imports_mib"] > 0
    split = json.loads((tmp_path / "work" / "split-1000" / "split.json").read_text())
    assert split["duplicates"] == [["000/000499.png", "000/000500.png", "000/000501.png", "000/000502.png"]]
