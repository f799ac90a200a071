"""The tiny models' shipped weights: checked by digest, installed in seconds, loaded bit for bit, rebuilt on demand."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.errors import RangefinderError
from rangefinder.formats.diffusers_folder import clip_text_key
from rangefinder.formats.digest import file_sha256
from rangefinder.models import shipped, tiny, tiny_flux, tiny_sd3, tiny_sdxl

MODELS = {tiny.SHIPPED_NAME: (tiny.BUILDER_VERSION, tiny.TinyModelSettings()),
          tiny_sdxl.SHIPPED_NAME: (tiny_sdxl.BUILDER_VERSION, tiny_sdxl.TinySdxlSettings()),
          tiny_sd3.SHIPPED_NAME: (tiny_sd3.BUILDER_VERSION, tiny_sd3.TinySd3Settings()),
          tiny_flux.SHIPPED_NAME: (tiny_flux.BUILDER_VERSION, tiny_flux.TinyFluxSettings())}
WEIGHT_FILES = {"unet": "diffusion_pytorch_model.safetensors", "transformer": "diffusion_pytorch_model.safetensors",
                "vae": "diffusion_pytorch_model.safetensors", "text_encoder": "model.safetensors",
                "text_encoder_2": "model.safetensors"}


@pytest.mark.parametrize("name", MODELS)
def test_shipped_files_match_their_digests_and_the_default_settings(name):
    digests = shipped.read_manifest(name)
    folder = shipped.SHIPPED_DIR / name
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert on_disk == set(digests)  # nothing shipped unlisted, nothing listed missing
    for rel, digest in digests.items():
        assert file_sha256(folder / rel) == digest, rel
    # The shipped weights are what the builder makes of today's default settings: a changed default (or builder)
    # without `make tiny-weights` would leave the demo on weights its settings no longer describe.
    builder_version, settings = MODELS[name]
    info = json.loads((folder / "rangefinder_tiny.json").read_text())
    assert info["builder_version"] == builder_version
    assert info["settings"] == json.loads(json.dumps(dataclasses.asdict(settings)))
    # A few MB in all: the repository carries them.
    assert sum((folder / rel).stat().st_size for rel in digests) < 8 * 2**20


def _assert_modules_equal_shipped(pipe, shipped_folder: Path) -> None:
    for part, file_name in WEIGHT_FILES.items():
        module = getattr(pipe, part, None)
        if module is None:
            continue
        saved = load_file(str(shipped_folder / part / file_name))
        # transformers 5 drops CLIPTextModel's `text_model.` wrapper when it loads; the file keeps it
        # (formats/diffusers_folder.py).
        def norm(key: str, saved=saved) -> str:
            return key if key in saved else clip_text_key(key)

        loaded = {norm(k): v for k, v in module.state_dict().items()}
        params = {norm(k) for k, _ in module.named_parameters()}
        assert params <= saved.keys(), (part, sorted(params - saved.keys())[:3])
        for key, tensor in saved.items():
            assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), (part, key)


def test_fresh_cache_gets_the_sd_model_in_seconds_without_training(tmp_path, monkeypatch):
    from diffusers import StableDiffusionPipeline

    def no_pretraining(*args, **kwargs):
        raise AssertionError("the tiny model was pre-trained instead of installed from the shipped weights")

    monkeypatch.setattr(tiny, "build_tiny_base_model", no_pretraining)
    start = time.monotonic()
    folder = tiny.ensure_tiny_base_model(tmp_path)
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"{elapsed:.1f}s"  # a copy of a few MB (0.2 s idle); pre-training takes minutes
    assert folder.name == f"tiny-sd-{shipped.shipped_key(tiny.SHIPPED_NAME)}"
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [folder.name]  # no temporary folder left
    assert tiny.ensure_tiny_base_model(tmp_path) == folder
    pipe = StableDiffusionPipeline.from_pretrained(str(folder), safety_checker=None, feature_extractor=None,
                                                   requires_safety_checker=False, local_files_only=True)
    _assert_modules_equal_shipped(pipe, shipped.SHIPPED_DIR / tiny.SHIPPED_NAME)


DERIVED = {"sdxl": (tiny_sdxl, "build_tiny_sdxl_model", "ensure_tiny_sdxl_model", "StableDiffusionXLPipeline"),
           "sd3": (tiny_sd3, "build_tiny_sd3_model", "ensure_tiny_sd3_model", "StableDiffusion3Pipeline"),
           "flux": (tiny_flux, "build_tiny_flux_model", "ensure_tiny_flux_model", "FluxPipeline")}


@pytest.mark.parametrize("family", DERIVED)
def test_fresh_cache_gets_the_derived_model_without_training(family, tmp_path, monkeypatch):
    import diffusers

    module, builder, ensure, pipeline_class = DERIVED[family]

    def no_pretraining(*args, **kwargs):
        raise AssertionError(f"the tiny {family} model was pre-trained instead of installed from the shipped weights")

    monkeypatch.setattr(module, builder, no_pretraining)
    monkeypatch.setattr(tiny, "build_tiny_base_model", no_pretraining)
    start = time.monotonic()
    folder = getattr(module, ensure)(tmp_path)
    assert time.monotonic() - start < 10
    assert folder.name == f"{module.SHIPPED_NAME}-{shipped.shipped_key(module.SHIPPED_NAME)}"
    pipe = getattr(diffusers, pipeline_class).from_pretrained(str(folder), local_files_only=True)
    _assert_modules_equal_shipped(pipe, shipped.SHIPPED_DIR / module.SHIPPED_NAME)


def test_a_damaged_shipped_file_is_refused_and_nothing_is_installed(tmp_path):
    weights = tmp_path / "weights"
    shutil.copytree(shipped.SHIPPED_DIR, weights)
    unet = weights / tiny.SHIPPED_NAME / "unet" / "diffusion_pytorch_model.safetensors"
    data = bytearray(unet.read_bytes())
    data[-1] ^= 0xFF
    unet.write_bytes(bytes(data))
    with pytest.raises(RangefinderError, match="does not match its sha256.*make tiny-weights"):
        shipped.install_shipped(tiny.SHIPPED_NAME, tmp_path / "cache" / "m", weights)
    assert not (tmp_path / "cache" / "m").exists() and not list((tmp_path / "cache").iterdir())


def test_rebuild_writes_weights_that_install_as_built_under_a_new_key(tmp_path):
    """`make-base-model --rebuild` (`make tiny-weights`), at a few steps: the shipped folders install bit for bit as
    the builder wrote them, and new weights are a new cache key."""
    quick = tiny.TinyModelSettings(pretrain_images=4, vae_steps=2, vae_batch=2, unet_steps=2, unet_batch=2)
    quick_xl = tiny_sdxl.TinySdxlSettings(pretrain_images=4, unet_steps=2, unet_batch=2)
    quick_sd3 = tiny_sd3.TinySd3Settings(pretrain_images=4, steps=2, batch=2)
    quick_flux = tiny_flux.TinyFluxSettings(pretrain_images=4, vae_steps=2, vae_batch=2, transformer_steps=2,
                                            transformer_batch=2)
    from rangefinder.models.tiny_weights import rebuild_shipped_weights

    weights = tmp_path / "weights"
    written = rebuild_shipped_weights(weights, log=lambda *_: None, settings=quick, sdxl_settings=quick_xl,
                                      sd3_settings=quick_sd3, flux_settings=quick_flux)
    assert set(written) == set(MODELS)
    for name in MODELS:
        installed = shipped.install_shipped(name, tmp_path / "cache" / name, weights)
        for rel in shipped.read_manifest(name, weights):
            assert (installed / rel).read_bytes() == (weights / name / rel).read_bytes()
        assert (installed / "model_index.json").is_file()
        # These weights differ from the package's, and so does their key.
        assert shipped.shipped_key(name, weights) != shipped.shipped_key(name)
    assert not list(weights.glob(".*tmp*"))
