"""Prodigy's step size as (a)'s LR (issue 34, item 4: "Prodigy's d as a prior"): a probe of saved bench.versus cases.

The lead (bench/RESULTS.md, "A third halving candidate below lr_mid", its last part): on the saved grids, Prodigy's
final step size d x lr, taken as a constant LR, lands nearer the grid's best than the LR (a) trained at in 23 of 26
LoRA cases and 21 of 30 full ones. Across cases it moves less than (a)'s range test does, and the range test's noise
costs (a) more than its bias. No run has tested it.

What it does, per saved case (full fine-tuning and LoRA; textual inversion's arms tie whatever the LR): rebuild the
case (bench.versus.rebuild_case: the same images, split and settings), read the step size its Prodigy arm (b) ended on
(`lr_effective_final`, recorded by bench.versus; a case run before it was recorded has that arm re-run first, as
bench.versus trains it, and is read only if the re-run reproduces the saved best loss), and train (a)'s fine-tune at
that one constant LR, as the pipeline's fine-tune step runs it with the case's settings (the step window, the window
average; halving off, one LR). That is the prior's run. Two deliveries are read:
- **prior**: what that run delivers (chosen.json, as (a) delivers);
- **prior or Prodigy**: the lower of it and the Prodigy run's best checkpoint. A pipeline that measures the LR this
  way has trained the Prodigy run first and validated its checkpoints, and like (a) it delivers the lowest validation
  loss it measured.
Both cost the Prodigy run and the prior's run: two fine-tunes, 320 updates on this bench, where (a) as shipped costs
264 (the range test, its zoom and the halving's extra half run). That is 25.0 % of the 8-LR grid's 1,280, inside
the Goal's 25 %, with no range test. Random search at equal compute is the saved arm: ceil(320 / 160) = 2 draws,
as for (a).

Each is weighed against Prodigy's best, the folk default's best and random search's best with the Goal's 1 % band,
and against (a) as shipped. A case whose rebuilt base model does not give the saved update-0 validation loss (the
data or split differ) is reported and read as missing.

    python -m bench.prodigy_prior --from bench/results/versus_all_275.json --methods full,lora \\
        --part 1/2 --out bench/results/prodigy_prior_part1.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any, Optional

from bench.common import (
    add_probe_arguments,
    by_method,
    case_key,
    family_of_case,
    median_of,
    part_spec,
    quiet_libraries,
    results_file,
    run_probe,
    write_json,
)
from bench.discovery_quality import gap_pct
from bench.versus import (
    OPPONENTS,
    aggregate,
    case_name,
    case_training_seed,
    count_verdicts,
    plain_finetune,
    prodigy_recipe,
    rebuild_case,
    train_arm,
    verdict_of,
)

NAME = "prodigy_prior"
METHODS = ("full", "lora")
DELIVERIES = ("prior", "prior_or_prodigy")
AGAINST = ("prodigy_best", "folk_best", "random_best", "rangefinder")


def probe_case(c: dict[str, Any], work: Path, log=print, multiplier: float = 1.0) -> dict[str, Any]:
    """One saved case: (a)'s fine-tune at the case's Prodigy final step size (times `multiplier`: --multiplier, a
    probe of an LR above or below it), and the two deliveries' verdicts."""
    s = c["summary"]
    # The case's key (bench.common.case_key) travels with the row: a killed probe resumes, and --report merges, by it.
    row: dict[str, Any] = {k: c[k] for k in ("method", "kind", "seed", "held_out")}
    row.update(family=family_of_case(c), case=case_name(c), **({"lora": c["lora"]} if c.get("lora") else {}))
    case, cfg, split_dir = rebuild_case(c, work)
    seed = case_training_seed(c)
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"seed": seed})})
    lr = c["prodigy"].get("lr_effective_final")
    if lr is None:  # run before bench.versus recorded it: the arm re-run as versus runs it, which must reproduce
        prodigy = prodigy_arm(cfg, split_dir, case / "prodigy")
        lr = prodigy.get("lr_effective_final")
        row["prodigy_rerun"] = {k: prodigy.get(k) for k in ("best_val_loss", "lr_effective_final", "seconds")}
        row["prodigy_reproduces"] = math.isclose(prodigy.get("best_val_loss") or math.nan,
                                                 c["prodigy"]["best_val_loss"], rel_tol=1e-6)
    row["prodigy_lr_effective_final"] = lr
    if not lr or not math.isfinite(lr) or row.get("prodigy_reproduces") is False:
        row["absent"] = "the case's Prodigy arm gave no step size, or its re-run did not reproduce it"
        shutil.rmtree(case, ignore_errors=True)
        return row
    trained_lr = lr * multiplier
    row.update(multiplier=multiplier, trained_lr=trained_lr)
    arm = train_arm(cfg, split_dir, trained_lr, case / "prior")
    shutil.rmtree(case, ignore_errors=True)
    chosen = arm.get("chosen") or {}
    row.update(prior=chosen.get("val_loss", arm.get("final_val_loss")), prior_best=arm.get("best_val_loss"),
               prior_rule=chosen.get("rule"), prior_updates=arm["updates"], seconds=arm["seconds"],
               baseline_val_loss=arm.get("baseline_val_loss"),
               # The saved base loss: (a)'s, or where (a) failed before it trained one, the Prodigy arm's.
               reproduces=math.isclose(arm.get("baseline_val_loss") or math.nan,
                                       s["baseline_val_loss"] or c["prodigy"]["baseline_val_loss"], rel_tol=1e-6),
               updates=arm["updates"] + c["prodigy"]["updates"], rangefinder_updates=s["updates"]["rangefinder"],
               rangefinder_lr=s["rangefinder_lr"], lr_over_rangefinder=trained_lr / s["rangefinder_lr"]
               if s.get("rangefinder_lr") else None)
    row["prior_or_prodigy"] = min((x for x in (row["prior"], s["prodigy_best"]) if x is not None), default=None)
    for opp in AGAINST:
        row[opp] = s[opp]
        for d in DELIVERIES:
            row[f"{d}_vs_{opp}"] = verdict_of(row[d], s[opp])
            if opp == "rangefinder" and s[opp] is None and row[d] is not None:
                row[f"{d}_vs_{opp}"] = "win"  # (a) failed (no bounds): it delivered nothing, as verdict_of counts it
        row[f"rangefinder_vs_{opp}"] = verdict_of(s["rangefinder"], s[opp]) if opp != "rangefinder" else None
    log(f"[{row['case']}] lr {trained_lr:.3g} ({row['lr_over_rangefinder'] or math.nan:.2f}x (a)'s): "
        f"prior {row['prior']}, (a) {s['rangefinder']}, Prodigy best {s['prodigy_best']}; "
        f"vs Prodigy best {row['prior_vs_prodigy_best']} (a: {row['rangefinder_vs_prodigy_best']}); "
        f"{arm['seconds']:.0f} s")
    return row


def prodigy_arm(cfg, split_dir: Path, out: Path) -> dict[str, Any]:
    """Arm (b) as bench.versus trains it: Prodigy at lr 1.0 with diffusers' settings, a plain run."""
    return train_arm(prodigy_recipe(plain_finetune(cfg)), split_dir, 1.0, out)


def tally(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method and together, over the cases read (ran, and reproduced): each delivery's and (a)'s wins, ties and
    losses against each arm, the better shares, and how far the prior's loss lies from (a)'s."""
    read = [r for r in rows if "absent" not in r and r.get("reproduces")]
    out: dict[str, Any] = {"cases": len(rows), "read": len(read),
                           "not_read": [r["case"] for r in rows if r not in read], "by": {}}
    for name, rs in by_method(read, METHODS).items():
        g: dict[str, Any] = {"cases": len(rs)}
        for who in (*DELIVERIES, "rangefinder"):
            for opp in AGAINST:
                if who == "rangefinder" and opp == "rangefinder":
                    continue
                v = [r[f"{who}_vs_{opp}"] for r in rs]
                g[f"{who}_vs_{opp}"] = {**count_verdicts(v), "better_share": v.count("win") / len(rs)}
        g["prior_over_rangefinder_pct_median"] = median_of(
            [100 * (r["prior"] / r["rangefinder"] - 1) for r in rs if r["prior"] and r["rangefinder"]])
        ratios = [r["lr_over_rangefinder"] for r in rs if r.get("lr_over_rangefinder")]
        g["lr_over_rangefinder_median"] = statistics.median(ratios) if ratios else None
        g["seconds"] = sum(r["seconds"] for r in rs)
        out["by"][name] = g
    return out


def with_prior(c: dict[str, Any], row: Optional[dict[str, Any]]) -> dict[str, Any]:
    """A saved case's summary with the prior run in (a)'s place where the probe read it (full and LoRA), as
    bench.versus summarizes a case: its loss, LR, updates and verdicts, and its gap to the grid's best."""
    s = dict(c["summary"])
    if row is None or "absent" in row or not row.get("reproduces") or c["method"] not in METHODS:
        return s
    s.update(rangefinder=row["prior"], rangefinder_lr=row["prodigy_lr_effective_final"], lr_finder="prodigy_step",
             updates={**s["updates"], "rangefinder": row["updates"]})
    for opp in OPPONENTS:
        s[f"vs_{opp}"] = verdict_of(s["rangefinder"], s[opp])
    if s.get("grid_best") is not None:
        s["gap_rangefinder_pct"] = gap_pct(s["rangefinder"], s["grid_best"])
        s["rangefinder_update_share"] = row["updates"] / s["updates"]["grid"]
    return s


def standings(source: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The Goal's lines over a bench.versus result with the prior run in (a)'s place wherever it was read: the
    aggregate as bench.versus makes it, held out and by method too, and how many cases took the prior."""
    by = {case_key(r): r for r in rows}
    sums = [with_prior(c, by.get(case_key(c))) for c in source["cases"]]
    return {"cases": len(sums), "with_prior": sum(x.get("lr_finder") == "prodigy_step" for x in sums),
            "aggregate": aggregate(sums), "aggregate_held_out": aggregate([x for x in sums if x["held_out"]]),
            "aggregate_by_method": {m: aggregate([x for x in sums if x["method"] == m])
                                    for m in dict.fromkeys(x["method"] for x in sums)},
            "summaries": sums}


def report(paths: list[Path], out: Path, source: Optional[Path] = None) -> dict[str, Any]:
    """The tally over several results of this probe (parts run side by side), each case once; with `source` (a
    bench.versus result) also the Goal's standings over its cases with the prior run in (a)'s place."""
    rows = {case_key(r): r for p in paths for r in json.loads(p.read_text())["cases"]}
    result: dict[str, Any] = {"benchmark": NAME, "merged_from": [p.name for p in paths], "cases": list(rows.values())}
    result["tally"] = tally(result["cases"])
    if source is not None:
        result["standings"] = standings(json.loads(source.read_text()), result["cases"])
        result["standings"]["source"] = source.name
        print(json.dumps(result["standings"]["aggregate"]["goals"], indent=1))
    write_json(out, result)
    print(json.dumps(result["tally"]["by"], indent=1))
    return result


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.prodigy_prior", description=__doc__.splitlines()[0])
    add_probe_arguments(p, source_required=False)
    p.add_argument("--report", type=results_file, nargs="+", metavar="JSON",
                   help="no runs: the tally over these results of this probe, written to --out (with --from: the "
                        "standings over that result's cases with the prior run in (a)'s place)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seeds", default=None, help="only these seeds of the source (default: all)")
    p.add_argument("--multiplier", type=float, default=1.0,
                   help="train at this multiple of the Prodigy step size (a probe of a higher or lower LR)")
    p.add_argument("--part", type=part_spec, default="1/1", metavar="I/N",
                   help="every N-th case from the I-th: side by side")
    args = p.parse_args(argv)
    quiet_libraries()
    if args.report:
        return report(args.report, args.out, args.source)
    if args.source is None:
        p.error("--from is required (or --report)")
    methods = [m for m in args.methods.split(",") if m]
    if unknown := set(methods) - set(METHODS):
        raise SystemExit(f"--methods: {', '.join(sorted(unknown))} not probed (only {', '.join(METHODS)})")
    seeds = {int(x) for x in args.seeds.split(",")} if args.seeds else None
    i, n = args.part
    cases = [c for c in json.loads(args.source.read_text())["cases"]
             if c["method"] in methods and (seeds is None or int(c["seed"]) in seeds)]
    cases = sorted(cases, key=case_key)[i - 1::n]
    return run_probe(NAME, args, cases, functools.partial(probe_case, multiplier=args.multiplier), tally)


if __name__ == "__main__":
    main()
