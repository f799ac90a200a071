"""bench.unseen: each arm's delivered weights, scored on images no arm chose on, are the weights it delivered."""

from __future__ import annotations

import json

import pytest

from bench.unseen import UNSEEN_ARMS, delivered_sets, flips, optimism, score_unseen, unseen_summary, unseen_view
from bench.versus import OPPONENTS, aggregate, keeping_every_checkpoint
from tests.tracking.fixtures import without_mlflow_run_env

LR = 1e-3


@pytest.mark.slow
def test_a_delivered_window_average_is_scored_as_the_checkpoints_it_averaged(split_dir, tiny_model_dir, tmp_path):
    """(a)'s window average is no checkpoint: its weights are the average of the checkpoints its average.json names,
    which measured on the case's validation images give the loss the step recorded for it, bit for bit; on unseen
    images (rendered after the case's own, none of them in the split) another loss."""
    from rangefinder.config import demo_config
    from rangefinder.data.split import read_split
    from rangefinder.steps.finetune import run_finetune

    cfg = demo_config(model={"base_model": str(tiny_model_dir)},
                      finetune={"epochs": 4, "successive_halving": False, "average": "on"},
                      training={"cache_dir": str(tmp_path / "cache")}, sampling={"every_validations": None},
                      validation={"every_epochs": 0.5},
                      tracking={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment_name": "unseen",
                                "registered_model_name": None})
    case = tmp_path / "case"
    with without_mlflow_run_env(), keeping_every_checkpoint():
        result = run_finetune(cfg, split_dir=split_dir, lr_low=LR, lr_high=LR, lr_mid=LR, lr_source="fixed",
                              model_dir=case / "rangefinder" / "finetune")
    avg = result.chosen["average"]
    # Whether or not the step delivered it, (a) delivering the average is what is scored here.
    chosen = {"rule": "window_average", "val_loss": avg["val_loss"], "update": max(avg["updates"])}
    missing = {"updates": 0, "seconds": 0.0, "best_val_loss": None, "final_val_loss": None, "curve": []}
    items = read_split(split_dir)
    c = {"method": "full", "kind": "shapes", "seed": 0, "images": len(items.train) + len(items.val),
         "held_out": False, "rangefinder": {"status": "ok", "chosen": chosen, "curve": [], "updates": 0, "seconds": 0},
         "prodigy": missing, "folk": missing, "random": {"runs": [], "updates": 0, "seconds": 0}}
    sets = delivered_sets(c, case)
    assert [p.name for p in sets["rangefinder"]] == [f"checkpoint-{u:06d}" for u in avg["updates"]]
    assert all(isinstance(sets[arm], str) for arm in UNSEEN_ARMS[1:])  # the other arms trained nothing here
    scored = score_unseen(cfg, c, case, split_dir, 6)
    a = scored["arms"]["rangefinder"]
    assert a["val_loss"] == avg["val_loss"] and a["reproduces"] is True
    assert a["unseen_loss"] > 0 and a["unseen_loss"] != a["val_loss"]
    assert scored["images"] == 6 and scored["first"] == c["images"]
    assert len(list((case / "unseen-images").glob("*.png"))) == 6
    assert all("absent" in scored["arms"][arm] for arm in UNSEEN_ARMS[1:])
    c["unseen"] = json.loads(json.dumps(scored))
    s = unseen_summary(c)
    assert s["unseen_rangefinder"] == a["unseen_loss"] and s["unseen_reproduces"] is True
    assert all(s[f"unseen_vs_{opp}"] is None for opp in OPPONENTS)  # no other arm has a loss


@pytest.mark.slow
def test_a_lora_run_s_default_ema_is_scored_as_it_delivered_it(split_dir, tiny_model_dir, tmp_path):
    """LoRA on SD 1.x keeps an EMA by default (training.use_ema auto) and delivers it. Scoring takes the delivered
    weights with the case's own config: the measuring run keeps no EMA of its own (the measurer refuses a config that
    validates averaged weights) and gives back the loss (a) recorded for its pick, bit for bit."""
    from rangefinder.config import demo_config
    from rangefinder.data.split import read_split
    from rangefinder.steps.finetune import run_finetune

    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, finetune={"epochs": 4, "successive_halving": False},
                      training={"method": "lora", "cache_dir": str(tmp_path / "cache")},
                      sampling={"every_validations": None}, validation={"every_epochs": 0.5},
                      tracking={"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment_name": "unseen",
                                "registered_model_name": None})
    assert cfg.training.keeps_ema("sd1")
    case = tmp_path / "case"
    with without_mlflow_run_env(), keeping_every_checkpoint():
        result = run_finetune(cfg, split_dir=split_dir, lr_low=LR, lr_high=LR, lr_mid=LR, lr_source="fixed",
                              model_dir=case / "rangefinder" / "finetune")
    chosen = {k: result.chosen[k] for k in ("rule", "val_loss", "update")}
    missing = {"updates": 0, "seconds": 0.0, "best_val_loss": None, "final_val_loss": None, "curve": []}
    items = read_split(split_dir)
    c = {"method": "lora", "kind": "shapes", "seed": 0, "images": len(items.train) + len(items.val),
         "held_out": False, "rangefinder": {"status": "ok", "chosen": chosen, "curve": [], "updates": 0, "seconds": 0},
         "prodigy": missing, "folk": missing, "random": {"runs": [], "updates": 0, "seconds": 0}}
    a = score_unseen(cfg, c, case, split_dir, 4)["arms"]["rangefinder"]
    assert a["val_loss"] == chosen["val_loss"] and a["reproduces"] is True
    assert a["unseen_loss"] > 0


def _arms(**losses):
    return {arm: ({"absent": "gone"} if v is None else
                  {"unseen_loss": v[0], "val_loss": 1.0, "recorded": 1.0, "reproduces": v[1]})
            for arm, v in losses.items()}


def test_unseen_verdicts_leave_out_weights_that_are_not_the_delivered_ones_and_count_a_failed_a_as_a_loss():
    ok = {"status": "ok"}
    # (a) 0.90 on unseen images: a win against 1.0, a tie against 0.905; Prodigy's final did not reproduce its
    # recorded loss (the weights measured are not the ones it delivered): no verdict against it.
    c = {"rangefinder": ok, "unseen": {"images": 4, "arms": _arms(
        rangefinder=(0.90, True), prodigy_best=(1.0, True), prodigy_final=(0.5, False), folk_final=(0.905, True),
        folk_best=(0.905, True), random_best=None)}}
    s = unseen_summary(c)
    assert s["unseen_vs_prodigy_best"] == "win" and s["unseen_vs_prodigy_final"] is None
    assert s["unseen_vs_folk_final"] == "tie" and s["unseen_vs_random_best"] is None
    assert s["unseen_prodigy_final"] is None and s["unseen_reproduces"] is False
    # (a) failed: it delivered nothing, a loss against every arm that delivered.
    failed = {"rangefinder": {"status": "failed"}, "unseen": {"images": 4, "arms": {
        "rangefinder": {"absent": "(a) failed"}, **_arms(prodigy_best=(1.0, True))}}}
    assert unseen_summary(failed)["unseen_vs_prodigy_best"] == "loss"
    # The standings and the verdicts that changed, read off the summaries.
    rows = [{**s, "held_out": False, "vs_prodigy_best": "tie", "vs_folk_final": "tie"}]
    agg = aggregate([unseen_view(r) for r in rows])
    assert agg["vs_prodigy_best"] == {"n": 1, "win": 1, "tie": 0, "loss": 0}
    assert flips(rows)["prodigy_best"] == {"tie->win": 1} and flips(rows)["folk_final"] == {"same": 1}
    # How optimistic each arm's validation loss was: its unseen loss over it (the recorded one, 1.0 in the summary).
    rows[0].update(rangefinder=1.0, prodigy_best=0.8)
    o = optimism(rows)
    assert o["rangefinder"] == {"n": 1, "median": 0.9, "min": 0.9, "max": 0.9}
    assert o["prodigy_best"]["median"] == 1.25 and o["random_best"]["n"] == 0
