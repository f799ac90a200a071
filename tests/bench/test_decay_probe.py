"""bench.decay_probe's schedule: constant, then a linear fall to 0, only for the run it was opened for."""

import pytest


def test_stable_then_decay_shapes_only_its_own_run_and_is_put_back():
    from bench.decay_probe import stable_then_decay
    from rangefinder.training import schedules
    from rangefinder.training.schedules import LRSchedule

    plain = schedules.lr_at
    mine = LRSchedule("constant", total_updates=12, lr=1e-3, lr_min=0.0, lr_max=1e-3)
    other_length = LRSchedule("constant", total_updates=20, lr=1e-3, lr_min=0.0, lr_max=1e-3)
    cosine = LRSchedule("cosine", total_updates=12, lr=1e-3, lr_min=0.0, lr_max=1e-3)
    with stable_then_decay(1e-3, stable=8, total=12):
        lrs = [mine(u) for u in range(12)]
        assert lrs[:8] == [1e-3] * 8  # the stable part: (a)'s own fine-tune, update for update
        assert lrs[8:] == pytest.approx([1e-3 * k / 5 for k in (4, 3, 2, 1)])  # falling, never 0 while training
        assert [other_length(u) for u in (0, 15)] == [1e-3, 1e-3]  # another run's constant LR is untouched
        assert cosine(11) == plain(cosine, 11)
    assert schedules.lr_at is plain and mine(11) == 1e-3
