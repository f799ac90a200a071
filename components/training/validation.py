"""Deterministic validation loss: the measurement the LR range test and the step window rest on (DESIGN.md).

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
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import torch


@dataclass
class ValidationSet:
    name: str  # "val" or "stabilize"
    ids: list[int]  # stable item ids from the split (seed the noise)
    latents: torch.Tensor  # (N, 4, h, w) scaled latents, CPU
    conditioning: torch.Tensor  # (N, 77, D) cached hidden states, or (N, 77) token ids when the encoder trains

    def __len__(self) -> int:
        return len(self.ids)


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
    states when the set holds ids (text encoder trains); None when it holds cached hidden states."""
    T = noise_scheduler.config.num_train_timesteps
    pairs = [(i, k) for i in range(len(vset)) for k in range(num_buckets)]
    bucket_sums = [0.0] * num_buckets
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        idx = [i for i, _ in chunk]
        draws = [fixed_draw(seed, vset.ids[i], k, num_buckets, T, vset.latents.shape[1:]) for i, k in chunk]
        latents = vset.latents[idx].to(device)  # (B, 4, h, w)
        timesteps = torch.tensor([t for t, _ in draws], dtype=torch.long, device=device)
        noise = torch.stack([n for _, n in draws]).to(device)
        cond = vset.conditioning[idx].to(device)
        with autocast():
            hidden = encode(cond) if encode is not None else cond
            noisy = noise_scheduler.add_noise(latents, noise, timesteps)
            pred = unet(noisy, timesteps, hidden.to(noisy.dtype), return_dict=False)[0]
        target = noise if prediction_type == "epsilon" else noise_scheduler.get_velocity(latents, noise, timesteps)
        per_pair = ((pred.float() - target.float()) ** 2).mean(dim=(1, 2, 3))  # (B,)
        # Sum in float64 in pair order: the mean does not depend on how the pairs were batched beyond the forward.
        for (_, k), loss in zip(chunk, per_pair.double().cpu().tolist()):
            bucket_sums[k] += loss
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
