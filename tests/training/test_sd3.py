"""SD3 (flow matching, MMDiT) end to end on the embedded tiny SD3: full and LoRA train and validate on the fixed
sigma grid, resume exactly after a SIGKILL, and save what diffusers' StableDiffusion3Pipeline loads; the settings
that mean nothing for SD3 are one line each."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import DataConfig, TrainingConfig, ValidationConfig
from rangefinder.errors import ConfigError
from rangefinder.training.loop import TrainSpec, train
from tests.training.test_resume import run_child

# 16 train images, batch 4: 4 updates an epoch; validation on the 4 val images at K = 4 sigmas.
SETTINGS = dict(batch_size=4, steps=4, lr=3e-4, seed=3, random_flip=True, cond_dropout=0.2)
VALIDATION = dict(every_updates=2, timesteps=4)
RUNS_CHECKPOINT = dict(checkpoint_every_updates=4)  # the `runs` fixture's: one checkpoint, at the end


@pytest.fixture(scope="module")
def runs(split_dir, tiny_sd3_dir, tmp_path_factory) -> dict:
    """One full and one LoRA run of 4 updates each on the tiny SD3, with a checkpoint at the end."""
    cache = str(tmp_path_factory.mktemp("encoded"))
    out = {}
    for method in ("full", "lora"):
        folder = tmp_path_factory.mktemp(method)
        out[method] = train(TrainSpec(TrainingConfig(method=method, cache_dir=cache, **SETTINGS, **RUNS_CHECKPOINT),
                                      ValidationConfig(**VALIDATION), split_dir=split_dir, model=tiny_sd3_dir),
                            out_dir=folder)
    return out


def rows(path) -> list[dict]:
    import csv

    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("method", ["full", "lora"])
def test_sd3_trains_and_validates_on_a_fixed_sigma_grid(runs, method):
    result = runs[method]
    assert result.status == "ok" and result.family == "sd3" and result.updates == 4
    table = rows(result.metrics_csv)
    assert [r["update"] for r in table] == ["0", "2", "4"]
    summary = json.loads(result.summary_path.read_text())
    assert summary["family"] == "sd3" and summary["prediction_type"] == "flow"
    weighting = summary["validation_weighting"]
    grid = weighting["grid"]
    assert len(grid) == 4 and grid == sorted(grid) and 0 < grid[0] < grid[-1] < 1
    assert "plain mean of the 4 per-sigma losses" in weighting["statement"]
    # val_loss is the plain mean of the per-sigma columns
    last = table[-1]
    per_sigma = [float(last[f"val_loss_b{k}"]) for k in range(4)]
    assert float(last["val_loss"]) == pytest.approx(sum(per_sigma) / 4, rel=1e-12)
    assert float(last["val_loss"]) != float(table[0]["val_loss"])  # the weights moved


def test_two_validation_passes_over_the_same_weights_are_bit_identical(runs):
    """Update 0 of both runs measures the same base weights (LoRA's adapters start as a no-op), in two runs."""
    full, lora = (rows(runs[m].metrics_csv)[0] for m in ("full", "lora"))
    cols = ["val_loss"] + [f"val_loss_b{k}" for k in range(4)]
    assert [full[c] for c in cols] == [lora[c] for c in cols]


def test_the_full_folder_renders_in_diffusers_and_the_lora_loads_every_key(runs, tiny_sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(runs["full"].final_dir), local_files_only=True)
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, max_sequence_length=77,
                 generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    assert image.shape == (32, 32, 3) and image.std() > 0
    trained = load_file(str(runs["full"].final_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    base = load_file(str(tiny_sd3_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert trained.keys() == base.keys() and any(not torch.equal(trained[k], base[k]) for k in base)

    lora_file = runs["lora"].final_dir / "pytorch_lora_weights.safetensors"
    tensors = load_file(str(lora_file))
    assert tensors and all(k.startswith("transformer.") for k in tensors)
    base_pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_dir), local_files_only=True)
    base_pipe.load_lora_weights(str(lora_file))
    from peft.tuners.lora import LoraLayer

    loaded = {n for n, m in base_pipe.transformer.named_modules() if isinstance(m, LoraLayer)}
    # every (A, B) pair of the file became one adapter: 0 keys left over
    assert {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in tensors} == loaded


def test_the_full_single_file_is_sd3s_layout_and_loads_bit_for_bit_in_diffusers(runs, tmp_path):
    """final/model.safetensors: Stability's SD3 layout (MMDiT under model.diffusion_model. with fused qkv, VAE under
    first_stage_model., text_encoders.clip_l/clip_g/t5xxl), read back by diffusers' from_single_file into exactly
    the folder's weights, and detected as sd3 by its keys."""
    assert_single_file_is_sd3s_layout_and_loads_as_its_folder(runs["full"].final_dir)


def test_the_kohya_lora_has_sd_scripts_sd3_names_and_comfyui_maps_every_key(runs, tiny_sd3_dir):
    """lora_kohya.safetensors: kohya's SD3 names (sd-scripts networks/lora_sd3.py: `lora_unet_` + its MMDiT's module
    path, q/k/v fused into `attn.qkv`). ComfyUI's key map (comfy/lora.py `model_lora_keys_unet` at 41444b5236c6)
    maps every `diffusion_model.<key>.weight` of the model as `lora_unet_<key with _ for .>`: each module of the file
    is one of those (0 left over), and its up @ down x alpha / rank is exactly the change that diffusers'
    load_lora_weights + fuse_lora makes to that weight from the diffusers-named file (q, k, v stacked)."""
    modules = assert_kohya_lora_is_comfy_named_and_equals_diffusers(runs["lora"].final_dir, tiny_sd3_dir)
    assert any(m.endswith("_attn_qkv") for m in modules)


def test_the_kohya_loras_metadata_is_sd_scripts_sd3_keys_with_the_run_s_updates(runs):
    """The sd-scripts keys LoRA browsers show, as on every other family: network module, base model version, dim
    and alpha as trained, and the updates as `ss_steps` (the SD3 file once had no `ss_steps`)."""
    from rangefinder.formats.weights_file import read_metadata

    result = runs["lora"]
    meta = read_metadata(result.final_dir / "lora_kohya.safetensors")
    lora = TrainingConfig().lora
    assert meta["ss_network_module"] == "networks.lora_sd3" and meta["ss_base_model_version"] == "5-large"
    assert meta["ss_network_dim"] == str(lora.rank) and float(meta["ss_network_alpha"]) == lora.alpha
    assert meta["ss_steps"] == meta["rangefinder.updates"] == str(result.updates) == "4"
    assert meta["rangefinder.family"] == "sd3" and meta["rangefinder.method"] == "lora"
    # And sd3_train_network.py's objective keys, which it lacked: the run's logit-normal density, no masks.
    assert {k: v for k, v in meta.items() if k.startswith(("ss_apply", "ss_weighting", "ss_logit"))} == {
        "ss_apply_lg_attn_mask": "False", "ss_apply_t5_attn_mask": "False", "ss_weighting_scheme": "logit_normal",
        "ss_logit_mean": "0.0", "ss_logit_std": "1.0"}


def assert_single_file_is_sd3s_layout_and_loads_as_its_folder(final) -> list[str]:
    """final/model.safetensors detected as sd3 and read back by from_single_file into the folder's weights; its
    keys."""
    from diffusers import StableDiffusion3Pipeline
    from safetensors import safe_open

    from rangefinder.training.family_detection import single_file_family

    path = final / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        assert f.metadata()["rangefinder.family"] == "sd3"
    assert single_file_family(path, keys) == "sd3"
    assert "model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight" in keys
    assert {k.split(".")[1] for k in keys if k.startswith("text_encoders.")} == {"clip_l", "clip_g", "t5xxl"}
    folder = StableDiffusion3Pipeline.from_pretrained(str(final), local_files_only=True)
    single = StableDiffusion3Pipeline.from_single_file(str(path), config=str(final), local_files_only=True)
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        a, b = getattr(folder, part).state_dict(), getattr(single, part).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    return keys


def assert_kohya_lora_is_comfy_named_and_equals_diffusers(final, base_dir) -> set[str]:
    """The kohya file's modules are ComfyUI's `lora_unet_` names of the base model's MMDiT weights and each makes the
    change diffusers makes from the diffusers-named file (see the test above); its module names."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from rangefinder.formats.single_file_sd3 import mmdit_module_name, mmdit_state_dict

    kohya = load_file(str(final / "lora_kohya.safetensors"))
    modules = {k.rsplit(".", 2)[0] if ".lora_" in k else k.rsplit(".", 1)[0] for k in kohya}
    base = StableDiffusion3Pipeline.from_pretrained(str(base_dir), local_files_only=True)
    before = {k: v.clone() for k, v in mmdit_state_dict(base.transformer).items()}  # fuse_lora writes in place
    comfy_map = {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): k for k in before if k.endswith(".weight")}
    assert modules and modules <= comfy_map.keys(), sorted(modules - comfy_map.keys())[:3]
    # The diffusers-named file: ComfyUI maps `transformer.<diffusers module>` through comfy/utils.py
    # `mmdit_to_diffusers` (at 41444b5236c6: to_q/k/v and add_q/k/v_proj as thirds of the qkv rows, the rest by
    # its MMDIT_MAP_BLOCK/BASIC tables), the correspondence mmdit_module_name states; every module has a place.
    diffusers_named = load_file(str(final / "pytorch_lora_weights.safetensors"))
    targets = {mmdit_module_name(k.removeprefix("transformer.").rsplit(".lora_", 1)[0]) for k in diffusers_named}
    assert {"lora_unet_" + name.replace(".", "_") for name, _ in targets} == modules
    base.load_lora_weights(str(final / "pytorch_lora_weights.safetensors"))
    base.fuse_lora()
    # the fused weights, as a plain transformer (peft keeps them under `.base_layer`)
    fused = {k.replace(".base_layer", ""): v for k, v in base.transformer.state_dict().items() if ".lora_" not in k}
    plain = SD3Transformer2DModel.from_config(base.transformer.config)
    plain.load_state_dict(fused, strict=True)
    after = mmdit_state_dict(plain)
    for m in modules:
        down, up, alpha = kohya[f"{m}.lora_down.weight"], kohya[f"{m}.lora_up.weight"], kohya[f"{m}.alpha"]
        delta = up @ down * (float(alpha) / down.shape[0])
        key = comfy_map[m]
        torch.testing.assert_close(after[key] - before[key], delta, rtol=1e-4, atol=1e-6)
    return modules


# ---------------------------------------------------------------------------------------------------------------
# SD3.5 Medium: MMDiT-X, whose first blocks have a second self-attention on the image stream (diffusers' `attn2`,
# `dual_attention_layers`). Both exports once ended its runs, after the last update, in a ValueError and no final/.


@pytest.fixture(scope="module")
def medium_dir(tiny_sd3_dir, tmp_path_factory):
    """The tiny SD3 made as SD3.5 Medium is: block 0 dual-attention; the weights it shares with the tiny SD3 kept,
    the new ones (attn2, block 0's 9-chunk adaLN) seeded."""
    import shutil

    from diffusers import SD3Transformer2DModel

    out = tmp_path_factory.mktemp("sd35m") / "model"
    shutil.copytree(tiny_sd3_dir, out)
    base = SD3Transformer2DModel.from_pretrained(str(tiny_sd3_dir / "transformer"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        medium = SD3Transformer2DModel.from_config({**base.config, "dual_attention_layers": (0,)})
    own = medium.state_dict()
    medium.load_state_dict({k: v for k, v in base.state_dict().items() if own[k].shape == v.shape}, strict=False)
    medium.save_pretrained(str(out / "transformer"))
    return out


@pytest.fixture(scope="module")
def medium_runs(split_dir, medium_dir, tmp_path_factory) -> dict:
    cache = str(tmp_path_factory.mktemp("encoded-sd35m"))
    settings = {**SETTINGS, "steps": 2}
    return {method: train(TrainSpec(TrainingConfig(method=method, cache_dir=cache, **settings),
                                    ValidationConfig(**VALIDATION), split_dir=split_dir, model=medium_dir),
                          out_dir=tmp_path_factory.mktemp(f"sd35m-{method}"))
            for method in ("full", "lora")}


def test_sd35_medium_full_single_file_holds_attn2_and_loads_bit_for_bit(medium_runs):
    """attn2 in the original MMDiT-X names (sd3.5_medium.safetensors' and ComfyUI's; diffusers' from_single_file
    reads them back, `get_attn2_layers`): `x_block.attn2.qkv` (q, k, v stacked), `proj`, `ln_q`, `ln_k`."""
    result = medium_runs["full"]
    assert result.status == "ok" and result.updates == 2
    keys = assert_single_file_is_sd3s_layout_and_loads_as_its_folder(result.final_dir)
    attn2 = {k for k in keys if ".attn2." in k}
    assert attn2 == {f"model.diffusion_model.joint_blocks.0.x_block.attn2.{m}" for m in
                     ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias", "ln_q.weight", "ln_k.weight")}


def test_sd35_medium_lora_on_attn2_is_kohyas_attn2_qkv_and_loads_in_diffusers(medium_runs, medium_dir):
    """The default targets (to_q, to_k, to_v, to_out.0) adapt attn2 too: kohya's file fuses them into
    `x_block_attn2_qkv` (and `attn2_proj`), ComfyUI maps every module, and diffusers loads the diffusers-named file
    with every key used, the same change."""
    from diffusers import StableDiffusion3Pipeline
    from peft.tuners.lora import LoraLayer

    result = medium_runs["lora"]
    assert result.status == "ok"
    modules = assert_kohya_lora_is_comfy_named_and_equals_diffusers(result.final_dir, medium_dir)
    assert {"lora_unet_joint_blocks_0_x_block_attn2_qkv", "lora_unet_joint_blocks_0_x_block_attn2_proj"} <= modules
    from rangefinder.formats.weights_file import read_metadata

    meta = read_metadata(result.final_dir / "lora_kohya.safetensors")  # sd-scripts' name for SD3.5 Medium
    assert (meta["ss_base_model_version"], meta["modelspec.architecture"]) == (
        "5-medium", "stable-diffusion-3-5-medium/lora")
    tensors = load_file(str(result.final_dir / "pytorch_lora_weights.safetensors"))
    pipe = StableDiffusion3Pipeline.from_pretrained(str(medium_dir), local_files_only=True)
    pipe.load_lora_weights(str(result.final_dir / "pytorch_lora_weights.safetensors"))
    loaded = {n for n, m in pipe.transformer.named_modules() if isinstance(m, LoraLayer)}
    assert {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in tensors} == loaded
    assert "transformer_blocks.0.attn2.to_q" in loaded


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_sd3_resumes_after_sigkill_exactly_as_uninterrupted(method, split_dir, tiny_sd3_dir, tmp_path):
    training = dict(method=method, batch_size=4, epochs=2, lr=3e-4, seed=5, checkpoint_every_updates=2,
                    random_flip=True, cond_dropout=0.2, cache_dir=str(tmp_path / "cache"))
    validation = dict(every_updates=2, timesteps=3)
    whole = tmp_path / "whole"
    train(TrainSpec(TrainingConfig(**training), ValidationConfig(**validation), split_dir=split_dir,
                    model=tiny_sd3_dir), out_dir=whole)
    cut = tmp_path / "cut"
    settings = dict(split_dir=str(split_dir), model=str(tiny_sd3_dir), training=training, validation=validation,
                    out_dir=str(cut), kill_at_update=5)
    killed = run_child(settings, tmp_path, "killed")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = train(TrainSpec(TrainingConfig(**{**training, "resume": True}), ValidationConfig(**validation),
                              split_dir=split_dir, model=tiny_sd3_dir), out_dir=cut)
    assert resumed.resumed_from == 4 and resumed.updates == 8
    for name in ("metrics.csv", "updates.csv"):
        assert (cut / name).read_text() == (whole / name).read_text(), name
    weights = ("pytorch_lora_weights.safetensors" if method == "lora" else
               "transformer/diffusion_pytorch_model.safetensors")
    a = load_file(str(whole / "final" / weights))
    b = load_file(str(cut / "final" / weights))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_on_the_base_model_with_its_scheduler_shifting_otherwise_is_refused(runs, split_dir, tiny_sd3_dir,
                                                                                   tmp_path):
    """The same weights, the scheduler config's shift edited (3.0 to 1.0) mid-run: the weights' digest matched and
    training.flow.shift, unset, was unchanged, so the run went on drawing its sigmas at another shift than its first
    updates, and validating on another sigma grid, without a word."""
    import shutil

    model = Path(shutil.copytree(tiny_sd3_dir, tmp_path / "model"))
    config = model / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "shift": 1.0}))
    out = Path(shutil.copytree(runs["lora"].out_dir, tmp_path / "run"))
    spec = TrainSpec(TrainingConfig(method="lora", cache_dir=str(tmp_path / "cache"), resume=True, **SETTINGS,
                                    **RUNS_CHECKPOINT),
                     ValidationConfig(**VALIDATION), split_dir=split_dir, model=model)
    with pytest.raises(ConfigError, match=r"cannot resume: .*the shift of the sigmas it trains at \(3\.0 -> 1\.0: "
                                          r"the base model's scheduler config"):
        train(spec, out_dir=out)


def test_a_resume_with_training_flow_shift_changed_by_hand_names_it_once(runs, split_dir, tiny_sd3_dir, tmp_path):
    """training.flow.shift set by hand on a run that trained at the scheduler's shift: the refusal named the one
    change twice, as the shift of the sigmas (blaming the scheduler config or the setting) and as the setting."""
    out = Path(shutil.copytree(runs["lora"].out_dir, tmp_path / "run"))
    spec = TrainSpec(TrainingConfig(method="lora", cache_dir=str(tmp_path / "cache"), resume=True, flow={"shift": 1.0},
                                    **SETTINGS, **RUNS_CHECKPOINT),
                     ValidationConfig(**VALIDATION), split_dir=split_dir, model=tiny_sd3_dir)
    with pytest.raises(ConfigError, match=r"different settings or data \(the shift of the sigmas it trains at \(3\.0 "
                                          r"-> 1\.0: training\.flow\.shift null -> 1\.0\)\); resume with"):
        train(spec, out_dir=out)


@pytest.mark.parametrize("setting, words", [
    (dict(min_snr_gamma=5.0), r"^training.min_snr_gamma: min-SNR weighting is defined through the DDPM noise "
                              r"schedule; Stable Diffusion 3/3.5 is a flow-matching model"),
    (dict(method="textual_inversion"), r"^training.method: textual inversion is not supported on Stable Diffusion "
                                        r"3/3.5 models"),
    (dict(flow={"guidance": 3.5}), r"^training.flow.guidance: SD3 has no guidance embedding"),
])
def test_settings_that_mean_nothing_for_sd3_are_one_line(split_dir, tiny_sd3_dir, tmp_path, setting, words):
    cfg = TrainingConfig(batch_size=4, steps=1, cache_dir=str(tmp_path / "cache"), **setting)
    with pytest.raises(ConfigError, match=words) as e:
        train(TrainSpec(cfg, ValidationConfig(every_epochs=0), split_dir=split_dir, model=tiny_sd3_dir),
              out_dir=tmp_path / "run")
    assert "\n" not in str(e.value)


def test_a_resolution_off_the_patch_grid_is_one_line(tiny_sd3_dir):
    """SD3 cuts latents into 2 x 2 patches: with the tiny VAE's x4, sides must be multiples of 8 px (16 px for the
    real SD3, whose VAE downsamples by 8; shown here with the transformer's patch set to 4: 16 px)."""
    from rangefinder.config import ModelConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.encoding import check_resolution
    from rangefinder.training.families import family_for

    sd = load_sd_components(ModelConfig(base_model=str(tiny_sd3_dir)))
    family = family_for(sd, TrainingConfig())
    assert family.side_multiple_of(sd.vae.config, sd.unet.config) == 8
    check_resolution(family, sd, DataConfig(resolution=32))
    sd.unet.register_to_config(patch_size=4)
    with pytest.raises(ConfigError, match=r"^data.resolution: 40 px is not a multiple of 16 px, Stable Diffusion "
                                          r"3/3\.5's patch size in pixels .* set data.resolution to 32$"):
        check_resolution(family, sd, DataConfig(resolution=40))


def test_resuming_an_sd1_run_on_an_sd3_base_is_refused(split_dir, tiny_model_dir, tiny_sd3_dir, tmp_path):
    cfg = TrainingConfig(batch_size=8, steps=1, checkpoint_every_updates=1, cache_dir=str(tmp_path / "cache"))
    off = ValidationConfig(every_epochs=0)
    out = tmp_path / "run"
    train(TrainSpec(cfg, off, split_dir=split_dir, model=tiny_model_dir), out_dir=out, save_final=False)
    with pytest.raises(ConfigError, match=r"cannot resume: .* Stable Diffusion 1\.x/2\.x run but the base model "
                                          r".* is Stable Diffusion 3/3\.5"):
        train(TrainSpec(cfg.model_copy(update={"resume": True}), off, split_dir=split_dir, model=tiny_sd3_dir),
              out_dir=out)
