"""The model family is read from the base model, and a wrong pairing is one clear error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from rangefinder.config import ModelConfig
from rangefinder.errors import ConfigError
from rangefinder.models.loading import resolve_base_model
from rangefinder.training.family_detection import (
    FAMILY_LAYOUTS,
    detect_family,
    family_of,
    guidance_scale_for,
    sampling_dtype,
    sampling_dtypes,
    single_file_family,
)


def test_family_comes_from_model_index(tiny_model_dir, tiny_sdxl_dir, tiny_sd3_dir, tmp_path):
    assert detect_family(tiny_model_dir) == "sd1" and detect_family(tiny_sdxl_dir) == "sdxl"
    assert detect_family(tiny_sd3_dir) == "sd3" and family_of(ModelConfig(base_model=str(tiny_sd3_dir))) == "sd3"
    assert family_of(ModelConfig(base_model=str(tiny_sdxl_dir))) == "sdxl"
    assert family_of(ModelConfig()) == "sd1"  # the embedded model
    # A hub id is told by the folder the pipeline's first step resolved it to.
    assert family_of(ModelConfig(base_model="org/an-sdxl-model", resolved_dir=str(tiny_sdxl_dir))) == "sdxl"
    other = tmp_path / "kandinsky"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyV22Pipeline"}))
    with pytest.raises(ConfigError, match="KandinskyV22Pipeline model; rangefinder trains"):
        detect_family(other)
    flux = tmp_path / "flux"
    flux.mkdir()
    (flux / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert detect_family(flux) == "flux"


def test_tiny_sdxl_has_sdxl_structure(tiny_sdxl_dir):
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    unet = UNet2DConditionModel.from_pretrained(str(tiny_sdxl_dir), subfolder="unet")
    te1 = CLIPTextModel.from_pretrained(str(tiny_sdxl_dir), subfolder="text_encoder")
    te2 = CLIPTextModelWithProjection.from_pretrained(str(tiny_sdxl_dir), subfolder="text_encoder_2")
    c = unet.config
    assert c.addition_embed_type == "text_time"
    assert c.cross_attention_dim == te1.config.hidden_size + te2.config.hidden_size
    assert c.projection_class_embeddings_input_dim == 6 * c.addition_time_embed_dim + te2.config.projection_dim
    assert te1.config.hidden_size != te2.config.hidden_size  # single-file loaders tell them apart by width
    assert sum(p.numel() for p in unet.parameters()) < 2_000_000  # really tiny: its tests cost seconds


def test_single_file_family_from_keys_and_missing_second_encoder(tmp_path):
    sd1 = ["model.diffusion_model.input_blocks.0.0.weight", "cond_stage_model.transformer.x"]
    sdxl = ["model.diffusion_model.label_emb.0.0.weight", "conditioner.embedders.0.transformer.x",
            "conditioner.embedders.1.model.positional_embedding"]
    assert single_file_family(tmp_path, sd1) == "sd1" and single_file_family(tmp_path, sdxl) == "sdxl"
    # SDXL's UNet alone (its added embedding, no conditioner at all) is the pruned SDXL file, not an SD 1.x one.
    with pytest.raises(ConfigError, match="SDXL checkpoint without its second text encoder"):
        single_file_family(tmp_path, sdxl[:1])
    # SD3's single file (Stability's layout): the MMDiT's joint blocks under model.diffusion_model.
    sd3 = ["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight", "text_encoders.clip_l.x"]
    assert single_file_family(tmp_path, sd3) == "sd3"
    # Through the user's path: a single file whose second text encoder was pruned away.
    path = tmp_path / "sdxl-unet-and-clip-l.safetensors"
    save_file({k: torch.zeros(1) for k in sdxl[:2]}, str(path))
    with pytest.raises(ConfigError, match="SDXL checkpoint without its second text encoder"):
        resolve_base_model(ModelConfig(base_model=str(path), cache_dir=str(tmp_path / "cache")))
    assert not (tmp_path / "cache" / "base-models").exists() or not any((tmp_path / "cache" / "base-models").iterdir())


def test_flux_single_file_family_from_black_forest_labs_keys(tmp_path):
    """BFL's transformer file (bare names) and a ComfyUI checkpoint (under model.diffusion_model.) are Flux; a file
    with double-stream blocks only (not Flux.1's layout) is not."""
    bfl = ["double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight", "img_in.weight"]
    assert single_file_family(tmp_path, bfl) == "flux"
    assert single_file_family(tmp_path, ["model.diffusion_model." + k for k in bfl]) == "flux"
    assert single_file_family(tmp_path, bfl[:1] + bfl[2:]) != "flux"
    path = tmp_path / "flux1-tiny.safetensors"
    save_file({k: torch.zeros(1) for k in bfl}, str(path))
    assert family_of(ModelConfig(base_model=str(path))) == "flux"


def test_sdxl_folder_lacking_second_encoder_names_it(tiny_sdxl_dir, tmp_path):
    broken = tmp_path / "sdxl"
    shutil.copytree(tiny_sdxl_dir, broken)
    shutil.rmtree(broken / "text_encoder_2")
    with pytest.raises(ConfigError, match="lacks text_encoder_2/"):
        resolve_base_model(ModelConfig(base_model=str(broken)))


def test_kohya_sdxl_unet_names_match_sd_scripts_for_the_real_sdxl_layout():
    """Our diffusers -> original-layout table (formats/single_file.py) against kohya's, for SDXL base's own UNet
    (3 levels of 2 layers; sd-scripts library/sdxl_model_util.py make_unet_conversion_map)."""
    from rangefinder.formats.lora import kohya_sdxl_unet_name
    from tests.methods.kohya_sdxl import kohya_unet_path

    config = {"block_out_channels": [320, 640, 1280], "layers_per_block": 2,
              "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]}
    paths = [f"down_blocks.{i}.attentions.{j}.transformer_blocks.0.attn1.to_q" for i in (1, 2) for j in (0, 1)]
    paths += [f"up_blocks.{i}.attentions.{j}.transformer_blocks.3.attn2.to_out.0" for i in (0, 1) for j in (0, 1, 2)]
    paths += ["mid_block.attentions.0.transformer_blocks.9.attn2.to_k"]
    for p in paths:
        assert kohya_sdxl_unet_name(p, config) == kohya_unet_path(p, 2), p
    # Spot checks written out by hand from sd-scripts' table (3i + j + 1 / 3i + j).
    assert kohya_sdxl_unet_name(paths[0], config) == "input_blocks.4.1.transformer_blocks.0.attn1.to_q"
    assert kohya_sdxl_unet_name(paths[4], config).startswith("output_blocks.0.1.")
    assert kohya_sdxl_unet_name(paths[-1], config).startswith("middle_block.1.")


def test_a_guidance_scale_of_zero_is_kept_not_taken_for_unset():
    """sampling.guidance_scale 0 (allowed: no classifier-free guidance) is the scale sampled at; only None means the
    family's pipeline's own."""
    assert guidance_scale_for("sdxl", 0.0) == 0.0 and guidance_scale_for("sdxl", None) == 5.0
    assert guidance_scale_for("sd1", None) == 7.5 and guidance_scale_for("flux", 2) == 2.0


def test_an_unset_guidance_is_read_from_the_pipeline_s_source_without_importing_torch_or_diffusers(tiny_flux_dir):
    """The guidance scale a family's pipeline samples at when given none is its `__call__`'s default, as diffusers
    writes it (StableDiffusionPipeline 7.5, StableDiffusionXLPipeline 5.0, StableDiffusion3Pipeline 7.0, FluxPipeline
    3.5), read from diffusers' source: resolve-config, the first step of every run, logs it
    (sampling.guidance_scale_used) and imported the pipeline, so torch, transformers and diffusers, to do it (~7-10
    CPU-s for a Flux run's parameters on 2 busy cores). Checked in a fresh interpreter, for every family and on the
    parameters a step logs for a Flux folder with the scale unset."""
    import subprocess
    import sys

    code = ("import json, sys\nfrom rangefinder.config import RangefinderConfig\n"
            "from rangefinder.tracking.runs import applicable_params\n"
            "from rangefinder.training.family_detection import FAMILY_LAYOUTS, guidance_scale_for\n"
            "cfg = RangefinderConfig.model_validate({'model': {'base_model': sys.argv[1]}, "
            "'sampling': {'guidance_scale': None}})\n"
            "used = applicable_params(cfg)['sampling.guidance_scale_used']\n"
            "own = {f: guidance_scale_for(f) for f in FAMILY_LAYOUTS}\n"
            "print(json.dumps([own, used, sorted(m for m in ('torch', 'diffusers', 'transformers') "
            "if m in sys.modules)]))")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_flux_dir)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    own, used, loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert own == {"sd1": 7.5, "sdxl": 5.0, "sd3": 7.0, "flux": 3.5} and used == "3.5", r.stdout
    assert loaded == [], loaded


def test_flux_and_sd3_sample_in_bf16_on_a_gpu_never_in_fp16_where_t5_overflows():
    """The grid and the registered model loaded every family in fp16 on a GPU: T5-XXL overflows in fp16 (NaN, black
    images), and diffusers' and the model cards load SD3.5 and Flux.1 in bf16. The flow families take bf16 where the
    GPU computes in it, fp32 where it does not; SD 1.x/2.x and SDXL keep fp16; a CPU samples in fp32."""
    by_precision = {f: sampling_dtypes(f) for f in FAMILY_LAYOUTS}
    assert by_precision == {"sd1": {"bf16": "float16", "fp16": "float16", "no": "float32"},
                            "sdxl": {"bf16": "float16", "fp16": "float16", "no": "float32"},
                            "sd3": {"bf16": "bfloat16", "fp16": "float32", "no": "float32"},
                            "flux": {"bf16": "bfloat16", "fp16": "float32", "no": "float32"}}
    assert {sampling_dtype(f, "cpu") for f in FAMILY_LAYOUTS} == {torch.float32}
    # A "cuda" device without bf16 (torch says so of every GPU where it has no CUDA, as here): fp16 for SD, not Flux.
    if not torch.cuda.is_available():
        assert sampling_dtype("sd1", "cuda") == torch.float16 and sampling_dtype("flux", "cuda") == torch.float32
