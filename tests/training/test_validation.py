"""Validation's cost knobs on real tiny-model runs: what they skip, and what they must leave alone (the numbers that
are measured, and training)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.data.split import read_split
from rangefinder.training.loop import TrainSpec, train

UPDATES = 5  # validated after every update: rows 0 (baseline) .. 5


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def unet_weights(final_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(final_dir / "unet" / "diffusion_pytorch_model.safetensors"))


@pytest.fixture(scope="module")
def cadence_runs(split_dir, tiny_model_dir, tmp_path_factory):
    """One run three times: stabilize measured at every validation, at every 3rd, and no validation at all."""
    cache = str(tmp_path_factory.mktemp("encoded"))
    cfg = TrainingConfig(batch_size=4, lr=1e-4, seed=3, steps=UPDATES, cache_dir=cache, random_flip=True)
    out = {}
    for name, val_cfg in (("every", ValidationConfig(every_updates=1)),
                          ("third", ValidationConfig(every_updates=1, stabilize_every=3)),
                          ("off", ValidationConfig(every_epochs=0))):
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, train(TrainSpec(cfg, val_cfg, split_dir=split_dir, model=tiny_model_dir), out_dir=d))
    return out


def test_stabilize_every_n_measures_every_nth_row_and_the_last(cadence_runs):
    table = rows(cadence_runs["third"][0] / "metrics.csv")
    assert [r["update"] for r in table] == [str(u) for u in range(UPDATES + 1)]
    assert all(r["val_loss"] != "" for r in table)  # val at every row
    measured = [int(r["update"]) for r in table if r["stabilize_loss"] != ""]
    assert measured == [0, 3, UPDATES]  # rows 0 and 3 (every 3rd from the baseline) and the last
    skipped = [r for r in table if r["stabilize_loss"] == ""]
    assert all(r[k] == "" for r in skipped for k in r if k.startswith("stabilize_loss_b"))
    every = rows(cadence_runs["every"][0] / "metrics.csv")
    assert all(r["stabilize_loss"] != "" for r in every)


def test_skipping_stabilize_leaves_the_measured_numbers_bit_identical(cadence_runs):
    """Sets are never batched together, so a row's val loss does not depend on whether stabilize was measured."""
    every = rows(cadence_runs["every"][0] / "metrics.csv")
    third = rows(cadence_runs["third"][0] / "metrics.csv")
    assert len(every) == len(third) == UPDATES + 1
    for a, b in zip(every, third, strict=True):
        assert {k: v for k, v in b.items() if not k.startswith("stabilize_")} == \
            {k: v for k, v in a.items() if not k.startswith("stabilize_")}
        if b["stabilize_loss"]:
            assert b == a


def test_weights_are_the_same_with_validation_on_sparse_and_off(cadence_runs):
    weights = {name: unet_weights(result.final_dir) for name, (_, result) in cadence_runs.items()}
    for name in ("every", "third"):
        assert weights[name].keys() == weights["off"].keys()
        assert all(torch.equal(weights[name][k], weights["off"][k]) for k in weights["off"])
    assert rows(cadence_runs["third"][0] / "updates.csv") == rows(cadence_runs["off"][0] / "updates.csv")


def test_without_a_val_set_stabilize_is_measured_every_time(split_dir, tiny_model_dir, tmp_path):
    # train+val: the stabilize subset is the only measurement (and the divergence watch), so it is never thinned.
    cfg = TrainingConfig(batch_size=4, lr=1e-4, seed=3, steps=3, cache_dir=str(tmp_path / "cache"))
    train(TrainSpec(cfg, ValidationConfig(every_updates=1, stabilize_every=4), split_dir=split_dir,
                    model=tiny_model_dir, train_on="train+val"),
          out_dir=tmp_path / "run", save_final=False)
    table = rows(tmp_path / "run" / "metrics.csv")
    assert [r["update"] for r in table] == ["0", "1", "2", "3"]
    assert all(r["val_loss"] == "" and r["stabilize_loss"] != "" for r in table)


@pytest.fixture(scope="module")
def scorer(split_dir, tiny_model_dir):
    """(the split's validation items, their cached hidden states, the tiny model's epsilon denoiser in eval mode)."""
    from rangefinder.config import ModelConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.caching import tokenize
    from rangefinder.training.family import Denoiser, Sd1Family

    sd = load_sd_components(ModelConfig(base_model=str(tiny_model_dir)))
    items = read_split(split_dir).val
    with torch.no_grad():
        hidden = sd.text_encoder(tokenize(sd.tokenizer, [it.text for it in items]))[0]
    return items, hidden, Denoiser(Sd1Family(sd.tokenizer, sd.noise_scheduler, prediction_type="epsilon"),
                                   sd.unet.eval())


def two_bucket_sets(items, hidden) -> list:
    """The items as two aspect-ratio buckets of different latent shapes (random latents, seeded)."""
    from rangefinder.training.validation import ValidationSet

    g = torch.Generator().manual_seed(0)
    half = len(items) // 2
    return [ValidationSet("val", [it.id for it in items[:half]], torch.randn((half, 4, 8, 8), generator=g),
                          hidden[:half], bucket="64x64"),
            ValidationSet("val", [it.id for it in items[half:]],
                          torch.randn((len(items) - half, 4, 8, 6), generator=g), hidden[half:], bucket="64x48")]


def test_a_pass_reuses_its_fixed_draws_and_matches_the_per_pair_definition(scorer):
    """The draws kept on the set are the ones fixed_draw gives for (seed, id, k); a pass is the same bit for bit
    whatever the global RNG, at any batch size the numbers agree to the float tolerance."""
    from rangefinder.training.validation import ValidationSet, fixed_draw, measure

    items, hidden, denoiser = scorer
    latents = torch.randn((len(items), 4, 8, 8), generator=torch.Generator().manual_seed(0))
    vset = ValidationSet("val", [it.id for it in items], latents, hidden)
    kw = dict(denoiser=denoiser, num_buckets=4, seed=5, device=torch.device("cpu"))
    torch.manual_seed(1)
    first = measure(vset, **kw, batch_size=32)
    fixed = vset.fixed_inputs(5, 4, denoiser.family, torch.device("cpu"))
    torch.manual_seed(2)
    assert measure(vset, **kw, batch_size=32) == first
    assert vset.fixed_inputs(5, 4, denoiser.family, torch.device("cpu")) is fixed
    t, noise = fixed_draw(5, items[-1].id, 3, 4, denoiser.family, (4, 8, 8))
    assert int(fixed.timesteps[-1]) == t and torch.equal(fixed.noise[-1], noise)
    small = measure(vset, **kw, batch_size=3)
    assert small[0] == pytest.approx(first[0], rel=1e-6)
    assert small[1] == pytest.approx(first[1], rel=1e-6)


def test_stabilize_cadence_counts_rows_across_a_resume(split_dir, tiny_model_dir, tmp_path):
    """Resumed from the checkpoint of update 1 (rows 0 and 1 written), the next stabilize row is still the 3rd;
    a count restarted at the resume would measure it at update 2."""
    import shutil

    cfg = TrainingConfig(batch_size=4, lr=1e-4, seed=3, steps=UPDATES, cache_dir=str(tmp_path / "cache"),
                         checkpoint_every_updates=1, keep_checkpoints=UPDATES)
    val_cfg = ValidationConfig(every_updates=1, stabilize_every=3)
    out = tmp_path / "run"
    train(TrainSpec(cfg, val_cfg, split_dir=split_dir, model=tiny_model_dir), out_dir=out, save_final=False)
    whole = (out / "metrics.csv").read_text()
    # As if the run had died after its checkpoint at update 1.
    for ckpt in (out / "checkpoints").iterdir():
        if int(ckpt.name.rsplit("-", 1)[1]) > 1:
            shutil.rmtree(ckpt)
    (out / "run_summary.json").unlink()
    resumed = train(TrainSpec(cfg.model_copy(update={"resume": True}), val_cfg, split_dir=split_dir,
                              model=tiny_model_dir),
                    out_dir=out, save_final=False)
    assert resumed.resumed_from == 1
    assert (out / "metrics.csv").read_text() == whole
    assert [int(r["update"]) for r in rows(out / "metrics.csv") if r["stabilize_loss"]] == [0, 3, UPDATES]


def test_sharded_passes_give_every_process_the_one_process_numbers(scorer):
    """N processes each score a contiguous 1/N of a subset's (item, k) pairs and pool them with one sum: every
    process gets the same numbers, the one-process ones up to the last bits (the shards cut the batches), and each
    scored only its share. The processes are threads here, their all-reduce a barrier and a sum;
    tests/steps/test_processes.py runs the real gloo one."""
    from rangefinder.training.validation import PairScoring, Shard, measure_subset

    items, hidden, denoiser = scorer
    vsets = two_bucket_sets(items, hidden)  # a shard may span both buckets
    scoring = PairScoring(num_buckets=4, seed=5, batch_size=32, device=torch.device("cpu"))
    one = Shard()
    mean, per_bucket, per_shape = measure_subset(vsets, denoiser, scoring, shard=one)
    pairs = len(items) * 4
    assert one.pairs_by_rank == [pairs]

    for world in (2, 3):
        results = _as_processes(world, lambda shard: (measure_subset(vsets, denoiser, scoring, shard=shard),
                                                      shard.pairs_by_rank))
        assert all(r == results[0] for r in results)  # every process: the same numbers, bit for bit
        (m, b, s), counts = results[0]
        assert m == pytest.approx(mean, rel=1e-6) and b == pytest.approx(per_bucket, rel=1e-6)
        assert s.keys() == per_shape.keys() and list(s.values()) == pytest.approx(list(per_shape.values()), rel=1e-6)
        assert counts == [pairs * (r + 1) // world - pairs * r // world for r in range(world)]


def test_the_loss_is_each_pair_s_plain_mse_averaged_per_timestep_bucket_and_per_aspect_bucket(scorer):
    """design.md 2: each (item, k) pair is scored at its own fixed timestep and noise (fixed_draw), as the plain MSE of
    the model's output against its target; timestep bucket k's loss is the mean over the items, val_loss the mean of
    the K buckets, and an aspect-ratio bucket's loss the mean of its own pairs. Here pair by pair, one forward each."""
    from rangefinder.training.validation import PairScoring, fixed_draw, measure_subset

    items, hidden, denoiser = scorer
    vsets = two_bucket_sets(items, hidden)
    mean, per_bucket, per_shape = measure_subset(vsets, denoiser, PairScoring(4, 5, 32, torch.device("cpu")))
    losses: dict[str, list[list[float]]] = {}  # aspect bucket -> [item][k]
    with torch.no_grad():
        for vset in vsets:
            for i, item_id in enumerate(vset.ids):
                row = []
                for k in range(4):
                    t, noise = fixed_draw(5, item_id, k, 4, denoiser.family, vset.latents.shape[1:])
                    pred, target = denoiser(vset.latents[i:i + 1], noise[None], torch.tensor([t]),
                                            vset.conditioning[i:i + 1])
                    row.append(float(((pred - target) ** 2).mean()))
                losses.setdefault(vset.bucket, []).append(row)
    every = [row for by_item in losses.values() for row in by_item]
    assert per_bucket == pytest.approx([sum(r[k] for r in every) / len(every) for k in range(4)], rel=1e-5)
    assert mean == pytest.approx(sum(map(sum, every)) / (4 * len(every)), rel=1e-5)
    assert per_shape == pytest.approx({b: sum(map(sum, r)) / (4 * len(r)) for b, r in losses.items()}, rel=1e-5)


def test_each_pair_draws_its_own_noise_and_a_timestep_inside_its_part_of_training_s(scorer):
    """The generator of a pair is seeded by (seed, item id, k): every pair has its own noise, and bucket k's timestep is
    drawn inside the k-th of K equal parts of [0, T) (design.md 2), not pinned to the part's start."""
    from rangefinder.training.validation import fixed_draw

    items, _, denoiser = scorer
    family, T = denoiser.family, denoiser.family.num_timesteps
    draws = {(it.id, k): fixed_draw(5, it.id, k, 4, family, (4, 8, 8)) for it in items for k in range(4)}
    noises = [noise for _, noise in draws.values()]
    assert all(not torch.equal(a, b) for i, a in enumerate(noises) for b in noises[i + 1:])
    for (_, k), (t, _) in draws.items():
        assert k * T // 4 <= t < (k + 1) * T // 4
    assert len({t for (_, k), (t, _) in draws.items() if k == 0}) > 1
    assert fixed_draw(5, items[0].id, 1, 4, family, (4, 8, 8))[1].equal(draws[(items[0].id, 1)][1])  # reproducible


def test_a_measurement_leaves_every_rng_as_it_found_it():
    """Validation and sampling run inside preserved_rng, which puts back Python's, NumPy's and torch's RNG and the
    training generator: whatever a forward pass draws, training draws what it would have without it."""
    import random

    import numpy as np

    from rangefinder.training.validation import preserved_rng

    train_gen = torch.Generator().manual_seed(3)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state(), train_gen.get_state())
    with preserved_rng((train_gen,)):
        random.random()
        np.random.rand()
        torch.rand(3)
        torch.rand(3, generator=train_gen)
    assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2]) and torch.equal(train_gen.get_state(), before[3])


def test_a_ramp_diverges_on_its_smoothed_loss_not_on_one_point():
    """validation.diverged: the median of the last `window` losses against factor x the best centred median; one
    spike does not stop a ramp, a sustained blow-up does, and one low point is not the best to compare with."""
    from rangefinder.training.validation import diverged

    assert not diverged([0.2, 0.19, 0.18, 0.9], 4.0, 3)
    assert diverged([0.2, 0.19, 0.18, 0.9, 1.0], 4.0, 3)
    assert not diverged([0.2, 0.2, 0.04, 0.2, 0.2], 4.0, 3)
    assert diverged([0.2, 0.19, float("nan")], 4.0, 3)


def _as_processes(world: int, work) -> list:
    """work(shard) in `world` threads standing in for processes, their all-reduce a barrier and a sum."""
    import threading

    from rangefinder.training.validation import Shard

    barrier = threading.Barrier(world, timeout=60)
    vectors: list[torch.Tensor] = [torch.zeros(0)] * world
    results: list = [None] * world

    def process(rank: int) -> None:
        def sum_over_processes(t: torch.Tensor) -> torch.Tensor:
            vectors[rank] = t
            barrier.wait()
            total = sum(vectors[1:], vectors[0].clone())
            barrier.wait()
            return total

        results[rank] = work(Shard(rank, world, sum_over_processes, [0] * world))

    threads = [threading.Thread(target=process, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results
