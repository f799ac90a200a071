"""Flux's output files, held to their consumers' own loading rules (issue 33, item 5): the single file in Black
Forest Labs' layout (diffusers' `FluxTransformer2DModel.from_single_file`, ComfyUI's key rules) and both LoRA files
(diffusers' `load_lora_weights`, ComfyUI's key map with no key left over).

The model is the tiny Flux's architecture (models/tiny_flux.py), freshly initialised: the mapping is what is tested,
not the weights. diffusers' Flux converters write Flux.1's widths in as numbers (`inner_dim = 3072` in
single_file_utils.convert_flux_transformer_checkpoint_to_diffusers; `dims=[3072, 3072, 3072, 12288]` for a single
block's `linear1` in lora_conversion_utils._convert_kohya_flux_lora_to_diffusers), so for a model 100 times narrower
`diffusers_at_width` runs their own source with only those numbers replaced by the tiny model's widths.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from rangefinder.formats.flux_layout import export_flux_transformer, to_bfl_state_dict
from tests.formats.consumers import (
    comfy_flux_config,
    comfy_flux_key_map,
    comfy_flux_patched,
    comfy_flux_to_diffusers,
    comfy_load_lora,
)


@contextmanager
def diffusers_at_width(inner: int):
    """diffusers' two Flux converters with Flux.1's widths (3072, MLP 4x) replaced by `inner` (and 4 * inner)."""
    import diffusers.loaders.lora_conversion_utils as lcu
    import diffusers.loaders.lora_pipeline as lp
    import diffusers.loaders.single_file_model as sfm
    import diffusers.loaders.single_file_utils as sfu

    single_src = inspect.getsource(sfu.convert_flux_transformer_checkpoint_to_diffusers)
    lora_src = inspect.getsource(lcu._convert_kohya_flux_lora_to_diffusers)
    assert "inner_dim = 3072" in single_src and "dims=[3072, 3072, 3072, 12288]" in lora_src
    ns_single, ns_lora = dict(vars(sfu)), dict(vars(lcu))
    exec(single_src.replace("inner_dim = 3072", f"inner_dim = {inner}"), ns_single)  # noqa: S102
    exec(lora_src.replace("dims=[3072, 3072, 3072, 12288]", f"dims=[{inner}, {inner}, {inner}, {4 * inner}]"),  # noqa: S102
         ns_lora)
    entry = sfm.SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"]
    saved = entry["checkpoint_mapping_fn"], lp._convert_kohya_flux_lora_to_diffusers
    entry["checkpoint_mapping_fn"] = ns_single["convert_flux_transformer_checkpoint_to_diffusers"]
    lp._convert_kohya_flux_lora_to_diffusers = ns_lora["_convert_kohya_flux_lora_to_diffusers"]
    try:
        yield
    finally:
        entry["checkpoint_mapping_fn"], lp._convert_kohya_flux_lora_to_diffusers = saved


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory) -> Path:
    """A FluxPipeline folder of the tiny Flux's architecture, two blocks of each kind, not pre-trained."""
    import dataclasses

    from diffusers import FluxPipeline

    from rangefinder.formats.diffusers_folder import save_pipeline_folder
    from rangefinder.models.tiny_flux import TinyFluxSettings, build_tiny_flux_components

    settings = dataclasses.replace(TinyFluxSettings(), num_layers=2, num_single_layers=2)
    with torch.random.fork_rng(devices=[]):
        parts = build_tiny_flux_components(settings)
        # Non-zero norms and biases everywhere, so a misplaced tensor cannot pass for an initial one.
        for p in parts["transformer"].parameters():
            p.data = torch.randn_like(p)
    out = tmp_path_factory.mktemp("flux") / "model"
    save_pipeline_folder(FluxPipeline(**parts), out)
    return out


def _inner(transformer) -> int:
    return int(transformer.config.num_attention_heads * transformer.config.attention_head_dim)


def test_bfl_single_file_loads_in_diffusers_and_by_comfy_rules(flux_folder, tmp_path):
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    transformer = FluxTransformer2DModel.from_pretrained(str(flux_folder / "transformer"))
    path = export_flux_transformer(flux_folder, tmp_path / "model.safetensors", {"rangefinder.family": "flux"})
    bfl = load_file(str(path))
    assert not any(k.startswith(("transformer_blocks", "single_transformer_blocks")) for k in bfl)

    with diffusers_at_width(_inner(transformer)):
        loaded = FluxTransformer2DModel.from_single_file(str(path), config=str(flux_folder), subfolder="transformer",
                                                         local_files_only=True)
    want = transformer.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)

    # ComfyUI: recognised as Flux, every weight of its model present, each diffusers weight where its table puts it.
    depth, single, hidden = comfy_flux_config(set(bfl), bfl)
    assert (depth, single, hidden) == (2, 2, _inner(transformer))
    table = comfy_flux_to_diffusers(depth, single, hidden)
    assert {t[0] for t in table.values()} == set(bfl)
    for d_key, (bfl_key, offset, swapped) in table.items():
        value = bfl[bfl_key] if offset is None else bfl[bfl_key].narrow(*offset)
        if swapped:
            value = torch.cat(value.chunk(2)[::-1])
        assert torch.equal(value, want[d_key]), d_key


def _with_adapters(flux_folder: Path):
    """The tiny transformer and CLIP-L with LoRA on every linear layer BFL's blocks hold (as kohya trains) and on
    CLIP's attention, alpha != rank, and non-zero `up`s; and the weights they merge to, {part: state dict}."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig
    from transformers import CLIPTextModel

    transformer = FluxTransformer2DModel.from_pretrained(str(flux_folder / "transformer"))
    text_encoder = CLIPTextModel.from_pretrained(str(flux_folder / "text_encoder"))
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
               "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
               "single_transformer_blocks.0.proj_out", "single_transformer_blocks.1.proj_out"]
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian"))
    text_encoder.add_adapter(LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "k_proj", "v_proj", "out_proj"],
                                        init_lora_weights="gaussian"))
    g = torch.Generator().manual_seed(7)
    for m in (transformer, text_encoder):
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.data = torch.randn(p.shape, generator=g) * 0.1
    merged = {}
    for part, m in (("transformer", transformer), ("text_encoder", text_encoder)):
        from peft.tuners.lora import LoraLayer

        state = {}
        for name, mod in m.named_modules():
            if isinstance(mod, LoraLayer):
                delta = mod.scaling["default"] * (mod.lora_B["default"].weight @ mod.lora_A["default"].weight)
                state[name + ".weight"] = (mod.get_base_layer().weight + delta).detach()
        merged[part] = state
    return transformer, text_encoder, merged


def _base_state(module) -> dict[str, torch.Tensor]:
    """Plain weight names: peft's `base_layer.` dropped, the adapters left out."""
    return {k.replace(".base_layer", ""): v for k, v in module.state_dict().items() if "lora_" not in k}


@pytest.mark.parametrize("which", ["diffusers", "kohya"])
def test_flux_lora_files_load_in_diffusers_and_comfy_with_no_key_left(flux_folder, tmp_path, which):
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    from rangefinder.formats.lora import save_lora_files

    transformer, text_encoder, merged = _with_adapters(flux_folder)
    files = save_lora_files(tmp_path, unet=transformer, text_encoder=text_encoder, flux=True)
    lora = load_file(str(files[which]))
    if which == "kohya":
        assert any(k.startswith("lora_unet_double_blocks_") for k in lora)
        assert any(k.startswith("lora_unet_single_blocks_") for k in lora)
        assert any(k.startswith("lora_te1_") for k in lora)

    # diffusers: load, fuse, and compare every adapted weight with what the adapters merge to.
    pipe = FluxPipeline.from_pretrained(str(flux_folder), local_files_only=True)
    with diffusers_at_width(_inner(transformer)):
        pipe.load_lora_weights(str(files[which]))
    pipe.fuse_lora(components=["transformer", "text_encoder"])
    pipe.unload_lora_weights()
    for part, module in (("transformer", pipe.transformer), ("text_encoder", pipe.text_encoder)):
        state = _base_state(module)
        for key, want in merged[part].items():
            assert torch.allclose(state[key], want, atol=1e-5), (part, key)

    # ComfyUI: every key loads, and the patched BFL weights are the merged model's in BFL's layout.
    base_bfl = to_bfl_state_dict(_base_state(transformer), transformer.config)
    from transformers import CLIPTextModel

    clip_l = CLIPTextModel.from_pretrained(str(flux_folder / "text_encoder"))  # as ComfyUI holds it: no adapters
    patches, left = comfy_load_lora(lora, comfy_flux_key_map(base_bfl, clip_l))
    assert left == set()
    expected = to_bfl_state_dict({**_base_state(transformer), **merged["transformer"]}, transformer.config)
    patched = comfy_flux_patched(base_bfl, patches)
    for key, want in expected.items():
        assert torch.allclose(patched[key], want.float(), atol=1e-5), key
    te_targets = {k for part, k, _ in patches if part == "text_encoder"}
    assert te_targets == {k.replace(".base_layer", "") for k in merged["text_encoder"]}


def test_bfl_single_file_is_a_base_model_with_its_folder_as_config(flux_folder, tmp_path):
    """Our own single file, named as base model, loads back to the same transformer (its metadata names the folder
    whose VAE and text encoders go with it); without such a folder, one line says what to set."""
    from safetensors.torch import load_file, save_file

    from rangefinder.config import ModelConfig
    from rangefinder.errors import ConfigError
    from rangefinder.models.loading import load_sd_components

    path = export_flux_transformer(flux_folder, tmp_path / "flux-ft.safetensors",
                                   {"rangefinder.base_model": str(flux_folder), "rangefinder.method": "full"})
    sd = load_sd_components(ModelConfig(base_model=str(path), cache_dir=str(tmp_path / "cache")))
    assert sd.family == "flux" and sd.kind == "single_file"
    want = _transformer_state(flux_folder)
    got = sd.unet.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

    bare = tmp_path / "flux1-bare.safetensors"
    save_file(load_file(str(path)), str(bare))  # the same tensors, no metadata: which VAE and T5 is unknown
    with pytest.raises(ConfigError, match="set model.single_file_config to a local Flux diffusers folder") as e:
        load_sd_components(ModelConfig(base_model=str(bare), cache_dir=str(tmp_path / "cache")))
    assert "\n" not in str(e.value)


def _transformer_state(folder: Path) -> dict[str, torch.Tensor]:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(str(folder / "transformer")).state_dict()
