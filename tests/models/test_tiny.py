"""The embedded tiny model: a real diffusers SD folder that loads offline, generates, and rebuilds bit for bit."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rangefinder.models.tiny import (
    TinyModelSettings,
    build_tiny_base_model,
    build_tokenizer,
    ensure_tiny_base_model,
    settings_key,
    vocabulary_words,
)

# A few steps of everything: enough to run every line of the builder, cheap enough to do twice.
QUICK = TinyModelSettings(pretrain_images=4, vae_steps=2, vae_batch=2, unet_steps=2, unet_batch=2)


def test_every_vocabulary_word_is_one_token():
    tok = build_tokenizer()
    for word in vocabulary_words():
        assert len(tok(word, add_special_tokens=False).input_ids) == 1, word
    for word in ("object", "style", "circle", "background", "photo"):
        assert word in vocabulary_words()
    # Words outside the vocabulary still tokenize (into bytes), never into the unknown token.
    ids = tok("a zebra", add_special_tokens=False).input_ids
    assert len(ids) > 2 and tok.unk_token_id not in ids
    assert tok.decode(tok("a red circle on a blue background").input_ids, skip_special_tokens=True) == \
        "a red circle on a blue background"


def test_loads_offline_with_from_pretrained_and_generates(tiny_model_dir):
    from diffusers import StableDiffusionPipeline

    for sub in ("model_index.json", "unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (tiny_model_dir / sub).exists(), sub
    pipe = StableDiffusionPipeline.from_pretrained(
        str(tiny_model_dir), safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        local_files_only=True,
    )
    pipe.set_progress_bar_config(disable=True)
    out = pipe(["red and white horizontal stripes", "a red circle on a blue background"], num_inference_steps=4,
               guidance_scale=3.0, height=32, width=32, generator=torch.Generator().manual_seed(0),
               output_type="np").images
    assert out.shape == (2, 32, 32, 3) and np.isfinite(out).all()
    assert out.std() > 0.05  # an image, not a flat colour
    assert pipe.vae_scale_factor == 4 and pipe.unet.config.sample_size == 8


def test_vae_is_pretrained_with_latents_scaled_to_unit_std(tiny_model_dir):
    from diffusers import AutoencoderKL

    from rangefinder.data.pixels import to_model_array
    from rangefinder.data.synthetic import render_item

    vae = AutoencoderKL.from_pretrained(str(tiny_model_dir), subfolder="vae")
    x = torch.from_numpy(np.stack([to_model_array(render_item(kind, 99, i, 32)[0], 32)
                                   for kind in ("shapes", "stripes") for i in range(8)]))
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        recon = vae.decode(z).sample
    # Decoded latents resemble the images (a flat mean image would score ~0.3), shapes included.
    assert torch.mean((recon - x) ** 2).item() < 0.1
    scaled_std = (z * vae.config.scaling_factor).std().item()
    assert 0.6 < scaled_std < 1.6
    info = json.loads((tiny_model_dir / "rangefinder_tiny.json").read_text())
    assert info["pretraining"]["scaling_factor"] == vae.config.scaling_factor


def test_rebuild_gives_identical_weights(tmp_path):
    a = build_tiny_base_model(tmp_path / "a", QUICK, log=lambda *_: None)
    b = build_tiny_base_model(tmp_path / "b", QUICK, log=lambda *_: None)
    for part in ("unet", "vae", "text_encoder"):
        wa = load_file(str(a / part / ("model.safetensors" if part == "text_encoder" else
                                       "diffusion_pytorch_model.safetensors")))
        wb = load_file(str(next((b / part).glob("*.safetensors"))))
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), part
    for f in ("tokenizer/vocab.json", "tokenizer/merges.txt", "model_index.json", "scheduler/scheduler_config.json"):
        if (a / f).exists():
            assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary folders were renamed


def test_cache_builds_once_and_never_exposes_a_partial_model(tmp_path):
    first = ensure_tiny_base_model(tmp_path, QUICK)
    stamp = (first / "model_index.json").stat().st_mtime_ns
    again = ensure_tiny_base_model(tmp_path, QUICK)
    assert again == first and (again / "model_index.json").stat().st_mtime_ns == stamp
    assert first.name.startswith("tiny-sd-") and first.parent == tmp_path
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [first.name]  # no temporary folder left
    # Any change of setting (or of the builder's code) is a different cache entry.
    assert settings_key(dataclasses.replace(QUICK, seed=1)) != settings_key(QUICK)
    assert first.name == f"tiny-sd-{settings_key(QUICK)}"


def test_make_base_model_command_copies_the_cached_model(tmp_path, monkeypatch, capsys, tiny_model_dir):
    from rangefinder.cli.main import main

    monkeypatch.setenv("RANGEFINDER_CACHE", str(tiny_model_dir.parent))
    assert main(["make-base-model", "--out", str(tmp_path / "m"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cached"] == str(tiny_model_dir)
    assert (tmp_path / "m" / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == \
        (tiny_model_dir / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert main(["make-base-model", "--out", str(tmp_path / "m")]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_make_base_model_gives_each_family_s_tiny_model(family, tmp_path, monkeypatch, capsys, request):
    """`demo --family sd3|flux` trains the tiny SD3 and Flux.1 models; `make-base-model --family` gives them too, for
    a user's own config (it offered sd1 and sdxl only)."""
    from rangefinder.cli.main import main
    from rangefinder.models.loading import detect_family

    model = request.getfixturevalue(f"tiny_{family}_dir")
    monkeypatch.setenv("RANGEFINDER_CACHE", str(model.parent))
    assert main(["make-base-model", "--family", family, "--out", str(tmp_path / "m"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["cached"], out["family"]) == (str(model), family)
    assert detect_family(tmp_path / "m") == family
