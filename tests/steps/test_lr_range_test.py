"""The range-test step's pure parts: the sweep's settings (the zoom decision is tests/analysis/test_zoom.py)."""

from __future__ import annotations

from rangefinder.config import demo_config, parse_config
from rangefinder.steps.lr_range_test import ramp_training_config


def test_ramp_settings_follow_the_range_test_section():
    cfg = demo_config()
    tc = ramp_training_config(cfg, 1e-6, 1e-1)
    assert tc.schedule == "exp-ramp" and tc.lr_min == 1e-6 and tc.lr_max == 1e-1
    assert tc.epochs == cfg.lr_range_test.epochs and tc.steps is None and tc.scale_lr == "none"
    lin = ramp_training_config(parse_config({"lr_range_test": {"ramp": "linear"}}), 0.0001, 0.01)
    assert lin.schedule == "linear-ramp"
