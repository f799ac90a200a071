"""The fine-tune's window average: the checkpoints inside the step window, averaged, measured, delivered when lower.

Inside the step window a constant-LR run wanders along the floor of its valley: each checkpoint there carries the
noise of the constant step size, and the window's pick is the luckiest of them on the validation set. The uniform
average of the same checkpoints cancels much of that noise without training anything (averaging the tail of an SGD
run: Izmailov et al. 2018, "Averaging Weights Leads to Wider Optima and Better Generalization"; latest weight
averaging over checkpoints: Kaddour 2022; Hägele et al. 2024 find such averages close much of the gap a final LR
cooldown closes). It has no setting of its own: the window, which the step measured anyway, says which checkpoints.

Once the window is known (`finetune.average: on`), before the other checkpoints are removed:
- every kept checkpoint whose update lies inside the window (window_start_update .. window_end_update) is read and
  their trained tensors averaged uniformly (LoRA's factors and textual inversion's vectors each averaged as stored;
  with no window, or fewer than 2 checkpoints in it, nothing is done);
- the average is validated once on the fine-tune's own terms (training.loop.measure_weights: the same images, fixed
  timesteps and noise as the run's curve), and its model written as the run writes `final/`;
- it is delivered when its validation loss is below the window's pick (`deliver`); otherwise the pick stays and
  chosen.json says what the average measured.

Cost: reading the window's checkpoints and one validation, no training. Where things are, in the step's work folder:
`average/` holds the measurement's metrics.csv, `average.json` (which checkpoints, the loss) and, until delivered or
dropped, the averaged model as `final/`. average.json is written last, so a retried step measures again unless it
finds it. With EMA or a schedule-free optimizer the run already validates and delivers averaged weights, and the
step does not average again.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rangefinder.config import RangefinderConfig
from rangefinder.formats import checkpoints
from rangefinder.formats.atomic import write_json
from rangefinder.training.spec import TrainSpec

if TYPE_CHECKING:
    import torch

    from rangefinder.analysis import StepWindow
    from rangefinder.data.split import Split
    from rangefinder.models.loading import ResolvedModel

AVERAGE_DIR = "average"
MEASURED = "average.json"


@dataclass(frozen=True)
class WindowAverage:
    """What the window average took and measured (average.json): the candidate offered for delivery (`updates`,
    `val_loss`: the uniform average of the window's checkpoints, or the greedy soup when that measured lower) and,
    when a soup was tried, what the uniform average measured and how many tries the soup made."""

    updates: tuple[int, ...]  # the checkpoints averaged, by update
    val_loss: Optional[float]  # its validation loss; None when it was not finite
    how: str = "uniform"  # "uniform" (every checkpoint in the window) or "greedy_soup"
    window_updates: tuple[int, ...] = ()  # every checkpoint in the window (the uniform average's)
    uniform_val_loss: Optional[float] = None  # the uniform average's loss (the same as val_loss when how is uniform)
    soup_tries: int = 0  # soup candidates measured (0: no soup)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "updates": list(self.updates), "window_updates": list(self.window_updates)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WindowAverage:
        updates = tuple(int(u) for u in data["updates"])
        return cls(updates=updates, val_loss=data["val_loss"], how=data.get("how", "uniform"),
                   window_updates=tuple(int(u) for u in data.get("window_updates", updates)),
                   uniform_val_loss=data.get("uniform_val_loss", data["val_loss"]),
                   soup_tries=int(data.get("soup_tries", 0)))

    def delivered_over(self, pick_val_loss: Optional[float]) -> bool:
        """Whether the average is delivered instead of the window's pick: it measures lower."""
        from rangefinder.steps.delivery import measures_lower

        return measures_lower(self.val_loss, pick_val_loss)

    def sentence(self, pick_val_loss: Optional[float], verdict: Optional[str] = None) -> str:
        """What it averaged and whether it was delivered (`verdict`, when another rule decided that), for the report
        and the run's description."""
        from rangefinder.steps.delivery import measured_sentence

        window = self.window_updates or self.updates
        how = (f"the {len(window)} checkpoints inside the step window (updates {window[0]} to {window[-1]}) "
               "averaged uniformly")
        if self.how == "greedy_soup":
            how = (f"the greedy soup of {len(self.updates)} of the window's checkpoints (updates "
                   f"{', '.join(map(str, self.updates))}; {self.soup_tries} tried in order of validation loss), "
                   f"below {how} ({_loss(self.uniform_val_loss)})")
        elif self.soup_tries:
            how += f" (a greedy soup, {self.soup_tries} tried, measured no lower)"
        return measured_sentence("Window average", how, self.val_loss, pick_val_loss, verdict)


def average_label(average: dict[str, Any]) -> str:
    """What delivered weights chosen.json's `average` describes are, in a few words (the sample grid's label, the
    registered model's `rangefinder.weights`): "average of updates a-b" or "greedy soup of updates a, b, c"."""
    updates = average.get("updates") or []
    if average.get("how") == "greedy_soup":
        return f"greedy soup of updates {', '.join(map(str, updates))}"
    return f"average of updates {updates[0]}-{updates[-1]}" if updates else "window average"


def _loss(value: Optional[float]) -> str:
    return "not finite" if value is None else f"{value:.4g}"


def average_applies(cfg: RangefinderConfig, validating: bool) -> bool:
    """finetune.average on, with validation (the average is delivered only when it measures lower), a run that
    validates its raw weights (not EMA's or a schedule-free optimizer's averages, which it would average again), and
    a step that trains in its own pod (`not_on_several_nodes`)."""
    from rangefinder.training.family_detection import family_of

    tc = cfg.training
    return (cfg.finetune.average == "on" and validating and not tc.validates_averaged_weights(family_of(cfg.model))
            and not not_on_several_nodes(cfg))


def not_on_several_nodes(cfg: RangefinderConfig) -> Optional[str]:
    """Why the average is not measured on a TrainJob of several nodes (None otherwise): the step's own pod only
    submits it (1 CPU, 4 GiB: pipelines/pipeline.py), too small to validate the model, and the measurement runs in
    the step's process."""
    if cfg.finetune.average != "on" or cfg.distributed.num_nodes <= 1:
        return None
    return (f"Window average: not measured, because the fine-tune ran as a TrainJob on {cfg.distributed.num_nodes} "
            "nodes and the step's own pod, which would measure it, only submits the job; the window's pick is "
            "delivered.")


def window_checkpoints(ckpt_root: Path, window: StepWindow) -> dict[int, Path]:
    """The kept checkpoints whose update lies inside the step window, by update; none when no window was found."""
    if window.recommended_epochs is None or window.window_start_update is None or window.window_end_update is None:
        return {}
    start, end = float(window.window_start_update), float(window.window_end_update)
    found = checkpoints.checkpoints_by_update(ckpt_root) if Path(ckpt_root).is_dir() else {}
    return {u: p for u, p in sorted(found.items()) if start <= u <= end}


def average_weights(ckpts: list[Path]) -> dict[str, torch.Tensor]:
    """The uniform average of the checkpoints' trained tensors, in update order (a running mean in float32, returned
    in each tensor's own dtype; an integer tensor, the update count, is the newest checkpoint's). Each checkpoint's
    weights are checked against its manifest first."""
    from rangefinder.errors import RangefinderError

    mean: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for n, ckpt in enumerate(ckpts, start=1):
        checkpoints.require_intact(ckpt, only=(checkpoints.WEIGHTS_NAME,))
        weights = checkpoints.read_weights(ckpt)
        if n > 1 and set(weights) != set(mean):
            raise RangefinderError(f"checkpoint {ckpt} holds other tensors than {ckpts[0]}: they are not checkpoints "
                                   "of one run, and cannot be averaged")
        reshaped = [k for k, v in weights.items() if n > 1 and v.shape != mean[k].shape]
        if reshaped:
            k = reshaped[0]
            raise RangefinderError(f"checkpoint {ckpt} holds {k} of shape {tuple(weights[k].shape)} where {ckpts[0]} "
                                   f"holds {tuple(mean[k].shape)}: they are not checkpoints of one run (a LoRA rank or "
                                   "other setting changed between them), and cannot be averaged")
        for key, value in weights.items():
            if n == 1:
                dtypes[key] = value.dtype
                mean[key] = value.float().clone() if value.is_floating_point() else value.clone()
            elif value.is_floating_point():
                mean[key].add_(value.float().sub_(mean[key]), alpha=1.0 / n)
            else:  # a count (method.updates): the newest checkpoint's, the updates that made the average
                mean[key] = value.clone()
    return {k: v.to(dtypes[k]) for k, v in mean.items()}


def run_average(cfg: RangefinderConfig, spec: TrainSpec, work: Path, window: StepWindow, split: Split,
                base_model: Path, base: Optional[ResolvedModel] = None,
                curve_losses: Optional[dict[int, float]] = None) -> Optional[WindowAverage]:
    """Average the fine-tune's checkpoints inside the window (run in `work`, all its checkpoints still there), measure
    the average, with finetune.soup_tries > 0 make and measure the greedy soup (`curve_losses`: the run's validation
    loss by update, which orders the checkpoints), and write the lower of the two's model as `average/final/`; None
    when the window holds fewer than 2 checkpoints. A retried step reads average.json instead of measuring again."""
    from rangefinder.training.loop import weights_measurer
    from rangefinder.training.restore import AveragedWeights, save_checkpoint_model

    root = Path(work) / AVERAGE_DIR
    if (root / MEASURED).is_file():
        return WindowAverage.from_json(json.loads((root / MEASURED).read_text()))
    found = window_checkpoints(Path(work) / checkpoints.RUN_DIR, window)
    if len(found) < 2:
        return None
    weights = average_weights(list(found.values()))
    # Validation is measured in this process: the weights are the same on every rank, and the measurement does
    # not depend on how many processes share it (validation.py).
    one = dataclasses.replace(spec, training=spec.training.model_copy(update={"world_size": 1}), plan=None)
    with weights_measurer(one, out_dir=root, split=split) as measure:
        uniform = _finite(measure(weights).get("val_loss"))
        soup = None
        if cfg.finetune.soup_tries > 0 and curve_losses:
            soup = greedy_soup(found, curve_losses, measure, cfg.finetune.soup_tries)
    measured = offered(WindowAverage(updates=tuple(found), val_loss=uniform, window_updates=tuple(found),
                                     uniform_val_loss=uniform), soup)
    if measured.how == "greedy_soup" and soup is not None:
        weights = soup.weights
    if measured.val_loss is not None:
        save_checkpoint_model(found[max(measured.updates)], base_model, root / "final", base=base,
                              weights=AveragedWeights(weights, measured.updates), variant=cfg.model.variant)
    write_json(root / MEASURED, measured.to_json())  # last: a retry finds the measurement and the model beside it
    return measured


def offered(uniform: WindowAverage, soup: Optional[Soup]) -> WindowAverage:
    """What the window average offers for delivery: the greedy soup where it measured lower than the `uniform`
    average of the window's checkpoints (or the uniform average's loss was not finite), else the uniform average;
    either way with the soup's tries. A soup of fewer than 2 checkpoints is no average, and one of every checkpoint
    in the window is the uniform average (its loss differs only by summation order)."""
    if soup is None:
        return uniform
    tried = dataclasses.replace(uniform, soup_tries=soup.tries)
    if soup.val_loss is None or not 1 < len(soup.updates) < len(uniform.window_updates):
        return tried
    if uniform.val_loss is not None and not soup.val_loss < uniform.val_loss:
        return tried
    return dataclasses.replace(tried, updates=soup.updates, val_loss=soup.val_loss, how="greedy_soup")


@dataclass
class Soup:
    """A greedy soup: the checkpoints kept (by update, ascending), its weights and validation loss, tries made."""

    updates: tuple[int, ...]
    weights: dict[str, torch.Tensor]
    val_loss: Optional[float]
    tries: int


def greedy_soup(found: dict[int, Path], curve_losses: dict[int, float],
                measure: Callable[[dict[str, torch.Tensor]], dict[str, Any]], tries: int) -> Soup:
    """The greedy soup of Wortsman et al. 2022 over the window's checkpoints `found`: start from the one with the
    lowest validation loss on the run's curve (the window's pick), try the others in order of that loss, and keep
    each whose addition lowers the soup's measured validation loss; at most `tries` measurements. Checkpoints with no
    finite curve loss are not tried. The soup is the uniform average of what is kept (an integer tensor, the update
    count, is the newest kept checkpoint's). Each checkpoint is read once."""
    order = sorted((u for u in found if _finite(curve_losses.get(u)) is not None), key=lambda u: (curve_losses[u], u))
    if not order:
        return Soup(updates=(), weights={}, val_loss=None, tries=0)
    first = checkpoints.read_weights(found[order[0]])
    dtypes = {k: v.dtype for k, v in first.items()}
    total = {k: v.float().clone() if v.is_floating_point() else v.clone() for k, v in first.items()}  # a float32 sum
    kept, best = [order[0]], float(curve_losses[order[0]])
    tried = order[1:tries + 1]
    for update in tried:
        added = checkpoints.read_weights(found[update])  # checked against its manifest by average_weights
        newer = update > max(kept)
        summed = {k: v + added[k].float() if v.is_floating_point() else (added[k] if newer else v)
                  for k, v in total.items()}
        loss = _finite(measure(_mean(summed, dtypes, len(kept) + 1)).get("val_loss"))
        if loss is not None and loss < best:
            kept.append(update)
            best, total = loss, summed
    return Soup(updates=tuple(sorted(kept)), weights=_mean(total, dtypes, len(kept)),
                val_loss=best if len(kept) > 1 else None, tries=len(tried))


def _mean(total: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype], n: int) -> dict[str, torch.Tensor]:
    """A float32 sum of n checkpoints' tensors divided by n, in each tensor's own dtype; integer tensors as they are."""
    return {k: (v / n).to(dtypes[k]) if v.is_floating_point() else v.clone() for k, v in total.items()}


def _finite(value: Any) -> Optional[float]:
    return float(value) if value is not None and math.isfinite(value) else None


def deliver(work: Path, measured: WindowAverage, chosen: dict[str, Any], *, epoch: Optional[float]) -> dict[str, Any]:
    """chosen.json with the average's measurement; when it is delivered, its model becomes `chosen/` and chosen.json
    names it (rule `window_average`, at the newest averaged checkpoint's update and `epoch`, the pick it replaced
    under `window_pick`). Its model is removed otherwise."""
    from rangefinder.steps.delivery import deliver_if_lower

    return deliver_if_lower(work, Path(work) / AVERAGE_DIR / "final", chosen, measured, key="average",
                            compared_as="pick_val_loss", rule="window_average", update=measured.updates[-1],
                            epoch=epoch, what=f"The average of the fine-tune's checkpoints at updates "
                            f"{', '.join(map(str, measured.updates))}, the ones inside the step window")
