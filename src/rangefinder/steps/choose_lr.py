"""Step `choose_lr`: the LR bounds the fine-tune uses, and where they came from.

The branches of the DAG end here: the first range test was readable, a zoom re-test was needed, the prodigy_step
LR finder read the step size a Prodigy run ended on (rangefinder.steps.prodigy_step_size; the bounds collapse onto
it), or a person fixed the LR (no discovery; the bounds collapse onto that LR), or an LR-free training.optimizer
(Prodigy) made discovery moot: it trains at its own LR multiplier (1.0 unless set). The step checks the numbers and
writes the decision down, with the reason discovery was skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rangefinder.config import FAMILY_NAMES, LR_FREE_OPTIMIZERS, ConfigLike, RangefinderConfig, as_config
from rangefinder.errors import RangefinderError
from rangefinder.formats.text import percent

SOURCES = ("range-test", "zoom", "prodigy-step", "fixed")


@dataclass(frozen=True)
class ChosenLR:
    lr_low: float
    lr_high: float
    lr_mid: float
    source: str


def run_choose_lr(cfg: ConfigLike, *, source: str, lr_low: float, lr_high: float, lr_mid: float,
                  decision_path: Optional[Path] = None, updates: int = 0, factor: float = 1.0) -> ChosenLR:
    """The bounds checked, and the decision written to `decision_path`. `updates` and `factor`: the prodigy-step
    source's run length (0: not said) and the factor its step size was multiplied by (ProdigyStep.factor), for the
    decision's text.
    `cfg`: a RangefinderConfig, or a dict of its sections (a notebook's, a YAML file's) validated as a config file
    is (rangefinder.config.as_config: ConfigError naming a bad setting); anything else is a TypeError."""
    cfg = as_config(cfg)  # a dict from a notebook is validated as a config file is
    if source not in SOURCES:
        raise RangefinderError(f"choose_lr source must be one of {', '.join(SOURCES)} (got {source!r})")
    for name, v in (("lr_low", lr_low), ("lr_high", lr_high), ("lr_mid", lr_mid)):
        if not (math.isfinite(v) and v > 0):
            raise RangefinderError(f"{name} = {v!r} from the {source} step is not a positive learning rate")
    if not lr_low <= lr_mid <= lr_high:
        raise RangefinderError(f"the bounds from the {source} step are out of order: "
                               f"lr_low {lr_low:g}, lr_mid {lr_mid:g}, lr_high {lr_high:g}")
    if not (math.isfinite(factor) and factor > 0):
        raise RangefinderError(f"the prodigy-step factor {factor!r} is not a positive number")
    if source == "prodigy-step" and not lr_low == lr_mid == lr_high:
        raise RangefinderError(f"the prodigy-step source gives one LR, the step size, as lr_low, lr_mid and lr_high "
                               f"(got {lr_low:g}, {lr_mid:g}, {lr_high:g}); pass the step size as all three")
    chosen = ChosenLR(float(lr_low), float(lr_high), float(lr_mid), source)
    if decision_path is not None:
        if source == "prodigy-step":
            why = prodigy_words(cfg, lr_mid, updates, factor)
        elif source == "fixed":
            why = skipped_because(cfg) or (f"fixed by hand; discovery skipped (lr_finder {cfg.lr_finder} has nothing "
                                           "to measure)")
        else:
            why = {"range-test": "read off the LR range test",
                   "zoom": "read off the zoomed (second) LR range test"}[source]
        Path(decision_path).write_text(
            "# Learning rate\n\n| lr_low | lr_mid | lr_high | source |\n|---|---|---|---|\n"
            f"| {lr_low:.3g} | {lr_mid:.3g} | {lr_high:.3g} | {why} |\n"
            f"\n{finetune_words(cfg, chosen)}\n"
        )
    return chosen


def finetune_words(cfg: RangefinderConfig, chosen: ChosenLR) -> str:
    """What the fine-tune will train with these bounds, as its spec (TrainSpec.finetune) and successive halving
    (steps.halving) will: one LR, a race between two or three, or a cycle between the bounds."""
    from rangefinder.steps.halving import halving_applies

    ft = cfg.finetune
    if chosen.lr_low == chosen.lr_high:  # collapsed bounds: trained constant, and halving has nothing to race
        return "The fine-tune trains at lr_mid (one constant LR, no successive halving)."
    if ft.schedule != "constant":
        return f"The fine-tune cycles between lr_low and lr_high ({ft.schedule} schedule)."
    if halving_applies(ft.successive_halving, cfg.validation.enabled(), ft.schedule, chosen.lr_mid, chosen.lr_high):
        below = ("" if ft.halving_below_margin is None else
                 f" lr_below = lr_mid^2 / lr_high joins the race where lr_high is more than "
                 f"{percent(ft.halving_below_margin)} behind lr_mid by then, and the lower of those two goes on.")
        return ("The fine-tune races lr_mid against lr_high (successive halving, constant schedule): both train half "
                "its epochs, and the one with the lower validation loss by then trains on." + below +
                " The fine-tune's report says which one it kept.")
    why = "successive halving is off" if not ft.successive_halving else "successive halving needs validation"
    return f"The fine-tune trains at lr_mid (constant schedule; {why})."


def prodigy_words(cfg: RangefinderConfig, lr: float, updates: int, factor: float = 1.0) -> str:
    """Where a prodigy-step LR `lr` came from: the step size of a Prodigy run of `updates` updates (0: not said), the
    factor the prodigy-step-size step multiplied it by (RangefinderConfig.prodigy_step_factor_for: the config's, or
    the base model's family's and the method's; the step size alone where it is 1), and the finder that measured
    it."""
    from rangefinder.analysis.prodigy_step import FACTOR_FROM_TABLE
    from rangefinder.training.family_detection import family_of

    run = f", {updates} updates" if updates else ""
    why = (f"prodigy_step_factor: {factor:g}, as set" if cfg.prodigy_step_factor is not None else
           f"{cfg.training.method} on this family trains at {factor:g} times the step size: {FACTOR_FROM_TABLE}")
    times = f" = {lr:.3g}{run}" if factor == 1 else f" = {lr / factor:.3g}{run}, times {factor:g} = {lr:.3g} ({why})"
    return f"read off a Prodigy run's final step size d x lr{times} ({finder_words(cfg, family_of(cfg.model))})"


def finder_words(cfg: RangefinderConfig, family: Optional[str]) -> str:
    """lr_finder as set, and under auto what it resolved to for this run's base model (of `family`, None: not known)
    and method."""
    if cfg.lr_finder != "auto":
        return f"lr_finder: {cfg.lr_finder}"
    if family is None:  # not resolved (a step run by hand on a config that did not pass resolve-config)
        return "lr_finder: auto"
    return (f"lr_finder: auto, which measures {cfg.training.method} on {FAMILY_NAMES[family]} with "
            f"{cfg.lr_finder_for(family)}")


def skipped_because(cfg: RangefinderConfig) -> Optional[str]:
    """Why the range test did not run, when the reason is the optimizer: an LR-free one estimates its own step size
    (d), so there is no LR to measure; it trains one constant run at its LR multiplier, without halving (a single
    LR has nothing to race). None for an LR fixed by hand."""
    optimizer = cfg.training.optimizer
    if optimizer not in LR_FREE_OPTIMIZERS or cfg.lr is not None:
        return None
    return (f"training.optimizer {optimizer} is LR-free (it estimates its own step size, logged as lr_effective): "
            f"range test skipped (lr_finder {cfg.lr_finder} has nothing to measure); one constant run at its lr "
            f"multiplier {cfg.pipeline_lr():g}, no halving")
