"""Average probe (issue 34, item 4): does averaging the step window's checkpoints turn (a)'s ties into wins?

Over bench.versus's 70 SD 1.x cases (bench/results/versus_all_70.json) rangefinder is as good as Prodigy's best
checkpoint in 81 % but better in only 40 %, and better than random search in only 60 %. Most of the non-wins are
ties: 29 of 42 against Prodigy's best (21 of them with (a) 0-1 % lower), 23 of 28 against random search. Two fixes
aimed at where (a) trains (a decayed end, a capped zoom) changed no verdict on fresh cases. This one changes what
(a) delivers from the same run: inside the step window a constant-LR run wanders along its valley's floor, and the
uniform average of the window's checkpoints cancels part of that noise (SWA, Izmailov et al. 2018; latest weight
averaging, Kaddour 2022; Hägele et al. 2024 find it closes much of what a cooldown closes). It trains nothing and
has no setting: the window says which checkpoints. Built as shipped: `finetune.average: on`
(rangefinder.steps.average; off by default until this probe says otherwise). The average is delivered only when it
measures below the window's pick, on the same validation loss every arm is scored by, so it can turn a tie or a loss
into a win and never a win into less; what is measured is how often, and by how much.

Per case the probe rebuilds the saved bench.versus case exactly and runs the fine-tune step as shipped with the saved
(a)'s bounds (successive halving as before, the cooldown off as the saved (a) had none) and finetune.average on. The
window's pick must reproduce the saved (a)'s delivered loss (checked per case: a rebuild check); the delivered loss
is then weighed against the saved arms.

Written down (committed) before any run of this probe; no case has been run with an average before:
- The cases: the 55 of the 70 where (a) did not beat both Prodigy's best and random search's best (the other 15 are
  wins against both already, and the average cannot change that), in the file's order. They were run before, but
  the rule has no parameter to fit on them, and none was fitted.
- `finetune.average` becomes the default (on, for every method) if, over the cases probed:
  1. the window's pick reproduces the saved (a)'s loss (within 1e-6 relative) in every case (a case that does not
     is reported and left out);
  2. the average is delivered in at least half of the cases where it applies (2 or more checkpoints in the window);
  3. it turns at least 5 of (a)'s non-wins against Prodigy's best or random search's best into wins.
  Otherwise it stays off. The Goal's standings over the 70 (the probe's verdicts where it ran, the saved ones where
  it did not, which are wins against both) are reported as they come out either way. If the session ends before all
  55 ran, the rule is read over those that did, in the order above, and the note says how many.

    python -m bench.average_probe --from bench/results/versus_all_70.json --out bench/results/average_probe.json

The flow-matching families, written down (committed) after the rule above was met and its seed-7 confirmation ran,
before any run of these: the same selection (cases not won against both Prodigy's best and random search's best) of
the 20 saved seed-3 cases (`--family sd3 --from bench/results/versus_flow_sd3_seed3.json`, and flux), to say what
(a) as shipped now delivers there. The rule above is not re-read on them; the numbers are reported as they come out.
The greedy soup (`--soup`), written down (committed) on 2026-11-27 at 17:05 UTC, before it was built and before any
run of it. Over the 95 SD 1.x cases with the uniform average (bench/results/versus_all_95.json) (a) is better than
Prodigy's best in 52 %, but in 44 % on the 25 fresh cases of seeds 7 and 8, and beats random search in 62 %; the
uniform average was delivered in none of textual inversion's cases and in no case whose window held many
checkpoints, where the early ones pull it up. The candidate is the greedy soup of Wortsman et al. 2022 ("Model
soups"), over the same checkpoints: start from the window's pick, try the window's other checkpoints in order of
their validation loss (the curve's, already measured), and keep each one whose addition lowers the soup's
validation loss, at most `finetune.soup_tries` tries (8 here). (a) then delivers the lowest of the pick, the uniform
average and the soup, each only when lower than what it replaces. Like every "best by validation" arm it picks on
the images that score it; it makes at most 8 more measurements, where Prodigy's and random search's best are the
lowest of about 40 and 80.
- The cases: (1) the 64 of the 95 where (a) as shipped did not beat both Prodigy's best and random search's best, in
  the file's order, rebuilt and re-run by this probe with `--soup`; (2) then fresh seed 9, which no bench has run:
  `python -m bench.versus` with the soup on in (a), full, LoRA and textual inversion, the five kinds, `--no-grid`,
  each case recording what (a) would have delivered without the soup.
- `finetune.soup_tries` becomes 8 by default if:
  1. the rebuild holds: the window's pick reproduces the saved pick and the uniform average the saved average (where
     one was measured), within 1e-6 relative, in every probed case (a case that does not is reported and left out);
  2. over the saved cases the soup turns at least 5 of (a)'s non-wins against Prodigy's best or random search's best
     into wins;
  3. on fresh seed 9 it turns at least 2 of (a)-without-the-soup's non-wins against those into wins.
  Otherwise it stays 0 (off). The soup cannot lower a verdict (it is delivered only when lower). The standings are
  reported as they come out either way; if the session ends before all cases ran, the rule is read over those that
  did, in the order above, and the note says how many.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import add_probe_arguments, family_of_case, median_of, part_spec, quiet_libraries, run_probe
from bench.versus import OPPONENTS, count_verdicts, plain_finetune, rebuild_case, verdict_of, verdict_rank, without_soup

NAME = "average_probe"


def candidate(c: dict[str, Any]) -> bool:
    """A case whose (a) did not beat both Prodigy's best and random search's best."""
    s = c["summary"]
    return c["rangefinder"].get("status") == "ok" and not (
        s.get("vs_prodigy_best") == "win" and s.get("vs_random_best") == "win")


def probe_case(c: dict[str, Any], work: Path, log=print, soup_tries: int = 0) -> dict[str, Any]:
    from rangefinder.steps.finetune import run_finetune

    a, s = c["rangefinder"], c["summary"]
    tag = f"[{c['method']} {c['kind']} seed {c['seed']}]"
    case, cfg, split_dir = rebuild_case(c, work)
    cfg = plain_finetune(cfg)
    cfg = cfg.model_copy(update={"finetune": cfg.finetune.model_copy(update={"average": "on",
                                                                             "soup_tries": soup_tries})})
    t0 = time.perf_counter()
    ft = run_finetune(cfg, split_dir=split_dir, lr_low=a["lr_low"], lr_high=a["lr_high"], lr_mid=a["lr_mid"],
                      lr_source=a.get("lr_source", "range-test"), model_dir=case / "finetune")
    seconds = time.perf_counter() - t0
    chosen = ft.chosen or {}
    average = chosen.get("average") or {}
    delivered: Optional[float] = chosen.get("val_loss")
    pick = average.get("pick_val_loss", delivered)
    shutil.rmtree(case, ignore_errors=True)
    row: dict[str, Any] = {k: c[k] for k in ("method", "kind", "seed", "held_out")}
    row["family"] = family_of_case(c)
    # The saved pick: the window's, where the saved (a) (or the average probe that rescored it) delivered more.
    saved_pick = s.get("rangefinder_window_pick", s["rangefinder"])
    row.update(lr_used=ft.lr, saved_lr_used=a["lr_used"], pick=pick, saved=saved_pick,
               reproduces=_same(pick, saved_pick))
    if soup_tries:
        # The uniform average must measure what it measured before (where it was measured): a rebuild check too.
        uniform = average.get("uniform_val_loss")
        saved_uniform = s.get("rangefinder_average")
        without = without_soup(chosen, delivered)
        row.update(how=average.get("how"), uniform_val_loss=uniform, saved_uniform=saved_uniform,
                   soup_tries=average.get("soup_tries"),
                   reproduces=row["reproduces"] and (saved_uniform is None or _same(uniform, saved_uniform)),
                   without_soup=without)
        for opp in OPPONENTS:
            row[f"saved_vs_{opp}"] = verdict_of(without, s.get(opp))  # (a) as shipped: the uniform average
    row.update(
               applies=bool(average), averaged_updates=average.get("updates"), average_val_loss=average.get("val_loss"),
               average_delivered=average.get("delivered"), delivered=delivered, rule=chosen.get("rule"),
               seconds=seconds, gain_pct=(100.0 * (delivered - pick) / pick if delivered and pick else None))
    for opp in OPPONENTS:
        row[opp] = s.get(opp)
        row[f"vs_{opp}"] = verdict_of(delivered, s.get(opp))
        row.setdefault(f"saved_vs_{opp}", s.get(f"vs_{opp}"))
    log(f"{tag} pick {pick} (saved {s['rangefinder']}, {'same' if row['reproduces'] else 'DIFFERENT'}); average of "
        f"{len(average.get('updates') or [])} checkpoints: {average.get('val_loss')} "
        f"({'delivered' if average.get('delivered') else 'not delivered'}); vs Prodigy best {row['vs_prodigy_best']} "
        f"(was {row['saved_vs_prodigy_best']}), vs random {row['vs_random_best']} (was {row['saved_vs_random_best']}), "
        f"{seconds:.0f} s" + (f"; {average.get('how')} ({average.get('soup_tries')} soup tries), without the soup "
                              f"{row['without_soup']}" if soup_tries else ""))
    return row


def _same(mine: Optional[float], saved: Optional[float]) -> bool:
    return mine is not None and saved is not None and abs(mine - saved) <= 1e-6 * abs(saved)


def tally(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["reproduces"]]
    applies = [r for r in ok if r["applies"]]
    delivered = [r for r in applies if r["average_delivered"]]
    out: dict[str, Any] = {"cases": len(rows), "reproduced": len(ok), "applies": len(applies),
                           "delivered": len(delivered),
                           "median_gain_pct_when_delivered": median_of([r["gain_pct"] for r in delivered])}
    for opp in OPPONENTS:
        now = [r[f"vs_{opp}"] for r in ok if r.get(f"vs_{opp}")]
        was = [r[f"saved_vs_{opp}"] for r in ok if r.get(f"saved_vs_{opp}")]
        out[f"vs_{opp}"] = count_verdicts(now)
        out[f"saved_vs_{opp}"] = count_verdicts(was)
    turned = sum(1 for r in ok if any(r[f"saved_vs_{o}"] != "win" and r[f"vs_{o}"] == "win"
                                      for o in ("prodigy_best", "random_best")))
    out["non_wins_turned_into_wins"] = turned
    out["worse_than_saved"] = sum(1 for r in ok for o in OPPONENTS
                                  if verdict_rank(r[f"vs_{o}"]) < verdict_rank(r[f"saved_vs_{o}"]))
    out["rule_met"] = 2 * len(delivered) >= len(applies) > 0 and turned >= 5
    if any("how" in r for r in rows):  # --soup: the soup's rule (the docstring's), over the saved cases
        souped = [r for r in ok if r.get("how") == "greedy_soup" and r.get("average_delivered")]
        out["soup_delivered"] = len(souped)
        out["median_soup_gain_pct_when_delivered"] = median_of(
            [100.0 * (r["delivered"] - r["without_soup"]) / r["without_soup"] for r in souped])
        out["rule_met"] = turned >= 5
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.average_probe", description=__doc__.split("\n\n")[0])
    add_probe_arguments(p)
    p.add_argument("--part", type=part_spec, default="1/1",
                   help="K/N: every Nth case from the Kth, to run N probes side by side")
    p.add_argument("--family", default="sd1", help="the saved cases of this family only (sd1, sd3, flux)")
    p.add_argument("--soup", type=int, default=0, metavar="TRIES",
                   help="finetune.soup_tries in the probed fine-tune (the greedy soup; 0: the uniform average only)")
    args = p.parse_args(argv)
    quiet_libraries()
    saved = json.loads(args.source.read_text())
    cases = [c for c in saved["cases"] if family_of_case(c) == args.family and candidate(c)]
    k, n = args.part
    cases = cases[k - 1::n]
    probe = functools.partial(probe_case, soup_tries=args.soup) if args.soup else probe_case
    return run_probe(NAME + ("_soup" if args.soup else ""), args, cases, probe, tally)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
