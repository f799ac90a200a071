"""The score-calibration benchmark keeps working (a handful of curves) and counts what it says it counts."""


def test_score_calibration_small(tmp_path):
    import json

    from bench.score_calibration import main

    res = main(["--points", "14,30", "--noise", "0.02,0.3", "--seeds", "2", "--bootstrap", "20",
                "--out", str(tmp_path / "sc.json")])
    saved = json.loads((tmp_path / "sc.json").read_text())
    assert saved["n"] == res["n"] == 8 and len(saved["rows"]) == 8
    ok = [r for r in saved["rows"] if r["status"] == "ok"]
    assert saved["ok"] == len(ok) and sum(b["readings"] for b in saved["bands"]) == len(ok)
    # Clean, dense curves read well: scored high and close to the true midpoint.
    clean = [r for r in ok if r["points"] == 30 and r["noise"] == 0.02]
    assert len(clean) == 2 and all(r["quality"] >= 0.7 and r["error_decades"] < 0.2 for r in clean)
