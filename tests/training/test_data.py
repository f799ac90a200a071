"""The image stream: what the planner counts is what the loop draws, image by image."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from rangefinder.planning import plan
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


# ---------------------------------------------------------------------------------------------------------------
# Aspect-ratio buckets: one bucket per micro-batch, counted as plan() counts them


@pytest.mark.parametrize("counts, bs, ga, ws, epochs, drop_last", [
    ((4, 5, 3), 2, 2, 1, 3, False), ((7, 1, 9), 3, 1, 2, 2, False), ((6, 6), 4, 1, 1, 2, False),
    ((5, 4, 3), 2, 3, 1, 2, True), ((10, 2, 7), 1, 1, 3, 2, True),
])
def test_bucketed_epochs_see_each_image_once_in_batches_of_one_bucket(counts, bs, ga, ws, epochs, drop_last):
    from rangefinder.training.data import BucketedStream, make_stream

    bucket_of = [b for b, c in enumerate(counts) for _ in range(c)]
    bucket_of = [bucket_of[i] for i in np.random.default_rng(0).permutation(len(bucket_of))]  # buckets interleaved
    n, chunk = len(bucket_of), bs * ws
    p = plan(n, bucket_counts=counts, batch_size=bs, grad_accum=ga, world_size=ws, epochs=epochs, drop_last=drop_last)
    s = make_stream(p, 5, bucket_of)
    assert isinstance(s, BucketedStream) and s.total_updates == p.total_updates
    per_epoch = sum(c // chunk if drop_last else -(-c // chunk) for c in counts)
    assert p.total_micro_batches == epochs * per_epoch
    chunks = [s.micro_batch(j) for j in range(p.total_micro_batches)]
    assert all(len({bucket_of[i] for i in c}) == 1 and 0 < len(c) <= chunk for c in chunks)
    assert sum(len(c) for c in chunks) == p.images_seen
    assert sum(len(s.local(j, r)) for j in range(p.total_micro_batches) for r in range(ws)) == p.images_seen
    for e in range(epochs):
        seen = [i for c in chunks[e * per_epoch : (e + 1) * per_epoch] for i in c]
        assert len(set(seen)) == len(seen)  # no image twice in an epoch
        if not drop_last:
            assert sorted(seen) == list(range(n))
        assert s.epochs_after((e + 1) * per_epoch) == e + 1
    # Partial chunks: one per bucket not a multiple of the chunk, each epoch (none with drop_last).
    partial = sum(1 for c in chunks if len(c) < chunk)
    assert partial == (0 if drop_last else epochs * sum(1 for c in counts if c % chunk))
    # The order depends on (seed, epoch) only: a fresh stream read backwards agrees.
    again = make_stream(p, 5, bucket_of)
    assert [again.micro_batch(j) for j in reversed(range(p.total_micro_batches))][::-1] == chunks
    assert make_stream(p, 6, bucket_of).micro_batch(0) != chunks[0] or make_stream(p, 6, bucket_of).micro_batch(
        1) != chunks[1]


def test_one_bucket_keeps_the_plain_stream_and_plan():
    from rangefinder.training.data import ImageStream, make_stream

    p = plan(10, bucket_counts=[10], batch_size=3, epochs=2)
    assert p.bucket_counts is None and p == plan(10, train_images=10, batch_size=3, epochs=2)
    assert isinstance(make_stream(p, 1, [0] * 10), ImageStream)


def test_a_steps_budget_ending_mid_epoch_is_flagged_with_buckets():
    p = plan(12, bucket_counts=[4, 5, 3], batch_size=2, steps=10)
    assert p.total_updates == 10 and p.epochs == 1
    assert any("ends 3 micro-batches into epoch 2" in w for w in p.warnings)


def test_bucketed_epochs_draw_afresh_and_mix_the_buckets_chunks():
    from rangefinder.training.data import make_stream

    counts = (4, 5, 3)
    bucket_of = [b for b, c in enumerate(counts) for _ in range(c)]
    p = plan(12, bucket_counts=counts, batch_size=2, epochs=2)
    s = make_stream(p, 5, bucket_of)
    assert s.epoch_chunks(0) != s.epoch_chunks(1)  # each epoch its own order, as the plain stream's
    # The chunks of all buckets are shuffled together: not every run opens with the first bucket's chunks.
    firsts = {bucket_of[make_stream(p, seed, bucket_of).micro_batch(0)[0]] for seed in range(8)}
    assert len(firsts) > 1


def test_without_the_cache_a_flipped_image_gets_the_caches_mirrored_latent(tiny_model_dir, tmp_path):
    """cache_latents off encodes each micro-batch itself: a flipped image is the one mirrored left to right, its latent
    sampled with the seed the cache samples the mirrored latent with."""
    import torch
    from diffusers import AutoencoderKL
    from PIL import Image

    from rangefinder.data.pixels import load_rgb, to_model_array
    from rangefinder.training.caching import LatentCache, VaeEncoder
    from rangefinder.training.data import EncodedOnTheFly

    path = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
    cpu = torch.device("cpu")
    vae = AutoencoderKL.from_pretrained(tiny_model_dir / "vae")
    cache = LatentCache(VaeEncoder(vae, cpu, "sample", 3), lambda p: to_model_array(load_rgb(p), 32), tmp_path / "c")
    latent, mirrored = cache.latents([path], ["key"], flipped=True, progress=False)
    assert mirrored is not None and not torch.equal(latent, mirrored)
    on_the_fly = EncodedOnTheFly([path], ["key"], cache.encoder, cache.load)
    assert torch.equal(on_the_fly.get([0], [False], cpu), latent)
    assert torch.equal(on_the_fly.get([0], [True], cpu), mirrored)
