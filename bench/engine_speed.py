"""Engine speed: updates per second and peak memory, with latent caching on and off.

    python -m bench.engine_speed                  # CPU: the tiny model at 32 px (and, on CUDA, SD 1.5 size at 512 px)
    python -m bench.engine_speed --updates 4 --smoke

Each variant trains in a process of its own (so one variant's memory does not count against the next; a `--smoke`
run starts one for its first variant only) through the public `rangefinder.training.loop.train`, with validation off.
`updates/s` is the loop's own rate (the summary's `updates_per_second`: the updates over the loop's wall time, model
loading and the one-time encoding excluded);
`cpu s/update` is the process' CPU time in the loop per update (steadier than wall time on a shared machine);
`run s` is the whole call. Rounds alternate the variants and the median round is reported. Peak memory: the process'
resident set sampled during the call on CPU, `torch.cuda.max_memory_allocated` on CUDA. Caching on means the latents
come from the content-keyed cache (warmed by an untimed first run), off means every micro-batch is loaded, preprocessed
and VAE-encoded.

Prints a table and writes JSON to bench/results/engine_speed.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import PeakMemory, default_out, machine_info, mib, table, torch_threads, write_json

VARIANTS = {"cache_on": True, "cache_off": False}


def one_variant(setup_kind: str, cache: bool, *, updates: int, batch_size: int, mixed_precision: str, work: Path,
                threads: Optional[int]) -> dict[str, Any]:
    """One timed engine run (in this process)."""
    import torch

    from bench.fixtures import sd15_setup, tiny_setup
    from rangefinder.config import DataConfig, TrainingConfig, ValidationConfig
    from rangefinder.training.loop import TrainSpec, train

    device = "cuda" if setup_kind == "sd15" else "cpu"
    setup = sd15_setup(work) if setup_kind == "sd15" else tiny_setup(work)
    cfg = TrainingConfig(batch_size=batch_size, steps=updates, lr=1e-5, mixed_precision=mixed_precision,
                         cache_latents=cache, cache_dir=str(work / "encoded"), seed=0)
    inputs = dict(split_dir=setup.split_dir, model=str(setup.model_dir), data=DataConfig(resolution=setup.resolution))
    with torch_threads(threads):
        # Untimed: fills the latent/text cache (caching's one-time cost is reported separately as `encode s`).
        t0 = time.perf_counter()
        train(TrainSpec(cfg.model_copy(update={"steps": 1, "cache_latents": True}), ValidationConfig(every_epochs=0),
                        **inputs), out_dir=Path(tempfile.mkdtemp(dir=work)) / "warm", save_final=False)
        warm_seconds = time.perf_counter() - t0
        if device == "cuda":
            torch.cuda.empty_cache()
        with PeakMemory(device) as mem:
            t0 = time.perf_counter()
            result = train(TrainSpec(cfg, ValidationConfig(every_epochs=0), **inputs),
                           out_dir=Path(tempfile.mkdtemp(dir=work)) / "run", save_final=False)
            wall = time.perf_counter() - t0
    summary = json.loads(result.summary_path.read_text())
    return {
        "model": setup_kind,
        "resolution": setup.resolution,
        "device": device,
        "mixed_precision": mixed_precision,
        "latent_cache": "on" if cache else "off",
        "batch_size": batch_size,
        "updates": result.updates,
        "updates_per_s": summary["updates_per_second"],
        "s_per_update": 1.0 / summary["updates_per_second"],
        "cpu_s_per_update": summary["cpu_seconds"] / result.updates,
        "run_s": wall,
        "first_run_s": warm_seconds,
        "peak_mib": mib(mem.peak_bytes),
        "threads": torch.get_num_threads() if threads is None else threads,
    }


def run_isolated(args: argparse.Namespace, setup_kind: str, variant: str, work: Path) -> dict[str, Any]:
    """A variant in a fresh interpreter; its row comes back as JSON on the last stdout line."""
    cmd = [sys.executable, "-m", "bench.engine_speed", "--variant", variant, "--model", setup_kind,
           "--updates", str(args.updates), "--batch-size", str(args.batch_size if setup_kind == "tiny" else 4),
           "--work", str(work)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"variant {setup_kind}/{variant} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def variant_here(args: argparse.Namespace, setup_kind: str, variant: str, work: Path) -> dict[str, Any]:
    """A variant in this process, as the child of `run_isolated` runs it (bf16 at SD 1.5 size, fp32 on the tiny one)."""
    mp = "bf16" if setup_kind == "sd15" else "no"
    return one_variant(setup_kind, VARIANTS[variant], updates=args.updates, batch_size=args.batch_size,
                       mixed_precision=mp, work=work, threads=args.threads)


COLUMNS = ["model", "resolution", "device", "mixed_precision", "latent_cache", "batch_size", "updates",
           "updates_per_s", "s_per_update", "cpu_s_per_update", "run_s", "peak_mib", "threads", "rounds"]


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.engine_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--updates", type=int, default=30, help="timed updates per variant")
    p.add_argument("--batch-size", type=int, default=4, help="micro-batch of the tiny-model runs (SD 1.5 size: 4)")
    p.add_argument("--rounds", type=int, default=3, help="alternating repeats of each variant (median reported)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=None, help="JSON result (default bench/results/engine_speed.json)")
    p.add_argument("--work", type=Path, help="where datasets, models and caches go (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model only, no GPU section, only the first variant in a process of its own (the tests)")
    p.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)  # internal: one isolated variant
    p.add_argument("--model", choices=["tiny", "sd15"], default="tiny", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.variant:  # child process
        row = variant_here(args, args.model, args.variant, args.work)
        print(json.dumps(row))
        return row

    import torch

    work = args.work or Path(tempfile.mkdtemp(prefix="engine-speed-"))
    kinds = ["tiny"] + (["sd15"] if torch.cuda.is_available() and not args.smoke else [])
    # Rounds alternate the variants, so load from other jobs on a shared machine falls on both alike; each row is
    # the median round.
    rounds: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for kind in kinds:
            for i, variant in enumerate(VARIANTS):
                if args.smoke and i > 0:
                    # A smoke run checks the plumbing, not the numbers: the first variant takes the child-process
                    # path every variant of a real run takes, the others run here and save a process start-up each.
                    row = variant_here(args, kind, variant, work)
                else:
                    row = run_isolated(args, kind, variant, work)
                rounds.setdefault((kind, variant), []).append(row)
    rows = []
    for runs in rounds.values():
        row = dict(sorted(runs, key=lambda r: r["s_per_update"])[len(runs) // 2])
        row["cpu_s_per_update"] = statistics.median(r["cpu_s_per_update"] for r in runs)
        row["rounds"] = len(runs)
        row["all_s_per_update"] = [r["s_per_update"] for r in runs]
        rows.append(row)
    for kind in kinds:
        on, off = (next(r for r in rows if r["model"] == kind and r["latent_cache"] == c) for c in ("on", "off"))
        on["speedup_vs_off"] = off["s_per_update"] / on["s_per_update"]
        on["cpu_saving_vs_off"] = 1 - on["cpu_s_per_update"] / off["cpu_s_per_update"]
    result = {"benchmark": "engine_speed", "machine": machine_info(), "rows": rows,
              "gpu": None if "sd15" in kinds else "pending: no CUDA device on this machine"}
    out = write_json(args.out or default_out("engine_speed"), result)
    print(table(rows, COLUMNS + ["speedup_vs_off", "cpu_saving_vs_off"], title="engine speed (latent cache on vs off)"))
    if result["gpu"]:
        print(f"GPU row: {result['gpu']}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
