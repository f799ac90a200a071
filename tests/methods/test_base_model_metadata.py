"""The base model an SD 1.x/2.x LoRA's kohya file and an embedding's A1111 file name, as sd-scripts names it, read
off the model exported: SD 1.x or 2.x by the UNet's cross-attention width, v-prediction by what it was trained to
predict (training.prediction_type over the model's scheduler).

What sd-scripts writes (kohya-ss/sd-scripts at 48d368f): `ss_base_model_version` sd_v1 / sd_v2, `_v` appended for
v-prediction (library/model_util.py `get_model_version_str_for_sd1_sd2`, train_network.py); `modelspec.architecture`
stable-diffusion-v1 whatever it predicts, stable-diffusion-v2-768-v for 2.x predicting v, stable-diffusion-v2-512
otherwise, + "/lora" or "/textual-inversion"; `modelspec.implementation` diffusers for an SD 1.x/2.x LoRA, Stability's
generative-models for any embedding (library/sai_model_spec.py `determine_architecture`, `determine_implementation`);
`modelspec.prediction_type` v or epsilon, as trained (`build_metadata_dataclass`). The diffusers-named files say the
same base model in diffusers' implementation.

The SD 2.x-like model is the tiny SD model with its UNet rebuilt from its config at SD 2.x's 1024-wide cross-attention
(and SD 2.x's linear projections), random weights. The model's scheduler is left as loaded, without the override
registered, as a model rebuilt from a checkpoint has it (training/restore.py), so the setting must win on its own.
"""

from __future__ import annotations

import pytest
import torch

from rangefinder.config import TrainingConfig
from rangefinder.formats.embeddings import TI_A1111_DIR, TI_WEIGHTS_NAME, a1111_embedding_name
from rangefinder.formats.lora import LORA_KOHYA_NAME, LORA_WEIGHTS_NAME, trained_lora_layers
from rangefinder.formats.weights_file import read_metadata
from rangefinder.training.methods import make_method
from tests.formats.consumers import a1111_load_embedding
from tests.methods.harness import Parts, load_parts, unet_output

SGM = "https://github.com/Stability-AI/generative-models"
V1, V2_512, V2_768_V = "stable-diffusion-v1", "stable-diffusion-v2-512", "stable-diffusion-v2-768-v"
# (the UNet, what the model's scheduler predicts, training.prediction_type, ss_base_model_version, architecture)
LORA_CASES = [
    ("sd1", "epsilon", None, "sd_v1", V1),
    ("sd1", "epsilon", "v_prediction", "sd_v1_v", V1),
    ("sd2", "epsilon", None, "sd_v2", V2_512),
    ("sd2", "v_prediction", None, "sd_v2_v", V2_768_V),
    ("sd2", "v_prediction", "epsilon", "sd_v2", V2_512),  # trained as epsilon: what was trained, not the model's own
    ("sd2", "epsilon", "v_prediction", "sd_v2_v", V2_768_V),
]


def _parts(tiny_model_dir, unet: str, predicts: str) -> Parts:
    from diffusers import DDPMScheduler, UNet2DConditionModel

    parts = load_parts(tiny_model_dir)
    assert parts.unet.config.cross_attention_dim != 1024  # the tiny model is SD 1.x's kind
    if unet == "sd2":
        torch.manual_seed(0)
        parts.unet = UNet2DConditionModel.from_config(
            {**parts.unet.config, "cross_attention_dim": 1024, "use_linear_projection": True})
    parts.noise_scheduler = DDPMScheduler.from_config(parts.noise_scheduler.config, prediction_type=predicts)
    return parts


@pytest.mark.parametrize("unet,predicts,setting,version,architecture", LORA_CASES)
def test_the_kohya_lora_names_its_base_model_as_sd_scripts_does_and_loads_in_diffusers(
        tiny_model_dir, tmp_path, unet, predicts, setting, version, architecture):
    import copy

    from diffusers import StableDiffusionPipeline
    from peft.tuners.lora import LoraLayer

    parts = _parts(tiny_model_dir, unet, predicts)
    base_unet = copy.deepcopy(parts.unet)
    method = make_method(TrainingConfig(method="lora", lora={"rank": 4, "alpha": 8.0}, prediction_type=setting))
    method.setup(parts, torch.float32)
    g = torch.Generator().manual_seed(0)
    for layer in parts.unet.modules():
        if isinstance(layer, LoraLayer):
            b = layer.lora_B["default"].weight
            b.data = torch.randn(b.shape, generator=g) * 0.1  # B starts at zero in training
    method.save_final(parts, tmp_path)

    meta = read_metadata(tmp_path / LORA_KOHYA_NAME)
    keys = ("ss_network_module", "ss_base_model_version", "ss_v2", "modelspec.sai_model_spec",
            "modelspec.architecture", "modelspec.implementation", "modelspec.prediction_type")
    predicts = "v" if version.endswith("_v") else "epsilon"
    # ss_v2: what A1111 tells an SD 2.x LoRA by (extensions-builtin/Lora/network.py `detect_version`), and hides it
    # from its Lora tab under a checkpoint of another version (ui_extra_networks_lora.py `create_item`).
    assert {k: meta.get(k) for k in keys} == {
        "ss_network_module": "networks.lora", "ss_base_model_version": version, "ss_v2": str(unet == "sd2"),
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.architecture": f"{architecture}/lora", "modelspec.implementation": "diffusers",
        "modelspec.prediction_type": predicts}
    assert {k: v for k, v in read_metadata(tmp_path / LORA_WEIGHTS_NAME).items() if k.startswith("modelspec.")} == {
        k: v for k, v in meta.items() if k.startswith("modelspec.")}

    # diffusers' load_lora_weights takes the kohya file whole, and its UNet computes what the trained one does.
    pipe = StableDiffusionPipeline(vae=parts.vae, text_encoder=parts.text_encoder, tokenizer=parts.tokenizer,
                                   unet=base_unet, scheduler=parts.noise_scheduler, safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.load_lora_weights(str(tmp_path), weight_name=LORA_KOHYA_NAME, adapter_name="loaded")
    assert set(trained_lora_layers(pipe.unet, adapter="loaded")) == set(trained_lora_layers(parts.unet))
    torch.testing.assert_close(unet_output(pipe.unet), unet_output(parts.unet), rtol=0, atol=1e-5)


@pytest.mark.parametrize("unet,predicts,setting,architecture", [
    ("sd1", "epsilon", "v_prediction", V1),
    ("sd2", "epsilon", None, V2_512),
    ("sd2", "epsilon", "v_prediction", V2_768_V),
])
def test_the_a1111_embedding_names_its_base_model_as_sd_scripts_does(tiny_model_dir, tmp_path, unet, predicts,
                                                                     setting, architecture):
    """sd-scripts' embedding (train_textual_inversion.py: `emb_params` with `get_sai_model_spec(..., textual_inversion
    =True)`) is the A1111 file; A1111's reader still takes it. The diffusers-named file names the same base model in
    diffusers' implementation, its `{token: vectors}` being diffusers' format."""
    token = "<rf-concept>"
    parts = _parts(tiny_model_dir, unet, predicts)
    method = make_method(TrainingConfig(method="textual_inversion", textual_inversion={"placeholder_token": token},
                                        prediction_type=setting))
    method.setup(parts, torch.float32)
    method.save_final(parts, tmp_path)
    a1111 = tmp_path / TI_A1111_DIR / f"{a1111_embedding_name(token)}.safetensors"
    meta = read_metadata(a1111)
    spec = {"modelspec.sai_model_spec": "1.0.1", "modelspec.architecture": f"{architecture}/textual-inversion",
            "modelspec.implementation": SGM, "modelspec.prediction_type": "v" if setting else "epsilon"}
    assert {k: v for k, v in meta.items() if k.startswith("modelspec.")} == spec
    assert {k: v for k, v in read_metadata(tmp_path / TI_WEIGHTS_NAME).items() if k.startswith("modelspec.")} == {
        **spec, "modelspec.implementation": "diffusers"}
    torch.testing.assert_close(a1111_load_embedding(a1111)["vec"], method.learned_embeds().float(), rtol=0, atol=0)


def test_the_sdxl_a1111_embedding_names_sdxl_as_sd_scripts_does(tmp_path):
    """sdxl_train_textual_inversion.py writes `clip_l` and `clip_g` with the SDXL base model's spec (no prediction type
    given: none is claimed)."""
    from rangefinder.formats.embeddings import save_textual_inversion_sdxl

    files = save_textual_inversion_sdxl(tmp_path, "<rf-concept>", torch.randn(2, 32), torch.randn(2, 48))
    meta = read_metadata(files["a1111"])
    assert {k: v for k, v in meta.items() if k.startswith("modelspec.")} == {
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.architecture": "stable-diffusion-xl-v1-base/textual-inversion",
        "modelspec.implementation": SGM}
