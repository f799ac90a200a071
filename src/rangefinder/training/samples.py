"""Samples during training: the run's fixed prompts x seeds rendered from its current weights at chosen
validations, so that a bad run shows early (diffusers' `--validation_prompt`, kohya's `--sample_every_n_steps` and
EveryDream2's sample prompts do the same).

When: at the update-0 baseline (the strip starts from the base model), at every Nth validation after it
(`sampling.every_validations`; "auto": N such that a run renders about AUTO_GRIDS grids after its baseline) and at
the run's last validation. Rank 0 only; a validation whose losses are not finite (a diverged run) is not sampled.

How: a diffusers pipeline of the run's family (`Family.sampling_pipeline`) over the run's own modules as they are in
memory, with the EMA weights swapped in when validation measures them, in eval mode and without gradients; no
checkpoint is written or read. Every RNG is saved and restored around it and each module's train/eval flag is put
back, as validation does, so a run with samples trains bit for bit the weights of a run without
(tests/training/test_samples.py). Each cell's initial latents come from a CPU generator seeded with its seed, as in
the final grid (rangefinder.sampling), so cells of two updates differ only by the weights. The grid is the final
grid's layout (formats/grid.py).

Outputs, under the run's `samples/`:
- `update-000040.png`: one validation's grid (one row: each prompt x seed), labelled; what MLflow shows;
- `update-000040/p00-s0.png`: its cells, for the fine-tune report's "samples over training" strip;
- `index.json`: the settings and one entry per grid (update, epoch, files, seconds, the MLflow run it went to),
  rewritten atomically after each grid's files, so an entry only names whole files. A resumed run keeps the entries
  up to the update it resumed at and renders the later ones again (it retraces the lost updates exactly), so the
  index has neither duplicates nor gaps.

MLflow: each grid goes to the run's sink when it is a `training.ImageSink` (the step's MLflow run:
`log_image(path, key=SAMPLES_KEY, step=update)`, MLflow's step-keyed images; the engine never imports mlflow). An
entry records the sink's `run_id`; a resumed run logs the kept grids its sink's run does not hold yet (a retried
step's new MLflow run gets the whole strip) and does not log again a grid that run already holds.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from rangefinder.formats.atomic import atomic_path, read_written_json, write_json
from rangefinder.models.loading import pipeline_call_kwargs
from rangefinder.planning import planned_validations
from rangefinder.training.family_detection import SAMPLING_GUIDANCE_REFUSAL, guidance_scale_in
from rangefinder.training.geometry import ModelGeometry, check_sampling_resolution
from rangefinder.training.sinks import ImageSink
from rangefinder.training.validation import preserved_rng

if TYPE_CHECKING:
    from rangefinder.config import SamplingConfig
    from rangefinder.training.run import Run
    from rangefinder.training.state import RunState

_log = logging.getLogger(__name__)

SAMPLES_DIR = "samples"
INDEX_NAME = "index.json"
SAMPLES_KEY = "samples_during_training"  # the MLflow image series
# "auto" aims at this many grids after the baseline: enough to see a run turn, a bounded cost whatever its length.
AUTO_GRIDS = 10


def resolve_every(setting: Any, planned: int) -> Optional[int]:
    """sampling.every_validations as a count of validations (None: no samples): "auto" spreads about AUTO_GRIDS
    grids over the validations after the baseline."""
    if setting is None:
        return None
    if setting == "auto":
        return max(1, math.ceil((planned - 1) / AUTO_GRIDS))
    return int(setting)


def samples_guidance_scale(family: str, model_dir: Optional[Path], setting: Optional[float]) -> Optional[float]:
    """The guidance scale the samples draw at and their index records: the one `rangefinder sample`'s grid records
    (family_detection.guidance_scale_in), None for a model without the guidance input (FLUX.1-schnell, whose scale
    FluxPipeline never feeds its transformer); the family's own where the parts came from no folder. ConfigError
    for a `setting` above 0 given for a model without that input, as resolve-config's preflight says it, for a run
    started without the preflight."""
    return guidance_scale_in(model_dir, family, setting, refuse=SAMPLING_GUIDANCE_REFUSAL)


def read_index(run_dir: Path) -> Optional[dict[str, Any]]:
    """The samples index of a run folder (see the module's doc), or None when it has none."""

    path = Path(run_dir) / SAMPLES_DIR / INDEX_NAME
    if not path.is_file():
        return None
    return read_written_json(
        path, lambda index: isinstance(index, dict) and isinstance(index.get("samples", []), list),
        "not a samples index", "it is written whole after each grid, so it was damaged or changed since: remove it to "
        "go on (a resumed run then drops the grids from before the update it resumes at and renders the later ones)")


@dataclass
class TrainingSamples:
    """The samples of one run (rank 0): when they are due, how they are rendered, where they go."""

    run: Run
    cfg: SamplingConfig
    every: int  # render at every Nth validation (and the baseline and the last)
    resolution: int  # pixels, square
    guidance_scale: Optional[float]  # sampling.guidance_scale, or the base model's own; None: it has no guidance input
    sink: Optional[ImageSink]
    index: dict[str, Any]
    folder: Path
    # Grids a resumed run renders again, whose first rendering already went to an MLflow run: update -> its run id.
    logged_before: dict[int, str] = field(default_factory=dict)
    _pipe: Any = None

    # --- setup ------------------------------------------------------------------------------------------------

    @classmethod
    def start(cls, run: Run, state: RunState, cfg: Optional[SamplingConfig],
              sink: Any = None) -> Optional[TrainingSamples]:
        """The run's samples after its setup and resume, or None when there are none (off, no validation, or not
        rank 0). Checks the settings the pipeline would only refuse mid-run, and puts the index in order."""
        if cfg is None or not run.main or not run.validating:
            return None
        every = resolve_every(cfg.every_validations, planned_validations(run.settings.plan, run.val_cfg))
        if every is None:
            return None
        resolution = cfg.resolution or run.data.data_cfg.resolution
        # The rule resolve-config's preflight applies too (geometry.py), here for a run started without it.
        check_sampling_resolution(ModelGeometry.loaded(run.family, run.sd), resolution)
        if cfg.scheduler is not None:
            from rangefinder.models.loading import check_scheduler_name, check_scheduler_takes

            check_scheduler_name(cfg.scheduler)
            check_scheduler_takes(run.sd.family, cfg.scheduler)
        folder = run.settings.out_dir / SAMPLES_DIR
        guidance = samples_guidance_scale(run.sd.family, run.sd.model_dir, cfg.guidance_scale)
        settings = {"prompts": list(cfg.prompts), "seeds": cfg.seeds_for_training(),
                    "num_inference_steps": cfg.num_inference_steps, "guidance_scale": guidance,
                    "scheduler": cfg.scheduler, "resolution": resolution, "every_validations": every}
        samples = cls(run, cfg, every, resolution, guidance, sink if isinstance(sink, ImageSink) else None,
                      {"settings": settings, "samples": []}, folder)
        samples._resume(read_index(run.settings.out_dir), state)
        return samples

    def _resume(self, before: Optional[dict[str, Any]], state: RunState) -> None:
        """Keep the entries of the grids rendered up to the update the run resumed at (all of them are again
        rendered when it starts afresh), remove files no entry names, and log the kept grids the sink's run lacks."""
        if before is not None and before.get("settings") != self.index["settings"]:
            if before.get("samples"):
                _log.warning("rangefinder: the sampling settings changed since %s was written; its samples are "
                             "replaced by this run's", self.folder)
            before = None
        entries = before["samples"] if before is not None else []
        resumed_at = state.resumed_from
        kept = [e for e in entries if resumed_at is not None and e["update"] <= resumed_at]
        self.logged_before = {e["update"]: e["logged_to"] for e in entries
                              if e not in kept and e.get("logged_to") is not None}
        self.index["samples"] = kept
        if self.folder.is_dir():
            import shutil

            named = {Path(e["grid"]).stem for e in kept}
            for p in self.folder.glob("update-*"):
                if p.name.split(".")[0] not in named:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        run_id = self._sink_run_id()
        for e in kept:
            if self.sink is not None and run_id is not None and e.get("logged_to") != run_id:
                self.sink.log_image(str(self.folder / e["grid"]), key=SAMPLES_KEY, step=int(e["update"]))
                e["logged_to"] = run_id
        self._write_index()

    def _sink_run_id(self) -> Optional[str]:
        """Where the sink's images land: its run, and its key prefix if any (training.PrefixedSink's `sink_id`)."""
        run_id = getattr(self.sink, "sink_id", None) or getattr(self.sink, "run_id", None)
        return str(run_id) if run_id is not None else None

    # --- at a validation --------------------------------------------------------------------------------------

    def after_validation(self, state: RunState, last: bool) -> None:
        """Render, save and log the grid when the validation just written (the newest metrics row) is due."""
        nth = len(state.log.metrics_rows) - 1  # 0: the baseline
        if nth < 0 or not (nth % self.every == 0 or last):
            return
        row = state.log.metrics_rows[-1]
        losses = [row.get(k) for k in ("val_loss", "stabilize_loss")]
        if any(v is not None and not math.isfinite(v) for v in losses):
            return  # a diverged model draws noise; its loss says so already
        update, epoch = int(row["update"]), float(row["epoch"])
        t0 = time.perf_counter()
        images = self.render(state)
        seconds = time.perf_counter() - t0
        entry = self._save(update, epoch, nth, images, seconds)
        run_id = self._sink_run_id()
        if self.sink is not None and (run_id is None or self.logged_before.get(update) != run_id):
            self.sink.log_image(str(self.folder / entry["grid"]), key=SAMPLES_KEY, step=update)
        entry["logged_to"] = run_id if self.sink is not None else None
        self.index["samples"].append(entry)
        self._write_index()

    def rows(self) -> list[tuple[str, int]]:
        """(prompt, seed) of each cell, prompt-major: the grid's one row, left to right."""
        return [(p, s) for p in self.cfg.prompts for s in self.cfg.seeds_for_training()]

    def render(self, state: RunState) -> list[Any]:
        """The cells (PIL images) from the weights as they are now; nothing about the run changes."""
        run, cfg = self.run, self.cfg
        cells = self.rows()
        with preserved_rng((state.train_gen,)), run.schedule_free_eval(), \
                run.ema_weights(on=not run.schedule.is_ramp), \
                self._eval_mode(), self._vae_on_device():
            pipe = self._pipeline()
            generators = [torch.Generator("cpu").manual_seed(int(seed)) for _, seed in cells]
            with run.accelerator.autocast():
                out = pipe(prompt=[p for p, _ in cells], num_inference_steps=cfg.num_inference_steps,
                           height=self.resolution, width=self.resolution, generator=generators,
                           **({} if self.guidance_scale is None else {"guidance_scale": self.guidance_scale}),
                           **pipeline_call_kwargs(pipe))
        return list(out.images)

    def _pipeline(self) -> Any:
        if self._pipe is None:
            sd = self.run.sd
            pipe = self.run.family.sampling_pipeline(sd, sampling_scheduler(sd, self.cfg.scheduler))
            pipe.set_progress_bar_config(disable=True)
            self._pipe = pipe
        return self._pipe

    @contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """Every module of the model in eval mode inside; each submodule's own train/eval flag put back after."""
        sd = self.run.sd
        modules = [sd.unet, sd.vae, *sd.text_encoders().values(), *self.run.modules.values()]
        flags = [(m, m.training) for top in modules for m in top.modules()]
        for top in modules:
            top.eval()
        try:
            yield
        finally:
            for m, training in flags:
                m.training = training

    @contextmanager
    def _vae_on_device(self) -> Iterator[None]:
        """The VAE decodes on the run's device; a run that cached its latents keeps it on the CPU otherwise."""
        vae = self.run.sd.vae
        where = next(vae.parameters()).device
        moved = where != self.run.device
        if moved:
            vae.to(self.run.device)
        try:
            yield
        finally:
            if moved:
                vae.to(where)

    # --- files ------------------------------------------------------------------------------------------------

    def _save(self, update: int, epoch: float, nth: int, images: list[Any], seconds: float) -> dict[str, Any]:
        files = save_sample_grid(self.folder, update, grid_title(update, epoch), self.rows(),
                                 len(self.cfg.seeds_for_training()), images)
        return {"update": update, "epoch": epoch, "validation": nth, **files, "seconds": seconds}

    def _write_index(self) -> None:
        write_json(self.folder / INDEX_NAME, self.index)


def grid_title(update: int, epoch: float, note: str = "") -> str:
    """A sample grid's title: `update U, epoch E` and an optional note."""
    return f"update {update}, epoch {epoch:g}{note}"


def save_sample_grid(folder: Path, update: int, title: str, rows: Sequence[tuple[str, int]], seeds_per_prompt: int,
                     images: list[Any]) -> dict[str, Any]:
    """Write one update's samples under `folder`: each cell as `update-NNNNNN/pPP-sSEED.png` and the grid of them,
    titled `title` (`grid_title`), as `update-NNNNNN.png`, each atomically. `rows` are the cells' (prompt, seed) in
    order, `seeds_per_prompt` of them per prompt; the cells are square images of one size. Returns the index entry's
    `grid` and `cells`."""
    from rangefinder.formats.grid import compose_grid

    stem = f"update-{update:06d}"
    cells = []
    for i, ((_, seed), img) in enumerate(zip(rows, images, strict=True)):
        rel = f"{stem}/p{i // seeds_per_prompt:02d}-s{seed}.png"
        _save_png(img, folder / rel)
        cells.append(rel)
    labels = [f"{p} | seed {s}" for p, s in rows]
    grid, _ = compose_grid([images], [title], labels, max(images[0].width, 128))
    _save_png(grid, folder / f"{stem}.png")
    return {"grid": f"{stem}.png", "cells": cells}


def _save_png(img: Any, path: Path) -> None:
    with atomic_path(path, suffix=".png") as tmp:
        img.save(tmp, format="PNG")


def sampling_scheduler(sd: Any, name: Optional[str] = None) -> Any:
    """The scheduler a trained model samples with: `name` (sampling.scheduler), else the base model's own
    (model_index.json), set up from the model's scheduler config and predicting what its training scheduler predicts
    (`sd.noise_scheduler`, on which the run's family registered training.prediction_type: family.py
    `_checked_prediction_type`). The one source of the prediction type for the run's samples, a checkpoint's samples
    (sampling.py) and a saved SDXL folder's scheduler (methods/full.py); a flow-matching family's scheduler predicts
    none and keeps its own FlowMatch* class."""
    import json

    import diffusers

    folder = sd.model_dir
    config = sd.noise_scheduler.config
    cls_name = name
    if folder is not None and (Path(folder) / "scheduler" / "scheduler_config.json").is_file():
        config = diffusers.DDPMScheduler.load_config(str(folder), subfolder="scheduler")
        if cls_name is None:
            index = Path(folder) / "model_index.json"
            entry = json.loads(index.read_text()).get("scheduler") if index.is_file() else None
            cls_name = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
    cls = getattr(diffusers, cls_name or type(sd.noise_scheduler).__name__)
    predicts = sd.noise_scheduler.config.get("prediction_type")
    if predicts is None:  # a flow-matching family: its own FlowMatch* scheduler (no prediction type)
        from rangefinder.training.family_rules import check_flow_scheduler

        check_flow_scheduler(type(sd.noise_scheduler).__name__, cls.__name__)
        return cls.from_config(config)
    return cls.from_config(config, prediction_type=predicts)
