"""Encode once: VAE latents and text embeddings, cached on disk and keyed by content.

An entry's key is a hash of what determines it, never of a path or a run: a latent is keyed by the image file's
bytes under a folder keyed by the VAE's weights and config and the preprocessing (square resolution or aspect-ratio
bucket, crop, mode or seeded sample); a text embedding is keyed by its token ids under a folder keyed by the text
encoder's weights. So the LR range test, the fine-tune and the retrain of a pipeline (and the train+val retrain,
which needs the same images) encode each image once, and a changed image or base model can never be served a stale
entry.

Layout: `<cache_root>/latents/<setting key>/<image sha256>.safetensors` holding `latent` (4, h, w) and, once a run
with flipping has needed it, `flipped` (the mirrored image's latent: mirroring a latent is not the latent of the
mirrored image); `<cache_root>/text/<encoder key>/<ids hash>.safetensors` holding `hidden` (77, D). Each file is
written to a temporary name and renamed, so concurrent or killed writers never leave a torn entry, and a killed
caching run keeps every entry it finished. Entries are written batch by batch and the training ones read back per
micro-batch (CachedLatentFiles, CachedTextFiles), so memory does not grow with the dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from rangefinder.errors import DataError
from rangefinder.formats.atomic import atomic_path, usable_folder
from rangefinder.training.data import LatentSource
from rangefinder.training.disk import disk_problem

CACHE_VERSION = "2"  # bump when the meaning of an entry changes (2: pixels with an ICC profile converted to sRGB)
# The way out of a cache whose disk refuses a write, besides freeing space there (disk.disk_problem's `elsewhere`).
_CACHE_ELSEWHERE = "or point training.cache_dir (or $RANGEFINDER_CACHE) at another disk"

# What reading an entry raises when the file is the problem: OSError when deleted, SafetensorError when torn, damaged
# or foreign. Nothing else is the file's: a Ctrl-C that lands inside a read comes out as torch's ValueError
# (errors.on_sigint), which must not be taken for a bad entry.
UNREADABLE_ENTRY = (OSError, SafetensorError)


def cache_root(configured: Optional[str] = None) -> Path:
    """training.cache_dir, else $RANGEFINDER_CACHE, else ~/.cache/rangefinder (shared with the embedded model)."""
    if configured:
        return usable_folder(configured, "training.cache_dir") / "encoded"
    if os.environ.get("RANGEFINDER_CACHE"):
        return usable_folder(os.environ["RANGEFINDER_CACHE"], "$RANGEFINDER_CACHE") / "encoded"
    return usable_folder(Path.home() / ".cache" / "rangefinder", "the cache folder") / "encoded"


def module_fingerprint(module: torch.nn.Module) -> str:
    """Hash of a module's class, config and every tensor's name, dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(module).__name__.encode())
    config = getattr(module, "config", None)
    if config is not None:
        as_dict = dict(config) if not hasattr(config, "to_dict") else config.to_dict()
        h.update(json.dumps(as_dict, sort_keys=True, default=str).encode())
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _key(*parts: object) -> str:
    return hashlib.blake2b("|".join(map(str, (CACHE_VERSION,) + parts)).encode(), digest_size=12).hexdigest()


@dataclass
class CacheStats:
    encoded: int = 0
    reused: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"encoded": self.encoded, "reused": self.reused}


# ---------------------------------------------------------------------------------------------------------------
# Latents


class VaeEncoder:
    """Pixels -> scaled latents, with the distribution's mode or a sample seeded by the image's content hash."""

    # vae: a diffusers AutoencoderKL. Typed Any: for mypy, `from diffusers import AutoencoderKL` is diffusers' dummy
    # placeholder class (its __init__ picks those when it cannot see torch), so the real type would hide every method.
    def __init__(self, vae: Any, device: torch.device, sampling: str, seed: int) -> None:
        self.vae, self.device, self.sampling, self.seed = vae, device, sampling, seed
        self.scaling = float(vae.config.scaling_factor)
        shift = getattr(vae.config, "shift_factor", None)
        self.shift = float(shift) if shift is not None else 0.0
        self.fingerprint = module_fingerprint(vae)

    @torch.no_grad()
    def __call__(self, pixels: torch.Tensor, keys: Sequence[str]) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, 4, H/8, W/8) fp32 on CPU."""
        dtype = next(self.vae.parameters()).dtype
        dist = self.vae.encode(pixels.to(self.device, dtype)).latent_dist
        if self.sampling == "mode":
            z = dist.mode()
        else:
            # One generator per image, seeded by its content: the same image gets the same sample in every run.
            eps = torch.stack(
                [torch.randn(dist.mean.shape[1:], generator=_seeded(self.seed, k), dtype=torch.float32) for k in keys]
            )
            z = dist.mean + dist.std * eps.to(dist.mean.device, dist.mean.dtype)
        return ((z.float() - self.shift) * self.scaling).cpu()


def _seeded(seed: int, key: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}|{key}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def latent_cache_dir(
    root: Path, encoder: VaeEncoder, resolution: int, center_crop: bool, bucket: Optional[tuple[int, int]] = None
) -> Path:
    """The folder of one preprocessing setting's latents: a square of `resolution`, or one aspect-ratio `bucket`
    (width, height) px, into which each image is resized and cropped from its own size (data/buckets.py)."""
    seed = encoder.seed if encoder.sampling == "sample" else None
    if bucket is None:
        return root / "latents" / _key(encoder.fingerprint, resolution, center_crop, encoder.sampling, seed)
    return root / "latents" / _key(encoder.fingerprint, "bucket", *bucket, center_crop, encoder.sampling, seed)


@dataclass
class LatentCache:
    """The latents of image files under one setting's folder (latent_cache_dir), encoding only images not there yet."""

    encoder: VaeEncoder
    load: Callable[[Path], np.ndarray]  # path -> (3, H, W) pixels in [-1, 1] at the setting's resolution and crop
    folder: Path
    stats: CacheStats = field(default_factory=CacheStats)
    batch_size: int = 8  # images per VAE forward

    def entry_path(self, key: str) -> Path:
        return self.folder / f"{key}.safetensors"

    def ensure(self, paths: Sequence[Path], keys: Sequence[str], *, flipped: bool, progress: bool = True) -> None:
        """Encode and write every image whose entry is missing (or lacks its mirrored latent when `flipped`).

        Nothing is kept in memory beyond one VAE batch, so 100,000 images cache in the memory of eight. Each entry is
        its own file, renamed into place when whole: a run killed while caching keeps every entry it finished, and
        the next run (or another step sharing the cache) encodes only the rest. A progress bar counts the images to
        encode (on stderr; a pod's log shows it too).
        """
        wanted = ("latent", "flipped") if flipped else ("latent",)
        todo: dict[str, int] = {}  # one encode per distinct image
        for i, k in enumerate(keys):
            if k not in todo and not _has(self.entry_path(k), wanted):
                todo[k] = i
        self.stats.reused += len(keys) - len(todo)
        if not todo:
            return
        from tqdm.auto import tqdm

        order = sorted(todo.values())
        with tqdm(total=len(order), desc="encode latents", unit="image", disable=not progress,
                  dynamic_ncols=True, mininterval=2.0) as bar:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                arrays = [self.load(paths[i]) for i in chunk]
                z = self.encoder(torch.from_numpy(np.stack(arrays)), [keys[i] for i in chunk])
                zf = None
                if flipped:
                    mirrored = np.stack([np.ascontiguousarray(a[:, :, ::-1]) for a in arrays])
                    zf = self.encoder(torch.from_numpy(mirrored), [keys[i] + "/flip" for i in chunk])
                for j, i in enumerate(chunk):
                    # Another run sharing the cache may have written the entry since the look above, one with the
                    # mirrored latent this run does not need: written over, the other's training found it gone.
                    if _has(self.entry_path(keys[i]), wanted):
                        continue
                    entry = {"latent": z[j].clone()}
                    if zf is not None:
                        entry["flipped"] = zf[j].clone()
                    _write_entry(self.entry_path(keys[i]), entry)
                self.stats.encoded += len(chunk)
                bar.update(len(chunk))

    def latents(
        self, paths: Sequence[Path], keys: Sequence[str], *, flipped: bool, progress: bool = True
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(N, 4, h, w) latents for the images (and of their mirror images when `flipped`); `keys` are the images'
        content hashes. Encodes what is missing (`ensure`), then reads the entries into one tensor."""
        self.ensure(paths, keys, flipped=flipped, progress=progress)
        return self.read(keys, flipped=flipped)

    def read(self, keys: Sequence[str], *, flipped: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(N, 4, h, w) latents (and mirrored ones) of entries already in the folder, read into one tensor each."""
        latents: Optional[torch.Tensor] = None
        mirrored: Optional[torch.Tensor] = None
        for r, k in enumerate(keys):
            entry = _try_load(self.entry_path(k))
            if entry is None:
                raise DataError(f"latent cache entry {self.entry_path(k)} vanished while it was read (was the cache "
                                "cleared?); run again to encode it")
            if latents is None:  # filled in place: never a list of N tensors and their stack at once
                latents = torch.empty((len(keys), *entry["latent"].shape), dtype=entry["latent"].dtype)
                mirrored = torch.empty_like(latents) if flipped else None
            latents[r] = entry["latent"]
            if mirrored is not None:
                mirrored[r] = entry["flipped"]
        if latents is None:
            return torch.empty(0), (torch.empty(0) if flipped else None)
        return latents, mirrored


@dataclass
class CachedLatentFiles(LatentSource):
    """Training latents read from the cache's entries per micro-batch, so memory does not grow with the set (at 512
    px a latent is 64 KiB: 100,000 images, with their mirrored latents, would hold 13 GB). Reading a few 64 KiB
    files per micro-batch, from the page cache once read, is small next to a UNet step."""

    files: list[Path]  # each training item's cache entry (LatentCache.entry_path)

    def get(self, indices: Sequence[int], flips: Sequence[bool], device: torch.device) -> torch.Tensor:
        rows = [_read_tensor(self.files[i], "flipped" if flip else "latent")
                for i, flip in zip(indices, flips, strict=True)]
        return torch.stack(rows).to(device)


def _write_entry(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """One cache entry, whole or absent (formats/atomic.py): concurrent or killed writers never leave a torn one. A
    write the file system refuses (a full disk) is one sentence naming the cache folder (disk.py's rule); the entries
    already written stay, and the next run encodes only the rest."""
    try:
        with atomic_path(path, durable=False) as tmp:  # a torn entry is encoded again (_has, _try_load)
            # safetensors refuses non-contiguous tensors (a latent's row of a strided batch); metadata as exports
            # write it.
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={})
    except (OSError, SafetensorError) as e:
        problem = disk_problem("the encoded-data cache", path.parent, e, elsewhere=_CACHE_ELSEWHERE,
                               again="then run again (the entries written so far are kept)")
        if problem is None:
            raise
        raise problem from None


def _has(path: Path, wanted: Sequence[str]) -> bool:
    """Whether the entry holds every tensor in `wanted`; reads only the file's header."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return all(w in f.keys() for w in wanted)
    except UNREADABLE_ENTRY:  # a torn or foreign file: encode again and overwrite it
        return False


def _try_load(path: Path) -> Optional[dict[str, torch.Tensor]]:
    if not path.is_file():
        return None
    try:
        return load_file(str(path))
    except UNREADABLE_ENTRY:  # a file from an older writer or another format: encode again and overwrite it
        return None


# ---------------------------------------------------------------------------------------------------------------
# Text


def tokenize(tokenizer, captions: Sequence[str]) -> torch.Tensor:
    """(N, 77) token ids, padded and truncated to the tokenizer's length as SD 1.x was trained."""
    # A tokenizer saved without its length reports a huge sentinel; CLIP's context is 77 tokens.
    length = tokenizer.model_max_length if tokenizer.model_max_length < 100_000 else 77
    tokens = tokenizer(list(captions), padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    return tokens.input_ids


@torch.no_grad()
def ensure_text_embeddings(
    input_ids: torch.Tensor,
    encode: Callable[[torch.Tensor], torch.Tensor],
    folder: Path,
    device: torch.device,
    *,
    batch_size: int = 32,
    stats: Optional[CacheStats] = None,
) -> list[Path]:
    """The cache entry of each row of (N, 77) ids, encoding (one batch at a time, nothing kept) each distinct
    caption not cached yet."""
    stats = stats if stats is not None else CacheStats()
    keys = [hashlib.blake2b(row.numpy().tobytes(), digest_size=16).hexdigest() for row in input_ids]
    paths = [folder / f"{k}.safetensors" for k in keys]
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    todo = [i for k, i in first.items() if not _has(paths[i], ("hidden",))]
    stats.reused += len(first) - len(todo)
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        hidden = encode(input_ids[chunk].to(device)).float().cpu()
        for j, i in enumerate(chunk):
            _write_entry(paths[i], {"hidden": hidden[j].clone()})
        stats.encoded += len(chunk)
    return paths


@torch.no_grad()
def cached_text_embeddings(
    input_ids: torch.Tensor,
    encode: Callable[[torch.Tensor], torch.Tensor],
    folder: Path,
    device: torch.device,
    *,
    batch_size: int = 32,
    stats: Optional[CacheStats] = None,
) -> torch.Tensor:
    """(N, 77, D) fp32 hidden states for (N, 77) ids, encoding each distinct caption once ever."""
    paths = ensure_text_embeddings(input_ids, encode, folder, device, batch_size=batch_size, stats=stats)
    return _read_text(paths)


def _read_text(paths: Sequence[Path]) -> torch.Tensor:
    out: Optional[torch.Tensor] = None
    for r, path in enumerate(paths):
        hidden = _read_tensor(path, "hidden")
        if out is None:
            out = torch.empty((len(paths), *hidden.shape), dtype=hidden.dtype)
        out[r] = hidden
    return out if out is not None else torch.empty(0)


def _read_tensor(path: Path, name: str) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)
    except UNREADABLE_ENTRY as e:
        raise DataError(f"cache entry {path} cannot be read any more ({e}); the cache was cleared or damaged during "
                        "the run: resume it (training.resume) to encode it again") from None


@dataclass
class CachedTextFiles:
    """The training captions' hidden states, read from their cache entries per micro-batch: at SD 1.x's 77 x 768
    fp32 a caption is 231 KiB, so 100,000 captions held at once would be 22 GiB."""

    files: list[Path]  # each training item's entry (ensure_text_embeddings)

    def cond(self, indices: Sequence[int], gen: torch.Generator) -> torch.Tensor:
        """(B, 77, D) fp32 on the CPU; `gen` is unused (the captions are fixed), as the loop calls every source."""
        return torch.stack([_read_tensor(self.files[i], "hidden") for i in indices])


def text_cache_dir(root: Path, *text_encoders: torch.nn.Module) -> Path:
    """The folder of the encoders' embeddings (a family with two encoders: keyed by both)."""
    return root / "text" / _key(*(module_fingerprint(te) for te in text_encoders))
