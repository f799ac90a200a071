"""The base model: where it comes from, resolved once to a local diffusers folder; and loading its parts.

`model.base_model` may be:
- None: the embedded tiny model (built once, cached; see tiny.py);
- a local diffusers folder (model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/);
- a single-file checkpoint in safetensors (the layout A1111 and ComfyUI share). It is converted once, by diffusers'
  `from_single_file` and `save_pretrained`, into a diffusers folder in the rangefinder cache, keyed by the file's
  content and the files of the folder giving its architecture. Its architecture comes from a local diffusers
  folder, so nothing is fetched: `model.single_file_config`, else the base model named in the file's rangefinder
  metadata, else diffusers' own inference (which fetches the matching config from the hub). Pickle formats (.ckpt,
  .pt, .pth, .bin) are refused: loading one can run code;
- a Hugging Face hub id (`org/name`, at `model.revision`), taken from the Hugging Face cache ($HF_HUB_CACHE, else
  $HF_HOME/hub) when it is there, downloaded into it otherwise, unless HF_HUB_OFFLINE is set. A gated or private
  repo needs HF_TOKEN (on a cluster: the Secret named by `kubernetes.hf_token_secret`).

`resolve_base_model` turns each into a local diffusers folder. The pipeline's first step (resolve-config) calls it
once and hands the folder on in the config (`model.resolved_dir`), so a download or conversion happens once per
pipeline run and every later step (range test, fine-tune, retrain, samples, export, registry) loads the same files.
On a cluster the caches are on the data volume, shared by every pod; a step that cannot see `resolved_dir` (a
cluster without a shared volume) resolves again from `base_model`, through the same caches, at the commit the first
step resolved (`model.resolved_revision`), not what a branch names by then.

The training noise scheduler is always a DDPMScheduler built from the model's scheduler config, as in diffusers'
training examples, whatever scheduler the model samples with.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

from rangefinder.config import FAMILY_NAMES, ModelConfig, expand_home
from rangefinder.errors import ConfigError
from rangefinder.formats import checkpoints
from rangefinder.formats.digest import hash_file_into
from rangefinder.formats.single_file import single_file_prediction_type
from rangefinder.formats.weights_file import (
    EMBEDDED_BASE_MODEL,
    FILE_REVISION_PREFIX,
    base_model_path,
    names_embedded_model,
    pickle_format,
    read_metadata,
)
from rangefinder.models.fingerprint import folder_revision
from rangefinder.training.family_detection import (
    FAMILY_DENOISER,
    FAMILY_LAYOUTS,
    FAMILY_OF_PIPELINE,
    FAMILY_PARTS,
    detect_family,
    import_named,
    single_file_family,
    t5_sequence_length,
)

SINGLE_FILE_SUFFIX = ".safetensors"
# A single file's UNet input convolution and VAE decoder input convolution: their input channels are the latents'.
UNET_CONV_IN_KEY = "model.diffusion_model.input_blocks.0.0.weight"
VAE_DECODER_CONV_IN_KEY = "first_stage_model.decoder.conv_in.weight"
# Refused: torch.load of a pickle runs whatever code the file holds (safetensors holds tensors only).
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")
# The parts training and sampling load; each is a sub-folder of a diffusers Stable Diffusion folder.
REQUIRED_PARTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
HUB_TIMEOUT_S = 10.0  # seconds for one hub metadata request (downloads use huggingface_hub's per-read timeout)
# What a diffusers Stable Diffusion repo needs, for `hf download` in the offline message. `hf`'s --include takes one
# pattern each time it is given: patterns after the first would be read as file names, and hf then ignores --include.
HUB_INCLUDE = " ".join(f'--include "{pattern}"' for pattern in ("model_index.json", "*/*.json", "*/*.txt",
                                                                 "*/*.safetensors"))
# Each family's embedded tiny model, "module:ensure(cache_dir)": the architecture of a file exported from it.
TINY_MODELS = {"sd1": "rangefinder.models.tiny:ensure_tiny_base_model",
               "sdxl": "rangefinder.models.tiny_sdxl:ensure_tiny_sdxl_model",
               "sd3": "rangefinder.models.tiny_sd3:ensure_tiny_sd3_model",
               "flux": "rangefinder.models.tiny_flux:ensure_tiny_flux_model"}


@dataclass(frozen=True)
class ResolvedModel:
    """A base model as a local diffusers folder, and where it came from."""

    path: Path  # a diffusers folder with model_index.json and REQUIRED_PARTS
    kind: str  # "embedded" | "folder" | "single_file" | "hub"
    source: str  # for logs, tags and file metadata: "org/name@main", a path, "embedded tiny model"
    # The revision as resolving found it (`revision` below): a hub id's snapshot commit, a single file's
    # "sha256:<hex>", or model.resolved_revision handed on with the folder; None for a folder and the embedded model.
    known_revision: Optional[str] = None

    @functools.cached_property
    def revision(self) -> Optional[str]:
        """What `source` was when resolved, which a move upstream does not change (model.resolved_revision): a hub
        id's snapshot commit, a single file's "sha256:<hex>", a folder's and the embedded model's "weights:<hex>", a
        fingerprint of its weights (fingerprint.py; ConfigError naming a weights file whose header is damaged). Read
        off the files when first asked: by resolve-config, or as the folder is loaded (_load_folder), so that it names
        the weights loaded, not those the folder holds when the run's files are written; a resolve that loads
        nothing reads none."""
        if self.known_revision is None and self.kind in ("folder", "embedded"):
            return folder_revision(self.path)
        return self.known_revision

    @property
    def family(self) -> str:
        """"sd1" | "sdxl" | "sd3" | "flux", from the folder's model_index.json."""
        return detect_family(self.path)


@dataclass
class SDComponents:
    unet: Any  # the denoiser: diffusers UNet2DConditionModel (Flux: FluxTransformer2DModel, from transformer/)
    vae: Any  # diffusers AutoencoderKL
    text_encoder: Any  # transformers CLIPTextModel
    tokenizer: Any  # transformers CLIPTokenizer
    noise_scheduler: Any  # diffusers DDPMScheduler (training; Flux: the model's FlowMatchEulerDiscreteScheduler)
    source: str  # what was loaded, for logs and MLflow tags
    model_dir: Optional[Path] = None  # the local diffusers folder the parts came from
    kind: str = "folder"  # "embedded" | "folder" | "single_file" | "hub"
    family: str = "sd1"  # "sd1" | "sdxl" | "sd3" | "flux" (detect_family)
    text_encoder_2: Any = None  # SDXL: transformers CLIPTextModelWithProjection (OpenCLIP bigG); Flux: T5EncoderModel
    tokenizer_2: Any = None  # SDXL: its tokenizer; Flux: T5's
    # SD3: T5, never trained (so not among text_encoders()), and its tokenizer; `unet` is then SD3's transformer.
    text_encoder_3: Any = None
    tokenizer_3: Any = None
    # The loaded weights' fingerprint (weights_digest), before any training changes them: what a checkpoint records
    # as its base model, so that a resume on another one is refused wherever the folder now lies.
    digest: Optional[str] = None
    # How `source` resolved: its revision (a hub commit, a file's sha256, a folder's fingerprint, read when first
    # asked) is what the delivered files name beside it as rangefinder.base_model_revision.
    resolved: Optional[ResolvedModel] = None

    def text_encoders(self) -> dict[str, Any]:
        """{part name: text encoder} of the family that training may change, in the order the family concatenates
        them (SD3's T5 is never trained: not here)."""
        named = {"text_encoder": self.text_encoder, "text_encoder_2": self.text_encoder_2}
        return {k: v for k, v in named.items() if v is not None}


def describe_base_model(model_cfg: ModelConfig) -> str:
    if model_cfg.base_model and model_cfg.revision and _looks_like_hub_id(model_cfg.base_model):
        return f"{model_cfg.base_model}@{model_cfg.revision}"
    return model_cfg.base_model or EMBEDDED_BASE_MODEL


def load_sd_components(model_cfg: Optional[ModelConfig] = None) -> SDComponents:
    """The five parts of a Stable Diffusion model, in eval mode on the CPU; ConfigError when it cannot be loaded."""
    resolved = resolve_base_model(model_cfg or ModelConfig())
    return _load_folder(resolved, model_cfg or ModelConfig())


# ---------------------------------------------------------------------------------------------------------------
# Resolving a source to a local diffusers folder


def resolve_base_model(model_cfg: ModelConfig) -> ResolvedModel:
    """The local diffusers folder of `model.base_model`, downloading or converting it once; ConfigError (one
    sentence naming the value and the fix) when it cannot be had."""
    kind = _kind(model_cfg.base_model)
    if model_cfg.resolved_dir:
        done = Path(model_cfg.resolved_dir)
        if _missing_parts(done) == []:  # resolved by the pipeline's first step, and visible here
            # Checked again: a folder on the data volume may have changed since.
            refuse_shipped_code(done, f"model.base_model: {done}")
            return ResolvedModel(done, kind, describe_base_model(model_cfg), model_cfg.resolved_revision)
    name = model_cfg.base_model
    if name is None:
        from rangefinder.models.tiny import ensure_tiny_base_model

        folder = ensure_tiny_base_model(model_cfg.cache_dir)
        # Its revision is a folder's fingerprint: another rangefinder release may ship other tiny weights (`make
        # tiny-weights`), and the registry then says the base model's weights changed, as of a folder whose files did.
        return ResolvedModel(folder, "embedded", f"{EMBEDDED_BASE_MODEL} ({folder})")
    if kind == "hub":
        return _resolve_hub(name, model_cfg)
    if "://" in name:
        _refuse_url(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return _resolve_folder(path.resolve(), model_cfg.variant)
    if path.is_file():
        return _resolve_single_file(path.resolve(), model_cfg)
    raise ConfigError(
        f"model.base_model: {name} does not exist (relative to {Path.cwd()}); pass an existing diffusers folder, "
        f"a {SINGLE_FILE_SUFFIX} checkpoint file or a hub id such as org/name"
    )


def _refuse_url(name: str) -> None:
    """ConfigError for a link as the base model: a model page's or a download's (Hugging Face, Civitai) was read as a
    path relative to the working folder, and said not to exist there. A Hugging Face link names its hub id."""
    parts = urlsplit(name)
    repo = "/".join(parts.path.strip("/").split("/")[:2])
    if (parts.hostname or "").removeprefix("www.") in ("huggingface.co", "hf.co") and repo.count("/") == 1:
        instead = f"pass its hub id, {repo}, instead (model.revision for a branch or commit)"
    else:
        instead = (f"download the file, then pass its path (a {SINGLE_FILE_SUFFIX} file), or pass a hub id such as "
                   "org/name")
    raise ConfigError(f"model.base_model: {name} is a URL, which rangefinder does not download; {instead}")


def local_model_folder(model_cfg: ModelConfig) -> Optional[Path]:
    """The diffusers folder of the base model when it can be read here as it is, without downloading, converting or
    copying anything (for the checks made before a run: training.families.check_local_model_settings): the resolved
    folder, a local diffusers folder, the embedded model's shipped files (what ensure_tiny_base_model copies into the
    cache); None otherwise (a hub id, a single file not converted yet)."""
    if model_cfg.resolved_dir and (Path(model_cfg.resolved_dir) / "model_index.json").is_file():
        return Path(model_cfg.resolved_dir)
    if model_cfg.base_model is None:
        from rangefinder.models.tiny import shipped_files

        return shipped_files()
    path = Path(model_cfg.base_model).expanduser()
    return path if (path / "model_index.json").is_file() else None


def _kind(name: Optional[str]) -> str:
    if name is None:
        return "embedded"
    if _looks_like_hub_id(name):
        return "hub"
    path = Path(name).expanduser()
    return "single_file" if path.is_file() or path.suffix.lower() in (SINGLE_FILE_SUFFIX, *PICKLE_SUFFIXES) \
        else "folder"


def _looks_like_hub_id(name: str) -> bool:
    """`org/name` or a bare `name` that is not a path on this machine (hub ids have at most one slash)."""
    return not (
        name.startswith(("/", "./", "../", "~", "."))
        or name.lower().endswith((SINGLE_FILE_SUFFIX, *PICKLE_SUFFIXES))
        or name.count("/") > 1
        or (os.sep != "/" and os.sep in name)
        or Path(name).expanduser().exists()
    )


def _missing_parts(folder: Path) -> Optional[list[str]]:
    """None when `folder` has no model_index.json; else the required parts (those of its family) without a config
    inside."""
    if not (folder / "model_index.json").is_file():
        return None
    try:
        family = detect_family(folder)
        extra, denoiser = FAMILY_PARTS[family], FAMILY_DENOISER[family]
    except ConfigError:
        extra, denoiser = (), "unet"  # an unknown family: the load names it
    configs = {"tokenizer": ("tokenizer_config.json", "vocab.json"), "tokenizer_2": ("tokenizer_config.json",
               "vocab.json"), "tokenizer_3": ("tokenizer_config.json",), "scheduler": ("scheduler_config.json",)}
    parts = [denoiser if p == "unet" else p for p in REQUIRED_PARTS]
    return [p for p in (*parts, *extra)
            if not any((folder / p / f).is_file() for f in configs.get(p, ("config.json",)))]


def _check_folder(folder: Path, what: str, variant: Optional[str] = None) -> None:
    missing = _missing_parts(folder)
    if missing is None:
        raise ConfigError(
            f"model.base_model: {what} is not a diffusers model folder (no model_index.json); "
            + (_folder_above_or_inside(folder) or f"pass a folder saved with save_pretrained(), a {SINGLE_FILE_SUFFIX} "
                                                  "checkpoint file or a hub id")
        )
    if missing:
        raise ConfigError(
            f"model.base_model: {what} lacks {', '.join(f'{p}/' for p in missing)} (or their config files); a "
            "Stable Diffusion folder needs unet/, vae/, text_encoder/, tokenizer/ and scheduler/ (SDXL also "
            "text_encoder_2/ and tokenizer_2/)"
        )
    layout = FAMILY_LAYOUTS[detect_family(folder)]  # a pipeline class rangefinder does not train: say so now
    refuse_shipped_code(folder, f"model.base_model: {what}")
    for part, _ in layout.classes:  # weights the load would not find (an fp16-only download): said now, not by the
        problem = _weights_missing(folder / part, variant or sole_variant(folder / part)) if _has_weights(part) \
            else None  # step that loads them
        if problem is not None:
            raise ConfigError(f"model.base_model: {part}/ of {what} {problem}")


def _folder_above_or_inside(folder: Path) -> Optional[str]:
    """What to pass instead of a folder without model_index.json that is one step from a model: a part of a diffusers
    folder (its unet/), the Hugging Face cache's folder of a hub repo (models--org--name, or its snapshots/), a run's
    folder holding the model it delivered, or an adapter's folder (a LoRA or an embedding is no base model); None
    for any other folder."""
    from rangefinder.formats.embeddings import TI_WEIGHTS_NAME
    from rangefinder.formats.lora import LORA_WEIGHTS_NAME

    if (folder.parent / "model_index.json").is_file():
        return f"it is the {folder.name}/ part of the diffusers folder {folder.parent}: pass that folder"
    repo = next((d for d in (folder, folder.parent) if d.name.startswith("models--") and "--" in d.name[8:]), None)
    if repo is not None:
        repo_id = repo.name[len("models--"):].replace("--", "/")
        return (f"it is the Hugging Face cache's folder of hub model {repo_id}: pass the hub id {repo_id} (with "
                f"HF_HUB_CACHE={repo.parent}), or one of its snapshot folders, {repo / 'snapshots'}/<commit>")
    delivered = [folder / name for name in ("chosen", "final") if (folder / name / "model_index.json").is_file()]
    if delivered:
        return f"it is a run's folder: pass the model it delivered, {delivered[0]}"
    if checkpoints.is_checkpoint(folder):
        return (f"it is a training checkpoint, not a model: `rangefinder train --resume --out {folder.parent.parent}` "
                "continues its run, `rangefinder sample --checkpoints` draws with it, and a full fine-tune's final/ "
                "is a base model to train further")
    adapter = next((d / name for d in (folder, folder / "final") for name in (LORA_WEIGHTS_NAME, TI_WEIGHTS_NAME)
                    if (d / name).is_file()), None)
    if adapter is not None:
        try:
            meta = read_metadata(adapter)
        except Exception:  # noqa: BLE001  (safetensors raises its own error, or OSError, for a file it cannot read)
            meta = {}
        return (f"it holds {adapter.name}, an adapter, which is trained on a base model and applied on top of it; "
                + (_trained_on(meta) or "pass that base model, and the file to `rangefinder sample --checkpoints` to "
                                        "draw with it"))
    return None


# A part's config files where transformers' Auto classes find an `auto_map`: the classes of code shipped in the folder.
AUTO_MAP_FILES = ("config.json", "tokenizer_config.json")


def refuse_shipped_code(folder: Path, what: str) -> None:
    """ConfigError where the diffusers folder `folder` names code of its own to load a part with, `what` (the setting
    or column, and the folder) leading its line: rangefinder never runs code from a model, whether it trains on it,
    samples it, exports or registers it, as a pickle is refused for that reason. model_index.json's `[library, class]`
    of a part whose folder holds `<library>.py` is diffusers' custom component, which older diffusers releases import
    without asking (0.42, in constraints.txt, refuses it unless told trust_remote_code); an `auto_map` in a part's
    config or tokenizer config is transformers' custom code, which its AutoTokenizer (SD3's and Flux's T5 tokenizer)
    asks about on a terminal. Whoever can write the data volume or owns the hub repo writes these files."""
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):  # unreadable: the load that comes next says so, naming the file (detect_family)
        index = None
    named = [f"{part}/{entry[0]}.py" for part, entry in (index.items() if isinstance(index, dict) else ())
             if not part.startswith("_") and isinstance(entry, list) and len(entry) == 2
             and isinstance(entry[0], str) and (folder / part / f"{entry[0]}.py").is_file()]
    named += [f"{part.name}/{name} (auto_map)" for part in sorted(folder.iterdir()) if part.is_dir()
              for name in AUTO_MAP_FILES if _has_auto_map(part / name)]
    if named:
        raise ConfigError(
            f"{what} loads parts with code shipped in the folder ({', '.join(named)}), and rangefinder never runs "
            "code from a model; pass a model saved by diffusers' own classes (its save_pretrained) without that code"
        )


def _has_auto_map(path: Path) -> bool:
    try:
        config = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):  # unreadable: the part's own load says so
        return False
    return isinstance(config, dict) and "auto_map" in config


def _resolve_folder(folder: Path, variant: Optional[str]) -> ResolvedModel:
    _check_folder(folder, str(folder), variant)
    # A folder's path stays when its weights are replaced (a PVC mount a team updates): its revision is their
    # fingerprint, read without loading them (ResolvedModel.revision).
    return ResolvedModel(folder, "folder", str(folder))


# --- single file -------------------------------------------------------------------------------------------------


def _resolve_single_file(path: Path, model_cfg: ModelConfig) -> ResolvedModel:
    from filelock import FileLock

    from rangefinder.formats.atomic import atomic_dir
    from rangefinder.models.tiny import default_cache_dir

    suffix = path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise ConfigError(
            f"model.base_model: {path} is a pickle checkpoint ({suffix}), which can run code when loaded, so it is "
            f"refused; convert it to {SINGLE_FILE_SUFFIX} (most model pages offer one) or pass a diffusers folder"
        )
    if suffix != SINGLE_FILE_SUFFIX:
        raise ConfigError(
            f"model.base_model: {path} is not a {SINGLE_FILE_SUFFIX} checkpoint; pass a Stable Diffusion "
            f"{SINGLE_FILE_SUFFIX} file, a diffusers folder or a hub id"
        )
    family = _check_sd_checkpoint(path)
    config = _single_file_config(path, model_cfg, family)
    root = Path(model_cfg.cache_dir).expanduser() if model_cfg.cache_dir else default_cache_dir()
    # The folder giving its architecture: model.single_file_config's, else one the file's metadata names.
    named = "model.single_file_config" if model_cfg.single_file_config else f"model.base_model ({path}'s config)"
    content, key = _single_file_key(path, config, named)
    out = root / "base-models" / f"{path.stem[:40]}-{key}"
    if _missing_parts(out) != []:
        with FileLock(str(out) + ".lock"):
            if _missing_parts(out) != []:
                with atomic_dir(out) as tmp:
                    _convert_single_file(path, config, tmp, family, hub_cache_dir(model_cfg))
    return ResolvedModel(out, "single_file", str(path), f"{FILE_REVISION_PREFIX}{content}")


def _check_sd_checkpoint(path: Path) -> str:
    """A whole Stable Diffusion checkpoint holds the UNet under `model.diffusion_model.` (the LDM layout); its
    family."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys, meta = list(f.keys()), f.metadata() or {}
            # The UNet's first convolution takes the VAE's latents (4 channels in SD 1.x/2.x and SDXL), and more in
            # an inpainting or image-conditioned UNet (the mask and the masked image, or the input image).
            unet_in, latents = (f.get_slice(k).get_shape()[1] if k in keys else None
                                for k in (UNET_CONV_IN_KEY, VAE_DECODER_CONV_IN_KEY))
    except (SafetensorError, OSError) as e:
        pickled = pickle_format(path)
        if pickled is not None:
            raise ConfigError(
                f"model.base_model: {path} is {pickled}, not safetensors (a pickle checkpoint such as a .ckpt, "
                f"renamed), which can run code when loaded, so it is refused unread; pass the model's "
                f"{SINGLE_FILE_SUFFIX} file (most model pages offer one) or a diffusers folder"
            ) from None
        raise ConfigError(
            f"model.base_model: {path} is not a readable safetensors file ({_first_line(e)}); download it again"
        ) from None
    if single_file_family(path, keys) == "flux":  # BFL's transformer file: its names are bare
        return "flux"
    if not any(k.startswith("model.diffusion_model.") for k in keys):
        raise ConfigError(
            f"model.base_model: {path} is not a Stable Diffusion checkpoint (no model.diffusion_model.* UNet weights; "
            f"it looks like {_what_file(keys, meta)}); "
            + (_trained_on(meta) or "pass a whole SD checkpoint, a diffusers folder or a hub id")
        )
    if unet_in is not None and unet_in != (latents or 4):
        kind = {9: "an inpainting model's (latents, mask and masked image)",
                8: "an image-conditioned model's (latents and the input image, as InstructPix2Pix)"}.get(
            unet_in, "a model's conditioned on more than the text")
        raise ConfigError(
            f"model.base_model: {path} is not a text-to-image checkpoint: its UNet takes {unet_in} input channels, "
            f"{kind}, where text-to-image takes the VAE's {latents or 4} latent channels, and rangefinder trains "
            "text-to-image models; pass the text-to-image checkpoint it was made from"
        )
    return single_file_family(path, keys)


def _what_file(keys: list[str], meta: dict[str, str]) -> str:
    """What a .safetensors file that holds no UNet is, for the line refusing it as a base model: read off the model
    spec's architecture (`.../lora`, `.../textual-inversion`: rangefinder's, kohya's and other trainers' exports),
    else its tensor names."""
    arch = meta.get("modelspec.architecture", "")
    if arch.endswith("/lora") or any("lora" in k for k in keys):
        return "a LoRA"
    if arch.endswith("/textual-inversion") or keys in (["emb_params"], ["clip_g", "clip_l"]) or len(keys) == 1:
        return "a textual-inversion embedding"
    if any(k.startswith(("encoder.", "decoder.", "first_stage_model.")) for k in keys):
        return "a VAE alone"
    return "an embedding, a VAE or another kind of file"


def _trained_on(meta: dict[str, str]) -> str:
    """The clause naming the base model an adapter says it was trained on (rangefinder.base_model), to pass instead."""
    base = meta.get("rangefinder.base_model")
    if not base:
        return ""
    repo_id, _, revision = base.partition("@")  # a hub id as exports write it, "org/name@revision"
    if names_embedded_model(base):
        instead = "leave model.base_model unset for it"
    elif revision and _looks_like_hub_id(repo_id):
        instead = f"pass {repo_id} as the base model (model.revision {revision})"
    else:
        instead = "pass that as the base model"
    return f"it was trained on {base}: {instead}, and this file to `rangefinder sample --checkpoints` to draw with it"


def _single_file_key(path: Path, config: Optional[Path], setting: str = "model.single_file_config"
                     ) -> tuple[str, str]:
    """(the sha256 of the file's bytes, the conversion's key): the key is a sha256 of those bytes and of the
    architecture they are read with, so a new file or config converts anew; the file's own sha256 comes of the same
    one read (the checksum a model page lists beside the file). The config folder counts by its files, not its path
    alone: the conversion takes every part's config from it, and the parts a file lacks (a Flux transformer file's
    VAE, CLIP-L and T5; an SD3 file's text encoders) whole, which someone may replace under the same path."""
    import diffusers

    h = hashlib.sha256()
    hash_file_into(h, path)
    content = h.hexdigest()  # the bytes' alone; hashing goes on from there for the key
    h.update(f"|{config}|{diffusers.__version__}".encode())
    if config is not None and (config / "model_index.json").is_file():  # a bare unet/ folder: its path, as before
        h.update(f"|{folder_revision(config, setting)}".encode())
    predicts = single_file_prediction_type(path)
    if predicts is not None:  # read since the scheduler says it: an earlier conversion predicted the config's
        h.update(f"|{predicts}".encode())
    return content, h.hexdigest()[:16]


def _single_file_config(path: Path, model_cfg: ModelConfig, family: str = "sd1") -> Optional[Path]:
    """A local diffusers folder describing the checkpoint's architecture, if one is known."""
    explicit = model_cfg.single_file_config
    denoiser = FAMILY_DENOISER.get(family, "unet")
    if explicit:
        folder = Path(explicit).expanduser()
        if (folder / "model_index.json").is_file():  # said before its parts: a folder of SDXL has no transformer/
            _check_config_family(folder, path, family)
        if not (folder / denoiser).is_dir():
            raise ConfigError(f"model.single_file_config: {folder} is not a diffusers folder (no {denoiser}/); pass "
                              "the folder of a model with the same architecture")
        return folder.resolve()
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    base = meta.get("rangefinder.base_model")
    # A folder, `~/...` as a pipeline's steps spell it: on the machine a file was shared to, `~` is that user's home,
    # where a folder of the same name may hold another family's model, which converted the file deep into diffusers'
    # errors. One of another family is passed over, as a folder that is not there is.
    if base and _of_family(base_model_path(base), family):
        return base_model_path(base)
    if base and not Path(base).is_absolute():  # a hub id, "org/name@revision" as exports write it: its snapshot
        # in the cache, if the run that trained it left one here: the commit it was trained on where the file says
        commit = meta.get("rangefinder.base_model_revision")
        snapshot = _hub_snapshot_of(base, model_cfg, commit)
        if snapshot is not None and _of_family(snapshot, family):
            if commit and _HUB_COMMIT.fullmatch(commit) and snapshot.name != commit:
                _warn_other_snapshot(path, base, commit, snapshot, hub_cache_dir(model_cfg))
            return snapshot
    if (not base or names_embedded_model(base)) and "rangefinder.method" in meta:
        # Exported from the embedded model: its config is the tiny model's (of the file's family).
        ensure: Callable[[Optional[str]], Path] = import_named(TINY_MODELS[family])
        return ensure(model_cfg.cache_dir)
    return None


# A hub revision is a 40-hex commit; a file's sha256 or a folder's fingerprint recorded as its revision is none.
_HUB_COMMIT = re.compile(r"[0-9a-f]{40}")


def _warn_other_snapshot(path: Path, base: str, commit: str, snapshot: Path, cache: Path) -> None:
    """The line saying a single file's architecture is read from another snapshot of its hub base model than the
    commit it was trained on (rangefinder.base_model_revision), which the cache no longer holds: the branch may have
    moved on to another config since, and the conversion goes on with it."""
    from rangefinder.formats.text import warn

    repo_id = base.partition("@")[0]
    warn([f"{path} was trained on {repo_id} at commit {commit}, which the Hugging Face cache {cache} does not hold; "
          f"its architecture is read from the snapshot {snapshot.name} ({base.partition('@')[2] or 'main'}) instead, "
          f"whose config may differ; fetch the commit with `HF_HUB_CACHE={cache} hf download {repo_id} --revision "
          f"{commit} {HUB_INCLUDE}`, or set model.single_file_config to a diffusers folder of that commit"])


def _hub_snapshot_of(source: str, model_cfg: ModelConfig, commit: Optional[str] = None) -> Optional[Path]:
    """The cached snapshot of the hub model `source` names ("org/name" or "org/name@revision"), without any network
    call; None when it is not a valid hub id or not in the cache. `commit`: the file's rangefinder.base_model_revision,
    the commit its run resolved `source` to: that snapshot first, as the branch (main where `source` names none) may
    have moved on to another config since; the branch's where the cache no longer holds the commit."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id, _, revision = source.partition("@")
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    cache = hub_cache_dir(model_cfg)
    if commit and _HUB_COMMIT.fullmatch(commit):
        snapshot = _cached_snapshot(repo_id, commit, cache)
        if snapshot is not None:
            return snapshot
    return _cached_snapshot(repo_id, revision or "main", cache)


def _convert_single_file(path: Path, config: Optional[Path], out: Path, family: str, hub_cache: Path) -> None:
    """`path` as a diffusers folder in `out`. Without `config`, diffusers looks the configs of the file's
    architecture up in the Hugging Face cache `hub_cache` (hub_cache_dir's, read now): left to itself it takes
    huggingface_hub's constants.HF_HUB_CACHE, read once at that library's import, and missed a cache a process set
    after it (a notebook, a second `main()`) though a hub id's run found its snapshot there."""
    import diffusers

    if family == "flux":  # a transformer file alone, in Black Forest Labs' layout: diffusers' converter assumes
        _convert_flux_file(path, config, out)  # Flux.1's widths
        return

    layout = FAMILY_LAYOUTS[family]
    kwargs: dict[str, Any] = dict(layout.pipeline_kwargs, cache_dir=str(hub_cache))
    if config is not None:
        _check_config_family(config, path, family)
        kwargs.update(config=str(config), local_files_only=True)
        kwargs.update(parts_not_in_single_file(path, config, family))
    pipeline_class: Any = getattr(diffusers, layout.pipeline)
    try:
        with _without_the_offline_config_notice(), _hub_offline_while_set():
            pipe = pipeline_class.from_single_file(str(path), **kwargs)
    except Exception as e:  # diffusers raises many kinds here (missing keys, hub errors, shape mismatches)
        hint = (
            f"its architecture was taken from {config}" if config is not None
            else "set model.single_file_config to a local diffusers folder of the same architecture "
                 "(diffusers otherwise fetches one from the hub)"
        )
        raise ConfigError(f"model.base_model: cannot convert the checkpoint {path}: {_first_line(e)}; {hint}") from None
    predict_as_the_file_says(pipe, path)
    pipe.save_pretrained(str(out), safe_serialization=True)


class _OfflineConfigNotice(logging.Filter):
    """Drops diffusers' two lines that `local_files_only` is set (HF_HUB_OFFLINE does) and no config of the file's
    architecture is cached, so it downloads one: offline that download fails, and the refusal says so in its one
    line, with the setting that gives the architecture. Every other record of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("`local_files_only` is True but no local configs were found")


@contextlib.contextmanager
def _without_the_offline_config_notice() -> Iterator[None]:
    """_OfflineConfigNotice on diffusers' single-file loader while inside."""
    logger = logging.getLogger("diffusers.loaders.single_file")  # diffusers' logging.get_logger(__name__)
    notice = _OfflineConfigNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


@contextlib.contextmanager
def _hub_offline_while_set() -> Iterator[None]:
    """huggingface_hub offline while inside where hub_offline() says so now. huggingface_hub reads HF_HUB_OFFLINE
    once, at its import, into `constants.HF_HUB_OFFLINE`, which its every request reads back (is_offline_mode, in
    the request hook of its HTTP session); a process that set the variable after (a notebook, a second `main()`) was
    offline for rangefinder but not for the library, and diffusers' from_single_file, which downloads the configs of
    a file's architecture though told local_files_only where none are cached, went to the hub. Inside, a request is
    refused before it connects, as in a process started with HF_HUB_OFFLINE=1."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or not hub_offline():
        yield
        return
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = False


def parts_not_in_single_file(path: Path, config: Path, family: str, dtype: Any = None) -> dict[str, Any]:
    """The parts of an SD3 model its single file leaves out, loaded from `config` (a local SD3 folder), for
    from_single_file; {} for another family (an SD 1.x/SDXL file holds every part, a Flux file is read apart:
    _convert_flux_file); in `dtype` where given, as the pipeline loading the file. Stability ships SD3.5 Large's and
    Medium's MMDiT and VAE in one file and the three text encoders apart (the repo's
    text_encoders/, which ComfyUI loads beside it), and diffusers' from_single_file reads a part the file lacks only
    when it is passed in: it stopped with "Weights for this component appear to be missing in the checkpoint"."""
    from safetensors import safe_open

    from rangefinder.formats.single_file import LDM_VAE_PREFIX
    from rangefinder.formats.single_file_sd3 import SD3_CLIP_G_PREFIX, SD3_CLIP_L_PREFIX, SD3_T5_PREFIX

    if family != "sd3":
        return {}
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    held = {"text_encoder": SD3_CLIP_L_PREFIX, "text_encoder_2": SD3_CLIP_G_PREFIX, "text_encoder_3": SD3_T5_PREFIX,
            "vae": LDM_VAE_PREFIX}
    classes = dict(FAMILY_LAYOUTS["sd3"].classes)
    parts = {part: import_named(classes[part]).from_pretrained(str(config), subfolder=part, local_files_only=True)
             for part, prefix in held.items() if not any(k.startswith(prefix) for k in keys)}
    return {part: module.to(dtype) for part, module in parts.items()} if dtype is not None else parts


def _of_family(folder: Path, family: str) -> bool:
    """Whether `folder` may give the architecture of a file of `family`: its denoiser's folder is there, and its
    model_index.json, where it has one, names no pipeline of another family."""
    if not (folder / FAMILY_DENOISER.get(family, "unet")).is_dir():
        return False
    if not (folder / "model_index.json").is_file():
        return True  # the parts alone: their configs are what the conversion reads
    try:
        return detect_family(folder) == family
    except ConfigError:  # a damaged model_index.json, or a pipeline rangefinder does not train
        return False


def _check_config_family(config: Path, path: Path, family: str) -> None:
    """ConfigError where the folder giving a single file's architecture is a model of another family."""
    theirs = detect_family(config)
    if theirs != family:
        raise ConfigError(
            f"model.single_file_config: {config} is a {FAMILY_NAMES[theirs]} model but {path} is a "
            f"{FAMILY_NAMES[family]} checkpoint; pass a folder of the checkpoint's own family"
        )


def predict_as_the_file_says(pipe: Any, path: Path) -> None:
    """Set the scheduler of `pipe`, read from the single file `path`, to predict what the file says its UNet predicts
    (a v-prediction SDXL checkpoint's `v_pred` tensor, rangefinder's own `modelspec.predict_key`:
    formats.single_file.single_file_prediction_type): diffusers' `from_single_file` takes the scheduler from the
    config folder it is given, or its defaults, never from the file. A file that says nothing keeps that."""
    predicts = single_file_prediction_type(path)
    if predicts is not None and "prediction_type" in pipe.scheduler.config:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, prediction_type=predicts)


def _convert_flux_file(path: Path, config: Optional[Path], out: Path) -> None:
    """A Flux transformer file (Black Forest Labs' layout) as a FluxPipeline folder: the file's transformer, mapped
    back by formats/flux_layout.py (diffusers' own converter assumes Flux.1's widths), with the VAE, CLIP-L and T5 of
    `config`, a Flux folder: a transformer file holds nothing else."""
    from diffusers import FluxPipeline

    from rangefinder.formats.diffusers_folder import save_pipeline_folder

    if config is None:
        raise ConfigError(
            f"model.base_model: {path} holds Flux's transformer only (Black Forest Labs' layout); set "
            "model.single_file_config to a local Flux diffusers folder, whose VAE, CLIP-L and T5 are used with it"
        )
    _check_config_family(config, path, "flux")
    pipe = FluxPipeline.from_pretrained(str(config), local_files_only=True)
    pipe.transformer = flux_transformer_from_file(path, pipe.transformer.config, config, "model.base_model")
    save_pipeline_folder(pipe, out)


def flux_transformer_from_file(path: Path, config: Any, config_source: Path, setting: str) -> Any:
    """The FluxTransformer2DModel of `config` (from the folder `config_source`) with the weights of the Flux
    transformer file `path` (Black Forest Labs' layout, mapped back by formats/flux_layout.py: diffusers' own
    converter assumes Flux.1's widths); ConfigError naming `setting` where they do not fit."""
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    from rangefinder.formats.flux_layout import from_bfl_state_dict

    transformer = FluxTransformer2DModel.from_config(config)
    try:
        transformer.load_state_dict(from_bfl_state_dict(load_file(str(path)), transformer.config), strict=True)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"{setting}: cannot read the Flux transformer {path} with the architecture of "
                          f"{config_source}: {_first_line(e)}; pass the folder of the model it was trained from") \
            from None
    return transformer


# --- hub id --------------------------------------------------------------------------------------------------


def hub_cache_dir(model_cfg: ModelConfig) -> Path:
    """Where hub models are cached, read when called: model.cache_dir, $HF_HUB_CACHE, $HF_HOME/hub, or
    ~/.cache/huggingface/hub (huggingface_hub reads the same variables, but only once, at import)."""
    if model_cfg.cache_dir:
        return Path(model_cfg.cache_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return expand_home(os.environ["HF_HUB_CACHE"], "$HF_HUB_CACHE")
    if os.environ.get("HF_HOME"):
        return expand_home(os.environ["HF_HOME"], "$HF_HOME") / "hub"
    return expand_home(os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"),
                       "$XDG_CACHE_HOME") / "hub"


def hub_offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return constants.HF_HUB_OFFLINE or any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def _hub_location(repo_id: str, model_cfg: ModelConfig) -> tuple[str, Path]:
    """(revision, Hugging Face cache folder) of a hub id; ConfigError for an id the hub cannot have. The revision is
    the commit the pipeline's first step resolved `model.revision` to (model.resolved_revision), where it did: a step
    that cannot see that step's folder loads the same commit, not what a branch names by then."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ConfigError(
            f"model.base_model: {repo_id!r} is neither an existing path nor a valid hub id; pass a diffusers folder, "
            f"a {SINGLE_FILE_SUFFIX} file or a hub id such as stable-diffusion-v1-5/stable-diffusion-v1-5"
        ) from None
    return model_cfg.resolved_revision or model_cfg.revision or "main", hub_cache_dir(model_cfg)


def hub_family(model_cfg: ModelConfig) -> Optional[str]:
    """The family of a hub id base model, read off its model_index.json alone, before any weights are fetched:
    from the snapshot in the Hugging Face cache, else that one file downloaded into it (with the cache, offline
    setting, endpoint and errors of resolve_base_model, which then finds it there). For the checks made before a
    run (training.families.check_local_model_settings): a method the family cannot train is refused before a
    download of gigabytes, not after it. None when the base model is not a hub id, or its cached snapshot has no
    model_index.json (resolve_base_model says so)."""
    name = model_cfg.base_model
    if name is None or _kind(name) != "hub":
        return None
    revision, cache = _hub_location(name, model_cfg)
    folder = _cached_snapshot(name, revision, cache)
    if folder is None:
        if hub_offline():
            _raise_not_cached(name, revision, cache)
        folder = _fetch_model_index(name, revision, cache).parent
    return detect_family(folder) if (folder / "model_index.json").is_file() else None


def _resolve_hub(repo_id: str, model_cfg: ModelConfig) -> ResolvedModel:
    revision, cache = _hub_location(repo_id, model_cfg)
    where = f"hub model {repo_id!r} at revision {revision!r}"
    folder = _cached_snapshot(repo_id, revision, cache)
    # A snapshot without its parts' configs (model_index.json alone, fetched by hub_family; a download cut short)
    # is completed where the hub can be reached; offline, the line names what it lacks and how to fill it.
    lacks = _missing_parts(folder) if folder is not None else None
    if folder is not None and lacks and hub_offline():
        raise _snapshot_incomplete(repo_id, revision, cache, folder, lacks, "HF_HUB_OFFLINE is set",
                                   "or unset HF_HUB_OFFLINE so the first step completes it")
    if folder is None or lacks != []:
        if hub_offline():
            _raise_not_cached(repo_id, revision, cache)
        folder = _download(repo_id, revision, model_cfg, cache)
    _check_folder(folder, f"{where} ({folder})", model_cfg.variant)
    # The cache keeps each commit in snapshots/<commit>: the folder's name is the commit `revision` (a branch) named.
    # The source names the revision as configured (a branch), as a step that sees the resolved folder names it.
    return ResolvedModel(folder, "hub", f"{repo_id}@{model_cfg.revision or 'main'}", folder.name)


def _cached_snapshot(repo_id: str, revision: str, cache: Path) -> Optional[Path]:
    """The snapshot folder of `revision` (a branch, tag or commit) in the cache, without any network call."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=True))
    except LocalEntryNotFoundError:  # also an incomplete snapshot (IncompleteSnapshotError)
        return None


def _revisions_held(repo_id: str, cache: Path) -> Optional[str]:
    """"refs main, v1 and snapshots <commit>": what the Hugging Face cache holds of a hub repo, for a message naming
    the revisions model.revision can take offline; None when it holds none of it."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    refs = sorted(str(p.relative_to(repo / "refs")) for p in (repo / "refs").rglob("*") if p.is_file()) \
        if (repo / "refs").is_dir() else []
    # Whole commits: a snapshot's name is the only revision that finds it offline (a short hash does not).
    snapshots = sorted(p.name for p in (repo / "snapshots").iterdir()) if (repo / "snapshots").is_dir() else []
    if not (refs or snapshots):
        return None
    return f"refs {', '.join(refs) or 'none'} and snapshots {', '.join(snapshots) or 'none'}"


def _cache_one_level_off(repo_id: str, cache: Path) -> str:
    """A clause for a cache that holds nothing of the repo where the folder above or below it does: HF_HOME set to the
    hub cache itself (which is HF_HOME/hub), or HF_HUB_CACHE to HF_HOME. Empty otherwise."""
    from huggingface_hub.file_download import repo_folder_name

    name = repo_folder_name(repo_id=repo_id, repo_type="model")
    other = next((d for d in (cache / "hub", cache.parent) if (d / name).is_dir()), None)
    if other is None:
        return ""
    return (f" (it is in {other}: set HF_HUB_CACHE={other}, the folder the models--* folders are in; HF_HOME is the "
            "folder above it)")


def _not_cached(repo_id: str, revision: str, cache: Path, why: str, fill: str, *, named: str = "",
                else_: str = "") -> ConfigError:
    """The error for a hub model the cache does not hold at `revision` and that cannot be fetched (`why`), with the
    download that fills the cache (`fill`): naming the revisions it holds of the repo (a misspelt model.revision), or,
    where it holds none, a cache one folder off. `named` follows the repo id, `else_` the fill, in the second."""
    held = _revisions_held(repo_id, cache)
    if held:
        return ConfigError(
            f"model.revision: {revision!r} of hub model {repo_id!r} is not in the Hugging Face cache {cache} (it "
            f"holds {held}) and {why}; set model.revision to one of those, or {fill}"
        )
    return ConfigError(
        f"model.base_model: hub model {repo_id!r}{named} is not in the Hugging Face cache {cache}"
        f"{_cache_one_level_off(repo_id, cache)} and {why}; {fill}{else_}"
    )


def _raise_not_cached(repo_id: str, revision: str, cache: Path) -> None:
    fill = (f"pre-fill it with `HF_HUB_CACHE={cache} hf download {repo_id} --revision {revision} "
            f"{HUB_INCLUDE}`, or unset HF_HUB_OFFLINE (with HF_TOKEN for a gated or private repo) so the "
            "first step downloads it")
    raise _not_cached(repo_id, revision, cache, "HF_HUB_OFFLINE is set", fill, named=f" (revision {revision!r})")


def _snapshot_incomplete(repo_id: str, revision: str, cache: Path, snapshot: Path, lacks: list[str], why: str,
                         otherwise: str) -> ConfigError:
    """The error for a snapshot in the cache without some of its parts (a download cut short) that cannot be
    completed here (`why`), with the download that completes it."""
    return ConfigError(
        f"model.base_model: the snapshot of hub model {repo_id!r} at revision {revision!r} in the Hugging Face cache "
        f"({snapshot}) lacks {', '.join(f'{p}/' for p in lacks)}, which cannot be fetched here ({why}); complete "
        f"it with `HF_HUB_CACHE={cache} hf download {repo_id} --revision {revision} {HUB_INCLUDE}` {otherwise}"
    )


def _unreachable(repo_id: str, revision: str, cache: Path, e: Exception) -> ConfigError:
    """The error for a hub that cannot be reached, saying what the cache holds of the repo: the revision's snapshot
    without some of its parts (a download cut short), other revisions (a misspelt model.revision), or nothing."""
    unreachable = f"the hub cannot be reached from here ({_first_line(e)})"
    fill = f"pre-fill the cache on a machine that can reach it (`hf download {repo_id} --revision {revision}`)"
    partial = _cached_snapshot(repo_id, revision, cache)
    lacks = _missing_parts(partial) if partial is not None else None
    if partial is not None and lacks:
        return _snapshot_incomplete(repo_id, revision, cache, partial, lacks,
                                    f"the hub cannot be reached from here: {_first_line(e)}",
                                    "on a machine that can reach the hub")
    return _not_cached(repo_id, revision, cache, unreachable, fill, else_=", or pass a local folder or checkpoint file")


def _gated(repo_id: str) -> ConfigError:
    return ConfigError(
        f"model.base_model: hub model {repo_id!r} is gated and no token with access was given; accept its licence "
        f"on huggingface.co/{repo_id} and give that account's token as HF_TOKEN (on a cluster: the Secret named by "
        "kubernetes.hf_token_secret)"
    )


def _download(repo_id: str, revision: str, model_cfg: ModelConfig, cache: Path) -> Path:
    """Check the repo and fetch its model_index.json (_fetch_model_index), then download what a diffusers pipeline
    loads (diffusers' own file selection: one weights format, the asked variant, no safety checker)."""
    from diffusers import DiffusionPipeline
    from huggingface_hub.errors import GatedRepoError

    _fetch_model_index(repo_id, revision, cache)
    try:
        folder = DiffusionPipeline.download(repo_id, revision=revision, variant=model_cfg.variant,
                                            cache_dir=str(cache), safety_checker=None, feature_extractor=None)
    except GatedRepoError:
        raise _gated(repo_id) from None
    except Exception as e:  # a missing variant, a repo of another pipeline, the network gone mid-download
        raise ConfigError(f"model.base_model: cannot download hub model {repo_id!r} at revision {revision!r}: "
                          f"{_first_line(e)}") from None
    return Path(folder)


def _fetch_model_index(repo_id: str, revision: str, cache: Path) -> Path:
    """Check the repo in one metadata call (failing in seconds, with the reason) and download its model_index.json
    alone into the cache; the file's path there."""
    from huggingface_hub import HfApi, get_token, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now: huggingface_hub reads it once, at import
    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, timeout=HUB_TIMEOUT_S)
        if info.gated and get_token() is None:
            raise _gated(repo_id)
        return Path(hf_hub_download(repo_id, "model_index.json", revision=revision, cache_dir=str(cache),
                                    endpoint=endpoint, etag_timeout=HUB_TIMEOUT_S))
    except GatedRepoError:  # a token that has not accepted the licence
        raise _gated(repo_id) from None
    except RevisionNotFoundError:
        raise ConfigError(
            f"model.revision: {revision!r} does not exist for hub model {repo_id!r}; give a branch, tag or commit "
            "of the repo (its Files tab lists them), or leave model.revision unset for main"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"model.base_model: no hub model {repo_id!r} (or it is private and HF_TOKEN has no access); check the id"
        ) from None
    except EntryNotFoundError:
        raise ConfigError(
            f"model.base_model: hub model {repo_id!r} is not in diffusers format (no model_index.json); pass a "
            f"diffusers repo, or download its {SINGLE_FILE_SUFFIX} checkpoint and pass the file"
        ) from None
    except ConfigError:
        raise
    except Exception as e:  # network errors come from the HTTP library, whose classes vary by version
        raise _unreachable(repo_id, revision, cache, e) from None


# ---------------------------------------------------------------------------------------------------------------
# Loading the parts


def _load_folder(resolved: ResolvedModel, model_cfg: ModelConfig) -> SDComponents:
    """Each part from the resolved folder, as diffusers' training scripts load them: with the classes its family's
    layout names (family_detection.FamilyLayout.classes), the denoiser (a UNet or a transformer) as `unet`, and
    the training scheduler as `noise_scheduler` (SD 1.x and SDXL: a DDPMScheduler from the model's config; SD3
    and Flux: the model's own flow-matching scheduler, whose shift settings the objective reads)."""
    folder = str(resolved.path)
    family = detect_family(resolved.path)
    layout = FAMILY_LAYOUTS[family]
    # The revision of the weights loaded now (a folder's fingerprint, ~0.1 s for SD 1.5), not of those the folder
    # holds when the run's files are written, hours on, which someone may have replaced by then.
    _ = resolved.revision
    # Variant files (e.g. fp16) keep their names in a hub snapshot or a saved folder; a converted file has none.
    has_variants = model_cfg.variant and resolved.kind in ("hub", "folder")
    var: dict[str, Any] = {"variant": model_cfg.variant} if has_variants else {}
    parts: dict[str, Any] = {}
    part = ""
    try:
        for part, class_path in layout.classes:
            cls = import_named(class_path)
            weights = _has_weights(part)
            key = {layout.denoiser: "unet", "scheduler": "noise_scheduler"}.get(part, part)
            variant = (var.get("variant") or sole_variant(resolved.path / part)) if weights else None
            parts[key] = cls.from_pretrained(folder, subfolder=part, local_files_only=True,
                                             **({"variant": variant} if variant else {}))
    except (OSError, ValueError, pickle.UnpicklingError) as e:
        where = f"{part}/ of {folder} ({resolved.source})"
        if _raised_from(e, pickle.UnpicklingError):  # torch.load(weights_only=True) met more than tensors in a .bin:
            raise ConfigError(  # transformers raises it as it is, diffusers inside an OSError of its own
                f"model.base_model: {where} holds pickle weights with objects other than tensors, so they were "
                f"refused unread (unpickling them can run code); convert them to {SINGLE_FILE_SUFFIX} or use a copy "
                f"of the model that has {SINGLE_FILE_SUFFIX} weights"
            ) from None
        raise ConfigError(
            f"model.base_model: cannot load the diffusers folder {folder} ({resolved.source}): {_first_line(e)}"
        ) from None
    for key in ("unet", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        if key in parts:
            parts[key].eval()
    return SDComponents(source=resolved.source, model_dir=resolved.path, kind=resolved.kind, family=family,
                        digest=weights_digest(parts), resolved=resolved, **parts)


def _has_weights(part: str) -> bool:
    """Whether a part of a diffusers folder is a model with weights (not a tokenizer or the scheduler)."""
    return not (part.startswith("tokenizer") or part == "scheduler")


def _raised_from(e: BaseException, kind: type[BaseException]) -> bool:
    """Whether `e`, or an exception it was raised from or while handling, is a `kind`."""
    seen: Optional[BaseException] = e
    while seen is not None:
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# A part's weights file, as diffusers and transformers name it: `diffusion_pytorch_model`, `model` or `pytorch_model`,
# then `.<variant>` where it is one (fp16), `-00001-of-00002` where it is a shard, then the format.
_WEIGHTS_FILE = re.compile(r"^(?:diffusion_pytorch_model|model|pytorch_model)(?:\.(?P<variant>[^.-]+))?"
                           r"(?:-\d+-of-\d+)?\.(?:safetensors|bin)(?:\.index\.json)?$")


def _variants(part_dir: Path) -> set[Optional[str]]:
    """The variants a part's weights files are in (None: the plain weights)."""
    files = part_dir.iterdir() if part_dir.is_dir() else ()
    return {m["variant"] for f in files if (m := _WEIGHTS_FILE.match(f.name))}


def sole_variant(part_dir: Path) -> Optional[str]:
    """The variant a part holds its weights in when it holds them in that one alone, no plain ones (an fp16-only
    download, or a part of a folder saved so): diffusers and transformers load such files only when told their
    variant, which model.variant need not repeat; None otherwise."""
    found = _variants(part_dir)
    return next(iter(found)) if len(found) == 1 else None


def folder_variant(folder: Path) -> Optional[str]:
    """The variant to load a whole diffusers folder with (a pipeline's from_pretrained, which takes the plain weights
    of a part without that variant): the one its parts without plain weights hold theirs in; None when every part
    has plain weights (or they disagree: the load names what is missing)."""
    only = {sole_variant(part) for part in folder.iterdir() if part.is_dir() and None not in _variants(part)}
    only.discard(None)
    return next(iter(only)) if len(only) == 1 else None


def _weights_missing(part_dir: Path, variant: Optional[str]) -> Optional[str]:
    """Why a part of a diffusers folder has no weights its load would find, with the fix: only other variants'
    files (more than one, model.variant unset), none of the variant asked for, or none at all; None when the files
    asked for are there."""
    found = _variants(part_dir)
    if variant in found:
        return None
    others = sorted(v for v in found if v is not None)
    if variant is None and others:
        return (f"holds only the {' and '.join(others)} variants of its weights, and model.variant is unset; set "
                f"model.variant to the one to train")
    if variant is not None and not others and found:
        return (f"has no {variant!r} variant of its weights (model.variant), only the plain ones; leave model.variant "
                "unset")
    if variant is not None and found:
        return (f"has no {variant!r} variant of its weights (model.variant), only {', '.join(others)}; set "
                f"model.variant to one of those{', or leave it unset' if None in found else ''}")
    return ("holds no weights file (no diffusion_pytorch_model or model .safetensors); the download or copy is "
            "incomplete: fetch the model again or pass a complete folder")


def weights_digest(parts: dict[str, Any]) -> str:
    """sha256 of the models' parameter names, shapes, dtypes and first 64 values each: two base models (another
    fine-tune of the same architecture differs in every tensor) tell apart without hashing gigabytes of weights."""
    import torch

    h = hashlib.sha256()
    for key in ("unet", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        if key not in parts:
            continue
        for name, t in parts[key].state_dict().items():
            h.update(f"{key}.{name}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(t.detach().reshape(-1)[:64].to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# ---------------------------------------------------------------------------------------------------------------
# Schedulers


# Scheduler class names taken as diffusers' without importing it: importing diffusers imports torch, about 4 s of a
# `compile`, a `run --local` or resolve-config of the demo's config (config.demo_config samples with DDIM), none of
# which needs either (training/families.py). tests/models/test_loading.py holds each to diffusers' own classes.
KNOWN_SCHEDULERS = frozenset({"DDIMScheduler"})


def check_scheduler_name(name: Optional[str]) -> None:
    """ConfigError unless `name` (sampling.scheduler) is a diffusers scheduler class; None (the model's own) is."""
    if name is None or name in KNOWN_SCHEDULERS:
        return
    import diffusers
    from diffusers import SchedulerMixin

    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, SchedulerMixin)):
        raise ConfigError(
            f"sampling.scheduler: {name!r} is not a diffusers scheduler class; "
            "use a class name such as DDIMScheduler, EulerDiscreteScheduler or DPMSolverMultistepScheduler"
        )


def check_scheduler_takes(family: str, name: Optional[str]) -> None:
    """ConfigError where sampling.scheduler `name` cannot take what the family's pipeline hands its `set_timesteps`
    (FamilyLayout.scheduler_takes): FlowMatchHeunDiscreteScheduler on Flux stopped the first sample in diffusers'
    ValueError, the fine-tune's after the LR discovery. None (the model's own) is fine; `name` is a diffusers
    scheduler class (check_scheduler_name)."""
    needs = FAMILY_LAYOUTS[family].scheduler_takes
    if name is None or not needs:
        return
    import inspect

    import diffusers

    taken = inspect.signature(getattr(diffusers, name).set_timesteps).parameters
    missing = [n for n in needs if n not in taken]
    if missing:
        raise ConfigError(f"sampling.scheduler: {name} cannot sample {FAMILY_NAMES[family]}: "
                          f"{FAMILY_LAYOUTS[family].pipeline} gives its scheduler {' and '.join(missing)}, which "
                          f"{name}.set_timesteps does not take; use FlowMatchEulerDiscreteScheduler (the model's own) "
                          "or leave sampling.scheduler unset")


def pipeline_call_kwargs(pipe: Any) -> dict[str, Any]:
    """Keyword arguments a loaded pipeline of the model's family needs at call time beyond the common ones: the T5
    sequence length its family trains with (family_detection.t5_sequence_length: SD3's 77 tokens, where
    StableDiffusion3Pipeline defaults to 256; Flux's 512, or fewer where its T5 tokenizer stops sooner, as the tiny
    model's ByT5), so samples see the conditioning training saw."""
    family = FAMILY_OF_PIPELINE.get(type(pipe).__name__)
    if family is None or FAMILY_LAYOUTS[family].t5_tokens is None:
        return {}
    return {"max_sequence_length": t5_sequence_length(family, pipe)}
