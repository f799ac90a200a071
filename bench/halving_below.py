"""The third halving candidate's readings: (a) re-run with `finetune.halving_below_margin` against (a) as saved.

The rule, its test cases and its readings were written in bench/RESULTS.md ("A third halving candidate below lr_mid")
before any test case was read. `bench.versus --halving-below-margin M --reuse-arms SAVED.json` re-runs (a) of the
cases where it fires and keeps arms (b)-(e), random search topped up to (a)'s extra updates. This pairs each re-run
with its saved case and reads:
- whether the re-run reproduced the saved race (the same best validation loss of `lr_mid` and `lr_high` by the
  pause): a re-run that did not is not the same case and stops the reading;
- R1: (a)'s delivered validation loss with the rule against without it: lower in more than half, median change < 0;
- R2: each case's verdict against Prodigy's best, the folk default's best and random search, with and without: the
  verdicts turned better (loss to tie or win, tie to win) against those turned worse.

    python -m bench.halving_below --saved bench/results/versus_all_215.json ... \\
        --rerun bench/results/versus_lora_below_rerun.json --out bench/results/halving_below.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any, Optional

from bench.common import results_file
from bench.versus import case_key, summarize, verdict_of, verdict_rank

NAME = "halving_below"
ARMS = ("prodigy_best", "folk_best", "random_best")  # the verdicts R2 counts (bench/RESULTS.md)


def race_reproduces(saved: dict[str, Any], rerun: dict[str, Any]) -> bool:
    """The same best validation loss for `lr_mid` and `lr_high` by the pause: the re-run raced the saved case."""
    was, now = saved["rangefinder"].get("halving") or {}, rerun["rangefinder"].get("halving") or {}
    if not was or not now or was.get("pause_update") != now.get("pause_update"):
        return False
    return all(math.isclose(was[n]["best_val_loss"], now[n]["best_val_loss"], rel_tol=1e-6)
               for n in ("lr_mid", "lr_high"))


def turned(before: Optional[str], after: Optional[str]) -> str:
    """How a verdict moved: better, worse or same."""
    if before is None or after is None or before == after:
        return "same"
    return "better" if verdict_rank(after) > verdict_rank(before) else "worse"


def pair(saved: dict[str, Any], rerun: dict[str, Any]) -> dict[str, Any]:
    """One case's row: its race, (a) with and without the rule, and each verdict before and after."""
    s, r = summarize(saved), summarize(rerun)
    halving = rerun["rangefinder"].get("halving") or {}
    row: dict[str, Any] = {
        "case": r["case"], "reproduces": race_reproduces(saved, rerun), "kept": halving.get("kept"),
        "fired": "lr_below" in halving, "lr_before": s["rangefinder_lr"], "lr_after": r["rangefinder_lr"],
        "before": s["rangefinder"], "after": r["rangefinder"],
        "change_pct": 100 * (r["rangefinder"] / s["rangefinder"] - 1)
        if s["rangefinder"] and r["rangefinder"] else None,
        "updates_before": s["updates"]["rangefinder"], "updates_after": r["updates"]["rangefinder"],
        "random_runs_before": s["random_runs"], "random_runs_after": r["random_runs"],
    }
    for arm in ARMS:
        before, after = verdict_of(s["rangefinder"], s[arm]), verdict_of(r["rangefinder"], r[arm])
        row[f"vs_{arm}"] = {"before": before, "after": after, "turned": turned(before, after)}
    return row


def readings(rows: list[dict[str, Any]], all_cases: bool = False) -> dict[str, Any]:
    """R1 and R2 over the cases where the rule fired (`all_cases`: over every pair, for a change that applies to
    every case, such as the range test's length)."""
    fired = rows if all_cases else [x for x in rows if x["fired"]]
    changes = [x["change_pct"] for x in fired if x["change_pct"] is not None]
    lower = sum(c < 0 for c in changes)
    moves = [x[f"vs_{arm}"]["turned"] for x in fired for arm in ARMS]
    better, worse = moves.count("better"), moves.count("worse")
    # A change that applies everywhere (all_cases) changes the race itself: there is no saved race to reproduce.
    reproduce = None if all_cases else all(x["reproduces"] for x in rows)
    return {"cases": len(rows), "fired": len(fired), "all_reproduce": reproduce,
            "r1": {"lower": lower, "of": len(changes),
                   "median_change_pct": statistics.median(changes) if changes else None,
                   "met": bool(changes) and lower > len(changes) / 2 and statistics.median(changes) < 0},
            "r2": {"better": better, "worse": worse, "met": better > worse},
            "by_arm": {arm: {t: [x[f"vs_{arm}"]["turned"] for x in fired].count(t)
                             for t in ("better", "worse", "same")} for arm in ARMS}}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | kept | lr before → after | (a) before | (a) after | change | vs Prodigy best | vs folk best | "
             "vs random | updates | random runs |", "|" + "---|" * 11]
    for x in rows:
        cells = [f"{x['vs_' + a]['before']} → {x['vs_' + a]['after']}" for a in ARMS]
        lines.append(f"| {x['case']} | {x['kept']} | {x['lr_before']:.3g} → {x['lr_after']:.3g} | {x['before']:.4f} | "
                     f"{x['after']:.4f} | {x['change_pct']:+.1f} % | {' | '.join(cells)} | "
                     f"{x['updates_before']} → {x['updates_after']} | {x['random_runs_before']} → "
                     f"{x['random_runs_after']} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.halving_below", description=__doc__.split("\n")[0])
    p.add_argument("--saved", type=results_file, nargs="+", required=True,
                   help="the versus JSONs the cases were saved in")
    p.add_argument("--rerun", type=results_file, nargs="+", required=True, help="the re-runs with the rule")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--all-cases", action="store_true",
                   help="read R1 and R2 over every pair, not only where the third candidate fired (a change that "
                   "applies to every case: bench.versus --range-test-epochs)")
    args = p.parse_args(argv)
    saved: dict[Any, dict[str, Any]] = {}
    for path in args.saved:  # a later file's case replaces an earlier one's, as in bench.versus --report
        saved.update({case_key(c): c for c in json.loads(path.read_text())["cases"]})
    rows = []
    for path in args.rerun:
        for c in json.loads(path.read_text())["cases"]:
            if case_key(c) not in saved:
                raise SystemExit(f"{c['method']} {c['kind']} {c['seed']} in {path} is in none of the saved files")
            rows.append(pair(saved[case_key(c)], c))
    result = {"benchmark": NAME, "saved": [str(x) for x in args.saved], "rerun": [str(x) for x in args.rerun],
              "rows": rows, "readings": readings(rows, args.all_cases)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(rows))
    print(json.dumps(result["readings"], indent=1))
    return result


if __name__ == "__main__":
    main()
