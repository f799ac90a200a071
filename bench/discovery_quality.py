"""Discovery quality: how close one rangefinder discovery gets to the best of a grid sweep, at what share of its cost.

`python -m bench.discovery_quality` runs, for each dataset (a synthetic kind, or with `--dataset DIR` any folder of
images and .txt captions) and seed, on the embedded tiny model:

(a) rangefinder's discovery, through the pipeline's own step functions in the pipeline's order: the LR range test
    (`run_lr_range_test`, plus the zoom re-test when it asks for one), `run_choose_lr`, and the constant fine-tune
    at the midpoint (`run_finetune`), which also gives the recommended epochs;
(b) a grid of constant LRs, log-spaced over three decades, each trained exactly as the fine-tune step trains
    (`run_finetune` at that fixed LR, the same epochs, the same validation);
(b') the other midpoint rules (`lr_range_test.midpoint`: tuned, geometric, arithmetic) between the same discovered
    bounds, each trained the same way: one run gives the evidence for every rule at the same range-test cost;
(c) the classic LR-finder suggestions of the same first range test (fastai's steepest slope, and the LR at the loss
    minimum / 10; Smith 2017, arXiv:1506.01186, and fastai's `lr_find`), each trained the same way.

Each arm's quality is its best validation loss after training began (the minimum over its validation measurements,
update 0 left out; the same fixed validation noise for all, so differences are the weights', not the noise's), and
its cost the optimizer updates and wall seconds it spent, range tests included. The answer: discovery's gap to the
grid's best (%), at what fraction of the grid's updates, and whether the range test's quality score and censoring
flags tell the cases that miss from those that do not (`score_vs_gap`). Steps log to a throw-away MLflow store in
the work folder.

`--reuse-grid RESULT.json` takes (b) from an earlier run instead of training it, about 80 % of a case's cost, so that
a variant of the range test or the midpoint (`--range-test-epochs`, `--range-test-every-updates`, `--mid-position`)
costs only its discovery. It is refused unless that run had the same datasets, seeds, images, grid and fine-tune
epochs, and a case stops when its fine-tune's update-0 validation loss differs from the reused grid's (another base
model, split or validation).
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
from rangefinder.config import DEMO_PROMPTS
from rangefinder.defaults import MIDPOINT_RULES

NAME = "discovery_quality"
CENSORED = ("lower_censored", "upper_censored")
DEFAULT_KINDS = "shapes,stripes,textures,subject"
# The kinds no setting of the method was chosen on (bench/RESULTS.md): marked held out whenever they run.
DEFAULT_HELD_OUT = "subject,glyphs"
# A smoke still renders the samples during training (the steps' own path), but one prompt at one denoising step:
# the demo's 4 prompts x 20 steps x 3 grids were two thirds of every 4-update smoke arm, and no smoke number is read.
SMOKE_SAMPLING: dict[str, Any] = {"prompts": list(DEMO_PROMPTS[:1]), "num_inference_steps": 1}


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
           "final_val_loss": trained[-1][0] if trained else None,
           # The whole curve, [update, loss] after update 0: what an arm had reached at any point, so that schemes
           # which stop some arms early (successive halving) can be scored from the same runs.
           "curve": [[u_, round(y, 8)] for y, u_ in sorted(trained, key=lambda t: t[1])]}
    if recommended_updates is not None and trained:
        # The measurement nearest the recommended length: what stopping (or retraining) there gives.
        out["val_loss_at_recommended"] = min(trained, key=lambda t: (abs(t[1] - recommended_updates), t[1]))[0]
    return out


def _updates_of(run_dir: Path) -> int:
    return int(json.loads((run_dir / "run_summary.json").read_text())["updates"])


def train_fixed_lr(cfg, split_dir: Path, lr: float, out: Path) -> dict[str, Any]:
    """One constant-LR run exactly as the fine-tune step runs it (the grid's and the classic suggestions' arm)."""
    from rangefinder.errors import RangefinderError
    from rangefinder.steps.finetune import run_finetune

    t0 = time.perf_counter()
    try:
        ft = run_finetune(cfg, split_dir=split_dir, lr_low=lr, lr_high=lr, lr_mid=lr, lr_source="fixed",
                          model_dir=out)
        curve_csv, diverged = ft.curve_csv, False
    except RangefinderError as e:
        # A draw (random search) or grid point so high that the loss turned NaN: the run stops as diverged and
        # delivers nothing. The arm keeps what it measured before that (its curve's finite points), as a user
        # picking the best validated checkpoint would; a run with none has no loss and cannot be the arm's best.
        if "diverged" not in str(e):
            raise
        curve_csv, diverged = next(out.rglob("metrics.csv")), True
    seconds = time.perf_counter() - t0
    stats = {**curve_stats(curve_csv), "diverged": diverged}
    updates = _updates_of(curve_csv.parent)
    shutil.rmtree(out / "final", ignore_errors=True)  # the weights are not needed; keep the curve
    return {"lr": lr, "updates": updates, "seconds": seconds, **stats}


def discover(cfg, split_dir: Path, out: Path) -> dict[str, Any]:
    """The pipeline's discovery: range test (-> zoom), or the prodigy_step LR finder where the config resolves to it
    (lr_finder), -> choose LR -> constant fine-tune at the midpoint."""
    from rangefinder.steps.choose_lr import run_choose_lr
    from rangefinder.steps.finetune import run_finetune
    from rangefinder.training.family_detection import family_of

    res: dict[str, Any] = {"updates": 0, "seconds": 0.0, "range_tests": []}
    t0 = time.perf_counter()
    family = family_of(cfg.model)
    if family is None:  # a hub id not in the cache: this bench only trains local models
        raise SystemExit(f"model.base_model {cfg.model.base_model}: not a local model; pass a diffusers folder")
    if cfg.pipeline_lr() is None and cfg.lr_finder_for(family) == "prodigy_step":
        chosen = prodigy_step(cfg, split_dir, out, res)
        if chosen is None:
            return res
    else:
        tests = range_tests(cfg, split_dir, out, res)
        if not tests:
            return res
        used = tests[-1]
        chosen = run_choose_lr(cfg, source="zoom" if used.stage == "zoom" else "range-test", lr_low=used.lr_low,
                               lr_high=used.lr_high, lr_mid=used.lr_mid)
    ft = run_finetune(cfg, split_dir=split_dir, lr_low=chosen.lr_low, lr_high=chosen.lr_high, lr_mid=chosen.lr_mid,
                      lr_source=chosen.source, model_dir=out / "finetune")
    res["seconds"] = time.perf_counter() - t0
    ft_updates = _updates_of(out / "finetune")  # the delivered run's; with successive halving the step took more
    res["updates"] += ft.updates_trained or ft_updates
    shutil.rmtree(out / "finetune" / "final", ignore_errors=True)
    if ft.halving is not None:
        res["halving"] = {"kept": ft.halving.kept, "pause_update": ft.halving.pause_update,
                          **{n: {"lr": c.lr, "best_val_loss": c.best_val_loss, "best_update": c.best_update,
                                 "status": c.status} for n, c in ft.halving.candidates.items()}}
    res.update(
        status="ok", lr_source=chosen.source, lr_low=chosen.lr_low, lr_mid=chosen.lr_mid, lr_high=chosen.lr_high,
        lr_used=ft.lr, finetune_updates=ft_updates, finetune_updates_trained=ft.updates_trained,
        recommended_epochs=ft.recommended_epochs,
        recommended_updates=ft.recommended_updates, still_improving=ft.still_improving,
        # The checkpoint the step window kept (chosen.json: update, epoch, val_loss): the model the pipeline delivers.
        chosen=ft.chosen,
        **curve_stats(ft.curve_csv, ft.recommended_updates),
    )
    return res


def prodigy_step(cfg, split_dir: Path, out: Path, res: dict[str, Any]):
    """The prodigy_step LR finder as the pipeline runs it (rangefinder.steps.prodigy_step_size) under `out`: choose_lr's
    decision on its step size, its reading and updates added to `res` ("prodigy_step", "updates"). None when it gave
    no step size (`res` says status failed and why)."""
    from rangefinder.errors import RangefinderError
    from rangefinder.steps.choose_lr import run_choose_lr
    from rangefinder.steps.prodigy_step_size import SOURCE, run_prodigy_step_size

    t0 = time.perf_counter()
    try:
        step = run_prodigy_step_size(cfg, split_dir=split_dir, out_dir=out / "prodigy-step")
    except RangefinderError as e:
        res.update(status="failed", error=str(e), seconds=res.get("seconds", 0.0) + time.perf_counter() - t0)
        return None
    res["prodigy_step"] = step.reading.to_dict()
    res["updates"] += int(step.reading.updates)
    shutil.rmtree(out / "prodigy-step", ignore_errors=True)
    return run_choose_lr(cfg, source=SOURCE, lr_low=step.lr, lr_high=step.lr, lr_mid=step.lr)


def range_tests(cfg, split_dir: Path, out: Path, res: dict[str, Any]) -> list[Any]:
    """The pipeline's range tests, the first and (when it asks for one) the zoom, under `out`: their results, the
    last one's bounds the ones used; each one's decision and updates added to `res` ("range_tests", "updates"). None
    when no usable bounds came out (`res` says status failed and why, with the seconds so far)."""
    from rangefinder.errors import RangefinderError
    from rangefinder.steps.lr_range_test import run_lr_range_test

    t0 = time.perf_counter()
    try:
        tests = [run_lr_range_test(cfg, split_dir=split_dir, out_dir=out / "range-test", stage="first")]
        if tests[0].needs_zoom:
            tests.append(run_lr_range_test(cfg, split_dir=split_dir, out_dir=out / "range-test-zoom", stage="zoom",
                                           lr_min=tests[0].zoom_lr_min, lr_max=tests[0].zoom_lr_max))
    except RangefinderError as e:
        # No usable bounds even after the zoom: the pipeline stops here. Its cost so far still counts, and the
        # first test's classic suggestions (written before the step gave up) are still worth training.
        res.update(status="failed", error=str(e), seconds=res.get("seconds", 0.0) + time.perf_counter() - t0)
        tests = []
    for name in ("range-test", "range-test-zoom"):
        bounds_json = out / name / "bounds.json"
        if bounds_json.exists():
            decision = json.loads(bounds_json.read_text())
            res["range_tests"].append({k: decision.get(k) for k in (
                "stage", "lr_min", "lr_max", "status", "lr_low", "lr_mid", "lr_high", "flags", "quality",
                "points_between", "updates", "lr_steepest", "lr_min_div10", "lr_at_min", "midpoint", "midpoints",
                "quality_label", "quality_parts", "snr")})
            res["updates"] += int(decision["updates"])
        elif (out / name / "run" / "run_summary.json").exists():
            res["updates"] += _updates_of(out / name / "run")
    return tests


def _open_store(cfg) -> None:
    """Create the MLflow store's tables now, so that the one-time migration is not timed as the first step's."""
    from rangefinder.tracking import runs

    runs.tracking_client(cfg).search_experiments(max_results=1)


def gap_pct(loss: Optional[float], best: Optional[float]) -> Optional[float]:
    if loss is None or best is None or best == 0:
        return None
    return 100.0 * (loss - best) / best


def dataset_sources(kinds: list[str], datasets: list[Path], held_out: list[str]) -> list[dict[str, Any]]:
    """What the bench runs on: each synthetic kind, then each --dataset folder (named by its folder, made unique)."""
    from rangefinder.data.synthetic import KINDS
    from rangefinder.errors import RangefinderError

    out: list[dict[str, Any]] = []
    for k in kinds:
        if k not in KINDS:
            raise RangefinderError(f"unknown synthetic kind {k!r} in --kinds; choose from {', '.join(KINDS)}")
        out.append({"name": k, "kind": k, "dataset": None, "held_out": k in held_out})
    for d in datasets:
        d = d.expanduser().resolve()
        if not d.is_dir():
            raise RangefinderError(f"--dataset {d} is not a folder; give a folder of images with .txt captions")
        name = d.name or "dataset"
        while name in {o["name"] for o in out}:
            name += "'"
        out.append({"name": name, "kind": None, "dataset": str(d), "held_out": name in held_out})
    unknown = set(held_out) - {o["name"] for o in out}
    if unknown:
        raise RangefinderError(f"--held-out names {', '.join(sorted(unknown))}, which this run does not include; "
                               "name kinds or --dataset folder names of this run")
    return out


def load_reusable_grid(path: Path, sources: list[dict[str, Any]], seeds: list[int], args,
                       finetune_epochs: int) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """The grid arms of an earlier result, per (dataset name, seed), when every case of this run has one trained
    exactly so: the same dataset (synthetic kind or folder), seed, images, grid (points, range) and fine-tune
    epochs. Any difference refuses, naming it: a grid trained otherwise is not this run's baseline.
    """
    from rangefinder.errors import RangefinderError

    fix = f"run without --reuse-grid (trains the grid), or with the settings of {path}"
    try:
        old = json.loads(Path(path).read_text())
        old_settings, old_cases = old["settings"], old["cases"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RangefinderError(f"--reuse-grid {path}: not a readable {NAME} result ({e}); give the JSON a "
                               f"python -m bench.{NAME} run wrote") from e
    if old.get("smoke") and not args.smoke:
        raise RangefinderError(f"--reuse-grid {path} is a --smoke result; {fix}")
    for key in ("grid_points", "grid_lr_min", "grid_lr_max"):
        if old_settings.get(key) != getattr(args, key):
            raise RangefinderError(f"--reuse-grid {path}: its {key} is {old_settings.get(key)!r}, this run's "
                                   f"{getattr(args, key)!r}; {fix}")
    by_case = {(c["kind"], int(c["seed"])): c for c in old_cases}
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for seed in seeds:
        for src in sources:
            c = by_case.get((src["name"], seed))
            if c is None:
                raise RangefinderError(f"--reuse-grid {path} has no case {src['name']} seed {seed} "
                                       f"(it has {', '.join(f'{k} {s}' for k, s in by_case) or 'none'}); {fix}")
            images = args.images if src["kind"] else _count_images(Path(src["dataset"]))
            want = {"synthetic_kind": src["kind"], "dataset_dir": src["dataset"], "images": images,
                    "finetune_epochs": finetune_epochs}
            for key, value in want.items():
                if c.get(key) != value:
                    raise RangefinderError(f"--reuse-grid {path}: case {src['name']} seed {seed} has {key} "
                                           f"{c.get(key)!r}, this run {value!r}; {fix}")
            if len(c.get("grid") or []) != args.grid_points:
                raise RangefinderError(f"--reuse-grid {path}: case {src['name']} seed {seed} has "
                                       f"{len(c.get('grid') or [])} grid arms, not {args.grid_points}; {fix}")
            out[(src["name"], seed)] = [dict(g, reused=True) for g in c["grid"]]
    return out


def check_reused_baseline(grid: list[dict[str, Any]], discovery: dict[str, Any], where: str) -> None:
    """The reused grid and this run's fine-tune start from the same model on the same validation images: the same
    update-0 loss (validation loss is deterministic on CPU). A different one means another base model, split or
    validation, and the grid is not this run's baseline."""
    from rangefinder.errors import RangefinderError

    mine = discovery.get("baseline_val_loss")
    theirs = {g.get("baseline_val_loss") for g in grid}
    if mine is None or len(theirs) != 1:
        return  # no fine-tune ran (discovery failed), or an old file without the loss: the settings check stands
    ref = theirs.pop()
    if ref is None or not math.isclose(mine, ref, rel_tol=1e-6):
        raise RangefinderError(f"--reuse-grid: {where}: this run's update-0 validation loss is {mine!r}, the "
                               f"reused grid's {ref!r}: another base model, split or validation; run without "
                               "--reuse-grid to train the grid on this setup")


def _count_images(folder: Path) -> int:
    from rangefinder.data.dataset import IMAGE_EXTENSIONS

    return sum(1 for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)


def set_up_case(dataset: Path, seed: int, work: Path, case: Path, overrides: dict[str, dict[str, Any]]):
    """A case's config and split: demo_config on the embedded tiny model with the case's dataset and seed, the
    latent cache and one MLflow store shared by the run's cases under `work`, and `overrides` (by section) on top;
    the split written under `case`. Returns (config, split folder)."""
    from rangefinder.config import demo_config
    from rangefinder.models.tiny import ensure_tiny_base_model
    from rangefinder.steps.prepare_dataset import run_prepare_dataset

    sections: dict[str, dict[str, Any]] = {
        "data": {"dataset_dir": str(dataset)},
        "model": {"base_model": str(ensure_tiny_base_model())},
        "training": {"seed": seed, "cache_dir": str(work / "cache")},
        "tracking": {"tracking_uri": f"sqlite:///{(work / 'mlflow.db').resolve()}", "registered_model_name": None},
    }
    for section, values in overrides.items():
        sections[section] = {**sections.get(section, {}), **values}
    cfg = demo_config(**sections)
    split_dir = case / "split"
    run_prepare_dataset(cfg, out_dir=split_dir)
    _open_store(cfg)
    return cfg, split_dir


def one_case(source: dict[str, Any], seed: int, args, work: Path, log=print,
             reused_grid: Optional[list[dict[str, Any]]] = None, other_arms: bool = True) -> dict[str, Any]:
    """Discovery, grid, the other midpoint rules and classic suggestions on one dataset with one training seed.

    A synthetic kind is drawn with the case's seed too (a new dataset per seed); a --dataset folder is the same in
    every case, and only the training seed (and with it the split) changes.
    """
    from rangefinder.data.synthetic import make_synthetic_dataset

    name = source["name"]
    case = work / f"{name}-seed{seed}"
    if source["kind"]:
        dataset = case / "dataset"
        make_synthetic_dataset(dataset, kind=source["kind"], count=args.images, seed=seed, resolution=32)
        images = args.images
    else:
        dataset = Path(source["dataset"])
        images = _count_images(dataset)
    overrides: dict[str, dict[str, Any]] = {}
    if args.range_test_epochs:
        overrides["lr_range_test"] = {"epochs": args.range_test_epochs}
    if args.range_test_every_updates:
        overrides.setdefault("lr_range_test", {})["validate_every_updates"] = args.range_test_every_updates
    if args.mid_position is not None:
        overrides.setdefault("lr_range_test", {})["mid_position"] = args.mid_position
    if args.finetune_epochs:
        overrides["finetune"] = {"epochs": args.finetune_epochs}
    if args.smoke:
        overrides["sampling"] = SMOKE_SAMPLING
    cfg, split_dir = set_up_case(dataset, seed, work, case, overrides)
    kind = name  # the log's and the tables' name of the dataset
    out: dict[str, Any] = {"kind": name, "synthetic_kind": source["kind"], "dataset_dir": source["dataset"],
                           "held_out": source["held_out"], "seed": seed, "images": images,
                           "finetune_epochs": cfg.finetune.epochs, "range_test_epochs": cfg.lr_range_test.epochs,
                           "range_test_every_updates": cfg.lr_range_test.validate_every_updates,
                           "mid_position": cfg.lr_range_test.mid_position, "grid_reused": reused_grid is not None}
    log(f"[{kind} seed {seed}] discovery")
    out["discovery"] = discover(cfg, split_dir, case / "discovery")
    d = out["discovery"]
    log(f"[{kind} seed {seed}]   {d['status']}: lr_mid {d.get('lr_mid')}, best {d.get('best_val_loss')}, "
        f"{d['updates']} updates, {d['seconds']:.1f} s")

    grid_lrs = [args.grid_lr_min * (args.grid_lr_max / args.grid_lr_min) ** (i / (args.grid_points - 1))
                for i in range(args.grid_points)] if args.grid_points > 1 else [args.grid_lr_min]
    out["grid"] = []
    if reused_grid is not None:
        check_reused_baseline(reused_grid, d, f"{kind} seed {seed}")
        out["grid"] = reused_grid
        log(f"[{kind} seed {seed}]   grid reused from {args.reuse_grid}: best "
            f"{min(g['best_val_loss'] for g in reused_grid if g.get('best_val_loss') is not None)}")
    for i, lr in enumerate(grid_lrs if reused_grid is None else ()):
        row = train_fixed_lr(cfg, split_dir, lr, case / f"grid-{i}")
        log(f"[{kind} seed {seed}]   grid lr {lr:.3g}: best {row['best_val_loss']}, {row['seconds']:.1f} s")
        out["grid"].append(row)

    out["midpoint_arms"] = {}
    if args.midpoint_arms and other_arms and d["status"] == "ok":
        used = d["range_tests"][-1]
        chosen = used.get("midpoint")
        for rule, lr in (used.get("midpoints") or {}).items():
            if rule == chosen or lr is None:
                continue  # the chosen rule's arm is the discovery's own fine-tune
            if math.isclose(lr, d["lr_mid"], rel_tol=1e-9):
                row = {"lr": lr, "updates": d["finetune_updates"], "seconds": 0.0, "same_as": chosen,
                       **{k: d.get(k) for k in ("baseline_val_loss", "best_val_loss", "best_update")}}
            else:
                row = train_fixed_lr(cfg, split_dir, float(lr), case / f"midpoint-{rule}")
            log(f"[{kind} seed {seed}]   midpoint {rule} {lr:.3g}: best {row['best_val_loss']}")
            out["midpoint_arms"][rule] = row

    first = d["range_tests"][0] if d.get("range_tests") else {}
    out["classic"] = {}
    for name in ("lr_steepest", "lr_min_div10") if args.classic and other_arms else ():
        lr = first.get(name)
        if lr is None or not (lr > 0 and math.isfinite(lr)):
            out["classic"][name] = {"lr": None, "note": "the first range test gave no such suggestion"}
            continue
        row = train_fixed_lr(cfg, split_dir, float(lr), case / f"classic-{name}")
        row["updates_with_range_test"] = row["updates"] + int(first.get("updates") or 0)
        log(f"[{kind} seed {seed}]   {name} {lr:.3g}: best {row['best_val_loss']}")
        out["classic"][name] = row
    if args.diagnose_lr_high and other_arms and d.get("lr_high"):
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
        "kind": case["kind"], "seed": case["seed"], "held_out": bool(case.get("held_out")),
        "baseline_val_loss": best["baseline_val_loss"] if best else None,
        "grid_best_lr": best["lr"] if best else None,
        "grid_best_val_loss": best["best_val_loss"] if best else None,
        "grid_best_at_edge": bool(best) and best["lr"] in (case["grid"][0]["lr"], case["grid"][-1]["lr"]),
        "grid_updates": grid_updates, "grid_seconds": grid_seconds,
        "discovery_status": d["status"], "discovery_lr_source": d.get("lr_source"),
        "discovery_lr_mid": d.get("lr_mid"),
        # The LR of the delivered fine-tune: lr_mid, or lr_high when successive halving kept it.
        "discovery_lr": d.get("lr_used") or d.get("lr_mid"),
        "halving_kept": (d.get("halving") or {}).get("kept"),
        "discovery_best_val_loss": d.get("best_val_loss"),
        "discovery_val_at_recommended": d.get("val_loss_at_recommended"),
        "recommended_epochs": d.get("recommended_epochs"),
        "discovery_updates": d["updates"], "discovery_seconds": d["seconds"],
    }
    s["discovery_still_improving"] = d.get("still_improving")
    # What the report knew before any training at lr_mid: the quality score and flags of the test the LR came from
    # (the zoom's when it ran), and of the first test.
    tests = d.get("range_tests") or []
    used = tests[-1] if tests else {}
    s["zoomed"] = len(tests) > 1
    s["quality"] = used.get("quality", 0.0) if d["status"] == "ok" else 0.0
    s["quality_label"] = used.get("quality_label")
    s["flags"] = list(used.get("flags") or [])
    s["first_status"] = tests[0].get("status") if tests else None
    s["first_quality"] = tests[0].get("quality") if tests else None
    s["first_flags"] = list(tests[0].get("flags") or []) if tests else []
    s["censored"] = any(f in CENSORED for f in s["flags"])
    if s["discovery_lr"] and s["grid_best_lr"]:
        # How far the discovered LR is from the grid's best, in decades (negative: below it).
        s["discovery_lr_decades_from_grid_best"] = math.log10(s["discovery_lr"] / s["grid_best_lr"])
    s["discovery_gap_pct"] = gap_pct(s["discovery_best_val_loss"], s["grid_best_val_loss"])
    s["discovery_gap_at_recommended_pct"] = gap_pct(s["discovery_val_at_recommended"], s["grid_best_val_loss"])
    s["cost_fraction_updates"] = d["updates"] / grid_updates if grid_updates else None
    s["cost_fraction_seconds"] = d["seconds"] / grid_seconds if grid_seconds else None
    base, gb, db = s["baseline_val_loss"], s["grid_best_val_loss"], s["discovery_best_val_loss"]
    if None not in (base, gb, db) and base - gb > 0:
        s["share_of_grid_improvement"] = (base - db) / (base - gb)
    # Each midpoint rule between the same bounds: the chosen one is the discovery's fine-tune, the others extra arms.
    chosen = used.get("midpoint")
    for rule in MIDPOINT_RULES:
        row = case.get("midpoint_arms", {}).get(rule)
        if rule == chosen:  # the discovery's own fine-tune, unless successive halving kept lr_high instead
            kept_mid = s["halving_kept"] in (None, "lr_mid")
            lr, best_loss = d.get("lr_mid"), d.get("best_val_loss") if kept_mid else None
        elif row:
            lr, best_loss = row.get("lr"), row.get("best_val_loss")
        else:
            lr, best_loss = (used.get("midpoints") or {}).get(rule), None
        s[f"mid_{rule}_lr"] = lr
        s[f"mid_{rule}_gap_pct"] = gap_pct(best_loss, s["grid_best_val_loss"])
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
                "share_of_grid_improvement", *(f"mid_{r}_gap_pct" for r in MIDPOINT_RULES)):
        out[key] = stats([s.get(key) for s in summaries])
    gaps = [s.get("discovery_gap_pct") for s in summaries]
    out[f"discovery_within_{within_pct:g}pct"] = sum(g is not None and g <= within_pct for g in gaps)
    for name in ("lr_steepest", "lr_min_div10", *(f"mid_{r}" for r in MIDPOINT_RULES)):
        g = [s.get(f"{name}_gap_pct") for s in summaries]
        out[f"{name}_within_{within_pct:g}pct"] = sum(x is not None and x <= within_pct for x in g)
    return out


def spearman(a: list[float], b: list[float]) -> Optional[float]:
    """Spearman's rank correlation (ties get their mean rank; +inf ranks last); None under 3 pairs or no spread."""
    import numpy as np

    if len(a) != len(b) or len(a) < 3:
        return None

    def ranks(v: list[float]) -> np.ndarray:
        x = np.asarray(v, dtype=float)
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for value in np.unique(x):  # mean rank within ties
            tie = x == value
            r[tie] = r[tie].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return None
    return float(np.corrcoef(ra, rb)[0, 1])


def score_vs_gap(summaries: list[dict[str, Any]], within_pct: float,
                 thresholds: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)) -> dict[str, Any]:
    """Does the range test's quality score (and its censoring flags) predict discovery's gap to the grid's best?

    A failed discovery counts with score 0 and an infinite gap (a miss). For each threshold: how many cases score
    under it and how many of those miss the target, against the cases at or above it.
    """
    pairs = [(float(s.get("quality") or 0.0), math.inf if s.get("discovery_gap_pct") is None
              else float(s["discovery_gap_pct"]), s) for s in summaries]
    out: dict[str, Any] = {"n": len(pairs), "target_pct": within_pct,
                           "spearman_score_gap": spearman([p[0] for p in pairs], [p[1] for p in pairs])}
    decades = [(float(s.get("quality") or 0.0), abs(s["discovery_lr_decades_from_grid_best"]))
               for s in summaries if s.get("discovery_lr_decades_from_grid_best") is not None]
    out["spearman_score_abs_decades"] = spearman([q for q, _ in decades], [x for _, x in decades])
    rows = []
    for t in thresholds:
        below = [p for p in pairs if p[0] < t]
        above = [p for p in pairs if p[0] >= t]
        rows.append({"threshold": t, "below": len(below), "below_misses": sum(p[1] > within_pct for p in below),
                     "at_or_above": len(above), "above_misses": sum(p[1] > within_pct for p in above)})
    out["thresholds"] = rows
    for key, test in (("censored", lambda s: bool(s.get("censored"))),
                      ("still_improving", lambda s: bool(s.get("discovery_still_improving")))):
        yes = [p for p in pairs if test(p[2])]
        no = [p for p in pairs if not test(p[2])]
        out[key] = {"flagged": len(yes), "flagged_misses": sum(p[1] > within_pct for p in yes),
                    "not_flagged": len(no), "not_flagged_misses": sum(p[1] > within_pct for p in no)}
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.discovery_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default=None, help="synthetic dataset kinds (rangefinder.data.synthetic; default "
                   f"{DEFAULT_KINDS}, or none when --dataset is given)")
    p.add_argument("--dataset", type=Path, action="append", default=[], metavar="DIR",
                   help="a folder of images with .txt captions to run the same comparison on (repeatable)")
    p.add_argument("--held-out", default=None, help="kinds or --dataset folder names no setting was tuned on, "
                   f"marked in the tables (default: those of {DEFAULT_HELD_OUT} that run)")
    p.add_argument("--seeds", default="0,1,2", help="dataset and training seeds; shapes seed 0 is the embedded default")
    p.add_argument("--images", type=int, default=20, help="images per synthetic dataset (20: the embedded default)")
    p.add_argument("--grid-points", type=int, default=8)
    p.add_argument("--grid-lr-min", type=float, default=1e-5)
    p.add_argument("--grid-lr-max", type=float, default=1e-2)
    p.add_argument("--range-test-epochs", type=int, help="default: the demo config's")
    p.add_argument("--range-test-every-updates", type=int, help="validation interval of the range test "
                   "(default: the demo config's)")
    p.add_argument("--finetune-epochs", type=int, help="the epochs budget of every arm (default: the demo config's)")
    p.add_argument("--mid-position", type=float, help="lr_range_test.mid_position of the discovery (default: the "
                   "demo config's)")
    p.add_argument("--reuse-grid", type=Path, metavar="JSON", help="take the grid arms from an earlier result "
                   "instead of training them (~80%% of a case's cost); refused unless its datasets, seeds, images, "
                   "grid and fine-tune epochs are this run's. For variants of the range test and the midpoint")
    p.add_argument("--no-diagnose-lr-high", dest="diagnose_lr_high", action="store_false",
                   help="skip the diagnostic run at the discovery's own lr_high")
    p.add_argument("--no-classic", dest="classic", action="store_false",
                   help="skip the runs at the classic suggestions (steepest slope, minimum / 10)")
    p.add_argument("--no-midpoint-arms", dest="midpoint_arms", action="store_false",
                   help="skip the runs at the other midpoint rules' LRs")
    p.add_argument("--target-pct", type=float, default=3.0, help="the 'within x%% of the grid's best' target")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's choice)")
    p.add_argument("--keep", action="store_true", help="keep every run's folder (with --work-dir)")
    p.add_argument("--smoke", action="store_true", help="one tiny case, 2 grid points, 2-epoch runs (CI)")
    p.add_argument("--out", type=Path, help="JSON output (default bench/results/<name>.json; with --smoke a "
                   "temporary file, so a smoke run never replaces a real result); rewritten after every case")
    p.add_argument("--work-dir", type=Path, help="where runs go (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    args.out = args.out or (smoke_out(NAME) if args.smoke else default_out(NAME))
    quiet_libraries()
    if args.kinds is None:
        args.kinds = "" if args.dataset else DEFAULT_KINDS
    if args.smoke:
        args.kinds = "shapes" if not args.dataset else args.kinds
        args.seeds, args.images, args.grid_points = "0", 10, 2
        args.range_test_epochs, args.range_test_every_updates, args.finetune_epochs = 3, 1, 2
    if args.grid_points < 1 or args.grid_lr_min <= 0 or args.grid_lr_max < args.grid_lr_min:
        p.error("the grid needs --grid-points >= 1 and 0 < --grid-lr-min <= --grid-lr-max")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.held_out is None:
        args.held_out = ",".join(k for k in DEFAULT_HELD_OUT.split(",") if k in kinds)
    held_out = [k.strip() for k in args.held_out.split(",") if k.strip()]
    from rangefinder.errors import RangefinderError

    try:
        sources = dataset_sources(kinds, args.dataset, held_out)
    except RangefinderError as e:
        p.error(str(e))
    if not sources or not seeds:
        p.error("nothing to run: give --kinds, --dataset and --seeds")
    reused: dict[tuple[str, int], list[dict[str, Any]]] = {}
    if args.reuse_grid:
        from rangefinder.config import demo_config

        try:
            reused = load_reusable_grid(args.reuse_grid, sources, seeds, args,
                                        args.finetune_epochs or demo_config().finetune.epochs)
        except RangefinderError as e:
            p.error(str(e))

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-discovery-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.pop("MLFLOW_RUN_ID", None)  # the steps' runs go to the work folder's own store, top level
    result: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke, "settings": {
        "kinds": kinds, "datasets": [str(d) for d in args.dataset], "sources": sources, "held_out": held_out,
        "seeds": seeds, "images": args.images, "grid_points": args.grid_points, "grid_lr_min": args.grid_lr_min,
        "grid_lr_max": args.grid_lr_max, "target_pct": args.target_pct, "midpoint_arms": args.midpoint_arms,
        "classic": args.classic, "diagnose_lr_high": args.diagnose_lr_high, "mid_position": args.mid_position,
        "range_test_epochs": args.range_test_epochs, "range_test_every_updates": args.range_test_every_updates,
        "finetune_epochs": args.finetune_epochs, "reuse_grid": str(args.reuse_grid) if args.reuse_grid else None}}
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        with torch_threads(args.threads or None):
            result["machine"] = machine_info()
            from rangefinder.models.tiny import ensure_tiny_base_model

            result["base_model"] = str(ensure_tiny_base_model())  # its folder name is the builder's content key
            t0 = time.perf_counter()
            result["cases"] = []
            # Seed by seed, every dataset within a seed: a run cut short still covers every dataset.
            for seed in seeds:
                for source in sources:
                    try:
                        # A smoke trains the other arms (midpoint rules, classic suggestions, the lr_high
                        # diagnostic) on its first case only: the same code on every case, and no smoke number is
                        # read; they were 5 of the 10 runs of each further case.
                        result["cases"].append(one_case(source, seed, args, work, log,
                                                        reused.get((source["name"], seed)) if reused else None,
                                                        other_arms=not (args.smoke and result["cases"])))
                    except RangefinderError as e:
                        if not args.reuse_grid:
                            raise
                        p.error(str(e))  # the reused grid is not this setup's: what ran so far is written
                    result["seconds"] = time.perf_counter() - t0
                    finish(result, partial=True)
                    write_json(args.out, result)  # after every case: a run cut short keeps what it measured
            result["machine"]["loadavg_after"] = list(os.getloadavg())
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    finish(result, partial=False)
    write_json(args.out, result)
    print(report(result))
    print(f"\nwritten: {args.out}")
    return result


def finish(result: dict[str, Any], partial: bool) -> None:
    """The aggregates over the cases so far: all, by dataset, held-out vs tuned-on, and the score-vs-gap relation."""
    summaries = [c["summary"] for c in result["cases"]]
    target = result["settings"]["target_pct"]
    result["partial"] = partial
    result["aggregate"] = aggregate(summaries, target)
    names = list(dict.fromkeys(s["kind"] for s in summaries))
    result["aggregate_by_kind"] = {k: aggregate([s for s in summaries if s["kind"] == k], target) for k in names}
    result["aggregate_held_out"] = aggregate([s for s in summaries if s["held_out"]], target)
    result["aggregate_tuned_on"] = aggregate([s for s in summaries if not s["held_out"]], target)
    result["score_vs_gap"] = score_vs_gap(summaries, target)
    result["score_vs_gap_tuned_on"] = score_vs_gap([s for s in summaries if not s["held_out"]], target)


def headline(result: dict[str, Any]) -> str:
    """One column per dataset (and all together): the gap to the grid's best under each midpoint rule, the cost."""
    target = result["settings"]["target_pct"]
    cols = {**result["aggregate_by_kind"], "all": result["aggregate"]}
    held = set(result["settings"].get("held_out") or [])
    chosen = next((c["discovery"]["range_tests"][-1].get("midpoint") for c in result["cases"]
                   if c["discovery"].get("range_tests")), None)
    rows: list[dict[str, Any]] = [{"what": "cases", **{k: a["cases"] for k, a in cols.items()}}]
    for rule in MIDPOINT_RULES:
        tag = f"{rule}" + (" (chosen)" if rule == chosen else "")
        rows.append({"what": f"{tag}: median gap %",
                     **{k: _f(a[f"mid_{rule}_gap_pct"]["median"]) for k, a in cols.items()}})
        rows.append({"what": f"{tag}: worst gap %",
                     **{k: _f(a[f"mid_{rule}_gap_pct"]["max"]) for k, a in cols.items()}})
        rows.append({"what": f"{tag}: within {target:g}%",
                     **{k: f"{a[f'mid_{rule}_within_{target:g}pct']}/{a['cases']}" for k, a in cols.items()}})
    rows.append({"what": "cost: share of the grid's updates (median)",
                 **{k: _f(a["cost_fraction_updates"]["median"]) for k, a in cols.items()}})
    rows.append({"what": "cost: share of the grid's time (median)",
                 **{k: _f(a["cost_fraction_seconds"]["median"]) for k, a in cols.items()}})
    heads = ["", *(f"{k} (held out)" if k in held else k for k in cols)]
    return table(rows, ["what", *cols], title="Headline: discovery against the grid's best, by dataset",
                 headers=heads)


def report(result: dict[str, Any]) -> str:
    rows = [c["summary"] for c in result["cases"]]
    cols = ["kind", "seed", "baseline_val_loss", "grid_best_lr", "grid_best_val_loss", "discovery_lr", "halving_kept",
            "discovery_lr_decades_from_grid_best", "discovery_best_val_loss", "discovery_gap_pct",
            "mid_geometric_gap_pct", "mid_arithmetic_gap_pct", "quality", "flags",
            "recommended_epochs", "discovery_still_improving", "lr_steepest_gap_pct",
            "lr_min_div10_gap_pct", "diagnostic_lr_high_gap_pct"]
    heads = ["data", "seed", "base loss", "grid best lr", "grid best", "disc lr", "halving kept", "decades off",
             "disc best",
             "disc gap %", "geometric gap %", "arithmetic gap %", "score", "flags", "rec epochs", "still improving",
             "steepest gap %", "min/10 gap %", "(at lr_high gap %)"]
    if not any(r.get("lr_steepest") or r.get("lr_min_div10") for r in rows):  # run with --no-classic
        keep = [i for i, c in enumerate(cols) if not c.startswith(("lr_steepest", "lr_min_div10"))]
        cols, heads = [cols[i] for i in keep], [heads[i] for i in keep]
    text = headline(result) + "\n\n"
    text += table([{**r, "kind": r["kind"] + (" (held out)" if r.get("held_out") else ""),
                    "flags": ",".join(r.get("flags") or []) or "-"} for r in rows], cols,
                  title="Best validation loss (gap: % above the grid's best)", headers=heads)
    cost_cols = ["kind", "seed", "discovery_status", "discovery_lr_source", "discovery_updates", "grid_updates",
                 "cost_fraction_updates", "discovery_seconds", "grid_seconds", "cost_fraction_seconds"]
    cost_heads = ["data", "seed", "discovery", "lr from", "disc updates", "grid updates", "update share",
                  "disc s", "grid s", "time share"]
    text += "\n\n" + table(rows, cost_cols, title="Compute", headers=cost_heads)
    sg = result["score_vs_gap"]
    text += "\n\n" + table(sg["thresholds"], ["threshold", "below", "below_misses", "at_or_above", "above_misses"],
                            title=f"Quality score vs a miss (gap > {sg['target_pct']:g}%): all cases",
                            headers=["score <", "cases under", "misses under", "cases at/above", "misses at/above"])
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
        f"worst {_f(agg['lr_min_div10_gap_pct']['max'])}%" if agg["lr_steepest_gap_pct"]["n"] else
        "classic suggestions: not run (--no-classic)",
        f"discovered LR vs the grid's best LR: median {_f(agg['discovery_lr_decades_from_grid_best']['median'])} "
        f"decades; diagnostic run at the discovery's lr_high: median gap "
        f"{_f(agg['diagnostic_lr_high_gap_pct']['median'])}%",
        f"score vs gap: Spearman {_f(sg['spearman_score_gap'])} (score vs |decades off| "
        f"{_f(sg['spearman_score_abs_decades'])}); censored: {sg['censored']['flagged_misses']} misses in "
        f"{sg['censored']['flagged']} flagged, {sg['censored']['not_flagged_misses']} in "
        f"{sg['censored']['not_flagged']} not",
    ]
    return text + "\n\n" + "\n".join(lines)


def _f(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.3g}"


if __name__ == "__main__":
    main()
