"""Successive halving inside the fine-tune step: `lr_mid` against `lr_high`, half the budget each, the better one on.

The range test gives two candidate constant LRs: its midpoint, `lr_mid`, and its upper bound, `lr_high`. Which one
fine-tunes better depends on the data (on the discovery bench, `lr_mid` where the base model already knows the
images, `lr_high` where they are new; bench/RESULTS.md). Successive halving (Jamieson & Talwalkar 2016,
arXiv:1502.07943) settles it by measurement at half the price of two whole runs: both train the same spec to half
the fine-tune's updates (the engine's pause, training.loop.train), the one with the lower best validation loss so
far (ties: `lr_mid`) goes on to the end, and the other's checkpoints are removed. A constant-LR run paused and
resumed is the same run, so the kept one is exactly the fine-tune that LR would have been.

With `finetune.halving_below_margin` set, a race `lr_high` lost by more than that margin (analysis.halving.fires_below)
gets a third candidate, `lr_below` = `lr_mid`^2 / `lr_high`, trained to the same pause after the two; the lowest of
the three goes on. A step killed while it trains goes on from its newest checkpoint (the other two have paused: their
runs return at once).

Where things are, in the step's work folder:
- `halving/<lr_mid|lr_high|lr_below>/`: each candidate's run until the decision; the kept one's is then moved up into
  the work folder, where it goes on as the step's run; the others keep their curves (metrics.csv, updates.csv,
  samples/) and lose their checkpoints;
- `halving/halving.json`: the decision, written before anything moves, so a step killed at any point goes on from
  where it was: a candidate from its newest checkpoint, the move from the entries still to move, the kept run from
  its newest checkpoint.

MLflow: each candidate logs live into a child run of the fine-tune's run (`finetune_lr_mid`, `finetune_lr_high`),
under the same plain keys (`val_loss`, ...), so that MLflow overlays the two curves in run colours; at the decision
each is tagged `halving.outcome` kept or dropped (and its name says so), and the kept candidate's first half is
logged again into the fine-tune's own run, which the rest of its run continues, so `val_loss` in the fine-tune's
run is always the delivered model's curve.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rangefinder.analysis.halving import (
    BELOW,
    CANDIDATES,
    RACED,
    RULE,
    HalvingCandidate,
    HalvingDecision,
    below_lr,
    best_until,
    compared_at,
    fires_below,
    pause_update,
    pick,
)
from rangefinder.config import RangefinderConfig
from rangefinder.errors import RangefinderError
from rangefinder.formats import checkpoints
from rangefinder.formats.atomic import rename_into_place, write_json
from rangefinder.training.sinks import MetricSink
from rangefinder.training.spec import TrainSpec

if TYPE_CHECKING:
    from rangefinder.data.split import Split

__all__ = ["CANDIDATES", "DECISION", "HALVING_DIR", "HalvingDecision", "best_until", "halving_applies",
           "pause_update", "pick", "run_halving"]

HALVING_DIR = "halving"
DECISION = "halving.json"
_NOT_MOVED = {".rangefinder.lock"}  # the candidate folder's own lock stays with it


def halving_applies(enabled: bool, validating: bool, schedule: str, lr_mid: float, lr_high: float) -> bool:
    """Halving compares validation losses of two constant LRs: it needs validation, a constant schedule and an
    `lr_high` above `lr_mid` (a fixed LR collapses the bounds: nothing to compare)."""
    return enabled and validating and schedule == "constant" and lr_high > lr_mid * (1 + 1e-9)


def run_halving(cfg: RangefinderConfig, spec: TrainSpec, work: Path, *, lr_mid: float, lr_high: float,
                split: Optional[Split] = None, sink: Optional[MetricSink] = None) -> HalvingDecision:
    """Race `lr_mid` and `lr_high` to the pause (and `lr_below` where `lr_high` lost by the config's
    finetune.halving_below_margin) and move the kept one's run into `work`; returns the decision
    (halving.json): the kept candidate's name and LR, the pause, and each candidate's LR, best validation loss so
    far, where, its status and its curve. Goes on from whatever a killed attempt left. `split`: the one at
    spec.split_dir as the step read it; `spec.plan` gives the fine-tune's updates."""
    root = Path(work) / HALVING_DIR
    decision_path = root / DECISION
    decision = HalvingDecision.from_json(json.loads(decision_path.read_text())) if decision_path.is_file() else None
    if decision is not None:
        _check_same_race(decision, decision_path, lr_mid, lr_high)
    if decision is None:
        plan = spec.plan if spec.plan is not None else spec.plan_from(_read(spec))
        half = pause_update(plan.total_updates)
        lrs = {"lr_mid": lr_mid, "lr_high": lr_high, BELOW: below_lr(lr_mid, lr_high)}
        margin = cfg.finetune.halving_below_margin
        candidates: dict[str, HalvingCandidate] = {}
        runs: dict[str, str] = {}  # each candidate's MLflow child run, as it opened it
        for name in RACED:
            candidates[name] = _race(cfg, spec, root / name, sink, name, lrs[name], half, split, runs)
        pause = compared_at(half, candidates)  # half, unless no validation came before it
        candidates = {name: c.by(pause) for name, c in candidates.items()}
        rule = RULE
        if fires_below(candidates, margin):
            candidates[BELOW] = _race(cfg, spec, root / BELOW, sink, BELOW, lrs[BELOW], half, split, runs).by(pause)
            rule = f"{RULE}; lr_high lost by more than {margin:g}, so lr_below = lr_mid^2 / lr_high raced too"
        decision = HalvingDecision.decide(pause, candidates, rule)
        write_json(decision_path, decision.to_json())  # before anything moves: a killed step redoes only the move
        _tag_outcomes(sink, decision, runs)
    if not decision.moved:
        _move_up(root / decision.kept, Path(work))
        shutil.rmtree(root / decision.kept, ignore_errors=True)  # only its lock is left
        if sink is not None:
            replay_curve(sink, Path(work))
        for name in decision.candidates:
            if name != decision.kept:
                shutil.rmtree(root / name / checkpoints.RUN_DIR, ignore_errors=True)
        decision = decision.done_moving()
        write_json(decision_path, decision.to_json())
    return decision


def _check_same_race(decision: HalvingDecision, decision_path: Path, lr_mid: float, lr_high: float) -> None:
    """RangefinderError when the decision a folder holds raced other LRs than these: a retried step races the same
    ones, but a second fine-tune into the same folder (a notebook's second call with new bounds) went on from the
    first's decision, and trained and reported the first's LR for the bounds it was given."""
    raced = decision.candidates
    if all(name in raced and math.isclose(raced[name].lr, lr, rel_tol=1e-9)
           for name, lr in (("lr_mid", lr_mid), ("lr_high", lr_high))):
        return
    was = ", ".join(f"{name} {raced[name].lr:g}" for name in ("lr_mid", "lr_high") if name in raced)
    raise RangefinderError(f"{decision_path} is the race of another fine-tune ({was}), not of lr_mid {lr_mid:g} and "
                           f"lr_high {lr_high:g}; give this fine-tune a new folder, or delete that one")


def _race(cfg: RangefinderConfig, spec: TrainSpec, out_dir: Path, sink: Optional[MetricSink], name: str, lr: float,
          pause: int, split: Optional[Split], runs: dict[str, str]) -> HalvingCandidate:
    """One candidate's run to the pause (or on from where a killed attempt left it), in its own child run, whose id
    goes in `runs` (an MLflow run's)."""
    from rangefinder.launch.processes import run_training
    from rangefinder.tracking import StepRun

    with _candidate_run(cfg, sink, name, lr) as candidate_sink:
        if isinstance(candidate_sink, StepRun):
            runs[name] = candidate_sink.run_id
        result = run_training(cfg, spec.with_lr(lr), out_dir=out_dir, step_name=candidate_step(name),
                              pause_after_update=pause, split=split, metric_sink=candidate_sink)
    return HalvingCandidate.measured(lr, result.status, result.updates, result.curve["update"],
                                     result.curve["val_loss"], pause)


def candidate_step(name: str) -> str:
    """The step name of a candidate's child run (and of its spool): one per candidate, so that a retried step goes
    on in each candidate's own unfinished run."""
    return f"finetune_{name}"


def _candidate_run(cfg: RangefinderConfig, sink: Optional[MetricSink], name: str,
                   lr: float) -> contextlib.AbstractContextManager[Optional[MetricSink]]:
    """The candidate's child run under the fine-tune's run when that is an MLflow run, else the sink as it is."""
    from rangefinder.tracking import child_run
    from rangefinder.tracking.metrics import lr_text

    # Its `lr` tag as every LR tag is written (the range test's lr_mid, the parent's lr_used, the version's lr), so
    # one filter or sort finds it beside them.
    return child_run(cfg, sink, candidate_step(name), run_name=f"{name} lr {lr:.3g}",
                     tags={"halving.candidate": name, "lr": lr_text(lr)}, params={"lr": lr},
                     description=f"Successive halving candidate {name}: the fine-tune at lr {lr:.3g} to the pause.")


def _tag_outcomes(sink: Optional[MetricSink], decision: HalvingDecision, runs: dict[str, str]) -> None:
    """Each candidate's child run (`runs`: as the race opened it) says whether it was kept, in a tag and in its name
    (MLflow's chart legend), through the step's outbox: a server away since then gets them from the spool. (The runs
    were searched for on the server, which failed the step after both candidates trained when it was away.)"""
    from rangefinder.tracking import StepRun

    if not isinstance(sink, StepRun):
        return
    for name, candidate in decision.candidates.items():
        if name not in runs:
            continue
        outcome = "kept" if name == decision.kept else "dropped"
        why = (f"best val_loss {candidate.best_val_loss:.4g} by update {decision.pause_update}"
               if candidate.best_val_loss is not None else f"no val_loss by update {decision.pause_update}")
        sink.set_run_tags(runs[name], {
            "halving.outcome": outcome, "mlflow.runName": f"{name} lr {candidate.lr:.3g} ({outcome})",
            "mlflow.note.content": f"Successive halving candidate {name} at lr {candidate.lr:.3g}: {why}; "
            + ("kept: the fine-tune goes on with it." if outcome == "kept" else f"dropped for {decision.kept}.")})


def _read(spec: TrainSpec) -> Split:
    from rangefinder.data.split import read_split

    return read_split(spec.split_dir)


def _move_up(folder: Path, work: Path) -> None:
    """Every entry of the kept candidate's run into the work folder (a rename: the same file system); an entry a
    killed attempt already moved is not there to move again."""
    if not folder.is_dir():
        return
    for entry in sorted(folder.iterdir()):
        if entry.name in _NOT_MOVED:
            continue
        rename_into_place(entry, work / entry.name)


def replay_curve(sink: MetricSink, run_dir: Path) -> None:
    """Log a run's curve so far (updates.csv, metrics.csv) under the plain keys the engine logs live
    (training.UPDATE_METRICS per update, the MEASURED_PREFIXES columns per measurement).

    From the files, not the candidate's TrainResult: the result's curve is metrics.csv's columns only (not the
    per-update rows of updates.csv), and a step killed after the decision and before the move has no result in
    memory, only these files; two small CSVs read once per halving buy one path for both."""
    import csv

    from rangefinder.training.sinks import MEASURED_PREFIXES, UPDATE_METRICS

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
