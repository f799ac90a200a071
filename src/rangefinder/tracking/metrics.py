"""The engine's metric sink: `log_metrics(metrics, step)` values land in MLflow in batches, through the run's outbox.

One REST round trip per update would cost a training step ~10 ms to a remote server for every metric; the outbox
(tracking/outbox.py) buffers the values and sends them with `log_batch` every `flush_every` values or `flush_seconds`
seconds (and before any other record, and on close), so logging is free for training. A server that is away is the
outbox's business: the values go to the step's spool and reach MLflow in order when it answers again.

A step run that is continued (a retried step, tracking/runs.py) already holds the curve up to where its first attempt
got; `logged_through` names the last update each metric reached there, and values at or before it are not logged
again (the resumed run retraces those updates exactly), so MLflow's history holds each update once.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from rangefinder.errors import TrackingError
from rangefinder.tracking.outbox import Outbox
from rangefinder.tracking.spool import mlflow_key

# Keys of validation measurements: always kept, whatever `every_updates` thins the per-update ones to.
VALIDATION_PREFIXES = ("val_", "stabilize_")


def is_lr_key(key: str) -> bool:
    """A decision that is a learning rate: `lr` or `lr_*` as the last part of its dotted key (lr_low,
    halving.lr_mid.lr, ...), never lr_source (a word, not a number)."""
    last = key.rsplit(".", 1)[-1]
    return last == "lr" or last.startswith("lr_")


def lr_text(lr: float) -> str:
    """An LR as a tag: 4 significant digits in scientific notation (2.091e-04), as readable as it is exact enough
    to sort and compare by."""
    return f"{lr:.3e}"


_BAD_NAME_CHARS = re.compile(r"[^\w\-. :/]")  # what MLflow accepts in a metric name
# A tag value that may go into a search filter between single quotes as it is (tracking/runs.py hashes a longer or
# odder key; tracking/registry.py does not search by one).
SAFE_TAG_VALUE = re.compile(r"^[\w.:/@+ -]{1,200}$")

# The chart section the validation losses (val_loss and its per-bucket val_loss_*) are logged under, so that a
# run's page opens on its val_loss chart. MLflow 3.17's run page (Model metrics tab) groups charts into sections by
# the key's part before its last "/", orders the named sections alphabetically and then the unprefixed keys'
# "Model metrics" section, and each section's charts by key; a chart's title is the part after the "/". With the
# validation losses the one named section of a training run, "validation/val_loss" is its first chart, titled
# val_loss; everything else (train_loss, lr, stabilize_loss, decisions) follows under "Model metrics". The key is
# the same on every run that trains (range tests, the fine-tune, its halving candidates) and is the only MLflow key
# of the quantity; curve CSVs and reports keep their plain column names.
VALIDATION_SECTION = "validation/"


def metric_name(key: str) -> str:
    """`key` with characters MLflow refuses replaced by "_", and cut where longer than MLflow keeps (mlflow_key): one
    bad name must not block every later batch, and a key over 250 characters failed the step."""
    return mlflow_key(_BAD_NAME_CHARS.sub("_", str(key)) or "_")


def curve_metric_name(key: str) -> str:
    """The MLflow key of one of the engine's per-update values: the validation losses under VALIDATION_SECTION."""
    key = metric_name(key)
    return VALIDATION_SECTION + key if key == "val_loss" or key.startswith("val_loss_") else key


class BatchedMetricLogger:
    """Implements the engine's MetricSink and ImageSink. `step` is the update number; each value is timestamped when
    received.

    every_updates: keep per-update metrics only at updates divisible by it (TrackingConfig.log_every_updates);
    a call carrying any validation metric (val_*, stabilize_*) is kept whole.
    """

    def __init__(self, outbox: Outbox, *, every_updates: int = 1,
                 logged_through: Optional[Mapping[str, int]] = None) -> None:
        self.outbox = outbox
        self.run_id = outbox.run_id
        self.every_updates = max(1, int(every_updates))
        self.logged_through = dict(logged_through or {})
        self.closed = False

    @property
    def sent(self) -> int:
        """Metric values delivered to MLflow so far."""
        return self.outbox.sent

    @property
    def pending(self) -> int:
        return self.outbox.pending

    def log_metrics(self, metrics: Mapping[str, Optional[float]], step: int) -> None:
        if self.closed:
            raise TrackingError(f"the metric logger of MLflow run {self.run_id} is closed; log before the step ends")
        step = int(step)
        if step % self.every_updates and not any(k.startswith(VALIDATION_PREFIXES) for k in metrics):
            return
        ts = int(time.time() * 1000)
        rows = []
        for key, value in metrics.items():
            if value is None:
                continue  # not measured at this step (an empty cell in the curve CSV)
            key = curve_metric_name(key)
            if step <= self.logged_through.get(key, -1):
                continue  # the first attempt of this run logged it already
            # NaN/inf are kept: a diverged run's curve must show the divergence. MLflow stores them as such.
            rows.append([key, float(value), ts, step])
        if rows:
            self.outbox.add_metrics(rows)

    def flush(self) -> None:
        self.outbox.flush()

    def log_image(self, image: Any, artifact_file: Optional[str] = None, *, key: Optional[str] = None,
                  step: Optional[int] = None) -> None:
        """An image file (the samples rank 0 renders during a multi-process run), as StepRun.log_image logs it."""
        if (artifact_file is None) == (key is None):
            raise ValueError("give either artifact_file or key")
        self.outbox.send({"kind": "image", "run_id": self.run_id, "artifact_file": artifact_file, "key": key,
                          "step": int(step or 0), "path": str(Path(image).absolute())})

    def close(self) -> None:
        """Send what is buffered (or spool it while the server is away)."""
        if self.closed:
            return
        try:
            self.outbox.flush()
        finally:
            self.closed = True

    def __enter__(self) -> BatchedMetricLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
