"""Step `sample_images`: the fixed prompts and seeds rendered by the base model and each trained model, one grid.

Columns: the base model (the same resolved folder the runs trained from), the fine-tune's chosen checkpoint (the
model registered without a retrain) and any other kept checkpoints, its final weights, and the full-data retrain
when there is one. Only the weights differ between two cells of a row (rangefinder.sampling).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Optional

from rangefinder.config import ConfigLike, RangefinderConfig, as_config
from rangefinder.steps.kept_settings import keeps_mlflow_settings


def column_slug(label: str) -> str:
    """A column's metric name that stays the same from run to run: base, chosen, final, retrained, update_N."""
    if label.startswith("chosen"):
        return "chosen"
    if label == "fine-tuned (final)":
        return "final"
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_")


def grid_columns(cfg: RangefinderConfig, finetuned_dir: Path, retrained_dir: Optional[Path]) -> tuple[list, list]:
    """(models, labels) of the grid, base model first."""
    from rangefinder.formats import checkpoints
    from rangefinder.models.loading import resolve_base_model
    from rangefinder.steps.average import average_label

    models: list = [resolve_base_model(cfg.model).path]
    labels = ["base"]
    chosen = checkpoints.read_chosen(finetuned_dir)
    if chosen is not None:
        models.append(Path(finetuned_dir) / checkpoints.CHOSEN_DIR)
        epoch = f"epoch {chosen['epoch']:g}, " if chosen.get("epoch") is not None else ""
        averaged = chosen.get("rule") == "window_average" and (chosen.get("average") or {}).get("updates")
        labels.append(f"chosen ({average_label(chosen['average'])})" if averaged
                      else f"chosen ({epoch}update {chosen['update']})")
    # Kept checkpoints hold the method's trained tensors only; the grid applies them on top of the base model.
    for ckpt in checkpoints.list_checkpoints(Path(finetuned_dir) / checkpoints.RUN_DIR):
        if chosen is not None and ckpt.name == chosen["checkpoint"]:
            continue  # the chosen column already shows these weights
        models.append(ckpt)
        labels.append(f"update {checkpoints.checkpoint_update(ckpt)}")
    models.append(Path(finetuned_dir) / "final")
    labels.append("fine-tuned (final)")
    if retrained_dir is not None:
        models.append(Path(retrained_dir) / "final")
        labels.append("retrained")
    return models, labels


def grid_note(prompts: int, seeds: int, labels: list[str], scores: list[dict]) -> str:
    """The sample-images run's description. The colour scores (sampling.prompt_scores) exist only for prompts that
    name the synthetic data's colours and shapes; a user's own prompts have none, and the note says nothing of them
    (it ended "how well each follows the prompts' colours: .")."""
    def count(n: int, what: str) -> str:
        return f"{n} {what}" if n == 1 else f"{n} {what}s"

    note = (f"Sample grid: {count(prompts, 'prompt')} x {count(seeds, 'seed')} for {', '.join(labels)}, the same "
            "noise in every column")
    if scores:
        note += "; how well each follows the prompts' colours: " + ", ".join(
            f"{s['column']} {s['colour']:.2f}" for s in scores)
    return note + "."


@keeps_mlflow_settings
def run_sample_images(cfg: ConfigLike, *, finetuned_dir: Path, retrained_dir: Optional[Path] = None,
                      out_dir: Path, grid_html: Optional[Path] = None,
                      mlflow_parent_run_id: Optional[str] = None) -> dict:
    """Render the config's sampling prompts and seeds with the base model and the fine-tune's models in
    `finetuned_dir` (its chosen checkpoint, other kept checkpoints, its final weights) and the retrain's in
    `retrained_dir` where given, into `out_dir` (the grid, its images and manifest), and log them to the step's
    MLflow run (a child of `mlflow_parent_run_id` where given); the grid's HTML is copied to `grid_html` where given.
    Returns render_grid's paths and layout (rangefinder.sampling.render_grid).
    `cfg`: a RangefinderConfig, or a dict of its sections (a notebook's, a YAML file's) validated as a config file
    is (rangefinder.config.as_config: ConfigError naming a bad setting); anything else is a TypeError."""
    cfg = as_config(cfg)  # a dict from a notebook is validated as a config file is
    from rangefinder import tracking
    from rangefinder.launch.processes import apply_torch_threads
    from rangefinder.sampling import render_grid

    apply_torch_threads()
    models, labels = grid_columns(cfg, finetuned_dir, retrained_dir)
    s = cfg.sampling
    with tracking.step_run(cfg, "sample_images", parent_run_id=mlflow_parent_run_id) as run:
        out = render_grid(models, s.prompts, s.seeds, out_dir=out_dir, labels=labels, base_model=models[0],
                          steps=s.num_inference_steps, guidance_scale=s.guidance_scale, scheduler=s.scheduler,
                          resolution=s.resolution or cfg.data.resolution, variant=cfg.model.variant)
        if grid_html is not None:
            shutil.copyfile(out["html"], grid_html)
        run.log_artifact(out_dir, "samples")
        # Also as an MLflow image, so the grid shows in the run's image view, not only as a file.
        run.log_image(out["grid"], key="sample_grid")
        # How well each column follows shapes prompts (the demo's): prompt_colour.<column>, prompt_shape.<column>
        # (data.prompt_score).
        run.log_decisions({f"prompt_{k}.{column_slug(s_['column'])}": s_[k] for s_ in out["scores"]
                           for k in ("colour", "shape")}, to_parent=False)
        run.describe(grid_note(len(s.prompts), len(s.seeds), labels, out["scores"]))
    return out
