"""Validation overhead: time spent measuring validation loss as a share of training time.

`python -m bench.validation_overhead` trains the embedded tiny model with the engine at val split 0.2 (and the
stabilize subset, 0.2 of training, which every validation also measures), K=4 timesteps per item, latents cached
(the cache is filled by an untimed warm-up run first), in alternating rounds of:

- `off`: validation turned off, the training-only time;
- `on`: validation at the given interval (default every epoch, the fine-tune's setting).

Two estimates of the share, which should agree:
- direct: seconds inside the engine's validation measurement (`components.training.validation.measure`, timed by a
  wrapper around the engine's own function for the run; every pass, the update-0 baseline included) over the
  training-only time of the `off` run with the same updates;
- paired: (loop time of `on` - loop time of `off`) / loop time of `off` (the engine's loop timer; it starts after
  the baseline pass, so this one leaves the baseline out).

It also reports the cost of one validation pass, and the validation interval (in epochs) at which the share would be
the target (5%): validation costs K x (val + stabilize images) forward passes, training 3 x train images (forward
and backward) per epoch, so the share is set by the split and K, not by the dataset's size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from bench.common import smoke_out, default_out, machine_info, quiet_libraries, table, torch_threads, write_json

NAME = "validation_overhead"


@contextmanager
def timed_measure() -> Iterator[list[float]]:
    """Time every call the engine makes to its validation measurement (the real function runs unchanged)."""
    from components.training import loop

    seconds: list[float] = []
    original = loop.measure

    def measure(*a, **kw):
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            seconds.append(time.perf_counter() - t0)

    loop.measure = measure
    try:
        yield seconds
    finally:
        loop.measure = original


def run(setup, *, epochs: int, batch_size: int, timesteps: int, every_epochs: float, cache_dir: Path,
        val_batch_size: int, seed: int = 0) -> dict[str, Any]:
    from components.config import DataConfig, TrainingConfig, ValidationConfig
    from components.training.loop import train

    cfg = TrainingConfig(batch_size=batch_size, epochs=epochs, lr=1e-4, schedule="constant", seed=seed,
                         cache_dir=str(cache_dir), cache_latents=True)
    val = ValidationConfig(every_epochs=every_epochs, timesteps=timesteps, batch_size=val_batch_size)
    out = Path(tempfile.mkdtemp(prefix="val-overhead-"))
    try:
        with timed_measure() as passes:
            t0 = time.perf_counter()
            result = train(cfg, val, split_dir=setup.split_dir, model=str(setup.model_dir), out_dir=out / "run",
                           data=DataConfig(resolution=setup.resolution), save_final=False)
            wall = time.perf_counter() - t0
        summary = json.loads(result.summary_path.read_text())
        rows = sum(1 for _ in open(result.metrics_csv)) - 1
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"every_epochs": every_epochs, "updates": result.updates, "loop_seconds": float(summary["seconds"]),
            "wall_seconds": wall, "measure_calls": len(passes), "measure_seconds": sum(passes),
            "validation_rows": rows, "cache": result.cache}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.validation_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=20, help="synthetic shapes (20: the embedded default)")
    p.add_argument("--val-split", type=float, default=0.2)
    p.add_argument("--timesteps", type=int, default=4, help="K, validation timesteps per item")
    p.add_argument("--epochs", type=int, default=12, help="epochs per run (12: the demo fine-tune's)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--val-batch-size", type=int, default=8, help="items per validation forward pass")
    p.add_argument("--every-epochs", type=float, default=1.0, help="validation interval of the `on` runs")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--target-pct", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's choice)")
    p.add_argument("--smoke", action="store_true", help="1 round of 1-epoch runs on 10 images (CI)")
    p.add_argument("--out", type=Path, help="JSON output (default bench/results/<name>.json; with --smoke a "
                   "temporary file, so a smoke run never replaces a real result)")
    p.add_argument("--work-dir", type=Path)
    args = p.parse_args(argv)
    args.out = args.out or (smoke_out(NAME) if args.smoke else default_out(NAME))
    quiet_libraries()
    if args.smoke:
        args.images, args.epochs, args.rounds = 10, 1, 1

    from bench.fixtures import tiny_setup

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-val-"))
    result: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke, "settings": {
        k: getattr(args, k) for k in ("images", "val_split", "timesteps", "epochs", "batch_size", "val_batch_size",
                                      "every_epochs", "rounds", "target_pct")}}
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        with torch_threads(args.threads or None):
            result["machine"] = machine_info()
            setup = tiny_setup(work, "shapes", images=args.images, val_split=args.val_split)
            from components.data.split import read_split

            split = read_split(setup.split_dir)
            result["split"] = {"train": len(split.train), "val": len(split.val), "stabilize": len(split.stabilize)}
            kw = dict(epochs=args.epochs, batch_size=args.batch_size, timesteps=args.timesteps,
                      cache_dir=work / "cache", val_batch_size=args.val_batch_size)
            run(setup, **{**kw, "epochs": 1}, every_epochs=args.every_epochs)  # untimed: fills the latent cache
            runs = []
            for r in range(args.rounds):
                order = (0.0, args.every_epochs) if r % 2 == 0 else (args.every_epochs, 0.0)
                for every in order:
                    row = run(setup, **kw, every_epochs=every) | {"round": r, "arm": "on" if every else "off"}
                    log(f"  round {r} {row['arm']:3s}: loop {row['loop_seconds']:.2f} s, "
                        f"{row['validation_rows']} validations {row['measure_seconds']:.2f} s")
                    runs.append(row)
            result["runs"] = runs
            result["machine"]["loadavg_after"] = list(__import__("os").getloadavg())
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    result["summary"] = summarize(result, args)
    write_json(args.out, result)
    print(report(result))
    print(f"\nwritten: {args.out}")
    return result


def summarize(result: dict[str, Any], args) -> dict[str, Any]:
    runs = result["runs"]
    off = [r for r in runs if r["arm"] == "off"]
    on = [r for r in runs if r["arm"] == "on"]
    train_s = statistics.median(r["loop_seconds"] for r in off)
    on_loop = statistics.median(r["loop_seconds"] for r in on)
    val_s = statistics.median(r["measure_seconds"] for r in on)
    passes = on[0]["validation_rows"]  # validations (metrics.csv rows); each measures val and stabilize
    per_pass = val_s / passes if passes else None
    epochs = args.epochs
    # Each pass measures val and stabilize; the share at interval N epochs is per_pass / (N x train time per epoch).
    per_epoch_train = train_s / epochs
    s = {
        "train_seconds": train_s,
        "validation_seconds": val_s,
        "validation_passes": passes,
        "seconds_per_pass": per_pass,
        "train_seconds_per_epoch": per_epoch_train,
        "share_direct_pct": 100 * val_s / train_s,
        "share_paired_pct": 100 * (on_loop - train_s) / train_s,
        "share_of_total_pct": 100 * val_s / (train_s + val_s),
    }
    if per_pass:
        s["interval_epochs_for_target"] = per_pass / (args.target_pct / 100 * per_epoch_train)
    split = result["split"]
    # Forward-pass count model: K forwards per val/stabilize item vs ~3 forward-equivalents per trained image.
    s["expected_share_pct"] = (100 * args.timesteps * (split["val"] + split["stabilize"])
                               / (3 * split["train"] * args.every_epochs))
    s["meets_target"] = s["share_direct_pct"] <= args.target_pct
    return s


def report(result: dict[str, Any]) -> str:
    s = result["summary"]
    st = result["settings"]
    rows = [{"quantity": k, "value": v} for k, v in s.items()]
    head = (f"Validation overhead: {result['split']['train']} train / {result['split']['val']} val / "
            f"{result['split']['stabilize']} stabilize images, K={st['timesteps']}, every {st['every_epochs']:g} "
            f"epoch(s), {st['epochs']} epochs, latents cached (median of {st['rounds']} rounds)")
    return table(rows, ["quantity", "value"], title=head)


if __name__ == "__main__":
    main()
