"""What samples during training add to the demo: its fine-tune step, and (`--whole-demo`) the whole `rangefinder demo`.

`python -m bench.samples_cost` runs the demo's fine-tune step (`run_finetune` with `demo_config()`: the tiny model,
the 20 embedded images, its fine-tune epochs at the demo's midpoint LR, validation every epoch, MLflow into a local
sqlite store)
in alternating rounds of two arms:

- `auto`: the default, `sampling.every_validations: auto` (about 10 grids of the demo's prompts x 1 seed);
- `off`: `sampling.every_validations: null`.

Each round runs the arms in a rotated order. It reports each arm's wall time (median), the time inside the samples
(the index's seconds per grid: render only) and the added share. `--whole-demo` also times the whole pipeline
(`rangefinder demo`'s `run_pipeline_locally`, every step through kfp.local) once per arm and round: the number that
says whether samples double the demo's time (issue 20, item 2: off by default on CPU if they do).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import default_out, machine_info, quiet_libraries, smoke_out, table, torch_threads, write_json
from bench.discovery_quality import SMOKE_SAMPLING

NAME = "samples_cost"
# The demo's LR bounds as README.md prints them (a fixed LR keeps both arms on the same run).
DEMO_LR = {"lr_low": 2.89735e-05, "lr_high": 0.00014558, "lr_mid": 9.72358e-05}
ARMS = {"auto": "auto", "off": None}


def finetune_once(work: Path, cfg: Any, split_dir: Path, name: str) -> dict[str, Any]:
    from rangefinder.steps.finetune import run_finetune
    from rangefinder.training.samples import read_index

    out = work / name
    t0 = time.perf_counter()
    run_finetune(cfg, split_dir=split_dir, model_dir=out, **DEMO_LR)
    wall = time.perf_counter() - t0
    index = read_index(out) or {"samples": []}
    row = {"wall_seconds": wall, "grids": len(index["samples"]),
           "render_seconds": sum(e["seconds"] for e in index["samples"])}
    shutil.rmtree(out, ignore_errors=True)
    return row


def whole_demo_once(work: Path, every: Any, name: str) -> dict[str, Any]:
    from rangefinder.cli.commands.demo import prepare_demo
    from rangefinder.pipelines.local_run import run_pipeline_locally

    out = work / name
    out.mkdir(parents=True)
    cfg = prepare_demo(out)
    cfg.sampling.every_validations = every
    t0 = time.perf_counter()
    run_pipeline_locally(cfg, out, quiet=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return {"wall_seconds": wall}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.samples_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--whole-demo", action="store_true", help="also time the whole demo pipeline per arm and round")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's choice)")
    p.add_argument("--smoke", action="store_true", help="1 round of a 2-epoch fine-tune, samples of one prompt at one "
                   "denoising step, no untimed warm-up run (CI)")
    p.add_argument("--out", type=Path, help="JSON output (default bench/results/<name>.json; with --smoke a "
                   "temporary file, so a smoke run never replaces a real result)")
    p.add_argument("--work-dir", type=Path)
    args = p.parse_args(argv)
    args.out = args.out or (smoke_out(NAME) if args.smoke else default_out(NAME))
    quiet_libraries()
    if args.smoke:
        args.rounds, args.whole_demo = 1, False

    from rangefinder.config import demo_config
    from rangefinder.data.split import split_dataset
    from rangefinder.data.synthetic import EMBEDDED_KIND, make_synthetic_dataset
    from rangefinder.models.tiny import ensure_tiny_base_model

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-samples-"))
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    result: dict[str, Any] = {"benchmark": NAME, "smoke": args.smoke,
                              "settings": {"rounds": args.rounds, "whole_demo": args.whole_demo, **DEMO_LR}}
    try:
        with torch_threads(args.threads or None):
            result["machine"] = machine_info()
            data = work / "dataset"
            make_synthetic_dataset(data, kind=EMBEDDED_KIND, count=20, seed=0, resolution=32)  # the demo's
            base = demo_config(model={"base_model": str(ensure_tiny_base_model())},
                               data={"dataset_dir": str(data)},
                               training={"cache_dir": str(work / "cache")},
                               tracking={"tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
                                         "registered_model_name": None},
                               finetune={"epochs": 2} if args.smoke else {},
                               sampling=SMOKE_SAMPLING if args.smoke else {})
            split_dir = work / "split"
            split_dataset(data, split_dir, val_split=base.split.val_split,
                          stabilize_split=base.split.stabilize_split, seed=base.split.seed)
            configs = {arm: base.model_copy(update={"sampling": base.sampling.model_copy(
                update={"every_validations": every})}) for arm, every in ARMS.items()}
            if not args.smoke:  # a smoke run checks the arms and their counts, not their timing: no warm-up run
                finetune_once(work, configs["off"], split_dir, "warm-up")  # untimed: fills the latent and text caches
            names = list(ARMS)
            runs = []
            for r in range(args.rounds):
                for arm in names[r % len(names):] + names[: r % len(names)]:
                    row = finetune_once(work, configs[arm], split_dir, f"ft-{arm}-{r}") | {"round": r, "arm": arm,
                                                                                            "what": "finetune"}
                    log(f"  round {r} finetune {arm:4s}: {row['wall_seconds']:.1f} s, {row['grids']} grids "
                        f"({row['render_seconds']:.1f} s rendering)")
                    runs.append(row)
                    if args.whole_demo:
                        row = whole_demo_once(work, ARMS[arm], f"demo-{arm}-{r}") | {"round": r, "arm": arm,
                                                                                    "what": "demo"}
                        log(f"  round {r} demo     {arm:4s}: {row['wall_seconds']:.1f} s")
                        runs.append(row)
            result["runs"] = runs
            result["machine"]["loadavg_after"] = machine_info()["loadavg_1_5_15"]
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    result["summary"] = summarize(result["runs"])
    write_json(args.out, result)
    print(report(result))
    print(f"\nwritten: {args.out}")
    return result


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for what in ("finetune", "demo"):
        rows = [r for r in runs if r["what"] == what]
        if not rows:
            continue
        wall = {arm: statistics.median(r["wall_seconds"] for r in rows if r["arm"] == arm) for arm in ARMS}
        s: dict[str, Any] = {f"{arm}_seconds": v for arm, v in wall.items()}
        s["added_seconds"] = wall["auto"] - wall["off"]
        s["added_pct"] = 100 * (wall["auto"] - wall["off"]) / wall["off"]
        if what == "finetune":
            auto = [r for r in rows if r["arm"] == "auto"]
            s["grids"] = auto[0]["grids"]
            s["render_seconds"] = statistics.median(r["render_seconds"] for r in auto)
            s["render_pct_of_off"] = 100 * s["render_seconds"] / wall["off"]
        out[what] = s
    return out


def report(result: dict[str, Any]) -> str:
    rows = [{"what": what, **s} for what, s in result["summary"].items()]
    columns = ["what", "off_seconds", "auto_seconds", "added_seconds", "added_pct", "grids", "render_seconds",
               "render_pct_of_off"]
    return table(rows, columns, title=f"Samples during training on the demo (median of {result['settings']['rounds']} "
                                      "rounds)")


if __name__ == "__main__":
    main()
