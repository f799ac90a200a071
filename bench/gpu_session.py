"""One prepared GPU session for issue 38: the rows only a CUDA machine can measure, in order of priority, each part
in its own try/except and time budget, every result written under --out as soon as it exists.

    python -m bench.gpu_session --out $OUT --budget 440        # on the GPU machine (SD 1.5-sized, 512 px)
    python -m bench.gpu_session --out /tmp/o --tiny --budget 900   # dry run on CPU: the tiny model, 64 px

Parts (a part starts only while its minimum time is left; a stopped part says so in its JSON):
1. wholerun: `rangefinder run --local` (kfp.local, MLflow on SQLite) on the model at full size, LoRA, the default
   compile/precision settings (auto/auto), 40 synthetic images of mixed aspect ratios (buckets), short epochs, through
   every step to the registered model. Its run_summary.json facts (mixed_precision_used, compile, buckets) kept.
2. goals: the engine's full fine-tune at batch 4, 16 and 32 (eager; steady s/update from the update timestamps, the
   first updates left out), the reference loop at batch 4 and at the largest batch that fitted, LoRA at the same
   batches, the fine-tune's validation overhead (every epoch) eager, then once compiled (compile seconds, compiled
   rate, the compiled module's validation overhead).
   compile_static: the compiled run again with dynamo's automatic dynamic shapes off (static graphs per shape).
   k16: the eager validation overhead again at validation.timesteps 16 (issue 34's steadier loss), beside K 4's.
   ema: full fine-tuning and LoRA at batch 4, eager, with and without `training.use_ema`: the memory each run added
   over what it started with, steady s/update, and what the EMA adds (measured on an H200 on 2026-11-29: full
   fine-tuning's fp32 UNet copy and 9 % per update, LoRA's 3 MB; bench/RESULTS.md, "GPU rows, third session").
   ti: textual inversion through the engine at the first and last batch, eager: images/s beside full's.
   weights: the full fine-tune at every batch with training.weights_dtype fp32 (autocast) and bf16 (bf16 weights,
   fp32 master in the optimizer), eager: images/s, MFU and peak memory of each.
   precision: the UNet's training step alone (forward, backward, clipping, fused AdamW) at each batch, four ways: the
   engine's (fp32 weights under bf16 autocast) with and without channels_last, and bf16 weights without autocast
   whose fp32 master copy the optimizer steps (cast in once per update), with and without channels_last. The first
   session's profile put 28 % of the GPU time in copies (autocast's casts around group norm and the weights); this
   measures what leaving autocast would give before the engine is changed for it.
3. extras: a torch.profiler summary of the full fine-tune at the largest batch, the bf16 all-reduce hook's cost under
   DDP on NCCL with one process.
Files: env.json, wholerun.json, wholerun_log.txt, goals.json, precision.json, profile.txt, extras.json (and the
caller's log.txt). `--wholerun-method full` runs the whole run as a full fine-tune, `--wholerun-model sdxl` on an
SDXL-sized model at 1024 px; `--wholerun-last` runs it after the other parts, with the time they left.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

T0 = time.monotonic()


# What goals() runs; all but ema, ti and weights need its eager validation run.
GOAL_PARTS = {"goals", "compile", "compile_static", "k16", "ema", "ti", "weights"}


def elapsed() -> float:
    return time.monotonic() - T0


def say(msg: str) -> None:
    print(f"[gpu_session {elapsed():6.1f}s] {msg}", flush=True)


def dump(out: Path, name: str, data: Any) -> None:
    tmp = out / (name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(out / name)


# ---------------------------------------------------------------------------------------------------------------
# Data


def write_mixed_dataset(folder: Path, count: int, base: int) -> Path:
    """`count` PNGs with captions in five aspect ratios (1:1, 10:7, 7:10, 9:8, 8:9 at about base^2 pixels), so the
    engine's aspect-ratio buckets have several buckets to fill."""
    import random

    from PIL import Image, ImageDraw

    if (folder / "done").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    shapes = [(1.0, 1.0), (1.25, 0.875), (0.875, 1.25), (1.125, 1.0), (1.0, 1.125)]
    colours = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
    rng = random.Random(0)
    for i in range(count):
        fw, fh = shapes[i % len(shapes)]
        w, h = int(base * fw) // 8 * 8, int(base * fh) // 8 * 8
        name, rgb = rng.choice(sorted(colours.items()))
        bg = tuple(rng.randrange(256) for _ in range(3))
        img = Image.new("RGB", (w, h), bg)
        d = ImageDraw.Draw(img)
        r = rng.randrange(min(w, h) // 6, min(w, h) // 3)
        cx, cy = rng.randrange(r, w - r), rng.randrange(r, h - r)
        kind = rng.choice(["circle", "square"])
        (d.ellipse if kind == "circle" else d.rectangle)([cx - r, cy - r, cx + r, cy + r], fill=rgb)
        img.save(folder / f"{i:05d}.png")
        (folder / f"{i:05d}.txt").write_text(f"a {name} {kind}")
    (folder / "done").write_text("")
    return folder


# ---------------------------------------------------------------------------------------------------------------
# 1. The whole run


def whole_run(out: Path, work: Path, model_dir: Path, resolution: int, budget: float, tiny: bool,
              method: str = "lora") -> dict[str, Any]:
    import yaml

    data = write_mixed_dataset(work / f"mixed-40-{resolution}px", 40, resolution)
    run_out = work / "wholerun"
    cfg = {
        "data": {"dataset_dir": str(data), "resolution": resolution},
        "model": {"base_model": str(model_dir)},
        # Defaults kept: mixed_precision auto, compile auto, bucketing on; batch 4 keeps the epochs short.
        "training": {"method": method, "batch_size": 4, "cache_dir": str(work / "wholerun-cache")},
        "lr_range_test": {"epochs": 3, "validate_every_updates": 2, "zoom": False},
        "finetune": {"epochs": 2},
        "validation": {"every_updates": 2},
        "sampling": {"prompts": ["a red circle"], "seeds": [0], "num_inference_steps": 4},
        "tracking": {"tracking_uri": f"sqlite:///{run_out / 'mlflow.db'}"},
    }
    run_out.mkdir(parents=True, exist_ok=True)
    cfg_path = work / "wholerun.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "rangefinder.cli.main", "run", "--local", "--config", str(cfg_path),
           "--out", str(run_out), "--json"]
    say(f"wholerun: {' '.join(cmd)} (budget {budget:.0f} s)")
    t0 = time.perf_counter()
    result: dict[str, Any] = {"config": cfg, "command": cmd}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget, env=env)
        result.update(rc=proc.returncode, stderr_tail=proc.stderr[-3000:])
        try:
            result["summary"] = json.loads(proc.stdout)
        except json.JSONDecodeError:
            result["stdout_tail"] = proc.stdout[-3000:]
    except subprocess.TimeoutExpired:
        result["rc"] = "timeout"
    result["seconds"] = time.perf_counter() - t0
    summaries = []
    for p in sorted(run_out.rglob("run_summary.json")):
        s = json.loads(p.read_text())
        tr = s.get("training", {})
        summaries.append({
            "path": str(p.relative_to(run_out)), "status": s.get("status"), "updates": s.get("updates"),
            "mixed_precision_used": s.get("mixed_precision_used", tr.get("mixed_precision")),
            "compile": s.get("compile"), "family": s.get("family"), "resolution": s.get("resolution"),
            "buckets": s.get("buckets"), "seconds": s.get("seconds"),
            "updates_per_second": s.get("updates_per_second"), "method": tr.get("method"),
            "channels_last": tr.get("channels_last"), "best_val_loss": s.get("best_val_loss"),
        })
    result["run_summaries"] = summaries
    log = run_out / "pipeline.log"
    if log.is_file():
        (out / "wholerun_log.txt").write_text(log.read_text(errors="replace")[-200_000:])
    return result


# ---------------------------------------------------------------------------------------------------------------
# 2. Goals: timed engine runs (one model load each), steady rates from update timestamps


class Stamps:
    """A MetricSink that notes when each update's metrics arrive (the engine has synchronised by then: it logs the
    loss as a float); `on_update` lets a profiler step along."""

    def __init__(self, on_update: Optional[Callable[[int], None]] = None):
        self.times: dict[int, float] = {}
        self.on_update = on_update

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "train_loss" in metrics and step not in self.times:
            self.times[step] = time.perf_counter()
            if self.on_update:
                self.on_update(step)

    def steady(self, skip: int) -> Optional[float]:
        """Seconds per update from update `skip` on (the first updates carry allocation, autotuning, compile)."""
        steps = sorted(self.times)
        if len(steps) < skip + 2:
            return None
        a, b = steps[skip], steps[-1]
        return (self.times[b] - self.times[a]) / (b - a)


def engine(setup, *, method: str, batch: int, updates: int, device: str, mp: str, cache_dir: Path,
           compile: str = "off", validate_every_epochs: float = 0, skip: int = 3,
           on_update: Optional[Callable[[int], None]] = None, timed_validation: bool = False,
           timesteps: Optional[int] = None, use_ema: bool = False, weights_dtype: str = "fp32") -> dict[str, Any]:
    import torch

    from bench.common import PeakMemory, mib
    from rangefinder.config import DataConfig, TrainingConfig, ValidationConfig
    from rangefinder.training.loop import TrainSpec, train

    cfg = TrainingConfig(method=method, batch_size=batch, steps=updates, lr=1e-5, schedule="constant",
                         mixed_precision=mp, max_grad_norm=1.0, seed=0, cache_dir=str(cache_dir),
                         channels_last=device == "cuda", compile=compile, use_ema=use_ema,
                         weights_dtype=weights_dtype)
    val = ValidationConfig(every_epochs=validate_every_epochs,
                           **({"timesteps": timesteps} if timesteps else {}))  # None: the shipped K
    stamps = Stamps(on_update)
    out = Path(tempfile.mkdtemp(prefix="gpu-engine-"))
    calls: list[float] = []
    # What an earlier run left for the collector would count in this one's peak (the allocator's peak is absolute):
    # the H200 call of 2026-11-29 read 1.65 GB "added by LoRA's EMA", a bf16 UNet's size, where the EMA holds the
    # adapter's 3 MB. Collected first, and the bytes still allocated at the start recorded beside the peak.
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    with PeakMemory(device) as mem:
        if timed_validation:
            from bench.validation_overhead import timed_measure

            with timed_measure() as calls:
                result = train(TrainSpec(cfg, val, split_dir=setup.split_dir, model=str(setup.model_dir),
                                         data=DataConfig(resolution=setup.resolution)),
                               out_dir=out / "run", save_final=False, metric_sink=stamps)
        else:
            result = train(TrainSpec(cfg, val, split_dir=setup.split_dir, model=str(setup.model_dir),
                                     data=DataConfig(resolution=setup.resolution)),
                           out_dir=out / "run", save_final=False, metric_sink=stamps)
    wall = time.perf_counter() - t0
    summary = json.loads(result.summary_path.read_text())
    per = stamps.steady(skip)
    steps = sorted(stamps.times)
    first = stamps.times[steps[0]] if steps else None
    row = {
        "method": method, "batch_size": batch, "updates": result.updates, "compile": summary["compile"],
        "use_ema": use_ema, "weights_dtype": weights_dtype,
        "mixed_precision_used": summary.get("mixed_precision_used", summary["training"]["mixed_precision"]),
        "loop_seconds": summary["seconds"], "wall_seconds": wall, "steady_s_per_update": per,
        "images_per_second": batch / per if per else None, "peak_mib": mib(mem.peak_bytes),
        "start_mib": mib(mem.start_bytes), "added_mib": mib(mem.added_bytes),
        "update_times": [stamps.times[s] - first for s in steps] if first else [],
    }
    if timed_validation:
        row["validation_seconds"] = list(calls)
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def reference(setup, *, batch: int, updates: int, mp: str, timed_from: int) -> dict[str, Any]:
    from bench.reference_loop import train_reference

    r = train_reference(setup.model_dir, setup.split_dir, updates=updates, batch_size=batch,
                        resolution=setup.resolution, lr=1e-5, mixed_precision=mp, timed_from=timed_from)
    return {"batch_size": batch, **r.as_dict(), "steady_s_per_update": 1 / r.updates_per_second}


def goals(out: Path, work: Path, setup, device: str, mp: str, deadline: float, tiny: bool,
          batches: list[int], parts: set[str]) -> dict[str, Any]:
    import torch

    from bench.speed_vs_reference import device_peak_flops, unet_flops_per_update

    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    peak = device_peak_flops(name) if device == "cuda" else None
    res: dict[str, Any] = {"device": name, "peak_flops": peak, "resolution": setup.resolution, "mixed_precision": mp,
                           "batches": batches, "full": {}, "reference": {}, "lora": {}, "errors": []}
    cache = work / "goal-cache"
    upd = {b: (6 if tiny else max(8, min(20, 160 // b))) for b in batches}

    def left() -> float:
        return deadline - elapsed()

    def flops(b: int, trains: bool) -> float:
        return unet_flops_per_update(setup.model_dir, batch_size=b, resolution=setup.resolution, unet_trains=trains)

    def mfu(row: dict[str, Any], trains: bool) -> None:
        if row.get("steady_s_per_update"):
            f = flops(row["batch_size"], trains)
            row["flops_per_update"] = f
            row["tflops"] = f / row["steady_s_per_update"] / 1e12
            row["mfu"] = f / row["steady_s_per_update"] / peak if peak else None

    def guarded(label: str, need: float, fn: Callable[[], Any]) -> Any:
        if left() < need:
            res["errors"].append(f"{label}: not run, device time ({left():.0f} s left, needs ~{need:.0f})")
            say(res["errors"][-1])
            return None
        say(f"{label} ...")
        try:
            v = fn()
            say(f"{label}: done")
            return v
        except Exception as e:  # noqa: BLE001 - one part's failure must not lose the rest
            oom = "out of memory" in str(e).lower() or isinstance(e, torch.cuda.OutOfMemoryError) or \
                isinstance(e.__cause__, torch.cuda.OutOfMemoryError)
            res["errors"].append(f"{label}: {'OOM' if oom else ''} {type(e).__name__}: {str(e)[:600]}")
            say(res["errors"][-1])
            if not oom:
                traceback.print_exc()
            if device == "cuda":
                torch.cuda.empty_cache()
            return "oom" if oom else None
        finally:
            dump(out, "goals.json", res)

    # a. full fine-tune, eager, ascending batches: MFU at each, the largest that fits
    largest = None
    for b in (batches if "goals" in parts else []):
        row = guarded(f"full eager b{b}", 25, lambda b=b: engine(setup, method="full", batch=b, updates=upd[b],
                                                                  device=device, mp=mp, cache_dir=cache))
        if row == "oom" or row is None:
            break
        mfu(row, True)
        res["full"][b] = row
        largest = b
    res["largest_full_batch_tried"] = largest
    best = max(res["full"], key=lambda b: res["full"][b]["images_per_second"] or 0) if res["full"] else None
    res["best_full_batch"] = best
    # b. the reference at batch 4 and at the largest
    for b in (sorted({batches[0], largest} - {None}) if "goals" in parts else []):
        row = guarded(f"reference b{b}", 25, lambda b=b: reference(setup, batch=b, updates=upd[b] - 1, mp=mp,
                                                                    timed_from=3))
        if isinstance(row, dict):
            mfu(row, True)
            res["reference"][b] = row
            if b in res["full"] and res["full"][b]["steady_s_per_update"]:
                row["engine_over_reference"] = row["steady_s_per_update"] / res["full"][b]["steady_s_per_update"]
    # c. LoRA at the same batches
    for b in (sorted({batches[0], best} - {None}) if "goals" in parts else []):
        row = guarded(f"lora eager b{b}", 25, lambda b=b: engine(setup, method="lora", batch=b, updates=upd[b],
                                                                  device=device, mp=mp, cache_dir=cache))
        if isinstance(row, dict):
            mfu(row, False)
            res["lora"][b] = row
            if b in res["full"] and res["full"][b]["images_per_second"]:
                row["lora_over_full"] = row["images_per_second"] / res["full"][b]["images_per_second"]
    # d. validation overhead of the fine-tune (every epoch), eager, batch 4
    b4 = batches[0]

    def median_interval(row: dict[str, Any]) -> Optional[float]:
        # Steady seconds per update between validations: the median gap between consecutive updates (a gap that
        # holds a validation pass, or the compile in the first updates, is an outlier the median ignores).
        ts = row["update_times"]
        return statistics.median(b - a for a, b in zip(ts[2:], ts[3:], strict=False)) if len(ts) > 4 else None

    def val_run(compile: str, timesteps: Optional[int] = None) -> dict[str, Any]:
        from torch._dynamo.utils import counters

        from rangefinder.config import ValidationConfig
        from rangefinder.data.split import read_split

        epochs = 1 if tiny else 3
        epochs_updates = epochs * -(-len(read_split(setup.split_dir).train) // b4)  # whole epochs: ceil
        counters.clear()
        if compile == "on":
            torch._dynamo.reset()  # a compiled run before this one leaves graphs a new run could reuse
        row = engine(setup, method="full", batch=b4, updates=epochs_updates, device=device, mp=mp, cache_dir=cache,
                     compile=compile, validate_every_epochs=1, timed_validation=True, timesteps=timesteps)
        if compile == "on":  # what dynamo compiled, and whether it ran any frame eager for its recompile limit
            config = torch._dynamo.config
            row["dynamo"] = {"unique_graphs": counters["stats"]["unique_graphs"], "frames": dict(counters["frames"]),
                             "recompile_limit": getattr(config, "recompile_limit", None),
                             "recompile_limit_fallbacks": [k for k in counters["unimplemented"]
                                                           if "recompile limit" in k.lower()]}
        row["validation_timesteps"] = timesteps or ValidationConfig().timesteps
        times = row["validation_seconds"]
        # measure_subset calls per pass: val and stabilize (validation.stabilize_every=1). Passes: update 0, every
        # epoch's end and the run's end (which is not an epoch's end when micro-batches straddle epochs).
        per_pass = 2 if read_split(setup.split_dir).stabilize else 1
        passes = max(2, len(times) // per_pass)
        row["validation_passes"] = passes
        # The loop's timer starts after the update-0 pass: training time = loop time - the later passes.
        training = row["loop_seconds"] - sum(times[per_pass:])
        row["training_seconds"] = training
        row["overhead_all_passes"] = sum(times) / training
        # Every pass at the cost of the later ones (the first carries the no-grad graph's first call, and its compile
        # when compiled).
        later = sum(times[per_pass:]) / (passes - 1)
        row["later_pass_seconds"] = later
        row["overhead_steady"] = later * passes / training
        row["median_s_per_update"] = median_interval(row)
        return row

    row = guarded("validation overhead eager", 30, lambda: val_run("off")) \
        if parts & (GOAL_PARTS - {"ema", "ti", "weights"}) else None
    if isinstance(row, dict):
        res["validation_eager"] = row
    # d'. the same at validation.timesteps 16 (issue 34's steadier loss: four times the draws per image), eager
    row = guarded("validation overhead eager K16", 30, lambda: val_run("off", 16)) if "k16" in parts else None
    if isinstance(row, dict):
        res["validation_eager_k16"] = row
        k4 = res.get("validation_eager")
        if k4:
            row["pass_seconds_over_k4"] = row["later_pass_seconds"] / k4["later_pass_seconds"]
    # e. one compiled run: compile seconds, the compiled rate at batch 4, the compiled validation's overhead
    need = 40 if tiny else 150
    row = guarded("compiled full b4 with validation", need, lambda: val_run("on")) if "compile" in parts else None
    if isinstance(row, dict):
        res["compiled"] = row
        dump(out, "goals.json", res)
        ev = res.get("validation_eager")
    if isinstance(row, dict) and ev and ev["median_s_per_update"] and row["median_s_per_update"]:
        try:
            row["gain_s_per_update"] = ev["median_s_per_update"] - row["median_s_per_update"]
            row["images_per_second"] = b4 / row["median_s_per_update"]
            ev["images_per_second"] = b4 / ev["median_s_per_update"]
            # The same run eager and compiled: the compiled loop's extra time plus what its faster updates saved
            # is what compiling cost (the training graph and validation's no-grad graph); over the per-update
            # gain, the updates after which compiling pays (COMPILE_AUTO_MIN_UPDATES).
            cost = row["loop_seconds"] - ev["loop_seconds"] + row["updates"] * row["gain_s_per_update"]
            row["compile_seconds_total"] = cost
            row["break_even_updates"] = cost / row["gain_s_per_update"] if row["gain_s_per_update"] > 0 else None
        except Exception as e:  # noqa: BLE001 - the measured rows are kept
            res["errors"].append(f"compile arithmetic: {type(e).__name__}: {e}")
    # f. compiled again with dynamo's automatic dynamic shapes off: a new shape (a partial last micro-batch, another
    # bucket) gets graphs of its own with static shapes instead of turning a dimension dynamic
    if "compile_static" in parts:
        def static_run() -> dict[str, Any]:
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                return val_run("on")

        row = guarded("compiled full b4, static shapes", need, static_run)
        if isinstance(row, dict):
            res["compiled_static"] = row
            ev = res.get("validation_eager")
            if ev and ev["median_s_per_update"] and row["median_s_per_update"]:
                row["gain_s_per_update"] = ev["median_s_per_update"] - row["median_s_per_update"]
    def pair_of(arms: dict[str, tuple[str, Callable[[], Any]]], need: float) -> dict[str, Any]:
        """Two arms of one comparison, each run guarded in order (label, run), by name; stops at the first that
        gives no row."""
        pair: dict[str, Any] = {}
        for name, (label, run) in arms.items():
            row = guarded(label, need, run)
            if not isinstance(row, dict):
                break
            pair[name] = row
        return pair

    # g. the EMA of the trained weights (LoRA's default; full fine-tuning's candidate): memory and time, batch 4
    for method in (("full", "lora") if "ema" in parts else ()):
        pair = pair_of({name: (f"{method} eager b{b4}{' with EMA' if ema else ''}",
                               lambda m=method, e=ema: engine(setup, method=m, batch=b4, updates=upd[b4],
                                                              device=device, mp=mp, cache_dir=cache, use_ema=e))
                        for name, ema in (("without", False), ("with_ema", True))}, 25 if tiny else 60)
        if len(pair) == 2:
            a, e = pair["without"], pair["with_ema"]
            pair["added_peak_mib"] = e["added_mib"] - a["added_mib"]  # each over what its start held
            if a["steady_s_per_update"] and e["steady_s_per_update"]:
                pair["s_per_update_ratio"] = e["steady_s_per_update"] / a["steady_s_per_update"]
        res.setdefault("ema", {})[method] = pair
        dump(out, "goals.json", res)
    # g'. training.weights_dtype bf16 against fp32 (autocast), full fine-tune, eager, at every batch: the engine-level
    # reading of the precision part's bf16-master arm
    for b in (batches if "weights" in parts else []):
        pair = pair_of({wd: (f"full eager b{b} weights {wd}",
                             lambda b=b, wd=wd: engine(setup, method="full", batch=b, updates=upd[b], device=device,
                                                       mp="bf16", cache_dir=cache, weights_dtype=wd))  # on CPU too
                        for wd in ("fp32", "bf16")}, 25 if tiny else 45)
        for row in pair.values():
            mfu(row, True)
        if len(pair) == 2 and pair["fp32"]["images_per_second"] and pair["bf16"]["images_per_second"]:
            pair["bf16_over_fp32"] = pair["bf16"]["images_per_second"] / pair["fp32"]["images_per_second"]
        res.setdefault("weights_dtype", {})[b] = pair
        dump(out, "goals.json", res)
    # h. textual inversion at the first and the last batch, eager (the UNet frozen: its backward reaches the inputs)
    for b in (sorted({batches[0], batches[-1]}) if "ti" in parts else []):
        row = guarded(f"textual inversion eager b{b}", 25 if tiny else 45,
                      lambda b=b: engine(setup, method="textual_inversion", batch=b, updates=upd[b], device=device,
                                         mp=mp, cache_dir=cache))
        if not isinstance(row, dict):
            break
        mfu(row, False)
        res.setdefault("textual_inversion", {})[b] = row
        if b in res["full"] and res["full"][b]["images_per_second"] and row["images_per_second"]:
            row["over_full"] = row["images_per_second"] / res["full"][b]["images_per_second"]
    dump(out, "goals.json", res)
    return res


# ---------------------------------------------------------------------------------------------------------------
# 2'. Precision: the UNet's training step alone, under autocast and in bf16 with an fp32 master copy


def precision(out: Path, setup, device: str, batches: list[int], deadline: float) -> dict[str, Any]:
    """Seconds per training step of the UNet alone, at each batch, for four arms (see the module's docstring).

    autocast: fp32 weights, bf16 autocast, fp32 gradients clipped and stepped by fused AdamW: the engine's way.
    bf16_master: the weights held in bf16 and run without autocast (group norm, softmax and the weights need no casts
    at each use); their bf16 gradients cast once into an fp32 master copy, clipped and stepped by fused AdamW there,
    and the master copied back into the bf16 weights: one cast each way per update instead of per use.
    The loss of the last step is kept so that an arm that trains nothing stands out."""
    import copy

    import torch
    from diffusers import UNet2DConditionModel

    from bench.speed_vs_reference import device_peak_flops, unet_flops_per_update

    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    peak = device_peak_flops(name) if device == "cuda" else None
    res: dict[str, Any] = {"device": name, "peak_flops": peak, "resolution": setup.resolution, "rows": [],
                           "errors": []}
    base = UNet2DConditionModel.from_pretrained(str(setup.model_dir), subfolder="unet").to(device)
    side = setup.resolution // 8
    arms = [("autocast", True), ("autocast_contiguous", False), ("bf16_master", True),
            ("bf16_master_contiguous", False)]
    warm, timed = (2, 3) if device == "cpu" else (3, 8)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for b in batches:
        g = torch.Generator(device="cpu").manual_seed(b)
        x = torch.randn(b, 4, side, side, generator=g).to(device)
        target = torch.randn(b, 4, side, side, generator=g).to(device)
        c = torch.randn(b, 77, base.config.cross_attention_dim, generator=g).to(device)
        t = torch.randint(0, 1000, (b,), generator=g).to(device)
        flops = unet_flops_per_update(setup.model_dir, batch_size=b, resolution=setup.resolution)
        for arm, channels_last in arms:
            if deadline - elapsed() < (20 if device == "cuda" else 5):
                res["errors"].append(f"{arm} b{b}: not run, device time")
                continue
            say(f"precision {arm} b{b} ...")
            unet = opt = None
            try:
                unet = copy.deepcopy(base)
                if channels_last:
                    unet.to(memory_format=torch.channels_last)
                unet.train()
                params = [q for q in unet.parameters() if q.requires_grad]
                master: list[torch.Tensor] = []
                if arm.startswith("bf16"):
                    master = [q.detach().clone().float() for q in params]
                    unet.to(torch.bfloat16)
                    params = [q for q in unet.parameters() if q.requires_grad]
                    opt = torch.optim.AdamW(master, lr=1e-5, fused=device == "cuda")
                else:
                    opt = torch.optim.AdamW(params, lr=1e-5, fused=device == "cuda")
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                times, loss_value = [], None
                for i in range(warm + timed):
                    sync()
                    t0 = time.perf_counter()
                    if master:
                        pred = unet(x.bfloat16(), t, c.bfloat16(), return_dict=False)[0]
                    else:
                        with torch.autocast(device, dtype=torch.bfloat16):
                            pred = unet(x, t, c, return_dict=False)[0]
                    loss = torch.nn.functional.mse_loss(pred.float(), target)
                    loss.backward()
                    if master:
                        for m, q in zip(master, params, strict=True):
                            m.grad = q.grad.float() if q.grad is not None else None
                            q.grad = None
                        torch.nn.utils.clip_grad_norm_(master, 1.0, foreach=True)
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        with torch.no_grad():
                            torch._foreach_copy_(params, master)
                    else:
                        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    loss_value = float(loss.detach())  # synchronises, as the engine's logged loss does
                    sync()
                    if i >= warm:
                        times.append(time.perf_counter() - t0)
                per = statistics.median(times)
                row = {"arm": arm, "channels_last": channels_last, "batch_size": b, "s_per_update": per,
                       "images_per_second": b / per, "tflops": flops / per / 1e12,
                       "mfu": flops / per / peak if peak else None, "last_loss": loss_value,
                       "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None}
                res["rows"].append(row)
                say(f"precision {arm} b{b}: {per:.4f} s/update, {b / per:.1f} images/s"
                    + (f", MFU {row['mfu']:.1%}" if row["mfu"] else ""))
            except Exception as e:  # noqa: BLE001 - one arm's failure must not lose the rest
                res["errors"].append(f"{arm} b{b}: {type(e).__name__}: {str(e)[:400]}")
                say(res["errors"][-1])
            finally:
                del unet, opt
                if device == "cuda":
                    torch.cuda.empty_cache()
                dump(out, "precision.json", res)
    return res


# ---------------------------------------------------------------------------------------------------------------
# 3. Extras


def profile(out: Path, setup, device: str, mp: str, batch: int, cache: Path) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = torch.profiler.profile(activities=acts, schedule=schedule(wait=3, warmup=1, active=3))
    prof.start()
    try:
        row = engine(setup, method="full", batch=batch, updates=9, device=device, mp=mp, cache_dir=cache,
                     on_update=lambda step: prof.step())
    finally:
        prof.stop()
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    text = prof.key_averages().table(sort_by=key, row_limit=30)
    (out / "profile.txt").write_text(f"full fine-tune, batch {batch}, {mp}, 3 updates profiled\n{text}\n")
    return {"batch_size": batch, "steady_s_per_update": row["steady_s_per_update"]}


def allreduce_hook(device: str, batch: int, resolution: int, model_dir: Path) -> dict[str, Any]:
    """DDP over one process (NCCL on CUDA, gloo on CPU): forward+backward of the UNet in bf16 autocast with DDP's
    default fp32 all-reduce and with the engine's bf16 hook; median seconds per step of each."""
    import torch
    import torch.distributed as dist
    from diffusers import UNet2DConditionModel

    from rangefinder.training.setup import bf16_allreduce_hook

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    backend = "nccl" if device == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=0, world_size=1)
    out: dict[str, Any] = {"backend": backend, "batch_size": batch}
    try:
        unet = UNet2DConditionModel.from_pretrained(str(model_dir), subfolder="unet").to(device)
        unet.train()
        side = resolution // 8 if device == "cuda" else resolution // 4
        x = torch.randn(batch, 4, side, side, device=device)
        t = torch.randint(0, 1000, (batch,), device=device)
        c = torch.randn(batch, 77, unet.config.cross_attention_dim, device=device)
        for arm in ("fp32", "bf16"):
            ddp = torch.nn.parallel.DistributedDataParallel(unet, device_ids=[0] if device == "cuda" else None)
            if arm == "bf16":
                ddp.register_comm_hook(None, bf16_allreduce_hook)
            times = []
            for i in range(8):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = ddp(x, t, c, return_dict=False)[0].float().pow(2).mean()
                loss.backward()
                unet.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            out[f"{arm}_s_per_step"] = statistics.median(times)
            del ddp
        out["bf16_hook_extra_s"] = out["bf16_s_per_step"] - out["fp32_s_per_step"]
    finally:
        dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_session", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "gpu-session")
    p.add_argument("--budget", type=float, default=440, help="seconds for everything; parts stop before it")
    p.add_argument("--wholerun-budget", type=float, default=190)
    p.add_argument("--wholerun-method", default="lora", choices=("lora", "full"))
    p.add_argument("--wholerun-model", default="sd15", choices=("sd15", "sdxl"),
                   help="sdxl: an SDXL-sized model (bench.fixtures.sized_model, built on the GPU; the tiny SDXL with "
                        "--tiny) at --wholerun-resolution")
    p.add_argument("--wholerun-resolution", type=int, default=None,
                   help="pixels; default the session's (512), 1024 for --wholerun-model sdxl (64 with --tiny)")
    p.add_argument("--wholerun-last", action="store_true",
                   help="run the whole run after the other parts, with the time they leave (at least --wholerun-budget "
                        "is kept for it)")
    p.add_argument("--precision-batches", default="4,32")
    p.add_argument("--tiny", action="store_true", help="CPU dry run: the tiny model at 64 px")
    p.add_argument("--batches", default="4,32,48")
    p.add_argument("--parts", default="wholerun,goals,compile,k16,profile,allreduce")
    args = p.parse_args(argv)
    out, work = args.out, args.work
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from bench.common import machine_info, quiet_libraries

    quiet_libraries()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.tiny:
        torch.set_num_threads(1)  # the shared CPU machine: one thread is steadier (bench/RESULTS.md, threads)
    mp = "bf16" if device == "cuda" else "no"
    resolution = 64 if args.tiny else 512
    env: dict[str, Any] = {"machine": machine_info(), "device": device, "torch": torch.__version__,
                           "cuda": torch.version.cuda, "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    try:
        import diffusers

        env["diffusers"] = diffusers.__version__
        if device == "cuda":
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        env["error"] = repr(e)
    dump(out, "env.json", env)
    say(f"env: {env.get('gpu', device)} torch {torch.__version__}")

    from bench.fixtures import sd15_setup, tiny_setup

    t0 = time.perf_counter()
    if args.tiny:
        setup = tiny_setup(work, images=40, resolution=resolution)
    else:
        setup = sd15_setup(work, images=48, resolution=resolution)
    env["setup_seconds"] = time.perf_counter() - t0
    dump(out, "env.json", env)
    say(f"model and data ready in {env['setup_seconds']:.1f} s: {setup.model_dir}")
    parts = args.parts.split(",")
    extras: dict[str, Any] = {}

    def wholerun(budget: float) -> None:
        ends = elapsed() + budget  # the SDXL model's build comes out of the budget
        try:
            model_dir, px = setup.model_dir, args.wholerun_resolution or resolution
            if args.wholerun_model == "sdxl":
                from bench.fixtures import sized_model
                from rangefinder.models.tiny_sdxl import ensure_tiny_sdxl_model

                t0 = time.perf_counter()
                model_dir = ensure_tiny_sdxl_model() if args.tiny else sized_model(work / "sdxl-sized", "sdxl",
                                                                                   device=device)
                px = args.wholerun_resolution or (64 if args.tiny else 1024)
                env["sdxl_setup_seconds"] = time.perf_counter() - t0
                dump(out, "env.json", env)
                say(f"SDXL model ready in {env['sdxl_setup_seconds']:.1f} s: {model_dir}")
            budget = ends - elapsed()
            dump(out, "wholerun.json", whole_run(out, work, model_dir, px, budget, args.tiny, args.wholerun_method))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            dump(out, "wholerun.json", {"error": f"{type(e).__name__}: {e}"})
        say("wholerun finished")

    if "wholerun" in parts and not args.wholerun_last:
        wholerun(min(args.wholerun_budget, args.budget - elapsed() - 60))
    # With the whole run last, the other parts stop where they would leave it less than its budget.
    deadline = args.budget - 10 - (args.wholerun_budget if "wholerun" in parts and args.wholerun_last else 0)
    if "precision" in parts:
        try:
            precision(out, setup, device, [int(b) for b in args.precision_batches.split(",")], deadline)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            dump(out, "precision.json", {"error": f"{type(e).__name__}: {e}"})
    res: dict[str, Any] = {}
    if GOAL_PARTS & set(parts):
        try:
            res = goals(out, work, setup, device, mp, deadline - (40 if "profile" in parts else 0), args.tiny,
                        [int(b) for b in args.batches.split(",")], set(parts))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            dump(out, "goals.json", {"error": f"{type(e).__name__}: {e}"})
    if "profile" in parts and deadline - elapsed() > 25:
        try:
            batch = res.get("best_full_batch") or int(args.batches.split(",")[0])
            extras["profile"] = profile(out, setup, device, mp, batch, work / "goal-cache")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            extras["profile"] = {"error": f"{type(e).__name__}: {e}"}
        dump(out, "extras.json", extras)
    if "allreduce" in parts and deadline - elapsed() > 20:
        try:
            extras["allreduce"] = allreduce_hook(device, 8 if device == "cuda" else 2, resolution, setup.model_dir)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            extras["allreduce"] = {"error": f"{type(e).__name__}: {e}"}
        dump(out, "extras.json", extras)
    if "wholerun" in parts and args.wholerun_last:
        wholerun(args.budget - elapsed() - 10)
    say("all parts done")


if __name__ == "__main__":
    main()
