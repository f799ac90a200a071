"""What the loop trains on: the image stream (which images go into each micro-batch) and the latents of those images.

The stream is the batching model of src/rangefinder/config.py, counted exactly as `plan()` counts it: one seeded
permutation of the training set per epoch, the permutations concatenated and cut into consecutive chunks of
`batch_size * world_size` images (one chunk per micro-batch step, split between the processes). A chunk may
straddle an epoch boundary and the very last one may be partial. With `drop_last` each epoch is cut on its own and
its trailing `n % (batch_size * world_size)` images are skipped. Micro-batch j of the run depends only on (seed, j),
so resuming needs nothing but the number of micro-batches already done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from rangefinder.config import Plan


@dataclass(frozen=True)
class ImageStream:
    train_images: int
    batch_size: int  # per process
    world_size: int
    grad_accum: int
    drop_last: bool
    seed: int
    total_micro_batches: int  # per process == micro-batch steps of the run
    total_images: int  # images in the stream (all processes); the last chunk may be partial

    @classmethod
    def from_plan(cls, p: Plan, seed: int) -> ImageStream:
        return cls(
            train_images=p.train_images,
            batch_size=p.batch_size,
            world_size=p.world_size,
            grad_accum=p.grad_accum,
            drop_last=p.drop_last,
            seed=seed,
            total_micro_batches=p.total_micro_batches,
            total_images=p.images_seen,
        )

    @property
    def chunk(self) -> int:
        return self.batch_size * self.world_size

    @property
    def total_updates(self) -> int:
        return -(-self.total_micro_batches // self.grad_accum)

    def permutation(self, epoch: int) -> np.ndarray:
        return _permutation(self.seed, epoch, self.train_images)

    def micro_batch(self, j: int) -> list[int]:
        """Indices (into the training items) of micro-batch step j, across all processes."""
        n, c = self.train_images, self.chunk
        if self.drop_last:
            per_epoch = n // c
            epoch, k = divmod(j, per_epoch)
            return self.permutation(epoch)[k * c : (k + 1) * c].tolist()
        start, stop = j * c, min((j + 1) * c, self.total_images)
        return [int(self.permutation(p // n)[p % n]) for p in range(start, stop)]

    def local(self, j: int, rank: int) -> list[int]:
        """This process's share of micro-batch j (may be short, or empty, in a partial last chunk)."""
        return self.micro_batch(j)[rank * self.batch_size : (rank + 1) * self.batch_size]

    def update_micro_batches(self, u: int) -> range:
        """Micro-batch steps making up update u (0-based); the last update may have fewer than grad_accum."""
        return range(u * self.grad_accum, min((u + 1) * self.grad_accum, self.total_micro_batches))

    def epochs_after(self, micro_batches_done: int) -> float:
        """Progress in epochs (passes over the training set) after that many micro-batch steps."""
        if self.drop_last:
            return micro_batches_done / (self.train_images // self.chunk)
        return min(micro_batches_done * self.chunk, self.total_images) / self.train_images


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    # A generator of its own per (seed, epoch): the order never depends on the global RNG or on what ran before.
    return np.random.default_rng([seed, epoch]).permutation(n)


# ---------------------------------------------------------------------------------------------------------------
# Latents of a micro-batch


class LatentSource:
    """(B, 4, h, w) scaled latents for training items, flipped or not."""

    def get(self, indices: Sequence[int], flips: Sequence[bool], device: torch.device) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class CachedLatents(LatentSource):
    latents: torch.Tensor  # (N, 4, h, w), scaled, on CPU
    flipped: Optional[torch.Tensor] = None  # (N, 4, h, w) latents of the mirrored images, when flip is on

    def get(self, indices: Sequence[int], flips: Sequence[bool], device: torch.device) -> torch.Tensor:
        rows = [
            (self.flipped[i] if f and self.flipped is not None else self.latents[i])
            for i, f in zip(indices, flips, strict=True)
        ]
        return torch.stack(rows).to(device)


@dataclass
class EncodedOnTheFly(LatentSource):
    """Without the cache: load, preprocess and VAE-encode each micro-batch (what caching saves)."""

    paths: list[Path]
    keys: list[str]  # content hash of each image (seeds the latent sample when latent_sampling == "sample")
    encode: Callable[[torch.Tensor, list[str]], torch.Tensor]  # (B, 3, H, W) pixels, seeds -> (B, 4, h, w)
    load: Callable[[Path], np.ndarray]  # path -> (3, H, W) in [-1, 1]

    def get(self, indices: Sequence[int], flips: Sequence[bool], device: torch.device) -> torch.Tensor:
        arrays = []
        for i, f in zip(indices, flips, strict=True):
            a = self.load(self.paths[i])
            arrays.append(np.ascontiguousarray(a[:, :, ::-1]) if f else a)
        pixels = torch.from_numpy(np.stack(arrays))
        keys = [self.keys[i] + ("/flip" if f else "") for i, f in zip(indices, flips, strict=True)]
        return self.encode(pixels, keys).to(device)
