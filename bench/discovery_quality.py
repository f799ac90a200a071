"""Discovery quality: how close one rangefinder discovery gets to the best of a grid sweep, at what share of its cost.

`python -m bench.discovery_quality` runs, for each dataset kind and seed, on the embedded tiny model:

(a) rangefinder's discovery, through the pipeline's own step functions in the pipeline's order: the LR range test
    (`run_lr_range_test`, plus the zoom re-test when it asks for one), `run_choose_lr`, and the constant fine-tune
    at the midpoint (`run_finetune`), which also gives the recommended epochs;
(b) a grid of constant LRs, log-spaced over three decades, each trained exactly as the fine-tune step trains
    (`run_finetune` at that fixed LR, the same epochs, the same validation);
(c) the classic LR-finder suggestions of the same first range test (fastai's steepest slope, and the LR at the loss
    minimum / 10; Smith 2017, arXiv:1506.01186, and fastai's `lr_find`), each trained the same way.

Each arm's quality is its best validation loss after training began (the minimum over its validation measurements,
update 0 left out; the same fixed validation noise for all, so differences are the weights', not the noise's), and
its cost the optimizer updates and wall seconds it spent, range tests included. The answer: discovery's gap to the
grid's best (%), at what fraction of the grid's updates. Steps log to a throw-away MLflow store in the work folder.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import default_out, machine_info, quiet_libraries, smoke_out, table, torch_threads, write_json

NAME = "discovery_quality"


def arm_config(base_cfg, **update):
    return base_cfg.model_copy(update=update)


def curve_stats(curve_csv: Path, recommended_updates: Optional[int] = None) -> dict[str, Any]:
    """Baseline, best (after update 0) and, when given, the loss at the recommended number of updates."""
    from rangefinder.analysis import read_curve_csv

    c = read_curve_csv(curve_csv)
    u, v = c["update"], c["val_loss"]
    baseline = next((float(y) for x, y in zip(u, v, strict=True) if x == 0 and math.isfinite(y)), None)
    trained = [(float(y), int(x)) for x, y in zip(u, v, strict=True) if x > 0 and math.isfinite(y)]
    best, best_update = min(trained) if trained else (None, None)
    out = {"baseline_val_loss": baseline, "best_val_loss": best, "best_update": best_update,
           "final_val_loss": trained[-1][0] if trained else None}
    if recommended_updates is not None and trained:
        # The measurement nearest the recommended length: what stopping (or retraining) there gives.
        out["val_loss_at_recommended"] = min(trained, key=lambda t: (abs(t[1] - recommended_updates), t[1]))[0]
    return out


def _updates_of(run_dir: Path) -> int:
    return int(json.loads((run_dir / "run_summary.json").read_text())["updates"])


def train_fixed_lr(cfg, split_dir: Path, lr: float, out: Path) -> dict[str, Any]:
    """One constant-LR run exactly as the fine-tune step runs it (the grid's and the classic suggestions' arm)."""
    from rangefinder.steps.finetune import run_finetune

    t0 = time.perf_counter()
    ft = run_finetune(cfg, split_dir=split_dir, lr_low=lr, lr_high=lr, lr_mid=lr, lr_source="fixed", model_dir=out)
    seconds = time.perf_counter() - t0
    stats = curve_stats(ft.curve_csv)
    updates = _updates_of(out)
    shutil.rmtree(out / "final", ignore_errors=True)  # the weights are not needed; keep the curve
    return {"lr": lr, "updates": updates, "seconds": seconds, **stats}


def discover(cfg, split_dir: Path, out: Path) -> dict[str, Any]:
    """The pipeline's discovery: range test (-> zoom) -> choose LR -> constant fine-tune at the midpoint."""
    from rangefinder.errors import RangefinderError
    from rangefinder.steps.choose_lr import run_choose_lr
    from rangefinder.steps.finetune import run_finetune
    from rangefinder.steps.lr_range_test import run_lr_range_test

    res: dict[str, Any] = {"updates": 0, "seconds": 0.0, "range_tests": []}
    t0 = time.perf_counter()
    try:
        tests = [run_lr_range_test(cfg, split_dir=split_dir, out_dir=out / "range-test", stage="first")]
        if tests[0].needs_zoom:
            tests.append(run_lr_range_test(cfg, split_dir=split_dir, out_dir=out / "range-test-zoom", stage="zoom",
                                           lr_min=tests[0].zoom_lr_min, lr_max=tests[0].zoom_lr_max))
    except RangefinderError as e:
        # No usable bounds even after the zoom: the pipeline stops here. Its cost so far still counts, and the
        # first test's classic suggestions (written before the step gave up) are still worth training.
        res.update(status="failed", error=str(e), seconds=time.perf_counter() - t0)
        tests = []
    for name in ("range-test", "range-test-zoom"):
        bounds_json = out / name / "bounds.json"
        if bounds_json.exists():
            decision = json.loads(bounds_json.read_text())
            res["range_tests"].append({k: decision.get(k) for k in (
                "stage", "lr_min", "lr_max", "status", "lr_low", "lr_mid", "lr_high", "flags", "quality",
                "points_between", "updates", "lr_steepest", "lr_min_div10", "lr_at_min")})
            res["updates"] += int(decision["updates"])
        elif (out / name / "run" / "run_summary.json").exists():
            res["updates"] += _updates_of(out / name / "run")
    if not tests:
        return res
    used = tests[-1]
    chosen = run_choose_lr(cfg, source="zoom" if used.stage == "zoom" else "range-test", lr_low=used.lr_low,
                           lr_high=used.lr_high, lr_mid=used.lr_mid)
    ft = run_finetune(cfg, split_dir=split_dir, lr_low=chosen.lr_low, lr_high=chosen.lr_high, lr_mid=chosen.lr_mid,
                      lr_source=chosen.source, model_dir=out / "finetune")
    res["seconds"] = time.perf_counter() - t0
    ft_updates = _updates_of(out / "finetune")
    res["updates"] += ft_updates
    shutil.rmtree(out / "finetune" / "final", ignore_errors=True)
    res.update(
        status="ok", lr_source=chosen.source, lr_low=chosen.lr_low, lr_mid=chosen.lr_mid, lr_high=chosen.lr_high,
        finetune_updates=ft_updates, recommended_epochs=ft.recommended_epochs,
        recommended_updates=ft.recommended_updates, still_improving=ft.still_improving,
        **curve_stats(ft.curve_csv, ft.recommended_updates),
    )
    return res


def _open_store(cfg) -> None:
    """Create the MLflow store's tables now, so that the one-time migration is not timed as the first step's."""
    from rangefinder.tracking import runs

    runs.tracking_client(cfg).search_experiments(max_results=1)


def gap_pct(loss: Optional[float], best: Optional[float]) -> Optional[float]:
    if loss is None or best is None or best == 0:
        return None
    return 100.0 * (loss - best) / best


def one_case(kind: str, seed: int, args, work: Path, log=print) -> dict[str, Any]:
    """Discovery, grid and classic suggestions on one dataset (kind, seed) with one training seed."""
    from rangefinder.config import demo_config
    from rangefinder.data.synthetic import make_synthetic_dataset
    from rangefinder.models.tiny import ensure_tiny_base_model
    from rangefinder.steps.prepare_dataset import run_prepare_dataset

    case = work / f"{kind}-seed{seed}"
    dataset = case / "dataset"
    make_synthetic_dataset(dataset, kind=kind, count=args.images, seed=seed, resolution=32)
    overrides: dict[str, Any] = {
        "data": {"dataset_dir": str(dataset)},
        "model": {"base_model": str(ensure_tiny_base_model())},
        "training": {"seed": seed, "cache_dir": str(work / "cache")},
        "tracking": {"tracking_uri": f"sqlite:///{(work / 'mlflow.db').resolve()}", "registered_model_name": None},
    }
    if args.range_test_epochs:
        overrides["lr_range_test"] = {"epochs": args.range_test_epochs}
    if args.range_test_every_updates:
        overrides.setdefault("lr_range_test", {})["validate_every_updates"] = args.range_test_every_updates
    if args.finetune_epochs:
        overrides["finetune"] = {"epochs": args.finetune_epochs}
    cfg = demo_config(**overrides)
    split_dir = case / "split"
    run_prepare_dataset(cfg, out_dir=split_dir)

    _open_store(cfg)
    out: dict[str, Any] = {"kind": kind, "seed": seed, "images": args.images,
                           "finetune_epochs": cfg.finetune.epochs, "range_test_epochs": cfg.lr_range_test.epochs}
    log(f"[{kind} seed {seed}] discovery")
    out["discovery"] = discover(cfg, split_dir, case / "discovery")
    d = out["discovery"]
    log(f"[{kind} seed {seed}]   {d['status']}: lr_mid {d.get('lr_mid')}, best {d.get('best_val_loss')}, "
        f"{d['updates']} updates, {d['seconds']:.1f} s")

    grid_lrs = [args.grid_lr_min * (args.grid_lr_max / args.grid_lr_min) ** (i / (args.grid_points - 1))
                for i in range(args.grid_points)] if args.grid_points > 1 else [args.grid_lr_min]
    out["grid"] = []
    for i, lr in enumerate(grid_lrs):
        row = train_fixed_lr(cfg, split_dir, lr, case / f"grid-{i}")
        log(f"[{kind} seed {seed}]   grid lr {lr:.3g}: best {row['best_val_loss']}, {row['seconds']:.1f} s")
        out["grid"].append(row)

    first = d["range_tests"][0] if d.get("range_tests") else {}
    out["classic"] = {}
    for name in ("lr_steepest", "lr_min_div10"):
        lr = first.get(name)
        if lr is None or not (lr > 0 and math.isfinite(lr)):
            out["classic"][name] = {"lr": None, "note": "the first range test gave no such suggestion"}
            continue
        row = train_fixed_lr(cfg, split_dir, float(lr), case / f"classic-{name}")
        row["updates_with_range_test"] = row["updates"] + int(first.get("updates") or 0)
        log(f"[{kind} seed {seed}]   {name} {lr:.3g}: best {row['best_val_loss']}")
        out["classic"][name] = row
    if args.diagnose_lr_high and d.get("lr_high"):
        # Not one of the compared methods: where the discovery's own upper bound would have landed, to tell a
        # misplaced midpoint from misplaced bounds.
        row = train_fixed_lr(cfg, split_dir, float(d["lr_high"]), case / "diagnostic-lr_high")
        log(f"[{kind} seed {seed}]   diagnostic lr_high {d['lr_high']:.3g}: best {row['best_val_loss']}")
        out["diagnostic_lr_high"] = row
    out["summary"] = summarize_case(out)
    if not args.keep:
        for p in case.iterdir():
            if p.name != "discovery":
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else None
    return out


def summarize_case(case: dict[str, Any]) -> dict[str, Any]:
    grid = [g for g in case["grid"] if g.get("best_val_loss") is not None]
    best = min(grid, key=lambda g: g["best_val_loss"]) if grid else None
    grid_updates = sum(g["updates"] for g in case["grid"])
    grid_seconds = sum(g["seconds"] for g in case["grid"])
    d = case["discovery"]
    s: dict[str, Any] = {
        "kind": case["kind"], "seed": case["seed"],
        "baseline_val_loss": best["baseline_val_loss"] if best else None,
        "grid_best_lr": best["lr"] if best else None,
        "grid_best_val_loss": best["best_val_loss"] if best else None,
        "grid_best_at_edge": bool(best) and best["lr"] in (case["grid"][0]["lr"], case["grid"][-1]["lr"]),
        "grid_updates": grid_updates, "grid_seconds": grid_seconds,
        "discovery_status": d["status"], "discovery_lr_source": d.get("lr_source"),
        "discovery_lr_mid": d.get("lr_mid"),
        "discovery_best_val_loss": d.get("best_val_loss"),
        "discovery_val_at_recommended": d.get("val_loss_at_recommended"),
        "recommended_epochs": d.get("recommended_epochs"),
        "discovery_updates": d["updates"], "discovery_seconds": d["seconds"],
    }
    s["discovery_still_improving"] = d.get("still_improving")
    if s["discovery_lr_mid"] and s["grid_best_lr"]:
        # How far the discovered LR is from the grid's best, in decades (negative: below it).
        s["discovery_lr_decades_from_grid_best"] = math.log10(s["discovery_lr_mid"] / s["grid_best_lr"])
    s["discovery_gap_pct"] = gap_pct(s["discovery_best_val_loss"], s["grid_best_val_loss"])
    s["discovery_gap_at_recommended_pct"] = gap_pct(s["discovery_val_at_recommended"], s["grid_best_val_loss"])
    s["cost_fraction_updates"] = d["updates"] / grid_updates if grid_updates else None
    s["cost_fraction_seconds"] = d["seconds"] / grid_seconds if grid_seconds else None
    base, gb, db = s["baseline_val_loss"], s["grid_best_val_loss"], s["discovery_best_val_loss"]
    if None not in (base, gb, db) and base - gb > 0:
        s["share_of_grid_improvement"] = (base - db) / (base - gb)
    diag = case.get("diagnostic_lr_high")
    if diag:
        s["diagnostic_lr_high"] = diag["lr"]
        s["diagnostic_lr_high_gap_pct"] = gap_pct(diag.get("best_val_loss"), s["grid_best_val_loss"])
    for name, row in case["classic"].items():
        s[f"{name}"] = row.get("lr")
        s[f"{name}_best_val_loss"] = row.get("best_val_loss")
        s[f"{name}_gap_pct"] = gap_pct(row.get("best_val_loss"), s["grid_best_val_loss"])
        s[f"{name}_updates"] = row.get("updates_with_range_test")
    return s


def aggregate(summaries: list[dict[str, Any]], within_pct: float) -> dict[str, Any]:
    """Over all cases: median and worst gap, share within the target, median cost fraction."""
    def stats(values: list[Optional[float]]) -> dict[str, Any]:
        vals = [v for v in values if v is not None]
        return {"n": len(vals), "median": statistics.median(vals) if vals else None,
                "max": max(vals) if vals else None, "min": min(vals) if vals else None}

    out: dict[str, Any] = {"cases": len(summaries),
                           "discovery_ok": sum(s["discovery_status"] == "ok" for s in summaries)}
    for key in ("discovery_gap_pct", "discovery_gap_at_recommended_pct", "diagnostic_lr_high_gap_pct",
                "discovery_lr_decades_from_grid_best", "lr_steepest_gap_pct",
                "lr_min_div10_gap_pct", "cost_fraction_updates", "cost_fraction_seconds",
                "share_of_grid_improvement"):
        out[key] = stats([s.get(key) for s in summaries])
    gaps = [s.get("discovery_gap_pct") for s in summaries]
    out[f"discovery_within_{within_pct:g}pct"] = sum(g is not None and g <= within_pct for g in gaps)
    for name in ("lr_steepest", "lr_min_div10"):
        g = [s.get(f"{name}_gap_pct") for s in summaries]
        out[f"{name}_within_{within_pct:g}pct"] = sum(x is not None and x <= within_pct for x in g)
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.discovery_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="shapes,stripes", help="synthetic dataset kinds (rangefinder.data.synthetic)")
    p.add_argument("--seeds", default="0,1,2", help="dataset and training seeds; shapes seed 0 is the embedded default")
    p.add_argument("--images", type=int, default=20, help="images per dataset (20: the embedded default)")
    p.add_argument("--grid-points", type=int, default=8)
    p.add_argument("--grid-lr-min", type=float, default=1e-5)
    p.add_argument("--grid-lr-max", type=float, default=1e-2)
    p.add_argument("--range-test-epochs", type=int, help="default: the demo config's")
    p.add_argument("--range-test-every-updates", type=int, help="validation interval of the range test "
                   "(default: the demo config's)")
    p.add_argument("--finetune-epochs", type=int, help="the epochs budget of every arm (default: the demo config's)")
    p.add_argument("--no-diagnose-lr-high", dest="diagnose_lr_high", action="store_false",
                   help="skip the diagnostic run at the discovery's own lr_high")
    p.add_argument("--target-pct", type=float, default=2.0, help="the 'within x%% of the grid's best' target")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's choice)")
    p.add_argument("--keep", action="store_true", help="keep every run's folder (with --work-dir)")
    p.add_argument("--smoke", action="store_true", help="one tiny case, 2 grid points, 2-epoch runs (CI)")
    p.add_argument("--out", type=Path, help="JSON output (default bench/results/<name>.json; with --smoke a "
                   "temporary file, so a smoke run never replaces a real result)")
    p.add_argument("--work-dir", type=Path, help="where runs go (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    args.out = args.out or (smoke_out(NAME) if args.smoke else default_out(NAME))
    quiet_libraries()
    if args.smoke:
        args.kinds, args.seeds, args.images, args.grid_points = "shapes", "0", 10, 2
        args.range_test_epochs, args.range_test_every_updates, args.finetune_epochs = 3, 1, 2
    if args.grid_points < 1 or args.grid_lr_min <= 0 or args.grid_lr_max < args.grid_lr_min:
        p.error("the grid needs --grid-points >= 1 and 0 < --grid-lr-min <= --grid-lr-max")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-discovery-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.pop("MLFLOW_RUN_ID", None)  # the steps' runs go to the work folder's own store, top level
    result: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke, "settings": {
        "kinds": kinds, "seeds": seeds, "images": args.images, "grid_points": args.grid_points,
        "grid_lr_min": args.grid_lr_min, "grid_lr_max": args.grid_lr_max, "target_pct": args.target_pct}}
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        with torch_threads(args.threads or None):
            result["machine"] = machine_info()
            from rangefinder.models.tiny import ensure_tiny_base_model

            result["base_model"] = str(ensure_tiny_base_model())  # its folder name is the builder's content key
            t0 = time.perf_counter()
            result["cases"] = [one_case(k, s, args, work, log) for k in kinds for s in seeds]
            result["seconds"] = time.perf_counter() - t0
            result["machine"]["loadavg_after"] = list(os.getloadavg())
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    summaries = [c["summary"] for c in result["cases"]]
    result["aggregate"] = aggregate(summaries, args.target_pct)
    result["aggregate_by_kind"] = {k: aggregate([s for s in summaries if s["kind"] == k], args.target_pct)
                                   for k in kinds}
    write_json(args.out, result)
    print(report(result))
    print(f"\nwritten: {args.out}")
    return result


def report(result: dict[str, Any]) -> str:
    rows = [c["summary"] for c in result["cases"]]
    cols = ["kind", "seed", "baseline_val_loss", "grid_best_lr", "grid_best_val_loss", "discovery_lr_mid",
            "discovery_lr_decades_from_grid_best", "discovery_best_val_loss", "discovery_gap_pct",
            "recommended_epochs", "discovery_still_improving", "lr_steepest", "lr_steepest_gap_pct", "lr_min_div10",
            "lr_min_div10_gap_pct", "diagnostic_lr_high_gap_pct"]
    heads = ["kind", "seed", "base loss", "grid best lr", "grid best", "disc lr_mid", "decades off", "disc best",
             "disc gap %", "rec epochs", "still improving", "steepest lr", "steepest gap %", "min/10 lr",
             "min/10 gap %", "(at lr_high gap %)"]
    text = table(rows, cols, title="Best validation loss (gap: % above the grid's best)", headers=heads)
    cost_cols = ["kind", "seed", "discovery_status", "discovery_lr_source", "discovery_updates", "grid_updates",
                 "cost_fraction_updates", "discovery_seconds", "grid_seconds", "cost_fraction_seconds"]
    cost_heads = ["kind", "seed", "discovery", "lr from", "disc updates", "grid updates", "update share",
                  "disc s", "grid s", "time share"]
    text += "\n\n" + table(rows, cost_cols, title="Compute", headers=cost_heads)
    agg = result["aggregate"]
    target = result["settings"]["target_pct"]
    lines = [
        f"cases: {agg['cases']}, discovery ok in {agg['discovery_ok']}",
        f"discovery gap to grid best: median {_f(agg['discovery_gap_pct']['median'])}%, worst "
        f"{_f(agg['discovery_gap_pct']['max'])}%; within {target:g}% in {agg[f'discovery_within_{target:g}pct']} "
        f"of {agg['cases']} cases (a failed discovery counts as a miss)",
        f"cost: median {_f(agg['cost_fraction_updates']['median'])} of the grid's updates, "
        f"{_f(agg['cost_fraction_seconds']['median'])} of its wall time",
        f"classic steepest: median gap {_f(agg['lr_steepest_gap_pct']['median'])}%, worst "
        f"{_f(agg['lr_steepest_gap_pct']['max'])}%; min/10: median gap {_f(agg['lr_min_div10_gap_pct']['median'])}%, "
        f"worst {_f(agg['lr_min_div10_gap_pct']['max'])}%",
        f"discovered lr_mid vs the grid's best LR: median {_f(agg['discovery_lr_decades_from_grid_best']['median'])} "
        f"decades; diagnostic run at the discovery's lr_high: median gap "
        f"{_f(agg['diagnostic_lr_high_gap_pct']['median'])}%",
    ]
    return text + "\n\n" + "\n".join(lines)


def _f(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3g}"


if __name__ == "__main__":
    main()
