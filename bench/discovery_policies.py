"""Score discovery policies against the grid from saved `bench.discovery_quality` results, with no training.

`python -m bench.discovery_policies --base P0.json [P0.json ...] --variant P1.json [P1.json ...]` reads the cases of
one or more runs with a grid (`--base`: today's discovery, its grid and its `lr_high` arm) and of runs of a range
test variant that reused that grid (`--variant`, with the `lr_high` arm and whole curves, which the bench records
since 2026-11-25), and prints, per case and per kind, the gap to the grid's best (%) and the share of the grid's
updates of each policy:

- `P0`: the base run's discovery (its fine-tune at `lr_mid`);
- `P1`: the variant's discovery;
- `P2`: P1, and when its fine-tune ends still improving, a second constant-LR fine-tune at P1's `lr_high` (its
  diagnostic arm); the better of the two;
- `P3`: successive halving between P1's `lr_mid` and `lr_high` (Jamieson & Talwalkar 2016, arXiv:1502.07943): both
  fine-tunes run half the budget, the one with the lower best validation loss so far runs on to the full budget
  (a constant-LR run continued is the same run), a tie keeps `lr_mid`; its quality is that run's best;
- `geometric`, `arithmetic`: the other midpoint rules between P1's bounds (the variant's midpoint arms).

P2 and P3 are scored from runs the bench trained (the variant's fine-tune and `lr_high` arm), not trained again.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Optional

from bench.common import results_file, table
from bench.discovery_quality import gap_pct

NAME = "discovery_policies"
POLICIES = ("P0", "P1", "P2", "P3", "geometric", "arithmetic")


def load_cases(paths: list[Path]) -> dict[tuple[str, int], dict[str, Any]]:
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for p in paths:
        for c in json.loads(Path(p).read_text())["cases"]:
            out[(c["kind"], int(c["seed"]))] = c
    return out


def best_by(curve: list[list[float]], update: int) -> float:
    """The lowest validation loss an arm had reached by `update` (its curve after update 0)."""
    seen = [loss for u, loss in curve if u <= update]
    if not seen:
        raise ValueError(f"no validation at or before update {update}")
    return min(seen)


def score_case(base: dict[str, Any], variant: Optional[dict[str, Any]]) -> dict[str, Any]:
    """One case's gap (%) and updates per policy; policies the runs cannot score are absent."""
    grid = base["grid"]
    grid_updates = sum(int(a["updates"]) for a in grid)
    best_arm = min(grid, key=lambda a: a["best_val_loss"])
    best = float(best_arm["best_val_loss"])
    d0 = base["discovery"]
    row: dict[str, Any] = {"kind": base["kind"], "seed": int(base["seed"]), "held_out": bool(base.get("held_out")),
                           "grid_best_lr": best_arm["lr"], "grid_updates": grid_updates,
                           "P0": {"lr": d0.get("lr_mid"), "gap": gap_pct(d0.get("best_val_loss"), best),
                                  "updates": d0.get("updates")}}
    if variant is None or variant["discovery"].get("status") != "ok":
        return row
    d1 = variant["discovery"]
    high = variant.get("diagnostic_lr_high") or {}
    row["P1"] = {"lr": d1["lr_mid"], "gap": gap_pct(d1["best_val_loss"], best), "updates": d1["updates"],
                 "bounds": (d1["lr_low"], d1["lr_high"]), "still_improving": bool(d1["still_improving"])}
    budget = int(d1["finetune_updates"])
    if high.get("best_val_loss") is not None:
        retry = bool(d1["still_improving"])
        loss = min(d1["best_val_loss"], high["best_val_loss"]) if retry else d1["best_val_loss"]
        row["P2"] = {"lr": d1["lr_high"] if retry and high["best_val_loss"] < d1["best_val_loss"] else d1["lr_mid"],
                     "gap": gap_pct(loss, best), "updates": d1["updates"] + (budget if retry else 0)}
        if high.get("curve") and d1.get("curve"):
            half = budget // 2
            pick_high = best_by(high["curve"], half) < best_by(d1["curve"], half)
            loss = high["best_val_loss"] if pick_high else d1["best_val_loss"]
            row["P3"] = {"lr": d1["lr_high"] if pick_high else d1["lr_mid"], "picked": "lr_high" if pick_high
                         else "lr_mid", "gap": gap_pct(loss, best), "updates": d1["updates"] + half}
    for rule, arm in (variant.get("midpoint_arms") or {}).items():
        if rule in POLICIES and arm.get("best_val_loss") is not None:
            row[rule] = {"lr": arm["lr"], "gap": gap_pct(arm["best_val_loss"], best),
                         "updates": d1["updates"] - budget + int(arm["updates"])}
    return row


def summarise(rows: list[dict[str, Any]], target_pct: float) -> list[dict[str, Any]]:
    """Per policy: within target / cases, median and worst gap, over all cases, the held-out ones, and per kind;
    and the median and largest share of the grid's updates."""
    kinds = sorted({r["kind"] for r in rows}, key=lambda k: (any(r["held_out"] for r in rows if r["kind"] == k), k))
    out = []
    for policy in POLICIES:
        scored = [r for r in rows if r.get(policy, {}).get("gap") is not None]
        if not scored:
            continue

        def count(rs: list[dict[str, Any]], p: str = policy) -> str:
            return f"{sum(r[p]['gap'] <= target_pct for r in rs)}/{len(rs)}" if rs else "-"

        shares = [r[policy]["updates"] / r["grid_updates"] for r in scored]
        line: dict[str, Any] = {"policy": policy}
        for k in kinds:
            line[k] = count([r for r in scored if r["kind"] == k])
        line.update({
            "all": count(scored), "held out": count([r for r in scored if r["held_out"]]),
            "median gap %": round(statistics.median(r[policy]["gap"] for r in scored), 2),
            "worst gap %": round(max(r[policy]["gap"] for r in scored), 2),
            "updates: median share": round(statistics.median(shares), 3), "largest share": round(max(shares), 3),
        })
        out.append(line)
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.discovery_policies", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=results_file, nargs="+", required=True,
                   help="discovery_quality results with the grid")
    p.add_argument("--variant", type=Path, nargs="*", default=[], help="results of a variant that reused that grid")
    p.add_argument("--target-pct", type=float, default=3.0)
    p.add_argument("--out", type=Path, help="write the rows and the summary as JSON here too")
    args = p.parse_args(argv)
    base, variant = load_cases(args.base), load_cases(args.variant)
    missing = sorted(set(variant) - set(base))
    if missing:
        p.error(f"the variant has cases the base runs lack (no grid to compare with): {missing}")
    rows = [score_case(base[k], variant.get(k)) for k in sorted(base, key=lambda k: (k[1], k[0]))]
    summary = summarise(rows, args.target_pct)
    per_case = [{"data": r["kind"] + (" (held out)" if r["held_out"] else ""), "seed": r["seed"],
                 "grid best lr": f"{r['grid_best_lr']:.3g}",
                 **{f"{pol} gap %": (round(r[pol]["gap"], 2) if pol in r else "-") for pol in POLICIES},
                 "P3 picks": r.get("P3", {}).get("picked", "-")} for r in rows]
    print(table(per_case, list(per_case[0])))
    print()
    print(table(summary, list(summary[0])) if summary else "no policy could be scored")
    result = {"benchmark": NAME, "target_pct": args.target_pct, "base": [str(x) for x in args.base],
              "variant": [str(x) for x in args.variant], "rows": rows, "summary": summary}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
