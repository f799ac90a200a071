"""The fine-tune and retrain steps' settings: what LR and schedule the engine is given."""

from __future__ import annotations

from rangefinder.config import demo_config, parse_config
from rangefinder.steps.finetune import finetune_training_config
from rangefinder.steps.retrain_full import retrain_training_config


def test_constant_at_the_midpoint():
    cfg = demo_config()
    tc = finetune_training_config(cfg, 1e-4, 1e-2, 1e-3, train_images=16)
    assert tc.schedule == "constant" and tc.lr == 1e-3 and tc.epochs == cfg.finetune.epochs
    assert tc.lr_min is None and tc.lr_max is None


def test_cyclical_between_the_bounds_and_checkpoints_per_epoch():
    cfg = parse_config({"finetune": {"schedule": "triangular", "checkpoint_every_epochs": 2},
                        "training": {"batch_size": 4}, "split": {"val_split": 0.2}})
    tc = finetune_training_config(cfg, 1e-4, 1e-2, 1e-3, train_images=16)
    assert (tc.schedule, tc.lr_min, tc.lr_max) == ("triangular", 1e-4, 1e-2)
    assert tc.checkpoint_every_updates == 8  # 2 epochs x 16 images / batch 4


def test_fixed_lr_cannot_cycle():
    cfg = parse_config({"finetune": {"schedule": "triangular"}, "lr": 1e-3})
    tc = finetune_training_config(cfg, 1e-3, 1e-3, 1e-3, train_images=16)
    assert tc.schedule == "constant"


def test_retrain_uses_recommended_epochs_and_schedule():
    cfg = demo_config()
    tc = retrain_training_config(cfg, 1e-4, 1e-2, 1e-3, epochs=5)
    assert (tc.epochs, tc.schedule, tc.lr) == (5, "constant", 1e-3)
    tri = retrain_training_config(parse_config({"retrain": {"schedule": "triangular"}}), 1e-4, 1e-2, 1e-3, 5)
    assert (tri.schedule, tri.lr_min, tri.lr_max) == ("triangular", 1e-4, 1e-2)
