"""kohya's SDXL LoRA names, written from sd-scripts' own scheme for the tests to check our export against.

Sources (kohya-ss/sd-scripts at 48d368f):
- networks/lora.py, `LoRANetwork.create_modules`: a module's LoRA name is the prefix (`lora_unet`, and for SDXL's
  encoders `lora_te1` / `lora_te2`: LORA_PREFIX_TEXT_ENCODER1/2) + "." + its path in the model kohya trains, with
  every "." replaced by "_".
- library/sdxl_model_util.py, `make_unet_conversion_map`: kohya trains SDXL on its own UNet in the original layout
  (library/sdxl_original_unet.py), whose block paths relate to diffusers' as: down_blocks.i.resnets.j ->
  input_blocks.(3i + j + 1).0, down_blocks.i.attentions.j -> input_blocks.(3i + j + 1).1, up_blocks.i.resnets.j ->
  output_blocks.(3i + j).0, up_blocks.i.attentions.j -> output_blocks.(3i + j).1, mid_block.attentions.0 ->
  middle_block.1. The 3 there is SDXL's layers_per_block (2) + 1 (the level's downsampler or upsampler); written
  here for any layers_per_block so that the tiny SDXL (1 per level) is checked by the same rule. Inside a
  transformer block the names are diffusers' (attn1.to_q, to_out.0 ...).
- The text encoders are transformers' CLIPTextModel and CLIPTextModelWithProjection, named under `text_model.`.
"""

from __future__ import annotations

import re

UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # the default training.lora.target_modules
TE_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


def kohya_unet_path(diffusers_path: str, layers_per_block: int) -> str:
    step = layers_per_block + 1
    m = re.match(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", diffusers_path)
    if m:
        return f"input_blocks.{step * int(m[1]) + int(m[2]) + 1}.1.{m[3]}"
    m = re.match(r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", diffusers_path)
    if m:
        return f"output_blocks.{step * int(m[1]) + int(m[2])}.1.{m[3]}"
    m = re.match(r"mid_block\.attentions\.0\.(.*)", diffusers_path)
    if m:
        return f"middle_block.1.{m[1]}"
    raise AssertionError(f"no attention layer outside the transformer blocks: {diffusers_path}")


def _kohya(prefix: str, path: str) -> str:
    return (prefix + "." + path).replace(".", "_")


def expected_kohya_sdxl_names(unet, text_encoder, text_encoder_2) -> set[str]:
    """The kohya names of every module a LoRA on the default targets (UNet and both encoders) adapts."""
    per = int(unet.config.layers_per_block)
    names = {_kohya("lora_unet", kohya_unet_path(n, per)) for n, _ in unet.named_modules()
             if n.endswith(tuple("." + t for t in UNET_TARGETS))}
    for prefix, te in (("lora_te1", text_encoder), ("lora_te2", text_encoder_2)):
        for n, _ in te.named_modules():
            if n.endswith(tuple("." + t for t in TE_TARGETS)):
                path = n if n.startswith("text_model.") else "text_model." + n
                names.add(_kohya(prefix, path))
    return names
