"""What a training run changes as it goes: `RunState` (position, running train loss, status, the training RNG) and
`RunLog` (the rows of metrics.csv and updates.csv so far).

A checkpoint saves the state (checkpointing.py) and a resume puts it back, so a resumed run goes on exactly as if
it had never stopped. Everything else the loop uses is fixed once setup is done (run.Run).
"""

from __future__ import annotations

import csv
import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from rangefinder.formats.atomic import atomic_path


@dataclass
class RunState:
    """The loop's mutable state: where the run is, what it has measured, and the generator it draws from."""

    train_gen: torch.Generator  # all training randomness (flips, caption dropout, timesteps, noise); CPU, any device
    log: RunLog
    update: int = 0  # optimizer updates taken
    micro_batches_done: int = 0  # the position in the image stream (data.ImageStream)
    # Per-update train losses since the last metrics row: their sum and count (the row's train_loss is the mean).
    loss_sum: float = 0.0
    loss_count: int = 0
    status: str = "ok"  # "ok" | "diverged" | "paused" (set after the pause's checkpoint, never saved)
    resumed_from: Optional[int] = None  # the update this process resumed at (not saved)
    # When the run began (ISO-8601, UTC, to the second) and the title its deliverables carry: what their model spec
    # names as its date and title (formats/model_spec.py SpecFacts). Recorded once, when the run starts afresh, and
    # put back from its checkpoint by a resume, so a resumed run's files say what the uninterrupted run's say. An
    # empty `started`: unknown (a resume of an older rangefinder's checkpoint), and the files name no date.
    started: str = ""
    title: str = ""

    @classmethod
    def fresh(cls, seed: int, log: RunLog, title: str) -> RunState:
        """The state before the first update; `seed` is the run's seed plus the process rank."""
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return cls(train_gen=torch.Generator().manual_seed(seed), log=log, started=started, title=title)

    def add_update(self, row: dict[str, Any]) -> None:
        """Record one update's row of updates.csv (`train_loss` also counts towards the next metrics row)."""
        self.log.add_update(row)
        self.loss_sum += row["train_loss"]
        self.loss_count += 1

    def train_loss_since_row(self) -> Optional[float]:
        return self.loss_sum / self.loss_count if self.loss_count else None

    def start_row(self) -> None:
        """A metrics row was written: the next one averages the updates after it."""
        self.loss_sum, self.loss_count = 0.0, 0


class RunLog:
    """metrics.csv (rewritten whole, atomically, per row) and updates.csv (appended per update)."""

    def __init__(self, out_dir: Path, num_buckets: int, write: bool, extra_columns: Sequence[str] = ()) -> None:
        """`num_buckets`: validation's K timestep buckets; `extra_columns`: the per-aspect-bucket losses
        (validation.bucket_columns), after the contract's columns."""
        self.metrics_path, self.updates_path, self.write = out_dir / "metrics.csv", out_dir / "updates.csv", write
        buckets = [f"{s}_loss_b{k}" for s in ("val", "stabilize") for k in range(num_buckets)]
        self.metric_columns = ["update", "epoch", "lr", "train_loss", "val_loss", "stabilize_loss"] + buckets
        self.metric_columns += list(extra_columns)
        # lr_effective: the step size the update took (Prodigy's d*lr from before it, times its bias correction; the
        # schedule's lr for AdamW); prodigy_d_lr: Prodigy's d*lr after it, its estimate (empty for other optimizers)
        self.update_columns = ["update", "epoch", "lr", "train_loss", "grad_norm", "lr_effective", "prodigy_d_lr"]
        self.metrics_rows: list[dict[str, Any]] = []
        self.update_rows: list[dict[str, Any]] = []
        if write:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._rewrite_metrics()
            self._rewrite_updates()

    def restore(self, metrics_rows: list[dict], update_rows: list[dict]) -> None:
        self.metrics_rows, self.update_rows = list(metrics_rows), list(update_rows)
        if self.write:
            self._rewrite_metrics()
            self._rewrite_updates()

    def add_metrics(self, row: dict[str, Any]) -> None:
        self.metrics_rows.append(row)
        if self.write:
            self._rewrite_metrics()

    def add_update(self, row: dict[str, Any]) -> None:
        self.update_rows.append(row)
        if self.write:
            with open(self.updates_path, "a", newline="") as f:
                csv.DictWriter(f, self.update_columns).writerow(_cells(row, self.update_columns))

    def series(self, column: str) -> list[float]:
        return [float(r[column]) for r in self.rows_with(column)]

    def rows_with(self, column: str) -> list[dict]:
        return [r for r in self.metrics_rows if r.get(column) is not None]

    def _rewrite_metrics(self) -> None:
        _write_csv(self.metrics_path, self.metric_columns, self.metrics_rows)

    def _rewrite_updates(self) -> None:
        _write_csv(self.updates_path, self.update_columns, self.update_rows)


def _cells(row: dict, columns: list[str]) -> dict:
    # repr() round-trips a float exactly, so two runs' CSVs compare equal only if their numbers are bit-identical.
    return {c: ("" if row.get(c) is None else repr(row[c]) if isinstance(row[c], float) else row[c]) for c in columns}


def _write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        for r in rows:
            w.writerow(_cells(r, columns))
