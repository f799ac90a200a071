"""What a local run shows on the terminal while kfp.local runs the steps: a line per step as it starts and ends
(its duration and headline result) and, while a step trains, a live bar.

kfp.local runs each step in a subprocess and prints that subprocess's output line by line, as it comes (its
SubprocessRunner reads the pipe with `readline` in text mode, so tqdm's carriage-return updates arrive as lines).
`StepProgress` is the stream kfp.local prints into: everything goes on to the log file unchanged, and the lines
that mark a task's start and end ("Executing task 'x'", "Task 'x' finished with status ...", its outputs) and the
steps' own tqdm lines are read to draw the terminal's view. Nothing is added to the steps for this, so the same
tqdm lines are what a pod log shows on a cluster.

On a terminal the bar is redrawn in place (tqdm); anywhere else (a pipe, CI, a file) a plain line is written at most
every `plain_every` seconds, so logs stay short.
"""

from __future__ import annotations

import os
import re
import time
from typing import IO, Any, Optional

from rangefinder.tracking.outbox import AWAY_SAID, BACK_SAID

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_START = re.compile(r"Executing task '([^']+)'")
_END = re.compile(r"Task '([^']+)' finished with status (\w+)")
_OUTPUTS = re.compile(r"Task '([^']+)' outputs:")
_OUTPUT_LINE = re.compile(r"^\s{4}(\w+): (.*)$")
# A step's own warning (the training plan's, settings that cancel each other): said on the terminal once per run,
# under the first step that says it. The plan's are the same for every run of one batch and dataset, so the range
# test, its zoom and the fine-tune each print them (the fine-tune once per successive-halving run).
_WARNING = re.compile(r"rangefinder: warning: (.*)$")
# Except the outbox's lines of an MLflow outage: a server can go away again after it came back, and a step says the
# second outage in the first one's words (its spool folder, the first try's wait).
_OUTAGE = re.compile("|".join(re.escape(said.removeprefix("rangefinder: warning: ")).replace("%s", ".*")
                              for said in (AWAY_SAID, BACK_SAID)))
# tqdm's default format: "desc:  42%|████▏     | 10/24 [00:03<00:04,  3.1update/s, loss=0.2, lr=0.001]"
_BAR = re.compile(r"^\s*(?P<desc>[^|:]+?):\s+\d+%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)\s+"
                  r"\[(?P<elapsed>[^<\]]*)<(?P<eta>[^,\]]*)(?:,\s*[^,\]]*)?(?P<post>(?:,[^\]]*)?)\]")
# rangefinder's own bars (the engine's training, latent caching); libraries' loading bars stay in the log.
_OUR_BARS = re.compile(r"^(train|encode)\b")
# The outputs worth a line on the terminal, in the order shown; artifacts and the resolved config are left to the log.
HEADLINE = ("source", "lr", "lr_low", "lr_mid", "lr_high", "needs_zoom", "train_images", "val_images", "skipped_files",
            "halving_kept", "lr_used", "recommended_epochs", "chosen_epoch", "chosen_rule", "still_improving", "epochs",
            "model_uri")
# Read with needs_zoom, and said in its place (headline_text); not shown by name.
ZOOM_RANGE = ("zoom_lr_min", "zoom_lr_max")
BOUNDS = ("lr_low", "lr_mid", "lr_high")


def step_name(task: str) -> str:
    """kfp.local's task name without the suffixes it adds inside sub-DAGs (finetune-2 -> finetune)."""
    return re.sub(r"(-\d+)+$", "", task)


def _short(value: str) -> str:
    value = value.strip().strip("'")
    try:
        number = float(value)
    except ValueError:
        return value
    return str(int(number)) if number.is_integer() and abs(number) < 1e6 else f"{number:.3g}"


def headline_text(outputs: dict[str, str]) -> str:
    """A finished step's outputs as its terminal line says them, in HEADLINE's order. A range test's needs_zoom is
    said as what follows: its bounds are provisional, or none were read (the component's 0), and a zoomed test runs
    over zoom_lr_min..zoom_lr_max; without a zoom to follow, nothing is said of it."""
    phrases = {k: f"{k} {outputs[k]}" for k in HEADLINE if k in outputs}
    phrases.pop("needs_zoom", None)  # said as what it means, or not at all
    if outputs.get("needs_zoom") == "True":
        bounds = ", ".join(phrases[k] for k in BOUNDS if k in phrases and outputs[k] != "0")  # 0: none read
        for k in BOUNDS:
            phrases.pop(k, None)
        where = (f" over {outputs['zoom_lr_min']}..{outputs['zoom_lr_max']}"
                 if all(outputs.get(k) not in (None, "0") for k in ZOOM_RANGE) else "")
        phrases["needs_zoom"] = (f"{bounds} (provisional: a zoomed range test follows{where})" if bounds
                                 else f"no LR bounds read yet: a zoomed range test follows{where}")
    return ", ".join(phrases[k] for k in HEADLINE if k in phrases)


def _columns(terminal: Any) -> int:
    """The terminal's width in columns; 0 where it reports none or is no terminal."""
    try:
        return os.get_terminal_size(terminal.fileno()).columns
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return 0


class StepProgress:
    """A text stream: writes everything to `log`, and the run's progress to `terminal` (see the module doc)."""

    def __init__(self, log: IO[str], terminal: Any, *, plain_every: float = 30.0) -> None:
        self.log = log
        self.terminal = terminal
        self.live = bool(getattr(terminal, "isatty", lambda: False)())
        self.plain_every = plain_every
        self._held = ""
        self._started: dict[str, float] = {}
        self._ended: Optional[tuple[str, str, float]] = None  # task, status, seconds: waiting for its outputs
        self._running = ""  # the task whose lines are coming
        self._warned: set[str] = set()  # the warnings said, whichever step said them
        self._headline: dict[str, str] = {}  # the finished step's outputs worth saying, by name
        self._bar: Any = None
        self._bar_desc = ""  # the bar being drawn (a terminal) or last written (plain lines)
        self._last_plain = 0.0
        self._last_said = ""  # the last plain bar line: tqdm's close repeats a finished bar's last state

    # -- the stream --------------------------------------------------------------------------------------------------
    def write(self, text: str) -> int:
        self.log.write(text)
        self._held += text
        while "\n" in self._held:
            line, self._held = self._held.split("\n", 1)
            self._line(_ANSI.sub("", line).rstrip("\r"))
        return len(text)

    def flush(self) -> None:
        self.log.flush()

    def isatty(self) -> bool:
        return False  # what kfp.local prints is for the log: no colours, no in-place redraws there

    def close(self) -> None:
        """The end of the run: say what is still pending (a finished step whose outputs never came)."""
        self._close_bar()
        self._say_end()

    # -- reading kfp.local's lines -----------------------------------------------------------------------------------
    def _line(self, line: str) -> None:
        if self._ended is not None:
            m = _OUTPUT_LINE.match(line)
            if m and not _OUTPUTS.search(line):
                value = m.group(2).strip()
                name = m.group(1)
                if name in HEADLINE + ZOOM_RANGE and value not in ("", "''") and not re.match(r"\w+\(", value):
                    self._headline[name] = _short(value)
                return
            if _OUTPUTS.search(line):
                return
            if line.strip() and not line.startswith("    "):
                self._say_end()
        m = _START.search(line)
        if m:
            self._say_end()
            self._started[m.group(1)] = time.monotonic()
            self._running = m.group(1)
            self._say(f"rangefinder: {step_name(m.group(1))} started")
            return
        m = _WARNING.search(line)
        if m:
            said = m.group(1).strip()
            if said not in self._warned or _OUTAGE.fullmatch(said):  # several steps, runs, processes say it once each
                self._warned.add(said)
                self._close_bar()
                self._say(f"rangefinder:   {step_name(self._running)}: warning: {said}")
            return
        m = _END.search(line)
        if m:
            self._close_bar()
            task, status = m.group(1), m.group(2)
            self._ended = (task, status, time.monotonic() - self._started.get(task, time.monotonic()))
            self._headline = {}
            if status != "SUCCESS":  # no outputs follow a failure
                self._say_end()
            return
        m = _BAR.match(line)
        if m and _OUR_BARS.match(m.group("desc").strip()):
            self._bar_line(m)

    def _bar_line(self, m: re.Match[str]) -> None:
        n, total = int(m.group("n")), int(m.group("total"))
        desc = m.group("desc").strip()
        post = m.group("post").strip(", ")
        if self.live:
            if self._bar is None or desc != self._bar_desc or total != self._bar.total:
                self._close_bar()
                from tqdm import tqdm

                # tqdm sized to the terminal draws nothing on one that reports no size (0 x 0: a pseudo-terminal no
                # window sized, as `script` or `docker run -t` in CI give); there it draws 80 x 24.
                sized = _columns(self.terminal) > 0
                self._bar = tqdm(total=total, desc=f"  {desc}", unit="update", file=self.terminal,
                                 dynamic_ncols=sized, ncols=None if sized else 80, nrows=None if sized else 24,
                                 leave=False)
                self._bar_desc = desc
            self._bar.n = n
            self._bar.set_postfix_str(post, refresh=False)
            self._bar.refresh()
            return
        now = time.monotonic()
        if desc != self._bar_desc or now - self._last_plain >= self.plain_every or n == total:
            self._last_plain, self._bar_desc = now, desc
            eta = m.group("eta").strip()
            said = (f"rangefinder:   {desc}: {n}/{total}{f' ({post})' if post else ''}"
                    f"{f', eta {eta}' if eta and n < total else ''}")
            if n < total or said != self._last_said:  # two runs may start alike (successive halving's candidates)
                self._last_said = said
                self._say(said)

    # -- the terminal ------------------------------------------------------------------------------------------------
    def _close_bar(self) -> None:
        self._bar_desc = ""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _say_end(self) -> None:
        if self._ended is None:
            return
        task, status, seconds = self._ended
        self._ended = None
        if status == "SUCCESS":
            shown = headline_text(self._headline)
            result = f": {shown}" if shown else ""
            self._say(f"rangefinder: {step_name(task)} done in {seconds:.1f} s{result}")
        else:
            said = "failed" if status == "FAILURE" else status.lower()
            self._say(f"rangefinder: {step_name(task)} {said} after {seconds:.1f} s")

    def _say(self, text: str) -> None:
        print(text, file=self.terminal, flush=True)
