"""Issue 34's "the README's claim matches RESULTS.md, number for number": the README's standings table is the one
the saved standings of record give (bench/results/versus_all_275.json, as `bench.versus --report` aggregates it),
and RESULTS.md's headline quotes the same shares."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The README's rows, by the opponent each names, in the order the table gives them.
ROWS = {"Prodigy, final weights": "prodigy_final", "folk default, final weights": "folk_final",
        "folk default, best checkpoint": "folk_best", "Prodigy, best checkpoint": "prodigy_best",
        "random search, exactly (a)'s updates": "random_equal",
        "random search, two whole runs (>= (a)'s updates)": "random_best"}


def _readme_rows() -> dict[str, tuple[int, int, int, int]]:
    text = (ROOT / "README.md").read_text()
    out = {}
    for label, opp in ROWS.items():
        m = re.search(r"^\| " + re.escape(label) + r" \| (\d+) / (\d+) / (\d+) \|[^|]*\| \**(\d+) %", text, re.M)
        assert m, f"README: no standings row for {label!r}"
        out[opp] = tuple(int(x) for x in m.groups())
    return out


def test_the_readme_standings_are_the_saved_standings_of_record():
    agg = json.loads((ROOT / "bench" / "results" / "versus_all_275.json").read_text())["aggregate"]
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


def test_results_headline_quotes_the_same_shares():
    agg = json.loads((ROOT / "bench" / "results" / "versus_all_275.json").read_text())["aggregate"]
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    head = results[results.index("The standings of record are over"):][:900]
    for opp in ("prodigy_best", "random_equal", "random_best"):
        w = agg[f"vs_{opp}"]
        assert f"{100 * w['win'] / w['n']:.1f} %" in head, opp
