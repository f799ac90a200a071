"""What the loop trains on: the image stream (which images go into each micro-batch) and the latents of those images.

The stream is the batching model of src/rangefinder/config.py, counted exactly as `plan()` counts it: one seeded
permutation of the training set per epoch, the permutations concatenated and cut into consecutive chunks of
`batch_size * world_size` images (one chunk per micro-batch step, split between the processes). A chunk may
straddle an epoch boundary and the very last one may be partial. With `drop_last` each epoch is cut on its own and
its trailing `n % (batch_size * world_size)` images are skipped. Micro-batch j of the run depends only on (seed, j),
so resuming needs nothing but the number of micro-batches already done.

With two or more aspect-ratio buckets (data/buckets.py) a micro-batch must hold images of one shape, so
`BucketedStream` draws instead, as kohya's sd-scripts does (library/train_util.py, `BaseDataset.make_buckets` and
`shuffle_buckets`): each epoch, every bucket is shuffled and cut into chunks on its own (its last chunk partial, or
skipped with `drop_last`), and the chunks of all buckets are shuffled together. An epoch is still every image once;
a chunk never straddles epochs. Both streams answer the same questions (`micro_batch`, `local`, ...), and
`make_stream` picks one: a set of one shape keeps the plain stream, so bucketing square images changes nothing.

`micro_batch(j)` is the one place that decides which images micro-batch j holds; `local(j, rank)` shares it between
the processes, the layer a per-rank sampler replaces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from rangefinder.planning import Plan


@dataclass(frozen=True)
class _Batching:
    """What both streams share: micro-batch step j is a chunk of `batch_size * world_size` images, shared between the
    processes, and an update is `grad_accum` steps."""

    batch_size: int  # per process
    world_size: int
    grad_accum: int
    drop_last: bool
    seed: int
    total_micro_batches: int  # per process == micro-batch steps of the run

    @property
    def chunk(self) -> int:
        return self.batch_size * self.world_size

    @property
    def total_updates(self) -> int:
        return -(-self.total_micro_batches // self.grad_accum)

    def micro_batch(self, j: int) -> list[int]:
        """Indices (into the training items) of micro-batch step j, across all processes: each stream draws its own."""
        raise NotImplementedError

    def local(self, j: int, rank: int) -> list[int]:
        """This process's share of micro-batch j (may be short, or empty, in a partial chunk: the stream's last, or
        a bucket's last in an epoch)."""
        return self.micro_batch(j)[rank * self.batch_size : (rank + 1) * self.batch_size]

    def update_micro_batches(self, u: int) -> range:
        """Micro-batch steps making up update u (0-based); the last update may have fewer than grad_accum."""
        return range(u * self.grad_accum, min((u + 1) * self.grad_accum, self.total_micro_batches))


@dataclass(frozen=True)
class ImageStream(_Batching):
    train_images: int
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

    def epochs_after(self, micro_batches_done: int) -> float:
        """Progress in epochs (passes over the training set) after that many micro-batch steps."""
        if self.drop_last:
            return micro_batches_done / (self.train_images // self.chunk)
        return min(micro_batches_done * self.chunk, self.total_images) / self.train_images


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    # A generator of its own per (seed, epoch): the order never depends on the global RNG or on what ran before.
    return np.random.default_rng([seed, epoch]).permutation(n)


@dataclass(frozen=True)
class BucketedStream(_Batching):
    """Micro-batches of one aspect-ratio bucket each (see the module docstring); counted as `plan()` counts them
    when given `bucket_counts`."""

    bucket_of: tuple[int, ...]  # the bucket (an index) of each training item
    _epochs: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # the newest epochs' chunks
    # The training items of each bucket, in item order; computed once.
    members: list[np.ndarray] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        of = np.asarray(self.bucket_of)
        self.members.extend(np.flatnonzero(of == b) for b in range(int(of.max()) + 1))

    @classmethod
    def from_plan(cls, p: Plan, seed: int, bucket_of: Sequence[int]) -> BucketedStream:
        return cls(bucket_of=tuple(bucket_of), batch_size=p.batch_size, world_size=p.world_size,
                   grad_accum=p.grad_accum, drop_last=p.drop_last, seed=seed, total_micro_batches=p.total_micro_batches)

    @property
    def train_images(self) -> int:
        return len(self.bucket_of)

    @property
    def micro_batches_per_epoch(self) -> int:
        c = self.chunk
        sizes = [len(m) for m in self.members]
        return sum(n // c for n in sizes) if self.drop_last else sum(-(-n // c) for n in sizes)

    def epoch_chunks(self, epoch: int) -> list[list[int]]:
        """The chunks (item indices, one bucket each) of `epoch`, in the order they are trained."""
        if epoch not in self._epochs:
            # One generator per (seed, epoch), as the plain stream: independent of the global RNG and of the past.
            rng = np.random.default_rng([self.seed, epoch])
            c, chunks = self.chunk, []
            for members in self.members:
                order = members[rng.permutation(len(members))]
                stop = len(order) - len(order) % c if self.drop_last else len(order)
                chunks += [order[i : min(i + c, stop)].tolist() for i in range(0, stop, c)]
            if len(self._epochs) >= 2:  # the loop moves forward; an update straddling epochs reads two
                del self._epochs[min(self._epochs)]
            self._epochs[epoch] = [chunks[k] for k in rng.permutation(len(chunks))]
        return self._epochs[epoch]

    def micro_batch(self, j: int) -> list[int]:
        """Indices (into the training items) of micro-batch step j, across all processes; one bucket."""
        epoch, k = divmod(j, self.micro_batches_per_epoch)
        return self.epoch_chunks(epoch)[k]

    def epochs_after(self, micro_batches_done: int) -> float:
        """Progress in epochs after that many micro-batch steps: whole epochs plus the share of the epoch's images
        seen so far."""
        epoch, k = divmod(micro_batches_done, self.micro_batches_per_epoch)
        if k == 0:
            return float(epoch)
        chunks = self.epoch_chunks(epoch)
        return epoch + sum(len(x) for x in chunks[:k]) / sum(len(x) for x in chunks)


Stream = Union[ImageStream, BucketedStream]


def make_stream(p: Plan, seed: int, bucket_of: Optional[Sequence[int]] = None) -> Stream:
    """The plan's stream: bucketed when the training items span two or more buckets (`bucket_of`), else plain."""
    if bucket_of is not None and len(set(bucket_of)) >= 2:
        return BucketedStream.from_plan(p, seed, bucket_of)
    return ImageStream.from_plan(p, seed)


# ---------------------------------------------------------------------------------------------------------------
# Latents of a micro-batch


class LatentSource:
    """(B, 4, h, w) scaled latents for training items, flipped or not."""

    def get(self, indices: Sequence[int], flips: Sequence[bool], device: torch.device) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class EncodedOnTheFly(LatentSource):
    """Without the cache: load, preprocess and VAE-encode each micro-batch (what caching saves)."""

    paths: list[Path]
    keys: list[str]  # content hash of each image (seeds the latent sample when latent_sampling == "sample")
    encode: Callable[[torch.Tensor, list[str]], torch.Tensor]  # (B, 3, H, W) pixels, seeds -> (B, 4, h, w)
    load: Callable[[Path], np.ndarray]  # path -> (3, H, W) in [-1, 1], at the image's bucket when bucketed

    def get(self, indices: Sequence[int], flips: Sequence[bool], device: torch.device) -> torch.Tensor:
        arrays = []
        for i, f in zip(indices, flips, strict=True):
            a = self.load(self.paths[i])
            arrays.append(np.ascontiguousarray(a[:, :, ::-1]) if f else a)
        pixels = torch.from_numpy(np.stack(arrays))
        keys = [self.keys[i] + ("/flip" if f else "") for i, f in zip(indices, flips, strict=True)]
        return self.encode(pixels, keys).to(device)
