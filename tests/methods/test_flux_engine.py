"""Flux.1-dev through the engine (issue 33): full fine-tune and LoRA on the tiny Flux, each a short run that
validates (two passes over the same weights bit-identical), is SIGKILLed and resumes exactly; the outputs load in
their consumers; and the settings a guidance-distilled flow model refuses, one line each."""

from __future__ import annotations

import csv
import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import DataConfig, TrainingConfig, ValidationConfig
from rangefinder.errors import ConfigError
from rangefinder.training.loop import TrainSpec, train
from tests.training.test_resume import run_child

SETTINGS = {
    "full": dict(lr=1e-4),
    "lora": dict(lr=1e-2, lora={"rank": 4, "alpha": 8.0}),
}


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("method", ["lora", "full"])
def test_flux_trains_validates_resumes_and_exports(method, split_dir, tiny_flux_dir, tmp_path):
    torch.set_num_threads(1)  # the same reduction order in the straight, the killed and the resumed run
    cfg = TrainingConfig(method=method, batch_size=8, steps=4, seed=3, checkpoint_every_updates=2, keep_checkpoints=2,
                         cache_dir=str(tmp_path / "encoded"), **SETTINGS[method])
    val = ValidationConfig(every_updates=2, timesteps=2)
    spec = TrainSpec(cfg, val, split_dir=split_dir, model=tiny_flux_dir)
    straight = train(spec, out_dir=tmp_path / "straight")
    assert straight.status == "ok" and straight.updates == 4
    curve = _rows(straight.metrics_csv)
    assert [int(r["update"]) for r in curve] == [0, 2, 4] and all(float(r["val_loss"]) > 0 for r in curve)
    assert curve[0]["val_loss"] != curve[-1]["val_loss"]  # it trained
    summary = json.loads(straight.summary_path.read_text())
    assert summary["family"] == "flux"
    # training.use_ema auto keeps no EMA on Flux, LoRA included (config.EMA_AUTO_FAMILIES): the rule failed there.
    assert summary["use_ema_used"] is False
    grid = summary["validation_weighting"]["grid"]
    assert len(grid) == 2 and 0 < grid[0] < grid[1] < 1

    cut = tmp_path / "cut"
    child = dict(split_dir=str(split_dir), model=str(tiny_flux_dir), out_dir=str(cut), kill_at_update=3,
                 training=cfg.model_dump(mode="json"), validation=val.model_dump(mode="json"))
    killed = run_child(child, tmp_path, "killed")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = train(TrainSpec(cfg.model_copy(update={"resume": True}), val, split_dir=split_dir,
                              model=tiny_flux_dir), out_dir=cut)
    assert resumed.resumed_from == 2
    # Validation is a function of the weights: the killed process measured updates 0 and 2 and the resumed one
    # update 4, each with the bits the straight run got.
    assert _rows(resumed.metrics_csv) == curve
    a = load_file(str(straight.checkpoints[-1] / "weights.safetensors"))
    b = load_file(str(resumed.checkpoints[-1] / "weights.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    final = straight.final_dir
    if method == "full":
        from diffusers import FluxPipeline

        from rangefinder.formats.single_file import SINGLE_FILE_NAME

        pipe = FluxPipeline.from_pretrained(str(final), local_files_only=True)
        image = pipe("a red circle", height=32, width=32, num_inference_steps=2, max_sequence_length=64,
                     generator=torch.Generator().manual_seed(0), output_type="np").images[0]
        assert image.shape == (32, 32, 3)
        keys = load_file(str(final / SINGLE_FILE_NAME)).keys()
        assert "double_blocks.0.img_attn.qkv.weight" in keys and "single_blocks.0.linear1.weight" in keys
    else:
        from diffusers import FluxPipeline

        from rangefinder.formats.lora import LORA_KOHYA_NAME, LORA_WEIGHTS_NAME
        from rangefinder.formats.weights_file import read_metadata
        from tests.formats.test_flux_outputs import diffusers_at_width

        kohya = load_file(str(final / LORA_KOHYA_NAME))
        # flux_train_network.py's objective keys, which the file lacked: what the run trained at, in its words.
        meta = read_metadata(final / LORA_KOHYA_NAME)
        assert {k: meta.get(k) for k in ("ss_timestep_sampling", "ss_sigmoid_scale", "ss_guidance_scale",
                                         "ss_model_prediction_type", "ss_weighting_scheme", "ss_model_type")} == {
            "ss_timestep_sampling": "flux_shift", "ss_sigmoid_scale": "1.0", "ss_guidance_scale": "3.5",
            "ss_model_prediction_type": "raw", "ss_weighting_scheme": "none", "ss_model_type": "flux"}
        assert any(k.startswith("lora_unet_double_blocks_0_img_attn_qkv.") for k in kohya)
        assert any(k.startswith("lora_unet_single_blocks_0_linear1.") for k in kohya)  # q, k, v with MLP rows 0
        # The run's adapters (on the default targets) through both files: diffusers merges the same weights.
        fused = []
        for name in (LORA_WEIGHTS_NAME, LORA_KOHYA_NAME):
            pipe = FluxPipeline.from_pretrained(str(tiny_flux_dir), local_files_only=True)
            inner = pipe.transformer.config.num_attention_heads * pipe.transformer.config.attention_head_dim
            with diffusers_at_width(inner):
                pipe.load_lora_weights(str(final / name))
            pipe.fuse_lora()
            pipe.unload_lora_weights()
            fused.append(pipe.transformer.state_dict())
        base = FluxPipeline.from_pretrained(str(tiny_flux_dir), local_files_only=True).transformer.state_dict()
        assert any(not torch.equal(fused[0][k], base[k]) for k in base)
        assert all(torch.allclose(fused[0][k], fused[1][k], atol=1e-6) for k in base)


@pytest.mark.parametrize(("setting", "message"), [
    (dict(min_snr_gamma=5.0), "training.min_snr_gamma: min-SNR weighting is defined through the DDPM"),
    (dict(cond_dropout=0.1), "training.cond_dropout: Flux.1-dev is guidance-distilled"),
    (dict(method="textual_inversion"), "training.method: textual inversion is not supported on Flux"),
])
def test_flux_refuses_what_it_does_not_do_in_one_line(setting, message, split_dir, tiny_flux_dir, tmp_path):
    cfg = TrainingConfig(**{"batch_size": 4, "steps": 1, "cache_dir": str(tmp_path / "enc"), **setting})
    with pytest.raises(ConfigError, match=message) as e:
        train(TrainSpec(cfg, ValidationConfig(), split_dir=split_dir, model=tiny_flux_dir), out_dir=tmp_path / "r")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("targets", [["img_attn.qkv"], ["to_q", "txt_attn.qkv"]])
def test_lora_targets_in_another_layout_are_one_line_naming_the_layers_there_are(targets, tiny_flux_dir):
    """kohya's Flux names (BFL's fused `img_attn.qkv`) are not the diffusers model's: alone they stopped the run in
    peft's traceback, beside a name that matches they were skipped without a word, the text stream untrained."""
    from rangefinder.config import ModelConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.methods import make_method

    sd = load_sd_components(ModelConfig(base_model=str(tiny_flux_dir)))
    method = make_method(TrainingConfig(method="lora", lora={"target_modules": targets}))
    with pytest.raises(ConfigError, match=rf"training.lora.target_modules: '{targets[-1]}' names no layer of the "
                                          r"Flux.1 transformer .*: .*attn.add_q_proj, .*proj_mlp") as e:
        method.setup(sd, torch.float32)
    assert "\n" not in str(e.value)
    assert not any("lora_" in n for n, _ in sd.unet.named_parameters())  # refused before any adapter went on
    make_method(TrainingConfig(method="lora", lora={"target_modules": ["attn.add_q_proj", "proj_mlp"]})).setup(
        sd, torch.float32)  # diffusers' names, whole paths' ends included, are taken


def test_lora_setup_at_the_model_s_own_dtype_casts_nothing_and_says_nothing(tiny_flux_dir, capfd):
    """diffusers warns on every ModelMixin.to(dtype) of the transformer ("should be kept in float32: []. Casting
    directly with `to()` can lead to inconsistent results"): every Flux and SD3 LoRA run at fp32 printed it for a cast
    that changed nothing."""
    from rangefinder.config import ModelConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.methods import make_method

    sd = load_sd_components(ModelConfig(base_model=str(tiny_flux_dir)))
    capfd.readouterr()
    make_method(TrainingConfig(method="lora")).setup(sd, torch.float32)
    assert "kept in float32" not in capfd.readouterr().err
    assert all(p.dtype == torch.float32 for p in sd.unet.parameters())
    half = load_sd_components(ModelConfig(base_model=str(tiny_flux_dir)))
    make_method(TrainingConfig(method="lora")).setup(half, torch.bfloat16)  # a cast there is, still made
    assert {p.dtype for n, p in half.unet.named_parameters() if "lora_" not in n} == {torch.bfloat16}


def test_flux_resolution_must_be_a_multiple_of_the_patch(tiny_flux_dir):
    """Flux packs 2x2 latent patches: a side must be a multiple of the VAE's downscale times 2. The tiny model's is
    8 px, which every DataConfig resolution already is, so the check is shown on Flux.1's VAE depth (x8: 16 px)."""
    from rangefinder.config import ModelConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.encoding import check_resolution
    from rangefinder.training.families import family_for

    sd = load_sd_components(ModelConfig(base_model=str(tiny_flux_dir)))
    family = family_for(sd, TrainingConfig())
    assert family.side_multiple_of(sd.vae.config, sd.unet.config) == 8
    check_resolution(family, sd, DataConfig(resolution=40))
    sd.vae.register_to_config(block_out_channels=[8, 16, 32, 32])  # Flux.1's VAE: 4 levels, downscale 8
    with pytest.raises(ConfigError, match="data.resolution: 40 px is not a multiple of 16 px") as e:
        check_resolution(family, sd, DataConfig(resolution=40))
    assert "\n" not in str(e.value)
