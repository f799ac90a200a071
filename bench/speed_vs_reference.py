"""Training speed of rangefinder's engine against the plain reference loop (bench/reference_loop.py).

`python -m bench.speed_vs_reference` trains the same model on the same split, batch and precision with both, in one
process, in alternating order (reference then engine, then engine then reference, ...), so that drift in the
machine's load falls on both alike. For each it reports updates/s and images/s of the training loop (model loading
and, for the engine, the one-time encoding into its cache are outside the loop and reported as setup), peak memory,
and the engine/reference ratio of the median updates/s.

On CPU it runs the embedded tiny model at 32 px. On CUDA it also runs a randomly initialised model of Stable
Diffusion 1.5's size at 512 px in bf16, at batch 4 and at the largest batch the engine fits, and reports model FLOPs
utilisation: FLOPs of one UNet forward+backward counted by torch.utils.flop_counter.FlopCounterMode, times
updates/s, over the device's dense bf16 peak.

Validation is off in both (this times training; bench/validation_overhead.py times validation).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import (
    PeakMemory,
    default_out,
    machine_info,
    mib,
    quiet_libraries,
    smoke_out,
    table,
    torch_threads,
    write_json,
)

NAME = "speed_vs_reference"

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, FLOP/s. Matched on the device name.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10G", 70e12),
)


def device_peak_flops(name: str) -> Optional[float]:
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in name.lower():
            return flops
    return None


# ---------------------------------------------------------------------------------------------------------------
# One run of each


def engine_run(setup, *, updates: int, batch_size: int, mixed_precision: str, device: str, cache_dir: Path,
               seed: int = 0, lr: float = 1e-5, gradient_checkpointing: bool = False, method: str = "full",
               compile: str = "off", use_8bit_adam: bool = False) -> dict[str, Any]:
    """One engine run (rangefinder.training.train) with validation off; its loop time is the engine's own timer
    (with compile on it includes the compile, which happens in the first update).
    On CUDA the engine runs its UNet channels_last (the issue's GPU settings); on CPU it seldom helps."""
    from rangefinder.config import DataConfig, TrainingConfig, ValidationConfig
    from rangefinder.training.loop import TrainSpec, train

    cfg = TrainingConfig(
        method=method, batch_size=batch_size, steps=updates, lr=lr, schedule="constant",
        mixed_precision=mixed_precision, max_grad_norm=1.0, seed=seed, cache_dir=str(cache_dir),
        gradient_checkpointing=gradient_checkpointing, channels_last=device == "cuda", compile=compile,
        use_8bit_adam=use_8bit_adam,
    )
    out = Path(tempfile.mkdtemp(prefix="engine-run-"))
    try:
        with PeakMemory(device) as mem:
            t0 = time.perf_counter()
            result = train(TrainSpec(cfg, ValidationConfig(every_epochs=0), split_dir=setup.split_dir,
                                     model=str(setup.model_dir), data=DataConfig(resolution=setup.resolution)),
                           out_dir=out / "run", save_final=False)
            wall = time.perf_counter() - t0
        summary = json.loads(result.summary_path.read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    loop = float(summary["seconds"])
    return {
        "loop": "engine", "method": method, "compile": summary["compile"], "channels_last": cfg.channels_last,
        "batch_size": batch_size, "updates": result.updates, "loop_seconds": loop,
        "setup_seconds": wall - loop, "updates_per_second": result.updates / loop,
        "images_per_second": result.updates * batch_size / loop,
        "peak_mib": mib(mem.peak_bytes), "added_mib": mib(mem.added_bytes), "cache": result.cache,
    }


def reference_run(setup, *, updates: int, batch_size: int, mixed_precision: str, device: str, seed: int = 0,
                  lr: float = 1e-5, gradient_checkpointing: bool = False) -> dict[str, Any]:
    from bench.reference_loop import train_reference

    with PeakMemory(device) as mem:
        r = train_reference(setup.model_dir, setup.split_dir, updates=updates, batch_size=batch_size,
                            resolution=setup.resolution, lr=lr, mixed_precision=mixed_precision, seed=seed,
                            gradient_checkpointing=gradient_checkpointing)
    return {
        "loop": "reference", "batch_size": batch_size, "updates": r.updates, "loop_seconds": r.loop_seconds,
        "setup_seconds": r.setup_seconds, "updates_per_second": r.updates_per_second,
        "images_per_second": r.images_per_second, "peak_mib": mib(mem.peak_bytes), "added_mib": mib(mem.added_bytes),
    }


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# FLOPs


def unet_flops_per_update(model_dir: Path, *, batch_size: int, resolution: int, unet_trains: bool = True) -> float:
    """FLOPs of one UNet forward and backward on a batch, counted op by op by FlopCounterMode (matmuls,
    convolutions, attention; elementwise work and the optimizer step are left out, as MFU conventionally does).

    The UNet is built from its config on the meta device: the count needs shapes only, so it costs no memory and
    no time, on any machine. Precision does not change the count. `unet_trains=False` (LoRA, textual inversion:
    the UNet's weights are frozen) counts the backward to the inputs only, without the weight gradients; LoRA's
    adapters add a negligible count on top.
    """
    import torch
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode

    config = UNet2DConditionModel.load_config(str(model_dir), subfolder="unet")
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    unet.train()
    unet.requires_grad_(unet_trains)
    vae_cfg = json.loads((Path(model_dir) / "vae" / "config.json").read_text())
    side = resolution // 2 ** (len(vae_cfg["block_out_channels"]) - 1)  # SD's VAE downsamples by 8, the tiny by 4
    x = torch.empty(batch_size, unet.config.in_channels, side, side, device="meta", requires_grad=not unet_trains)
    t = torch.zeros(batch_size, dtype=torch.long, device="meta")
    cond = torch.empty(batch_size, 77, unet.config.cross_attention_dim, device="meta")
    with FlopCounterMode(display=False) as counter:
        pred = unet(x, t, cond, return_dict=False)[0]
        pred.float().pow(2).mean().backward()
    return float(counter.get_total_flops())


def encoders_flops_per_update(model_dir: Path, *, batch_size: int, resolution: int) -> float:
    """FLOPs of what the reference loop adds to every update and the engine does once per dataset: a VAE encode of
    the batch and a text-encoder forward of its captions (counted on the meta device, as above)."""
    import torch
    from diffusers import AutoencoderKL
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import CLIPTextConfig, CLIPTextModel

    vae_config = AutoencoderKL.load_config(str(model_dir), subfolder="vae")
    text_config = CLIPTextConfig.from_pretrained(str(model_dir), subfolder="text_encoder")
    with torch.device("meta"):
        vae = AutoencoderKL.from_config(vae_config)
        text_encoder = CLIPTextModel(text_config)
    pixels = torch.empty(batch_size, 3, resolution, resolution, device="meta")
    ids = torch.zeros(batch_size, text_config.max_position_embeddings, dtype=torch.long, device="meta")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        vae.encode(pixels)
        text_encoder(ids)
    return float(counter.get_total_flops())


def add_flops(summary: dict[str, Any], setup, peak_flops: Optional[float]) -> None:
    """FLOPs per update, achieved TFLOP/s and MFU (UNet training FLOPs: the useful work both loops do), and the
    engine/reference ratio the FLOP counts alone predict (the reference also encodes every batch)."""
    b = summary["batch_size"]
    summary["flops_per_update"] = unet_flops_per_update(setup.model_dir, batch_size=b, resolution=setup.resolution)
    summary["encoder_flops_per_update"] = encoders_flops_per_update(setup.model_dir, batch_size=b,
                                                                    resolution=setup.resolution)
    summary["ratio_predicted_by_flops"] = 1 + summary["encoder_flops_per_update"] / summary["flops_per_update"]
    for which in ("reference", "engine"):
        achieved = summary["flops_per_update"] * summary[f"{which}_updates_per_second"]
        summary[f"{which}_tflops"] = achieved / 1e12
        summary[f"{which}_mfu"] = achieved / peak_flops if peak_flops else None


# ---------------------------------------------------------------------------------------------------------------
# The comparison


def compare(setup, *, rounds: int, updates: int, batch_size: int, mixed_precision: str, device: str,
            cache_dir: Path, warmup_updates: int, label: str, gradient_checkpointing: bool = False,
            log=print) -> dict[str, Any]:
    """Alternating rounds of reference and engine; medians and their ratio."""
    kw = dict(batch_size=batch_size, mixed_precision=mixed_precision, device=device,
              gradient_checkpointing=gradient_checkpointing)
    warmup: dict[str, Any] = {}
    if warmup_updates:
        # Untimed: first imports and allocations, and the engine's one-time encoding of the dataset into its cache
        # (its cost is kept: the pipeline pays it once for its three training runs).
        warmup["engine"] = engine_run(setup, updates=warmup_updates, cache_dir=cache_dir, **kw)
        _release(device)
        warmup["reference"] = reference_run(setup, updates=warmup_updates, **kw)
        _release(device)
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        order = ("reference", "engine") if r % 2 == 0 else ("engine", "reference")
        for which in order:
            if which == "engine":
                row = engine_run(setup, updates=updates, cache_dir=cache_dir, **kw)
            else:
                row = reference_run(setup, updates=updates, **kw)
            row.update(round=r, setting=label)
            log(f"  [{label}] round {r} {which:9s} {row['updates_per_second']:.3f} updates/s "
                f"peak {row['peak_mib']} MiB")
            runs.append(row)
            _release(device)
    summary: dict[str, Any] = {"setting": label, "batch_size": batch_size, "mixed_precision": mixed_precision,
                               "updates": updates, "rounds": rounds}
    for which in ("reference", "engine"):
        mine = [x for x in runs if x["loop"] == which]
        summary[f"{which}_updates_per_second"] = statistics.median(x["updates_per_second"] for x in mine)
        summary[f"{which}_images_per_second"] = statistics.median(x["images_per_second"] for x in mine)
        summary[f"{which}_peak_mib"] = max(x["peak_mib"] for x in mine)
        summary[f"{which}_setup_seconds"] = statistics.median(x["setup_seconds"] for x in mine)
    summary["ratio"] = summary["engine_updates_per_second"] / summary["reference_updates_per_second"]
    per_round = []
    for r in range(rounds):
        e = next(x for x in runs if x["round"] == r and x["loop"] == "engine")
        f = next(x for x in runs if x["round"] == r and x["loop"] == "reference")
        per_round.append(e["updates_per_second"] / f["updates_per_second"])
    summary["ratio_per_round"] = per_round
    if warmup:
        summary["engine_cold_setup_seconds"] = warmup["engine"]["setup_seconds"]
    return {"summary": summary, "runs": runs, "warmup": warmup}


def largest_batch(setup, *, candidates: list[int], mixed_precision: str, device: str, cache_dir: Path,
                  log=print, **training: Any) -> tuple[Optional[int], list[dict[str, Any]]]:
    """The largest candidate batch the engine trains without running out of GPU memory (3 updates each);
    `training` passes engine_run's memory settings (compile, gradient_checkpointing, use_8bit_adam)."""
    import torch

    from rangefinder.errors import ConfigError

    tried, best = [], None
    for b in sorted(candidates):
        try:
            row = engine_run(setup, updates=3, batch_size=b, mixed_precision=mixed_precision, device=device,
                             cache_dir=cache_dir, **training)
            tried.append({"batch_size": b, "fits": True, "peak_mib": row["peak_mib"]})
            best = b
            log(f"  batch {b}: fits, peak {row['peak_mib']} MiB")
        except (torch.cuda.OutOfMemoryError, ConfigError) as e:  # the engine words an OOM as a ConfigError
            if isinstance(e, ConfigError) and not isinstance(e.__cause__, torch.cuda.OutOfMemoryError):
                raise
            tried.append({"batch_size": b, "fits": False})
            log(f"  batch {b}: out of memory")
            _release(device)
            break
        _release(device)
    return best, tried


def cuda_section(args, work: Path, log=print) -> dict[str, Any]:
    """SD 1.5-sized UNet at 512 px, bf16: batch 4 and the largest that fits; MFU."""
    import torch

    from bench.fixtures import sd15_setup

    name = torch.cuda.get_device_name(0)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else device_peak_flops(name)
    candidates = [int(b) for b in args.cuda_batches.split(",")]
    # Enough training images (after the 0.2 validation split) for the largest batch tried, so the reference loop's
    # data loader never serves a short batch.
    images = max(40, int(max(candidates) / 0.8) + 8)
    setup = sd15_setup(work, images=images, resolution=args.cuda_resolution)
    log(f"CUDA: {name}; SD 1.5-sized model at {args.cuda_resolution} px, bf16")
    out = sized_section(setup, device="cuda", mixed_precision="bf16", candidates=candidates, rounds=args.cuda_rounds,
                        updates=args.cuda_updates, peak_flops=peak, cache_dir=work / "cache-sd15",
                        label=f"sd15-{args.cuda_resolution}px-bf16", log=log)
    methods = [m for m in args.methods.split(",") if m]
    out["methods"] = methods_section(setup, methods=methods, compile_arms=args.compile_arms.split(","),
                                     rounds=args.method_rounds, updates=args.method_updates, batch_size=4,
                                     mixed_precision="bf16", device="cuda", cache_dir=work / "cache-sd15",
                                     peak_flops=peak, log=log)
    return {"device": name, "resolution": args.cuda_resolution, **out}


def sized_section(setup, *, device: str, mixed_precision: str, candidates: list[int], rounds: int, updates: int,
                  peak_flops: Optional[float], cache_dir: Path, label: str, log=print) -> dict[str, Any]:
    """The largest batch of `candidates` the engine fits, then the comparison at batch 4 and at that batch, with
    FLOPs per update and, given the device's peak, MFU."""
    import torch

    from rangefinder.errors import ConfigError

    largest, tried = largest_batch(setup, candidates=candidates, mixed_precision=mixed_precision, device=device,
                                   cache_dir=cache_dir, log=log)
    out: dict[str, Any] = {"peak_flops": peak_flops, "largest_batch_search": tried, "largest_batch": largest,
                           "settings": []}
    for b in sorted({4, largest} - {None}):
        try:
            res = compare(setup, rounds=rounds, updates=updates, batch_size=b, mixed_precision=mixed_precision,
                          device=device, cache_dir=cache_dir, warmup_updates=2, label=f"{label}-b{b}", log=log)
        except (torch.cuda.OutOfMemoryError, ConfigError) as e:  # the reference may not fit where the engine does
            if isinstance(e, ConfigError) and not isinstance(e.__cause__, torch.cuda.OutOfMemoryError):
                raise
            out["settings"].append({"summary": {"setting": f"{label}-b{b}", "batch_size": b,
                                                "error": f"out of memory: {e}"}})
            _release(device)
            continue
        add_flops(res["summary"], setup, peak_flops)
        out["settings"].append(res)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The engine alone, per method, eager and compiled

METHODS = ("full", "lora", "textual_inversion")
COMPILE_ARMS = ("eager", "compile")
SHORT_RUN_UPDATES = 2  # the short run of each pair: it carries the first-call (and compile) cost


def methods_section(setup, *, methods: list[str], compile_arms: list[str], rounds: int, updates: int,
                    batch_size: int, mixed_precision: str, device: str, cache_dir: Path, peak_flops: Optional[float],
                    log=print) -> list[dict[str, Any]]:
    """images/s of the engine for each method, eager and compiled (training.compile on), with the compile time
    apart. Dynamo is reset before each arm, then a cold short run (SHORT_RUN_UPDATES) pays the compile; each round
    then trains a short and a long run (SHORT_RUN_UPDATES + `updates`) of the same arm, warm: steady s/update =
    (long - short) / updates, which cancels whatever the first update costs. compile_seconds = cold short - median
    warm short (inductor's on-disk cache may shorten a cold compile that ran before on this machine). MFU (given the
    device's peak) counts the UNet's forward and backward as the method runs it (frozen UNet: no weight
    gradients)."""
    import torch

    rows = []
    for method in methods:
        flops = unet_flops_per_update(setup.model_dir, batch_size=batch_size, resolution=setup.resolution,
                                      unet_trains=method == "full")
        for arm in compile_arms:
            kw = dict(batch_size=batch_size, mixed_precision=mixed_precision, device=device, cache_dir=cache_dir,
                      method=method, compile="on" if arm == "compile" else "off")
            torch._dynamo.reset()
            cold = engine_run(setup, updates=SHORT_RUN_UPDATES, **kw)
            _release(device)
            steady, warm_short = [], []
            for r in range(rounds):
                short = engine_run(setup, updates=SHORT_RUN_UPDATES, **kw)
                _release(device)
                long = engine_run(setup, updates=SHORT_RUN_UPDATES + updates, **kw)
                _release(device)
                per_update = (long["loop_seconds"] - short["loop_seconds"]) / updates
                if per_update <= 0:  # noise larger than the difference (a smoke run): the long run's mean instead
                    per_update = long["loop_seconds"] / long["updates"]
                steady.append(per_update)
                warm_short.append(short["loop_seconds"])
                log(f"  [{method} {arm}] round {r}: {batch_size / per_update:.2f} images/s; cold first run "
                    f"{cold['loop_seconds']:.2f} s, warm {short['loop_seconds']:.2f} s")
            s_per_update = statistics.median(steady)
            ups = 1 / s_per_update
            rows.append({
                "setting": f"{method}-{arm}", "method": method, "compile": long["compile"],
                "batch_size": batch_size, "updates": updates, "rounds": rounds,
                "updates_per_second": ups, "images_per_second": batch_size * ups,
                # The cold run's extra time over a warm one of the same length; eager's is the baseline (first-call
                # allocations), so compile costs about compile's value minus eager's.
                "compile_seconds": cold["loop_seconds"] - statistics.median(warm_short),
                "peak_mib": long["peak_mib"], "flops_per_update": flops, "tflops": flops * ups / 1e12,
                "mfu": flops * ups / peak_flops if peak_flops else None,
            })
    torch._dynamo.reset()
    return rows


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.speed_vs_reference", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (each runs both loops once)")
    p.add_argument("--updates", type=int, default=100, help="optimizer updates per timed run")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--images", type=int, default=20, help="synthetic shapes in the dataset (20: the embedded default)")
    p.add_argument("--warmup-updates", type=int, default=3, help="untimed updates of each loop first (0: none)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: steadier on a shared machine; 0 leaves torch's choice)")
    p.add_argument("--cpu-only", action="store_true", help="skip the CUDA section even where a GPU is present")
    p.add_argument("--cuda-resolution", type=int, default=512)
    p.add_argument("--cuda-batches", default="4,8,16,24,32,48,64",
                   help="batch sizes tried (ascending) for the largest that fits")
    p.add_argument("--cuda-updates", type=int, default=20)
    p.add_argument("--cuda-rounds", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: from its name)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="methods of the engine-only section ('' skips it; the smoke runs lora only unless given)")
    p.add_argument("--compile-arms", default=",".join(COMPILE_ARMS),
                   help="eager and/or compile for the engine-only section (the smoke runs eager only unless given)")
    p.add_argument("--method-updates", type=int, default=30, help="updates of the long minus the short run")
    p.add_argument("--method-rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="2 updates, 1 round, no warm-up, CPU only (CI)")
    p.add_argument("--out", type=Path, help="JSON output (default bench/results/<name>.json; with --smoke a "
                   "temporary file, so a smoke run never replaces a real result)")
    p.add_argument("--work-dir", type=Path, help="datasets and model copies (default: a temporary folder)")
    given = set(argv if argv is not None else sys.argv[1:])
    args = p.parse_args(argv)
    args.out = args.out or (smoke_out(NAME) if args.smoke else default_out(NAME))
    quiet_libraries()
    if args.smoke:
        args.rounds, args.updates, args.warmup_updates, args.cpu_only = 1, 2, 0, True
        args.method_updates, args.method_rounds = 2, 1
        if "--compile-arms" not in given:  # inductor's compile of even the tiny UNet takes a minute on 2 cores
            args.compile_arms = "eager"
        if "--methods" not in given:
            # One method runs the section's loop; LoRA's frozen UNet is the FLOP count the comparison above lacks.
            args.methods = "lora"

    import torch

    from bench.fixtures import tiny_setup

    # Enough training images (after the 0.2 validation split) for every update to see a full batch in both loops.
    args.images = max(args.images, math.ceil(args.batch_size / 0.8) + 2)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-speed-"))
    result: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke}
    try:
        with torch_threads(args.threads or None):
            result["machine"] = machine_info()
            setup = tiny_setup(work, "shapes", images=args.images)
            # accelerate (in both loops) trains on the GPU when there is one, so the tiny comparison runs there too.
            tiny_device = "cuda" if torch.cuda.is_available() else "cpu"
            print(f"{tiny_device}: tiny model, {args.images} shapes at {setup.resolution} px, batch {args.batch_size}, "
                  f"fp32, {torch.get_num_threads()} CPU thread(s)", file=sys.stderr)
            cpu = compare(setup, rounds=args.rounds, updates=args.updates, batch_size=args.batch_size,
                          mixed_precision="no", device=tiny_device, cache_dir=work / "cache",
                          label=f"tiny-{tiny_device}-fp32", warmup_updates=args.warmup_updates,
                          log=lambda m: print(m, file=sys.stderr))
            add_flops(cpu["summary"], setup, None)
            result["tiny"] = cpu
            methods = [m for m in args.methods.split(",") if m]
            result["methods"] = methods_section(
                setup, methods=methods, compile_arms=args.compile_arms.split(","), rounds=args.method_rounds,
                updates=args.method_updates, batch_size=args.batch_size, mixed_precision="no", device=tiny_device,
                cache_dir=work / "cache", peak_flops=None, log=lambda m: print(m, file=sys.stderr))
            if torch.cuda.is_available() and not args.cpu_only:
                try:
                    result["cuda"] = cuda_section(args, work, log=lambda m: print(m, file=sys.stderr))
                except Exception as e:  # keep the CPU numbers; say what broke
                    result["cuda"] = {"error": f"{type(e).__name__}: {e}"}
            else:
                result["cuda"] = {"skipped": "no CUDA device" if not torch.cuda.is_available() else "--cpu-only"}
            result["machine"]["loadavg_after"] = list(__import__("os").getloadavg())
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    write_json(args.out, result)
    print(report(result))
    print(f"\nwritten: {args.out}")
    return result


def report(result: dict[str, Any]) -> str:
    rows = [result["tiny"]["summary"]]
    cuda = result.get("cuda", {})
    rows += [s["summary"] for s in cuda.get("settings", [])]
    cols = ["setting", "batch_size", "reference_updates_per_second", "engine_updates_per_second", "ratio",
            "reference_images_per_second", "engine_images_per_second", "reference_peak_mib", "engine_peak_mib",
            "engine_cold_setup_seconds"]
    heads = ["setting", "batch", "ref upd/s", "engine upd/s", "ratio", "ref img/s", "engine img/s", "ref peak MiB",
             "engine peak MiB", "engine first setup s"]
    text = table(rows, cols, title="Training loop speed: engine vs reference (median of rounds)", headers=heads)
    flops_cols = ["setting", "flops_per_update", "encoder_flops_per_update", "ratio_predicted_by_flops",
                  "reference_tflops", "engine_tflops", "reference_mfu", "engine_mfu"]
    text += "\n\n" + table(rows, flops_cols, title="FLOPs per update and utilisation (UNet forward+backward)",
                           headers=["setting", "UNet FLOPs/update", "+ encoders (ref)", "ratio by FLOPs",
                                    "ref TFLOP/s", "engine TFLOP/s", "ref MFU", "engine MFU"])
    method_rows = result.get("methods", []) + cuda.get("methods", [])
    if method_rows:
        text += "\n\n" + table(method_rows, ["setting", "compile", "batch_size", "images_per_second",
                                              "compile_seconds", "peak_mib", "tflops", "mfu"],
                                title="The engine per method, eager and compiled (steady rate; compile apart)",
                                headers=["setting", "compile", "batch", "img/s", "compile s", "peak MiB",
                                         "TFLOP/s", "MFU"])
    if "skipped" in cuda or "error" in cuda:
        text += f"\n\nCUDA section: {cuda.get('skipped') or cuda.get('error')}"
    return text


if __name__ == "__main__":
    main()
