"""Successive halving inside the fine-tune step: `lr_mid` against `lr_high`, half the budget each, the better one on.

The range test gives two candidate constant LRs: its midpoint, `lr_mid`, and its upper bound, `lr_high`. Which one
fine-tunes better depends on the data (on the discovery bench, `lr_mid` where the base model already knows the
images, `lr_high` where they are new; bench/RESULTS.md). Successive halving (Jamieson & Talwalkar 2016,
arXiv:1502.07943) settles it by measurement at half the price of two whole runs: both train the same spec to half
the fine-tune's updates (the engine's pause, training.loop.train), the one with the lower best validation loss so
far (ties: `lr_mid`) goes on to the end, and the other's checkpoints are removed. A constant-LR run paused and
resumed is the same run, so the kept one is exactly the fine-tune that LR would have been.

Where things are, in the step's work folder:
- `halving/<lr_mid|lr_high>/`: each candidate's run until the decision; the kept one's is then moved up into the
  work folder, where it goes on as the step's run; the other keeps its curve (metrics.csv, updates.csv, samples/)
  and loses its checkpoints;
- `halving/halving.json`: the decision, written before anything moves, so a step killed at any point goes on from
  where it was: a candidate from its newest checkpoint, the move from the entries still to move, the kept run from
  its newest checkpoint.

MLflow: each candidate logs live under its own prefix (`lr_mid/val_loss`, `lr_high/val_loss`, ...); at the decision
the kept candidate's first half is logged again under the plain keys, which the rest of its run continues, so
`val_loss` in the fine-tune's run is always the delivered model's curve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from rangefinder.errors import RangefinderError
from rangefinder.formats.atomic import write_json

HALVING_DIR = "halving"
DECISION = "halving.json"
CANDIDATES = ("lr_mid", "lr_high")
_NOT_MOVED = {".rangefinder.lock"}  # the candidate folder's own lock stays with it


def halving_applies(enabled: bool, validating: bool, schedule: str, lr_mid: float, lr_high: float) -> bool:
    """Halving compares validation losses of two constant LRs: it needs validation, a constant schedule and an
    `lr_high` above `lr_mid` (a fixed LR collapses the bounds: nothing to compare)."""
    return enabled and validating and schedule == "constant" and lr_high > lr_mid * (1 + 1e-9)


def pause_update(total_updates: int) -> int:
    """Where both candidates pause: half the fine-tune's updates (the engine pauses at the first validation at or
    after it)."""
    return max(1, math.ceil(total_updates / 2))


def curve_points(metrics_csv: Path) -> list[list[float]]:
    """[update, val_loss] of every finite measurement, for the decision, the report and decision.json."""
    from rangefinder.analysis import read_curve_csv

    curve = read_curve_csv(metrics_csv)
    pairs = zip(curve["update"], curve["val_loss"], strict=True)
    return [[int(u), float(v)] for u, v in pairs if math.isfinite(v)]


def best_until(points: list[list[float]], update: int) -> tuple[Optional[float], Optional[int]]:
    """The lowest validation loss measured after update 0 and at or before `update`, and where."""
    seen = [(loss, int(u)) for u, loss in points if 0 < u <= update]
    if not seen:
        return None, None
    loss, at = min(seen)
    return loss, at


def run_halving(cfg: Any, spec: Any, work: Path, *, lr_mid: float, lr_high: float, total_updates: int,
                sink: Any = None) -> dict[str, Any]:
    """Race the two candidates to the pause and move the kept one's run into `work`; returns the decision
    (halving.json): the kept candidate's name and LR, the pause, and each candidate's LR, best validation loss so
    far, where, its status and its curve. Goes on from whatever a killed attempt left."""
    from rangefinder.steps.launch import run_training
    from rangefinder.training import PrefixedSink

    root = Path(work) / HALVING_DIR
    decision_path = root / DECISION
    decision = json.loads(decision_path.read_text()) if decision_path.is_file() else None
    if decision is None:
        pause = pause_update(total_updates)
        lrs = {"lr_mid": lr_mid, "lr_high": lr_high}
        candidates: dict[str, dict[str, Any]] = {}
        for name in CANDIDATES:
            folder = root / name
            cspec = dataclasses.replace(spec, training=spec.training.model_copy(update={"lr": lrs[name]}))
            result = run_training(cfg, cspec, out_dir=folder, step_name="finetune", pause_after_update=pause,
                                  metric_sink=PrefixedSink(sink, f"{name}/") if sink is not None else None)
            points = curve_points(result.metrics_csv)
            best, at = best_until(points, pause)
            candidates[name] = {"lr": lrs[name], "status": result.status, "updates": result.updates,
                                "best_val_loss": best, "best_update": at, "curve": points}
        kept = _pick(candidates)
        decision = {"pause_update": pause, "kept": kept, "lr": lrs[kept], "candidates": candidates,
                    "moved": False, "rule": "the lower best validation loss by the pause goes on (ties: lr_mid)"}
        write_json(decision_path, decision)  # before anything moves: a killed step redoes only the move
    if not decision["moved"]:
        _move_up(root / decision["kept"], Path(work))
        shutil.rmtree(root / decision["kept"], ignore_errors=True)  # only its lock is left
        if sink is not None:
            replay_curve(sink, Path(work))
        for name in CANDIDATES:
            if name != decision["kept"]:
                shutil.rmtree(root / name / "checkpoints", ignore_errors=True)
        decision["moved"] = True
        write_json(decision_path, decision)
    return decision


def _pick(candidates: dict[str, dict[str, Any]]) -> str:
    """The candidate that goes on. A diverged or unmeasured one cannot; when neither can, the step fails as an
    unhalved fine-tune would."""
    usable = {n: c for n, c in candidates.items() if c["status"] != "diverged" and c["best_val_loss"] is not None}
    if not usable:
        raise RangefinderError(
            f"both fine-tune candidates diverged or measured nothing before update {candidates['lr_mid']['updates']} "
            f"(lr_mid {candidates['lr_mid']['lr']:.3g}, lr_high {candidates['lr_high']['lr']:.3g}); the range "
            "test's bounds are too high for this run: check its report, or set a fixed LR (fixed_lr)"
        )
    return min(usable, key=lambda n: (usable[n]["best_val_loss"], CANDIDATES.index(n)))


def _move_up(folder: Path, work: Path) -> None:
    """Every entry of the kept candidate's run into the work folder (a rename: the same file system); an entry a
    killed attempt already moved is not there to move again."""
    if not folder.is_dir():
        return
    for entry in sorted(folder.iterdir()):
        if entry.name in _NOT_MOVED:
            continue
        dest = work / entry.name
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        os.replace(entry, dest)


def replay_curve(sink: Any, run_dir: Path) -> None:
    """Log a run's curve so far (updates.csv, metrics.csv) under the plain keys the engine logs live
    (training.UPDATE_METRICS per update, the MEASURED_PREFIXES columns per measurement)."""
    import csv

    from rangefinder.training import MEASURED_PREFIXES, UPDATE_METRICS

    for name, keep in (("updates.csv", UPDATE_METRICS), ("metrics.csv", None)):
        path = run_dir / name
        if not path.is_file():
            continue
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                values: dict[str, float] = {}
                for k, v in row.items():
                    wanted = k in keep if keep is not None else k.startswith(MEASURED_PREFIXES)
                    if wanted and v not in ("", None):
                        values[k] = float(v)
                if values:
                    sink.log_metrics(values, int(float(row["update"])))
