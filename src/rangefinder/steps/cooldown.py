"""The fine-tune's cooldown: the recommended length trained again, its last stretch decaying, from a kept checkpoint.

A constant-LR run delivers weights that still carry the noise of its constant step size. Prodigy's best checkpoint
beat rangefinder's in bench.versus where no constant LR did, and the measured reason is the shrinking step late in
its run; a constant-LR run decayed linearly to 0 over its last ~20 % (the "stable, then decay" end of
warmup-stable-decay schedules; Hägele et al. 2024) was never worse than the window's pick on 20 full fine-tuning cases
and beat Prodigy's best more often (bench/RESULTS.md, "A decay after the window"). For LoRA and textual inversion it
did not help: a constant LR already ends near their best, hence `finetune.cooldown: auto` = full fine-tuning only.

Once the step window is known, with recommended length R (the window's centre, in whole epochs: T updates):
- the cooldown is the wsd schedule of T updates (schedules.py): the fine-tune's own LR until update
  S = T - ceil(cooldown_fraction x T), then linear to 0 at T;
- up to S it is the fine-tune's run, update for update, so it branches from the fine-tune's newest checkpoint at or
  before S (TrainSpec.cooldown_of; the engine checks that the LR agreed up to that update) and trains from there
  to T: about cooldown_fraction x R updates more (from the base model when no checkpoint is that early);
- its weights at T are validated like every checkpoint, and delivered when their validation loss is below the
  window's pick (`deliver`); otherwise the window's pick stays, and chosen.json says what the cooldown measured.

Where things are, in the step's work folder: `cooldown/` holds the branch's run (its curve, metrics.csv and
updates.csv, with the fine-tune's rows up to the branch point), `branch.json` (the update it branched from) and
`cooldown.json`, the measurement, written before
the delivered weights move, so that a retried step does not train it again. Its final weights become `chosen/` when
delivered, and are removed otherwise; its checkpoints are removed once it is measured.

MLflow: the branch logs live into a child run of the fine-tune's run, `finetune_cooldown`, under the fine-tune's keys
(`validation/val_loss`, `lr`, ...), so that MLflow overlays its curve on the fine-tune's.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rangefinder.config import SCHEDULE_FREE_OPTIMIZERS, RangefinderConfig
from rangefinder.formats import checkpoints
from rangefinder.formats.atomic import rename_into_place, write_json
from rangefinder.formats.text import percent
from rangefinder.training.schedules import decay_updates
from rangefinder.training.sinks import MetricSink
from rangefinder.training.spec import TrainSpec

if TYPE_CHECKING:
    from rangefinder.analysis import StepWindow
    from rangefinder.data.split import Split

COOLDOWN_DIR = "cooldown"
MEASURED = "cooldown.json"
BRANCH_POINT = "branch.json"
STEP = "finetune_cooldown"


@dataclass(frozen=True)
class Cooldown:
    """What the cooldown trained and measured (cooldown.json)."""

    lr: float
    epochs: int  # the recommended length in whole epochs
    total_updates: int  # T: where it ends
    decay_start: int  # S: the first update whose LR is below `lr`
    start_update: int  # the fine-tune checkpoint it branched from; 0: the base model
    updates_trained: int  # T - start_update
    val_loss: Optional[float]  # at T; None when the run diverged or that validation was not finite

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Cooldown:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})

    def delivered_over(self, window_val_loss: Optional[float]) -> bool:
        """Whether its weights are delivered instead of the window's pick: they measure lower."""
        from rangefinder.steps.delivery import measures_lower

        return measures_lower(self.val_loss, window_val_loss)

    def sentence(self, window_val_loss: Optional[float], verdict: Optional[str] = None) -> str:
        """What it did and whether it was delivered (`verdict`, when another rule decided that), for the report and
        the run's description."""
        from rangefinder.steps.delivery import measured_sentence

        how = (f"the recommended {self.epochs} epochs ({self.total_updates} updates) again at lr {self.lr:.3g}, "
               f"decaying linearly to 0 from update {self.decay_start}, branched from "
               + (f"update {self.start_update}" if self.start_update else "the base model"))
        return measured_sentence("Cooldown", how, self.val_loss, window_val_loss, verdict)


def cooldown_applies(cfg: RangefinderConfig, validating: bool, schedule: str) -> bool:
    """finetune.cooldown: on, or auto for full fine-tuning; it needs validation (its weights are delivered only when
    they measure better) and the constant schedule it branches from, and a schedule-free optimizer has no LR to decay
    (it averages its iterates instead)."""
    setting = cfg.finetune.cooldown
    if (setting == "off" or not validating or schedule != "constant"
            or cfg.training.optimizer in SCHEDULE_FREE_OPTIMIZERS):
        return False
    return setting == "on" or cfg.training.method == "full"


def run_cooldown(cfg: RangefinderConfig, spec: TrainSpec, work: Path, window: StepWindow, split: Split,
                 sink: Optional[MetricSink] = None) -> Optional[Cooldown]:
    """Train the cooldown of the fine-tune run in `work` (whose checkpoints are all still there) and measure it;
    None when the window recommends no length. A retried step reads cooldown.json instead of training again."""
    from rangefinder.launch.processes import run_training

    root = Path(work) / COOLDOWN_DIR
    if (root / MEASURED).is_file():
        return Cooldown.from_json(json.loads((root / MEASURED).read_text()))
    if window.recommended_epochs is None:
        return None
    epochs = max(1, int(window.recommended_epochs))
    branch = spec.cooldown_of(split, epochs=epochs, decay_fraction=cfg.finetune.cooldown_fraction)
    assert branch.plan is not None
    total = branch.plan.total_updates
    decay_start = total - decay_updates(total, cfg.finetune.cooldown_fraction)
    start = _branch_point(Path(work) / checkpoints.RUN_DIR, root, decay_start)
    with _cooldown_run(cfg, sink, spec.training.lr) as run:
        result = run_training(cfg, branch, out_dir=root, metric_sink=run, step_name=STEP, split=split)
    ok = result.status == "ok" and result.final_dir is not None
    measured = Cooldown(lr=spec.training.lr, epochs=epochs, total_updates=total, decay_start=decay_start,
                        start_update=start, updates_trained=max(0, result.updates - start),
                        val_loss=_val_loss_at(result.curve, total) if ok else None)
    write_json(root / MEASURED, measured.to_json())  # before anything moves: a retry does not train it again
    shutil.rmtree(root / checkpoints.RUN_DIR, ignore_errors=True)
    return measured


def deliver(work: Path, measured: Cooldown, chosen: dict[str, Any]) -> dict[str, Any]:
    """chosen.json with the cooldown's measurement; when it is delivered, its final weights become `chosen/` and
    chosen.json names them (rule `cooldown`, the window's pick kept under `window_pick`). Its final weights are
    removed when they are not delivered."""
    from rangefinder.steps.delivery import deliver_if_lower

    epoch = float(measured.epochs)
    return deliver_if_lower(work, Path(work) / COOLDOWN_DIR / "final", chosen, measured, key="cooldown",
                            compared_as="window_val_loss", rule="cooldown", update=measured.total_updates,
                            epoch=epoch, what=f"Weights at update {measured.total_updates} (epoch {epoch:g}) of the "
                            "fine-tune's cooldown")


def _branch_point(source: Path, root: Path, decay_start: int) -> int:
    """Copy the fine-tune's newest checkpoint at or before `decay_start` into the cooldown's checkpoint folder (whole
    or not at all) and return its update; 0 when none is that early (the branch trains from the base model). A
    retried step finds the update in branch.json, and whatever checkpoint the branch got to in its folder."""
    noted = root / BRANCH_POINT
    if noted.is_file():
        return int(json.loads(noted.read_text())["start_update"])
    early = {u: p for u, p in checkpoints.checkpoints_by_update(source).items() if u <= decay_start} \
        if source.is_dir() else {}
    update = max(early) if early else 0
    if early:
        checkpoints.require_intact(early[update], only=(checkpoints.WEIGHTS_NAME, checkpoints.OPTIMIZER_NAME,
                                                        checkpoints.STATE_NAME))
        target = root / checkpoints.RUN_DIR
        target.mkdir(parents=True, exist_ok=True)
        tmp = target / f".{early[update].name}.copy.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(early[update], tmp)
        rename_into_place(tmp, target / early[update].name)
    write_json(noted, {"start_update": update})
    return update


def _val_loss_at(curve: dict[str, tuple[float, ...]], update: int) -> Optional[float]:
    """The validation loss measured at `update` (the run's last validation is at its end); None when not finite."""
    for u, y in zip(curve.get("update", ()), curve.get("val_loss", ()), strict=False):
        if int(u) == update and math.isfinite(y):
            return float(y)
    return None


def _cooldown_run(cfg: RangefinderConfig, sink: Optional[MetricSink],
                  lr: float) -> contextlib.AbstractContextManager[Optional[MetricSink]]:
    """The cooldown's child run under the fine-tune's run when that is an MLflow run, else the sink as it is."""
    from rangefinder.tracking import child_run
    from rangefinder.tracking.metrics import lr_text

    return child_run(cfg, sink, STEP, run_name=f"cooldown lr {lr:.3g}", tags={"cooldown": "true", "lr": lr_text(lr)},
                     params={"lr": lr},
                     description=f"The fine-tune's cooldown: its recommended length again at lr {lr:.3g}, the last "
                     f"{percent(cfg.finetune.cooldown_fraction)} decaying linearly to 0 (rangefinder.steps.cooldown).")
