"""SD3's single file: Stability's layout of the MMDiT, its VAE and its three text encoders in one `.safetensors`.

The layout is what Stability ships SD3/3.5 in (`sd3.5_large.safetensors`) and what ComfyUI (comfy/supported_models.py
`SD3`, comfy/ldm/modules/diffusionmodules/mmdit.py) and diffusers' `StableDiffusion3Pipeline.from_single_file`
(loaders/single_file_utils.py, `convert_sd3_transformer_checkpoint_to_diffusers`) read:
- the MMDiT under `model.diffusion_model.`, in the original module names: `x_embedder.proj`, `pos_embed`,
  `t_embedder.mlp.{0,2}`, `y_embedder.mlp.{0,2}`, `context_embedder`, `joint_blocks.<i>.{x_block,context_block}.`
  with `attn.qkv` (q, k and v stacked along the output rows), `attn.proj`, `attn.ln_q`/`ln_k` (SD3.5's RMSNorm),
  SD3.5 Medium's second image self-attention (diffusers' `attn2`, MMDiT-X) as `x_block.attn2.{qkv,proj,ln_q,ln_k}`,
  `adaLN_modulation.1`, `mlp.fc1`/`fc2`, and `final_layer.{linear,adaLN_modulation.1}`. The last joint block's
  context half has no output projection or MLP (it only feeds the image half), and the original's adaLN rows of
  that block and of the final layer come in (shift, scale) order where diffusers' AdaLayerNormContinuous keeps
  (scale, shift): the halves are swapped;
- the VAE under `first_stage_model.` in the LDM names (formats/single_file.py's table, as SD 1.x's);
- the text encoders under `text_encoders.clip_l.transformer.`, `text_encoders.clip_g.transformer.` (both in
  transformers' CLIP names, `text_model.` included, with `text_projection`) and `text_encoders.t5xxl.transformer.`
  (transformers' T5 encoder names).
Written from those readers' key rules (the inverse of what they map), not from a converter's code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from rangefinder.formats.diffusers_folder import clip_text_key
from rangefinder.formats.model_spec import MODELSPEC_IMPL_SGM, SpecFacts, model_spec, sd3_architecture
from rangefinder.formats.single_file import (
    LDM_UNET_PREFIX,
    LDM_VAE_PREFIX,
    map_keys,
    top_level_tables,
    vae_prefix_table,
)
from rangefinder.formats.weights_file import save_safetensors

SD3_CLIP_L_PREFIX = "text_encoders.clip_l.transformer."
SD3_CLIP_G_PREFIX = "text_encoders.clip_g.transformer."
SD3_T5_PREFIX = "text_encoders.t5xxl.transformer."

# diffusers' SD3 transformer-block module -> the original's, for the modules that map one to one.
_BLOCK_RENAMES = {
    "attn.to_out.0": "x_block.attn.proj",
    "attn.to_add_out": "context_block.attn.proj",
    "attn.norm_q": "x_block.attn.ln_q",
    "attn.norm_k": "x_block.attn.ln_k",
    "attn.norm_added_q": "context_block.attn.ln_q",
    "attn.norm_added_k": "context_block.attn.ln_k",
    # SD3.5 Medium's (MMDiT-X) second self-attention of the image stream, in `dual_attention_layers`; its adaLN rows
    # (9 chunks, the last 3 for attn2) are in the same order in both (diffusers' SD35AdaLayerNormZeroX).
    "attn2.to_out.0": "x_block.attn2.proj",
    "attn2.norm_q": "x_block.attn2.ln_q",
    "attn2.norm_k": "x_block.attn2.ln_k",
    "norm1.linear": "x_block.adaLN_modulation.1",
    "norm1_context.linear": "context_block.adaLN_modulation.1",
    "ff.net.0.proj": "x_block.mlp.fc1",
    "ff.net.2": "x_block.mlp.fc2",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
}
_TOP_RENAMES = {
    "pos_embed.pos_embed": "pos_embed",
    "pos_embed.proj": "x_embedder.proj",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "context_embedder": "context_embedder",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
_QKV = {"attn.to_": "x_block.attn.qkv", "attn.add_": "context_block.attn.qkv", "attn2.to_": "x_block.attn2.qkv"}


def swaps_halves(path: str, config: Mapping[str, Any]) -> bool:
    """Whether the diffusers module `path` of an SD3 transformer of `config` orders its output rows' halves the other
    way round from the original MMDiT: the final layer's adaLN and the last block's context one, which modulate only
    (shift, scale) there and (scale, shift) in diffusers. Its weights, and a LoRA's `up` on it, swap halves."""
    last = int(config["num_layers"]) - 1
    return path in ("norm_out.linear", f"transformer_blocks.{last}.norm1_context.linear")


def swap_halves(t: Any) -> Any:
    import torch

    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def mmdit_state_dict(transformer: Any) -> dict[str, Any]:
    """The diffusers SD3Transformer2DModel's weights under the original MMDiT names (no prefix)."""
    import torch

    state = transformer.state_dict()
    out: dict[str, Any] = {}
    qkv: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        module, _, param = key.rpartition(".")
        if module.startswith("transformer_blocks."):
            _, i, rest = module.split(".", 2)
            for head, fused in _QKV.items():
                proj = rest.removeprefix(head)
                if rest.startswith(head) and proj in ("q", "k", "v", "q_proj", "k_proj", "v_proj"):
                    qkv.setdefault(f"joint_blocks.{i}.{fused}.{param}", {})[proj[0]] = value
                    break
            else:
                if rest not in _BLOCK_RENAMES:
                    raise ValueError(f"SD3 transformer weight {key!r} has no place in the single-file layout")
                name = f"joint_blocks.{i}.{_BLOCK_RENAMES[rest]}.{param}"
                # The last block's context half modulates only (shift, scale) in the original's order.
                out[name] = swap_halves(value) if swaps_halves(module, transformer.config) else value
        elif key in _TOP_RENAMES:  # pos_embed.pos_embed is a parameter of its own
            out[_TOP_RENAMES[key]] = value
        elif module in _TOP_RENAMES:
            out[f"{_TOP_RENAMES[module]}.{param}"] = swap_halves(value) if swaps_halves(module, transformer.config) \
                else value
        else:
            raise ValueError(f"SD3 transformer weight {key!r} has no place in the single-file layout")
    for name, parts in qkv.items():
        out[name] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


def sd3_single_file_state_dict(transformer: Any, vae: Any, text_encoder: Any, text_encoder_2: Any,
                               text_encoder_3: Any) -> dict[str, Any]:
    _, vae_top = top_level_tables()
    sd = {LDM_UNET_PREFIX + k: v for k, v in mmdit_state_dict(transformer).items()}
    for k, v in map_keys(vae.state_dict(), vae_prefix_table(vae.config), vae_top, "VAE").items():
        if ".mid.attn_1." in k and k.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # LDM's AttnBlock uses 1x1 convolutions where diffusers uses linear layers
        sd[LDM_VAE_PREFIX + k] = v
    import torch

    projection = text_encoder.text_projection.weight
    if projection.shape[0] != projection.shape[1] or not torch.equal(
            projection, torch.eye(projection.shape[0], dtype=projection.dtype, device=projection.device)):
        # The layout has no CLIP-L projection: its readers take the identity (SD3's CLIP-L pools unprojected).
        raise ValueError("SD3's CLIP-L text_projection is not the identity: the single-file layout cannot hold it")
    for prefix, te in ((SD3_CLIP_L_PREFIX, text_encoder), (SD3_CLIP_G_PREFIX, text_encoder_2)):
        for k, v in te.state_dict().items():
            if prefix == SD3_CLIP_L_PREFIX and k == "text_projection.weight":
                continue
            sd[prefix + (k if k == "text_projection.weight" else clip_text_key(k))] = v
    for k, v in text_encoder_3.state_dict().items():
        sd[SD3_T5_PREFIX + k] = v
    return sd


def export_sd3_full(model_dir: Path, out_path: Path, metadata: Optional[Mapping[str, str]] = None,
                    facts: Optional[SpecFacts] = None) -> Path:
    """The SD3 single file next to a StableDiffusion3Pipeline folder, with the model spec sd-scripts gives an SD3
    checkpoint (sd3_train_utils.py: `is_stable_diffusion_ckpt`, so Stability's codebase) and the run's `facts`; no
    prediction type, which a flow-matching model has none of (sd-scripts' "epsilon" there is not what it predicts)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    model_dir = Path(model_dir)
    parts = (SD3Transformer2DModel.from_pretrained(str(model_dir / "transformer")),
             AutoencoderKL.from_pretrained(str(model_dir / "vae")),
             CLIPTextModelWithProjection.from_pretrained(str(model_dir / "text_encoder")),
             CLIPTextModelWithProjection.from_pretrained(str(model_dir / "text_encoder_2")),
             T5EncoderModel.from_pretrained(str(model_dir / "text_encoder_3")))
    spec = model_spec(sd3_architecture(parts[0].config), MODELSPEC_IMPL_SGM, facts)
    return save_safetensors(sd3_single_file_state_dict(*parts), Path(out_path), {**(metadata or {}), **spec})


def mmdit_module_name(path: str) -> tuple[str, Optional[int]]:
    """A diffusers SD3 transformer module path -> (the original MMDiT module, the row third of its fused `qkv` it is:
    0, 1, 2 for q, k, v; None when it maps whole). The names kohya's sd-scripts gives its LoRA modules
    (`lora_unet_` + this with `_` for `.`, networks/lora_sd3.py) and ComfyUI's key map reads."""
    if path.startswith("transformer_blocks."):
        _, i, rest = path.split(".", 2)
        for head, fused in _QKV.items():
            proj = rest.removeprefix(head)
            if rest.startswith(head) and proj in ("q", "k", "v", "q_proj", "k_proj", "v_proj"):
                return f"joint_blocks.{i}.{fused}", "qkv".index(proj[0])
        if rest in _BLOCK_RENAMES:
            return f"joint_blocks.{i}.{_BLOCK_RENAMES[rest]}", None
    elif path in _TOP_RENAMES:
        return _TOP_RENAMES[path], None
    raise ValueError(f"SD3 transformer module {path!r} has no place in the original MMDiT layout")
