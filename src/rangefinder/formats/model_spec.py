"""What an exported file says about itself: the SAI model spec (`modelspec.*`), and sd-scripts' name of a base model.

The spec (Stability-AI/ModelSpec, README.md at fe8dc60, version 1.0.1) puts its keys in a `.safetensors` header:
`sai_model_spec`, `architecture`, `implementation`, `title` and, for an image model, `resolution` are a MUST; `date`
a SHOULD; `prediction_type` a CAN. kohya's sd-scripts writes that set into every LoRA, embedding and checkpoint it
trains (library/sai_model_spec.py at 48d368fa5577, `build_metadata_dataclass`: the ARCH_* ids of base models with
the adapter appended, the IMPL_* codebases whose module names a file uses, `determine_resolution`, the date in
ISO-8601, the prediction type but for Flux), and model browsers read it: SwarmUI (src/Text2Image/
T2IModelHandler.cs `LoadMetadata`) lists a file by its `title`, `date` and `resolution` (parsed as `WxH`), and its
ComfyUI backend samples it with `prediction_type` (v: ModelSamplingDiscrete v_prediction). ComfyUI's own checkpoint
saver (comfy_extras/nodes_model_merging.py `save_checkpoint` at 3d3d14d2847) says what a whole model predicts as
`modelspec.predict_key`.

Every export writes these keys through `model_spec`, here, with what the run knows (`SpecFacts`): the base model is
read off the model exported (its denoiser's config, and what it was trained to predict), never off a setting.
Two deliberate departures from sd-scripts: no `implementation_version` (sd-scripts fills it with its own git commit;
the spec means the implementation codebase's version, and `rangefinder.version` already names the writer), and no
`prediction_type` for SD3 (sd-scripts writes "epsilon" there, which a flow-matching model does not predict).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

MODELSPEC_VERSION = "1.0.1"
MODELSPEC_IMPL_SGM = "https://github.com/Stability-AI/generative-models"
MODELSPEC_IMPL_FLUX = "https://github.com/black-forest-labs/flux"
MODELSPEC_IMPL_DIFFUSERS = "diffusers"  # a file in diffusers' module names (an SD 1.x/2.x kohya LoRA's are too)
ARCH_SDXL = "stable-diffusion-xl-v1-base"
ADAPTER_LORA = "lora"
ADAPTER_TEXTUAL_INVERSION = "textual-inversion"
# The UNet's cross-attention width is its text encoder's: SD 2.x's OpenCLIP ViT-H is 1024 wide, SD 1.x's CLIP ViT-L
# 768 (the first difference sd-scripts' library/original_unet.py lists between v1.5 and v2.1).
SD2_CROSS_ATTENTION_DIM = 1024
# ComfyUI's key for what a whole model predicts; the spec's own is `modelspec.prediction_type`. Both take diffusers'
# prediction_type as "epsilon" or "v" (sd-scripts' PRED_TYPE_EPSILON, PRED_TYPE_V).
PREDICT_KEY = "modelspec.predict_key"
PREDICTION_TYPE_KEY = "modelspec.prediction_type"
PREDICTION_TYPES = {"epsilon": "epsilon", "v_prediction": "v"}
# The family (training/family_detection.py's names) of each architecture id the spec's writers use, by its start:
# sd-scripts' ARCH_SD_V1, ARCH_SD_V2_*, ARCH_SD_XL_V1_BASE, ARCH_SD3_*, ARCH_FLUX_1_* (with `/lora` or
# `/textual-inversion` after an adapter's).
ARCHITECTURE_FAMILIES = (("stable-diffusion-xl-", "sdxl"), ("stable-diffusion-3-", "sd3"),
                         ("stable-diffusion-v1", "sd1"), ("stable-diffusion-v2", "sd1"), ("flux-1-", "flux"))


def architecture_family(metadata: Mapping[str, str]) -> Optional[str]:
    """The family of the model a file's `modelspec.architecture` names (rangefinder's, kohya's and other trainers'
    exports write it); None where it names none rangefinder knows."""
    arch = metadata.get("modelspec.architecture") or ""
    return next((family for start, family in ARCHITECTURE_FAMILIES if arch.startswith(start)), None)


@dataclass(frozen=True)
class SpecFacts:
    """What the run knows of the model it delivers, for the spec's title, resolution and date. Each is recorded once
    when the run starts and kept in its checkpoints (training/state.py RunState), so a resumed run, and a model
    written out of one of its checkpoints (training/restore.py), say what the uninterrupted run says."""

    title: str  # the registered model name the run delivers under, else its output folder's name
    resolution: Optional[int] = None  # px: the side of the square the run trained at (data.resolution)
    date: Optional[str] = None  # ISO-8601, when the run started; None for a checkpoint from before it was recorded


def is_sd2(unet_config: Mapping[str, Any]) -> bool:
    """Whether an SD 1.x/2.x UNet is SD 2.x's, by its cross-attention width (SD2_CROSS_ATTENTION_DIM)."""
    return unet_config.get("cross_attention_dim") == SD2_CROSS_ATTENTION_DIM


def sd_base_model(unet_config: Mapping[str, Any], prediction_type: Optional[str]) -> tuple[str, str]:
    """(sd-scripts' `ss_base_model_version`, the model spec's architecture id) of an SD 1.x/2.x UNet trained to
    predict `prediction_type` ("epsilon" | "v_prediction"), as sd-scripts names them from its --v2 and
    --v_parameterization flags: the version `sd_v1`/`sd_v2`, `_v` appended for v-prediction (library/model_util.py
    `get_model_version_str_for_sd1_sd2`); the architecture `stable-diffusion-v1` for SD 1.x whatever it predicts,
    `stable-diffusion-v2-768-v` for SD 2.x predicting v and `stable-diffusion-v2-512` otherwise
    (sai_model_spec.py's ARCH_SD_V1, ARCH_SD_V2_768_V, ARCH_SD_V2_512). A UNet of SD 2.x's cross-attention width is
    2.x; any other is 1.x, sd-scripts' own default without --v2 (the tiny model among them)."""
    v2 = is_sd2(unet_config)
    v = prediction_type == "v_prediction"
    version = ("sd_v2" if v2 else "sd_v1") + ("_v" if v else "")
    if not v2:
        return version, "stable-diffusion-v1"
    return version, "stable-diffusion-v2-768-v" if v else "stable-diffusion-v2-512"


def sd3_model_type(config: Mapping[str, Any]) -> str:
    """The SD3 model type sd-scripts writes as `ss_base_model_version` and after `stable-diffusion-3-` in
    `modelspec.architecture` (sd3_train_network.py returns `mmdit.model_type`, which library/sd3_utils.py
    `analyze_state_dict_state` reads off the weights): "medium" for SD3 Medium (no q/k norm), "5-large" for SD3.5
    Large (RMSNorm q/k), "5-medium" for SD3.5 Medium (RMSNorm q/k and MMDiT-X's second image attention)."""
    if not config.get("qk_norm"):
        return "medium"
    return "5-medium" if config.get("dual_attention_layers") else "5-large"


def sd3_architecture(config: Mapping[str, Any]) -> str:
    """An SD3 transformer's architecture id, as sai_model_spec.py `determine_architecture` builds it."""
    return f"stable-diffusion-3-{sd3_model_type(config)}"


def flux_architecture(config: Mapping[str, Any]) -> str:
    """A Flux transformer's architecture id: flux-1-dev when it takes guidance, flux-1-schnell otherwise (what
    sd-scripts' flux_utils.analyze_checkpoint_state tells them by)."""
    return "flux-1-dev" if config.get("guidance_embeds") else "flux-1-schnell"


def model_spec(architecture: str, implementation: str, facts: Optional[SpecFacts] = None,
               prediction_type: Optional[str] = None, adapter: Optional[str] = None) -> dict[str, str]:
    """The model spec's keys of a file: a whole model of `architecture`, or an `adapter` ("lora" |
    "textual-inversion") for it (`<architecture>/<adapter>`, as `determine_architecture` appends it), in the module
    names of `implementation`; the run's `facts` (title, resolution as `WxH`, date), when given; and what the model
    predicts (diffusers' "epsilon" | "v_prediction"; None for the flow families, whose models predict neither),
    which a whole model also says as ComfyUI's saver does."""
    spec = {"modelspec.sai_model_spec": MODELSPEC_VERSION,
            "modelspec.architecture": architecture if adapter is None else f"{architecture}/{adapter}",
            "modelspec.implementation": implementation}
    if facts is not None:
        spec["modelspec.title"] = facts.title
        if facts.resolution is not None:
            spec["modelspec.resolution"] = f"{facts.resolution}x{facts.resolution}"
        if facts.date is not None:
            spec["modelspec.date"] = facts.date
    if prediction_type in PREDICTION_TYPES:
        spec[PREDICTION_TYPE_KEY] = PREDICTION_TYPES[prediction_type]
        if adapter is None:
            spec[PREDICT_KEY] = PREDICTION_TYPES[prediction_type]
    return spec
