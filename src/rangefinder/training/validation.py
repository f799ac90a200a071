"""Deterministic validation loss: the measurement the LR range test and the step window rest on.

See docs/design.md, section 2 ("Deterministic validation").

Each item is scored at K stratified timesteps, one drawn inside each 1/K of the noise schedule, each with fixed
noise; timestep and noise come from a generator seeded by (seed, item id, k) and never from the global RNG. Latents
are the cached mode (or seeded sample), never flipped; captions are never dropped. The loss is the plain MSE
against the model's target (epsilon or v), unweighted, so the same model gives the same numbers bit for bit on
CPU. Every RNG the forward pass could touch is saved and restored around the measurement, so validating never
changes what training does.
"""

from __future__ import annotations

import hashlib
import random
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import numpy as np
import torch


@dataclass
class ValidationSet:
    name: str  # "val" or "stabilize"
    ids: list[int]  # stable item ids from the split (seed the noise)
    latents: torch.Tensor  # (N, 4, h, w) scaled latents, CPU
    conditioning: torch.Tensor  # (N, 77, D) cached hidden states, or (N, 77) token ids when the encoder trains
    # The fixed inputs of every pass, built on the first one and kept: the draws depend only on (seed, id, k), so
    # they never change during a run, and the set's tensors need not be copied to the device again each pass.
    _fixed: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.ids)

    def fixed_inputs(self, seed: int, num_buckets: int, num_timesteps: int, device: torch.device) -> "FixedInputs":
        key = (seed, num_buckets, num_timesteps, str(device))
        if key not in self._fixed:
            # (item, k) pairs item-major: pair p is item p // K at bucket p % K.
            draws = [fixed_draw(seed, i, k, num_buckets, num_timesteps, self.latents.shape[1:])
                     for i in self.ids for k in range(num_buckets)]
            self._fixed.clear()  # one setting per run; never keep a stale copy on the device
            self._fixed[key] = FixedInputs(
                timesteps=torch.tensor([t for t, _ in draws], dtype=torch.long, device=device),
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


def noise_seed(seed: int, item_id: int, k: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{item_id}|{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def fixed_draw(seed: int, item_id: int, k: int, num_buckets: int, num_timesteps: int, shape) -> tuple[int, torch.Tensor]:
    """Timestep inside bucket k (of num_buckets equal parts of [0, T)) and its (4, h, w) noise, for one item."""
    g = torch.Generator().manual_seed(noise_seed(seed, item_id, k))
    lo, hi = k * num_timesteps // num_buckets, (k + 1) * num_timesteps // num_buckets
    t = lo + int(torch.randint(0, max(1, hi - lo), (1,), generator=g))
    noise = torch.randn(tuple(shape), generator=g, dtype=torch.float32)
    return t, noise


# no_grad rather than inference_mode: measured no faster here (the tiny model, CPU), and a module that caches a
# tensor during the forward (a lazily built buffer) would hand training an inference tensor it cannot backprop.
@torch.no_grad()
def measure(
    vset: ValidationSet,
    *,
    unet: torch.nn.Module,
    encode: Optional[Callable[[torch.Tensor], torch.Tensor]],
    noise_scheduler,
    prediction_type: str,
    num_buckets: int,
    seed: int,
    batch_size: int,
    device: torch.device,
    autocast: Callable = nullcontext,  # accelerator.autocast under mixed precision
) -> tuple[float, list[float]]:
    """(mean loss, per-bucket losses) of the model on one validation set. `encode` turns token ids into hidden
    states when the set holds ids (text encoder trains); None when it holds cached hidden states.

    The (item, k) pairs go through the UNet `batch_size` at a time, in a fixed order and never mixed with another
    set, so the numbers depend on the model, the set, the seed, K and batch_size only. batch_size does change the
    last bits (the CPU kernels sum in another order for another batch shape: up to ~3e-8 relative on the tiny
    model), so it is part of the setting that reproduces a curve.
    """
    T = noise_scheduler.config.num_train_timesteps
    fixed = vset.fixed_inputs(seed, num_buckets, T, device)
    n_pairs = len(vset) * num_buckets
    per_pair = []
    for start in range(0, n_pairs, batch_size):
        end = min(start + batch_size, n_pairs)
        idx = torch.arange(start, end, device=device) // num_buckets
        latents, cond = fixed.latents[idx], fixed.conditioning[idx]
        timesteps, noise = fixed.timesteps[start:end], fixed.noise[start:end]
        with autocast():
            hidden = encode(cond) if encode is not None else cond
            noisy = noise_scheduler.add_noise(latents, noise, timesteps)
            pred = unet(noisy, timesteps, hidden.to(noisy.dtype), return_dict=False)[0]
        target = noise if prediction_type == "epsilon" else noise_scheduler.get_velocity(latents, noise, timesteps)
        per_pair.append(((pred.float() - target.float()) ** 2).mean(dim=(1, 2, 3)).double())
    # One copy back per pass (no device sync per batch); then sum in float64 in pair order, as before.
    losses = torch.cat(per_pair).cpu().tolist()
    bucket_sums = [0.0] * num_buckets
    for p, loss in enumerate(losses):
        bucket_sums[p % num_buckets] += loss
    per_bucket = [s / len(vset) for s in bucket_sums]
    return sum(per_bucket) / num_buckets, per_bucket


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
        for g, s in zip(extra, gens):
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
