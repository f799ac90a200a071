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

(a)'s own noise, `--training-seed`. Written down (committed) 2026-11-27 21:29 UTC, before any run of (a) with
another `training.seed`:
- The question: is the Goal's 1 % tie band outside (a)'s own run-to-run noise? (a) re-run with nothing changed but
  `training.seed` (1234 -> 1235: everything its runs draw, the data order, the training timesteps and noise, the
  LoRA and embedding initialisation), weighed against (a) as it was, as if it were an arm.
- The runs, over the 60 cases of seeds 14-17 (`--from bench/results/versus_all_215.json`, whose cases with unseen
  images are exactly those), two processes side by side: (1) `--timesteps 4 --training-seed 1235`, the baseline the
  saved (a); then (2) `--timesteps 16 --training-seed 1235 --against` timesteps_probe.json and
  timesteps_probe_confirm.json, the baseline (a) at K 16 with seed 1234. Cases not reached by 23:40 UTC are said to
  be missing, and the readings are over those that ran.
- The readings: (i) on the validation images (the Goal's measure), (a) is steady at the band if the re-seeded run
  ties the baseline (within 1 %) in at least 80 % of the cases; if not, a single run's verdict is not (a)'s standing
  case by case, and RESULTS says by how many of its verdicts against Prodigy's best and random search's best change
  with the seed alone. (ii) K 16 makes (a) steadier if, on the unseen images, the re-seeded K 16 run changes by more
  than 1 % in fewer cases than the re-seeded K 4 run, with a lower median size of change. Both are reported as they
  come out; neither changes the Goal's standings, which are single runs as the Goal defines them. The arms are not
  re-seeded: their own noise adds to (a)'s, so these counts are a floor for the verdicts' noise.
Correction (2026-11-28): the saved cases did not train with 1234. bench.discovery_quality.set_up_case sets each
case's data seed as its training seed, so "1234" above reads as the case's own seed (14-17); the runs and their
readings are what they were, 1235 against that seed.

Other settings of (a), `--training KEY=VALUE` and `--setting SECTION.KEY=VALUE` (2026-11-28, 2026-11-29): an EMA
of the weights ("An EMA of the weights in (a)") and textual inversion at the range test's lr_low ("Textual
inversion at the range test's lr_low", where the re-run (a) is also given the prompt score, on the case's own
prompts, seeds and sampler settings, and the case is summarized again with it as (a): random search at exactly its
updates included). `--deliver earliest_tied` scores (a)'s earliest checkpoint tied with its pick instead
("Textual inversion's earliest tied checkpoint"). Their rules are in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

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
from bench.replicates import moved, verdicts_changed
from bench.unseen import rangefinder_alone, score_unseen
from bench.versus import (
    OPPONENTS,
    SCORED_ARMS,
    VERDICTS,
    count_verdicts,
    keeping_every_checkpoint,
    rangefinder_weights,
    rebuild_case,
    score_prompts,
    summarize,
    verdict_of,
)
from rangefinder.config import RangefinderConfig, format_validation_error

NAME = "timesteps_probe"
DEFAULT_TIMESTEPS = 16
LOSSES = {"": "val_loss", "unseen_": "unseen_loss"}  # the verdicts' prefix -> the loss they weigh, per image set


def probe_case(c: dict[str, Any], work: Path, log=print, timesteps: int = DEFAULT_TIMESTEPS,
               training_seed: Optional[int] = None, against: Optional[dict[str, Any]] = None,
               training: Optional[dict[str, Any]] = None,
               settings: Optional[dict[str, dict[str, Any]]] = None, deliver: str = "as_shipped") -> dict[str, Any]:
    """(a) re-run on a saved case with `validation.timesteps` K and, when given, another `training.seed`, other
    `training` settings and other settings of any section (`settings`: section -> {key: value}), validated as a
    config would be; scored as the arms were, which keep theirs: on the validation and unseen images, and with the
    prompt score where the case measured one (the case's prompts and seeds). `against`: the probe row (of another
    run of this probe) (a) is weighed against as its baseline (`base_*`), else the saved case's (a). `deliver`:
    "earliest_tied" scores (a)'s earliest checkpoint tied with its pick (`earliest_tied`) instead of the pick."""

    s, u = c["summary"], c.get("unseen")
    tag = f"[{c['method']} {c['kind']} seed {c['seed']}]"
    case, cfg, split_dir = rebuild_case(c, work)
    update: dict[str, Any] = {"validation": cfg.validation.model_copy(update={"timesteps": timesteps})}
    trained = {**(training or {}), **({} if training_seed is None else {"seed": training_seed})}
    if trained:
        update["training"] = type(cfg.training).model_validate({**cfg.training.model_dump(), **trained})
    for section, values in (settings or {}).items():
        current = update.get(section) or getattr(cfg, section)
        update[section] = type(current).model_validate({**current.model_dump(), **values})
    steadier = cfg.model_copy(update=update)
    t0 = time.perf_counter()
    with keeping_every_checkpoint():
        a = discover(steadier, split_dir, case / "rangefinder")
    seconds = time.perf_counter() - t0
    if deliver == "earliest_tied":
        a = earliest_tied(a)
    alone = {**{k: c[k] for k in ("method", "kind", "seed", "images")}, **rangefinder_alone(a),
             # what (a) recorded, on its own K-timestep loss: "reproduces" only where K is the arms' 4
             "summary": {"rangefinder": (a.get("chosen") or {}).get("val_loss", a.get("final_val_loss"))}}
    # A case with no unseen images (--every-case): (a)'s weights as it measured them, the arms' 4 timesteps.
    scored = score_unseen(cfg, alone, case, split_dir, u["images"], log)["arms"]["rangefinder"] if u else \
        {"val_loss": alone["summary"]["rangefinder"]}
    prompts = score_prompts_again(c, cfg, a, case, log)
    shutil.rmtree(case, ignore_errors=True)
    row: dict[str, Any] = {k: c[k] for k in ("method", "kind", "seed", "held_out")}
    row.update(family=family_of_case(c), timesteps=timesteps, training_seed=steadier.training.seed,
               training_settings=training or {}, settings=settings or {}, deliver=deliver,
               status=a["status"], error=a.get("error"),
               lr_used=a.get("lr_used"),
               saved_lr_used=c["rangefinder"].get("lr_used"), rule=(a.get("chosen") or {}).get("rule"),
               seconds=seconds, saved_seconds=c["rangefinder"]["seconds"],
               # (a)'s own validation loss with K timesteps, and its weights measured as the arms were (4 timesteps)
               val_loss_k=(a.get("chosen") or {}).get("val_loss"), val_loss=scored.get("val_loss"),
               unseen_loss=scored.get("unseen_loss"), saved_val_loss=s["rangefinder"],
               saved_unseen_loss=s.get("unseen_rangefinder"))
    for opp in OPPONENTS:
        theirs_val, theirs_unseen = s.get(opp), (s.get(f"unseen_{opp}") if u else None)
        row[f"vs_{opp}"] = verdict_of(row["val_loss"], theirs_val)
        row[f"saved_vs_{opp}"] = s.get(f"vs_{opp}")
        row[f"unseen_vs_{opp}"] = verdict_of(row["unseen_loss"], theirs_unseen)
        row[f"saved_unseen_vs_{opp}"] = s.get(f"unseen_vs_{opp}")
    # The case as if this (a) had been its (a): every verdict as bench.versus gives it, random search at exactly this
    # (a)'s updates and the prompt score's (a) included.
    variant = {**c, "rangefinder": a}
    if u:
        variant["unseen"] = {**u, "arms": {**u["arms"], "rangefinder": scored}}
    if prompts is not None:
        ps = c["prompt_score"]
        variant["prompt_score"] = {**ps, "arms": {**ps["arms"], "rangefinder": prompts["arms"]["rangefinder"]}}
        row.update(prompt_reproduces=prompts["reproduces"], summary_prompt={
                       k: v for k, v in s.items() if k.startswith("prompt_") and isinstance(v, float)},
                   **{f"prompt_{w}": prompts["arms"]["rangefinder"].get(w) for w in ("colour", "shape")})
    row["variant_summary"] = summarize(variant)
    row["saved_vs_random_equal"] = s.get("vs_random_equal")
    # The baseline (a) this run is weighed against as a run of the same method: its own noise when only the seed
    # differs. Its losses and its verdicts against the arms, on both image sets.
    base = against or {"val_loss": row["saved_val_loss"], "unseen_loss": row["saved_unseen_loss"],
                       **{f"{w}vs_{o}": row[f"saved_{w}vs_{o}"] for w in LOSSES for o in OPPONENTS}}
    for w, loss in LOSSES.items():
        mine, theirs = row[loss], base.get(loss)
        row[f"base_{loss}"] = theirs
        row[f"{w}self_vs_base"] = verdict_of(mine, theirs)
        row[f"{w}self_change_pct"] = gap_pct(mine, theirs)
        for opp in OPPONENTS:
            row[f"base_{w}vs_{opp}"] = base.get(f"{w}vs_{opp}")
    log(f"{tag} K={timesteps}: lr {row['lr_used']} (saved {row['saved_lr_used']}), unseen {row['unseen_loss']} "
        f"(saved {row['saved_unseen_loss']}); unseen vs Prodigy best {row['unseen_vs_prodigy_best']} (was "
        f"{row['saved_unseen_vs_prodigy_best']}), vs random {row['unseen_vs_random_best']} (was "
        f"{row['saved_unseen_vs_random_best']}), {seconds:.0f} s (saved {row['saved_seconds']:.0f} s)")
    return row


def earliest_tied(a: dict[str, Any]) -> dict[str, Any]:
    """(a) as if it delivered its fine-tune's earliest checkpoint whose validation loss is within the Goal's tie band
    (TIE_PCT) of what it delivers (its pick: the window's lowest checkpoint or their average): among the checkpoints
    the validation loss cannot tell apart, the one that moved least from the base. The engine's own picker
    (`finetune.deliver: earliest_tied`, rangefinder.analysis.earliest_tied) on the saved curve, whose every update is
    a checkpoint in bench.versus. Its pick is kept under "chosen" as "shipped_pick". A failed (a), or one with no
    checkpoint in the band, is returned as it is."""
    from rangefinder.analysis import earliest_tied as engine_earliest_tied

    chosen = a.get("chosen") or {}
    pick = chosen.get("val_loss", a.get("final_val_loss"))
    if a.get("status") != "ok" or pick is None:
        return a
    updates, losses = [u for u, _ in a["curve"]], [v for _, v in a["curve"]]
    tied = engine_earliest_tied(updates, updates, losses, pick)
    if tied is None:  # a window average more than the band below every checkpoint: the pick stays
        return a
    shipped_pick = {**{k: chosen.get(k) for k in ("update", "val_loss", "rule")}, "val_loss": pick}
    return {**a, "chosen": {**chosen, "update": tied.update, "val_loss": tied.val_loss, "rule": "earliest_tied",
                            "shipped_pick": shipped_pick}}


def score_prompts_again(c: dict[str, Any], cfg, a: dict[str, Any], case: Path, log=print) -> Optional[dict[str, Any]]:
    """The prompt score of the re-run (a)'s delivered weights, on the case's own prompts, seeds and sampler settings
    (as recorded: a rebuilt case's config need not hold the ones it rendered with), with the base model (and, for
    textual inversion, its "TI start") rendered again beside it: "reproduces" says whether those scored exactly as
    the case recorded them, so that the re-run (a) can be read against the case's arms. None where the case measured
    no prompt score."""
    saved = c.get("prompt_score") or {}
    if not saved.get("arms"):
        return None
    sampler = {"num_inference_steps": saved["steps"], "guidance_scale": saved["guidance_scale"],
               "scheduler": saved["scheduler"], "resolution": saved["resolution"]}
    cfg = cfg.model_copy(update={"sampling": cfg.sampling.model_copy(update=sampler)})
    again = score_prompts(cfg, c, case, log, tuple(saved["seeds"]),
                          weights={"rangefinder": rangefinder_weights(a, case / "rangefinder")})
    if again is None or "colour" not in again["arms"].get("rangefinder", {}):
        return None
    refs = [arm for arm in ("base", "base_ti_start") if arm in saved["arms"]]
    again["reproduces"] = again["prompts"] == saved["prompts"] and all(
        again["arms"].get(arm, {}).get(w) == saved["arms"][arm].get(w) for arm in refs for w in ("colour", "shape"))
    return again


def prompt_tally(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """On the prompt score (where measured and reproduced): the re-run (a)'s colour and shape scores against each
    scored arm's and the saved (a)'s: in how many cases it scores higher, lower, the same, and the median difference
    (higher is better)."""
    read = [r for r in rows if r.get("prompt_reproduces")]
    out: dict[str, Any] = {"prompt_cases": len(read),
                           "prompt_not_reproduced": sum(1 for r in rows if r.get("prompt_reproduces") is False)}
    for w in ("shape", "colour"):
        for arm in SCORED_ARMS:
            diffs = [r[f"prompt_{w}"] - r["summary_prompt"][f"prompt_{w}_{arm}"] for r in read
                     if r["summary_prompt"].get(f"prompt_{w}_{arm}") is not None]
            name = "saved_rangefinder" if arm == "rangefinder" else arm
            out[f"prompt_{w}_vs_{name}"] = {
                "higher": sum(d > 0 for d in diffs), "lower": sum(d < 0 for d in diffs),
                "same": sum(d == 0 for d in diffs),
                "median_difference": statistics.median(diffs) if diffs else None}
    return out


def tally(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"cases": len(rows)}
    for where in ("unseen_", ""):
        for opp in OPPONENTS:
            now = [r[f"{where}vs_{opp}"] for r in rows if r.get(f"{where}vs_{opp}")]
            was = [r[f"saved_{where}vs_{opp}"] for r in rows if r.get(f"saved_{where}vs_{opp}")]
            out[f"{where}vs_{opp}"] = count_verdicts(now)
            out[f"saved_{where}vs_{opp}"] = count_verdicts(was)
    key = ("prodigy_best", "random_best")
    out["unseen_non_wins_turned_into_wins"] = sum(
        1 for r in rows if any(r[f"saved_unseen_vs_{o}"] not in ("win", None) and r[f"unseen_vs_{o}"] == "win"
                               for o in key))
    out["unseen_wins_turned_into_non_wins"] = sum(
        1 for r in rows if any(r[f"saved_unseen_vs_{o}"] == "win" and r[f"unseen_vs_{o}"] not in ("win", None)
                               for o in key))
    out["rule_met"] = out["unseen_non_wins_turned_into_wins"] >= 3 and out["unseen_wins_turned_into_non_wins"] <= 1
    ratios = [r["seconds"] / r["saved_seconds"] for r in rows if r.get("saved_seconds")]
    out["median_seconds_ratio"] = statistics.median(ratios) if ratios else None
    changes = [gap_pct(r["unseen_loss"], r["saved_unseen_loss"]) for r in rows
               if r.get("unseen_loss") and r.get("saved_unseen_loss")]
    out["median_unseen_change_pct"] = statistics.median(changes) if changes else None
    out.update(against_the_baseline(rows))
    variants = [r["variant_summary"] for r in rows if r.get("variant_summary")]
    out["vs_random_equal"] = count_verdicts([v["vs_random_equal"] for v in variants if v.get("vs_random_equal")])
    out["saved_vs_random_equal"] = count_verdicts([r["saved_vs_random_equal"] for r in rows
                                                   if r.get("variant_summary") and r.get("saved_vs_random_equal")])
    out.update(prompt_tally(rows))
    return out


def against_the_baseline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """(a) against its baseline run (the saved (a), or `--against`'s): on each image set, its verdicts against that
    run as if it were an arm (win / tie / loss beyond the 1 % band), the median and largest size of the change, and
    how many of the baseline's verdicts against Prodigy's best and random search's best came out otherwise. When
    the two runs differ only in `training.seed`, this is (a)'s own run-to-run noise, read with the Goal's band."""
    out: dict[str, Any] = {}
    for w, loss in LOSSES.items():
        m = moved([(r.get(f"base_{loss}"), r.get(loss)) for r in rows])
        if not m["n"]:
            continue
        out[f"{w}self_vs_base"] = {k: m[k] for k in VERDICTS}
        out[f"{w}self_median_abs_change_pct"] = m["median_abs_change_pct"]
        out[f"{w}self_largest_abs_change_pct"] = m["largest_abs_change_pct"]
        for opp in ("prodigy_best", "random_best"):
            pairs = [(r.get(f"base_{w}vs_{opp}"), r.get(f"{w}vs_{opp}")) for r in rows]
            base = [b for b, n in pairs if b and n]
            out[f"{w}verdicts_changed_vs_{opp}"] = {**verdicts_changed(pairs),
                                                      "base": count_verdicts(base)}
    return out


def parse_settings(p: argparse.ArgumentParser, training: list[str], setting: list[str]) -> dict[str, dict[str, Any]]:
    """(a)'s settings from --training KEY=VALUE and --setting SECTION.KEY=VALUE (any section but `training`), as
    section -> {key: value}, each value read as JSON and each section validated as a config would be (a typo or an
    impossible value is said now, not after the first case is rebuilt)."""
    sections = {name: f.annotation for name, f in RangefinderConfig.model_fields.items()
                if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}
    # (flag, the item as given, section, KEY=VALUE, an example of the flag's form)
    given = [("--training ", item, "training", item, "adam_beta2=0.99") for item in training]
    for item in setting:
        section, _, rest = item.partition(".")
        if section not in sections or section == "training" or not rest.partition("=")[0]:
            p.error(f"--setting {item!r}: write SECTION.KEY=VALUE, SECTION one of "
                    f"{', '.join(n for n in sections if n != 'training')} (a `training` setting goes in --training)")
        given.append(("--setting ", item, section, rest, "finetune.successive_halving=false"))
    settings: dict[str, dict[str, Any]] = {}
    flag_of: dict[str, str] = {}
    for flag, item, section, pair, example in given:
        key, _, value = pair.partition("=")
        try:  # no "=" leaves value "", which is not JSON either
            settings.setdefault(section, {})[key] = json.loads(value)
        except json.JSONDecodeError:
            p.error(f"{flag}{item!r}: write KEY=VALUE with a JSON value, e.g. {example}")
        flag_of[section] = flag if section == "training" else f"{flag}{section}."
    for section, values in settings.items():
        try:
            sections[section].model_validate({**sections[section]().model_dump(), **values})
        except ValidationError as e:
            p.error(format_validation_error(e, flag_of[section]))
    return settings


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.timesteps_probe", description=__doc__.split("\n\n")[0])
    add_probe_arguments(p)
    p.add_argument("--part", type=part_spec, default="1/1",
                   help="K/N: every Nth case from the Kth, to run N probes side by side")
    p.add_argument("--timesteps", type=int, default=DEFAULT_TIMESTEPS, help="validation.timesteps in (a)")
    p.add_argument("--training-seed", type=int, help="training.seed in (a) (as saved when left out): its own noise")
    p.add_argument("--training", action="append", default=[], metavar="KEY=VALUE",
                   help="a `training` setting of (a) only, its value read as JSON (e.g. adam_beta2=0.99); repeatable")
    p.add_argument("--setting", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a setting of (a) only in another section than `training`, its value read as JSON (e.g. "
                   "finetune.successive_halving=false); repeatable")
    p.add_argument("--deliver", choices=("as_shipped", "earliest_tied"), default="as_shipped",
                   help="which of (a)'s weights are scored: its pick, as shipped, or its earliest checkpoint within "
                   "the 1 %% tie band of the pick (every checkpoint is kept while (a) trains)")
    p.add_argument("--every-case", action="store_true",
                   help="every case of --from, those scored on no unseen images too (at --timesteps 4, the arms': "
                   "(a)'s weights are then read as it measured them); without it, only cases with unseen images")
    p.add_argument("--methods", type=lambda v: v.split(","), metavar="M1,M2",
                   help="only the cases of these methods of --from (all when left out)")
    p.add_argument("--seeds", type=lambda v: [int(x) for x in v.split(",")], metavar="S1,S2",
                   help="only the cases of these seeds of --from (all when left out)")
    p.add_argument("--against", type=results_file, nargs="+",
                   help="results of this probe whose (a) is the baseline, case "
                   "by case (as saved when left out)")
    args = p.parse_args(argv)
    settings = parse_settings(p, args.training, args.setting)
    training = settings.pop("training", {})
    if args.every_case and args.timesteps != 4:
        p.error("--every-case reads (a)'s own validation loss where a case has no unseen images, which is the arms' "
                "measure only at --timesteps 4")
    quiet_libraries()
    cases = [c for c in json.loads(args.source.read_text())["cases"] if (args.every_case or c.get("unseen"))
             and (args.methods is None or c["method"] in args.methods)
             and (args.seeds is None or c["seed"] in args.seeds)]
    k, n = args.part
    cases = cases[k - 1::n]

    baselines = None if not args.against else {
        case_key(r): r for f in args.against for r in json.loads(f.read_text())["cases"]}
    missing = [case_key(c) for c in cases if baselines is not None and case_key(c) not in baselines]
    if missing:
        raise SystemExit(f"--against has no row for {len(missing)} of the cases (the first: {missing[0]}); give "
                         "results of this probe over the same --from file")

    def probe(c: dict[str, Any], work: Path, log=print) -> dict[str, Any]:
        against = None if baselines is None else baselines[case_key(c)]
        return probe_case(c, work, log, args.timesteps, args.training_seed, against, training, settings, args.deliver)

    return run_probe(NAME, args, cases, probe, tally)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)

