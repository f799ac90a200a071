"""Which model family a base model is, read from its files: beside the families the engine trains (families.py).

The family is read from the model, never set by the user (docs/model-families.md): a diffusers folder's
model_index.json names its pipeline class, and a single file's tensor names tell SDXL's layout from SD 1.x's.

This module imports nothing of the package but config, errors and the single-file layout, so that models/loading.py,
which must know a model's family to load its parts, can import it: families.py names `models.loading.SDComponents`
(for type checking), so detection there would close a loop between models and training.
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from rangefinder.config import ModelConfig
from rangefinder.errors import ConfigError
from rangefinder.formats.flux_layout import FLUX_CHECKPOINT_PREFIX, FLUX_DOUBLE_BLOCK_KEY, FLUX_SINGLE_BLOCK_KEY
from rangefinder.formats.single_file import LDM_UNET_PREFIX, SGM_CLIP_G_PREFIX


def import_named(target: str) -> Any:
    """The object a "module:name" string names (FamilyLayout's exports, families.FAMILIES), imported only when
    used, so that naming it here imports nothing."""
    module_name, name = target.split(":")
    return getattr(importlib.import_module(module_name), name)


@dataclass(frozen=True)
class FamilyLayout:
    """What loading, sampling and exporting read of a family: plain facts, so that models/, sampling and the methods
    read them here, beside detection, without importing the engine's family classes (training/families.py). A new
    family is one entry here, its name in config.FAMILY_NAMES and its family module."""

    pipeline: str  # the diffusers pipeline class (model_index.json `_class_name`)
    denoiser: str  # the denoiser's folder and pipeline argument (loaded as SDComponents.unet whatever its kind)
    # (part, "library:Class") that models/loading.py loads for training; "scheduler" is the training scheduler.
    classes: tuple[tuple[str, str], ...]
    t5: Optional[str] = None  # the part holding T5: never trained, and kept out of fp16 (T5 overflows there)
    # T5 tokens per caption (`t5_sequence_length`): what training encodes, and so what its pipeline is called with
    # (max_sequence_length), whose own default may differ (StableDiffusion3Pipeline's is 256).
    t5_tokens: Optional[int] = None
    # Parameters kept frozen when their encoder trains: SD3's CLIP-L pools unprojected (its projection the identity).
    frozen: tuple[str, ...] = ()
    # `full`'s single file, "module:function(folder, file, metadata, facts)": the layout ComfyUI and A1111 load, with
    # the run's facts (formats/model_spec.py SpecFacts) in its model spec.
    single_file_export: str = "rangefinder.formats.single_file:export_full"
    # `lora`'s two files (diffusers' names and kohya's), "module:function(folder, denoiser, text_encoder,
    # text_encoder_2, metadata, prediction_type, facts)" (formats/lora.py).
    lora_export: str = "rangefinder.formats.lora:save_sd_lora_files"
    pipeline_kwargs: tuple[tuple[str, object], ...] = ()  # what its pipeline's constructor and loaders also take
    # Its saved folder keeps the base model's own sampling scheduler (SD 1.5 ships PNDM, SDXL Euler) rather than the
    # training DDPM, as its samples and the grid's checkpoint columns sample (samples.sampling_scheduler): a grid's
    # chosen/ and final/ columns then differ from its base and checkpoint columns in their weights alone. SD3 and Flux
    # train with their flow-matching one.
    samples_with_its_scheduler: bool = False
    # What its pipeline hands the sampling scheduler's `set_timesteps` (FluxPipeline: its own sigmas and the image
    # size's shift mu, every call), which a sampling.scheduler must take (models/loading.py check_scheduler_takes).
    scheduler_takes: tuple[str, ...] = ()

    @property
    def t5_tokenizer(self) -> Optional[str]:
        """The part holding T5's tokenizer (text_encoder_3's is tokenizer_3); None without T5."""
        return None if self.t5 is None else "tokenizer" + self.t5.removeprefix("text_encoder")

    @property
    def parts(self) -> tuple[str, ...]:
        """The parts it needs beyond models.loading.REQUIRED_PARTS (SD 1.x's, the denoiser's folder aside)."""
        return tuple(p for p, _ in self.classes if p not in ("vae", "text_encoder", "tokenizer", "scheduler",
                                                               self.denoiser))


_SD_CLASSES = (("tokenizer", "transformers:CLIPTokenizer"), ("text_encoder", "transformers:CLIPTextModel"),
             ("vae", "diffusers:AutoencoderKL"), ("unet", "diffusers:UNet2DConditionModel"),
             ("scheduler", "diffusers:DDPMScheduler"))  # a DDPM model trains with DDPMScheduler
FAMILY_LAYOUTS = {
    "sd1": FamilyLayout("StableDiffusionPipeline", "unet", _SD_CLASSES,
                        pipeline_kwargs=(("safety_checker", None), ("feature_extractor", None),
                                         ("requires_safety_checker", False)),
                        samples_with_its_scheduler=True),
    "sdxl": FamilyLayout("StableDiffusionXLPipeline", "unet",
                         (*_SD_CLASSES, ("tokenizer_2", "transformers:CLIPTokenizer"),
                          ("text_encoder_2", "transformers:CLIPTextModelWithProjection")),
                         samples_with_its_scheduler=True,
                         lora_export="rangefinder.formats.lora:save_sdxl_lora_files"),
    # SD3: both CLIPs with projection, T5 with whatever tokenizer its folder names (AutoTokenizer), the MMDiT.
    "sd3": FamilyLayout("StableDiffusion3Pipeline", "transformer",
                        (("tokenizer", "transformers:CLIPTokenizer"),
                         ("text_encoder", "transformers:CLIPTextModelWithProjection"),
                         ("tokenizer_2", "transformers:CLIPTokenizer"),
                         ("text_encoder_2", "transformers:CLIPTextModelWithProjection"),
                         ("tokenizer_3", "transformers:AutoTokenizer"),
                         ("text_encoder_3", "transformers:T5EncoderModel"),
                         ("vae", "diffusers:AutoencoderKL"), ("transformer", "diffusers:SD3Transformer2DModel"),
                         ("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler")),
                        t5="text_encoder_3", t5_tokens=77,  # diffusers' SD3 training examples' max_sequence_length
                        frozen=("text_encoder.text_projection",),
                        single_file_export="rangefinder.formats.single_file_sd3:export_sd3_full",
                        lora_export="rangefinder.formats.lora:save_sd3_lora_files"),
    # Flux: CLIP-L, and T5 with its tokenizer as the second encoder; `full`'s file is the transformer alone in
    # Black Forest Labs' layout, as BFL ships Flux.
    "flux": FamilyLayout("FluxPipeline", "transformer",
                         (("tokenizer", "transformers:CLIPTokenizer"), ("text_encoder", "transformers:CLIPTextModel"),
                          ("tokenizer_2", "transformers:AutoTokenizer"),
                          ("text_encoder_2", "transformers:T5EncoderModel"), ("vae", "diffusers:AutoencoderKL"),
                          ("transformer", "diffusers:FluxTransformer2DModel"),
                          ("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler")),
                         t5="text_encoder_2", t5_tokens=512,  # FluxPipeline's, and diffusers' Flux training examples'
                         scheduler_takes=("sigmas", "mu"),
                         single_file_export="rangefinder.formats.flux_layout:export_flux_transformer",
                         lora_export="rangefinder.formats.lora:save_flux_lora_files"),
}
FAMILY_OF_PIPELINE = {layout.pipeline: name for name, layout in FAMILY_LAYOUTS.items()}
FAMILY_PARTS = {name: layout.parts for name, layout in FAMILY_LAYOUTS.items()}
FAMILY_DENOISER = {name: layout.denoiser for name, layout in FAMILY_LAYOUTS.items()}
# In a single file (the LDM/SGM layout): SDXL's UNet has the added (pooled text + size) embedding `label_emb`, and
# SGM's conditioner holds the two text encoders, CLIP ViT-L as embedders.0 and OpenCLIP bigG as embedders.1.
SDXL_SINGLE_FILE_UNET_KEY = LDM_UNET_PREFIX + "label_emb.0.0.weight"
SDXL_SINGLE_FILE_TE2_PREFIX = SGM_CLIP_G_PREFIX
# SD3's single file (Stability's layout, which ComfyUI and diffusers' from_single_file read): the MMDiT's
# `joint_blocks` under model.diffusion_model.
SD3_SINGLE_FILE_KEY_PREFIX = LDM_UNET_PREFIX + "joint_blocks."


def sampling_dtypes(family: str) -> dict[str, str]:
    """The torch dtype (its name) a pipeline of `family` samples in, by the precision the machine offers
    (config.resolve_mixed_precision's `auto`: "bf16" on a CUDA GPU that computes in bf16, "fp16" on an older one, "no"
    on a CPU). SD 1.x/2.x and SDXL sample in fp16 on any GPU. The flow families (SD3, Flux: the families with T5)
    sample in bf16, as diffusers' FluxPipeline example and the SD3.5 model cards load them: T5-XXL overflows in fp16
    (NaN, black images), which is why the engine keeps it out of fp16 too (training/setup.py), and Flux's transformer
    is released in bf16; on a GPU without bf16 they sample in fp32. A CPU samples every family in fp32.

    A dict of names rather than a torch.dtype, as the registered model's config carries it (tracking/sd_pyfunc.py
    cannot import rangefinder, and reads its dtype from there)."""
    flow = FAMILY_LAYOUTS[family].t5 is not None
    return {"bf16": "bfloat16" if flow else "float16", "fp16": "float32" if flow else "float16", "no": "float32"}


def sampling_dtype(family: str, device: str) -> Any:
    """The torch.dtype a pipeline of `family` samples in on `device` ("cuda", "cpu", ...): sampling_dtypes' choice
    for the precision the device offers."""
    import torch

    from rangefinder.config import resolve_mixed_precision

    return getattr(torch, sampling_dtypes(family)[resolve_mixed_precision("auto", device)])


def t5_sequence_length(family: str, parts: Any) -> int:
    """T5 tokens per caption for a model of `family`, a family with T5: its layout's `t5_tokens`, or fewer where the
    model's T5 tokenizer (an attribute of `parts`, its loaded parts or its pipeline) stops sooner, as the tiny Flux's
    ByT5 at 64. The family's training encodes captions to this length and every sampling call passes it
    (models/loading.py: pipeline_call_kwargs): T5 runs without an attention mask, so its states, and what the
    transformer attends to, change with the padding, and another length is another conditioning."""
    layout = FAMILY_LAYOUTS[family]
    if layout.t5_tokens is None or layout.t5_tokenizer is None:
        raise ValueError(f"the {family} family has no T5 encoder")
    tokenizer = getattr(parts, layout.t5_tokenizer, None)
    return min(layout.t5_tokens, int(getattr(tokenizer, "model_max_length", None) or layout.t5_tokens))


def folder_t5_sequence_length(folder: Path) -> Optional[int]:
    """`t5_sequence_length` of the model in the diffusers folder `folder`, its T5 tokenizer loaded with the class its
    family's layout names (as models/loading.py loads it for training); None for a family without T5. For what reads a
    saved folder without loading the model: the registered MLflow model's config (tracking/registry.py)."""
    family = detect_family(folder)
    layout = FAMILY_LAYOUTS[family]
    if layout.t5_tokens is None or layout.t5_tokenizer is None:
        return None
    tokenizer_cls = import_named(dict(layout.classes)[layout.t5_tokenizer])
    tokenizer = tokenizer_cls.from_pretrained(str(folder), subfolder=layout.t5_tokenizer, local_files_only=True)
    return t5_sequence_length(family, SimpleNamespace(**{layout.t5_tokenizer: tokenizer}))


def guidance_scale_for(family: str, setting: Optional[float] = None) -> float:
    """The guidance scale a model of `family` samples at: `setting` (sampling.guidance_scale) when set, else what the
    family's diffusers pipeline samples at when given none, its `__call__`'s default (StableDiffusionPipeline 7.5,
    StableDiffusionXLPipeline 5.0, StableDiffusion3Pipeline 7.0, FluxPipeline 3.5, which is Flux.1-dev's distilled
    guidance input and which schnell, without the guidance embedding, ignores). Read from diffusers rather than
    written down here, so that it is the value a diffusers user of the same model gets: from its source where the
    default is written there as a number, else from the imported class."""
    if setting is not None:
        return float(setting)
    name = FAMILY_LAYOUTS[family].pipeline
    written = _call_default_in_source(name, "guidance_scale")
    if written is not None:
        return written
    import inspect

    pipeline = import_named(f"diffusers:{name}")
    return float(inspect.signature(pipeline.__call__).parameters["guidance_scale"].default)


@functools.cache  # diffusers does not change under a running process, which asks again (params, samples, registry)
def _call_default_in_source(pipeline: str, parameter: str) -> Optional[float]:
    """The number `parameter` defaults to in diffusers' `pipeline.__call__`, read from the installed diffusers'
    source (the module under diffusers/pipelines/ that defines the class) without importing it: importing a pipeline
    imports torch and transformers, ~10 CPU-s that a step which only logs the value (resolve-config's
    sampling.guidance_scale_used, the first step of every run) spent before anything else. None where the default
    is not written there as a number (or diffusers is not where Python would import it from): the caller imports."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("diffusers")  # finds the package; runs none of it
    if spec is None or not spec.submodule_search_locations:
        return None
    marker = f"class {pipeline}("
    for folder in spec.submodule_search_locations:
        for path in sorted(Path(folder, "pipelines").glob("*/pipeline_*.py")):
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if marker not in source:
                continue
            for node in ast.parse(source).body:
                if not (isinstance(node, ast.ClassDef) and node.name == pipeline):
                    continue
                call = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__call__"), None)
                if call is None:
                    return None
                named = call.args.args[len(call.args.args) - len(call.args.defaults):] + call.args.kwonlyargs
                defaults = [*call.args.defaults, *call.args.kw_defaults]
                default = next((d for a, d in zip(named, defaults, strict=True) if a.arg == parameter), None)
                try:
                    value = ast.literal_eval(default) if default is not None else None
                except ValueError:
                    return None
                return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return None


# `refuse` of guidance_scale_in for the run's own setting: the preflight and the samples during training say it alike.
SAMPLING_GUIDANCE_REFUSAL = ("sampling.guidance_scale", "remove sampling.guidance_scale")


def guidance_scale_in(folder: Optional[Path], family: str, setting: Optional[float] = None, *,
                      refuse: Optional[tuple[str, str]] = None) -> Optional[float]:
    """The guidance scale the model in diffusers folder `folder` samples at (guidance_scale_for), or None where its
    pipeline ignores every scale: a Flux transformer without the guidance embedding (FLUX.1-schnell, whose config
    has `guidance_embeds` false: FluxPipeline feeds the scale to the transformer only where it is true, and schnell,
    distilled to sample in few steps without guidance, has no input for it). `folder` None (parts from no folder,
    or a model not here to read): the family's. `refuse`: (the setting's name, how to leave it out), to refuse a
    `setting` given for such a model, where it would change nothing; 0 asks for none (diffusers' own schnell example
    passes it) and is taken."""
    from rangefinder.training.family_rules import guidance_embedded

    if family == "flux" and folder is not None:
        try:
            denoiser = json.loads((Path(folder) / FAMILY_LAYOUTS[family].denoiser / "config.json").read_text())
        except (OSError, ValueError):
            denoiser = None  # unreadable here: loading the pipeline says why, naming the folder
        if isinstance(denoiser, dict) and not guidance_embedded(denoiser):
            if refuse is not None and setting:
                raise ConfigError(f"{refuse[0]}: base model {folder} has no guidance embedding (its transformer's "
                                  "guidance_embeds is false, as FLUX.1-schnell's), so its pipeline ignores every "
                                  f"guidance scale; {refuse[1]}")
            return None
    return guidance_scale_for(family, setting)


def detect_family(folder: Path) -> str:
    """The family of a diffusers folder, from model_index.json's `_class_name`; ConfigError for a pipeline class
    rangefinder does not train."""
    index = Path(folder) / "model_index.json"
    try:
        read = json.loads(index.read_text())
        if not isinstance(read, dict):  # a list or a number: .get was an AttributeError's traceback
            raise ValueError(f"a JSON {type(read).__name__}, not an object")
        class_name = read.get("_class_name", "")
    except (OSError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"model.base_model: cannot read {index} ({reason}); pass a diffusers folder") from None
    if not isinstance(class_name, str):  # ["module", "Class"]: a custom pipeline, code shipped with the model
        raise ConfigError(f"model.base_model: {index} names a custom pipeline {class_name}, code shipped in the "
                          "folder, which rangefinder never runs; pass a model saved by one of diffusers' pipelines")
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
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(path), framework="pt") as f:
                    return single_file_family(path, list(f.keys()))
            except SafetensorError:  # cut short or not safetensors: loading.py says so, in one line
                return None
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
