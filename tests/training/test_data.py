"""The image stream: what the planner counts is what the loop draws, image by image."""

from __future__ import annotations

from collections import Counter

import pytest

from rangefinder.config import plan
from rangefinder.training.data import ImageStream


@pytest.mark.parametrize("n, bs, ga, ws, epochs, drop_last", [
    (16, 3, 1, 1, 3, False), (16, 2, 3, 1, 2, False), (10, 3, 2, 2, 4, False), (16, 5, 2, 1, 2, True),
    (7, 2, 2, 3, 3, True), (5, 5, 1, 1, 2, False),
])
def test_every_epoch_sees_each_image_once(n, bs, ga, ws, epochs, drop_last):
    p = plan(n, train_images=n, batch_size=bs, grad_accum=ga, world_size=ws, epochs=epochs, drop_last=drop_last)
    s = ImageStream.from_plan(p, seed=5)
    assert s.total_updates == p.total_updates
    chunks = [s.micro_batch(j) for j in range(p.total_micro_batches)]
    assert sum(len(c) for c in chunks) == p.images_seen
    assert sum(len(s.local(j, r)) for j in range(p.total_micro_batches) for r in range(ws)) == p.images_seen
    if drop_last:
        per_epoch = n // (bs * ws)
        for e in range(epochs):
            seen = [i for c in chunks[e * per_epoch : (e + 1) * per_epoch] for i in c]
            assert len(set(seen)) == len(seen) == per_epoch * bs * ws  # no repeats within an epoch
    else:
        flat = [i for c in chunks for i in c]
        for e in range(epochs):
            assert sorted(flat[e * n : (e + 1) * n]) == list(range(n))
        assert Counter(flat) == Counter({i: epochs for i in range(n)})
    assert s.epochs_after(p.total_micro_batches) == pytest.approx(epochs)
    updates = [s.update_micro_batches(u) for u in range(p.total_updates)]
    assert [j for r in updates for j in r] == list(range(p.total_micro_batches))


def test_order_depends_on_seed_and_epoch_only():
    p = plan(12, train_images=12, batch_size=4, epochs=2)
    a, b, c = ImageStream.from_plan(p, 1), ImageStream.from_plan(p, 1), ImageStream.from_plan(p, 2)
    assert [a.micro_batch(j) for j in range(6)] == [b.micro_batch(j) for j in reversed(range(6))][::-1]
    assert a.micro_batch(0) != c.micro_batch(0) or a.micro_batch(1) != c.micro_batch(1)
    first_half = a.micro_batch(0) + a.micro_batch(1) + a.micro_batch(2)
    assert first_half != a.micro_batch(3) + a.micro_batch(4) + a.micro_batch(5)
