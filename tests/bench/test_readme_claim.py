"""Issue 34's "the README's claim matches RESULTS.md, number for number": the README's standings table is the one
the saved standings of record give (bench.versus.STANDINGS_OF_RECORD, merged as `bench.versus --report` merges
them), and RESULTS.md's headline quotes the same shares."""

import re
from pathlib import Path
from typing import Any

import pytest

from bench.versus import standings_of_record

ROOT = Path(__file__).resolve().parents[2]
# The README's rows, by the opponent each names, in the order the table gives them.
ROWS = {"Prodigy, final weights": "prodigy_final", "folk default, final weights": "folk_final",
        "folk default, best checkpoint": "folk_best", "Prodigy, best checkpoint": "prodigy_best",
        "random search, exactly (a)'s updates": "random_equal",
        "random search, two whole runs (>= (a)'s updates)": "random_best"}


@pytest.fixture(scope="module")
def record() -> tuple[dict[str, Any], list[str]]:
    """The standings of record, merged once for the module, and what the merge said it replaced."""
    replaced: list[str] = []
    return standings_of_record(say=replaced.append), replaced


def _readme_rows() -> dict[str, tuple[int, int, int, int]]:
    text = (ROOT / "README.md").read_text()
    out = {}
    for label, opp in ROWS.items():
        m = re.search(r"^\| " + re.escape(label) + r" \| (\d+) / (\d+) / (\d+) \|[^|]*\| \**(\d+) %", text, re.M)
        assert m, f"README: no standings row for {label!r}"
        out[opp] = tuple(int(x) for x in m.groups())
    return out


def test_the_readme_standings_are_the_saved_standings_of_record(record):
    agg = record[0]["aggregate"]
    for opp, (win, tie, loss, pct) in _readme_rows().items():
        saved = agg[f"vs_{opp}"]
        assert (win, tie, loss) == (saved["win"], saved["tie"], saved["loss"]), opp
        assert pct == round(100 * saved["win"] / saved["n"]), opp
    # Beneath the 1 % band: the counts the README gives as context.
    text = " ".join((ROOT / "README.md").read_text().split())
    lower = agg["a_lower_than"]
    assert (f"(a) is lower than Prodigy's best in {lower['prodigy_best']['lower']} and lower than random search in "
            f"{lower['random_equal']['lower']}") in text
    goals = agg["goals"]
    assert not goals["beats_random_equal"]["met"] and not goals["as_good_as_prodigy_best"]["met"]
    assert goals["grid"]["met"]


def test_results_headline_quotes_the_same_shares(record):
    agg = record[0]["aggregate"]
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    head = results[results.index("The standings of record are over"):][:900]
    for opp in ("prodigy_best", "random_equal", "random_best"):
        w = agg[f"vs_{opp}"]
        assert f"{100 * w['win'] / w['n']:.1f} %" in head, opp


def _pct(x: float) -> str:
    return "100 %" if x == 1 else ("0 %" if x == 0 else f"{100 * x:.1f} %")


def test_results_at_a_glance_is_the_saved_standings_by_group(record):
    """RESULTS.md's "At a glance" table: every share, for all cases, the held-out ones and each method, is the one
    the saved standings give, and each line says met or not as the JSON does."""
    saved = record[0]
    groups = [saved["aggregate"], saved["aggregate_held_out"],
              *(saved["aggregate_by_method"][m] for m in ("full", "lora", "textual_inversion"))]
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    table = results[results.index("**At a glance: the standings of record**"):]
    table = table[:table.index("\n\n", table.index("| Goal line |"))]
    rows = {line.split(" | ")[0].strip("| "): [c.strip().replace("**", "") for c in line.strip("|").split(" | ")]
            for line in table.splitlines() if line.startswith("| ") and not line.startswith("| Goal line")}
    lines = {"Prodigy, final weights": "as_good_as_prodigy_final",
             "Prodigy, best checkpoint by validation": "as_good_as_prodigy_best",
             "folk default, final weights": "as_good_as_folk_final",
             "folk default, best checkpoint": "as_good_as_folk_best"}
    for label, goal in lines.items():
        cells = rows[label][2:7]
        assert cells == [f"{_pct(g['goals'][goal]['share'])} / {_pct(g['goals'][goal]['better_share'])}"
                         for g in groups], label
        assert rows[label][7] == ("yes" if saved["aggregate"]["goals"][goal]["met"] else "no"), label
    rand = rows["random search at exactly (a)'s updates"]
    assert rand[2:7] == [_pct(g["goals"]["beats_random_equal"]["share"]) for g in groups]
    assert rand[7] == ("yes" if saved["aggregate"]["goals"]["beats_random_equal"]["met"] else "no")
    grid = rows["the 8-LR grid, at <= 25 % of its updates"]
    gaps = [g["gap_rangefinder_pct"] for g in groups]
    assert grid[2].startswith(f"{gaps[0]['within_3pct']} of {gaps[0]['n']}, at "
                              f"{100 * saved['aggregate']['rangefinder_update_share_max']:.1f} %")
    assert grid[3:7] == [f"{x['within_3pct']} of {x['n']}" for x in gaps[1:]]
    assert grid[7] == ("yes" if saved["aggregate"]["goals"]["grid"]["met"] else "no")


def test_the_standings_count_each_case_once_and_say_how_many(record):
    """The files of record hold no case twice (a re-run would silently replace one), and RESULTS.md and the README
    name the number of cases the merge gives."""
    saved, replaced = record
    assert replaced == []
    n, held = saved["aggregate"]["cases"], saved["aggregate"]["held_out"]
    results = " ".join((ROOT / "bench" / "RESULTS.md").read_text().split())
    assert f"**At a glance: the standings of record** ({n} SD 1.x cases, {held} of them held out" in results
    assert f"Over {n} SD 1.x cases" in " ".join((ROOT / "README.md").read_text().split())


def test_bench_versus_record_prints_the_standings_of_record(record, capsys):
    """`python -m bench.versus --record`, the command RESULTS.md gives for the standings: the same standings."""
    from bench.versus import main

    printed = main(["--record"])
    assert printed["aggregate"] == record[0]["aggregate"]
    assert printed["aggregate_by_method"] == record[0]["aggregate_by_method"]
    assert "| (a) chosen |" in capsys.readouterr().out


def test_cases_run_as_shipped_join_the_record_as_they_ran_and_a_case_of_record_cannot_join_twice(
        record, tmp_path, monkeypatch):
    """RECORD_AS_SHIPPED's cases ran (a) as it ships (LoRA's EMA included), so they join after A_AS_SHIPPED's
    re-runs with their own (a), LoRA too; a case already of record joining again is one error, not a silent swap."""
    import json

    import bench.versus as versus

    saved = record[0]
    lora = next(c for c in saved["cases"] if c["method"] == "lora")
    fresh = {k: v for k, v in lora.items() if k != "summary"}
    fresh = {**fresh, "seed": 999, "rangefinder": {**fresh["rangefinder"], "lr_used": 1.234e-3}}
    path = tmp_path / "fresh.json"
    path.write_text(json.dumps({"cases": [fresh]}))
    monkeypatch.setattr(versus, "RECORD_AS_SHIPPED", (*versus.RECORD_AS_SHIPPED, str(path)))
    grown = versus.standings_of_record()
    assert grown["aggregate"]["cases"] == saved["aggregate"]["cases"] + 1
    (joined,) = [c for c in grown["cases"] if c["seed"] == 999]
    assert joined["rangefinder"]["lr_used"] == 1.234e-3  # its own (a), not a re-run's
    again = {k: v for k, v in lora.items() if k != "summary"}
    path.write_text(json.dumps({"cases": [again]}))
    with pytest.raises(SystemExit, match="in the standings of record twice"):
        versus.standings_of_record()
