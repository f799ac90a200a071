"""The LoRA files at SD 1.5's shape, against the loaders whose key rules assume it: AUTOMATIC1111 (its block
arithmetic is SD 1.x's, so the tiny model cannot be checked against it) and ComfyUI.

The UNet and text encoder are built from SD 1.5's configuration on the `meta` device (no memory, no weights); only
the adapters get real numbers. The files are written by the training method's own `save_final` path
(`save_lora_files`), with alpha != rank and adapters on attention, linear, 1x1 and 3x3 convolution layers. Each
loader's rules (tests/formats/consumers.py, cited there by file and commit) must match every key of the file to a
module of the model with fitting shapes, leave none over, and add to each weight exactly what peft's trained
adapter adds (`get_delta_weight`): the same model through every loader.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import TrainingConfig
from rangefinder.models.loading import SDComponents
from rangefinder.training.methods import make_method
from tests.formats.consumers import (
    a1111_load_lora,
    a1111_sd1_modules,
    comfy_load_lora,
    comfy_sd1_key_map,
    lora_delta,
)

RANK, ALPHA = 4, 8.0  # alpha != rank: a loader that ignores or misreads alpha adds twice or half the change
TARGETS = ["to_k", "to_q", "to_v", "to_out.0", "proj_in", "ff.net.2", "conv1"]
CLIP_VOCAB = 49408  # openai/clip-vit-large-patch14, SD 1.5's tokenizer


def _sd15_meta():
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from bench.fixtures import SD15_TEXT, SD15_UNET  # SD 1.5's unet/ and text_encoder/ config.json values

    with torch.device("meta"):
        unet = UNet2DConditionModel(**SD15_UNET)
        text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=CLIP_VOCAB, **SD15_TEXT))
    return unet, text_encoder


@pytest.fixture(scope="module")
def sd15_lora(tmp_path_factory):
    """(base unet, base text encoder, {part: {module path: peft layer}}, {"diffusers"/"kohya": file})."""
    from peft.tuners.lora import LoraLayer

    from rangefinder.formats.lora import save_lora_files
    from rangefinder.formats.weights_file import export_metadata

    base_unet, base_te = _sd15_meta()
    unet, te = _sd15_meta()
    cfg = TrainingConfig(method="lora", lora={"rank": RANK, "alpha": ALPHA, "train_text_encoder": True,
                                              "target_modules": TARGETS})
    # The method's own setup on the real components record (no VAE, tokenizer or scheduler: setup never reads them).
    parts = SDComponents(unet=unet, vae=None, text_encoder=te, tokenizer=None, noise_scheduler=None, source="sd15-meta")
    make_method(cfg).setup(parts, torch.float32)
    g = torch.Generator().manual_seed(0)
    layers: dict[str, dict[str, LoraLayer]] = {"unet": {}, "text_encoder": {}}
    for part, model in (("unet", unet), ("text_encoder", te)):
        for path, layer in model.named_modules():
            if isinstance(layer, LoraLayer):
                layers[part][path] = layer
                for pair in (layer.lora_A, layer.lora_B):  # real, nonzero adapters (B starts at zero in training)
                    shape = pair["default"].weight.shape
                    pair["default"].weight = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.05)
    assert len(layers["unet"]) > 100 and layers["text_encoder"]
    files = save_lora_files(tmp_path_factory.mktemp("sd15-lora"), unet=unet, text_encoder=te,
                            metadata=export_metadata(method="lora"))
    return base_unet, base_te, layers, files


def _trained(layers) -> set[tuple[str, str]]:
    return {(part, f"{path}.weight") for part, by_path in layers.items() for path in by_path}


def _assert_same_model(patches, layers, base_unet, base_te, what: str) -> None:
    """Every trained module patched, and by what its adapter adds. For every module the loader's factors are the
    trained ones (down = A, scale * up = peft's scaling * B, so scale * up @ down is the trained change); for one
    module of each kind (linear, 1x1 and 3x3 convolution, text encoder) the whole change is also built the way the
    loader builds it and compared with peft's own `get_delta_weight` (doing it for all ~230 SD 1.5 modules costs
    minutes of CPU)."""
    assert set(patches) == _trained(layers), f"{what}: patched modules differ from the trained ones"
    base = {"unet": base_unet, "text_encoder": base_te}
    smallest: dict[tuple, tuple[int, tuple[str, str]]] = {}
    for (part, key), patch in patches.items():
        path = key[: -len(".weight")]
        shape = base[part].get_submodule(path).weight.shape
        layer = layers[part][path]
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        torch.testing.assert_close(patch.down.reshape(a.shape), a, rtol=0, atol=0, msg=f"{what}: {key} down")
        torch.testing.assert_close((patch.up * patch.scale).reshape(b.shape), b * layer.scaling["default"],
                                   rtol=1e-6, atol=0, msg=f"{what}: {key} up * alpha / rank")
        kind = (part, len(shape), tuple(shape[2:]))
        if kind not in smallest or shape.numel() < smallest[kind][0]:
            smallest[kind] = (shape.numel(), (part, key))
    assert {k[1:] for k in smallest if k[0] == "unet"} >= {(2, ()), (4, (1, 1)), (4, (3, 3))}
    for _, (part, key) in smallest.values():
        path = key[: -len(".weight")]
        shape = base[part].get_submodule(path).weight.shape
        expected = layers[part][path].get_delta_weight("default")
        assert expected.shape == shape, (what, key)
        torch.testing.assert_close(lora_delta(patches[(part, key)], shape), expected, rtol=1e-5, atol=1e-7,
                                   msg=f"{what}: {key}")


def test_a1111_maps_every_kohya_key_to_a_fitting_module_and_applies_the_trained_change(sd15_lora):
    base_unet, base_te, layers, files = sd15_lora
    lora = load_file(str(files["kohya"]))
    patches, failed = a1111_load_lora(lora, a1111_sd1_modules(base_unet, base_te))
    assert not failed, f"A1111 would fail to match {sorted(failed)[:5]}"
    assert any(k.endswith(".alpha") for k in lora)  # alpha travels as A1111 reads it
    _assert_same_model(patches, layers, base_unet, base_te, "A1111")


def test_a1111_rules_reject_what_they_cannot_read(sd15_lora):
    """The check above can fail: A1111's loader splits a key at its first dot, so the diffusers-named file matches
    nothing there (the README sends A1111 users to lora_kohya.safetensors); and weights named for another module
    do not fit the one A1111 finds."""
    base_unet, base_te, _, files = sd15_lora
    modules = a1111_sd1_modules(base_unet, base_te)
    diffusers_file = load_file(str(files["diffusers"]))
    patches, failed = a1111_load_lora(diffusers_file, modules)
    assert not patches and failed == set(diffusers_file)
    kohya = load_file(str(files["kohya"]))
    # The keys of one level moved a level deeper (as a file for another layout would be): 1280 channels, not 640.
    shifted = {k.replace("down_blocks_1_", "down_blocks_2_"): v for k, v in kohya.items() if "down_blocks_1_" in k}
    with pytest.raises(AssertionError, match="do not fit"):
        a1111_load_lora(shifted, modules)


@pytest.mark.parametrize("which", ["kohya", "diffusers"])
def test_comfyui_maps_every_key_at_sd15_shape_and_applies_the_trained_change(sd15_lora, which):
    base_unet, base_te, layers, files = sd15_lora
    patches, left_over = comfy_load_lora(load_file(str(files[which])), comfy_sd1_key_map(base_unet, base_te))
    assert not left_over, f"ComfyUI would not load {sorted(left_over)[:5]}"
    _assert_same_model(patches, layers, base_unet, base_te, f"ComfyUI, {which} file")


def test_ldm_module_names_at_sd15_shape_invert_diffusers_converter(sd15_lora):
    """Both loaders' module names come from our diffusers -> LDM table (consumers.py); at SD 1.5's shape it is the
    exact inverse of diffusers' own LDM -> diffusers converter, weight for weight and shape for shape."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    from rangefinder.formats.single_file import LDM_UNET_PREFIX, map_keys, top_level_tables, unet_prefix_table

    base_unet, *_ = sd15_lora
    state = base_unet.state_dict()
    ldm = {LDM_UNET_PREFIX + k: v for k, v in
           map_keys(state, unet_prefix_table(base_unet.config), top_level_tables()[0], "UNet").items()}
    assert "model.diffusion_model.output_blocks.2.1.conv.weight" in ldm  # SD 1.x's first upsampler, no attention
    back = convert_ldm_unet_checkpoint(ldm, base_unet.config)
    assert set(back) == set(state)
    assert all(back[k].shape == state[k].shape for k in state)
