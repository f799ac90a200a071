"""How sd-scripts names a file's base model: the SAI model spec (`modelspec.*`) and, for a LoRA, its own version key.

kohya's sd-scripts writes the model spec beside its training keys into every LoRA and embedding it trains
(library/sai_model_spec.py at 48d368fa5577: the spec's version, the ARCH_* ids of base models, the adapter suffixes
and the IMPL_* codebases whose module names a file uses; `determine_architecture`, `determine_implementation`), and
LoRA browsers and model managers read it to tell what a file is for. rangefinder reads the base model off the model
being exported (its denoiser's config, and what it was trained to predict), never off a setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

MODELSPEC_VERSION = "1.0.1"
MODELSPEC_IMPL_SGM = "https://github.com/Stability-AI/generative-models"
MODELSPEC_IMPL_FLUX = "https://github.com/black-forest-labs/flux"
MODELSPEC_IMPL_DIFFUSERS = "diffusers"  # an SD 1.x/2.x LoRA, whose kohya names are diffusers' module paths
ARCH_SDXL = "stable-diffusion-xl-v1-base"
ADAPTER_LORA = "lora"
ADAPTER_TEXTUAL_INVERSION = "textual-inversion"
# The UNet's cross-attention width is its text encoder's: SD 2.x's OpenCLIP ViT-H is 1024 wide, SD 1.x's CLIP ViT-L
# 768 (the first difference sd-scripts' library/original_unet.py lists between v1.5 and v2.1).
SD2_CROSS_ATTENTION_DIM = 1024


def sd_base_model(unet_config: Mapping[str, Any], prediction_type: str) -> tuple[str, str]:
    """(sd-scripts' `ss_base_model_version`, the model spec's architecture id) of an SD 1.x/2.x UNet trained to
    predict `prediction_type` ("epsilon" | "v_prediction"), as sd-scripts names them from its --v2 and
    --v_parameterization flags: the version `sd_v1`/`sd_v2`, `_v` appended for v-prediction (library/model_util.py
    `get_model_version_str_for_sd1_sd2`); the architecture `stable-diffusion-v1` for SD 1.x whatever it predicts,
    `stable-diffusion-v2-768-v` for SD 2.x predicting v and `stable-diffusion-v2-512` otherwise
    (sai_model_spec.py's ARCH_SD_V1, ARCH_SD_V2_768_V, ARCH_SD_V2_512). A UNet of SD 2.x's cross-attention width is
    2.x; any other is 1.x, sd-scripts' own default without --v2 (the tiny model among them)."""
    v2 = unet_config.get("cross_attention_dim") == SD2_CROSS_ATTENTION_DIM
    v = prediction_type == "v_prediction"
    version = ("sd_v2" if v2 else "sd_v1") + ("_v" if v else "")
    if not v2:
        return version, "stable-diffusion-v1"
    return version, "stable-diffusion-v2-768-v" if v else "stable-diffusion-v2-512"


def model_spec(architecture: str, adapter: str, implementation: Optional[str] = None) -> dict[str, str]:
    """The model spec's keys for an `adapter` ("lora" | "textual-inversion") on the base model `architecture`: the
    spec's version and `<architecture>/<adapter>` (as `determine_architecture` appends it), and the `implementation`
    whose module names the file uses, when given."""
    spec = {"modelspec.sai_model_spec": MODELSPEC_VERSION, "modelspec.architecture": f"{architecture}/{adapter}"}
    if implementation is not None:
        spec["modelspec.implementation"] = implementation
    return spec
