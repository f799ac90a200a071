"""Timesteps probe (issue 34, item 4): does a less noisy validation loss make (a)'s choices better on unseen images?

Every choice (a) makes is read off the validation loss of the split's validation images: the range test's bounds,
the halving between lr_mid and lr_high, the step window's pick and whether its average is delivered. On the bench's
20-image cases that is 4 images x `validation.timesteps` (4) fixed draws of timestep and noise: 16 pairs. The same 4
images measured with other draws moved the base model's loss by 0.6-3.4 % (shapes and stripes, seed 14), more than
the 1 % tie band. bench.unseen scores every arm on 20 images no arm chose on, so whether (a) chooses better with a
steadier loss can be measured there, against the same arms.

Per case the probe rebuilds a saved bench.versus case run with `--unseen-images` and runs (a) as shipped but with
`validation.timesteps` K (16: four times the draws per image, each validation four times the cost), every checkpoint
kept; then measures its delivered weights with the case's own validation settings (4 timesteps) on the case's
validation images and on the same unseen images (bench.unseen), and weighs them against the saved arms' losses.

Written down (committed) 2026-11-27 19:36 UTC before any run of this probe, after 6 of the 30 cases below had been
read (their standings on validation and unseen images; no run of this probe):
- The cases: the 30 of bench/results/versus_unseen_seed14.json and versus_unseen_seed15.json (full, LoRA and textual
  inversion, the five kinds), in the files' order, two processes side by side.
- `validation.timesteps: 16` is a candidate for the default if, over those cases, on the unseen images: (1) it turns
  at least 3 of (a)'s non-wins against Prodigy's best or random search's best into wins, and (2) it turns at most 1 of
  (a)'s wins against those into a non-win. Then it is confirmed on fresh seeds before it becomes the default (not in
  this session). Otherwise the default stays 4. Reported as it comes out either way, with the cost in seconds.
  A case where (a) fails at K counts as a loss against every arm, as in bench.versus. The probe runs once seeds 14-17
  of bench.versus are done or stopped (21:05 UTC at the latest); cases it has not reached by 21:30 UTC are said to be
  missing and the rule is read over those that ran, in the order above.

Its result (20:25-20:38 UTC, all 30 cases): the rule was met, 4 non-wins turned into wins and no win lost (2 ties
became losses, which the rule did not count); the cost, 1.52x (a)'s seconds at the median. The confirmation,
written down (committed) 2026-11-27 20:39 UTC before any run of it: the same probe, K 16, on the 30 cases of
bench/results/versus_unseen_seed16.json and versus_unseen_seed17.json (run as shipped after the rule above was
written, and not used for it), two processes side by side; the same two conditions, and (3) no more ties or wins
turned into losses than losses turned into ties or wins, against those two arms. If all three hold, the default
becomes 16 in a later session that also weighs validation's cost on a GPU (bench.validation_overhead; four times the
draws are four times validation's forward passes); if not, it stays 4. Reported as it comes out.
Its result (20:39-20:52 UTC, all 30 cases): all three held (4 non-wins turned into wins, no win lost, nothing turned
into a loss, 4 losses turned into ties or wins), at 1.41x (a)'s seconds; bench/RESULTS.md, "A steadier validation
loss".
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from bench.common import add_probe_arguments, family_of_case, quiet_libraries, run_probe
from bench.discovery_quality import discover, set_up_case
from bench.unseen import score_unseen
from bench.versus import case_overrides, keeping_every_checkpoint, verdict_of

NAME = "timesteps_probe"
OPPONENTS = ("prodigy_best", "random_best", "prodigy_final", "folk_final", "folk_best")
DEFAULT_TIMESTEPS = 16


def probe_case(c: dict[str, Any], work: Path, log=print, timesteps: int = DEFAULT_TIMESTEPS) -> dict[str, Any]:
    from rangefinder.data.synthetic import make_synthetic_dataset

    s, u = c["summary"], c["unseen"]
    tag = f"[{c['method']} {c['kind']} seed {c['seed']}]"
    case = work / f"{c['method']}-{c['kind']}-seed{c['seed']}"
    dataset = case / "dataset"
    make_synthetic_dataset(dataset, kind=c["kind"], count=c["images"], seed=c["seed"], resolution=32)
    args = SimpleNamespace(finetune_epochs=c["finetune_epochs"], smoke=False, soup_tries=0)
    cfg, split_dir = set_up_case(dataset, c["seed"], work, case, case_overrides(c["method"], args, family_of_case(c)))
    steadier = cfg.model_copy(update={"validation": cfg.validation.model_copy(update={"timesteps": timesteps})})
    t0 = time.perf_counter()
    with keeping_every_checkpoint():
        a = discover(steadier, split_dir, case / "rangefinder")
    seconds = time.perf_counter() - t0
    # (a) alone: the other arms are the saved case's, their weights gone; bench.unseen says so for each.
    none = {"updates": 0, "seconds": 0.0, "best_val_loss": None, "final_val_loss": None, "curve": []}
    alone = {**{k: c[k] for k in ("method", "kind", "seed", "images")}, "rangefinder": a, "prodigy": none,
             "folk": none, "random": {"runs": [], "updates": 0, "seconds": 0.0},
             # what (a) recorded, on its own K-timestep loss: "reproduces" only where K is the arms' 4
             "summary": {"rangefinder": (a.get("chosen") or {}).get("val_loss", a.get("final_val_loss"))}}
    scored = score_unseen(cfg, alone, case, split_dir, u["images"], log)["arms"]["rangefinder"]
    shutil.rmtree(case, ignore_errors=True)
    row: dict[str, Any] = {k: c[k] for k in ("method", "kind", "seed", "held_out")}
    row.update(family=family_of_case(c), timesteps=timesteps, status=a["status"], error=a.get("error"),
               lr_used=a.get("lr_used"),
               saved_lr_used=c["rangefinder"].get("lr_used"), rule=(a.get("chosen") or {}).get("rule"),
               seconds=seconds, saved_seconds=c["rangefinder"]["seconds"],
               # (a)'s own validation loss with K timesteps, and its weights measured as the arms were (4 timesteps)
               val_loss_k=(a.get("chosen") or {}).get("val_loss"), val_loss=scored.get("val_loss"),
               unseen_loss=scored.get("unseen_loss"), saved_val_loss=s["rangefinder"],
               saved_unseen_loss=s.get("unseen_rangefinder"))
    for opp in OPPONENTS:
        theirs_val, theirs_unseen = s.get(opp), s.get(f"unseen_{opp}")
        row[f"vs_{opp}"] = verdict_of(row["val_loss"], theirs_val)
        row[f"saved_vs_{opp}"] = s.get(f"vs_{opp}")
        row[f"unseen_vs_{opp}"] = verdict_of(row["unseen_loss"], theirs_unseen)
        row[f"saved_unseen_vs_{opp}"] = s.get(f"unseen_vs_{opp}")
    log(f"{tag} K={timesteps}: lr {row['lr_used']} (saved {row['saved_lr_used']}), unseen {row['unseen_loss']} "
        f"(saved {row['saved_unseen_loss']}); unseen vs Prodigy best {row['unseen_vs_prodigy_best']} (was "
        f"{row['saved_unseen_vs_prodigy_best']}), vs random {row['unseen_vs_random_best']} (was "
        f"{row['saved_unseen_vs_random_best']}), {seconds:.0f} s (saved {row['saved_seconds']:.0f} s)")
    return row


def tally(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"cases": len(rows)}
    for where in ("unseen_", ""):
        for opp in OPPONENTS:
            now = [r[f"{where}vs_{opp}"] for r in rows if r.get(f"{where}vs_{opp}")]
            was = [r[f"saved_{where}vs_{opp}"] for r in rows if r.get(f"saved_{where}vs_{opp}")]
            out[f"{where}vs_{opp}"] = {k: now.count(k) for k in ("win", "tie", "loss")}
            out[f"saved_{where}vs_{opp}"] = {k: was.count(k) for k in ("win", "tie", "loss")}
    key = ("prodigy_best", "random_best")
    out["unseen_non_wins_turned_into_wins"] = sum(
        1 for r in rows if any(r[f"saved_unseen_vs_{o}"] not in ("win", None) and r[f"unseen_vs_{o}"] == "win"
                               for o in key))
    out["unseen_wins_turned_into_non_wins"] = sum(
        1 for r in rows if any(r[f"saved_unseen_vs_{o}"] == "win" and r[f"unseen_vs_{o}"] not in ("win", None)
                               for o in key))
    out["rule_met"] = out["unseen_non_wins_turned_into_wins"] >= 3 and out["unseen_wins_turned_into_non_wins"] <= 1
    ratios = sorted(r["seconds"] / r["saved_seconds"] for r in rows if r.get("saved_seconds"))
    out["median_seconds_ratio"] = ratios[len(ratios) // 2] if ratios else None
    changes = sorted(100.0 * (r["unseen_loss"] - r["saved_unseen_loss"]) / r["saved_unseen_loss"] for r in rows
                     if r.get("unseen_loss") and r.get("saved_unseen_loss"))
    out["median_unseen_change_pct"] = changes[len(changes) // 2] if changes else None
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.timesteps_probe", description=__doc__.split("\n\n")[0])
    add_probe_arguments(p)
    p.add_argument("--part", default="1/1", help="K/N: every Nth case from the Kth, to run N probes side by side")
    p.add_argument("--timesteps", type=int, default=DEFAULT_TIMESTEPS, help="validation.timesteps in (a)")
    args = p.parse_args(argv)
    quiet_libraries()
    cases = [c for c in json.loads(args.source.read_text())["cases"] if c.get("unseen")]
    k, n = (int(x) for x in args.part.split("/"))
    cases = cases[k - 1::n]

    def probe(c: dict[str, Any], work: Path, log=print) -> dict[str, Any]:
        return probe_case(c, work, log, args.timesteps)

    return run_probe(NAME, args, cases, probe, tally)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

