"""Seed soup probe (issue 34): (a) run twice with two training seeds, delivering the average of its two delivered
models, against the arms. A ceiling read before anything cheaper is built.

Why. A replicate (bench.replicates, RESULTS "A replicate of seeds 14-17") found that (a) ties itself within 1 % in
31 of 60 cases when only `training.seed` changes, and that the two failing Goal lines fail on single runs and on
the mean loss of two runs alike. Averaging in weight space (Wortsman et al. 2022, "Model soups": fine-tunes of one
pretrained model averaged) can do better than either run where the runs differ by their training draws: the average
keeps what the runs share and cancels part of what each drew. Along one run (the greedy soup over the window's
checkpoints, `finetune.soup_tries`) it found almost nothing; two seeds differ more than neighbouring checkpoints.

What it does, per saved bench.versus case: (a) as shipped with the case's own `training.seed` (the saved run) and
with the replicate's (1235), every checkpoint kept; each run's delivered weights (its chosen checkpoint, or its
window average as bench.unseen reads it); the soup = the two delivered sets averaged with weight 1/2 each. LoRA
adapters are averaged as the updates they make, not factor by factor (two seeds start from different A matrices, so
the mean of the A's times the mean of the B's is not the mean of B A): the soup is the rank-2r adapter [B1 B2] [A1;
A2] at the same alpha, whose scale alpha / 2r halves each run's update; it is measured by a run with `lora.rank` 2r.
Full weights and embeddings are averaged as tensors. Each run and the soup are measured with the case's validation
settings on the case's validation images and on the same unseen images as the arms (bench.unseen).

Its compute: two runs of (a), twice (a)'s updates (about 41 % of the grid's at today's 20.6 %), which breaks the
Goal's third line by itself. So random search at equal compute gets two runs' budget: its two runs of the saved
case and of the replicate (bench/results/versus_replicate_seed14_15.json, random search's LRs drawn afresh), the
better of their best by validation loss, with that trial's unseen loss. Prodigy and the folk default stay single
runs, as users run them.

Written down (committed) 2026-11-27 23:53 UTC, before any run of this probe on these cases (one check ran first, on a
2-epoch LoRA case of seed 0 made for it, not one of them):
- The cases: the 30 of bench/results/versus_all_215.json with seeds 14 and 15 (full, LoRA and textual inversion, the
  five kinds), each paired with its replicate in versus_replicate_seed14_15.json, in the file's order, two processes
  side by side. A case whose first run does not reproduce the saved (a)'s delivered validation loss (relative
  1e-5, bench.unseen's check) is reported and left out of the reading; the seed-1235 run is checked the same way
  against the replicate's (a) and reported.
- The reading: the seed soup is worth building in a cheaper form if, over the cases read, on the validation images
  AND on the unseen images, it is better than Prodigy's best (by more than the 1 % band) in more than half of them,
  and beats random search at equal compute in at least 70 % of them. Otherwise the lead is closed. Reported as it
  comes out either way, with each of the two runs alone against the same arms and the soup against the better of
  its two runs, and the seconds. Cases not reached by 01:30 UTC are said to be missing, and the reading is over those
  that ran.

Its first run (23:53 UTC on) trained each first run with `training.seed` 1234, TrainingConfig's default, which the
probe took for the saved cases' seed. They trained with their data seed (bench.discovery_quality.set_up_case sets
it as the training seed), so no first run reproduced the saved (a), while every second run reproduced the
replicate's: by the rule above it reads nothing. What it measured, a soup of two fresh seeds (1234 and 1235) against
the saved arms, is kept as a description (bench/results/seed_soup_probe_seeds_1234_1235.json), not a reading. The
probe now takes each case's own seed (versus.case_training_seed). The rule above, unchanged, is read on the 30 cases
of seeds 16 and 17 (`--seeds 16,17 --replicate bench/results/versus_replicate_seed16_17.json`), none of which this
probe had run: written down (committed) 2026-11-28 00:07 UTC, before any run of it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import (
    add_probe_arguments,
    case_key,
    family_of_case,
    part_spec,
    quiet_libraries,
    results_file,
    run_probe,
)
from bench.discovery_quality import discover, gap_pct
from bench.versus import (
    OPPONENTS,
    case_training_seed,
    count_verdicts,
    keeping_every_checkpoint,
    plain_finetune,
    rebuild_case,
    verdict_of,
)

NAME = "seed_soup_probe"
RUNS = ("first", "second", "soup")
WHERE = {"": "val_loss", "unseen_": "unseen_loss"}  # a verdict's prefix -> the loss it weighs


def soup_of(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """The two runs' trained tensors averaged with weight 1/2 each; a LoRA adapter's factors concatenated into one
    of twice the rank (lora_A along its rows, lora_B along its columns), which at the same alpha adds half of each
    run's B A; an integer tensor (the update count) is the first run's."""
    import torch

    if set(first) != set(second):
        raise ValueError("the two runs hold other tensors: they are not runs of one method on one model")
    out: dict[str, torch.Tensor] = {}
    for k, a in first.items():
        b = second[k]
        if "lora_A" in k:
            out[k] = torch.cat([a, b], dim=0)
        elif "lora_B" in k:
            out[k] = torch.cat([a, b], dim=1)
        elif a.is_floating_point():
            out[k] = ((a.float() + b.float()) / 2).to(a.dtype)
        else:
            out[k] = a.clone()
    return out


def random_at_equal_compute(s: dict[str, Any], r: dict[str, Any]) -> tuple[Optional[float], Optional[float], str]:
    """Random search with two runs' budget: the better by validation loss of the saved case's and the replicate's
    best; (validation loss, unseen loss, which run)."""
    both = [(x.get("random_best"), x.get("unseen_random_best"), name) for x, name in ((s, "first"), (r, "second"))
            if x.get("random_best") is not None]
    if not both:
        return None, None, "none"
    return min(both, key=lambda t: t[0])


def probe_case(c: dict[str, Any], rep: dict[str, Any], work: Path, log=print) -> dict[str, Any]:
    from bench.unseen import delivered_sets, rangefinder_alone, reproduces, unseen_split, write_unseen_images
    from rangefinder.data.split import read_split
    from rangefinder.steps.average import average_weights
    from rangefinder.training.loop import weights_measurer
    from rangefinder.training.spec import TrainSpec

    s, rs, u = c["summary"], rep["summary"], c["unseen"]
    tag = f"[{c['method']} {c['kind']} seed {c['seed']}]"
    case, cfg, split_dir = rebuild_case(c, work)
    row: dict[str, Any] = {k: c[k] for k in ("method", "kind", "seed", "held_out")}
    row["family"] = family_of_case(c)
    weights: dict[str, Any] = {}
    t0 = time.perf_counter()
    for run, seed in (("first", case_training_seed(c)), ("second", case_training_seed(rep))):
        seeded = cfg.model_copy(update={"training": cfg.training.model_copy(update={"seed": seed})})
        t = time.perf_counter()
        with keeping_every_checkpoint():
            a = discover(seeded, split_dir, case / run / "rangefinder")
        row[f"{run}_seconds"], row[f"{run}_training_seed"] = time.perf_counter() - t, seed
        row[f"{run}_lr_used"], row[f"{run}_rule"] = a.get("lr_used"), (a.get("chosen") or {}).get("rule")
        row[f"{run}_recorded"] = (a.get("chosen") or {}).get("val_loss", a.get("final_val_loss"))
        sets = delivered_sets(rangefinder_alone(a), case / run)["rangefinder"]
        if isinstance(sets, str):
            row[f"{run}_absent"] = sets
        else:
            weights[run] = average_weights(sets)
            row[f"{run}_checkpoints"] = [p.name for p in sets]
    if len(weights) == 2:
        weights["soup"] = soup_of(weights["first"], weights["second"])
    images = write_unseen_images(case / "unseen-images", c["kind"], c["seed"], c["images"], u["images"])
    splits = {"val_loss": read_split(split_dir), "unseen_loss": unseen_split(cfg, images, case / "unseen-split")}
    # One measuring setup per image set and model shape (the model loaded and the data encoded once): the two runs,
    # and the soup with them unless it is a LoRA adapter of twice the rank, which needs a model with such adapters.
    groups: dict[int, list[str]] = {}
    for run in [r for r in RUNS if r in weights]:
        rank = 2 if run == "soup" and c["method"] == "lora" else 1
        groups.setdefault(rank, []).append(run)
    lr, measured = cfg.training.lr, plain_finetune(cfg)  # the measurer validates the delivered weights (bench.unseen)
    for loss, split in splits.items():
        for rank, runs in groups.items():
            lora = cfg.training.lora.model_copy(update={"rank": rank * cfg.training.lora.rank})
            measured_cfg = measured.model_copy(update={"training": measured.training.model_copy(update={"lora": lora})})
            spec = TrainSpec.finetune(measured_cfg, split, lr=lr, bounds=(lr, lr), world_size=1)
            out_dir = case / f"measure-rank{rank}-{loss}"
            with weights_measurer(spec, out_dir=out_dir, split=split) as measure:
                for run in runs:
                    row[f"{run}_{loss}"] = measure(weights[run]).get("val_loss")
            shutil.rmtree(out_dir, ignore_errors=True)
    row["seconds"] = time.perf_counter() - t0
    shutil.rmtree(case, ignore_errors=True)

    row["saved_val_loss"], row["replicate_val_loss"] = s["rangefinder"], rs["rangefinder"]
    row["reproduces"] = reproduces(row.get("first_val_loss"), s["rangefinder"])
    row["replicate_reproduces"] = reproduces(row.get("second_val_loss"), rs["rangefinder"])
    rnd_val, rnd_unseen, rnd_from = random_at_equal_compute(s, rs)
    row.update(random_equal_compute=rnd_val, unseen_random_equal_compute=rnd_unseen, random_from=rnd_from)
    for w, loss in WHERE.items():
        for run in RUNS:
            mine = row.get(f"{run}_{loss}")
            for opp in OPPONENTS:
                row[f"{run}_{w}vs_{opp}"] = verdict_of(mine, s.get(f"{w}{opp}" if w else opp))
            row[f"{run}_{w}vs_random_equal_compute"] = verdict_of(mine, row[f"{w}random_equal_compute"])
        firsts = [row.get(f"{r}_{loss}") for r in ("first", "second")]
        better = min((x for x in firsts if x is not None), default=None)
        row[f"soup_{w}vs_better_run"] = verdict_of(row.get(f"soup_{loss}"), better)
        row[f"soup_{w}gain_over_better_run_pct"] = gap_pct(row.get(f"soup_{loss}"), better)
    log(f"{tag} runs {row.get('first_val_loss')} / {row.get('second_val_loss')} (saved {s['rangefinder']}, "
        f"{'reproduces' if row['reproduces'] else 'DOES NOT reproduce'}), soup {row.get('soup_val_loss')} "
        f"({row['soup_vs_better_run']} against the better run); unseen soup {row.get('soup_unseen_loss')}; vs "
        f"Prodigy best {row['soup_vs_prodigy_best']}/{row['soup_unseen_vs_prodigy_best']}, vs random at equal "
        f"compute {row['soup_vs_random_equal_compute']}/{row['soup_unseen_vs_random_equal_compute']} "
        f"(val/unseen), {row['seconds']:.0f} s")
    return row


def tally(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The reading over the cases whose first run reproduced the saved (a); every count also over all rows."""
    read = [r for r in rows if r.get("reproduces")]
    out: dict[str, Any] = {"cases": len(rows), "read": len(read),
                           "not_reproduced": [case_key(r) for r in rows if not r.get("reproduces")],
                           "replicate_not_reproduced": [case_key(r) for r in rows if not r.get("replicate_reproduces")]}
    for w in WHERE:
        for run in RUNS:
            for opp in (*OPPONENTS, "random_equal_compute"):
                vs = [r.get(f"{run}_{w}vs_{opp}") or "loss" for r in read]  # nothing delivered: a loss
                out[f"{run}_{w}vs_{opp}"] = count_verdicts(vs)
        vs = [r.get(f"soup_{w}vs_better_run") for r in read if r.get(f"soup_{w}vs_better_run")]
        out[f"soup_{w}vs_better_run"] = count_verdicts(vs)
    n = len(read)
    met = n > 0
    for w in WHERE:
        pb, rnd = out[f"soup_{w}vs_prodigy_best"]["win"], out[f"soup_{w}vs_random_equal_compute"]["win"]
        out[f"soup_{w}better_than_prodigy_best_pct"] = 100.0 * pb / n if n else None
        out[f"soup_{w}beats_random_equal_compute_pct"] = 100.0 * rnd / n if n else None
        met = met and 2 * pb > n and 10 * rnd >= 7 * n
    out["reading_met"] = met
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.seed_soup_probe", description=__doc__.split("\n\n")[0])
    add_probe_arguments(p)
    p.add_argument("--replicate", type=results_file, nargs="+", required=True,
                   help="bench.versus --training-seed results holding each case's replicate")
    p.add_argument("--seeds", default="14,15", help="the data seeds of the cases to probe")
    p.add_argument("--part", type=part_spec, default="1/1",
                   help="K/N: every Nth case from the Kth, to run N probes side by side")
    args = p.parse_args(argv)
    quiet_libraries()
    seeds = {int(x) for x in args.seeds.split(",")}
    replicates = {case_key(c): c for f in args.replicate for c in json.loads(f.read_text())["cases"]}
    cases = [c for c in json.loads(args.source.read_text())["cases"]
             if c.get("unseen") and c["seed"] in seeds and case_key(c) in replicates]
    k, n = args.part
    cases = cases[k - 1::n]

    def probe(c: dict[str, Any], work: Path, log=print) -> dict[str, Any]:
        return probe_case(c, replicates[case_key(c)], work, log)

    return run_probe(NAME, args, cases, probe, tally)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
