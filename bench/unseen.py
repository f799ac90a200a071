"""Unseen images: each arm's delivered weights scored on images no arm's rule looked at.

bench.versus scores every arm by the validation loss of the split's validation images, and every arm but the folk
default's final checkpoint also chooses on those images: (a)'s halving and step window, Prodigy's and the folk
default's best checkpoint, random search's best run. With 4 validation images, the lowest of many measured losses
is partly the images' luck, and an arm that picks among more checkpoints (random search: every checkpoint of every
run) gets more of it. `python -m bench.versus --unseen-images N` renders N more images of the case's synthetic kind
and seed (the items after the case's own, `data.synthetic.render_item`: the same subject, glyphs or palette, never
trained on, never measured before), and measures each arm's delivered weights on them with the same deterministic
validation loss (`training.loop.weights_measurer`: validation.py's fixed timesteps and noise). Each delivered set of
weights is also measured again on the case's own validation images: that it reproduces the arm's recorded loss shows
the weights scored are the ones the arm delivered.

Nothing here changes what an arm delivers: the verdicts on unseen images stand beside the validation ones.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any, Optional, Union

# The arms whose delivered weights are scored, as bench.versus names them in a case's summary.
UNSEEN_ARMS = ("rangefinder", "prodigy_best", "prodigy_final", "folk_final", "folk_best", "random_best")
REPRODUCES_REL = 1e-5  # a delivered set's loss measured again on the validation images, against the arm's record


def write_unseen_images(out: Path, kind: str, seed: int, first: int, count: int) -> Path:
    """Images `first` .. `first + count - 1` of the `kind` dataset with `seed` (PNG and caption, as
    make_synthetic_dataset writes them) in `out`."""
    from rangefinder.data.synthetic import render_item

    out.mkdir(parents=True, exist_ok=True)
    for i in range(first, first + count):
        img, caption = render_item(kind, seed, i, 32)
        img.save(out / f"{i:05d}.png", format="PNG")
        (out / f"{i:05d}.txt").write_text(caption + "\n")
    return out


def unseen_split(cfg, images: Path, out: Path):
    """A split whose validation set is `images` (split.val_dir), read back from `out`."""
    from rangefinder.data.split import read_split
    from rangefinder.steps.prepare_dataset import run_prepare_dataset

    split_cfg = cfg.model_copy(update={"split": cfg.split.model_copy(update={"val_dir": str(images)})})
    run_prepare_dataset(split_cfg, out_dir=out)
    return read_split(out)


def delivered_sets(c: dict[str, Any], case: Path) -> dict[str, Union[list[Path], str]]:
    """Per arm, the checkpoints whose trained tensors (averaged, where more than one) are what it delivers, or why
    none: those the prompt score renders (bench.versus.delivered_weights) and the folk default's best; for (a)'s
    window average, which it renders as its chosen/ model, the window's checkpoints its average.json names (every
    checkpoint of (a) is kept while it trains: versus.keeping_every_checkpoint)."""
    from bench.versus import checkpoint_at, delivered_weights

    out: dict[str, Union[Path, list[Path], str]] = dict(delivered_weights(c, case))
    out["folk_best"] = (checkpoint_at(case / "folk", c["folk"].get("best_update"))
                        or "no checkpoint at its update")
    rule = (c["rangefinder"].get("chosen") or {}).get("rule")
    if c["rangefinder"].get("status") == "ok" and rule == "window_average":
        runs = case / "rangefinder"
        found = sorted(runs.rglob("average.json"))
        if len(found) != 1:
            out["rangefinder"] = f"{len(found)} average.json under {runs}: which one (a) delivered is unclear"
        else:
            ckpts = [checkpoint_at(found[0].parent.parent, u) for u in json.loads(found[0].read_text())["updates"]]
            out["rangefinder"] = ("a checkpoint of (a)'s average is gone" if None in ckpts
                                  else [p for p in ckpts if p is not None])
    elif rule == "cooldown":
        out["rangefinder"] = "the cooldown's weights are not a checkpoint of the fine-tune: not scored"
    return {arm: [v] if isinstance(v, Path) else v for arm, v in out.items()}


def rangefinder_alone(a: dict[str, Any]) -> dict[str, Any]:
    """A case's arms with (a) as given and every other arm empty, for a probe that re-ran (a) alone: the other arms
    are the saved case's and their weights are gone, which delivered_sets and score_unseen say for each."""
    none = {"updates": 0, "seconds": 0.0, "best_val_loss": None, "final_val_loss": None, "curve": []}
    return {"rangefinder": a, "prodigy": none, "folk": none, "random": {"runs": [], "updates": 0, "seconds": 0.0}}


def reproduces(measured: Optional[float], recorded: Optional[float]) -> bool:
    """Whether delivered weights measured again give the loss recorded for them (within REPRODUCES_REL)."""
    return measured is not None and recorded is not None and math.isclose(measured, recorded, rel_tol=REPRODUCES_REL)


def recorded_losses(c: dict[str, Any]) -> dict[str, Optional[float]]:
    """Each arm's validation loss as the case recorded it (what versus scores it by)."""
    from bench.versus import summarize

    s = c.get("summary") or summarize(c)
    return {arm: s.get(arm) for arm in UNSEEN_ARMS}


def score_unseen(cfg, c: dict[str, Any], case: Path, split_dir: Path, count: int, log=print) -> dict[str, Any]:
    """Measure each arm's delivered weights on `count` unseen images of the case's kind and seed, and again on the
    case's validation images: {"images", "seconds", "arms": {arm: {"unseen_loss", "val_loss", "recorded",
    "reproduces"} or {"absent": why}}}."""
    import time

    from bench.versus import plain_finetune
    from rangefinder.data.split import read_split
    from rangefinder.steps.average import average_weights
    from rangefinder.training.loop import weights_measurer
    from rangefinder.training.restore import delivered_state
    from rangefinder.training.spec import TrainSpec

    t0 = time.perf_counter()
    images = write_unseen_images(case / "unseen-images", c["kind"], c["seed"], c["images"], count)
    splits = {"val_loss": read_split(split_dir), "unseen_loss": unseen_split(cfg, images, case / "unseen-split")}
    sets = delivered_sets(c, case)
    # One checkpoint: what its run delivers (an EMA or schedule-free run's averaged weights); several: their average.
    weights = {arm: average_weights(v) if len(v) > 1 else delivered_state(v[0], cfg.model.base_model)
               for arm, v in sets.items() if not isinstance(v, str)}
    arms: dict[str, dict[str, Any]] = {arm: {"absent": v} for arm, v in sets.items() if isinstance(v, str)}
    for arm in weights:
        arms[arm] = {"checkpoints": [p.name for p in sets[arm]]}
    # The measuring run: the case's method, model and validation settings, as its fine-tune; it trains nothing. It
    # validates the weights it is handed, which already are what each arm delivered (an EMA or a schedule-free
    # optimizer's average included), so it is a plain run (no EMA, AdamW): `use_ema: auto` keeps an EMA for LoRA on
    # SD 1.x/2.x, and the measurer refuses a config that would validate one.
    lr, measured = cfg.training.lr, plain_finetune(cfg)
    for key, split in splits.items():
        spec = TrainSpec.finetune(measured, split, lr=lr, bounds=(lr, lr), world_size=1)
        out_dir = case / f"unseen-measure-{key}"
        with weights_measurer(spec, out_dir=out_dir, split=split) as measure:
            for arm, w in weights.items():
                arms[arm][key] = measure(w).get("val_loss")
        shutil.rmtree(out_dir, ignore_errors=True)
    recorded = recorded_losses(c)
    for arm, v in arms.items():
        if "absent" in v:
            continue
        v["recorded"] = recorded.get(arm)
        v["reproduces"] = reproduces(v["val_loss"], v["recorded"])
    seconds = time.perf_counter() - t0
    log(f"[{c['method']} {c['kind']} seed {c['seed']}] unseen images: {count}, {len(weights)} arms, {seconds:.0f} s"
        + "".join(f"; {arm} does not reproduce its recorded loss" for arm, v in arms.items()
                  if v.get("reproduces") is False))
    return {"images": count, "first": c["images"], "seconds": seconds,
            "arms": {arm: arms[arm] for arm in UNSEEN_ARMS if arm in arms}}


def unseen_summary(c: dict[str, Any]) -> dict[str, Any]:
    """The case's unseen losses for its summary: "unseen_<arm>" (None where absent or where the measured weights did
    not reproduce the arm's recorded loss: then they are not the delivered ones) and "unseen_vs_<opponent>"."""
    from bench.versus import OPPONENTS, verdict_of

    u = c.get("unseen")
    if not u:
        return {}
    arms = u["arms"]
    loss = {arm: (v.get("unseen_loss") if v.get("reproduces") else None) for arm, v in arms.items()}
    out: dict[str, Any] = {"unseen_images": u["images"],
                           "unseen_reproduces": all(v.get("reproduces", True) for v in arms.values())}
    out.update({f"unseen_{arm}": loss.get(arm) for arm in UNSEEN_ARMS})
    a, a_failed = loss.get("rangefinder"), c["rangefinder"].get("status") != "ok"
    for opp in OPPONENTS:
        # (a) failed: a loss against any arm that delivered (verdict_of); (a) unmeasured otherwise: no verdict.
        out[f"unseen_vs_{opp}"] = verdict_of(a, loss.get(opp)) if a is not None or a_failed else None
    return out


def unseen_view(s: dict[str, Any]) -> dict[str, Any]:
    """A summary as bench.versus.aggregate reads it, with every arm's loss and verdict the unseen images' (and no grid:
    its arms' weights are not kept)."""
    from bench.versus import OPPONENTS

    view = {k: v for k, v in s.items() if not k.startswith("gap_") and k != "grid_best"}
    for arm in UNSEEN_ARMS:
        view[arm] = s.get(f"unseen_{arm}")
    for opp in OPPONENTS:
        view[f"vs_{opp}"] = s.get(f"unseen_vs_{opp}")
    return view


def optimism(summaries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per arm, over the cases that measured it, the median and the range of its unseen loss over its validation loss:
    how much lower the images it was picked on (or, for a final checkpoint, merely scored on) made it look. The ratio
    moves with how hard the case's unseen images are, alike for every arm; the arms' medians compare."""
    out: dict[str, dict[str, Any]] = {}
    for arm in UNSEEN_ARMS:
        r = sorted(s[f"unseen_{arm}"] / s[arm] for s in summaries
                   if s.get(f"unseen_{arm}") is not None and s.get(arm))
        out[arm] = {"n": len(r), "median": statistics.median(r) if r else None, "min": r[0] if r else None,
                    "max": r[-1] if r else None}
    return out


def flips(summaries: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per opponent, how the verdicts on validation images became the unseen images' ("win->tie": n, ...)."""
    from bench.versus import OPPONENTS

    out: dict[str, dict[str, int]] = {}
    for opp in OPPONENTS:
        counts: dict[str, int] = {}
        for s in summaries:
            was, now = s.get(f"vs_{opp}"), s.get(f"unseen_vs_{opp}")
            if was and now:
                key = "same" if was == now else f"{was}->{now}"
                counts[key] = counts.get(key, 0) + 1
        out[opp] = counts
    return out
