"""A LoRA testbed where the best LR moves (issue 34): the readings of bench.versus cases run at several adapters.

On the standings' testbed one constant LR does almost as well as any estimator, so it cannot tell an LR finder
from a good constant. kohya's sd-scripts trains LoRA with alpha 1 (a scale of 1/rank) where diffusers' examples
and rangefinder set alpha = rank (scale 1): the same data then wants another LR. `bench.versus --lora-rank
--lora-alpha` runs the cases; this reads them, as written down in bench/RESULTS.md ("A LoRA testbed where the best
LR moves") before any of them ran:
- V1: (a)'s win / tie / loss against each arm, per adapter and over the cases away from scale 1;
- V2: whether each arm follows the scale: over the kind and seed pairs, the median ratio of its LR at each scale to
  its LR at scale 1 ((a)'s LR, Prodigy's d x lr at its best checkpoint, random search's best draw, the grid's best);
- V3: on the cases with a grid, the median gap to the grid's best of (a)'s delivered model and of the one grid LR
  with the lowest median gap over them (a constant picked in hindsight), over all and within each adapter;
- V4: on the same cases, the grid's loss at Prodigy's final d x lr and at (a)'s LR, read by linear interpolation in
  log LR between grid points (an LR outside the grid reads nothing), and which is closer to the grid's best.

Runs nothing: `python -m bench.lora_scale RESULT.json ... --out OUT.json`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from bench.common import case_lora, median_of, results_file, table, write_json
from bench.discovery_quality import gap_pct
from bench.versus import OPPONENTS, count_verdicts, summarize

NAME = "lora_scale"

LR_OF = {  # V2: each arm's LR, from a case's summary
    "rangefinder": "rangefinder_lr", "prodigy_d_lr": "prodigy_lr_effective_at_best", "random_best": "random_best_lr",
    "grid_best": "grid_best_lr"}


def shipped_lora() -> dict[str, Any]:
    """rangefinder's default adapter (config.LoraSettings): the one every case that recorded none trained."""
    from rangefinder.config import LoraSettings

    return LoraSettings().model_dump(include={"rank", "alpha"})


SHIPPED = case_lora({"lora": shipped_lora()})  # "r4 a4": the standings' cases


def adapter(c: dict[str, Any]) -> str:
    """The case's adapter as its name says it; the shipped one for a case that set none."""
    return case_lora(c) or SHIPPED


def scale(c: dict[str, Any]) -> float:
    """alpha / rank of the adapter the case trained."""
    lora = c.get("lora") or shipped_lora()
    return float(lora["alpha"]) / float(lora["rank"])


def grid_points(c: dict[str, Any]) -> list[tuple[float, float]]:
    """(LR, best validation loss) of the case's grid, by LR; none where it trained no grid."""
    arms = (c.get("grid") or {}).get("arms") or []
    return sorted((float(g["lr"]), float(g["best_val_loss"])) for g in arms if g.get("best_val_loss") is not None)


def loss_at(points: Sequence[tuple[float, float]], lr: Optional[float]) -> Optional[float]:
    """The grid's loss at `lr`, linear in log LR between the two points around it; None outside the grid. It
    overstates the loss between points equally for every LR: meant for comparing LRs, not as a loss."""
    if lr is None or len(points) < 2 or not points[0][0] <= lr <= points[-1][0]:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= lr <= x1:
            t = (math.log(lr) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
            return y0 + t * (y1 - y0)
    return None


def verdicts(cases: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    sums = [c["summary"] for c in cases]
    return {opp: count_verdicts([s.get(f"vs_{opp}") for s in sums]) for opp in OPPONENTS}


def ratios(cases: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """V2: per adapter away from scale 1, each arm's median LR ratio to its LR at scale 1 on the same kind and seed."""
    by_pair: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for c in cases:
        by_pair.setdefault((c["kind"], int(c["seed"])), {})[adapter(c)] = c["summary"]
    scales = adapter_scales(cases)
    out: dict[str, dict[str, Any]] = {}
    for name in (n for n in scales if n != SHIPPED):
        row: dict[str, Any] = {"adapter": name, "one_over_scale": 1 / scales[name]}
        for arm, key in LR_OF.items():
            rs = [pair[name][key] / pair[SHIPPED][key] for pair in by_pair.values()
                  if name in pair and SHIPPED in pair and pair[name].get(key) and pair[SHIPPED].get(key)]
            row[arm] = median_of(rs)
            row[f"{arm}_pairs"] = len(rs)
        out[name] = row
    return out


def adapter_scales(cases: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Each adapter the cases trained, by name, with its scale: the largest scale first."""
    scales = {adapter(c): scale(c) for c in cases}
    return dict(sorted(scales.items(), key=lambda kv: -kv[1]))


def constant_and_prior(cases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """V3 and V4 over the cases with a grid: (a)'s gap, the best constant's, and the interpolated gaps at (a)'s LR
    and at Prodigy's final d x lr."""
    graded = [c for c in cases if len(grid_points(c)) >= 2]
    if not graded:
        return {"cases": 0}
    lrs = [lr for lr, _ in grid_points(graded[0])]
    same = all([lr for lr, _ in grid_points(c)] == lrs for c in graded)
    out: dict[str, Any] = {"cases": len(graded), "same_grid": same,
                           "rangefinder_gap_pct": median_of([c["summary"].get("gap_rangefinder_pct") for c in graded])}
    if same:
        gaps = {lr: median_of([gap_pct(dict(grid_points(c))[lr], c["summary"]["grid_best"]) for c in graded])
                for lr in lrs}
        best = min(gaps, key=lambda lr: gaps[lr] if gaps[lr] is not None else math.inf)
        out.update(constant_lr=best, constant_gap_pct=gaps[best])
    rows = []
    for c in graded:
        points, s = grid_points(c), c["summary"]
        at_a = loss_at(points, s.get("rangefinder_lr"))
        at_d = loss_at(points, (c.get("prodigy") or {}).get("lr_effective_final"))
        rows.append({"gap_at_a_lr": gap_pct(at_a, s["grid_best"]), "gap_at_prodigy_d": gap_pct(at_d, s["grid_best"])})
    both = [r for r in rows if r["gap_at_a_lr"] is not None and r["gap_at_prodigy_d"] is not None]
    out.update(prior_cases=len(both),
               gap_at_a_lr_pct=median_of([r["gap_at_a_lr"] for r in both]),
               gap_at_prodigy_d_pct=median_of([r["gap_at_prodigy_d"] for r in both]),
               prodigy_d_closer=sum(1 for r in both if r["gap_at_prodigy_d"] < r["gap_at_a_lr"]),
               a_lr_closer=sum(1 for r in both if r["gap_at_a_lr"] < r["gap_at_prodigy_d"]))
    return out


def readings(cases: Sequence[dict[str, Any]]) -> dict[str, Any]:
    cases = [{**c, "summary": summarize(c)} for c in cases if c["method"] == "lora"]
    names = list(adapter_scales(cases))
    away = [c for c in cases if adapter(c) != SHIPPED]
    return {
        "cases": len(cases),
        "v1": {**{n: {"cases": sum(1 for c in cases if adapter(c) == n),
                      **verdicts([c for c in cases if adapter(c) == n])} for n in names},
               "away_from_scale_1": {"cases": len(away), **verdicts(away)}},
        "v2": ratios(cases),
        "v3_v4": {"all": constant_and_prior(cases),
                  **{n: constant_and_prior([c for c in cases if adapter(c) == n]) for n in names}},
    }


def report(r: dict[str, Any]) -> str:
    def wtl(v: dict[str, int]) -> str:
        return f"{v['win']} / {v['tie']} / {v['loss']}"

    v1 = [{"adapter": n, "cases": v["cases"], **{opp: wtl(v[opp]) for opp in OPPONENTS}} for n, v in r["v1"].items()]
    out = [table(v1, ["adapter", "cases", *OPPONENTS], title="V1: (a) win / tie / loss against each arm")]
    v2 = list(r["v2"].values())
    out.append(table(v2, ["adapter", "one_over_scale", *LR_OF], title="V2: median LR ratio to scale 1 (1/scale: what a "
                                                           "finder that follows the scale would read)"))
    v34 = [{"adapter": n, **v} for n, v in r["v3_v4"].items()]
    out.append(table(v34, ["adapter", "cases", "rangefinder_gap_pct", "constant_lr", "constant_gap_pct",
                           "prior_cases", "gap_at_a_lr_pct", "gap_at_prodigy_d_pct", "a_lr_closer",
                           "prodigy_d_closer"], title="V3, V4: gaps to the grid's best (%), median"))
    return "\n\n".join(out)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.lora_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=results_file, nargs="+", help="bench.versus result JSONs")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    cases = [c for path in args.results for c in json.loads(path.read_text())["cases"]]
    result = {"benchmark": NAME, "from": [str(x) for x in args.results], **readings(cases)}
    print(report(result))
    if args.out:
        write_json(args.out, result)
        print(f"\nwritten: {args.out}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
