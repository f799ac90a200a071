"""The one way a step's records reach MLflow: sent now, or kept in the spool and sent in order when the server answers.

A step's own run (tracking/runs.py StepRun) and the multi-process workers' metric sink (tracking/metrics.py) each hand
every record (tracking/spool.py: metrics, params, tags, artifacts, images, the run's end) to an `Outbox`, which holds
the one policy for a server that does not answer:

- Send now while the server answers and nothing waits in the spool. The first call that finds it away costs that
  call's bounded time (tracking/target.py HTTP_LIMITS), no more: training is never held on a dead server.
- From then on every record goes to the spool (on disk, fsynced), in the order it was logged; the server is tried
  again after 30 s, then 60, 120, ... up to every 10 minutes, so a server away for long costs training one bounded
  call per try, and fewer and fewer of them.
- One warning line, when the spool is started, says the server is away and where the records are kept. The spool is
  shared by every process of the step (it is named by the step and the run), so a worker's records wait behind those
  the step's process kept. A training worker logs into one of the step's runs from a process of its own, whose first
  record can start another spool than the step's process starts: the runs that said the outage are written in the
  spool folder (spool.AWAY_MARKER), so one outage gets one line whether one process trains or several.
- A server that answers refusing the step's credentials (HTTP 401, or 403 for a user without permission: its admin
  changed the password while the step ran) is no outage, but nothing the step could do now would get its records in:
  they wait in the spool the same way, tried again on the same schedule, and the one line says the credentials were
  refused and names the variables to set (tracking/target.py refusal_message), never their values.
- A step with child runs (the fine-tune's halving candidates and cooldown: tracking/runs.py child_run) has an outbox
  and a spool per run, and one `StepLink` that they share in its process: one outage is one try's cost, one line
  naming the step's spool folder, and, when a try gets an answer, one line saying what was sent of all its runs.
- A try that gets an answer first sends the whole spool (every spool of the step's runs), oldest first, then the new
  record: MLflow gets everything in the order it was logged. At its end a step waits up to
  `tracking.server_wait_seconds` for the server (StepRun.finish); what is still not sent stays in the spool for
  `rangefinder relog`.

Metric values are buffered and sent in batches (one `log_batch` per `flush_every` values or `flush_seconds`); the
buffer is flushed before any other record, so the order holds for them too. Appends and replays of a spool take a
lock on its folder: two processes never replay one spool at once, and nothing is appended while a replay rewrites it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rangefinder.errors import TrackingError
from rangefinder.tracking.redaction import error_line, safe_uri
from rangefinder.tracking.spool import (
    MAX_METRICS_PER_BATCH,
    RunNotMadeYet,
    Spool,
    apply_record,
    describe,
    replay,
    said_away,
    write_said_away,
)
from rangefinder.tracking.target import (
    CredentialsRefused,
    HostRefused,
    await_tracking_server,
    away_reason,
    host_refused,
    refusal_message,
    refused_credentials,
    server_unreachable,
    store_error,
)

_log = logging.getLogger(__name__)

# What a step says of an outage: once when its spool starts, once when the spool is sent. Warning lines
# (`rangefinder: warning: ...`), which a local run's terminal shows under the step (pipelines/progress.py), as a pod's
# log shows them: the terminal said nothing of a server that went away and came back.
AWAY_SAID = ("rangefinder: warning: MLflow at %s is not answering (%s); step %s goes on, keeps what it logs in %s and "
             "sends it in order when the server answers (next try in %s, then less and less often)")
# A server that answers but no longer takes the step's credentials (its admin changed the password while the step
# ran): no outage, though the records wait the same way, for the same tries; said with the variables to set.
REFUSED_SAID = ("rangefinder: warning: %s; step %s goes on, keeps what it logs in %s and sends it in order once the "
                "server takes the step's %s again (next try in %s, then less and less often), or run "
                "`rangefinder relog` on that folder %s")
BACK_SAID = "rangefinder: warning: MLflow at %s answers again: step %s sent what it had kept in %s: %s"

FIRST_RETRY_S = 30.0  # after the first failure; doubled after each failed try
MAX_RETRY_S = 600.0
WRITE_RETRY_S = 1.0  # at a step's end, between tries of a store that answers its check but not the writes


class StepLink:
    """One step's MLflow server as the outboxes of its runs see it, in one process: the step's own run (the first
    outbox made with it) and its child runs. An outage is the step's, not each run's: one failed try holds every run's
    records until the next try is due, the line that says the server is away is said once, naming the step's spool
    folder, and the try that gets an answer sends every run's spool (an ended child's too) and says so once."""

    def __init__(self) -> None:
        self.outboxes: list[Outbox] = []  # the step's own run's first, then its child runs' as they open
        self.retry_wait = 0.0  # 0: the server answered the last try (or was never tried)
        self.retry_at = 0.0  # monotonic time before which nothing is tried
        self.reason = ""
        self.refused = False  # the last try's answer refused the credentials (target.refused_credentials)
        self.host_refused = False  # ... or, with the same 403, the Host header (target.host_refused)
        self.said_away = False  # the away line is said for the outage going on

    @property
    def spool_dir(self) -> Path:
        return self.outboxes[0].spool.path.parent

    @property
    def step(self) -> str:
        return self.outboxes[0].spool.step

    @property
    def run_ids(self) -> set[str]:
        """The runs this process logs to for the step: its own run's and its child runs' (AWAY_MARKER's lines)."""
        return {o.run_id for o in self.outboxes}


class Outbox:
    """The records of one MLflow run, from one process: sent now, or spooled and sent in order later. `link`: the
    step's, when this run is one of its child runs (a new one otherwise: the step's own run)."""

    def __init__(self, client: Any, spool: Spool, *, flush_every: int = 500, flush_seconds: float = 10.0,
                 link: StepLink | None = None) -> None:
        self.client = client
        self.spool = spool
        self.run_id = spool.run_id
        self.flush_every = max(1, int(flush_every))
        self.flush_seconds = float(flush_seconds)
        self.sent = 0  # metric values this process sent live (not those it spooled)
        self._metrics: list[list[Any]] = []  # [key, value, timestamp ms, step], not sent yet
        self._last_flush = time.monotonic()
        self.link = link if link is not None else StepLink()
        self.link.outboxes.append(self)
        self.refused = False  # MLflow refused a record of this spool, sent with another run's: left for a relog

    # --- what callers see

    @property
    def away(self) -> bool:
        """The last try (of any run of the step) to reach the server failed."""
        return self.link.retry_wait > 0

    @property
    def holding(self) -> bool:
        """Records wait: the last try failed, or a spool of the step's runs (any process's) holds records."""
        return self.away or any(o.spool.exists() for o in self.link.outboxes)

    @property
    def leads(self) -> bool:
        """This is the step's own run's outbox, not one of its child runs'."""
        return self.link.outboxes[0] is self

    @property
    def pending(self) -> int:
        """Metric values buffered in memory."""
        return len(self._metrics)

    def add_metrics(self, rows: list[list[Any]]) -> None:
        """Buffer metric values ([key, value, timestamp ms, step] each); send them when a batch is due."""
        self._metrics.extend(rows)
        if len(self._metrics) >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Send the buffered metric values (or spool them while the server is away)."""
        self._last_flush = time.monotonic()
        while self._metrics:
            chunk, self._metrics = self._metrics[:MAX_METRICS_PER_BATCH], self._metrics[MAX_METRICS_PER_BATCH:]
            if self._send({"kind": "metrics", "run_id": self.run_id, "metrics": chunk}):
                self.sent += len(chunk)

    def send(self, record: Mapping[str, Any]) -> None:
        """Log one record: after the metric values logged before it, now or through the spool."""
        self.flush()
        self._send(record)

    def wait_for_server(self, seconds: float) -> bool:
        """If records wait, probe the server every few seconds for up to `seconds` and, once it answers, send them.
        Returns whether nothing waits any more."""
        self.flush()
        if not self.holding:
            return True
        deadline = time.monotonic() + seconds
        while True:
            try:
                await_tracking_server(self.client.tracking_uri, max(0.0, deadline - time.monotonic()))
                self._drain()
                break
            except Exception as e:
                # A step's end must not fail on logging: a server that refuses (or a spooled record it refuses)
                # leaves the records in the spool, and the step's last warning names them and the relog command.
                if not (is_away_error(e) or isinstance(e, TrackingError)):
                    raise
                # A store whose check answers while its writes do not (a SQLite file another program holds locked:
                # the check only reads; a server answering 503 to writes) is waited for as long as one that does
                # not answer at all: the step tried once and left its records for a relog.
                away = isinstance(e, _StillAway) or server_unreachable(e)  # a refusal is not waited out
                if away and time.monotonic() + WRITE_RETRY_S < deadline:
                    time.sleep(WRITE_RETRY_S)
                    continue
                self._failed(e)  # not tried again at once: what follows goes to the spool
                return False
        self._answered()
        return not self.holding

    # --- the policy

    def _send(self, record: Mapping[str, Any]) -> bool:
        """True when `record` reached MLflow now, False when it went to the spool."""
        if time.monotonic() >= self.link.retry_at:
            try:
                if self._drain():
                    apply_record(self.client, record, folder=self.spool.path.parent)
                    self._answered()
                    return True
            except Exception as e:
                if store_error(e) and not is_away_error(e):
                    # A query the store refuses for the record's own sake, under the code of an outage: spooled, it
                    # was tried at every try and every relog, for ever.
                    raise TrackingError(
                        f"the MLflow store {safe_uri(self.client.tracking_uri)} refused a {record['kind']} record of "
                        f"run {record['run_id']} ({error_line(e, 300)}), which no wait gets in; change the value or "
                        "the store (its column's character set, its limits), then run the step again") from None
                if not is_away_error(e):
                    raise
                self._failed(e)
        self._append(record)
        return False

    def _drain(self) -> bool:
        """Send what the spools of the step's runs hold, each oldest first: the child runs' in the order they were
        made (MLflow starts a run made from a spool when it gets it, and lists a step's candidates by that start), then
        the step's own, whose records name them. True when this run's spool is empty now; False when another process
        is sending it (this record then waits behind it). Raises what the server's absence raised."""
        if not any(o.spool.exists() for o in self.link.outboxes):
            return True
        sent: Counter = Counter()
        runs = 0
        own, *children = self.link.outboxes
        for outbox in (*children, own):
            if outbox.refused and outbox is not self:
                continue
            with outbox._locked(blocking=False) as held:
                if not held or not outbox.spool.exists():
                    continue  # another process sends it, or it was sent (a record naming its run pulled it in)
                try:
                    result = replay(outbox.spool.path, outbox.client)
                except TrackingError as e:
                    if outbox is self:
                        raise
                    # Another run's record MLflow refuses (its run deleted meanwhile): this run's records do not
                    # wait behind it, nor fail the step; the step's end names the spool for `rangefinder relog`.
                    outbox.refused = True
                    _log.warning("rangefinder: warning: %s; step %s goes on, and leaves the rest of that spool for "
                                 "`rangefinder relog`", e, self.link.step)
                    continue
            if result.left and result.refused is not None:  # an answer, said as the refusal it is (_failed)
                refused = HostRefused if result.host else CredentialsRefused
                raise refused(refusal_message(self.client.tracking_uri, result.refused, result.host), result.refused)
            if result.left:
                raise _StillAway(f"the server stopped answering again with {describe(result.left)} left to send")
            sent.update(result.sent)
            runs += 1
        if runs:
            what = describe(sent) + (f", for {runs} runs" if runs > 1 else "")
            _log.warning(BACK_SAID, safe_uri(self.client.tracking_uri), self.link.step, self.link.spool_dir, what)
            self.link.said_away = False  # the outage is over (this run's spool may wait on another process's send)
            ours = self.link.run_ids
            with spool_lock(self.link.spool_dir):  # and said over: the next one is said again, by any process
                write_said_away(self.link.spool_dir,
                                [line for line in said_away(self.link.spool_dir) if not line & ours])
        return not self.spool.exists()

    def _failed(self, e: BaseException | None) -> None:
        link = self.link
        status = refused_credentials(e) if e is not None else None
        link.refused = status is not None
        link.host_refused = e is not None and status is not None and host_refused(e)
        if status is not None:
            link.reason = refusal_message(self.client.tracking_uri, status, link.host_refused)
        elif e is not None and server_unreachable(e):
            link.reason = away_reason(e)
        elif e is not None:  # a replay cut off, a run not made yet, a record refused at the step's end: its words
            link.reason = error_line(e, 300)
        link.retry_wait = min(MAX_RETRY_S, max(FIRST_RETRY_S, 2 * link.retry_wait))
        link.retry_at = time.monotonic() + link.retry_wait

    def _answered(self) -> None:
        # The outage is over, whoever sent what it kept (`rangefinder relog` may have): the next one is said again.
        self.link.retry_wait, self.link.retry_at, self.link.said_away, self.link.refused = 0.0, 0.0, False, False
        self.link.host_refused = False

    def _append(self, record: Mapping[str, Any]) -> None:
        say = False
        with self._locked(blocking=True):
            new = not self.spool.exists()
            # Read before this spool starts: a line of ours whose spools are all gone was said of an outage over.
            said = said_away(self.spool.path.parent) if new else []
            self.spool.append(record)
            if new:  # a spool started: the outage is said here unless another process of the step said it
                ours = self.link.run_ids
                with_ours = [line for line in said if line & ours]
                say = not self.link.said_away and not with_ours
                # Written where this process says it now or joins a line said: where it said an outage whose spools
                # another process has sent since (it has not tried the server again), a line of its own would silence
                # the step's other processes in the next outage, which it never said.
                if say or with_ours:
                    write_said_away(self.spool.path.parent,
                                    [line for line in said if not line & ours] + [ours.union(*with_ours)])
        # Said by the process that starts a spool (not again by a worker appending to the step's, nor by one whose
        # run another process said it of), once per outage of the step whichever of its runs' spools starts first.
        if new:
            self.link.said_away = True
        if say:
            wait = f"{self.link.retry_wait:.0f} s" if self.away else "a moment"
            if self.link.refused:
                what, relog = (("Host header", "once it does") if self.link.host_refused else
                               ("credentials", "with credentials it takes"))
                _log.warning(REFUSED_SAID, self.link.reason, self.link.step, self.link.spool_dir, what, wait, relog)
                return
            _log.warning(AWAY_SAID, safe_uri(self.client.tracking_uri), self.link.reason or "no answer",
                         self.link.step, self.link.spool_dir, wait)

    def _locked(self, *, blocking: bool) -> contextlib.AbstractContextManager[bool]:
        return spool_lock(self.spool.path.parent, blocking=blocking)


@contextlib.contextmanager
def spool_lock(folder: Path, *, blocking: bool = True) -> Iterator[bool]:
    """An exclusive lock on a spool folder, shared by every process of a step and by `rangefinder relog` (flock: a
    killed holder leaves no lock behind). Yields False when `blocking` is off and another process holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class _StillAway(Exception):
    """A replay that stopped part-way because the server stopped answering again."""


def is_away_error(e: BaseException) -> bool:
    """The server did not answer (as opposed to refusing a record, which is raised to the caller), the record's run
    is not made yet (a child run made from another spool when the server answers), or the server refused the
    credentials (refused_credentials: records the same credentials sent a moment before; they wait for ones it takes,
    where raising failed the step's training with MLflow's traceback)."""
    return isinstance(e, (_StillAway, RunNotMadeYet)) or server_unreachable(e) or refused_credentials(e) is not None
