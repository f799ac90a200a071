"""Step `finetune`: train at the chosen LR for longer than needed, with validation; the step window is found in it.

The LR is constant at the midpoint of the range test's bounds, or cycles between the bounds (Smith 2017's
triangular schedules) when `finetune.schedule` says so. With a constant LR and `finetune.successive_halving` on (the
default), the midpoint and the upper bound each train half the epochs and the better one goes on
(rangefinder.steps.halving): the step's LR is the one it kept. The step window is where smoothed validation loss
is within `finetune.tolerance` of its minimum; its centre gives the recommended epochs, since the window's edges are
better determined than the minimum itself (rangefinder.analysis.step_window).

The run deliberately trains past the window, so its final weights are not the model to deliver. It saves a
checkpoint every `finetune.checkpoint_every_epochs` and keeps them all until the window is known; then it keeps only
the one with the lowest validation loss inside the window (analysis.delivered_checkpoint) and writes its model as
`chosen/` beside `final/`, with `chosen.json` (rangefinder.formats.checkpoints). With no window (no significant
improvement) it keeps the lowest-loss checkpoint of the whole run instead, and says so, and says when even that is not
below the base model's loss (update 0). Without a retrain, that is the model registered. With `finetune.deliver:
earliest_tied` (off by default) it keeps the earliest checkpoint within 1 % of the lowest loss measured instead
(analysis.earliest_tied).

For full fine-tuning (`finetune.cooldown`), before the other checkpoints go, the recommended length is trained again
from one of them with its last ~20 % decaying to LR 0, and those weights are delivered instead when they measure lower
(rangefinder.steps.cooldown).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from rangefinder.config import ConfigLike, as_config, resolve_mixed_precision
from rangefinder.errors import RangefinderError
from rangefinder.formats import checkpoints
from rangefinder.formats.atomic import write_json
from rangefinder.launch.processes import batch_note, run_training, step_world_size
from rangefinder.steps.kept_settings import keeps_mlflow_settings
from rangefinder.steps.workdir import publish, work_dir

if TYPE_CHECKING:
    from rangefinder.analysis import Delivery, RecommendedLength, SampleStrip, StepWindow
    from rangefinder.analysis.halving import HalvingDecision
    from rangefinder.models.loading import ResolvedModel


# Delivery rules whose weights are no checkpoint of the run (analysis.DELIVERY_RULE_TEXT).
NOT_A_CHECKPOINT = ("cooldown", "window_average")


@dataclass
class FinetuneResult:
    recommended_epochs: int
    recommended_updates: int
    still_improving: bool
    best_val_loss: Optional[float]
    model_dir: Path
    curve_csv: Path
    checkpoints: list[Path]
    chosen: Optional[dict[str, Any]] = None  # chosen.json: the kept checkpoint's update, epoch, val_loss, reason
    mixed_precision: str = "no"  # what training.mixed_precision (e.g. auto) meant on this machine
    lr: float = 0.0  # the constant LR of the delivered run: lr_mid, or the candidate successive halving kept
    halving: Optional[HalvingDecision] = None  # halving.json (rangefinder.steps.halving) when it ran
    updates_trained: int = 0  # every optimizer update the step took, both halving candidates included

    def metrics(self) -> dict[str, float]:
        out = {"recommended_epochs": float(self.recommended_epochs),
               "recommended_updates": float(self.recommended_updates), "lr_used": float(self.lr),
               "updates_trained": float(self.updates_trained)}
        if self.best_val_loss is not None:
            out["best_val_loss"] = float(self.best_val_loss)
        for key in ("update", "epoch", "val_loss"):
            if self.chosen and self.chosen.get(key) is not None:
                out[f"chosen_{key}"] = float(self.chosen[key])
        return out


def epoch_at(curve: dict, update: int) -> Optional[float]:
    """The epoch at `update` on the curve's update -> epoch line (exact at a validated update); None without one."""
    import numpy as np

    return float(np.interp(update, curve["update"], curve["epoch"])) if curve.get("epoch") is not None else None


def curve_losses(curve: dict) -> dict[int, float]:
    """The curve's validation loss by update (the greedy soup's order: rangefinder.steps.average)."""
    return {int(u): float(v) for u, v in zip(curve["update"], curve["val_loss"], strict=True)}


def keep_only_chosen(ckpt_root: Path, chosen: dict[str, Any], *also: Path) -> None:
    """Remove every checkpoint under `ckpt_root` but the one keep_chosen_checkpoint kept (and `also`): the one
    delivered, or, when weights that are no checkpoint were delivered over it (the window average, the cooldown), the
    window's pick they replaced. Nothing is removed when that checkpoint is not there."""
    kept = chosen.get("checkpoint") or (chosen.get("window_pick") or {}).get("checkpoint")
    if kept and (Path(ckpt_root) / kept).is_dir():
        checkpoints.keep_only(ckpt_root, Path(ckpt_root) / kept, *also)


def keep_chosen_checkpoint(run_dir: Path, window: Any, curve: dict, base_model: Path,
                           base: Optional[ResolvedModel] = None, *, deliver: str = "lowest",
                           measured_besides: Optional[dict[str, Optional[float]]] = None,
                           keep_newest: bool = False, variant: Optional[str] = None) -> Optional[dict[str, Any]]:
    """Keep the checkpoint the window's rule picks (analysis.delivered_checkpoint: the lowest validation loss inside
    the window; with no window, the lowest of the whole run), write its model as `chosen/` with `chosen.json` (its
    update, epoch, loss, the rule and whether it beats the base model), and remove the other checkpoints. None
    (everything left as it is, the final weights delivered) when there is no checkpoint to pick.

    `deliver` is finetune.deliver: with earliest_tied, the earliest checkpoint within analysis.TIE_BAND of the lowest
    loss measured (the pick's, or one of `measured_besides`: the window average's and the cooldown's, by what they
    are) is kept instead, the pick under `window_pick` and the band under `band` (the usual pick stays when no
    checkpoint lies in the band).

    `keep_newest`: the run's newest checkpoint stays too, until the step removes it before it ends (run_finetune), so
    that a step retried in between goes on from the run's end instead of training its tail again.

    A retried step (a pod preempted after this ran, its work folder kept) finds chosen.json and chosen/ already: the
    earlier attempt's choice stands (chosen/ may hold weights delivered over it since, steps/delivery.py), and the
    checkpoints the retry wrote after the one kept are removed again (but the newest, with `keep_newest`)."""
    from rangefinder.analysis import delivered_checkpoint, earliest_tied
    from rangefinder.analysis.step_window import TIE_BAND
    from rangefinder.training.restore import save_checkpoint_model

    ckpt_root = Path(run_dir) / checkpoints.RUN_DIR
    found = checkpoints.checkpoints_by_update(ckpt_root)
    newest = [found[max(found)]] if keep_newest and found else []
    earlier = checkpoints.read_chosen(Path(run_dir))
    if earlier is not None:
        keep_only_chosen(ckpt_root, earlier, *newest)
        return earlier
    updates, losses = curve.get("update", []), curve.get("val_loss", [])
    picked = delivered_checkpoint(window, list(found), updates, losses)
    if picked is None:
        return None
    pick, band = picked, None
    if deliver == "earliest_tied":
        named = {f"the window's pick at update {pick.update}": pick.val_loss, **(measured_besides or {})}
        finite = {k: float(v) for k, v in named.items() if v is not None and math.isfinite(v)}
        if finite:
            set_by = min(finite, key=lambda k: finite[k])
            tied = earliest_tied(list(found), updates, losses, finite[set_by])
            if tied is not None:
                picked, band = tied, {"target_val_loss": finite[set_by], "set_by": set_by, "fraction": TIE_BAND,
                                      "ceiling": tied.tied_ceiling}
    update, ckpt = picked.update, found[picked.update]
    checkpoints.require_intact(ckpt)  # before its state.json is read here and its weights by save_checkpoint_model
    rows = [r for r in checkpoints.read_state(ckpt)["metrics_rows"] if r.get("update") == update]
    val_loss = rows[-1].get("val_loss") if rows else None
    epoch = rows[-1].get("epoch") if rows else None
    if epoch is None:  # a checkpoint between validations
        epoch = epoch_at(curve, update)
    why = pick_reason(pick, window)
    if band is not None:
        length = f" (epoch {epochs_up_to(epoch)})" if epoch is not None else ""
        why = (f"finetune.deliver is earliest_tied, so this is the earliest checkpoint whose validation loss is "
               f"within {TIE_BAND:.0%} of the lowest the fine-tune measured, {band['target_val_loss']:.4g} "
               f"({band['set_by']}): the validation loss cannot tell them apart, and this one moved least from the "
               f"base model; a retrain trains its length{length}. Without that rule: {why}")
    at = f"Weights at update {update} (epoch {epoch:g})" if epoch is not None else f"Weights at update {update}"
    reason = f"{at} of the constant-LR fine-tune: {why}. {picked.against_base()}".rstrip()
    info = {
        "checkpoint": ckpt.name,
        "update": update,
        "epoch": epoch,
        "val_loss": None if val_loss is None or not math.isfinite(val_loss) else float(val_loss),
        "recommended_updates": window.recommended_updates,
        "recommended_epochs": window.recommended_epochs,
        "window_start_update": window.window_start_update,
        "window_end_update": window.window_end_update,
        "status": window.status,
        "rule": picked.rule,
        "final_weights": picked.final,
        "base_val_loss": picked.base_val_loss,
        "improved_on_base": picked.improved_on_base,
        "reason": reason,
    }
    if band is not None:
        info.update(band=band, window_pick={"checkpoint": found[pick.update].name, "update": pick.update,
                                            "val_loss": pick.val_loss, "rule": pick.rule})
    save_checkpoint_model(ckpt, base_model, Path(run_dir) / checkpoints.CHOSEN_DIR, base=base,
                          variant=variant)
    checkpoints.keep_only(ckpt_root, ckpt, *newest)
    write_json(Path(run_dir) / checkpoints.CHOSEN_INFO, info)
    return info


def chosen_delivery(chosen: Optional[dict[str, Any]]) -> Optional[Delivery]:
    """What chosen.json delivers, as the step report and the run's description say it (analysis.Delivery)."""
    from rangefinder.analysis import Delivery

    return None if chosen is None else Delivery.of_chosen(chosen)


def pick_reason(pick: Delivery, window: StepWindow) -> str:
    """Why the window's rule (analysis.delivered_checkpoint) picked `pick`, for chosen.json's reason: said of the
    run's final weights too, where they are what is delivered (the run's only checkpoint, or its lowest)."""
    from rangefinder.analysis.step_window import within_words

    if pick.rule == "run_lowest":
        final = ("these are the run's final weights" if pick.final
                 else "the run's final weights are not delivered: it trained past any useful length")
        # The length recommended_length falls back to: the registered version's recommended_epochs tag beside this.
        return ("validation loss never fell by more than its noise, so no step window was found and the recommended "
                f"length is this checkpoint's epoch, rounded up; of the checkpoints kept over the whole run, update "
                f"{pick.update} has the lowest validation loss ({final})")
    if window.status == "still_improving":
        final = ", the run's final weights," if pick.final else ""
        return ("validation loss was still falling when the run ended, so the recommended length is the whole run and "
                f"the checkpoint with the lowest validation loss near its end, update {pick.update}{final} is kept; "
                "fine-tune for more epochs to find the minimum")
    past = "" if pick.final else " (the run went on past the window, so its final weights overfit)"
    return (f"smoothed validation loss stays {within_words(window)} from update "
            f"{window.window_start_update:.0f} to {window.window_end_update:.0f}; the centre of that window, update "
            f"{window.recommended_updates} (epoch {window.recommended_epochs}), is the recommended length, and update "
            f"{pick.update} is {pick.what()}{past}")


def sample_strip(run_dir: Path) -> Optional[SampleStrip]:
    """The run's samples during training (training/samples.py's index) as the report's "samples over training"
    strip; None when it rendered none."""
    from rangefinder.analysis import SampleStrip
    from rangefinder.training.samples import SAMPLES_DIR, SAMPLES_KEY, read_index

    index = read_index(run_dir)
    if not index or not index.get("samples"):
        return None
    settings = index["settings"]
    rows = [f"{p} | seed {s}" for p in settings["prompts"] for s in settings["seeds"]]
    folder = Path(run_dir) / SAMPLES_DIR
    columns = [(int(e["update"]), float(e["epoch"]), [folder / c for c in e["cells"]]) for e in index["samples"]]
    return SampleStrip(rows=rows, columns=columns, mlflow_key=SAMPLES_KEY)


def sample_delivered(work: Path, chosen: Optional[dict[str, Any]], base_model: Path,
                     sink: Optional[Any] = None, variant: Optional[str] = None) -> None:
    """Render the delivered (chosen) checkpoint with the settings of the samples during training and add its grid to
    them at its update, in the index (the report's strip) and in MLflow's image series (`sink`): the samples ran
    every few validations, and the slider ended before, or stepped over, the weights the pipeline delivers."""
    import tempfile

    from PIL import Image

    from rangefinder.formats.atomic import write_json
    from rangefinder.sampling import render_grid
    from rangefinder.training.samples import (
        INDEX_NAME,
        SAMPLES_DIR,
        SAMPLES_KEY,
        grid_title,
        read_index,
        save_sample_grid,
    )

    index = read_index(work)
    if chosen is None or not index or not index.get("samples"):
        return
    update = int(chosen["update"])
    # A checkpoint rendered during training is the delivered model itself; the cooldown's and the window average's
    # weights are not, and replace that update's grid.
    if chosen.get("rule") not in NOT_A_CHECKPOINT and any(int(e["update"]) == update for e in index["samples"]):
        return
    settings, folder = index["settings"], Path(work) / SAMPLES_DIR
    epoch = float(chosen["epoch"]) if chosen.get("epoch") is not None else float("nan")
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        out = render_grid([Path(work) / checkpoints.CHOSEN_DIR], settings["prompts"], settings["seeds"], out_dir=tmp,
                          labels=["delivered"], base_model=base_model, steps=settings["num_inference_steps"],
                          guidance_scale=settings["guidance_scale"], scheduler=settings["scheduler"],
                          resolution=settings["resolution"], device="cpu", variant=variant)
        images = [Image.open(path).convert("RGB") for (path,) in out["images"]]
    rows = [(r["prompt"], int(r["seed"])) for r in out["rows"]]
    files = save_sample_grid(folder, update, grid_title(update, epoch, " (delivered)"), rows, len(settings["seeds"]),
                             images)
    entry: dict[str, Any] = {"update": update, "epoch": epoch, "validation": None, **files, "seconds": None,
                             "delivered": True, "logged_to": getattr(sink, "run_id", None)}
    others = [e for e in index["samples"] if int(e["update"]) != update]
    index["samples"] = sorted([*others, entry], key=lambda e: int(e["update"]))
    write_json(folder / INDEX_NAME, index)
    if sink is not None:
        sink.log_image(str(folder / files["grid"]), key=SAMPLES_KEY, step=update)


def epochs_up_to(epoch: float) -> int:
    """The whole epochs a retrain trains to reach a checkpoint at `epoch` (rounded up; at least 1)."""
    return max(1, math.ceil(float(epoch) - 1e-9))


def recommended_length(window: StepWindow, chosen: Optional[dict[str, Any]], configured_epochs: int,
                       trained_updates: int, curve: Optional[dict] = None) -> RecommendedLength:
    """The length the fine-tune recommends, in epochs and the updates they take (what a full-data retrain trains):
    - the window's centre;
    - the delivered checkpoint's epoch rounded up when it is finetune.deliver's earliest tied checkpoint (the rule's
      point is the weights that moved least), or when there is no window (no significant improvement: the run went on
      past it and measured no better; in the bench its final weights were worse than the base model), in the updates
      those whole epochs take on `curve`'s update-epoch line (the checkpoint's own without a curve);
    - with neither, the configured epochs and the updates trained."""
    from rangefinder.analysis import RecommendedLength
    from rangefinder.analysis.step_window import updates_for_epochs

    rule = (chosen or {}).get("rule")
    own_length = rule == "earliest_tied" or (rule == "run_lowest" and window.recommended_epochs is None)
    if chosen is not None and own_length and chosen.get("epoch") is not None:
        epochs = epochs_up_to(chosen["epoch"])
        updates = updates_for_epochs(curve["update"], curve.get("epoch"), epochs) if curve else None
        return RecommendedLength(epochs=epochs, updates=int(chosen["update"]) if updates is None else updates,
                                 basis="earliest_tied" if rule == "earliest_tied" else "no_window")
    return RecommendedLength.of_window(window) or RecommendedLength(
        epochs=int(configured_epochs), updates=int(trained_updates), basis="configured")


@keeps_mlflow_settings
def run_finetune(
    cfg: ConfigLike,
    *,
    split_dir: Path,
    lr_low: float,
    lr_high: float,
    lr_mid: float,
    lr_source: str = "range-test",
    model_dir: Path,
    out_dir: Optional[Path] = None,
    report_html: Optional[Path] = None,
    report_md: Optional[Path] = None,
    mlflow_parent_run_id: Optional[str] = None,
) -> FinetuneResult:
    """Train the fine-tune on the split at `split_dir` at `lr_mid` (or the LR successive halving keeps of `lr_mid`
    and `lr_high`; the bounds `lr_low`..`lr_high` for a triangular schedule), find the step window in its curve and
    write the delivered model, its checkpoints and metrics.csv to `model_dir`; the LR's `lr_source` (range-test,
    prodigy-step, fixed) is named in the report and MLflow. The report goes to `out_dir` (None: `model_dir/report`),
    and is copied to `report_html` and `report_md` where given; the step's MLflow run is a child of
    `mlflow_parent_run_id` where given. Returns the recommended length, the weights kept and the LR trained
    (FinetuneResult); RangefinderError for bad settings or a run that wrote no weights.
    `cfg`: a RangefinderConfig, or a dict of its sections (a notebook's, a YAML file's) validated as a config file
    is (rangefinder.config.as_config: ConfigError naming a bad setting); anything else is a TypeError."""
    cfg = as_config(cfg)  # a dict from a notebook is validated as a config file is
    from rangefinder import tracking
    from rangefinder.analysis import RecommendedLength, copy_report, select_step_window, write_step_report
    from rangefinder.analysis.reports import step_headline, write_unmeasured_step_report
    from rangefinder.data.split import read_split
    from rangefinder.models.loading import resolve_base_model
    from rangefinder.planning import check_finetune_validations
    from rangefinder.steps.average import average_applies, not_on_several_nodes, run_average
    from rangefinder.steps.average import deliver as deliver_average
    from rangefinder.steps.choose_lr import skipped_because
    from rangefinder.steps.cooldown import cooldown_applies, run_cooldown
    from rangefinder.steps.cooldown import deliver as deliver_cooldown
    from rangefinder.steps.halving import halving_applies, run_halving
    from rangefinder.steps.retrain_full import retrain_preview
    from rangefinder.training.family_detection import family_of
    from rangefinder.training.spec import TrainSpec

    split = read_split(split_dir)
    # Samples during training (sampling.every_validations): grids in MLflow as it trains, and the report's strip.
    spec = TrainSpec.finetune(cfg, split, bounds=(lr_low, lr_high), lr=lr_mid,
                              world_size=step_world_size(cfg))
    tc, plan = spec.training, spec.plan
    validating = cfg.validation.enabled() and len(split.val) > 0
    check_finetune_validations(cfg, plan)  # before the halving's race and the run: the step window needs 3 updates
    model_dir = Path(model_dir)
    precision = resolve_mixed_precision(tc.mixed_precision)
    chosen, cooled, averaged = None, None, None
    halving = halving_applies(cfg.finetune.successive_halving, validating, tc.schedule, lr_mid, lr_high)
    # One home per LR on this run, its params: the bounds it was given and where they came from (here), and `lr`, the
    # LR it trained the delivered model at (after the race, below). The plan's lr and lr_base are that LR again (the
    # fine-tune does not scale it), so they are left out; the parent run's row shows the bounds and lr_used as tags.
    planned = plan.model_dump(mode="json", exclude={"lr", "lr_base"}) if plan is not None else None
    with tracking.step_run(cfg, "finetune", parent_run_id=mlflow_parent_run_id) as run:
        run.log_config(cfg, plan=planned,
                       extra={"lr_low": lr_low, "lr_high": lr_high, "lr_mid": lr_mid, "lr_source": lr_source,
                              "finetune.successive_halving_used": halving, **tc.used_params(family_of(cfg.model))})
        # The registered version's source run: its Datasets column names what the weights were trained on (also
        # where no range test ran, an LR given by hand).
        run.log_dataset_manifest(split_dir)
        work = work_dir(model_dir, f"{mlflow_parent_run_id}/finetune" if mlflow_parent_run_id else None)
        race, lr, extra_updates = None, lr_mid, 0
        if halving:
            race = run_halving(cfg, spec, work, lr_mid=lr_mid, lr_high=lr_high, split=split, sink=run)
            lr, extra_updates = race.lr, race.extra_updates
            spec = spec.with_lr(lr)
            tc = spec.training
        # The LR this run trains the delivered model at (lr_mid, or the kept one).
        run.log_params({"lr": lr})
        # With halving, this goes on from the kept candidate's checkpoint at the pause.
        result = run_training(cfg, spec, out_dir=work, metric_sink=run, step_name="finetune", split=split)
        if result.status == "diverged":
            # A NaN/inf loss stopped it, and training never writes NaN weights, so there is nothing to deliver: the
            # cause and the fix, before any reading of a curve cut short (which would blame the validation instead).
            raise RangefinderError(f"the fine-tune diverged at lr {lr:.3g} (its loss stopped being finite by update "
                                   f"{result.updates}), so it delivered no weights; lower the LR (or the range "
                                   f"test's lr_max) and run again. Its curve: {result.metrics_csv}")
        report_dir = Path(out_dir or model_dir / "report")
        report_dir.mkdir(parents=True, exist_ok=True)
        if validating:
            curve = result.curve_arrays()
            window = select_step_window(curve["update"], curve.get("epoch"), curve["val_loss"],
                                        stabilize_loss=curve.get("stabilize_loss"), tolerance=cfg.finetune.tolerance,
                                        seed=cfg.validation.seed,
                                        divergence_factor=cfg.validation.divergence_factor)
            # With an LR-free optimizer the report says why there was no range test (and no halving).
            skipped = skipped_because(cfg)
            source = "; ".join(p for p in (tracking.logged_curve(result.metrics_csv), batch_note(tc), skipped) if p)
            base = resolve_base_model(cfg.model)
            # The cooldown branches from one of the run's checkpoints, so it trains before the window's pick is
            # kept and the others are removed.
            if cooldown_applies(cfg, validating, tc.schedule):
                cooled = run_cooldown(cfg, spec, work, window, split, sink=run)
            # So does the window average, which reads the window's checkpoints.
            if average_applies(cfg, validating):
                averaged = run_average(cfg, spec, work, window, split, base.path, base,
                                       curve_losses=curve_losses(curve))
            # finetune.deliver: earliest_tied weighs the cooldown and the average too, before the checkpoints go.
            besides = {**({} if cooled is None else {"the cooldown's weights": cooled.val_loss}),
                       **({} if averaged is None else {"the window average": averaged.val_loss})}
            chosen = keep_chosen_checkpoint(work, window, curve, base.path, base, deliver=cfg.finetune.deliver,
                                            measured_besides=besides, keep_newest=True,
                                            variant=cfg.model.variant)
            if cooled is not None and chosen is not None:  # offered unless the earliest tied checkpoint was kept
                chosen = deliver_cooldown(work, cooled, chosen)
            if averaged is not None and chosen is not None:  # weighed against what is delivered by now
                chosen = deliver_average(work, averaged, chosen, epoch=epoch_at(curve, averaged.updates[-1]))
            delivered = chosen_delivery(chosen)
            sample_delivered(work, chosen, base.path, run, cfg.model.variant)
            # One length for the report, its lead (the run's description), MLflow and the step's outputs.
            length = recommended_length(window, chosen, tc.epochs or 1, result.updates, curve)
            retrain = retrain_preview(cfg, split, recommended_epochs=length.epochs, lr=lr, bounds=(lr_low, lr_high))
            report = write_step_report(window, curve, report_dir, source=source,
                                       samples=sample_strip(work), halving=race,
                                       plan_warnings=spec.plan.warnings if spec.plan is not None else (),
                                       validation_weighting=result.validation_weighting(), delivered=delivered,
                                       cooldown=(chosen or {}).get("cooldown", {}).get("sentence"),
                                       average=(chosen or {}).get("average", {}).get("sentence"),
                                       length=length, retrain=retrain)
            copy_report(report, report_html, report_md)
            improving = window.status == "still_improving"
            decision = window.to_dict()
            note = f"{step_headline(window, race, delivered, length)} Trained at lr {lr:.3g} (lr source: {lr_source})."
            for extra in ("cooldown", "average"):
                if chosen is not None and chosen.get(extra):
                    note += f" {chosen[extra]['sentence']}"
            if retrain:
                note += f" {retrain}"
            skipped_average = not_on_several_nodes(cfg)
            if skipped_average:
                note += f" {skipped_average}"
        else:
            # No validation set (a fixed LR with val_split 0): nothing to read a window from; keep the budget.
            length, improving = RecommendedLength(epochs=tc.epochs or 1, updates=result.updates,
                                                  basis="configured"), False
            decision = {"recommended_epochs": length.epochs, "note": "no validation: the configured epochs are kept"}
            note = write_unmeasured_step_report(length.epochs, result.updates, lr, lr_source, report_html, report_md)
        if chosen is None:  # no validated checkpoint to choose from: the final weights are delivered, as configured
            checkpoints.keep_newest(work / checkpoints.RUN_DIR, cfg.training.keep_checkpoints)
        else:  # the run's newest checkpoint goes last (keep_chosen_checkpoint's keep_newest)
            keep_only_chosen(work / checkpoints.RUN_DIR, chosen)
        publish(work, model_dir)
        decision.update(recommended_length=dataclasses.asdict(length),
                        lr_low=lr_low, lr_high=lr_high, lr_mid=lr_mid, lr_used=lr, lr_source=lr_source,
                        range_test_skipped=skipped_because(cfg),
                        halving=None if race is None else race.to_json(), mixed_precision=precision, chosen=chosen,
                        world_size=tc.world_size, global_batch=tc.batch_size * tc.grad_accum * tc.world_size,
                        model_family=result.family)
        write_json(report_dir / "decision.json", decision)
        shutil.copyfile(result.metrics_csv, report_dir / "metrics.csv")
        # decision.json holds the window's JSON (step_window.json) whole; the curve goes under curves/ once.
        run.log_report(report_dir, held_elsewhere=[report_dir / "step_window.json", result.metrics_csv])
        run.log_artifact(result.metrics_csv, tracking.CURVES_ARTIFACT)
        if cooled is not None:
            extra_updates += cooled.updates_trained
        # best_val_loss: the lowest validation loss the run measured, the KFP metric of the same name (None: no
        # validation, and log_decisions skips it).
        decisions: dict[str, Any] = {"recommended_epochs": length.epochs, "recommended_updates": length.updates,
                                     "recommended_from": length.basis, "still_improving": improving,
                                     "updates_trained": result.updates + extra_updates,
                                     "best_val_loss": result.best_val_loss}
        if cooled is not None and chosen is not None:  # deliver() wrote what the cooldown measured into chosen
            decisions.update(cooldown_delivered=chosen["cooldown"]["delivered"],
                             cooldown_updates=cooled.updates_trained)
            if cooled.val_loss is not None:
                decisions["cooldown_val_loss"] = cooled.val_loss
        if averaged is not None and chosen is not None:  # deliver_average wrote it into chosen
            decisions.update(average_delivered=chosen["average"]["delivered"],
                             average_checkpoints=len(averaged.updates), average_how=averaged.how)
            if averaged.val_loss is not None:
                decisions["average_val_loss"] = averaged.val_loss
        if race is not None:
            # Each candidate's LR is its child run's (tag and name) and a bound here: not a third time.
            decisions["halving"] = {"kept": race.kept, "pause_update": race.pause_update,
                                    **{n: {"best_val_loss": c.best_val_loss, "best_update": c.best_update}
                                       for n, c in race.candidates.items()}}
        if chosen is not None:
            # The rule that picked it and whether it beats the base model become tags (log_decisions).
            decisions.update({f"chosen_{k}": chosen[k] for k in ("update", "epoch", "val_loss", "rule",
                                                                  "improved_on_base")})
        run.log_decisions(decisions)
        # The parent run's row in MLflow's run list: the bounds choose_lr decided (the range tests keep their own
        # readings on their runs), where they came from and the LR kept, which this run holds as params.
        run.log_decisions({"lr_low": lr_low, "lr_high": lr_high, "lr_mid": lr_mid, "lr_used": lr,
                           "lr_source": lr_source}, parent_only=True)
        run.describe(note)
    if result.final_dir is None:
        raise RangefinderError(f"the fine-tune wrote no final weights under {model_dir}")
    return FinetuneResult(recommended_epochs=max(1, length.epochs), recommended_updates=length.updates,
                          still_improving=improving, best_val_loss=result.best_val_loss, model_dir=model_dir,
                          curve_csv=result.metrics_csv,
                          checkpoints=checkpoints.list_checkpoints(work / checkpoints.RUN_DIR),
                          chosen=chosen, mixed_precision=precision, lr=lr, halving=race,
                          updates_trained=result.updates + extra_updates)
