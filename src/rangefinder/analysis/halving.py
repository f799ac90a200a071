"""The successive halving's decision as a value: which of the fine-tune's two candidate LRs went on, and why.

The fine-tune step (rangefinder.steps.halving) races `lr_mid` against `lr_high` to half its updates and keeps the one
with the lower best validation loss so far; the step report (reports.py, plots.py) shows the race. `halving.json`
holds this value (`to_json`, `from_json`; its format on disk is the one the step has always written).

With `finetune.halving_below_margin` set, a race that `lr_high` lost by more than that margin gets a third candidate,
`lr_below` (`below_lr`: as far below `lr_mid` as `lr_high` is above it), to the same pause (`fires_below`); the pick is
then over all three (bench/RESULTS.md, "A third halving candidate below lr_mid").
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Optional, Union

from rangefinder.errors import RangefinderError

RACED = ("lr_mid", "lr_high")  # the two candidates every race trains
BELOW = "lr_below"  # the third, where lr_high lost by the margin
CANDIDATES = (*RACED, BELOW)  # in the order ties go
RULE = "the lower best validation loss by the pause goes on (ties: lr_mid)"

JSONValue = Union[None, bool, int, float, str, list["JSONValue"], dict[str, "JSONValue"]]


@dataclass(frozen=True)
class HalvingCandidate:
    """One candidate's run to the pause: its LR, how it ended, its updates, its best validation loss after update 0
    and at or before the pause (and where), and its curve as (update, val_loss) of every finite measurement."""

    lr: float
    status: str
    updates: int
    best_val_loss: Optional[float]
    best_update: Optional[int]
    curve: tuple[tuple[int, float], ...]

    @classmethod
    def measured(cls, lr: float, status: str, updates: int, update: Sequence[float], val_loss: Sequence[float],
                 pause: int) -> HalvingCandidate:
        curve = tuple((int(u), float(v)) for u, v in zip(update, val_loss, strict=True) if math.isfinite(v))
        best, at = best_until(curve, pause)
        return cls(lr=lr, status=status, updates=updates, best_val_loss=best, best_update=at, curve=curve)

    def by(self, update: int) -> HalvingCandidate:
        """The candidate with its best validation loss (and where) after update 0 and at or before `update`."""
        best, at = best_until(self.curve, update)
        return replace(self, best_val_loss=best, best_update=at)

    def to_json(self) -> dict[str, JSONValue]:
        return {"lr": self.lr, "status": self.status, "updates": self.updates, "best_val_loss": self.best_val_loss,
                "best_update": self.best_update, "curve": [[u, v] for u, v in self.curve]}

    @classmethod
    def from_json(cls, d: Mapping[str, JSONValue]) -> HalvingCandidate:
        best, at, curve = d.get("best_val_loss"), d.get("best_update"), d.get("curve") or []
        assert isinstance(curve, list)
        return cls(lr=_float(d["lr"]), status=str(d["status"]), updates=_int(d["updates"]),
                   best_val_loss=None if best is None else _float(best), best_update=None if at is None else _int(at),
                   curve=tuple((_int(p[0]), _float(p[1])) for p in curve if isinstance(p, list)))


@dataclass(frozen=True)
class HalvingDecision:
    """The race's outcome: where both paused, the kept candidate's name and LR, each candidate, and whether the kept
    run has been moved into the step's work folder yet (a step killed before that redoes only the move)."""

    pause_update: int
    kept: str
    lr: float
    candidates: dict[str, HalvingCandidate]
    moved: bool = False
    rule: str = RULE

    @classmethod
    def decide(cls, pause_update: int, candidates: dict[str, HalvingCandidate], rule: str = RULE) -> HalvingDecision:
        kept = pick(candidates)
        return cls(pause_update=pause_update, kept=kept, lr=candidates[kept].lr, candidates=candidates, rule=rule)

    def done_moving(self) -> HalvingDecision:
        return replace(self, moved=True)

    @property
    def extra_updates(self) -> int:
        """The updates the dropped candidates trained (what halving cost on top of the delivered run)."""
        return sum(c.updates for n, c in self.candidates.items() if n != self.kept)

    def to_json(self) -> dict[str, JSONValue]:
        return {"pause_update": self.pause_update, "kept": self.kept, "lr": self.lr,
                "candidates": {n: c.to_json() for n, c in self.candidates.items()}, "moved": self.moved,
                "rule": self.rule}

    @classmethod
    def from_json(cls, d: Mapping[str, JSONValue]) -> HalvingDecision:
        candidates = d["candidates"]
        assert isinstance(candidates, dict)
        return cls(pause_update=_int(d["pause_update"]), kept=str(d["kept"]), lr=_float(d["lr"]),
                   candidates={str(n): HalvingCandidate.from_json(c) for n, c in candidates.items()
                               if isinstance(c, dict)},
                   moved=bool(d.get("moved", False)), rule=str(d.get("rule", RULE)))


def pause_update(total_updates: int) -> int:
    """Where both candidates pause: half the fine-tune's updates (the engine pauses at the first validation at or
    after it)."""
    return max(1, math.ceil(total_updates / 2))


def compared_at(pause: int, candidates: Mapping[str, HalvingCandidate]) -> int:
    """The update the race compares its candidates' best losses by: the pause, or, when none of them validated between
    update 0 and it (validation every few epochs, and a pause before the first), the first update after it that one of
    them validated at. The engine pauses each candidate there, at its first validation at or after the pause (they
    validate at the same updates); by the pause alone none had a loss, and the race called them all diverged."""
    if any(best_until(c.curve, pause)[0] is not None for c in candidates.values()):
        return pause
    return min((u for c in candidates.values() for u, _ in c.curve if u > pause), default=pause)


def best_until(points: Sequence[Sequence[float]], update: int) -> tuple[Optional[float], Optional[int]]:
    """The lowest validation loss measured after update 0 and at or before `update`, and where."""
    seen = [(float(loss), int(u)) for u, loss in points if 0 < u <= update]
    if not seen:
        return None, None
    loss, at = min(seen)
    return loss, at


def below_lr(lr_mid: float, lr_high: float) -> float:
    """The third candidate's LR: `lr_mid` divided by the step from `lr_mid` to `lr_high` (their ratio), so the three
    are evenly spaced on a log scale."""
    return lr_mid * lr_mid / lr_high


def fires_below(candidates: Mapping[str, HalvingCandidate], margin: Optional[float]) -> bool:
    """Whether the race earns a third candidate below `lr_mid`: a margin is set, `lr_mid` measured a loss, and
    `lr_high` diverged, measured nothing, or its best loss by the pause is more than `margin` (a fraction) above
    `lr_mid`'s."""
    mid, high = candidates["lr_mid"], candidates["lr_high"]
    if margin is None or mid.status == "diverged" or mid.best_val_loss is None:
        return False
    if high.status == "diverged" or high.best_val_loss is None:
        return True
    return high.best_val_loss > mid.best_val_loss * (1 + margin)


def pick(candidates: Mapping[str, HalvingCandidate]) -> str:
    """The candidate that goes on. A diverged or unmeasured one cannot; when neither can, the step fails as an
    unhalved fine-tune would."""
    usable = {n: c for n, c in candidates.items() if c.status != "diverged" and c.best_val_loss is not None}
    if not usable:
        raise RangefinderError(
            f"both fine-tune candidates diverged or measured nothing before update {candidates['lr_mid'].updates} "
            f"(lr_mid {candidates['lr_mid'].lr:.3g}, lr_high {candidates['lr_high'].lr:.3g}); the range "
            "test's bounds are too high for this run: check its report, or set a fixed LR (fixed_lr)"
        )
    return min(usable, key=lambda n: (usable[n].best_val_loss, CANDIDATES.index(n)))


def _float(x: JSONValue) -> float:
    assert isinstance(x, (int, float)), x
    return float(x)


def _int(x: JSONValue) -> int:
    assert isinstance(x, (int, float)), x
    return int(x)
