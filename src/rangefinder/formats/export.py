"""Output formats other tools load: single-file SD checkpoints, LoRA (diffusers and kohya), embeddings (A1111).

- `full`: the diffusers folder (written by the engine) and one `.safetensors` file in the original Stable Diffusion
  (LDM, CompVis) key layout, which AUTOMATIC1111, ComfyUI and diffusers' `from_single_file` load.
- `lora`: `pytorch_lora_weights.safetensors` exactly as diffusers' `save_lora_weights` writes it, plus the kohya
  (sd-scripts) layout, `lora_unet_...lora_down.weight` with an `.alpha` per module, that A1111 and ComfyUI load.
- `textual_inversion`: `learned_embeds.safetensors` (diffusers: `{token: (vectors, dim)}`) and an A1111 embedding
  (`emb_params` in safetensors; `string_to_param` in the legacy .pt).

Every file carries the run's facts in its safetensors metadata (`rangefinder.*` keys, see `export_metadata`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from rangefinder import __version__
from rangefinder.formats.atomic import atomic_path

SINGLE_FILE_NAME = "model.safetensors"
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
LORA_KOHYA_NAME = "lora_kohya.safetensors"
TI_WEIGHTS_NAME = "learned_embeds.safetensors"
TI_A1111_NAME = "embedding_a1111.safetensors"
TI_A1111_PT_NAME = "embedding_a1111.pt"


def export_metadata(
    *,
    method: str,
    base_model: Optional[str] = None,
    lr: Optional[float] = None,
    epochs: Optional[float] = None,
    updates: Optional[int] = None,
    extra: Optional[Mapping[str, Any]] = None,
) -> dict[str, str]:
    """Metadata for a weights file. safetensors metadata holds strings only, so numbers are written with repr."""
    meta = {
        "rangefinder.version": __version__,
        "rangefinder.method": method,
        "rangefinder.base_model": base_model or "embedded tiny model",
    }
    if lr is not None:
        meta["rangefinder.lr"] = repr(float(lr))
    if epochs is not None:
        meta["rangefinder.epochs"] = repr(float(epochs))
    if updates is not None:
        meta["rangefinder.updates"] = str(int(updates))
    for k, v in (extra or {}).items():
        meta[k if "." in k else f"rangefinder.{k}"] = v if isinstance(v, str) else json.dumps(v)
    return meta


def training_metadata(cfg, base_model: Optional[str] = None, extra=None) -> dict[str, str]:
    """The facts every output file carries: base model, method, LR (or the schedule's range), budget, version."""
    info: dict[str, Any] = {"schedule": cfg.schedule}
    if cfg.schedule != "constant":
        info.update(lr_min=cfg.lr_min, lr_max=cfg.lr_max)
    if cfg.steps is not None:
        info.update(steps=cfg.steps, steps_unit=cfg.steps_unit)
    info["effective_batch"] = cfg.batch_size * cfg.grad_accum * cfg.world_size
    info.update(extra or {})
    return export_metadata(
        method=cfg.method,
        base_model=base_model,
        lr=cfg.lr,
        epochs=cfg.epochs,
        extra=info,
    )


def save_safetensors(tensors: Mapping[str, Any], path: Path, metadata: Optional[Mapping[str, str]] = None) -> Path:
    """Write to a temporary name and rename, so a half-written file never looks finished."""
    from safetensors.torch import save_file

    # safetensors refuses shared or non-contiguous storage; a clone per tensor keeps the caller's tensors intact.
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp),
                  metadata=dict(metadata or {}))
    return Path(path)


def read_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


# ---------------------------------------------------------------------------------------------------------------
# full: diffusers -> original SD (LDM) single-file layout
#
# The LDM names come from CompVis' ldm/modules/diffusionmodules/openaimodel.py (UNetModel: input_blocks,
# middle_block, output_blocks; ResBlock: in_layers, emb_layers, out_layers, skip_connection) and
# ldm/modules/diffusionmodules/model.py (Encoder/Decoder: down.i.block.j, mid.block_1, mid.attn_1, up.i.upsample;
# decoder levels are numbered from the bottom, diffusers' from the top). The inverse direction ships in diffusers
# (`loaders.single_file_utils.convert_ldm_unet_checkpoint`, `convert_ldm_vae_checkpoint`), which the tests use to
# check this mapping round-trips exactly. The tables below are built from the model configs, so any depth and
# `layers_per_block` map, not only SD 1.x's four levels of two.

LDM_UNET_PREFIX = "model.diffusion_model."
LDM_VAE_PREFIX = "first_stage_model."
LDM_CLIP_PREFIX = "cond_stage_model.transformer."

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


def _unet_prefix_table(config: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, str]]]:
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


def _vae_prefix_table(config: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, str]]]:
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


def _top_level_tables() -> tuple[dict[str, str], dict[str, str]]:
    """The non-block layers, from diffusers' own diffusers->LDM name table (used by its single-file loader)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    return dict(DIFFUSERS_TO_LDM_MAPPING["unet"]["layers"]), dict(DIFFUSERS_TO_LDM_MAPPING["vae"])


def _map_keys(state_dict, table, top_level: Mapping[str, str], what: str) -> dict[str, Any]:
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


def diffusers_to_ldm_state_dict(unet, vae, text_encoder) -> dict[str, Any]:
    """One state dict in the original SD 1.x layout (CLIP text encoder) from diffusers modules."""
    unet_top, vae_top = _top_level_tables()
    sd: dict[str, Any] = {}
    for k, v in _map_keys(unet.state_dict(), _unet_prefix_table(unet.config), unet_top, "UNet").items():
        sd[LDM_UNET_PREFIX + k] = v
    for k, v in _map_keys(vae.state_dict(), _vae_prefix_table(vae.config), vae_top, "VAE").items():
        if ".mid.attn_1." in k and k.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # LDM's AttnBlock uses 1x1 convolutions where diffusers uses linear layers
        sd[LDM_VAE_PREFIX + k] = v
    te_sd = text_encoder.state_dict()
    if "embeddings.token_embedding.weight" not in te_sd and "text_model.embeddings.token_embedding.weight" not in te_sd:
        raise ValueError("single-file export supports a CLIPTextModel text encoder (SD 1.x)")
    for k, v in te_sd.items():
        # SD 1.x files hold the HF CLIPTextModel under `text_model.`; transformers >= 5 drops that wrapper.
        sd[LDM_CLIP_PREFIX + (k if k.startswith("text_model.") else "text_model." + k)] = v
    return sd


def save_single_file_checkpoint(unet, vae, text_encoder, path: Path, metadata: Optional[Mapping[str, str]] = None):
    """The `.safetensors` single file A1111 and ComfyUI load (and `StableDiffusionPipeline.from_single_file`)."""
    return save_safetensors(diffusers_to_ldm_state_dict(unet, vae, text_encoder), Path(path), metadata)


def export_full(model_dir: Path, out_path: Optional[Path] = None, metadata: Optional[Mapping[str, str]] = None):
    """The single file next to a diffusers folder (`final/` -> `final/model.safetensors` by default)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    model_dir = Path(model_dir)
    unet = UNet2DConditionModel.from_pretrained(str(model_dir / "unet"))
    vae = AutoencoderKL.from_pretrained(str(model_dir / "vae"))
    text_encoder = CLIPTextModel.from_pretrained(str(model_dir / "text_encoder"))
    return save_single_file_checkpoint(unet, vae, text_encoder, out_path or model_dir / SINGLE_FILE_NAME, metadata)


# ---------------------------------------------------------------------------------------------------------------
# lora: diffusers (what save_lora_weights writes) and kohya (sd-scripts; what A1111 and ComfyUI load)


def peft_lora_state(module) -> dict[str, Any]:
    """The adapter tensors of a peft-wrapped module, in peft's saved layout (`...to_q.lora_A.weight`)."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(module)


def save_lora_diffusers(
    out_dir: Path,
    unet=None,
    text_encoder=None,
    metadata: Optional[Mapping[str, str]] = None,
) -> Path:
    """`pytorch_lora_weights.safetensors` through diffusers' own `save_lora_weights`, plus our metadata.

    The peft LoraConfig goes into the file too (diffusers' `lora_adapter_metadata`), so `load_lora_weights` gets
    alpha right when alpha != rank.
    """
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if unet is not None:
        kwargs["unet_lora_layers"] = convert_state_dict_to_diffusers(peft_lora_state(unet))
        kwargs["unet_lora_adapter_metadata"] = unet.peft_config["default"].to_dict()
    if text_encoder is not None:
        kwargs["text_encoder_lora_layers"] = convert_state_dict_to_diffusers(peft_lora_state(text_encoder))
        kwargs["text_encoder_lora_adapter_metadata"] = text_encoder.peft_config["default"].to_dict()
    staging = out_dir / ".lora.tmp"
    StableDiffusionPipeline.save_lora_weights(str(staging), safe_serialization=True, **kwargs)
    written = staging / LORA_WEIGHTS_NAME
    merged = read_metadata(written) | dict(metadata or {})
    path = save_safetensors(load_file(str(written)), out_dir / LORA_WEIGHTS_NAME, merged)
    import shutil

    shutil.rmtree(staging)
    return path


def lora_to_kohya(unet_state: Mapping[str, Any], text_encoder_state: Mapping[str, Any], alpha: float) -> dict:
    """kohya's layout from peft adapter tensors, by diffusers' `convert_state_dict_to_kohya`.

    Two fixes on top of it: kohya's `.alpha` is the LoRA alpha (the scale is alpha / rank), where the converter writes
    the rank (scale 1); and SD 1.x's single text encoder is `lora_te_` (the converter's `lora_te1_` is SDXL's first).
    """
    import torch
    from diffusers.utils import convert_state_dict_to_kohya

    peft_sd = {f"unet.{k}": v for k, v in unet_state.items()}
    for k, v in text_encoder_state.items():
        # sd-scripts names CLIP modules as in transformers < 5, under `text_model.`.
        peft_sd["text_encoder." + (k if k.startswith("text_model.") else "text_model." + k)] = v
    kohya = {}
    for k, v in convert_state_dict_to_kohya(peft_sd).items():
        if k.startswith("lora_te1_"):
            k = "lora_te_" + k[len("lora_te1_"):]
        kohya[k] = torch.tensor(float(alpha), dtype=torch.float32) if k.endswith(".alpha") else v
    return kohya


def save_lora_kohya(out_path: Path, unet=None, text_encoder=None, alpha: float = 1.0, metadata=None) -> Path:
    unet_state = peft_lora_state(unet) if unet is not None else {}
    te_state = peft_lora_state(text_encoder) if text_encoder is not None else {}
    meta = dict(metadata or {})
    # sd-scripts' own training metadata keys, which A1111's and ComfyUI's LoRA browsers show.
    meta.setdefault("ss_network_module", "networks.lora")
    if unet is not None:
        meta.setdefault("ss_network_dim", str(unet.peft_config["default"].r))
    meta.setdefault("ss_network_alpha", repr(float(alpha)))
    return save_safetensors(lora_to_kohya(unet_state, te_state, alpha), Path(out_path), meta)


# ---------------------------------------------------------------------------------------------------------------
# textual_inversion: diffusers' learned_embeds and A1111's embedding files


def save_textual_inversion(out_dir: Path, token: str, embeds, metadata: Optional[Mapping[str, str]] = None) -> dict:
    """`embeds` is (num_vectors, dim). Writes the diffusers file and A1111's two embedding layouts.

    A1111 reads `emb_params` from a .safetensors embedding and `string_to_param["*"]` from a .pt one
    (modules/textual_inversion/textual_inversion.py); the .pt also carries `name`, `step` and the token's text.
    """
    import torch

    out_dir = Path(out_dir)
    meta = dict(metadata or {})
    meta.setdefault("rangefinder.placeholder_token", token)
    paths = {
        "diffusers": save_safetensors({token: embeds}, out_dir / TI_WEIGHTS_NAME, meta),
        "a1111": save_safetensors({"emb_params": embeds}, out_dir / TI_A1111_NAME, meta),
    }
    legacy = {
        "string_to_token": {"*": 265},  # the token id of "*" in CLIP's vocabulary, as A1111 writes it
        "string_to_param": {"*": embeds.detach().clone()},
        "name": token,
        "step": int(meta.get("rangefinder.updates", 0)),
        "sd_checkpoint": None,
        "sd_checkpoint_name": meta.get("rangefinder.base_model"),
        "rangefinder": meta,
    }
    pt = out_dir / TI_A1111_PT_NAME
    with atomic_path(pt) as tmp:
        torch.save(legacy, tmp)
    paths["a1111_pt"] = pt
    return paths
