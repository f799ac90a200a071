"""Random search at exactly (a)'s compute, on the unseen images: its pick scored where the cut changed it.

bench.versus reads random search at exactly (a)'s updates off the saved curves (`random_at_compute`; bench/RESULTS.md,
"Random search at exactly (a)'s compute"). The unseen-image standings (bench.unseen) scored random search's pick with
every run whole, and the weights are gone once a case is scored. Where the cut changes the pick, this probe rebuilds
the saved case (`versus.rebuild_case`), trains again the run the exact pick lies in, whole and with every checkpoint
kept (a cut run is the first part of the whole one: tests/bench/test_versus.py checks it), and measures the
checkpoint at the pick's update on the case's validation images (it must give the pick's loss: then it is the pick)
and on the case's unseen images (bench.unseen.score_unseen). `--report` gives (a)'s unseen standings against random
search at exactly its compute, where every other case keeps its saved unseen score.

    python -m bench.unseen_equal --from bench/results/versus_all_275.json --part 1/2 --out part1.json  # and 2/2
    python -m bench.unseen_equal --report bench/results/versus_all_275.json --probes part1.json part2.json
    python -m bench.unseen_equal --report ... --probes ... --a-from bench/results/timesteps_probe.json  # (a) at K 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from bench.common import add_probe_arguments, case_key, part_spec, results_file, run_probe, write_json
from bench.unseen import rangefinder_alone, reproduces, score_unseen
from bench.versus import (
    count_verdicts,
    keeping_every_checkpoint,
    plain_finetune,
    random_at_compute,
    rebuild_case,
    summarize,
    verdict_of,
)

NAME = "unseen_equal"


def changed_pick(c: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The exact reading's pick where it is not the whole runs' (the run, its update and loss), or None."""
    exact = random_at_compute(c["random"]["runs"], c["rangefinder"]["updates"])
    s = c.get("summary") or summarize(c)
    if exact is None or exact["val_loss"] == s.get("random_best"):
        return None
    return exact


def probe_case(c: dict[str, Any], work: Path, log=print) -> dict[str, Any]:
    """The case's exact pick trained again and measured on its validation and unseen images."""
    from bench.discovery_quality import train_fixed_lr

    pick = changed_pick(c)
    row: dict[str, Any] = {k: c[k] for k in ("method", "kind", "seed")}
    if pick is None:
        return {**row, "absent": "the cut does not change random search's pick"}
    case, cfg, split_dir = rebuild_case(c, work)
    i = pick["run"]
    run = c["random"]["runs"][i]
    with keeping_every_checkpoint():
        again = train_fixed_lr(plain_finetune(cfg), split_dir, run["lr"], case / f"random-{i}")
    # Only random search's pick is scored: every other arm is empty, and score_unseen says so for each.
    runs = [{"best_val_loss": None} for _ in range(i)] + [{**again, "best_update": pick["update"]}]
    probe_c = {**{k: v for k, v in c.items() if k != "reused_arms_from"},
               **rangefinder_alone({"status": "not scored"}),
               "random": {"runs": runs, "updates": again["updates"], "seconds": again["seconds"]},
               "summary": {"random_best": pick["val_loss"]}}
    u = score_unseen(cfg, probe_c, case, split_dir, c["unseen"]["images"], log)
    arm = u["arms"]["random_best"]
    out = {**row, "run": i, "update": pick["update"], "lr": run["lr"], "random_equal": pick["val_loss"],
           "val_loss": arm.get("val_loss"), "reproduces": reproduces(arm.get("val_loss"), pick["val_loss"]),
           "unseen_random_equal": arm.get("unseen_loss"), "seconds": again["seconds"] + u["seconds"]}
    log(f"[{c['method']} {c['kind']} {c['seed']}] run {i} at update {pick['update']}: validation "
        f"{out['val_loss']} (pick {pick['val_loss']}, reproduces {out['reproduces']}), unseen "
        f"{out['unseen_random_equal']}")
    return out


def standings(source: dict[str, Any], probes: list[dict[str, Any]],
              a_rows: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """(a) against random search on the unseen images, at exactly (a)'s compute and with whole runs, over the cases
    that measured them; a case whose exact pick changed is read only where its probe reproduced the pick. With
    `a_rows` (bench.timesteps_probe's cases), (a) is the probe's re-run, over the cases it ran (one that failed: a
    loss, as bench.versus counts it)."""
    got = {case_key(r): r for r in probes if r.get("reproduces")}
    other_a = None if a_rows is None else {case_key(r): r for r in a_rows}
    rows = []
    for c in source["cases"]:
        s = c["summary"]
        if "unseen_images" not in s or (other_a is not None and case_key(c) not in other_a):
            continue
        if other_a is None:
            a = s.get("unseen_rangefinder")
            whole = s.get("unseen_vs_random_best")
        else:
            mine = other_a[case_key(c)]
            a = mine.get("unseen_loss") if mine.get("status") == "ok" else None
            whole = verdict_of(a, s.get("unseen_random_best"))
        pick = changed_pick(c)
        if pick is None:
            equal = s.get("unseen_random_best")
        else:
            probe = got.get(case_key(c))
            equal = probe["unseen_random_equal"] if probe else None
        rows.append({"case": s["case"], "method": c["method"], "changed": pick is not None,
                     "read": pick is None or case_key(c) in got,
                     "unseen_vs_random_equal": verdict_of(a, equal) if equal is not None else None,
                     "unseen_vs_random_best": whole})
    read = [r for r in rows if r["read"]]
    out: dict[str, Any] = {"cases": len(rows), "changed": sum(r["changed"] for r in rows), "read": len(read), "by": {}}
    for name in ("all", "full", "lora", "textual_inversion"):
        rs = [r for r in read if name == "all" or r["method"] == name]
        if rs:
            out["by"][name] = {opp: count_verdicts([r[f"unseen_vs_{opp}"] for r in rs])
                               for opp in ("random_equal", "random_best")}
    out["rows"] = rows
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.unseen_equal", description=__doc__.split("\n\n")[0])
    if argv is None:
        argv = sys.argv[1:]
    if "--report" in argv:
        p.add_argument("--report", type=results_file, required=True, metavar="JSON",
                       help="the bench.versus result probed")
        p.add_argument("--probes", type=results_file, nargs="*", default=[], metavar="JSON")
        p.add_argument("--a-from", type=results_file, nargs="*", metavar="JSON",
                       help="bench.timesteps_probe results: (a) as that probe re-ran it (e.g. validation.timesteps 16)")
        p.add_argument("--out", type=Path)
        args = p.parse_args(argv)
        probes = [r for f in args.probes for r in json.loads(f.read_text())["cases"]]
        a_rows = None if args.a_from is None else [r for f in args.a_from for r in json.loads(f.read_text())["cases"]]
        result = {"benchmark": NAME, "source": str(args.report), "probes": [str(f) for f in args.probes],
                  "a_from": None if args.a_from is None else [str(f) for f in args.a_from],
                  **standings(json.loads(args.report.read_text()), probes, a_rows)}
        print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
        if args.out:
            write_json(args.out, result)
        return result
    add_probe_arguments(p)
    p.add_argument("--part", type=part_spec, default="1/1",
                   help="K/N: every Nth case from the Kth, to run N side by side")
    args = p.parse_args(argv)
    cases = [c for c in json.loads(args.source.read_text())["cases"]
             if "unseen_images" in c["summary"] and changed_pick(c) is not None]
    k, n = args.part
    cases = cases[k - 1::n]

    def tally(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"cases": len(rows), "reproduces": sum(r.get("reproduces") is True for r in rows)}

    return run_probe(NAME, args, cases, probe_case, tally)


if __name__ == "__main__":
    main()
