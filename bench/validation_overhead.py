"""Validation overhead: time spent measuring validation loss as a share of training time.

`python -m bench.validation_overhead` trains the embedded tiny model with the engine at val split 0.2 (and the
stabilize subset, 0.2 of training, which validations also measure: every one by default), K=4 timesteps per item,
latents cached
(the cache is filled by an untimed warm-up run first), in alternating rounds of:

- `off`: validation turned off, the training-only time;
- `on`: validation at the given interval (default every epoch, the fine-tune's setting), with the config's
  defaults otherwise (`validation.batch_size`, `validation.stabilize_every`);
- any `--variant LABEL:key=value,...` (ValidationConfig fields: batch_size, stabilize_every, every_epochs,
  every_updates, timesteps; and `sampling.FIELD` for samples during training, SamplingConfig fields over the demo's
  sampling settings), each its own arm in the same alternating rounds, so levers are compared under the same
  load, e.g. `--variant bs8:batch_size=8 --variant stab3:stabilize_every=3` or `--variant
  samples:sampling.every_validations=auto`.

Each round runs the arms in a rotated order (the first arm of one round is the last of the next).

Two estimates of the share, which should agree:
- direct: seconds inside the engine's validation measurement (`rangefinder.training.validation.measure_subset`,
  timed by a wrapper around the engine's own function for the run; every pass, the update-0 baseline included) over the
  training-only time of the `off` run with the same updates;
- paired: (loop time of `on` - loop time of `off`) / loop time of `off` (the engine's loop timer; it starts after
  the baseline pass, so this one leaves the baseline out).

An arm with samples during training also reports their cost: seconds inside the engine's
`TrainingSamples.after_validation` (render, save, log; timed by a wrapper as above) over the `off` run's
training-only time ("samples share, direct"), and (its loop time - the `on` arm's) over the same ("paired"): what
the samples add to a validated run.

It also reports the cost of one validation pass, and the validation interval (in epochs) at which the share would be
the target (5%): validation costs K x (val + stabilize images) forward passes, training 3 x train images (forward
and backward) per epoch, so the share is set by the split and K, not by the dataset's size.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from bench.common import default_out, machine_info, quiet_libraries, smoke_out, table, torch_threads, write_json

NAME = "validation_overhead"


@contextmanager
def timed_measure() -> Iterator[list[float]]:
    """Time every call the engine makes to its validation measurement (the real function runs unchanged)."""
    from rangefinder.training import loop as validation  # validate() lives in loop.py and calls loop.measure_subset

    seconds: list[float] = []
    original = validation.measure_subset  # what validate() calls, once per subset (val, stabilize)

    def measure(*a, **kw):
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            seconds.append(time.perf_counter() - t0)

    validation.measure_subset = measure
    try:
        yield seconds
    finally:
        validation.measure_subset = original


@contextmanager
def timed_samples() -> Iterator[list[float]]:
    """Time every call the engine makes to its samples during training (the real method runs unchanged)."""
    from rangefinder.training.samples import TrainingSamples

    seconds: list[float] = []
    original = TrainingSamples.after_validation

    def after_validation(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return original(self, *a, **kw)
        finally:
            seconds.append(time.perf_counter() - t0)

    TrainingSamples.after_validation = after_validation  # type: ignore[method-assign]
    try:
        yield seconds
    finally:
        TrainingSamples.after_validation = original  # type: ignore[method-assign]


def run(setup, *, epochs: int, batch_size: int, cache_dir: Path, validation: dict[str, Any],
        seed: int = 0) -> dict[str, Any]:
    from rangefinder.config import DataConfig, TrainingConfig, ValidationConfig, demo_config
    from rangefinder.training.loop import TrainSpec, train
    from rangefinder.training.samples import read_index

    cfg = TrainingConfig(batch_size=batch_size, epochs=epochs, lr=1e-4, schedule="constant", seed=seed,
                         cache_dir=str(cache_dir), cache_latents=True)
    validation = dict(validation)
    sampling_fields = validation.pop("sampling", None)
    val = ValidationConfig(**validation)
    # Samples during training with the demo's settings (2 prompts x 1 seed, 10 steps), when the arm asks for them.
    sampling = demo_config().sampling.model_copy(update=sampling_fields) if sampling_fields else None
    out = Path(tempfile.mkdtemp(prefix="val-overhead-"))
    try:
        with timed_measure() as passes, timed_samples() as sample_calls:
            t0 = time.perf_counter()
            result = train(TrainSpec(cfg, val, split_dir=setup.split_dir, model=str(setup.model_dir),
                                     data=DataConfig(resolution=setup.resolution), sampling=sampling),
                           out_dir=out / "run", save_final=False)
            wall = time.perf_counter() - t0
        index = read_index(out / "run")
        summary = json.loads(result.summary_path.read_text())
        with open(result.metrics_csv, newline="") as f:
            table = list(csv.DictReader(f))
        rows, stabilize_rows = len(table), sum(1 for r in table if r["stabilize_loss"])
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"every_epochs": val.every_epochs, "validation": val.model_dump(), "updates": result.updates,
            "loop_seconds": float(summary["seconds"]), "wall_seconds": wall, "measure_calls": len(passes),
            "measure_seconds": sum(passes),
            "validation_rows": rows, "stabilize_rows": stabilize_rows, "cache": result.cache,
            "sample_grids": len(index["samples"]) if index else 0, "samples_seconds": sum(sample_calls)}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.validation_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=20, help="synthetic shapes (20: the embedded default)")
    p.add_argument("--val-split", type=float, default=0.2)
    p.add_argument("--timesteps", type=int, default=4, help="K, validation timesteps per item")
    p.add_argument("--epochs", type=int, default=12, help="epochs per run (12: the demo fine-tune's)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--val-batch-size", type=int, help="(item, timestep) pairs per validation forward pass "
                   "(default: validation.batch_size's default)")
    p.add_argument("--stabilize-every", type=int, help="measure the stabilize subset at every Nth validation "
                   "(default: validation.stabilize_every's default)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL:key=value,...",
                   help="another validated arm, e.g. bs8:batch_size=8 or stab3:stabilize_every=3 (repeatable)")
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
    from rangefinder.config import ValidationConfig

    defaults = ValidationConfig()
    args.val_batch_size = args.val_batch_size or defaults.batch_size
    args.stabilize_every = args.stabilize_every or defaults.stabilize_every
    base = {"every_epochs": args.every_epochs, "timesteps": args.timesteps, "batch_size": args.val_batch_size,
            "stabilize_every": args.stabilize_every}
    arms = {"off": {**base, "every_epochs": 0.0, "every_updates": None}, "on": base}
    for spec in args.variant:
        arms.update(parse_variant(spec, base))

    from bench.fixtures import tiny_setup

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-val-"))
    result: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke, "settings": {
        k: getattr(args, k) for k in ("images", "val_split", "timesteps", "epochs", "batch_size", "val_batch_size",
                                      "stabilize_every", "every_epochs", "rounds", "target_pct")} | {"arms": arms}}
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        with torch_threads(args.threads or None):
            result["machine"] = machine_info()
            setup = tiny_setup(work, "shapes", images=args.images, val_split=args.val_split)
            from rangefinder.data.split import read_split

            split = read_split(setup.split_dir)
            result["split"] = {"train": len(split.train), "val": len(split.val), "stabilize": len(split.stabilize)}
            kw = dict(epochs=args.epochs, batch_size=args.batch_size, cache_dir=work / "cache")
            run(setup, **{**kw, "epochs": 1}, validation=base)  # untimed: fills the latent cache
            runs = []
            names = list(arms)
            result["machine"]["loadavg_before"] = list(__import__("os").getloadavg())
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    row = run(setup, **kw, validation=arms[name]) | {"round": r, "arm": name}
                    log(f"  round {r} {row['arm']:6s}: loop {row['loop_seconds']:.2f} s, "
                        f"{row['validation_rows']} validations ({row['stabilize_rows']} with stabilize) "
                        f"{row['measure_seconds']:.2f} s")
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


def parse_variant(spec: str, base: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`LABEL:key=value,...` -> {LABEL: base with those ValidationConfig fields set}."""
    from rangefinder.config import ValidationConfig

    label, _, body = spec.partition(":")
    if not label or not body or label in ("on", "off"):
        raise SystemExit(f"--variant {spec!r}: write LABEL:key=value,... with a label other than on/off")
    from rangefinder.config import SamplingConfig

    fields: dict[str, Any] = dict(base)
    sampling: dict[str, Any] = {}
    for pair in body.split(","):
        key, _, value = pair.partition("=")
        try:
            parsed = None if value == "None" else json.loads(value)
        except ValueError:
            parsed = value  # a bare word: auto
        if key.startswith("sampling.") and key.removeprefix("sampling.") in SamplingConfig.model_fields:
            sampling[key.removeprefix("sampling.")] = parsed
        elif key in ValidationConfig.model_fields:
            fields[key] = parsed
        else:
            raise SystemExit(f"--variant {spec!r}: {key!r} is not a validation or sampling.* setting")
    ValidationConfig(**fields)  # a bad value fails here, before any run
    if sampling:
        SamplingConfig(**sampling)
        fields["sampling"] = sampling
    return {label: fields}


def summarize(result: dict[str, Any], args) -> dict[str, Any]:
    """The `on` arm's summary (as before), plus one per variant under `variants`."""
    arms = result["settings"]["arms"]
    s = summarize_arm(result, args, "on")
    others = [a for a in arms if a not in ("on", "off")]
    if others:
        s["variants"] = {a: summarize_arm(result, args, a) for a in others}
    return s


def summarize_arm(result: dict[str, Any], args, arm: str) -> dict[str, Any]:
    runs = result["runs"]
    settings = result["settings"]["arms"][arm]
    off = [r for r in runs if r["arm"] == "off"]
    on = [r for r in runs if r["arm"] == arm]
    train_s = statistics.median(r["loop_seconds"] for r in off)
    on_loop = statistics.median(r["loop_seconds"] for r in on)
    val_s = statistics.median(r["measure_seconds"] for r in on)
    passes = on[0]["validation_rows"]  # validations (metrics.csv rows); each measures val, some stabilize
    per_pass = val_s / passes if passes else None
    epochs = args.epochs
    # The share at interval N epochs is per_pass / (N x train time per epoch).
    per_epoch_train = train_s / epochs
    s = {
        "validation": {k: settings.get(k) for k in ("every_epochs", "every_updates", "batch_size", "stabilize_every")},
        "train_seconds": train_s,
        "validation_seconds": val_s,
        "validation_passes": passes,
        "stabilize_passes": on[0]["stabilize_rows"],
        "seconds_per_pass": per_pass,
        "train_seconds_per_epoch": per_epoch_train,
        "share_direct_pct": 100 * val_s / train_s,
        "share_paired_pct": 100 * (on_loop - train_s) / train_s,
        "share_of_total_pct": 100 * val_s / (train_s + val_s),
    }
    if per_pass:
        s["interval_epochs_for_target"] = per_pass / (args.target_pct / 100 * per_epoch_train)
    if settings.get("sampling"):
        on_plain = [r for r in runs if r["arm"] == "on"]
        samples_s = statistics.median(r["samples_seconds"] for r in on)
        grids = on[0]["sample_grids"]
        s["sampling"] = settings["sampling"]
        s["sample_grids"] = grids
        s["samples_seconds"] = samples_s
        s["seconds_per_grid"] = samples_s / grids if grids else None
        s["samples_share_direct_pct"] = 100 * samples_s / train_s
        if on_plain:
            s["samples_share_paired_pct"] = 100 * (on_loop - statistics.median(r["loop_seconds"] for r in on_plain)) \
                / train_s
    split = result["split"]
    # Forward-pass count model: K forwards per val/stabilize item measured vs ~3 forward-equivalents per trained
    # image; the stabilize subset counts in the share of validations that measured it.
    stab = split["stabilize"] * (on[0]["stabilize_rows"] / passes if passes else 1.0)
    every = settings["every_epochs"]
    if settings.get("every_updates"):
        every = settings["every_updates"] / math.ceil(split["train"] / args.batch_size)
    s["expected_share_pct"] = 100 * settings["timesteps"] * (split["val"] + stab) / (3 * split["train"] * every)
    s["meets_target"] = s["share_direct_pct"] <= args.target_pct
    return s


def report(result: dict[str, Any]) -> str:
    s = result["summary"]
    st = result["settings"]
    head = (f"Validation overhead: {result['split']['train']} train / {result['split']['val']} val / "
            f"{result['split']['stabilize']} stabilize images, K={st['timesteps']}, {st['epochs']} epochs, latents "
            f"cached (median of {st['rounds']} rounds)")
    arms = {"on": s} | s.get("variants", {})
    keys = [k for k in s if k not in ("variants", "validation")]
    keys += [k for v in arms.values() for k in v if k not in keys and k not in ("variants", "validation", "sampling")]
    rows = [{"arm": a, "every_epochs": v["validation"]["every_epochs"], "batch_size": v["validation"]["batch_size"],
             "stabilize_every": v["validation"]["stabilize_every"],
             "samples_every": (v.get("sampling") or {}).get("every_validations")} | {k: v.get(k) for k in keys}
            for a, v in arms.items()]
    columns = ["quantity"] + list(arms)
    table_rows = [{"quantity": k, **{r["arm"]: r[k] for r in rows}} for k in rows[0] if k != "arm"]
    return table(table_rows, columns, title=head)


if __name__ == "__main__":
    main()
