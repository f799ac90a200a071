"""Step `register_model`: log the delivered weights to MLflow with the LR and length that made them, and register them.

Which weights: with the full-data retrain, its final weights; without, the fine-tune's `chosen/` model, the kept
checkpoint with the lowest validation loss inside the step window (with no window, of the whole run:
rangefinder.steps.finetune), not its final weights, which the run took deliberately past the window. The version's
tags record the update, epoch and validation loss it was taken at and the rule that picked it, and its description
says why. The new version gets the `candidate` alias; promotion to `champion` stays a person's decision.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rangefinder.config import ConfigLike, RangefinderConfig, as_config
from rangefinder.steps.kept_settings import keeps_mlflow_settings


@dataclass(frozen=True)
class Registered:
    model_uri: str
    version: Optional[str]
    weights: Path  # the folder that was registered (chosen/ or final/)
    # The MLflow UI's page of the pipeline's parent run (the step's own run without one), without credentials, and
    # the command that serves that UI for a store that is no server (None for a server): tracking.target.ui_link.
    mlflow_link: Optional[str] = None
    mlflow_ui: Optional[str] = None
    # What to set where that link is built on an in-cluster tracking URI (tracking.target.ui_url_hint), else None.
    mlflow_hint: Optional[str] = None


def result_markdown(registered: Registered, *, lr: float, length: tuple[str, str], weights: str, why: str) -> str:
    """The pipeline's result in a few lines of Markdown, for register-model's `result` artifact: what a person looks
    for when a run ends (the model registered and how to load it, the LR, the length, where MLflow holds the record),
    on the run's graph in the Kubeflow UI instead of in a step's log. The model's name comes from the config: a code
    span, never markup."""
    from rangefinder.formats.text import markdown_cell, markdown_code

    model = markdown_code(registered.model_uri) + ("" if registered.version else
                                                   " (logged; tracking.registered_model_name is empty: not registered)")
    rows = [("Model", model), ("Weights", weights), ("Learning rate", f"{lr:.3g}"), length]
    if registered.mlflow_link:
        rows.append(("MLflow", f"[the run's record]({registered.mlflow_link})"
                     + (f" (serve the UI first: {markdown_code(registered.mlflow_ui)})" if registered.mlflow_ui
                        else "")
                     + (f" ({registered.mlflow_hint})" if registered.mlflow_hint else "")))
    table = "\n".join(f"| {k} | {markdown_cell(v)} |" for k, v in rows)
    return f"# Result\n\n| | |\n|---|---|\n{table}\n\n{why}\n"


def delivered_name(chosen: dict[str, Any]) -> str:
    """What chosen.json delivers, in a few words: its checkpoint's name, or the weights that are no checkpoint (the
    window average of updates a-b or its greedy soup, the cooldown at update u)."""
    if chosen.get("checkpoint"):
        return str(chosen["checkpoint"])
    if chosen.get("rule") == "window_average" and (chosen.get("average") or {}).get("updates"):
        from rangefinder.steps.average import average_label

        return f"window {average_label(chosen['average'])}"
    return f"{chosen.get('rule') or 'chosen'} at update {chosen.get('update')}"


def delivered_lead(chosen: dict[str, Any], lr: float) -> str:
    """What the fine-tune delivered, in a sentence or two for the pipeline run's description: which weights (the
    checkpoint at its update and epoch, or the weights that are no checkpoint, as `delivered_name` says), the LR they
    trained at, and their own validation loss against the base model's, as the version's description ends (a window
    average's is its own, not the pick's it replaced). A chosen.json of earlier code, or one written by hand, may lack
    the epoch or the base model's loss: the sentence then goes without them."""
    from rangefinder.analysis import Delivery

    if chosen.get("checkpoint"):
        epoch = f", epoch {chosen['epoch']:g}" if chosen.get("epoch") is not None else ""
        what = f"checkpoint at update {chosen.get('update')}{epoch}"
    else:
        what = delivered_name(chosen)
    against = Delivery.of_chosen(chosen).against_base()
    return f"Delivered the fine-tune's {what}, trained at lr {lr:.3g}. {against}".rstrip()


def delivered_weights(model_dir: Path) -> tuple[Path, Optional[dict]]:
    """(folder, chosen.json or None): the fine-tune's chosen model when it has one, else the run's final weights.

    `model_dir` is the step's output folder; `chosen/` itself (what `rangefinder register` is given by hand) is that
    same chosen model, with the chosen.json beside it: registered as "final weights, no validated checkpoint", its
    version would say the opposite of what it holds."""
    from rangefinder.formats import checkpoints

    model_dir = Path(model_dir)
    if model_dir.name == checkpoints.CHOSEN_DIR:
        beside = checkpoints.read_chosen(model_dir.parent)
        if beside is not None:
            return model_dir, beside
    chosen = checkpoints.read_chosen(model_dir)
    if chosen is not None:
        return model_dir / checkpoints.CHOSEN_DIR, chosen
    final = model_dir / "final"
    return (final if final.is_dir() else model_dir), None


def retrained_on_all_data(model_dir: Path) -> Optional[bool]:
    """Whether the run that wrote `model_dir` (a training step's output folder, or its final/) is the full-data
    retrain, from its run_summary.json (`train_on`); None where there is none (a folder given by hand)."""
    import json

    model_dir = Path(model_dir)
    for folder in (model_dir, model_dir.parent) if model_dir.name == "final" else (model_dir,):
        try:
            summary = json.loads((folder / "run_summary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(summary, dict) and summary.get("train_on") in ("train", "train+val"):
            return summary["train_on"] == "train+val"
    return None


@keeps_mlflow_settings
def run_register_model(cfg: ConfigLike, *, model_dir: Path, lr: float, epochs: int,
                       mlflow_parent_run_id: Optional[str] = None, result_md: Optional[Path] = None) -> Registered:
    """`result_md`: where to write the result in Markdown (result_markdown), the step's visualization in KFP.
    `cfg`: a RangefinderConfig, or a dict of its sections (a notebook's, a YAML file's) validated as a config file
    is (rangefinder.config.as_config: ConfigError naming a bad setting); anything else is a TypeError."""
    cfg = as_config(cfg)  # a dict from a notebook is validated as a config file is
    from rangefinder import tracking
    from rangefinder.tracking.registry import TAG_IMPROVED_ON_BASE
    from rangefinder.tracking.target import run_ui_link, ui_url_hint

    delivered, chosen = delivered_weights(model_dir)
    weights = delivered
    metrics: dict[str, float] = {"lr": lr, "epochs": epochs}
    tags: dict[str, str] = {}
    # Final weights are the retrain's or the fine-tune's, as the run that wrote them says: the config's retrain
    # setting tells them apart only in rangefinder's own pipeline, where it also decides whether retrain-full runs;
    # a pipeline of someone else's that wires retrain-full to register-model need not set it.
    retrained_here = retrained_on_all_data(model_dir)
    retrained = chosen is None and (cfg.retrain.enabled if retrained_here is None else retrained_here)
    # The step whose run made these weights: the version links to it (its curves and decisions).
    source_step = "retrain_full" if retrained else "finetune"
    if chosen is not None:
        # The weights are a checkpoint (or an average) at its own update and epoch: the length handed in is the one
        # the fine-tune recommends, and a version's `epochs` beside `epoch` read as how long these weights trained.
        metrics["recommended_epochs"] = metrics.pop("epochs")
        metrics.update({k: chosen[k] for k in ("update", "epoch", "val_loss") if chosen.get(k) is not None})
        tags = {"rangefinder.weights": f"finetune {delivered_name(chosen)}", "rangefinder.chosen_because":
                chosen["status"]}
        # Which rule picked the checkpoint (analysis.delivered_checkpoint), and whether it beats the base model;
        # a chosen.json written before the rules were named has neither.
        if chosen.get("rule") is not None:
            tags["rangefinder.chosen_rule"] = str(chosen["rule"])
        if chosen.get("improved_on_base") is not None:
            tags[TAG_IMPROVED_ON_BASE] = str(chosen["improved_on_base"]).lower()
        description = chosen["reason"]
    else:
        tags = {"rangefinder.weights": "retrain_full final" if retrained else "finetune final"}
        description = (f"Retrained on train + validation for {epochs} epochs (the fine-tune's recommended length) "
                       f"at lr {lr:.3g}, without validation." if retrained else
                       f"The fine-tune's final weights after {epochs} epochs at lr {lr:.3g} (no validated "
                       "checkpoint to choose from).")
    if (weights / "model_index.json").is_file():  # logged as it is, before any run starts: the export checks its own
        from rangefinder.models.loading import refuse_shipped_code

        refuse_shipped_code(weights, f"the delivered model {weights}")
    with tempfile.TemporaryDirectory(prefix="rangefinder-register-") as scratch:
        if not (weights / "model_index.json").is_file():
            # LoRA and textual inversion deliver a small file; the registry gets a whole pipeline that generates
            # on its own (the step's input artifact may be read-only, so it is built in scratch space), and the
            # delivered files beside it.
            from rangefinder.models.loading import resolve_base_model
            from rangefinder.sampling import export_pipeline

            weights = export_pipeline(weights, resolve_base_model(cfg.model).path, Path(scratch) / "pipeline",
                                      cfg.model.variant)

        where: dict[str, Optional[str]] = {}

        def register() -> tracking.RegisteredVersion:
            with tracking.step_run(cfg, "register_model", parent_run_id=mlflow_parent_run_id) as run:
                where["mlflow_ui"], where["mlflow_link"] = run_ui_link(
                    run.tracking_uri, run.experiment_id, run.parent_run_id or run.run_id, cfg.tracking.ui_url)
                where["mlflow_hint"] = ui_url_hint(run.tracking_uri, cfg.tracking.ui_url)
                # The model's defaults are the settings the run's samples and grid were drawn with, so that by
                # default it renders what the person promoting it looked at.
                v = run.log_diffusers_model(weights, metrics=metrics, tags=tags, description=description,
                                            num_inference_steps=cfg.sampling.num_inference_steps,
                                            guidance_scale=cfg.sampling.guidance_scale,
                                            scheduler=cfg.sampling.scheduler,
                                            resolution=cfg.sampling.resolution or cfg.data.resolution,
                                            delivered=None if weights == delivered else delivered,
                                            source_step=source_step)
                held = f"@{v.alias}" if v.alias else "not @candidate: a pipeline run started later holds it"
                model = (f"registered as {v.name} version {v.version} ({held})" if v.version else
                         f"logged as {v.model_uri} (tracking.registered_model_name is empty: not registered)")
                # The last step that knows the whole decision writes the pipeline run's description: what the weights
                # are (a checkpoint, or a window average of updates a-b: not "the recommended epochs", which the
                # fine-tune's run gives), as the version's description says.
                lead = description if chosen is None else delivered_lead(chosen, lr)
                run.describe(f"The delivered weights, {model}: {description}",
                             pipeline=f"{lead} They are {model}.")
                return v

        # The server must answer now (a version number cannot wait in a spool): wait for it a bounded time, then
        # say how to register these weights later (the config is kept for that only then, not on every run).
        v = tracking.retry_while_server_away(
            cfg, register, what="register the model",
            later=lambda: _later_command(cfg, model_dir, lr, epochs, mlflow_parent_run_id))
    # The registry's name for it when registered (what a person loads or promotes), else the logged model's URI.
    uri = f"models:/{v.name}/{v.version}" if v.version else v.model_uri
    registered = Registered(model_uri=uri, version=v.version, weights=delivered, **where)
    if result_md is not None:
        from rangefinder.formats.atomic import write_text

        if chosen is not None:
            at = ", ".join(f"{k} {chosen[k]:g}" for k in ("update", "epoch") if chosen.get(k) is not None)
            what = f"the fine-tune's {delivered_name(chosen)}" + (f" ({at})" if at else "")
            length = ("Recommended epochs", str(epochs))
        else:
            what = "the full-data retrain's final weights" if retrained else "the fine-tune's final weights"
            length = ("Epochs trained", str(epochs))
        write_text(result_md, result_markdown(registered, lr=lr, length=length, weights=what, why=description))
    return registered


def _later_command(cfg: RangefinderConfig, model_dir: Path, lr: float, epochs: int,
                   parent_run_id: Optional[str]) -> str:
    """The `rangefinder register` command that does this step's work later, with the step's resolved config kept
    beside the MLflow spools (the data volume on a cluster, which outlives the pod)."""
    import shlex

    from rangefinder.formats.atomic import write_json
    from rangefinder.tracking.spool import spool_dir

    kept = spool_dir() / f"register-model-{parent_run_id or 'config'}.json"
    try:
        write_json(kept, cfg.model_dump(mode="json"))
        config = str(kept)
    except OSError:
        config = "CONFIG.yaml"  # not writable: the user names the config the pipeline ran with
    words = ["rangefinder", "register", str(model_dir), "--config", config, "--lr", repr(float(lr)), "--epochs",
             str(epochs)] + (["--parent-run-id", parent_run_id] if parent_run_id else [])
    return shlex.join(words)
