"""LoRA: only adapters train; diffusers and kohya files load back into a pipeline and reproduce the trained model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from rangefinder.config import TrainingConfig
from rangefinder.formats.export import LORA_KOHYA_NAME, LORA_WEIGHTS_NAME
from rangefinder.training.methods import make_method
from tests.methods.harness import load_parts, pipeline_image, state_of, train_updates

RANK, ALPHA = 4, 8.0  # alpha != rank, so a file that drops the scale alpha/rank is caught


def _unet_out(unet):
    g = torch.Generator().manual_seed(1)
    size = unet.config.sample_size
    x = torch.randn(1, 4, size, size, generator=g)
    h = torch.randn(1, 77, unet.config.cross_attention_dim, generator=g)
    with torch.no_grad():
        return unet(x, torch.tensor([500]), h).sample


@pytest.fixture(scope="module")
def trained_lora(tiny_model_dir, tmp_path_factory):
    cfg = TrainingConfig(method="lora", lora={"rank": RANK, "alpha": ALPHA, "train_text_encoder": True}, lr=1e-2,
                         epochs=1)
    method = make_method(cfg)
    parts = load_parts(tiny_model_dir)
    before = {"unet": state_of(parts.unet), "text_encoder": state_of(parts.text_encoder)}
    method.setup(parts, torch.float32)
    train_updates(method, parts, ["a red circle", "a blue square"], updates=3, lr=1e-2)
    out = tmp_path_factory.mktemp("lora") / "final"
    out.mkdir()
    method.save_final(parts, out)
    parts.unet.eval()
    parts.text_encoder.eval()
    return method, parts, before, out, cfg


def test_only_adapters_train_and_base_weights_are_unchanged(trained_lora):
    method, parts, before, _, _ = trained_lora
    trainable = method.trainable_parameters()
    named = {id(p): n for m in method.trainable_modules().values() for n, p in m.named_parameters()}
    assert trainable and all("lora_" in named[id(p)] for p in trainable)
    assert all(k.split(".", 1)[1].count("lora_") for k in method.trainable_state_dict())
    for name in ("unet", "text_encoder"):
        now = {k.replace(".base_layer", ""): v for k, v in getattr(parts, name).state_dict().items() if "lora_" not in k}
        assert set(now) == set(before[name])
        assert all(torch.equal(now[k], before[name][k]) for k in before[name]), f"{name} base weights moved"


def test_diffusers_and_kohya_files_reproduce_the_trained_model(trained_lora, tiny_model_dir):
    from diffusers import StableDiffusionPipeline

    _, parts, _, out, _ = trained_lora
    trained = _unet_out(parts.unet)
    base = StableDiffusionPipeline.from_pretrained(str(tiny_model_dir), safety_checker=None)
    base_out, base_img = _unet_out(base.unet), pipeline_image(base, "a red circle")
    assert not torch.allclose(trained, base_out)
    for weight_name in (LORA_WEIGHTS_NAME, LORA_KOHYA_NAME):
        pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model_dir), safety_checker=None)
        pipe.load_lora_weights(str(out), weight_name=weight_name)
        torch.testing.assert_close(_unet_out(pipe.unet), trained, rtol=0, atol=1e-5, msg=weight_name)
        ids = pipe.tokenizer(["a red circle"], padding="max_length", max_length=77, return_tensors="pt").input_ids
        with torch.no_grad():
            torch.testing.assert_close(pipe.text_encoder(ids)[0], parts.text_encoder(ids)[0], rtol=0, atol=1e-5)
        img = pipeline_image(pipe, "a red circle")
        assert np.abs(img - base_img).max() > 0, f"{weight_name} did not change the output"


def test_files_have_kohya_keys_alpha_and_metadata(trained_lora):
    _, _, _, out, cfg = trained_lora
    with safe_open(str(out / LORA_KOHYA_NAME), framework="pt") as f:
        keys, meta = list(f.keys()), f.metadata()
        alphas = [f.get_tensor(k) for k in keys if k.endswith(".alpha")]
    assert any(k.startswith("lora_unet_") and k.endswith(".lora_down.weight") for k in keys)
    assert any(k.startswith("lora_te_text_model_encoder_layers_") for k in keys)
    assert alphas and all(float(a) == ALPHA for a in alphas)
    with safe_open(str(out / LORA_WEIGHTS_NAME), framework="pt") as f:
        dmeta = f.metadata()
    for m in (meta, dmeta):
        assert m["rangefinder.method"] == "lora" and float(m["rangefinder.lr"]) == cfg.lr
        assert m["rangefinder.lora_rank"] == str(RANK) and "rangefinder.version" in m


def test_checkpoint_state_round_trips_bit_for_bit(trained_lora, tiny_model_dir):
    method, parts, _, _, cfg = trained_lora
    state = {k: v.clone() for k, v in method.trainable_state_dict().items()}
    fresh = make_method(cfg)
    fresh_parts = load_parts(tiny_model_dir)
    fresh.setup(fresh_parts, torch.float32)
    fresh.load_trainable_state_dict(state)
    assert all(torch.equal(v, state[k]) for k, v in fresh.trainable_state_dict().items())
    fresh_parts.unet.eval()
    assert torch.equal(_unet_out(fresh_parts.unet), _unet_out(parts.unet))
    with pytest.raises(ValueError, match="same training.lora settings"):
        fresh.load_trainable_state_dict({k: v for k, v in list(state.items())[1:]})
