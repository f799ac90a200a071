"""Flux.1's transformer in Black Forest Labs' own layout: the single file ComfyUI and diffusers' `from_single_file`
load, and the module names kohya's sd-scripts gives its Flux LoRA.

BFL's model (black-forest-labs/flux, src/flux/model.py and modules/layers.py) fuses what diffusers'
`FluxTransformer2DModel` keeps apart: a double-stream block's q, k and v are one `img_attn.qkv` (and `txt_attn.qkv`)
linear layer, and a single-stream block's q, k, v and MLP input are one `linear1`. Everything else is a rename. The
table below is the inverse of diffusers' `convert_flux_transformer_checkpoint_to_diffusers`
(loaders/single_file_utils.py), which the tests use to check the round trip, including the one non-rename: the
final AdaLN's projection, whose (shift, scale) halves BFL orders the other way round from diffusers.

`BFL_MODULES` lists, for a model config, each BFL linear (or norm) module with the diffusers modules it is made of,
in the order they are concatenated along the output dimension; `to_bfl_state_dict` applies it to weights, and
formats/lora.py applies it to LoRA adapters (kohya names a Flux LoRA module `lora_unet_` + its BFL path).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from rangefinder.formats.model_spec import MODELSPEC_IMPL_FLUX, SpecFacts, flux_architecture, model_spec

# Flux LoRA module names in kohya's sd-scripts (networks/lora_flux.py at 0087a46e14c8: LORA_PREFIX_FLUX
# "lora_unet", LORA_PREFIX_TEXT_ENCODER_CLIP "lora_te1"); a module name is the prefix + its path, "." -> "_".
KOHYA_FLUX_PREFIX = "lora_unet_"
KOHYA_FLUX_CLIP_PREFIX = "lora_te1_"
# What a single file of Flux's transformer holds under ComfyUI's checkpoint prefix (a whole-model file); BFL's own
# transformer-only file (flux1-dev.safetensors) has the same names without it. Both are read by the family detection.
FLUX_CHECKPOINT_PREFIX = "model.diffusion_model."
FLUX_DOUBLE_BLOCK_KEY = "double_blocks.0.img_attn.qkv.weight"
FLUX_SINGLE_BLOCK_KEY = "single_blocks.0.linear1.weight"


def bfl_modules(config: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """{BFL module path: the diffusers module paths fused into it, in output order}, for a FluxTransformer2DModel
    config. A parameter `<module>.weight` / `.bias` maps with its module (norms: `.weight` -> `.scale`)."""
    table: dict[str, tuple[str, ...]] = {
        "img_in": ("x_embedder",),
        "txt_in": ("context_embedder",),
        "time_in.in_layer": ("time_text_embed.timestep_embedder.linear_1",),
        "time_in.out_layer": ("time_text_embed.timestep_embedder.linear_2",),
        "vector_in.in_layer": ("time_text_embed.text_embedder.linear_1",),
        "vector_in.out_layer": ("time_text_embed.text_embedder.linear_2",),
        "final_layer.linear": ("proj_out",),
        "final_layer.adaLN_modulation.1": ("norm_out.linear",),  # halves swapped: see to_bfl_state_dict
    }
    if config.get("guidance_embeds"):
        table["guidance_in.in_layer"] = ("time_text_embed.guidance_embedder.linear_1",)
        table["guidance_in.out_layer"] = ("time_text_embed.guidance_embedder.linear_2",)
    for i in range(int(config["num_layers"])):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        table |= {
            b + "img_mod.lin": (d + "norm1.linear",),
            b + "txt_mod.lin": (d + "norm1_context.linear",),
            b + "img_attn.qkv": tuple(d + f"attn.to_{p}" for p in "qkv"),
            b + "txt_attn.qkv": tuple(d + f"attn.add_{p}_proj" for p in "qkv"),
            b + "img_attn.proj": (d + "attn.to_out.0",),
            b + "txt_attn.proj": (d + "attn.to_add_out",),
            b + "img_attn.norm.query_norm": (d + "attn.norm_q",),
            b + "img_attn.norm.key_norm": (d + "attn.norm_k",),
            b + "txt_attn.norm.query_norm": (d + "attn.norm_added_q",),
            b + "txt_attn.norm.key_norm": (d + "attn.norm_added_k",),
            b + "img_mlp.0": (d + "ff.net.0.proj",),
            b + "img_mlp.2": (d + "ff.net.2",),
            b + "txt_mlp.0": (d + "ff_context.net.0.proj",),
            b + "txt_mlp.2": (d + "ff_context.net.2",),
        }
    for i in range(int(config["num_single_layers"])):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        table |= {
            b + "modulation.lin": (d + "norm.linear",),
            b + "linear1": (d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"),
            b + "linear2": (d + "proj_out",),
            b + "norm.query_norm": (d + "attn.norm_q",),
            b + "norm.key_norm": (d + "attn.norm_k",),
        }
    return table


def bfl_module_of(config: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """{diffusers module path: (its BFL module, its place among the fused parts)}."""
    return {part: (bfl, j) for bfl, parts in bfl_modules(config).items() for j, part in enumerate(parts)}


# The one BFL module whose output rows are diffusers' in the other order: the final AdaLN's (shift, scale), diffusers'
# (scale, shift). Its weights, and a LoRA's `up` on it, are swapped by halves between the layouts.
SWAPPED_HALVES = "final_layer.adaLN_modulation.1"


def swap_halves(t: Any) -> Any:
    import torch

    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def to_bfl_state_dict(state_dict: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """A FluxTransformer2DModel's weights in BFL's layout (bare names, as BFL's transformer file); ValueError for a
    weight with no place there."""
    import torch

    out: dict[str, Any] = {}
    used: set[str] = set()
    for bfl, parts in bfl_modules(config).items():
        norm = bfl.endswith(("query_norm", "key_norm"))
        for kind in ("weight", "bias"):
            keys = [f"{p}.{kind}" for p in parts]
            if not all(k in state_dict for k in keys):
                continue
            value = torch.cat([state_dict[k] for k in keys], dim=0) if len(keys) > 1 else state_dict[keys[0]]
            if bfl == SWAPPED_HALVES:
                value = swap_halves(value)  # diffusers: (scale, shift); BFL: (shift, scale)
            out[f"{bfl}.{'scale' if norm else kind}"] = value
            used.update(keys)
    left = sorted(set(state_dict) - used)
    if left:
        raise ValueError(f"Flux transformer weight {left[0]!r} has no place in Black Forest Labs' layout; cannot "
                         "export it")
    return out


def export_flux_transformer(model_dir: Path, out_path: Path, metadata: Optional[Mapping[str, str]] = None,
                            facts: Optional[SpecFacts] = None) -> Path:
    """`final/model.safetensors` for Flux: the transformer of the diffusers folder `model_dir` in BFL's layout, as
    BFL ships flux1-dev.safetensors (the transformer only: ComfyUI loads it as a diffusion model beside its own VAE,
    CLIP-L and T5 files; diffusers' `FluxTransformer2DModel.from_single_file` reads it), with the model spec
    sd-scripts gives a Flux checkpoint (flux_train_utils.py: BFL's codebase, no prediction type) and the run's
    `facts`."""
    from diffusers import FluxTransformer2DModel

    from rangefinder.formats.weights_file import save_safetensors

    transformer = FluxTransformer2DModel.from_pretrained(str(Path(model_dir) / "transformer"))
    spec = model_spec(flux_architecture(transformer.config), MODELSPEC_IMPL_FLUX, facts)
    return save_safetensors(to_bfl_state_dict(transformer.state_dict(), transformer.config), Path(out_path),
                            {**(metadata or {}), **spec})


def from_bfl_state_dict(bfl: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `to_bfl_state_dict`, for a model of `config` (bare BFL names, or under
    `model.diffusion_model.`): each fused weight split back along its output rows, in the parts' order (q, k, v each
    the attention width; a single block's MLP input the rest). ValueError for a missing or left-over tensor.

    Written here rather than taken from diffusers because diffusers' converter assumes Flux.1's widths."""
    import torch

    bare = {k.removeprefix(FLUX_CHECKPOINT_PREFIX): v for k, v in bfl.items()}
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    out: dict[str, Any] = {}
    used: set[str] = set()
    for module, parts in bfl_modules(config).items():
        norm = module.endswith(("query_norm", "key_norm"))
        for kind in ("weight", "bias"):
            key = f"{module}.{'scale' if norm else kind}"
            if norm and kind == "bias":
                continue
            if key not in bare:
                if kind == "bias" and not norm:
                    continue  # a layer without bias
                raise ValueError(f"the Flux single file lacks {key!r}; it is not a whole Flux transformer")
            value = bare[key]
            used.add(key)
            if module == SWAPPED_HALVES:
                value = swap_halves(value)
            if len(parts) == 1:
                out[f"{parts[0]}.{kind}"] = value
                continue
            sizes = [inner] * 3 + ([int(value.shape[0]) - 3 * inner] if len(parts) == 4 else [])
            for part, piece in zip(parts, torch.split(value, sizes, dim=0), strict=True):
                out[f"{part}.{kind}"] = piece.contiguous()
    left = sorted(set(bare) - used)
    if left:
        raise ValueError(f"the Flux single file's tensor {left[0]!r} has no place in FluxTransformer2DModel")
    return out
