"""The kohya LoRA of the flow families (Flux.1, SD3/3.5) as its consumers read it: the sd-scripts and model-spec
metadata that LoRA browsers, kohya's tools and model managers show agrees with the tensors, and the file still loads,
the same model, in diffusers and through ComfyUI's rules.

The adapters are the `lora` method's own (its `setup` on the tiny Flux and SD3), rank 4 and alpha 8, with non-zero
`up`s, written by the family's own export (FamilyLayout.lora_export). sd-scripts writes `ss_network_dim` and
`ss_network_alpha` as trained (train_network.py's metadata block), and every reader scales a module by its `.alpha`
over its `down`'s rows (ComfyUI: comfy/weight_adapter/lora.py `calculate_weight`; diffusers:
lora_conversion_utils.py `_convert_kohya_flux_lora_to_diffusers`), so a module holding one adapter must carry
alpha = ss_network_alpha at rank ss_network_dim, and a fused one (q, k and v in one BFL or MMDiT layer) the same
ratio. The Flux file once carried alpha = rank (scale folded into `up`) under `ss_network_alpha` 8.0.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.formats.weights_file import read_metadata

RANK, ALPHA = 4, 8.0  # alpha != rank, so a scale dropped or doubled anywhere shows
# Every linear layer of a block (BFL fuses q, k, v and a single block's MLP input; the MMDiT fuses q, k, v), so both
# fused and one-adapter modules are written.
TARGETS = {
    "flux": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
             "ff.net.0.proj", "ff.net.2", "proj_mlp"],
    "sd3": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
            "ff.net.2"],
}
# What sd-scripts writes for these models (flux_train_network.py, sd3_train_network.py, library/sai_model_spec.py):
# the tiny Flux takes guidance (dev); the tiny SD3 has SD3.5's RMSNorm q/k and no second attention (5-large). The SD3
# file's implementation is the one sd-scripts and ComfyUI give an SD3 checkpoint in the same MMDiT names (Stability's);
# sd-scripts' own SD3 LoRA says "diffusers", whose module names it does not use.
EXPECTED = {
    "flux": {"ss_network_module": "networks.lora_flux", "ss_base_model_version": "flux1",
             "modelspec.architecture": "flux-1-dev/lora",
             "modelspec.implementation": "https://github.com/black-forest-labs/flux"},
    "sd3": {"ss_network_module": "networks.lora_sd3", "ss_base_model_version": "5-large",
            "modelspec.architecture": "stable-diffusion-3-5-large/lora",
            "modelspec.implementation": "https://github.com/Stability-AI/generative-models"},
    "sdxl": {"ss_network_module": "networks.lora", "ss_base_model_version": "sdxl_base_v1-0",
             "modelspec.architecture": "stable-diffusion-xl-v1-base/lora",
             "modelspec.implementation": "https://github.com/Stability-AI/generative-models"},
}


@pytest.fixture(scope="module", params=["flux", "sd3"])
def exported(request, tmp_path_factory):
    """(family, base folder, {weight key: trained weight} of the transformer, {"diffusers"/"kohya": file})."""
    family = request.param
    folder = request.getfixturevalue({"flux": "tiny_flux_dir", "sd3": "tiny_sd3_dir"}[family])
    trained, files = _export(family, folder, TARGETS[family], tmp_path_factory.mktemp(f"{family}-lora"))
    return family, folder, trained, files


def _export(family: str, folder, targets: list[str], out_dir) -> tuple[dict[str, torch.Tensor], dict]:
    """The `lora` method's adapters on `targets` of the tiny model at `folder`, with non-zero `up`s, exported by the
    family's own export into `out_dir`: ({weight key: trained weight} of the transformer,
    {"diffusers"/"kohya": file})."""
    from peft.tuners.lora import LoraLayer

    from rangefinder.config import ModelConfig, TrainingConfig
    from rangefinder.formats.weights_file import export_metadata
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.family_detection import FAMILY_LAYOUTS, import_named
    from rangefinder.training.methods import make_method

    sd = load_sd_components(ModelConfig(base_model=str(folder)))
    assert sd.family == family
    cfg = TrainingConfig(method="lora", lora={"rank": RANK, "alpha": ALPHA, "target_modules": targets})
    make_method(cfg).setup(sd, torch.float32)
    g = torch.Generator().manual_seed(0)
    trained = {}
    for path, layer in sd.unet.named_modules():
        if isinstance(layer, LoraLayer):
            b = layer.lora_B["default"].weight
            b.data = torch.randn(b.shape, generator=g) * 0.1  # B starts at zero in training
            trained[f"{path}.weight"] = (layer.get_base_layer().weight + layer.get_delta_weight("default")).detach()
    state = {k.replace(".base_layer", ""): v for k, v in sd.unet.state_dict().items() if "lora_" not in k}
    files = import_named(FAMILY_LAYOUTS[family].lora_export)(
        out_dir, sd.unet, None, None, {**export_metadata(method="lora", updates=3), "rangefinder.family": family})
    return {**state, **trained}, files


def _modules(lora: dict[str, torch.Tensor]) -> dict[str, tuple[int, float]]:
    """{kohya module: (its rank, down's rows; its alpha)}."""
    return {k.removesuffix(".alpha"): (int(lora[k.replace(".alpha", ".lora_down.weight")].shape[0]), float(v))
            for k, v in lora.items() if k.endswith(".alpha")}


def test_kohya_dim_and_alpha_agree_with_the_tensors_and_consumers_apply_the_trained_change(exported):
    family, folder, trained, files = exported
    meta = read_metadata(files["kohya"])
    lora = load_file(str(files["kohya"]))
    assert meta["ss_network_dim"] == str(RANK) and float(meta["ss_network_alpha"]) == ALPHA
    assert meta["ss_steps"] == "3"

    modules = _modules(lora)
    assert {k.rsplit(".", 2)[0] for k in lora if ".lora_" in k} == set(modules)  # every module has its alpha
    single = {m: alpha for m, (rank, alpha) in modules.items() if rank == RANK}
    fused = {m for m, (rank, _) in modules.items() if rank > RANK}
    assert single and fused
    # A module of one adapter is the network's dim and alpha; every module scales by the trained alpha / rank.
    assert set(single.values()) == {float(meta["ss_network_alpha"])}
    assert all(alpha / rank == ALPHA / RANK for rank, alpha in modules.values())

    # ComfyUI's rules (alpha / down's rows, on the weight its key map names) give the trained weights.
    if family == "flux":
        _comfy_gives_the_trained_flux(lora, trained, folder)
    else:
        _comfy_gives_the_trained_sd3(lora, trained, folder)

    # diffusers' own loader: both Flux files (it converts kohya's Flux names), SD3's diffusers-named one (it has no
    # conversion for kohya's SD3 names: docs/model-families.md); fused, the trained weights.
    for which in ("diffusers", "kohya") if family == "flux" else ("diffusers",):
        fused_state = _diffusers_fused(family, folder, files[which])
        for key, want in trained.items():
            torch.testing.assert_close(fused_state[key], want, rtol=1e-5, atol=1e-6, msg=f"{which}: {key}")


def test_an_sd3_qkv_module_with_some_of_its_parts_adapted_holds_each_in_its_own_rows(tiny_sd3_dir, tmp_path):
    """lora.target_modules is the user's: with to_q and to_v (not to_k), and add_k_proj alone, the MMDiT's fused
    `attn.qkv` modules hold two parts and one; each part's `up` lies in its own third of the rows (v's in the last,
    not the second), the part left out in zeros, so ComfyUI's rules still give the trained weights."""
    trained, files = _export("sd3", tiny_sd3_dir, ["to_q", "to_v", "add_k_proj"], tmp_path)
    lora = load_file(str(files["kohya"]))
    assert {rank for rank, _ in _modules(lora).values()} == {RANK, 2 * RANK}
    _comfy_gives_the_trained_sd3(lora, trained, tiny_sd3_dir)


@pytest.mark.parametrize("family, targets", [("flux", ["norm_out.linear"]),
                                             ("sd3", ["norm_out.linear", "norm1_context.linear"])])
def test_an_adapted_adaln_whose_halves_the_original_orders_otherwise_holds_them_in_its_order(family, targets, request,
                                                                                           tmp_path):
    """The final layer's adaLN (and SD3's last block's context one) modulates (shift, scale) in BFL's and the MMDiT's
    order, (scale, shift) in diffusers': the single files swap the weight's halves, and the kohya file now swaps its
    adapter's `up` rows too. It wrote them as trained, so ComfyUI applied the change to scale to shift and back."""
    folder = request.getfixturevalue({"flux": "tiny_flux_dir", "sd3": "tiny_sd3_dir"}[family])
    trained, files = _export(family, folder, targets, tmp_path)
    lora = load_file(str(files["kohya"]))
    (_comfy_gives_the_trained_flux if family == "flux" else _comfy_gives_the_trained_sd3)(lora, trained, folder)
    if family == "flux":  # the diffusers-named file: ComfyUI's map swaps the change's halves itself
        _comfy_gives_the_trained_flux(load_file(str(files["diffusers"])), trained, folder)


def _comfy_gives_the_trained_flux(lora, trained, folder) -> None:
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel

    from rangefinder.formats.flux_layout import to_bfl_state_dict
    from tests.formats.consumers import comfy_flux_key_map, comfy_flux_patched, comfy_load_lora

    config = FluxTransformer2DModel.load_config(str(folder / "transformer"))
    base = to_bfl_state_dict(FluxTransformer2DModel.from_pretrained(str(folder / "transformer")).state_dict(), config)
    clip_l = CLIPTextModel.from_pretrained(str(folder / "text_encoder"))
    patches, left = comfy_load_lora(lora, comfy_flux_key_map(base, clip_l))
    assert left == set()
    patched = comfy_flux_patched(base, patches)
    for key, want in to_bfl_state_dict(trained, config).items():
        torch.testing.assert_close(patched[key], want.float(), rtol=1e-5, atol=1e-6, msg=key)


def _comfy_gives_the_trained_sd3(lora, trained, folder) -> None:
    """comfy/lora.py `model_lora_keys_unet` names every `diffusion_model.` weight `lora_unet_<path with _>`."""
    from diffusers import SD3Transformer2DModel

    from rangefinder.formats.single_file_sd3 import mmdit_state_dict
    from tests.formats.consumers import comfy_load_lora, comfy_patched_state

    base = SD3Transformer2DModel.from_pretrained(str(folder / "transformer"))
    before = {k: v.clone() for k, v in mmdit_state_dict(base).items()}  # load_state_dict copies in place
    base.load_state_dict(trained, strict=True)
    after = mmdit_state_dict(base)
    key_map = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): ("transformer", k)
               for k in before if k.endswith(".weight")}
    patches, left = comfy_load_lora(lora, key_map)
    assert left == set()
    patched = comfy_patched_state({k: v.float() for k, v in before.items()}, patches, "transformer")
    for key, want in after.items():
        torch.testing.assert_close(patched[key], want.float(), rtol=1e-5, atol=1e-6, msg=key)


def _diffusers_fused(family, folder, path) -> dict[str, torch.Tensor]:
    """The transformer's weights after diffusers' load_lora_weights and fuse_lora of `path`."""
    from contextlib import nullcontext

    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    pipe = (FluxPipeline if family == "flux" else StableDiffusion3Pipeline).from_pretrained(
        str(folder), local_files_only=True)
    if family == "flux":
        from tests.formats.test_flux_outputs import diffusers_at_width

        config = pipe.transformer.config
        width = diffusers_at_width(int(config.num_attention_heads * config.attention_head_dim))
    else:
        width = nullcontext()
    with width:
        pipe.load_lora_weights(str(path))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    return pipe.transformer.state_dict()


def test_kohya_metadata_names_the_base_model_as_sd_scripts_does(exported):
    """The network module, `ss_base_model_version` and the model spec's architecture (the base model's id +
    "/lora") with the codebase whose module names the file uses, as sd-scripts writes them for these models."""
    family, _, _, files = exported
    meta = read_metadata(files["kohya"])
    assert {k: meta.get(k) for k in EXPECTED[family]} == EXPECTED[family]
    assert meta["modelspec.sai_model_spec"] == "1.0.1"


@pytest.mark.parametrize("sd3_config", [{"qk_norm": None}, {"qk_norm": "rms_norm", "dual_attention_layers": [0]}])
def test_sd3_medium_and_sd35_medium_are_told_apart_as_sd_scripts_does(sd3_config):
    """sd-scripts' library/sd3_utils.py `analyze_state_dict_state`: no q/k norm is SD3 Medium, q/k norm and a
    second image attention is SD3.5 Medium (the tiny SD3 above is SD3.5 Large's kind)."""
    from rangefinder.formats.model_spec import sd3_model_type

    assert sd3_model_type(sd3_config) == ("medium" if sd3_config["qk_norm"] is None else "5-medium")


def test_sdxl_kohya_lora_names_its_base_model_through_the_same_metadata(tiny_sdxl_dir, tmp_path):
    """SDXL's kohya file goes through the same kohya_metadata: its sd-scripts version and model spec."""
    from rangefinder.config import ModelConfig, TrainingConfig
    from rangefinder.formats.lora import save_sdxl_lora_files
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.methods import make_method

    sd = load_sd_components(ModelConfig(base_model=str(tiny_sdxl_dir)))
    make_method(TrainingConfig(method="lora", lora={"rank": RANK, "alpha": ALPHA})).setup(sd, torch.float32)
    meta = read_metadata(save_sdxl_lora_files(tmp_path, sd.unet)["kohya"])
    assert {k: meta.get(k) for k in EXPECTED["sdxl"]} == EXPECTED["sdxl"]
    assert meta["ss_network_dim"] == str(RANK) and float(meta["ss_network_alpha"]) == ALPHA
