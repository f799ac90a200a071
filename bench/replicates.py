"""Replicates: the same bench.versus cases run twice, the second with another training seed, read together.

`python -m bench.versus --training-seed S` re-runs saved cases with everything their runs draw drawn again (the data
order, the training timesteps and noise, the adapters' and embeddings' initialisation, random search's LRs). This
reads a first run and its replicate side by side, case by case (family, method, kind, seed):

- per arm, how far its delivered loss moved between the two runs (as if the replicate were an opponent of the first:
  within the 1 % tie band or not, and the size of the change), on the validation images and, where both runs scored
  them, on the unseen ones; and how many of (a)'s verdicts against each arm came out otherwise. That is how much of
  a single run's verdict is the arms' own noise;
- the two runs read together: per case, each arm's mean loss over its two runs, weighed with the same band and
  counted as bench.versus counts its standings (the Goal's lines), on both image sets. A run that delivered nothing
  ((a) failed) leaves its arm's mean undefined, which counts as a loss, as in a single run.

    python -m bench.replicates --first A.json [...] --second B.json [...] --out both.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

from bench.common import CaseKey, case_key, results_file
from bench.discovery_quality import gap_pct
from bench.unseen import UNSEEN_ARMS, unseen_view
from bench.versus import OPPONENTS, aggregate, case_training_seed, count_verdicts, verdict_of

PREFIXES = ("", "unseen_")  # the validation images' losses and verdicts, and the unseen images'


def load_cases(paths: list[Path]) -> dict[CaseKey, dict[str, Any]]:
    return {case_key(c): c for p in paths for c in json.loads(p.read_text())["cases"]}


def paired(first: dict[CaseKey, dict[str, Any]],
           second: dict[CaseKey, dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The (first, second) summaries of every case the replicate ran, in the replicate's order."""
    return [(first[k]["summary"], c["summary"]) for k, c in second.items() if k in first]


def moved(pairs: list[tuple[Optional[float], Optional[float]]]) -> dict[str, Any]:
    """One run against a baseline run of the same arm, as if it were an opponent, over (baseline loss, run loss)
    pairs: win / tie / loss with the 1 % band (a run that delivered nothing is a loss, as in bench.versus), and the
    median and largest size of the change in %. Pairs without a baseline loss are left out."""
    pairs = [(x, y) for x, y in pairs if x is not None]
    verdicts = [verdict_of(y, x) for x, y in pairs]
    sizes = [abs(g) for x, y in pairs if (g := gap_pct(y, x)) is not None]
    return {"n": len(pairs), **count_verdicts(verdicts),
            "median_abs_change_pct": statistics.median(sizes) if sizes else None,
            "largest_abs_change_pct": max(sizes) if sizes else None}


def verdicts_changed(pairs: list[tuple[Optional[str], Optional[str]]]) -> dict[str, int]:
    """How many of (a)'s verdicts against an arm came out otherwise, over (before, after) pairs where both exist."""
    both = [(x, y) for x, y in pairs if x and y]
    return {"changed": sum(x != y for x, y in both), "of": len(both)}


def arm_changes(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Per image set and arm: the replicate against the first run (`moved`); and per opponent, how many of (a)'s
    verdicts came out otherwise."""
    out: dict[str, Any] = {}
    for w in PREFIXES:
        per_arm = {arm: moved([(a.get(f"{w}{arm}"), b.get(f"{w}{arm}")) for a, b in pairs]) for arm in UNSEEN_ARMS}
        per_arm = {arm: m for arm, m in per_arm.items() if m["n"]}
        changed = {opp: verdicts_changed([(a.get(f"{w}vs_{opp}"), b.get(f"{w}vs_{opp}")) for a, b in pairs])
                   for opp in OPPONENTS}
        if per_arm:
            out[f"{w or 'validation_'}arms"] = per_arm
            out[f"{w or 'validation_'}verdicts_changed"] = {opp: c for opp, c in changed.items() if c["of"]}
    return out


def _mean(x: Optional[float], y: Optional[float]) -> Optional[float]:
    return None if x is None or y is None else 0.5 * (x + y)


def mean_summary(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """A bench.versus summary of the case with each arm's loss the mean of its two runs, and (a)'s verdicts
    recomputed from those means on both image sets (unseen ones only where both runs scored them)."""
    s: dict[str, Any] = {k: a[k] for k in ("family", "method", "kind", "seed", "held_out")}
    for w in PREFIXES:
        if w and not ("unseen_images" in a and "unseen_images" in b):
            continue
        for arm in UNSEEN_ARMS:
            s[f"{w}{arm}"] = _mean(a.get(f"{w}{arm}"), b.get(f"{w}{arm}"))
        for opp in OPPONENTS:
            s[f"{w}vs_{opp}"] = verdict_of(s[f"{w}rangefinder"], s[f"{w}{opp}"])
        if w:
            s["unseen_images"] = a["unseen_images"]
    return s


def read_together(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The standings of the replicate alone and of the two runs' means, on both image sets, as bench.versus counts
    them (aggregate: wins, ties and losses against each arm and the Goal's lines), overall and per method."""
    out: dict[str, Any] = {"cases": len(pairs)}
    for name, sums in (("first", [a for a, _ in pairs]), ("replicate", [b for _, b in pairs]),
                       ("mean_of_two", [mean_summary(a, b) for a, b in pairs])):
        out[name] = {"validation": aggregate(sums),
                     "by_method": {m: aggregate([s for s in sums if s["method"] == m])
                                   for m in dict.fromkeys(s["method"] for s in sums)}}
        unseen = [unseen_view(s) for s in sums if "unseen_images" in s]
        if unseen:
            out[name]["unseen"] = aggregate(unseen)
            out[name]["unseen_by_method"] = {m: aggregate([s for s in unseen if s["method"] == m])
                                             for m in dict.fromkeys(s["method"] for s in unseen)}
    return out


def table(result: dict[str, Any]) -> str:
    """(a)'s wins / ties / losses against Prodigy's best and random search's best: the first run, the replicate and
    the two read together, on each image set."""
    lines = ["| (a) against | images | first run | replicate | mean of the two |", "|---|---|---|---|---|"]
    t = result["standings"]
    for opp in ("prodigy_best", "random_best", "prodigy_final", "folk_final", "folk_best"):
        for where in ("validation", "unseen"):
            cells = []
            for name in ("first", "replicate", "mean_of_two"):
                w = t[name].get(where, {}).get(f"vs_{opp}")
                cells.append("-" if not w or not w["n"] else
                             f"{w['win']} / {w['tie']} / {w['loss']} ({100.0 * w['win'] / w['n']:.0f} % better)")
            lines.append(f"| {opp} | {where} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.replicates", description=__doc__.split("\n\n")[0])
    p.add_argument("--first", type=results_file, nargs="+", required=True, help="bench.versus results: the first runs")
    p.add_argument("--second", type=results_file, nargs="+", required=True,
                   help="bench.versus results of the same cases with another --training-seed")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    first, second = load_cases(args.first), load_cases(args.second)
    missing = [k for k in second if k not in first]
    if missing:
        raise SystemExit(f"--first has no run of {len(missing)} of the replicate's cases (the first: {missing[0]}); "
                         "give the results the replicate re-ran")
    seeds = {case_training_seed(c) for c in second.values()} & {case_training_seed(c) for c in first.values()}
    if seeds:
        raise SystemExit(f"the replicate ran with the first runs' training seed ({sorted(seeds)}): it is the same "
                         "run again, not a replicate; run bench.versus with another --training-seed")
    pairs = paired(first, second)
    result = {"benchmark": "replicates", "first": [str(x) for x in args.first], "second": [str(x) for x in args.second],
              "changes": arm_changes(pairs), "standings": read_together(pairs)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
