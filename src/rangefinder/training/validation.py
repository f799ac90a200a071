"""Deterministic validation loss: the measurement the LR range test and the step window rest on.

See docs/design.md, section 2 ("Deterministic validation").

Each item is scored at K stratified timesteps, one in each 1/K of what training samples (the family's
`fixed_timestep`: DDPM families draw an integer inside each 1/K of [0, T); flow families take the fixed sigma at
the middle of each 1/K of their sigma density, the same grid for every item), each with fixed noise; timestep and
noise come from a generator seeded by (seed, item id, k) and never from the global RNG. Latents are the cached
mode (or seeded sample), never flipped; captions are never dropped. The loss is the plain MSE against the model's
target (epsilon, v, or the flow velocity noise - x0), unweighted, so the same model gives the same numbers bit for
bit on CPU. Every RNG the forward pass could touch is saved and restored around the measurement, so validating never
changes what training does.

With aspect-ratio buckets (data/buckets.py) a subset is held as one `ValidationSet` per bucket, each of one latent
shape: an item is always in the bucket its size puts it in, and its noise, drawn from (seed, item id, k), has that
bucket's latent shape, so the measurement stays a fixed function of the model. `measure_subset` scores a subset's
sets together (the subset's loss is the mean over all its items) and gives each bucket's loss too.

`measure` scores one set; `validate` writes one row of the run's curve (metrics.csv) from the sets it measures.

On several processes (`Shard`) each process scores its share of a subset's (item, k) pairs, and one all-reduce
gives every process every pair's loss: the one-process numbers up to the last bits (the batches differ), the same
on every process, at 1/world_size of the compute per process.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

if TYPE_CHECKING:
    from rangefinder.training.family import Denoiser, Family


@dataclass
class ValidationSet:
    name: str  # "val" or "stabilize"
    ids: list[int]  # stable item ids from the split (seed the noise)
    latents: torch.Tensor  # (N, 4, h, w) scaled latents, CPU
    conditioning: torch.Tensor  # (N, 77, D) cached hidden states, or (N, 77) token ids when the encoder trains
    bucket: Optional[str] = None  # the aspect-ratio bucket ("40x24") all its items are in; None: not bucketed
    # The fixed inputs of every pass, built on the first one and kept: the draws depend only on (seed, id, k), so
    # they never change during a run, and the set's tensors need not be copied to the device again each pass.
    _fixed: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.ids)

    def fixed_inputs(self, seed: int, num_buckets: int, family: Family, device: torch.device) -> FixedInputs:
        # One family object per run: its timestep grid (flow families: from the run's settings) never changes in it.
        key = (seed, num_buckets, id(family), str(device))
        if key not in self._fixed:
            # (item, k) pairs item-major: pair p is item p // K at bucket p % K.
            draws = [fixed_draw(seed, i, k, num_buckets, family, self.latents.shape[1:])
                     for i in self.ids for k in range(num_buckets)]
            timesteps = [t for t, _ in draws]
            self._fixed.clear()  # one setting per run; never keep a stale copy on the device
            self._fixed[key] = FixedInputs(
                # integer timesteps (DDPM families) stay integers; sigmas (flow families) are float32
                timesteps=torch.tensor(timesteps, device=device,
                                       dtype=torch.long if all(isinstance(t, int) for t in timesteps)
                                       else torch.float32),
                noise=torch.stack([n for _, n in draws]).to(device),
                latents=self.latents.to(device),
                conditioning=self.conditioning.to(device),
            )
        return self._fixed[key]


@dataclass(frozen=True)
class FixedInputs:
    timesteps: torch.Tensor  # (N*K,) in pair order
    noise: torch.Tensor  # (N*K, 4, h, w) in pair order
    latents: torch.Tensor  # (N, 4, h, w) on the device
    conditioning: torch.Tensor  # (N, ...) on the device


@dataclass
class Shard:
    """This process' share of a validation pass, and how the processes pool their losses.

    A subset's (item, k) pairs, set after set in pair order, are cut into world_size contiguous, near-equal ranges;
    process r scores range r, set by set in batches of `batch_size` (one latent shape per batch), each pair with its
    fixed timestep and noise of (seed, item id, k). Each process writes its losses at their places in a vector of
    zeros and one all-reduce sums the vectors (x + 0 is exact), so every process gets every pair's loss and the
    same curve (the divergence stop agrees without a broadcast), at 1/world_size of the UNet passes each. The
    batches differ from one process' (the shards cut them), which moves the last bits only, as another batch_size
    does (`measure`)."""

    rank: int = 0
    world_size: int = 1
    sum_over_processes: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # an all-reduce (sum)
    pairs_by_rank: list[int] = field(default_factory=lambda: [0])  # pairs each process scored, this run

    @classmethod
    def of(cls, accelerator: Any) -> Shard:
        """This process' shard under accelerate (one process: every batch)."""
        n = accelerator.num_processes
        if n == 1:
            return cls()

        def sum_over_processes(t: torch.Tensor) -> torch.Tensor:  # NCCL reduces device tensors, gloo CPU ones
            return accelerator.reduce(t.to(accelerator.device), reduction="sum").cpu()

        return cls(accelerator.process_index, n, sum_over_processes, [0] * n)

    def pair_range(self, n_pairs: int) -> tuple[int, int]:
        return n_pairs * self.rank // self.world_size, n_pairs * (self.rank + 1) // self.world_size


def noise_seed(seed: int, item_id: int, k: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{item_id}|{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def fixed_draw(
    seed: int, item_id: int, k: int, num_buckets: int, family: Family, shape
) -> tuple[float, torch.Tensor]:
    """Timestep of bucket k (the family's `fixed_timestep`: a draw inside the k-th of K equal parts of what
    training samples, or a fixed grid point) and its (C, h, w) noise, for one item; both from one generator
    seeded by (seed, item, k)."""
    g = torch.Generator().manual_seed(noise_seed(seed, item_id, k))
    t = family.fixed_timestep(k, num_buckets, g, (int(shape[-2]), int(shape[-1])))
    noise = torch.randn(tuple(shape), generator=g, dtype=torch.float32)
    return t, noise


# no_grad rather than inference_mode: measured no faster here (the tiny model, CPU), and a module that caches a
# tensor during the forward (a lazily built buffer) would hand training an inference tensor it cannot backprop.
@torch.no_grad()
def measure(
    vset: ValidationSet, denoiser: Denoiser, *, num_buckets: int, seed: int, batch_size: int, device: torch.device
) -> tuple[float, list[float]]:
    """(mean loss, per-bucket losses) of the model on one validation set. The denoiser encodes the set's token ids
    when it holds ids (the text encoder trains), and uses its cached hidden states otherwise.

    The (item, k) pairs go through the UNet `batch_size` at a time, in a fixed order and never mixed with another
    set, so the numbers depend on the model, the set, the seed, K and batch_size only. batch_size does change the
    last bits (the CPU kernels sum in another order for another batch shape: up to ~3e-8 relative on the tiny
    model), so it is part of the setting that reproduces a curve.
    """
    mean, per_bucket, _ = measure_subset([vset], denoiser, PairScoring(num_buckets, seed, batch_size, device))
    return mean, per_bucket


@dataclass(frozen=True)
class PairScoring:
    """How a pass scores its (item, k) pairs: K timestep buckets, the noise seed, the pairs per forward, the device.
    Together with the model and the sets, these fix the numbers (batch_size in the last bits: see `measure`)."""

    num_buckets: int
    seed: int
    batch_size: int
    device: torch.device


@torch.no_grad()
def measure_subset(
    vsets: list[ValidationSet], denoiser: Denoiser, scoring: PairScoring, shard: Optional[Shard] = None,
) -> tuple[float, list[float], dict[str, float]]:
    """(mean loss, per-timestep-bucket losses, mean loss per aspect-ratio bucket) of one subset held as several
    sets, one per aspect-ratio bucket. Each set's pairs go through the UNet on their own (one latent shape per
    batch), the sets in the given order; the subset's numbers are then summed over all its pairs in that order, so
    a subset of one set gives exactly what `measure` always gave. `shard`: this process' share of the batches
    (None: one process, every batch); the result is the same on every process."""
    losses = _subset_pair_losses(vsets, denoiser, scoring, shard or Shard())
    num_buckets = scoring.num_buckets
    per_set: dict[str, float] = {}
    start = 0
    for vset in vsets:
        pair_losses = losses[start:start + len(vset) * num_buckets]
        start += len(pair_losses)
        if vset.bucket is not None:
            per_set[vset.bucket] = sum(pair_losses) / len(pair_losses)
    n_items = sum(len(v) for v in vsets)
    bucket_sums = [0.0] * num_buckets
    for p, loss in enumerate(losses):  # every set's pairs are item-major, so pair p is at timestep bucket p % K
        bucket_sums[p % num_buckets] += loss
    per_bucket = [s / n_items for s in bucket_sums]
    return sum(per_bucket) / num_buckets, per_bucket, per_set


def _subset_pair_losses(
    vsets: list[ValidationSet], denoiser: Denoiser, scoring: PairScoring, shard: Shard,
) -> list[float]:
    """The loss of every (item, k) pair of the subset, set after set, each in pair order (float64 values)."""
    if shard.world_size == 1:
        losses: list[float] = []
        for vset in vsets:
            losses += _pair_losses(vset, denoiser, scoring)
        shard.pairs_by_rank[0] += len(losses)
        return losses
    assert shard.sum_over_processes is not None
    n_pairs = [len(v) * scoring.num_buckets for v in vsets]
    first, last = shard.pair_range(sum(n_pairs))
    # The subset's pairs, then one slot per process for the number of pairs it scored: one all-reduce for both.
    pooled = torch.zeros(sum(n_pairs) + shard.world_size, dtype=torch.float64)
    offset = 0
    for vset, n in zip(vsets, n_pairs, strict=True):
        lo, hi = max(first - offset, 0), min(last - offset, n)
        if lo < hi:
            pooled[offset + lo:offset + hi] = torch.tensor(
                _pair_losses(vset, denoiser, scoring, pairs=(lo, hi)), dtype=torch.float64)
        offset += n
    pooled[offset + shard.rank] = last - first
    pooled = shard.sum_over_processes(pooled)
    counts = pooled[offset:].tolist()
    shard.pairs_by_rank = [a + int(b) for a, b in zip(shard.pairs_by_rank, counts, strict=True)]
    return pooled[:offset].tolist()


def _pair_losses(
    vset: ValidationSet, denoiser: Denoiser, scoring: PairScoring, pairs: Optional[tuple[int, int]] = None,
) -> list[float]:
    """The loss of every (item, k) pair of one set, in pair order (float64 values); with `pairs` (lo, hi), of those
    pairs only."""
    num_buckets, batch_size, device = scoring.num_buckets, scoring.batch_size, scoring.device
    fixed = vset.fixed_inputs(scoring.seed, num_buckets, denoiser.family, device)
    lo, hi = pairs or (0, len(vset) * num_buckets)
    per_pair = []
    for start in range(lo, hi, batch_size):
        end = min(start + batch_size, hi)
        idx = torch.arange(start, end, device=device) // num_buckets
        latents, cond = fixed.latents[idx], fixed.conditioning[idx]
        timesteps, noise = fixed.timesteps[start:end], fixed.noise[start:end]
        pred, target = denoiser(latents, noise, timesteps, cond)
        per_pair.append(((pred.float() - target.float()) ** 2).mean(dim=(1, 2, 3)).double())
    # One copy back per pass (no device sync per batch); the caller sums in float64 in pair order.
    return torch.cat(per_pair).cpu().tolist()


def bucket_columns(val_sets: list[ValidationSet]) -> list[str]:
    """The metrics.csv columns of the per-aspect-bucket losses (`val_loss_40x24`, ...): for each subset held in two
    or more buckets, in the order `validate` measures them."""
    by_name: dict[str, list[str]] = {}
    for vset in val_sets:
        if vset.bucket is not None:
            by_name.setdefault(vset.name, []).append(f"{vset.name}_loss_{vset.bucket}")
    return [c for cols in by_name.values() if len(cols) > 1 for c in cols]


# ---------------------------------------------------------------------------------------------------------------
# RNG isolation


@contextmanager
def preserved_rng(extra: tuple[torch.Generator, ...] = ()) -> Iterator[None]:
    """Save every RNG state (Python, NumPy, torch CPU and CUDA, and any given generators) and put it back after."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    gens = [g.get_state() for g in extra]
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        for g, s in zip(extra, gens, strict=True):
            g.set_state(s)


# ---------------------------------------------------------------------------------------------------------------
# Divergence (ramps)


def centred_median(values: list[float], window: int) -> list[float]:
    """Median of each point with its neighbours (window points, centred; shorter at the ends)."""
    half = window // 2
    out = []
    for i in range(len(values)):
        seg = [v for v in values[max(0, i - half) : i + half + 1]]
        out.append(float(np.median(seg)))
    return out


def diverged(values: list[float], factor: float, window: int) -> bool:
    """True when the newest loss is NaN/inf, or the smoothed loss at the newest point exceeds factor x its best.

    Online, only the trailing half of the centred window exists at the newest point, so the check uses the median
    of the last `window` points; one noisy spike does not stop a ramp, a sustained blow-up does.
    """
    if not values:
        return False
    if not np.isfinite(values[-1]):
        return True
    finite = [v for v in values if np.isfinite(v)]
    smoothed = centred_median(finite, window)
    best = min(smoothed)
    latest = float(np.median(finite[-window:]))
    return best > 0 and latest > factor * best
