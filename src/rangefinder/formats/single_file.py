"""`full`'s single file: the original Stable Diffusion (LDM, CompVis) key layout, or SDXL's (SGM), in one
`.safetensors` that AUTOMATIC1111, ComfyUI and diffusers' `from_single_file` load.

The LDM names come from CompVis' ldm/modules/diffusionmodules/openaimodel.py (UNetModel: input_blocks,
middle_block, output_blocks; ResBlock: in_layers, emb_layers, out_layers, skip_connection) and
ldm/modules/diffusionmodules/model.py (Encoder/Decoder: down.i.block.j, mid.block_1, mid.attn_1, up.i.upsample;
decoder levels are numbered from the bottom, diffusers' from the top). The inverse direction ships in diffusers
(`loaders.single_file_utils.convert_ldm_unet_checkpoint`, `convert_ldm_vae_checkpoint`), which the tests use to
check this mapping round-trips exactly. The tables below are built from the model configs, so any depth and
`layers_per_block` map, not only SD 1.x's four levels of two.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from rangefinder.formats.diffusers_folder import clip_text_key
from rangefinder.formats.model_spec import (
    ARCH_SDXL,
    MODELSPEC_IMPL_SGM,
    PREDICT_KEY,
    PREDICTION_TYPES,
    SpecFacts,
    model_spec,
    sd_base_model,
)
from rangefinder.formats.weights_file import save_safetensors

SINGLE_FILE_NAME = "model.safetensors"
LDM_UNET_PREFIX = "model.diffusion_model."
LDM_VAE_PREFIX = "first_stage_model."
LDM_CLIP_PREFIX = "cond_stage_model.transformer."
# SDXL's single file (Stability's generative-models "SGM" layout, which ComfyUI and A1111 load): the two text
# encoders under the conditioner, CLIP ViT-L in transformers' naming, OpenCLIP bigG in open_clip's.
SGM_CLIP_L_PREFIX = "conditioner.embedders.0.transformer."
SGM_CLIP_G_PREFIX = "conditioner.embedders.1.model."
# What the UNet predicts, as ComfyUI's own checkpoint saver says it (comfy_extras/nodes_model_merging.py
# `save_checkpoint` at 3d3d14d2847: an empty `v_pred` tensor in a v-prediction model, and `modelspec.predict_key`
# "epsilon" or "v" in the metadata, which model_spec.model_spec writes with the spec's `modelspec.prediction_type`).
# The tensor is what loaders read back: ComfyUI for SDXL (comfy/supported_models.py `SDXL.model_type`), A1111 for
# SDXL in its later versions (modules/sd_models_config.py `guess_model_config_from_state_dict`), diffusers never. No
# loader reads it for SD 1.x: ComfyUI's SD15 keeps `supported_models_base.BASE.model_type`'s EPS, A1111 its v1 config
# unless a `<checkpoint stem>.yaml` lies beside the file (`find_checkpoint_config_near_filename`, which it reads
# before guessing); SwarmUI samples it as `modelspec.prediction_type` says.
V_PRED_KEY = "v_pred"

# Inside a UNet ResBlock (openaimodel.ResBlock), diffusers' ResnetBlock2D names -> LDM names.
UNET_RESNET_RENAMES = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}
# Inside a VAE ResnetBlock (model.ResnetBlock) only the shortcut differs.
VAE_RESNET_RENAMES = {"conv_shortcut": "nin_shortcut"}
# Inside the VAE mid-block attention (model.AttnBlock): 1x1 convolutions in LDM, linear layers in diffusers.
VAE_ATTENTION_RENAMES = {
    "group_norm": "norm",
    "to_q": "q",
    "to_k": "k",
    "to_v": "v",
    "to_out.0": "proj_out",
}


def unet_prefix_table(config: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, str]]]:
    """(diffusers prefix, LDM prefix, renames inside the block) for every block of a UNet2DConditionModel."""
    n = len(config["block_out_channels"])
    per = config["layers_per_block"]
    if not isinstance(per, int):
        raise ValueError("single-file export supports an integer layers_per_block (SD 1.x/2.x UNets)")
    table: list[tuple[str, str, Mapping[str, str]]] = []
    for i in range(n):
        for j in range(per):
            k = i * (per + 1) + j + 1  # input_blocks.0 is conv_in; each level adds `per` blocks + a downsampler
            table.append((f"down_blocks.{i}.resnets.{j}.", f"input_blocks.{k}.0.", UNET_RESNET_RENAMES))
            table.append((f"down_blocks.{i}.attentions.{j}.", f"input_blocks.{k}.1.", {}))
        if i < n - 1:
            table.append((f"down_blocks.{i}.downsamplers.0.conv.", f"input_blocks.{(i + 1) * (per + 1)}.0.op.", {}))
    table += [
        ("mid_block.resnets.0.", "middle_block.0.", UNET_RESNET_RENAMES),
        ("mid_block.attentions.0.", "middle_block.1.", {}),
        ("mid_block.resnets.1.", "middle_block.2.", UNET_RESNET_RENAMES),
    ]
    for i, block_type in enumerate(config["up_block_types"]):
        for j in range(per + 1):
            k = i * (per + 1) + j
            table.append((f"up_blocks.{i}.resnets.{j}.", f"output_blocks.{k}.0.", UNET_RESNET_RENAMES))
            table.append((f"up_blocks.{i}.attentions.{j}.", f"output_blocks.{k}.1.", {}))
        if i < n - 1:
            # The upsampler follows the attention layer where the level has one.
            slot = 2 if "CrossAttn" in block_type else 1
            table.append((f"up_blocks.{i}.upsamplers.0.", f"output_blocks.{i * (per + 1) + per}.{slot}.", {}))
    return table


def vae_prefix_table(config: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, str]]]:
    n = len(config["block_out_channels"])
    per = config["layers_per_block"]
    table: list[tuple[str, str, Mapping[str, str]]] = []
    for i in range(n):
        for j in range(per):
            table.append((f"encoder.down_blocks.{i}.resnets.{j}.", f"encoder.down.{i}.block.{j}.", VAE_RESNET_RENAMES))
        if i < n - 1:
            table.append((f"encoder.down_blocks.{i}.downsamplers.0.", f"encoder.down.{i}.downsample.", {}))
        for j in range(per + 1):
            table.append(
                (f"decoder.up_blocks.{i}.resnets.{j}.", f"decoder.up.{n - 1 - i}.block.{j}.", VAE_RESNET_RENAMES)
            )
        if i < n - 1:
            table.append((f"decoder.up_blocks.{i}.upsamplers.0.", f"decoder.up.{n - 1 - i}.upsample.", {}))
    for part in ("encoder", "decoder"):
        table += [
            (f"{part}.mid_block.resnets.0.", f"{part}.mid.block_1.", VAE_RESNET_RENAMES),
            (f"{part}.mid_block.resnets.1.", f"{part}.mid.block_2.", VAE_RESNET_RENAMES),
            (f"{part}.mid_block.attentions.0.", f"{part}.mid.attn_1.", VAE_ATTENTION_RENAMES),
        ]
    return table


def top_level_tables() -> tuple[dict[str, str], dict[str, str]]:
    """The non-block layers, from diffusers' own diffusers->LDM name table (used by its single-file loader)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    mapping: dict[str, Any] = DIFFUSERS_TO_LDM_MAPPING  # diffusers types it as dict[str, object]
    # SDXL's added (pooled text + size) embedding is `label_emb` there.
    return dict(mapping["unet"]["layers"]) | dict(mapping["unet"]["addition_embed_type"]), dict(mapping["vae"])


def map_keys(state_dict, table, top_level: Mapping[str, str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    table = sorted(table, key=lambda row: -len(row[0]))  # longest prefix first
    for key, value in state_dict.items():
        if key in top_level:
            out[top_level[key]] = value
            continue
        for d_prefix, ldm_prefix, renames in table:
            if key.startswith(d_prefix):
                rest = key[len(d_prefix):]
                for d_name, ldm_name in renames.items():
                    if rest.startswith(d_name + "."):
                        rest = ldm_name + rest[len(d_name):]
                        break
                out[ldm_prefix + rest] = value
                break
        else:
            raise ValueError(f"{what} weight {key!r} has no place in the original SD layout; cannot export it")
    return out


def open_clip_state_dict(text_encoder_2) -> dict[str, Any]:
    """A transformers CLIPTextModelWithProjection's weights in open_clip's naming (SDXL's bigG encoder in its single
    file): q/k/v fused into `attn.in_proj_*`, the projection transposed. The inverse of diffusers'
    `convert_open_clip_checkpoint` (loaders/single_file_utils.py), which the tests use to check the round trip."""
    te = {k.removeprefix("text_model."): v for k, v in text_encoder_2.state_dict().items()}
    out: dict[str, Any] = {
        "token_embedding.weight": te.pop("embeddings.token_embedding.weight"),
        "positional_embedding": te.pop("embeddings.position_embedding.weight"),
        "ln_final.weight": te.pop("final_layer_norm.weight"),
        "ln_final.bias": te.pop("final_layer_norm.bias"),
        "text_projection": te.pop("text_projection.weight").T.contiguous(),
    }
    te.pop("embeddings.position_ids", None)  # a buffer, not a weight
    renames = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
               "self_attn.out_proj": "attn.out_proj"}
    for i in range(text_encoder_2.config.num_hidden_layers):
        src, dst = f"encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{dst}attn.in_proj_{kind}"] = torch_cat(
                [te.pop(f"{src}self_attn.{p}_proj.{kind}") for p in ("q", "k", "v")]
            )
            for d_name, o_name in renames.items():
                out[f"{dst}{o_name}.{kind}"] = te.pop(f"{src}{d_name}.{kind}")
    if te:
        raise ValueError(f"text encoder 2 weight {sorted(te)[0]!r} has no place in the SDXL layout; cannot export it")
    return out


def torch_cat(tensors: list[Any]) -> Any:
    import torch

    return torch.cat(tensors, dim=0)


def diffusers_to_ldm_state_dict(unet, vae, text_encoder, text_encoder_2=None) -> dict[str, Any]:
    """One state dict in the original layout from diffusers modules: SD 1.x's (one CLIP text encoder), or SDXL's
    when `text_encoder_2` is given (both encoders under `conditioner.embedders.`)."""
    unet_top, vae_top = top_level_tables()
    sd: dict[str, Any] = {}
    for k, v in map_keys(unet.state_dict(), unet_prefix_table(unet.config), unet_top, "UNet").items():
        sd[LDM_UNET_PREFIX + k] = v
    for k, v in map_keys(vae.state_dict(), vae_prefix_table(vae.config), vae_top, "VAE").items():
        if ".mid.attn_1." in k and k.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # LDM's AttnBlock uses 1x1 convolutions where diffusers uses linear layers
        sd[LDM_VAE_PREFIX + k] = v
    te_sd = text_encoder.state_dict()
    if "embeddings.token_embedding.weight" not in te_sd and "text_model.embeddings.token_embedding.weight" not in te_sd:
        raise ValueError("single-file export supports a CLIPTextModel text encoder (SD 1.x)")
    clip_prefix = LDM_CLIP_PREFIX if text_encoder_2 is None else SGM_CLIP_L_PREFIX
    for k, v in te_sd.items():
        sd[clip_prefix + clip_text_key(k)] = v
    if text_encoder_2 is not None:
        for k, v in open_clip_state_dict(text_encoder_2).items():
            sd[SGM_CLIP_G_PREFIX + k] = v
    return sd


def save_single_file_checkpoint(unet, vae, text_encoder, path: Path, metadata: Optional[Mapping[str, str]] = None,
                                text_encoder_2=None, prediction_type: Optional[str] = None,
                                facts: Optional[SpecFacts] = None):
    """The `.safetensors` single file A1111 and ComfyUI load (and `StableDiffusionPipeline.from_single_file`, or
    StableDiffusionXLPipeline's for SDXL). `prediction_type` ("epsilon" | "v_prediction"): what the UNet predicts,
    said as ComfyUI's saver says it (V_PRED_KEY; PREDICT_KEY in the model spec); None says nothing. The model spec
    is sd-scripts' for a checkpoint (`is_stable_diffusion_ckpt`: Stability's codebase, whose layout this is), with
    the run's `facts`."""
    state = diffusers_to_ldm_state_dict(unet, vae, text_encoder, text_encoder_2)
    architecture = ARCH_SDXL if text_encoder_2 is not None else sd_base_model(unet.config, prediction_type)[1]
    meta = {**(metadata or {}), **model_spec(architecture, MODELSPEC_IMPL_SGM, facts, prediction_type)}
    if prediction_type == "v_prediction":
        import torch

        state[V_PRED_KEY] = torch.tensor([])
    return save_safetensors(state, Path(path), meta)


def single_file_prediction_type(path: Path) -> Optional[str]:
    """What a single file says its UNet predicts ("epsilon" | "v_prediction"), read as ComfyUI and A1111 read it (a
    `v_pred` tensor), else from `modelspec.predict_key`; None when it says nothing (most files: the loader's default,
    or the config it is read with, decides)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        if V_PRED_KEY in f.keys():
            return "v_prediction"
        said = (f.metadata() or {}).get(PREDICT_KEY)
    return {v: k for k, v in PREDICTION_TYPES.items()}.get(said or "")


def export_full(model_dir: Path, out_path: Optional[Path] = None, metadata: Optional[Mapping[str, str]] = None,
                facts: Optional[SpecFacts] = None):
    """The single file next to a diffusers folder (`final/` -> `final/model.safetensors` by default), saying what its
    UNet predicts as the folder's scheduler does, with the run's `facts` in its model spec."""
    import json

    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    model_dir = Path(model_dir)
    config = model_dir / "scheduler" / "scheduler_config.json"
    predicts = json.loads(config.read_text()).get("prediction_type") if config.is_file() else None
    unet = UNet2DConditionModel.from_pretrained(str(model_dir / "unet"))
    vae = AutoencoderKL.from_pretrained(str(model_dir / "vae"))
    text_encoder = CLIPTextModel.from_pretrained(str(model_dir / "text_encoder"))
    text_encoder_2 = None
    if (model_dir / "text_encoder_2" / "config.json").is_file():  # SDXL
        text_encoder_2 = CLIPTextModelWithProjection.from_pretrained(str(model_dir / "text_encoder_2"))
    return save_single_file_checkpoint(unet, vae, text_encoder, out_path or model_dir / SINGLE_FILE_NAME, metadata,
                                       text_encoder_2=text_encoder_2, prediction_type=predicts, facts=facts)
