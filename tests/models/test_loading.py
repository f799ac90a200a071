"""Loading a base model from the embedded default, a diffusers folder, a single file and a hub id."""

import pytest
import torch

from rangefinder.config import ModelConfig
from rangefinder.errors import ConfigError
from rangefinder.models.loading import load_sd_components


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def folder_parts(tiny_model_dir):
    return load_sd_components(ModelConfig(base_model=str(tiny_model_dir)))


def test_folder_and_embedded_default(tiny_model_dir, folder_parts):
    from diffusers import DDPMScheduler

    assert folder_parts.kind == "folder" and folder_parts.model_dir == tiny_model_dir.resolve()
    assert isinstance(folder_parts.noise_scheduler, DDPMScheduler)
    assert folder_parts.noise_scheduler.config.prediction_type == "epsilon"
    assert folder_parts.tokenizer("object", add_special_tokens=False).input_ids.__len__() == 1
    assert not folder_parts.unet.training
    embedded = load_sd_components(ModelConfig(cache_dir=str(tiny_model_dir.parent)))
    assert embedded.kind == "embedded" and str(tiny_model_dir) in embedded.source
    assert _same_weights(embedded.unet, folder_parts.unet)


def test_single_file_checkpoint_round_trip(tiny_model_dir, folder_parts, tmp_path):
    from rangefinder.formats.export import export_full, export_metadata

    meta = export_metadata(method="full", base_model=str(tiny_model_dir), lr=1e-4, epochs=1, updates=1)
    path = export_full(tiny_model_dir, tmp_path / "tiny.safetensors", meta)
    # The architecture comes from the base model named in the file's metadata: nothing is fetched.
    parts = load_sd_components(ModelConfig(base_model=str(path)))
    assert parts.kind == "single_file" and parts.model_dir == tiny_model_dir
    for name in ("unet", "vae", "text_encoder"):
        assert _same_weights(getattr(parts, name), getattr(folder_parts, name)), name
    assert parts.vae.config.scaling_factor == folder_parts.vae.config.scaling_factor
    # Without metadata, model.single_file_config names the architecture.
    bare = export_full(tiny_model_dir, tmp_path / "bare.safetensors")
    parts = load_sd_components(ModelConfig(base_model=str(bare), single_file_config=str(tiny_model_dir)))
    assert _same_weights(parts.unet, folder_parts.unet)


def test_hub_id_offline_fails_with_the_id_and_the_reason(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as e:
        load_sd_components(ModelConfig(base_model="rangefinder-tests/no-such-model"))
    msg = str(e.value)
    assert "'rangefinder-tests/no-such-model'" in msg and "offline" in msg and "model.base_model" in msg


def test_hub_id_unreachable_fails_fast_with_the_id():
    # This machine cannot reach the hub; where it can, the id does not exist. Either way: one clear error.
    with pytest.raises(ConfigError) as e:
        load_sd_components(ModelConfig(base_model="rangefinder-tests/no-such-model"))
    msg = str(e.value)
    assert "'rangefinder-tests/no-such-model'" in msg
    assert "hub is unreachable" in msg or "no hub model" in msg


def test_bad_paths(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_sd_components(ModelConfig(base_model=str(tmp_path / "nowhere.safetensors")))
    with pytest.raises(ConfigError, match="not a diffusers model"):
        load_sd_components(ModelConfig(base_model=str(tmp_path)))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="not a .safetensors or .ckpt"):
        load_sd_components(ModelConfig(base_model=str(tmp_path / "notes.txt")))
