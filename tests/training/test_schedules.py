"""Each schedule's LR follows its formula, written out here independently of schedules.py."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest

from rangefinder.config import TrainingConfig
from rangefinder.errors import ConfigError
from rangefinder.training.schedules import make_schedule

U = 40  # updates in the run
PER_EPOCH = 4.0  # updates per epoch


def lrs(**kw) -> list[float]:
    s = make_schedule(TrainingConfig(epochs=1, **kw), U, PER_EPOCH, kw.get("lr", 1e-4))
    return [s(u) for u in range(U)]


def test_constant():
    assert lrs(lr=3e-5) == [3e-5] * U


def test_linear_ramp_climbs_evenly_to_lr_max():
    got = lrs(schedule="linear-ramp", lr_max=1e-2)
    assert got == pytest.approx([1e-2 * (u + 1) / U for u in range(U)], rel=1e-12)
    assert got[-1] == pytest.approx(1e-2)


def test_linear_ramp_from_lr_min():
    got = lrs(schedule="linear-ramp", lr_min=1e-4, lr_max=1e-2)
    assert got == pytest.approx([1e-4 + (1e-2 - 1e-4) * (u + 1) / U for u in range(U)], rel=1e-12)


def test_exp_ramp_is_geometric_from_lr_min_to_lr_max():
    got = lrs(schedule="exp-ramp", lr_min=1e-7, lr_max=1e-1)
    assert got[0] == pytest.approx(1e-7) and got[-1] == pytest.approx(1e-1)
    ratios = [b / a for a, b in pairwise(got)]
    assert ratios == pytest.approx([(1e-1 / 1e-7) ** (1 / (U - 1))] * (U - 1), rel=1e-9)


def test_cosine_with_warmup():
    got = lrs(schedule="cosine", lr=1e-3, warmup_updates=5)
    assert got[:5] == pytest.approx([1e-3 * (u + 1) / 5 for u in range(5)])
    assert got[5] == pytest.approx(1e-3)
    for u in range(5, U):
        assert got[u] == pytest.approx(0.5 * 1e-3 * (1 + math.cos(math.pi * (u - 5) / (U - 5))), rel=1e-12)


@pytest.mark.parametrize(("fraction", "warmup", "lr_min"), [(0.2, 0, None), (0.25, 4, 1e-5), (0.13, 2, None)])
def test_wsd_is_constant_then_decays_linearly_over_its_last_share(fraction, warmup, lr_min):
    """Warmup, stable, decay: the last ceil(fraction x U) updates fall linearly to lr_min; the last one still moves;
    before the decay (after any warmup) it is the constant schedule, update for update (the cooldown relies on it)."""
    kw = {} if lr_min is None else {"lr_min": lr_min}
    got = lrs(schedule="wsd", lr=1e-3, decay_fraction=fraction, warmup_updates=warmup, **kw)
    lo, decay = lr_min or 0.0, math.ceil(fraction * U)
    start = U - decay  # 32, 30 and 34 of 40 (0.13 x 40 = 5.2 rounds up)
    assert got[:warmup] == pytest.approx([1e-3 * (u + 1) / warmup for u in range(warmup)], rel=1e-12)
    assert got[warmup:start] == lrs(lr=1e-3)[warmup:start]
    assert got[start:] == pytest.approx([lo + (1e-3 - lo) * (U - u) / (decay + 1) for u in range(start, U)],
                                        rel=1e-12)
    assert all(a > b for a, b in pairwise(got[start - 1:])) and got[-1] > lo


def smith(u: float, step: float, lo: float, hi: float) -> tuple[int, float]:
    """Smith 2017, "Cyclical Learning Rates for Training Neural Networks", section 3.1: (cycle, triangular LR)."""
    cycle = math.floor(1 + u / (2 * step))
    x = abs(u / step - 2 * cycle + 1)
    return cycle, lo + (hi - lo) * max(0.0, 1 - x)


@pytest.mark.parametrize("name", ["triangular", "triangular2", "exp_range"])
def test_cyclical(name):
    got = lrs(schedule=name, lr_min=1e-5, lr_max=1e-3, cycle_epochs=1.5, exp_range_gamma=0.99)
    step = 1.5 * PER_EPOCH  # half a cycle, in updates
    for u, lr in enumerate(got):
        cycle, tri = smith(u, step, 1e-5, 1e-3)
        scale = {"triangular": 1.0, "triangular2": 1 / 2 ** (cycle - 1), "exp_range": 0.99**u}[name]
        assert lr == pytest.approx(1e-5 + (tri - 1e-5) * scale, rel=1e-12)
    if name != "exp_range":
        assert got[int(step)] == pytest.approx(1e-3)  # the first peak reaches lr_max


def test_impossible_ranges_are_refused():
    fields = {**dict(TrainingConfig()), "schedule": "exp-ramp", "lr_min": 0.0, "lr_max": 1.0}
    cfg = TrainingConfig.model_construct(**fields)
    with pytest.raises(ConfigError, match="lr_min"):
        make_schedule(cfg, U, PER_EPOCH, 1e-4)
    cfg = TrainingConfig.model_construct(**{**dict(TrainingConfig()), "schedule": "spiral"})
    with pytest.raises(ConfigError, match="unknown schedule"):
        make_schedule(cfg, U, PER_EPOCH, 1e-4)
