"""The threads benchmark keeps working: tiny UNet updates timed at one thread and at torch's default."""

import json


def test_threads_smoke(tmp_path):
    from bench.threads import main

    out = tmp_path / "threads.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    rows = saved["rows"]
    assert {r["threads"] for r in rows} == {1, saved["default_threads"]} and all(r["busy_processes"] == 0 for r in rows)
    assert all(r["seconds_per_update"] > 0 for r in rows) and saved["machine"]["python"]
