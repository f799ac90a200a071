"""SIGTERM while training (a pod eviction, a spot preemption, a cancelled step): finish the update in flight, write
a checkpoint at it, say so in one line and stop with `Preempted`, so that the retry (or `--resume`) loses nothing.

Kubernetes sends SIGTERM, waits the pod's grace period (30 s by default), then SIGKILLs. The handler only sets a
flag; the loop reads it at each update boundary. With several processes the ranks may get the signal at different
updates (or only one may get it), so at each boundary they sum their flags (one all-reduce of one number) and all
stop at the same update: a checkpoint is written by all ranks together.

SIGINT (Ctrl-C) stops at once, with KeyboardInterrupt as ever (no checkpoint: the newest one is where a resume goes
on from); errors.on_sigint only makes sure the run ends as interrupted whatever error the signal surfaced as.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from rangefinder.training.run import Run


class StopRequest:
    """Set by SIGTERM; read at update boundaries (`agreed`)."""

    def __init__(self) -> None:
        self.at: Optional[float] = None  # time.monotonic() when the signal came

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.at is None:
            self.at = time.monotonic()
            # A bar's line ends in a carriage return, not a newline: in a log that is no terminal (a pod's, CI's,
            # `2> file`) this line was written onto the bar's. It starts a line of its own where a bar is shown.
            lead = "\n" if _bar_shown() else ""
            print(f"{lead}rangefinder: SIGTERM: finishing the current update, then writing a checkpoint",
                  file=sys.stderr, flush=True)

    def agreed(self, run: Run) -> bool:
        """Whether any process was asked to stop (the same answer on every rank: one collective, every rank calls
        it at every update boundary)."""
        if run.accelerator.num_processes == 1:
            return self.at is not None
        flag = torch.tensor([0.0 if self.at is None else 1.0], device=run.device)
        return bool(run.accelerator.reduce(flag, "sum").item() > 0)

    def since(self) -> str:
        """When the signal came, for the line that says the checkpoint is written."""
        if self.at is None:
            return "after another process got SIGTERM"
        return f"{time.monotonic() - self.at:.1f} s after the signal"


def _bar_shown() -> bool:
    """Whether a tqdm bar is open and drawn (the training loop's, or the encoding's)."""
    from tqdm import tqdm

    return any(not bar.disable for bar in list(getattr(tqdm, "_instances", ())))


@contextlib.contextmanager
def on_sigterm() -> Iterator[StopRequest]:
    """SIGTERM sets the request while inside; the previous handler is back after. Python delivers signals to the
    main thread only: a run in another thread keeps the process's handler (it cannot install one)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = signal.signal(signal.SIGTERM, request._handle)
    try:
        yield request
    finally:
        signal.signal(signal.SIGTERM, previous)
