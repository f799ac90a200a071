"""Which model family a base model is, read from its files: beside the families the engine trains (families.py).

The family is read from the model, never set by the user (docs/model-families.md): a diffusers folder's
model_index.json names its pipeline class, and a single file's tensor names tell SDXL's layout from SD 1.x's.

This module imports nothing of the package but config, errors and the single-file layout, so that models/loading.py,
which must know a model's family to load its parts, can import it: families.py names `models.loading.SDComponents`
(for type checking), so detection there would close a loop between models and training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rangefinder.config import ModelConfig
from rangefinder.errors import ConfigError
from rangefinder.formats.flux_layout import FLUX_CHECKPOINT_PREFIX, FLUX_DOUBLE_BLOCK_KEY, FLUX_SINGLE_BLOCK_KEY
from rangefinder.formats.single_file import LDM_UNET_PREFIX, SGM_CLIP_G_PREFIX

# The model families rangefinder trains (families.FAMILIES), by the pipeline class diffusers names in
# model_index.json `_class_name`.
FAMILY_OF_PIPELINE = {"StableDiffusionPipeline": "sd1", "StableDiffusionXLPipeline": "sdxl",
                      "StableDiffusion3Pipeline": "sd3", "FluxPipeline": "flux"}
# The parts a family needs beyond models.loading.REQUIRED_PARTS.
FAMILY_PARTS = {"sd1": (), "sdxl": ("text_encoder_2", "tokenizer_2"),
                "sd3": ("text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3"),
                "flux": ("text_encoder_2", "tokenizer_2")}  # Flux: T5 and its tokenizer
# The folder of the denoiser (loaded as SDComponents.unet whatever its kind): the UNet, or SD3's and Flux's
# transformer.
FAMILY_DENOISER = {"sd1": "unet", "sdxl": "unet", "sd3": "transformer", "flux": "transformer"}
FAMILY_NAMES = {"sd1": "Stable Diffusion 1.x/2.x", "sdxl": "Stable Diffusion XL", "sd3": "Stable Diffusion 3/3.5",
                "flux": "Flux.1"}
# In a single file (the LDM/SGM layout): SDXL's UNet has the added (pooled text + size) embedding `label_emb`, and
# SGM's conditioner holds the two text encoders, CLIP ViT-L as embedders.0 and OpenCLIP bigG as embedders.1.
SDXL_SINGLE_FILE_UNET_KEY = LDM_UNET_PREFIX + "label_emb.0.0.weight"
SDXL_SINGLE_FILE_TE2_PREFIX = SGM_CLIP_G_PREFIX
# SD3's single file (Stability's layout, which ComfyUI and diffusers' from_single_file read): the MMDiT's
# `joint_blocks` under model.diffusion_model.
SD3_SINGLE_FILE_KEY_PREFIX = LDM_UNET_PREFIX + "joint_blocks."


def detect_family(folder: Path) -> str:
    """The family of a diffusers folder, from model_index.json's `_class_name`; ConfigError for a pipeline class
    rangefinder does not train."""
    index = Path(folder) / "model_index.json"
    try:
        class_name = json.loads(index.read_text()).get("_class_name", "")
    except (OSError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"model.base_model: cannot read {index} ({reason}); pass a diffusers folder") from None
    family = FAMILY_OF_PIPELINE.get(class_name)
    if family is None:
        known = ", ".join(f"{v} ({k})" for k, v in FAMILY_OF_PIPELINE.items())
        raise ConfigError(
            f"model.base_model: {folder} is a {class_name or 'pipeline of unknown class'} model; rangefinder trains "
            f"{known}; pass a base model of one of those families"
        )
    return family


def family_of(model_cfg: ModelConfig) -> Optional[str]:
    """The family of a configured base model when it can be told without downloading or converting anything (the
    embedded model, a local folder, a single file's tensor names, a resolved folder); None otherwise (a hub id not
    resolved yet). For tags and reports."""
    try:
        if model_cfg.resolved_dir and (Path(model_cfg.resolved_dir) / "model_index.json").is_file():
            return detect_family(Path(model_cfg.resolved_dir))
        if model_cfg.base_model is None:
            return "sd1"
        path = Path(model_cfg.base_model).expanduser()
        if (path / "model_index.json").is_file():
            return detect_family(path)
        if path.is_file() and path.suffix.lower() == ".safetensors":  # the single files loading.py reads
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return single_file_family(path, list(f.keys()))
    except (ConfigError, OSError, ValueError):
        return None
    return None


def single_file_family(path: Path, keys: list[str]) -> str:
    """The family of a single-file checkpoint from its tensor names; ConfigError for an SDXL file without its
    second text encoder. Flux's transformer in Black Forest Labs' layout (formats/flux_layout.py) has double- and
    single-stream blocks, bare (BFL's own file) or under `model.diffusion_model.` (ComfyUI's checkpoints)."""
    bare = {k.removeprefix(FLUX_CHECKPOINT_PREFIX) for k in keys}
    if FLUX_DOUBLE_BLOCK_KEY in bare and FLUX_SINGLE_BLOCK_KEY in bare:
        return "flux"
    if any(k.startswith(SD3_SINGLE_FILE_KEY_PREFIX) for k in keys):
        return "sd3"
    if SDXL_SINGLE_FILE_UNET_KEY in keys or any(k.startswith("conditioner.") for k in keys):
        if not any(k.startswith(SDXL_SINGLE_FILE_TE2_PREFIX) for k in keys):
            raise ConfigError(
                f"model.base_model: {path} is an SDXL checkpoint without its second text encoder (OpenCLIP bigG, "
                f"{SDXL_SINGLE_FILE_TE2_PREFIX}*): SDXL conditions on both encoders; pass the complete checkpoint "
                "(the base model's file, not a UNet-only or pruned one) or a diffusers folder"
            )
        return "sdxl"
    return "sd1"
