"""The range-test step's pure parts: the sweep's settings (the zoom decision is tests/analysis/test_zoom.py)."""

from __future__ import annotations

import pytest

from rangefinder.config import demo_config, parse_config
from rangefinder.data.split import read_split
from rangefinder.training.spec import TrainSpec


def test_ramp_settings_follow_the_range_test_section(split_dir):
    cfg = demo_config()
    split = read_split(split_dir)
    tc = TrainSpec.ramp(cfg, split, lr_min=1e-6, lr_max=1e-1, world_size=1).training
    assert tc.schedule == "exp-ramp" and tc.lr_min == 1e-6 and tc.lr_max == 1e-1
    assert tc.epochs == cfg.lr_range_test.epochs and tc.steps is None and tc.scale_lr == "none"
    lin = TrainSpec.ramp(parse_config({"lr_range_test": {"ramp": "linear"}}), split,
                         lr_min=0.0001, lr_max=0.01, world_size=1).training
    assert lin.schedule == "linear-ramp"
    every = TrainSpec.ramp(parse_config({"lr_range_test": {"validate_every_updates": 3}}), split,
                           lr_min=0.0001, lr_max=0.01, world_size=1).validation
    assert every.every_updates == 3


def test_a_zoom_sweeps_the_range_it_is_given_not_the_configured_one(split_dir, tmp_path):
    """The zoom's lr_min and lr_max are its own: an empty one is refused as given (the configured range is not)."""
    from rangefinder.errors import RangefinderError
    from rangefinder.steps.lr_range_test import run_lr_range_test

    with pytest.raises(RangefinderError, match=r"^LR range 0\.001\.\.0\.0005 is empty"):
        run_lr_range_test(demo_config(), split_dir=split_dir, out_dir=tmp_path, stage="zoom", lr_min=1e-3,
                          lr_max=5e-4)
