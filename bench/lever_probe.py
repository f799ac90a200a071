"""Which setting moves the best LR on the tiny model? Grids only, a few cases (issue 34; exploratory).

A prior for the range test (Prodigy's d x lr, bench/RESULTS.md) can only be told from a good constant on cases
whose best LR differs. kohya's LoRA alpha 1 hardly moved it ("A LoRA testbed where the best LR moves"). Before a
testbed is built on another lever, this checks on a grid which levers move the valley floor at all: each case
(method x kind, one seed) trains the same log-spaced constant-LR grid with the case's settings as shipped and with
each lever, as every bench.versus arm but (a) trains (bench.versus.plain_finetune), and reports each grid's best LR
and its ratio to the shipped one. The levers:
- `batch16`: training.batch_size 16 (the whole 16-image training split in one update; 4x fewer updates);
- `images40`: 40 images instead of 20 (twice the updates per epoch, and 8 validation images instead of 4);
- `vectors4`: textual inversion only, 4 vectors for the concept instead of 1 (`textual_inversion.num_vectors`).

Each grid also says how much the LR matters near its best (`near_pct`: the cheaper of the two neighbouring LRs, half a
decade off, in % above the best; `decade_pct`: the worst point within a decade of it). Textual inversion's arms tie
within the 1 % band ("What a cheaper (a) would buy against random search"): a testbed where its LR can be won needs
a lever that lifts `near_pct` above the band, and none of these does ("What the LR is worth in textual inversion").

    python -m bench.lever_probe --methods lora,full --kinds shapes,subject --seed 30 --out bench/results/levers.json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from bench.common import machine_info, part_spec, quiet_libraries, rows_file, table, torch_threads, write_json

NAME = "lever_probe"
LEVERS: dict[str, tuple[dict[str, dict[str, Any]], Optional[int]]] = {  # name: (config overrides, images)
    "shipped": ({}, None),
    "batch16": ({"training": {"batch_size": 16}}, None),
    "images40": ({}, 40),
    "vectors4": ({"training": {"textual_inversion": {"num_vectors": 4}}}, None),
}
LEVER_METHODS = {"vectors4": ("textual_inversion",)}  # a lever that only one method has; the others, every method
GRIDS = {"lora": (1e-4, 1.0), "full": (1e-5, 1e-1), "textual_inversion": (1e-4, 1.0)}  # 9 points: half a decade
IMAGES = 20


def lever_case(method: str, kind: str, seed: int, lever: str, work: Path):
    """The case with `lever` on, set up under `work` as bench.versus sets one up: (case folder, config, split)."""
    from bench.discovery_quality import set_up_case
    from bench.versus import case_overrides
    from rangefinder.data.synthetic import make_synthetic_dataset

    extra, images = LEVERS[lever]
    case = work / f"{method}-{kind}-seed{seed}-{lever}"
    make_synthetic_dataset(case / "dataset", kind=kind, count=images or IMAGES, seed=seed, resolution=32)
    overrides = case_overrides(method, SimpleNamespace(finetune_epochs=40, smoke=False))
    for section, values in extra.items():
        overrides[section] = {**overrides.get(section, {}), **values}
    cfg, split_dir = set_up_case(case / "dataset", seed, work, case, overrides)
    return case, cfg, split_dir


def one_grid(method: str, kind: str, seed: int, lever: str, points: int, work: Path, log=print) -> dict[str, Any]:
    """The case's grid with `lever` on: each point's LR, best validation loss and updates; the best LR."""
    from bench.versus import plain_finetune, train_grid

    case, cfg, split_dir = lever_case(method, kind, seed, lever, work)
    lo, hi = GRIDS[method]
    t0 = time.perf_counter()
    spec = SimpleNamespace(grid_lr_min=lo, grid_lr_max=hi, grid_points=points)
    grid = train_grid(plain_finetune(cfg), split_dir, case, spec, log, f"[{method} {kind} {seed} {lever}]")
    shutil.rmtree(case, ignore_errors=True)
    arms = [{"lr": g["lr"], "best_val_loss": g.get("best_val_loss"), "updates": g.get("updates")}
            for g in grid["arms"]]
    scored = [g for g in arms if g["best_val_loss"] is not None]
    best = min(scored, key=lambda g: g["best_val_loss"]) if scored else None
    return {"method": method, "kind": kind, "seed": seed, "lever": lever, "images": LEVERS[lever][1] or IMAGES,
            "batch_size": cfg.training.batch_size, "num_vectors": cfg.training.textual_inversion.num_vectors,
            "arms": arms, "best_lr": best and best["lr"], "best_val_loss": best and best["best_val_loss"],
            **sensitivity(arms), "seconds": time.perf_counter() - t0}


def sensitivity(arms: list[dict[str, Any]]) -> dict[str, Optional[float]]:
    """How much the LR matters near a grid's best, in % above the best's loss: `near_pct`, the cheaper of its two
    neighbours (one point off; a point that failed or lies off the grid does not count); `decade_pct`, the worst of
    the points within two of it (a decade, at the probe's half-decade spacing), a failed one counting as infinite."""
    losses = [a["best_val_loss"] for a in arms]
    if not any(x is not None for x in losses):
        return {"near_pct": None, "decade_pct": None}
    i = min((j for j, x in enumerate(losses) if x is not None), key=lambda j: losses[j])
    pct = [math.inf if x is None else 100 * (x / losses[i] - 1) for x in losses]
    near = [pct[j] for j in (i - 1, i + 1) if 0 <= j < len(pct) and math.isfinite(pct[j])]
    around = [pct[j] for j in range(max(0, i - 2), min(len(pct), i + 3)) if j != i]
    return {"near_pct": min(near) if near else None, "decade_pct": max(around) if around else None}


def readings(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method and lever: over the kinds, the grid's best LR over the shipped grid's (median, and each)."""
    shipped = {(r["method"], r["kind"]): r["best_lr"] for r in rows if r["lever"] == "shipped"}
    out = []
    for method in dict.fromkeys(r["method"] for r in rows):
        for lever in (x for x in LEVERS if x != "shipped"):
            ratios = [r["best_lr"] / shipped[(method, r["kind"])] for r in rows
                      if r["method"] == method and r["lever"] == lever and r["best_lr"]
                      and shipped.get((method, r["kind"]))]
            if ratios:
                out.append({"method": method, "lever": lever, "cases": len(ratios),
                            "median_ratio": statistics.median(ratios),
                            "ratios": " ".join(f"{x:.3g}" for x in ratios),
                            "moved": sum(1 for x in ratios if not math.isclose(x, 1.0, rel_tol=1e-6))})
    return out


def lr_stakes(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method and lever (the shipped case included): over the kinds, how much a half-decade miss of the best LR
    costs (`near_pct`, median and each) and how many grids put it above the 1 % tie band."""
    out = []
    for method in dict.fromkeys(r["method"] for r in rows):
        for lever in LEVERS:
            near = [r["near_pct"] for r in rows
                    if r["method"] == method and r["lever"] == lever and r.get("near_pct") is not None]
            if near:
                out.append({"method": method, "lever": lever, "cases": len(near),
                            "median_near_pct": statistics.median(near), "near_pct": " ".join(f"{x:.3g}" for x in near),
                            "above_band": sum(1 for x in near if x > 1.0)})
    return out


def planned(methods: list[str], kinds: list[str], levers: list[str],
            part: tuple[int, int] = (1, 1)) -> list[tuple[str, str, str]]:
    """The grids to train, (method, kind, lever), each lever with the methods it applies to; the K-th of N shares."""
    k, n = part
    return [(m, kind, lever) for m in methods for kind in kinds for lever in levers
            if m in LEVER_METHODS.get(lever, (m,))][k - 1::n]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.lever_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="lora,full")
    p.add_argument("--kinds", default="shapes,subject")
    p.add_argument("--seed", type=int, default=30)
    p.add_argument("--levers", default=",".join(LEVERS))
    p.add_argument("--points", type=int, default=9)
    p.add_argument("--part", type=part_spec, default="1/1", help="K/N: the K-th of N interleaved shares of the grids")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--report", type=rows_file, nargs="+", metavar="JSON", help="run nothing: merge these results")
    args = p.parse_args(argv)
    if args.report:
        # Rows saved before the probe measured what the LR costs near its best get it from their own grids.
        rows = [{**sensitivity(r["arms"]), **r} for path in args.report for r in json.loads(path.read_text())["rows"]]
        result: dict[str, Any] = {"benchmark": NAME, "merged_from": [str(x) for x in args.report], "rows": rows}
    else:
        levers = [x for x in args.levers.split(",") if x]
        bad = [x for x in levers if x not in LEVERS]
        if bad:
            p.error(f"unknown lever {', '.join(bad)}; levers: {', '.join(LEVERS)}")
        plan = planned(args.methods.split(","), args.kinds.split(","), levers, args.part)
        quiet_libraries()
        result = {"benchmark": NAME, "machine": machine_info(), "command": " ".join(sys.argv), "rows": []}
        work = Path(tempfile.mkdtemp(prefix="bench-levers-"))
        log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        try:
            with torch_threads(args.threads or None):
                for method, kind, lever in plan:
                    result["rows"].append(one_grid(method, kind, args.seed, lever, args.points, work, log))
                    write_json(args.out, result)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result["readings"] = readings(result["rows"])
    result["lr_stakes"] = lr_stakes(result["rows"])
    print(table(result["rows"], ["method", "kind", "lever", "images", "batch_size", "best_lr", "best_val_loss",
                                 "near_pct", "decade_pct"], title="Each grid's best constant LR"))
    print()
    print(table(result["readings"], ["method", "lever", "cases", "median_ratio", "ratios", "moved"],
                title="The best LR with each lever over the shipped grid's"))
    print()
    print(table(result["lr_stakes"], ["method", "lever", "cases", "median_near_pct", "near_pct", "above_band"],
                title="What missing the best LR by half a decade costs, in % (the tie band is 1 %)"))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
