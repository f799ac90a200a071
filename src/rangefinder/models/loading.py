"""Loading a base model's parts for training, from wherever it lives.

`model.base_model` may be:
- None: the embedded tiny model (built once, cached; see tiny.py);
- a local diffusers folder (model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/);
- a single-file checkpoint (`.safetensors` / `.ckpt`, the layout A1111 and ComfyUI share), read by diffusers'
  `from_single_file`. Its architecture comes from a local diffusers folder so nothing is fetched: the
  `model.single_file_config` setting, else the base model named in the file's rangefinder metadata, else diffusers'
  own inference (which fetches the matching config from the hub);
- a Hugging Face hub id, downloaded on a machine that can reach the hub (or taken from the local cache).

The training noise scheduler is always a DDPMScheduler built from the model's scheduler config, as in diffusers'
training examples, whatever scheduler the model samples with.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rangefinder.config import ModelConfig
from rangefinder.errors import ConfigError

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt")


@dataclass
class SDComponents:
    unet: Any  # diffusers UNet2DConditionModel
    vae: Any  # diffusers AutoencoderKL
    text_encoder: Any  # transformers CLIPTextModel
    tokenizer: Any  # transformers CLIPTokenizer
    noise_scheduler: Any  # diffusers DDPMScheduler (training)
    source: str  # what was loaded, for logs and MLflow tags
    # A diffusers folder holding this model's configs (the folder itself, or the config of a single file);
    # None for a hub id. Samplers and exporters use it to assemble a pipeline.
    model_dir: Optional[Path] = None
    kind: str = "folder"  # "embedded" | "folder" | "single_file" | "hub"


def describe_base_model(model_cfg: ModelConfig) -> str:
    return model_cfg.base_model or "embedded tiny model"


def load_sd_components(model_cfg: Optional[ModelConfig] = None) -> SDComponents:
    """The five parts of a Stable Diffusion model, in eval mode on the CPU; ConfigError when it cannot be loaded."""
    model_cfg = model_cfg or ModelConfig()
    name = model_cfg.base_model
    if name is None:
        from rangefinder.models.tiny import ensure_tiny_base_model

        folder = ensure_tiny_base_model(model_cfg.cache_dir)
        parts = _load_folder(folder, model_cfg)
        parts.source, parts.kind = f"embedded tiny model ({folder})", "embedded"
        return parts

    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file() and not (path / "unet").is_dir():
            raise ConfigError(
                f"model.base_model: {path} is a folder but not a diffusers model (no model_index.json or unet/); "
                "pass a diffusers folder, a .safetensors/.ckpt file or a hub id"
            )
        return _load_folder(path.resolve(), model_cfg)
    if path.is_file():
        if path.suffix.lower() not in SINGLE_FILE_SUFFIXES:
            raise ConfigError(
                f"model.base_model: {path} is a file but not a .safetensors or .ckpt checkpoint; "
                "pass one of those, a diffusers folder or a hub id"
            )
        return _load_single_file(path.resolve(), model_cfg)
    if _looks_like_path(name):
        raise ConfigError(f"model.base_model: {name} does not exist; check the path (relative to {Path.cwd()})")
    return _load_hub(name, model_cfg)


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~"))
        or name.lower().endswith(SINGLE_FILE_SUFFIXES)
        or name.count("/") > 1
        or os.sep in name and os.sep != "/"
    )


# ---------------------------------------------------------------------------------------------------------------
# The three sources


def _from_folder_like(location: str, model_cfg: ModelConfig, **hub_kwargs) -> dict:
    """Each part from `location` (a local folder or a hub id), as diffusers' training scripts load them."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    rev: dict[str, Any] = {"revision": model_cfg.revision} if model_cfg.revision else {}
    var: dict[str, Any] = {"variant": model_cfg.variant} if model_cfg.variant else {}
    return {
        "tokenizer": CLIPTokenizer.from_pretrained(location, subfolder="tokenizer", **rev, **hub_kwargs),
        "text_encoder": CLIPTextModel.from_pretrained(location, subfolder="text_encoder", **rev, **var, **hub_kwargs),
        "vae": AutoencoderKL.from_pretrained(location, subfolder="vae", **rev, **var, **hub_kwargs),
        "unet": UNet2DConditionModel.from_pretrained(location, subfolder="unet", **rev, **var, **hub_kwargs),
        "noise_scheduler": DDPMScheduler.from_pretrained(location, subfolder="scheduler", **rev, **hub_kwargs),
    }


def _finish(parts: dict, source: str, model_dir: Optional[Path], kind: str) -> SDComponents:
    for key in ("unet", "vae", "text_encoder"):
        parts[key].eval()
    return SDComponents(source=source, model_dir=model_dir, kind=kind, **parts)


def _load_folder(folder: Path, model_cfg: ModelConfig) -> SDComponents:
    try:
        parts = _from_folder_like(str(folder), model_cfg, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.base_model: cannot load the diffusers folder {folder}: {_first_line(e)}") from e
    return _finish(parts, f"diffusers folder {folder}", folder, "folder")


def _single_file_config(path: Path, model_cfg: ModelConfig) -> Optional[Path]:
    """A local diffusers folder describing the checkpoint's architecture, if one is known."""
    explicit = model_cfg.single_file_config
    if explicit:
        folder = Path(explicit).expanduser()
        if not (folder / "unet").is_dir():
            raise ConfigError(f"model.single_file_config: {folder} is not a diffusers folder (no unet/)")
        return folder.resolve()
    if path.suffix.lower() == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        base = meta.get("rangefinder.base_model")
        if base and (Path(base) / "unet").is_dir():
            return Path(base)
        if base in (None, "", "None") and "rangefinder.method" in meta:
            # Exported from the embedded model: its config is the tiny model's.
            from rangefinder.models.tiny import ensure_tiny_base_model

            return ensure_tiny_base_model(model_cfg.cache_dir)
    return None


def _load_single_file(path: Path, model_cfg: ModelConfig) -> SDComponents:
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    config = _single_file_config(path, model_cfg)
    kwargs: dict[str, Any] = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    if config is not None:
        kwargs.update(config=str(config), local_files_only=True)
    try:
        pipe = StableDiffusionPipeline.from_single_file(str(path), **kwargs)
    except Exception as e:  # diffusers raises many kinds here (missing keys, hub errors, shape mismatches)
        hint = (
            f"its architecture was taken from {config}" if config is not None
            else "set model.single_file_config to a local diffusers folder of the same architecture "
                 "(diffusers otherwise fetches one from the hub)"
        )
        raise ConfigError(f"model.base_model: cannot load the checkpoint {path}: {_first_line(e)}; {hint}") from e
    parts = {
        "unet": pipe.unet,
        "vae": pipe.vae,
        "text_encoder": pipe.text_encoder,
        "tokenizer": pipe.tokenizer,
        "noise_scheduler": DDPMScheduler.from_config(pipe.scheduler.config),
    }
    return _finish(parts, f"single-file checkpoint {path}", config, "single_file")


def _load_hub(repo_id: str, model_cfg: ModelConfig) -> SDComponents:
    cache = {"cache_dir": model_cfg.cache_dir} if model_cfg.cache_dir else {}
    try:  # already downloaded: no network needed
        parts = _from_folder_like(repo_id, model_cfg, local_files_only=True, **cache)
        return _finish(parts, f"hub model {repo_id} (cached)", None, "hub")
    except (OSError, ValueError):
        pass
    _check_hub(repo_id, model_cfg.revision)
    try:
        parts = _from_folder_like(repo_id, model_cfg, **cache)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.base_model: cannot load hub model {repo_id!r}: {_first_line(e)}") from e
    return _finish(parts, f"hub model {repo_id}", None, "hub")


def _check_hub(repo_id: str, revision: Optional[str]) -> None:
    """Fail in a second, with the reason, rather than after diffusers' minute of retries."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ConfigError(
            f"model.base_model: hub model {repo_id!r} is not in the local cache and the hub is offline "
            "(HF_HUB_OFFLINE is set); download it on a machine with access, or pass a local folder or file"
        )
    try:
        HfApi().model_info(repo_id, revision=revision, timeout=10)
    except GatedRepoError:
        raise ConfigError(
            f"model.base_model: hub model {repo_id!r} is gated: accept its licence on huggingface.co and set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(f"model.revision: {revision!r} does not exist for hub model {repo_id!r}") from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"model.base_model: no hub model {repo_id!r} (or it is private: set HF_TOKEN); check the id"
        ) from None
    except Exception as e:  # network errors come from the HTTP library, whose classes vary by version
        raise ConfigError(
            f"model.base_model: hub model {repo_id!r} cannot be downloaded: the Hugging Face hub is unreachable "
            f"from here (offline: {_first_line(e)}) and the model is not in the local cache; pass a local diffusers "
            "folder or checkpoint file, or run where the hub can be reached"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
