"""Single-file SD checkpoints: the LDM layout round-trips exactly through diffusers' own converters and loader."""

from __future__ import annotations

import pytest
import torch

from rangefinder import __version__
from rangefinder.formats.export import (
    LDM_CLIP_PREFIX,
    LDM_UNET_PREFIX,
    LDM_VAE_PREFIX,
    diffusers_to_ldm_state_dict,
    export_full,
    export_metadata,
    read_metadata,
)


@pytest.fixture(scope="module")
def tiny_pipe(tiny_model_dir):
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(str(tiny_model_dir), safety_checker=None)


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        assert torch.equal(a[k].reshape(b[k].shape), b[k]), f"{what}: {k} differs"


def test_ldm_layout_inverts_diffusers_converters(tiny_pipe):
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint

    sd = diffusers_to_ldm_state_dict(tiny_pipe.unet, tiny_pipe.vae, tiny_pipe.text_encoder)
    assert {k.split(".")[0] for k in sd} == {"model", "first_stage_model", "cond_stage_model"}
    assert f"{LDM_UNET_PREFIX}input_blocks.0.0.weight" in sd and f"{LDM_UNET_PREFIX}out.2.weight" in sd
    assert f"{LDM_VAE_PREFIX}encoder.mid.attn_1.q.weight" in sd
    assert sd[f"{LDM_VAE_PREFIX}encoder.mid.attn_1.q.weight"].ndim == 4  # LDM's 1x1 convolution
    assert f"{LDM_CLIP_PREFIX}text_model.embeddings.token_embedding.weight" in sd
    _assert_same(convert_ldm_unet_checkpoint(sd, tiny_pipe.unet.config), tiny_pipe.unet.state_dict(), "unet")
    _assert_same(convert_ldm_vae_checkpoint(sd, tiny_pipe.vae.config), tiny_pipe.vae.state_dict(), "vae")


def test_single_file_loads_back_with_from_single_file(tiny_model_dir, tiny_pipe, tmp_path):
    from diffusers import StableDiffusionPipeline

    meta = export_metadata(method="full", base_model=str(tiny_model_dir), lr=3e-5, epochs=4, updates=40)
    path = export_full(tiny_model_dir, tmp_path / "model.safetensors", meta)
    assert not list(tmp_path.glob(".*.tmp"))
    got = read_metadata(path)
    assert got["rangefinder.method"] == "full" and got["rangefinder.version"] == __version__
    assert float(got["rangefinder.lr"]) == 3e-5 and float(got["rangefinder.epochs"]) == 4.0
    assert got["rangefinder.base_model"] == str(tiny_model_dir)

    loaded = StableDiffusionPipeline.from_single_file(
        str(path), config=str(tiny_model_dir), local_files_only=True, safety_checker=None
    )
    for name in ("unet", "vae", "text_encoder"):
        _assert_same(getattr(loaded, name).state_dict(), getattr(tiny_pipe, name).state_dict(), name)
