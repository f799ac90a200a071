"""The ceiling (issue 34): how would the best constant LR of each case have stood against the arms?

bench.versus weighs (a), rangefinder's delivered model, against Prodigy's best checkpoint and random search's best.
Two of the Goal's lines fail there (bench/RESULTS.md, "The standings over all 215"). This asks whether that is (a)'s
LR choice or above what any LR choice could reach with the same fine-tune. It needs no new method: every arm but
Prodigy is a constant-LR AdamW run of the same recipe, so the best of them is what a perfect LR finder would have
trained.

For each case with an 8-LR grid, the **pool oracle** is the lowest validation loss among every constant-LR run the
case trained: the grid's 8 (best checkpoint each), (a)'s delivered model, the folk default's best checkpoint
(AdamW at 1e-4 for full and LoRA, 5e-3 for textual inversion) and random search's draws. It stands for an LR finder
that always lands on the best LR the case saw, with (a)'s own delivery where (a) is that best. It is coarse by at
most the grid's spacing (2.7x) where no other run came closer. Its verdicts against Prodigy's best and random
search's best, with the Goal's 1 % band, are the ceiling of those two lines for a constant-LR fine-tune of this
recipe. Random search's own draws are in the pool, so the oracle never loses to it: the ceiling of "beats random
search" is the share of cases where some other constant LR was more than 1 % better than both of its draws.

Written down (committed) 2026-11-28 01:25 UTC, before any grid of the fresh seeds ran. The saved 60 cases with a grid
(seeds 0-4) had been read: there the oracle beats random search in 39 of 60 (65 %) and Prodigy's best in 38 of 60
(63 %), against (a)'s 38 and 32.
- The new grids: seeds 14-17 (the fresh seeds, on which (a) stood worst), `--from
  bench/results/versus_all_215.json`, 8 LRs log-spaced over 1e-5..1e-2 (full) and 1e-4..1e-1 (LoRA, textual
  inversion), as the saved grids. Each is trained with the case's settings, as every arm but (a) is (a plain
  fine-tune: bench.versus.plain_finetune). Full and LoRA come first, then textual inversion; two processes run side by
  side. Cases not reached by 03:20 UTC are said to be missing. A grid counts only if its run reproduces the saved case:
  the same base-model validation loss, and for LoRA the grid point at 1e-4 gives the folk default's best loss.
- The readings, over all cases with a grid (the 60 saved and the new ones), by method and together:
  (i) if the oracle beats random search's best in fewer than 70 % of the cases, the Goal's random search line is out
  of reach for any LR choice of this fine-tune on those cases;
  (ii) the same for "better than Prodigy's best in a majority";
  (iii) how many of (a)'s non-wins the oracle turns into wins, and whether the better LRs lie on one side of (a)'s
  (a bias a change of the midpoint or the halving could correct) or on both.
Its result (01:25-02:34 UTC, all 60 fresh grids reproduced their cases; bench/RESULTS.md, "The ceiling"): over the
120 cases with a grid, (i) the oracle beats random search in 58 % (70 of 120; full and LoRA 75 %, textual inversion
25 %), so that line is out of reach for any LR choice; (ii) it is better than Prodigy's best in 61 % (73 of 120)
against (a)'s 48 %, so that line is within reach of a perfect LR; (iii) the 16 non-wins it turns into wins lie
on both sides of (a)'s LR (9 higher, 7 lower).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from bench.common import add_probe_arguments, by_method, case_key, part_spec, results_file, run_probe, table, write_json
from bench.discovery_quality import gap_pct
from bench.versus import (
    count_verdicts,
    plain_finetune,
    random_at_compute,
    rebuild_case,
    summarize,
    train_grid,
    verdict_of,
)

NAME = "ceiling"
GRID_SPANS = {"full": (1e-5, 1e-2), "lora": (1e-4, 1e-1), "textual_inversion": (1e-4, 1e-1)}
GRID_POINTS = 8
# random_equal: random search at exactly (a)'s updates, the Goal's reading of record since RESULTS.md's "Random search
# at exactly (a)'s compute"; random_best: every run whole, >= (a)'s compute.
AGAINST = ("prodigy_best", "random_best", "random_equal")
DEFAULT_SEEDS = (14, 15, 16, 17)
METHOD_ORDER = ("full", "lora", "textual_inversion")


def grid_case(c: dict[str, Any], work: Path, log=print, points: int = GRID_POINTS) -> dict[str, Any]:
    """The saved case rebuilt and its grid trained as bench.versus trains one; with the checks that it reproduces
    the saved case (the base model's loss on the same images, and the folk default's loss where an LR matches)."""
    lo, hi = GRID_SPANS[c["method"]]
    case, cfg, split_dir = rebuild_case(c, work)
    t0 = time.perf_counter()
    args = SimpleNamespace(grid_lr_min=lo, grid_lr_max=hi, grid_points=points)
    grid = train_grid(plain_finetune(cfg), split_dir, case, args, log, f"[{c['method']} {c['kind']} {c['seed']}]")
    row: dict[str, Any] = {k: c[k] for k in ("method", "kind", "seed", "held_out")}
    folk = c["folk"]
    same_lr = [g for g in grid["arms"] if math.isclose(g["lr"], folk["lr"], rel_tol=1e-9)]
    row.update(grid=grid, seconds=time.perf_counter() - t0,
               base_reproduces=math.isclose(grid["arms"][0]["baseline_val_loss"],
                                            c["summary"]["baseline_val_loss"], rel_tol=1e-6),
               folk_reproduces=(same_lr[0]["best_val_loss"] == folk["best_val_loss"]) if same_lr else None)
    log(f"[{c['method']} {c['kind']} {c['seed']}] grid of {points} in {row['seconds']:.0f} s; reproduces: base "
        f"{row['base_reproduces']}, folk {row['folk_reproduces']}")
    return row


def constant_lr_runs(c: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(LR, validation loss, which run) of every constant-LR run of a case with a grid: the grid's points, (a)'s
    delivered model, the folk default's best checkpoint and random search's draws (diverged runs keep what they
    measured before, as bench.versus scores them)."""
    s = c["summary"]
    runs = [(g["lr"], g["best_val_loss"], "grid") for g in c["grid"]["arms"] if g.get("best_val_loss") is not None]
    runs += [(r["lr"], r["best_val_loss"], "random") for r in c["random"]["runs"] if r.get("best_val_loss") is not None]
    if s.get("folk_best") is not None:
        runs.append((c["folk"]["lr"], s["folk_best"], "folk"))
    if s.get("rangefinder") is not None:
        runs.append((s["rangefinder_lr"], s["rangefinder"], "rangefinder"))
    return runs


def ceiling_row(c: dict[str, Any]) -> dict[str, Any]:
    """One case's oracle and its verdicts beside (a)'s."""
    s = c["summary"]
    if "random_equal" not in s:  # a summary saved before the exact reading: read it off the saved runs
        s = {**s, "random_equal": (random_at_compute(c["random"]["runs"], c["rangefinder"]["updates"]) or {}).get(
            "val_loss")}
    lr, loss, run = min(constant_lr_runs(c), key=lambda x: x[1])
    row: dict[str, Any] = {"case": s["case"], "method": c["method"], "seed": c["seed"],
                           "rangefinder": s["rangefinder"], "rangefinder_lr": s["rangefinder_lr"],
                           "oracle": loss, "oracle_lr": lr, "oracle_run": run, "grid_best": s["grid_best"]}
    for opp in AGAINST:
        row[opp] = s[opp]
        row[f"rangefinder_vs_{opp}"] = verdict_of(s["rangefinder"], s[opp])
        row[f"oracle_vs_{opp}"] = verdict_of(loss, s[opp])
    # Where the oracle wins and (a) does not: how far and which way its LR lies from (a)'s.
    a_lr = s.get("rangefinder_lr")
    row["oracle_lr_over_rangefinder"] = lr / a_lr if a_lr else None
    return row


def ceiling(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The readings over the cases with a grid: per method and together, (a)'s and the oracle's wins, ties and losses
    against Prodigy's best and random search's best, the shares, and where the oracle turns (a)'s non-wins into wins."""
    rows = [ceiling_row(c) for c in cases if c.get("grid") and c["grid"].get("arms")]
    out: dict[str, Any] = {"cases": len(rows), "rows": rows, "by": {}}
    for name, rs in by_method(rows, METHOD_ORDER).items():
        g: dict[str, Any] = {"cases": len(rs)}
        # How far (a) lands from the best constant-LR run of its case (0 where it is that run).
        gaps = [x for x in (gap_pct(r["rangefinder"], r["oracle"]) for r in rs) if x is not None]
        g["rangefinder_over_oracle_pct"] = {"median": statistics.median(gaps) if gaps else None,
                                            "max": max(gaps, default=None),
                                            "within_1pct": sum(x <= 1.0 for x in gaps)}
        # Which run was the best: (a) itself (its window average or pick beat every grid point), or which other.
        g["oracle_run"] = {k: sum(r["oracle_run"] == k for r in rs) for k in ("rangefinder", "grid", "folk", "random")}
        for who in ("rangefinder", "oracle"):
            for opp in AGAINST:
                v = [r[f"{who}_vs_{opp}"] for r in rs]
                g[f"{who}_vs_{opp}"] = count_verdicts(v)
                g[f"{who}_vs_{opp}_better_share"] = v.count("win") / len(rs)
        for opp in AGAINST:
            turned = [r for r in rs if r[f"rangefinder_vs_{opp}"] != "win" and r[f"oracle_vs_{opp}"] == "win"]
            ratios = [r["oracle_lr_over_rangefinder"] for r in turned if r["oracle_lr_over_rangefinder"]]
            g[f"turned_vs_{opp}"] = {"n": len(turned), "higher": sum(x > 1 for x in ratios),
                                     "lower": sum(x < 1 for x in ratios),
                                     "median_lr_ratio": statistics.median(ratios) if ratios else None}
        out["by"][name] = g
    a = out["by"].get("all")
    if a:
        out["readings"] = {
            "random_line_reachable": a["oracle_vs_random_best_better_share"] >= 0.70,
            "random_line_reachable_at_equal_compute": a["oracle_vs_random_equal_better_share"] >= 0.70,
            "prodigy_line_reachable": a["oracle_vs_prodigy_best_better_share"] > 0.50}
    return out


def with_grids(source: dict[str, Any], grids: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The source's cases, each given the grid a run of this bench trained for it where that run reproduced the
    saved case (the saved grids stay as they are), and summarized again as bench.versus summarizes a case with a grid
    (its best point, the gaps to it, the update share)."""
    got = {case_key(r): r for r in grids if r.get("base_reproduces") and r.get("folk_reproduces") is not False}
    out = []
    for c in source["cases"]:
        r = got.get(case_key(c))
        if r and not c.get("grid"):
            c = {**c, "grid": {**r["grid"], "trained_by": NAME}}
            c["summary"] = summarize(c)
        out.append(c)
    return out


def report(result: dict[str, Any]) -> str:
    lines = []
    cols = ["group", "cases"] + [f"{w} vs {o}" for w in ("rangefinder", "oracle") for o in AGAINST]
    rows = []
    for name, g in result["by"].items():
        row = {"group": name, "cases": g["cases"]}
        for w in ("rangefinder", "oracle"):
            for o in AGAINST:
                wtl = g[f"{w}_vs_{o}"]
                row[f"{w} vs {o}"] = (f"{wtl['win']} / {wtl['tie']} / {wtl['loss']} "
                                      f"({100 * g[f'{w}_vs_{o}_better_share']:.0f} %)")
        rows.append(row)
    lines.append(table(rows, cols, "Wins / ties / losses (better share): (a) and the pool oracle"))
    for name, g in result["by"].items():
        gap = g["rangefinder_over_oracle_pct"]
        if gap["median"] is not None:
            lines.append(f"{name}: (a) above the oracle by {gap['median']:.2f} % at the median, {gap['max']:.2f} % at "
                         f"most, within 1 % in {gap['within_1pct']} of {g['cases']}; the best run: "
                         + ", ".join(f"{k} {v}" for k, v in g["oracle_run"].items()))
    for name, g in result["by"].items():
        for o in AGAINST:
            t = g[f"turned_vs_{o}"]
            if t["n"]:
                lines.append(f"{name}: the oracle turns {t['n']} of (a)'s non-wins against {o} into wins; its LR "
                             f"higher in {t['higher']}, lower in {t['lower']} (median ratio "
                             f"{t['median_lr_ratio']:.2f})")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__.split("\n\n")[0])
    p.add_argument("--report", type=results_file, metavar="JSON",
                   help="read: a bench.versus result; with --grids, the grids this bench trained for its cases")
    p.add_argument("--grids", type=results_file, nargs="*", default=[], metavar="JSON")
    p.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)), help="train grids for these seeds' cases")
    p.add_argument("--methods", default=",".join(METHOD_ORDER))
    p.add_argument("--part", type=part_spec, default="1/1",
                   help="K/N: every Nth case from the Kth, to run N side by side")
    p.add_argument("--grid-points", type=int, default=GRID_POINTS)
    if argv is None:
        argv = sys.argv[1:]
    if "--report" in argv:
        p.add_argument("--out", type=Path)
        args = p.parse_args(argv)
        source = json.loads(args.report.read_text())
        grids = [r for f in args.grids for r in json.loads(f.read_text())["cases"]]
        result = {"benchmark": NAME, "source": str(args.report), "grids": [str(f) for f in args.grids],
                  **ceiling(with_grids(source, grids))}
        print(report(result))
        if args.out:
            write_json(args.out, result)
        return result
    add_probe_arguments(p)
    args = p.parse_args(argv)
    seeds = {int(x) for x in args.seeds.split(",") if x.strip()}
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    cases = [c for c in json.loads(args.source.read_text())["cases"]
             if c["seed"] in seeds and c["method"] in methods and not c.get("grid")]
    cases.sort(key=lambda c: methods.index(c["method"]))  # full and LoRA first: a run cut short has them
    k, n = args.part
    cases = cases[k - 1::n]

    def probe(c: dict[str, Any], work: Path, log=print) -> dict[str, Any]:
        return grid_case(c, work, log, args.grid_points)

    def tally(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"cases": len(rows), "base_reproduces": sum(bool(r.get("base_reproduces")) for r in rows),
                "folk_reproduces": sum(r.get("folk_reproduces") is True for r in rows),
                "folk_differs": sum(r.get("folk_reproduces") is False for r in rows)}

    return run_probe(NAME, args, cases, probe, tally)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
