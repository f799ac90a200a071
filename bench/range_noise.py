"""Range-test noise probe: how far the range test's bounds move with the training seed alone, and whether a longer
range test steadies them.

With only `training.seed` changed (the replicate of seeds 14-17, bench/RESULTS.md), (a)'s LoRA LR moved 0.15
decades at the median and Prodigy's d x lr 0.07, and `validation.timesteps: 16` did not steady it: the noise comes
from the range test's training draws. Per saved bench.versus case this probe rebuilds the case and runs only the
pipeline's range tests (the first and, when it asks for one, the zoom: bench.discovery_quality.range_tests) at two
training seeds, for each `lr_range_test.epochs` given (the cases' own is demo_config's 3 epochs of 4 updates,
validated every update: 12 updates a test); no fine-tune. It reports, per length, how far `lr_mid` and
`lr_high` moved between the seeds (|log10 of their ratio|), how often the zoom ran, and the updates it cost.
Exploratory: it measures noise, not whether a steadier LR fine-tunes better.

    python -m bench.range_noise --from bench/results/versus_all_215.json --methods lora --seeds 14,15,16,17 \\
        --epochs 3,12 --out bench/results/range_noise.json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any, Optional

from bench.common import add_probe_arguments, part_spec, quiet_libraries, run_probe
from bench.discovery_quality import range_tests
from bench.versus import case_training_seed, rebuild_case

NAME = "range_noise"
OTHER_SEED = 1235  # the replicate's training seed


def bounds_at(cfg, split_dir: Path, out: Path, epochs: int, seed: int) -> dict[str, Any]:
    """The range tests at `epochs` and training seed `seed`: the bounds used (the last test's) and their cost."""
    run = cfg.model_copy(update={"lr_range_test": cfg.lr_range_test.model_copy(update={"epochs": epochs}),
                                 "training": cfg.training.model_copy(update={"seed": seed})})
    res: dict[str, Any] = {"updates": 0, "range_tests": []}
    tests = range_tests(run, split_dir, out, res)
    shutil.rmtree(out, ignore_errors=True)
    used = tests[-1] if tests else None
    return {"epochs": epochs, "training_seed": seed, "status": "ok" if used else "failed", "updates": res["updates"],
            "zoomed": len(tests) > 1, "lr_low": used.lr_low if used else None,
            "lr_mid": used.lr_mid if used else None, "lr_high": used.lr_high if used else None}


def probe_case(c: dict[str, Any], work: Path, log=print, epochs: tuple[int, ...] = (3, 12)) -> dict[str, Any]:
    case, cfg, split_dir = rebuild_case(c, work)
    own = case_training_seed(c)
    row: dict[str, Any] = {k: c[k] for k in ("method", "kind", "seed", "held_out")}
    row.update(saved_lr_mid=c["rangefinder"].get("lr_mid"), saved_lr_high=c["rangefinder"].get("lr_high"), runs=[])
    for e in epochs:
        for seed in (own, OTHER_SEED):
            row["runs"].append(bounds_at(cfg, split_dir, case / f"epochs{e}-seed{seed}", e, seed))
        a, b = row["runs"][-2:]
        log(f"[{c['method']} {c['kind']} seed {c['seed']}] epochs {e}: lr_mid {a['lr_mid']} / {b['lr_mid']}, "
            f"lr_high {a['lr_high']} / {b['lr_high']}, {a['updates']} + {b['updates']} updates")
    shutil.rmtree(case, ignore_errors=True)
    # The case's own length and seed is (a)'s range test as it ran: on the machine that ran the case, the same bounds.
    own_run = [r for r in row["runs"] if (r["epochs"], r["training_seed"]) == (cfg.lr_range_test.epochs, own)]
    row["reproduces"] = (math.isclose(own_run[0]["lr_mid"], row["saved_lr_mid"], rel_tol=1e-9)
                         if own_run and own_run[0]["lr_mid"] and row["saved_lr_mid"] else None)
    return row


def move(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """How far two LRs lie apart, in decades."""
    return abs(math.log10(b / a)) if a and b else None


def tally(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"cases": len(rows), "reproduce_saved": sum(r.get("reproduces") is True for r in rows)}
    for e in sorted({r["epochs"] for row in rows for r in row["runs"]}):
        pairs = [[r for r in row["runs"] if r["epochs"] == e] for row in rows]
        stats: dict[str, Any] = {"failed": sum(r["status"] == "failed" for p in pairs for r in p),
                                 "zoomed": sum(r["zoomed"] for p in pairs for r in p),
                                 "median_updates": statistics.median(r["updates"] for p in pairs for r in p)}
        for k in ("lr_mid", "lr_high"):
            moves = [m for p in pairs if len(p) == 2 and (m := move(p[0][k], p[1][k])) is not None]
            stats[f"{k}_median_move_decades"] = statistics.median(moves) if moves else None
            stats[f"{k}_largest_move_decades"] = max(moves) if moves else None
            stats[f"{k}_moved_over_1_5x"] = sum(m > math.log10(1.5) for m in moves)
        out[f"epochs_{e}"] = stats
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.range_noise", description=__doc__.split("\n\n")[0])
    add_probe_arguments(p)
    p.add_argument("--methods", default="lora")
    p.add_argument("--seeds", default="14,15,16,17", help="the cases' data seeds")
    p.add_argument("--epochs", default="3,12",
                   help="lr_range_test.epochs to compare (3: the bench's cases, demo_config's; validated every update)")
    p.add_argument("--part", type=part_spec, default="1/1",
                   help="K/N: every Nth case from the Kth, to run N probes side by side")
    args = p.parse_args(argv)
    quiet_libraries()
    methods, seeds = set(args.methods.split(",")), {int(x) for x in args.seeds.split(",")}
    epochs = tuple(int(x) for x in args.epochs.split(","))
    cases = [c for c in json.loads(args.source.read_text())["cases"]
             if c["method"] in methods and int(c["seed"]) in seeds and c.get("family", "sd1") == "sd1"]
    k, n = args.part
    cases = cases[k - 1::n]
    return run_probe(NAME, args, cases, lambda c, work, log=print: probe_case(c, work, log, epochs), tally)


if __name__ == "__main__":
    main()
