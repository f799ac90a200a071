"""The decision step: bounds checked and written down; a fixed LR collapses the bounds."""

from __future__ import annotations

import pytest

from rangefinder.config import demo_config
from rangefinder.errors import RangefinderError
from rangefinder.steps.choose_lr import run_choose_lr


def test_fixed_lr_and_decision_file(tmp_path):
    out = tmp_path / "decision.md"
    c = run_choose_lr(demo_config(), source="fixed", lr_low=3e-4, lr_high=3e-4, lr_mid=3e-4, decision_path=out)
    assert (c.lr_low, c.lr_mid, c.lr_high, c.source) == (3e-4, 3e-4, 3e-4, "fixed")
    text = out.read_text()
    assert "0.0003" in text and "fixed by hand" in text


@pytest.mark.parametrize("low, mid, high, match", [
    (1e-3, 1e-4, 1e-2, "out of order"),
    (0.0, 1e-4, 1e-2, "lr_low = 0.0"),
    (1e-4, float("nan"), 1e-2, "lr_mid = nan"),
])
def test_bad_bounds_are_refused(low, mid, high, match):
    with pytest.raises(RangefinderError, match=match):
        run_choose_lr(demo_config(), source="range-test", lr_low=low, lr_high=high, lr_mid=mid)


def test_unknown_source():
    with pytest.raises(RangefinderError, match="source must be one of"):
        run_choose_lr(demo_config(), source="guess", lr_low=1e-4, lr_high=1e-3, lr_mid=3e-4)
