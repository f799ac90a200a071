"""Weights the fine-tune measured besides its checkpoints (the cooldown's, the window average), delivered instead of
the window's pick when they measure lower: one rule for both, so chosen.json reads the same whichever it was."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Optional, Protocol, cast

from rangefinder.analysis.step_window import Delivery, DeliveryRule
from rangefinder.formats import checkpoints
from rangefinder.formats.atomic import rename_into_place, write_json

PICK_KEYS = ("checkpoint", "update", "epoch", "val_loss", "rule", "reason")


class Measured(Protocol):
    """What the cooldown and the window average measured (steps/cooldown.Cooldown, steps/average.WindowAverage)."""

    @property
    def val_loss(self) -> Optional[float]: ...

    def delivered_over(self, val_loss: Optional[float]) -> bool: ...

    def sentence(self, val_loss: Optional[float], verdict: Optional[str] = None) -> str: ...

    def to_json(self) -> dict[str, Any]: ...


# What the cooldown's and the window average's sentences say when finetune.deliver: earliest_tied delivered a checkpoint
# (steps/finetune.keep_chosen_checkpoint): they set its band and are not offered.
NOT_OFFERED = ("not delivered: finetune.deliver is earliest_tied, which delivers the earliest checkpoint tied with the "
               "lowest loss measured")


def measures_lower(val_loss: Optional[float], compared: Optional[float]) -> bool:
    """The rule: measured weights are delivered when their validation loss is finite and below the one they are
    weighed against, or that one is not finite."""
    return val_loss is not None and (compared is None or val_loss < compared)


def measured_sentence(name: str, how: str, val_loss: Optional[float], compared: Optional[float],
                      verdict: Optional[str] = None) -> str:
    """A Measured's sentence, for the report and the run's description: "`name`: `how`;", then what it measured
    against the window's pick (`compared`) and whether it was delivered (`verdict`, when another rule decided that)."""
    if val_loss is None:
        return f"{name}: {how}; its validation loss was not finite, so the window's pick stays."
    against = "" if compared is None else f" against the window's pick's {compared:.4g}"
    verdict = verdict or ("delivered" if measures_lower(val_loss, compared)
                          else "not delivered: the window's pick stays")
    return f"{name}: {how}; validation loss {val_loss:.4g}{against}, {verdict}."


def deliver_if_lower(work: Path, candidate: Path, chosen: dict[str, Any], measured: Measured, *, key: str,
                     compared_as: str, rule: str, update: int, epoch: Optional[float], what: str) -> dict[str, Any]:
    """chosen.json with `measured` under `key` (and the loss it was weighed against under `compared_as`). When it
    measures below what `chosen` delivers, the model folder `candidate` becomes `chosen/` and chosen.json names it:
    rule `rule` at `update` / `epoch`, the pick it replaced under `window_pick`, the reason beginning with `what`.
    Otherwise `candidate` is removed. When `chosen` is finetune.deliver's earliest tied checkpoint, `measured` only set
    its band: it is weighed against the window's pick (`window_pick`), said, and not delivered. Returns what
    chosen.json now says.

    A retried step (a pod preempted after this ran, its work folder kept) finds `key` in chosen.json already: the
    decision stands, and only the move or removal it named is finished. chosen.json is written before the move, so an
    attempt stopped between the two leaves the decision to finish, never a moved model that chosen.json does not
    name."""
    work = Path(work)
    if key in chosen:
        finish_delivery(work, candidate, chosen[key].get("delivered"))
        return chosen
    offered = chosen.get("rule") != "earliest_tied"
    compared = chosen.get("val_loss") if offered else (chosen.get("window_pick") or {}).get("val_loss")
    delivered = offered and measured.delivered_over(compared) and candidate.is_dir()
    info = {**chosen, key: {**measured.to_json(), compared_as: compared, "delivered": delivered,
                            "sentence": measured.sentence(compared, None if offered else NOT_OFFERED)}}
    if delivered:
        pick = {k: chosen.get(k) for k in PICK_KEYS}
        ours = Delivery(update=update, rule=cast(DeliveryRule, rule), val_loss=measured.val_loss,
                        base_val_loss=chosen.get("base_val_loss"))
        # The pick's reason ends on its own loss against the base model's: said as the pick's, after the delivered
        # weights' own (a version's description read the pick's loss as that of the weights it holds).
        replaced = f" It replaced the window's pick: {pick['reason']}" if pick["reason"] else ""
        info.update(checkpoint=None, final_weights=False, update=update, epoch=epoch, val_loss=measured.val_loss,
                    rule=rule, window_pick=pick,
                    reason=f"{what}: {measured.sentence(compared)} {ours.against_base()}".rstrip() + replaced,
                    improved_on_base=ours.improved_on_base)
    write_json(work / checkpoints.CHOSEN_INFO, info)
    finish_delivery(work, candidate, delivered)
    return info


def finish_delivery(work: Path, candidate: Path, delivered: Optional[bool]) -> None:
    """Move the delivered `candidate` to `chosen/`, or remove one not delivered; nothing when it is gone already."""
    if not Path(candidate).is_dir():
        return
    if delivered:
        rename_into_place(candidate, Path(work) / checkpoints.CHOSEN_DIR)
    else:
        shutil.rmtree(candidate, ignore_errors=True)
