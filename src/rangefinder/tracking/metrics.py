"""A buffered metric sink: the engine's `log_metrics(metrics, step)` lands in MLflow in batches.

One REST round trip per update would cost a training step ~10 ms to a remote server for every metric; buffering and
sending `MlflowClient.log_batch` every `flush_every` values or `flush_seconds` seconds (and on close) makes logging
free for training. A failed flush keeps its values and tries again later (30 s, then ever longer up to 10 min), so a
server that blinks during a long run loses nothing and one that stays away stalls training once per try, for the
bounded time of one call (tracking/target.py's HTTP_LIMITS). With a spool (a step's run has one), values beyond
MAX_BUFFERED and whatever `close()` cannot send go there, on disk, for `rangefinder relog`; without one, `close()`
reports a server that stayed away.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from rangefinder.errors import TrackingError
from rangefinder.tracking.redaction import redact
from rangefinder.tracking.spool import MAX_METRICS_PER_BATCH, Spool

_log = logging.getLogger(__name__)

# Values held in memory while the server is away; older ones move to the spool. ~200 bytes each: 20 MB.
MAX_BUFFERED = 100_000
# Keys of validation measurements: always kept, whatever `every_updates` thins the per-update ones to.
VALIDATION_PREFIXES = ("val_", "stabilize_")


_BAD_NAME_CHARS = re.compile(r"[^\w\-. :/]")  # what MLflow accepts in a metric name


def metric_name(key: str) -> str:
    """`key` with characters MLflow refuses replaced by "_": one bad name must not block every later batch."""
    return _BAD_NAME_CHARS.sub("_", str(key)) or "_"


class BatchedMetricLogger:
    """Implements the engine's MetricSink. `step` is the update number; each value is timestamped when received.

    every_updates: keep per-update metrics only at updates divisible by it (TrackingConfig.log_every_updates);
    a call carrying any validation metric (val_*, stabilize_*) is kept whole.
    """

    def __init__(
        self,
        client: Any,
        run_id: str,
        *,
        every_updates: int = 1,
        flush_every: int = 500,
        flush_seconds: float = 10.0,
        spool: Optional[Spool] = None,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.spool = spool
        self.every_updates = max(1, int(every_updates))
        self.flush_every = max(1, int(flush_every))
        self.flush_seconds = float(flush_seconds)
        self._buffer: list = []
        self._last_flush = time.monotonic()
        self._warned = False
        self._retry_after = 0.0  # monotonic time before which a failed flush is not tried again
        self._retry_wait = 0.0
        self.sent = 0  # values delivered to MLflow so far
        self.spooled = 0  # values put in the spool instead
        self.closed = False

    def log_metrics(self, metrics: Mapping[str, Optional[float]], step: int) -> None:
        from mlflow.entities import Metric

        if self.closed:
            raise TrackingError(f"the metric logger of MLflow run {self.run_id} is closed; log before the step ends")
        step = int(step)
        if step % self.every_updates and not any(k.startswith(VALIDATION_PREFIXES) for k in metrics):
            return
        ts = int(time.time() * 1000)
        for key, value in metrics.items():
            if value is None:
                continue  # not measured at this step (an empty cell in the curve CSV)
            value = float(value)
            key = metric_name(key)
            # NaN/inf are kept: a diverged run's curve must show the divergence. MLflow stores them as such.
            self._buffer.append(Metric(key=key, value=value, timestamp=ts, step=step))
        now = time.monotonic()
        due = len(self._buffer) >= self.flush_every or now - self._last_flush >= self.flush_seconds
        if due and now >= self._retry_after:
            self.flush(raise_errors=False)
        if self.spool is not None and len(self._buffer) > MAX_BUFFERED:
            self._to_spool(len(self._buffer) - MAX_BUFFERED)  # the oldest, so the newest still go live

    def flush(self, *, raise_errors: bool = True) -> None:
        """Send what is buffered. With raise_errors=False a failure is logged once and the values are kept."""
        self._last_flush = time.monotonic()
        while self._buffer:
            chunk = self._buffer[:MAX_METRICS_PER_BATCH]
            try:
                self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)
            except Exception as e:  # mlflow has already retried transient errors (MLFLOW_HTTP_REQUEST_MAX_RETRIES)
                if raise_errors:
                    raise TrackingError(
                        f"could not send {len(self._buffer)} metric values to MLflow run {self.run_id} "
                        f"({redact(e).splitlines()[0][:300]}); the curves are still in the step's CSV files"
                    ) from None
                # Each failed try already spent mlflow's own retries; wait longer and longer (up to 10 min)
                # before the next, so a server that stays away does not stall training at every flush.
                self._retry_wait = min(600.0, max(30.0, 2 * self._retry_wait))
                self._retry_after = time.monotonic() + self._retry_wait
                if not self._warned:
                    _log.warning("MLflow metric logging failed; keeping %d values and retrying later: %s",
                                 len(self._buffer), redact(e).splitlines()[0][:300])
                    self._warned = True
                return
            del self._buffer[: len(chunk)]
            self.sent += len(chunk)
            self._retry_wait = 0.0

    def log_image(self, image: Any, artifact_file: Optional[str] = None, *, key: Optional[str] = None,
                  step: Optional[int] = None) -> None:
        """An image file, now (the engine's ImageSink: the samples rank 0 renders during a multi-process run), as
        StepRun.log_image logs it; kept in the spool when the server does not answer (or a failed metric flush says
        it is away), so training never waits on a server known to be down."""
        from rangefinder.tracking.spool import apply_record
        from rangefinder.tracking.target import server_unreachable

        if (artifact_file is None) == (key is None):
            raise ValueError("give either artifact_file or key")
        record = {"kind": "image", "run_id": self.run_id, "artifact_file": artifact_file, "key": key,
                  "step": int(step or 0), "path": str(Path(image).absolute())}
        if not self.failing:
            try:
                apply_record(self.client, record)
                return
            except Exception as e:
                if not server_unreachable(e):
                    raise
                _log.warning("MLflow image logging failed (%s); %s", redact(e).splitlines()[0][:300],
                             f"keeping the image in {self.spool.path}" if self.spool is not None else
                             f"{image} stays on disk only")
        if self.spool is not None:
            self.spool.append(record)

    @property
    def failing(self) -> bool:
        """The last try to send failed (the server is away, as far as this logger knows)."""
        return self._retry_wait > 0

    def _to_spool(self, n: int) -> None:
        assert self.spool is not None
        chunk = self._buffer[:n]
        self.spool.append({"kind": "metrics", "run_id": self.run_id,
                           "metrics": [[m.key, m.value, m.timestamp, m.step] for m in chunk]})
        del self._buffer[:n]
        self.spooled += n

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def close(self, *, send: bool = True) -> None:
        """Send what is buffered (`send=False`: the server is known to be away, do not try). With a spool, what
        cannot be sent goes there; without one, TrackingError says how many values were lost."""
        if self.closed:
            return
        try:
            if send:
                try:
                    self.flush(raise_errors=True)
                except TrackingError:
                    if self.spool is None:
                        raise
            if self._buffer:
                if self.spool is None:
                    raise TrackingError(f"{len(self._buffer)} metric values of MLflow run {self.run_id} were not "
                                        "sent; the curves are still in the step's CSV files")
                self._to_spool(len(self._buffer))
        finally:
            self.closed = True

    def __enter__(self) -> BatchedMetricLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

