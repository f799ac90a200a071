"""The data act of setting up a run: the latents (at the run's resolution and crop, or each image's aspect-ratio
bucket) and the text conditioning of the training and validation items, encoded once per dataset and base model
into the content-keyed caches (caching.py), as `EncodedData` (run.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import torch

from rangefinder.config import DataConfig
from rangefinder.data.buckets import Placement, Size, bucket_array, bucket_name, image_size
from rangefinder.errors import DataError
from rangefinder.training import geometry as size_rules
from rangefinder.training.caching import (
    CachedLatentFiles,
    CachedTextFiles,
    CacheStats,
    LatentCache,
    VaeEncoder,
    cache_root,
    cached_text_embeddings,
    ensure_text_embeddings,
    latent_cache_dir,
    text_cache_dir,
)
from rangefinder.training.captions import ShuffledCaptions
from rangefinder.training.data import EncodedOnTheFly, LatentSource
from rangefinder.training.family import Family, ImageGeometry
from rangefinder.training.run import EncodedData, RunSettings
from rangefinder.training.setup import move_module
from rangefinder.training.validation import ValidationSet

if TYPE_CHECKING:
    from accelerate import Accelerator

    from rangefinder.data.dataset import Item
    from rangefinder.models.loading import SDComponents


def encode_data(settings: RunSettings, sd: SDComponents, family: Family, accelerator: Accelerator,
                data: DataConfig) -> EncodedData:
    """Latents (at `data`'s resolution and crop, or each image's aspect-ratio bucket) and text conditioning of the
    training and validation items, from the content-keyed cache where they were encoded before."""
    from rangefinder.data.pixels import load_rgb, to_model_array

    placements = settings.placements
    bucket_of_path: dict[Path, Size] = {}
    if placements is not None:
        check_bucket_sides(sd, family, {p.bucket for p in placements.values()}, data)
        items = settings.train_items + settings.val_items["val"] + settings.val_items["stabilize"]
        bucket_of_path = {settings.split.path_of(it): placements[it.id].bucket for it in items}

    def load_array(path: Path) -> np.ndarray:  # (3, H, W) in [-1, 1]
        try:
            img = load_rgb(path)
        except (OSError, ValueError) as e:  # deleted or broken after the run checked it (PIL's errors are OSErrors)
            raise DataError(f"image {path} cannot be read any more ({e}); put it back, or split the dataset again "
                            "(`rangefinder split`) and start the run again") from None
        if placements is None:
            return to_model_array(img, data.resolution, data.center_crop)
        # Resized and cropped from the file's real size into the bucket the split's record of it chose.
        return bucket_array(img, bucket_of_path[path], data.center_crop)

    cfg, device = settings.cfg, accelerator.device
    check_resolution(family, sd, data)
    encoder = VaeEncoder(sd.vae, device, cfg.latent_sampling, cfg.seed)
    root = cache_root(cfg.cache_dir)
    stats = CacheStats()

    def cache_for(bucket: Optional[Size]) -> LatentCache:  # the latent cache is keyed by bucket
        return LatentCache(encoder, load_array, latent_cache_dir(root, encoder, data.resolution, data.center_crop,
                                                                 bucket=bucket), stats=stats)

    with accelerator.main_process_first():  # one process encodes, the others then read the cache
        train_latents, val_latents = _encode_latents(settings, cache_for)
        if cfg.cache_latents:  # the VAE is not needed again; give its memory back
            move_module(sd.vae, torch.device("cpu"))
        text = _encode_text(settings, sd, family, device, root, data)
    # One validation set per subset and bucket (the same shape throughout, so its passes batch); sets of one
    # subset are measured together and reported per bucket (loop.validate).
    val_sets = []
    for name, items in settings.val_items.items():
        rows_of: dict[Optional[Size], list[int]] = {}
        for r, it in enumerate(items):
            rows_of.setdefault(None if placements is None else placements[it.id].bucket, []).append(r)
        for bucket, rows in sorted(rows_of.items(), key=lambda kv: kv[0] or (0, 0)):
            index = torch.tensor(rows, dtype=torch.long)
            val_sets.append(ValidationSet(name, [items[r].id for r in rows], val_latents[name, bucket],
                                          text.val_cond[name][index] if len(rows) < len(items) else text.val_cond[name],
                                          bucket=None if bucket is None else bucket_name(bucket)))
    return EncodedData(data, train_latents, text.train_cond, text.empty_cond, val_sets, stats, text.stats,
                       text.train_text, text.train_geometry)


def check_resolution(family: Family, sd: SDComponents, data: DataConfig) -> None:
    """A training resolution below what the model family supports, or a transformer's off its patch grid, is a
    ConfigError (geometry.check_resolution, which resolve-config's preflight applies too)."""
    size_rules.check_resolution(size_rules.ModelGeometry.loaded(family, sd), data)


def image_geometry(path: Path, data: DataConfig, placement: Optional[Placement] = None) -> ImageGeometry:
    """An item's original size, crop and target size (SDXL's size conditioning, as diffusers'
    train_text_to_image_sdxl.py computes them): from its aspect-ratio bucket placement when bucketed (the split's
    record: size, bucket, crop), else the file's size, the centre crop's top-left corner in the image resized to
    cover the square (0, 0 when the image is squashed, not cropped) and the square training resolution."""
    if placement is not None:
        (w, h), (bw, bh), (left, top) = placement.size, placement.bucket, placement.crop
        return ImageGeometry(original_hw=(h, w), crop_top_left=(top, left), target_hw=(bh, bw))
    # Upright, as load_rgb turns the pixels: a phone photo stored landscape with an EXIF rotation is a portrait.
    width, height = image_size(path)
    res = data.resolution
    top = left = 0
    if data.center_crop:
        scale = res / min(width, height)
        top, left = max(0, round((height * scale - res) / 2)), max(0, round((width * scale - res) / 2))
    return ImageGeometry(original_hw=(height, width), crop_top_left=(top, left), target_hw=(res, res))


def check_bucket_sides(sd: SDComponents, family: Family, buckets: set[Size], data: DataConfig) -> None:
    """ConfigError unless every bucket the images landed in fits the model (geometry.check_bucket_sides): known only
    once the split is placed, so checked here; the preflight refuses only a setting none of whose buckets fit."""
    size_rules.check_bucket_sides(size_rules.ModelGeometry.loaded(family, sd), buckets, data)


def _encode_latents(
    settings: RunSettings, cache_for: Callable[[Optional[Size]], LatentCache]
) -> tuple[LatentSource, dict[tuple[str, Optional[Size]], torch.Tensor]]:
    """The training latents, and (n, 4, h, w) latents of each validation set's items in each bucket (keyed by
    (set name, bucket); the bucket is None without bucketing)."""
    cfg, split, val_items, placements = settings.cfg, settings.split, settings.val_items, settings.placements
    all_items = {it.id: it for it in settings.train_items + val_items["val"] + val_items["stabilize"]}
    paths = {i: split.path_of(it) for i, it in all_items.items()}
    keys = {i: settings.file_hashes[i] for i in paths}  # content hash: the cache key and the sample seed

    def bucket_of(item_id: int) -> Optional[Size]:
        return None if placements is None else placements[item_id].bucket

    # Each distinct image once (the stabilize subset is part of train), bucket by bucket: (4, h, w) latents, and of
    # the mirrored images when flipping; without the cache only the validation images are encoded up front.
    val_item_ids = {it.id for items in val_items.values() for it in items}
    encode_now = [it for i, it in all_items.items() if cfg.cache_latents or i in val_item_ids]
    by_bucket: dict[Optional[Size], list[Item]] = {}
    for it in encode_now:
        by_bucket.setdefault(bucket_of(it.id), []).append(it)
    # Encoded to disk bucket by bucket and batch by batch, never all in memory; then only the validation latents are
    # read in, and the training ones are read per micro-batch (CachedLatentFiles).
    caches = {bucket: cache_for(bucket) for bucket in by_bucket}
    for bucket, group in by_bucket.items():
        caches[bucket].ensure([paths[it.id] for it in group], [keys[it.id] for it in group],
                              flipped=cfg.cache_latents and cfg.random_flip)

    def read(items: list[Item]) -> torch.Tensor:  # (n, 4, h, w) latents of items of one bucket
        return caches[bucket_of(items[0].id)].read([keys[it.id] for it in items], flipped=False)[0]

    train_items = settings.train_items
    train_latents: LatentSource
    if not cfg.cache_latents:
        one_bucket = cache_for(None)
        train_latents = EncodedOnTheFly(
            [paths[it.id] for it in train_items], [keys[it.id] for it in train_items], one_bucket.encoder,
            one_bucket.load,
        )
    else:  # each item's entry in its bucket's folder, read per micro-batch (a micro-batch holds one bucket)
        train_latents = CachedLatentFiles([caches[bucket_of(it.id)].entry_path(keys[it.id]) for it in train_items])
    val_latents = {}
    for name, items in val_items.items():
        groups: dict[Optional[Size], list[Item]] = {}
        for it in items:
            groups.setdefault(bucket_of(it.id), []).append(it)
        val_latents.update({(name, bucket): read(group) for bucket, group in groups.items()})
    return train_latents, val_latents


@dataclass
class _EncodedText:
    train_cond: torch.Tensor
    empty_cond: torch.Tensor
    val_cond: dict[str, torch.Tensor]
    stats: CacheStats
    train_text: Optional[Union[ShuffledCaptions, CachedTextFiles]] = None
    train_geometry: list[ImageGeometry] = field(default_factory=list)


def _encode_text(settings: RunSettings, sd: SDComponents, family: Family, device: torch.device,
                 root: Path, data: DataConfig) -> _EncodedText:
    method, stats, cfg = settings.method, CacheStats(), settings.cfg
    captions = [method.transform_caption(it.text) for it in settings.train_items]
    empty_ids = family.tokenize([""])
    # Tag shuffle: no fixed training conditioning to compute; the captions are shuffled and encoded per micro-batch.
    train_ids = (family.tokenize(captions) if not cfg.shuffle_tags
                 else torch.empty(0, *empty_ids.shape[1:], dtype=torch.long))
    val_ids = {name: family.tokenize([method.transform_caption(it.text) for it in items])
               for name, items in settings.val_items.items() if items}
    # Each item's size conditioning (SDXL; none for SD 1.x): the training items' is added per micro-batch by the
    # loop (family.with_images), the validation sets' once here.
    placements = settings.placements or {}
    sets = {"train": settings.train_items, **settings.val_items}
    geometry = {name: [image_geometry(settings.split.path_of(it), data, placements.get(it.id)) for it in items]
                for name, items in sets.items() if items}
    encoders = [getattr(sd, n) for n in family.text_encoder_names()]

    def frozen_encode(ids: torch.Tensor) -> torch.Tensor:
        return family.encode_prompt(encoders, ids)

    train_text: Optional[Union[ShuffledCaptions, CachedTextFiles]] = None
    if cfg.shuffle_tags:
        frozen = None if method.text_encoder_changes else frozen_encode
        train_text = ShuffledCaptions(captions, cfg.keep_tokens, family.tokenize, frozen, device)
    if method.text_encoder_changes:
        # (N, 77) ids (per family: family.py): prompts are encoded every micro-batch through the training encoders.
        return _EncodedText(train_ids, empty_ids, {name: family.with_images(ids, geometry[name])
                                                   for name, ids in val_ids.items()}, stats, train_text,
                            geometry["train"])
    # (N, 77, D) hidden states (per family), computed once with the frozen encoders.
    folder = text_cache_dir(root, *encoders)

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return cached_text_embeddings(ids, frozen_encode, folder, device, stats=stats)

    empty_cond = embed(empty_ids)
    if len(train_ids):
        # The training captions stay on disk, read per micro-batch (memory does not grow with the set).
        files = ensure_text_embeddings(train_ids, frozen_encode, folder, device, stats=stats)
        train_text = CachedTextFiles(files)
    train_cond = empty_cond[:0]
    val_cond = {name: family.with_images(embed(ids), geometry[name]) for name, ids in val_ids.items()}
    return _EncodedText(train_cond, empty_cond, val_cond, stats, train_text, geometry["train"])
