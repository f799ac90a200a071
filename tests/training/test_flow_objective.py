"""The rectified-flow objective behind the family seam (training/family_flow.py): noising and target, the training
sigma densities and their validation grid, the weightings, and the DDPM settings a flow model refuses."""

from __future__ import annotations

import math

import pytest
import torch

from rangefinder.config import FlowSettings, TrainingConfig
from rangefinder.errors import ConfigError
from rangefinder.training.family_flow import FlowFamily
from rangefinder.training.family_rules import refuse_ddpm_settings


def family(shift: float = 3.0, **flow) -> FlowFamily:
    return FlowFamily(FlowSettings(**flow), shift)


def test_noising_is_the_straight_line_and_the_target_its_velocity():
    x0 = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.0, 0.25, 1.0])
    f = family()
    xt = f.noised(x0, noise, sigma)
    assert torch.equal(xt[0], x0[0]) and torch.equal(xt[2], noise[2])
    assert torch.allclose(xt[1], 0.75 * x0[1] + 0.25 * noise[1])
    # d x_t / d sigma = noise - x0: the velocity the model is trained on
    assert torch.equal(f.target(x0, noise, sigma), noise - x0)


@pytest.mark.parametrize("sampling", [dict(timestep_sampling="uniform"), dict(timestep_sampling="logit_normal"),
                                      dict(timestep_sampling="logit_normal", logit_mean=0.5, logit_std=0.8),
                                      dict(timestep_sampling="mode")],
                         ids=["uniform", "logit_normal", "logit_normal-0.5-0.8", "mode"])
def test_the_validation_grid_splits_what_training_draws_into_equal_parts(sampling):
    """Each grid sigma is the middle of an equal-probability part of the (shifted) training density: of 200k
    training draws, the share below grid point k is (k + 1/2) / K."""
    f = family(shift=3.0, **sampling)
    K = 4
    grid = f.validation_sigmas(K, (8, 8))
    assert grid == sorted(grid) and all(0 < s < 1 for s in grid)
    draws = f.sample_timesteps(200_000, torch.Generator().manual_seed(0), (8, 8))
    for k, s in enumerate(grid):
        assert float((draws < s).double().mean()) == pytest.approx((k + 0.5) / K, abs=0.005)
    # the fixed timestep draws nothing: the item's noise stays the generator's first draw
    g = torch.Generator().manual_seed(7)
    assert f.fixed_timestep(2, K, g, (8, 8)) == grid[2]
    assert torch.equal(torch.randn(3, generator=g), torch.randn(3, generator=torch.Generator().manual_seed(7)))
    assert list(f.validation_weighting(K, (8, 8)).grid or ()) == grid


def test_the_shift_moves_sigma_towards_noise():
    plain, shifted = family(shift=1.0).validation_sigmas(4, (8, 8)), family(shift=3.0).validation_sigmas(4, (8, 8))
    assert all(b > a for a, b in zip(plain, shifted, strict=True))
    assert shifted[0] == pytest.approx(3 * plain[0] / (1 + 2 * plain[0]), rel=1e-6)


def test_the_shift_is_the_base_model_scheduler_s_unless_training_flow_shift_sets_one(tiny_sd3_dir):
    from types import SimpleNamespace

    from diffusers import FlowMatchEulerDiscreteScheduler

    from rangefinder.training.family_flow import flow_shift

    sd = SimpleNamespace(noise_scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(str(tiny_sd3_dir),
                                                                                         subfolder="scheduler"))
    assert flow_shift(sd, FlowSettings()) == sd.noise_scheduler.config.shift == 3.0  # SD3's
    assert flow_shift(sd, FlowSettings(shift=2.0)) == 2.0


def test_the_weightings():
    sigma = torch.tensor([0.1, 0.5, 0.9])
    assert torch.equal(family().loss_weights(sigma), torch.ones(3))
    assert torch.allclose(family(loss_weighting="sigma_sqrt").loss_weights(sigma), sigma ** -2)
    cosmap = family(loss_weighting="cosmap").loss_weights(sigma)
    assert torch.allclose(cosmap, 2 / (math.pi * (1 - 2 * sigma + 2 * sigma ** 2)))


@pytest.mark.parametrize("setting, words", [
    (dict(min_snr_gamma=5.0), "training.min_snr_gamma: min-SNR weighting is defined through the DDPM"),
    (dict(prediction_type="v_prediction"), "training.prediction_type: Stable Diffusion 3/3.5 is a flow-matching model"),
    (dict(noise_offset=0.05), "training.noise_offset: the offset noise is DDPM's"),
])
def test_ddpm_settings_are_refused_on_a_flow_model_in_one_line(setting, words):
    with pytest.raises(ConfigError, match=words) as e:
        refuse_ddpm_settings(TrainingConfig(**setting), "sd3")
    assert "\n" not in str(e.value)
    refuse_ddpm_settings(TrainingConfig(), "sd3")  # the defaults are fine


def test_flow_settings_on_a_ddpm_model_are_refused(tiny_model_dir):
    from rangefinder.config import ModelConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.families import family_for

    sd = load_sd_components(ModelConfig(base_model=str(tiny_model_dir)))
    with pytest.raises(ConfigError, match=r"training.flow \(loss_weighting\): the base model is a DDPM model"):
        family_for(sd, TrainingConfig(flow=FlowSettings(loss_weighting="cosmap")))
    assert family_for(sd, TrainingConfig()).name == "sd1"


def test_a_training_guidance_for_a_flux_model_without_the_guidance_embedding_is_refused():
    from rangefinder.training.family_rules import FluxRules

    cfg = TrainingConfig(flow=FlowSettings(guidance=3.5))
    FluxRules.check_settings(cfg, {}, {"guidance_embeds": True})  # Flux.1-dev
    for schnell in ({"guidance_embeds": False}, {}):
        with pytest.raises(ConfigError, match=r"^training.flow.guidance: this Flux model has no guidance embedding"):
            FluxRules.check_settings(cfg, {}, schnell)


def test_the_kohya_lora_s_sd_scripts_objective_keys_are_those_that_draw_as_this_run_drew():
    """sd-scripts' flux_train_network.py and sd3_train_network.py write their objective's settings as `ss_*` keys
    (update_metadata), and the kohya LoRA had none. A setting says sd-scripts' value only where that value trains as
    the run did: Flux's logit-normal of mean 0 under FLUX.1's resolution-dependent shift is sd-scripts' `flux_shift`,
    under a constant shift its `shift`; a density no sd-scripts sampling draws (mode under a shift) writes none, as
    SD3's logit-normal with cosmap, which diffusers' one weighting_scheme cannot name, writes no scheme."""
    from rangefinder.training.family_rules import FluxRules, Sd1Rules, Sd3Rules

    flux_scheduler = {"use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 4096,
                      "base_shift": 0.5, "max_shift": 1.15, "shift": 3.0}
    dev, schnell = {"guidance_embeds": True}, {"guidance_embeds": False}
    assert FluxRules.kohya_training_metadata(FlowSettings(), flux_scheduler, dev) == {
        "ss_model_type": "flux", "ss_apply_t5_attn_mask": "False", "ss_model_prediction_type": "raw",
        "ss_guidance_scale": "3.5", "ss_timestep_sampling": "flux_shift", "ss_sigmoid_scale": "1.0",
        "ss_weighting_scheme": "none"}
    shifted = FluxRules.kohya_training_metadata(
        FlowSettings(shift=2.0, logit_std=0.8, loss_weighting="cosmap", guidance=4.0), flux_scheduler, dev)
    assert {k: shifted.get(k) for k in ("ss_timestep_sampling", "ss_sigmoid_scale", "ss_discrete_flow_shift",
                                        "ss_weighting_scheme", "ss_guidance_scale")} == {
        "ss_timestep_sampling": "shift", "ss_sigmoid_scale": "0.8", "ss_discrete_flow_shift": "2.0",
        "ss_weighting_scheme": None, "ss_guidance_scale": "4.0"}
    # sd-scripts weights a Flux loss only under `sigma_scaled` (flux_train_utils.py apply_model_prediction_type):
    # `raw` beside `cosmap` said the run trained unweighted, as sd-scripts' run of those keys does. No key says it.
    for weighted in ("cosmap", "sigma_sqrt"):
        meta = FluxRules.kohya_training_metadata(FlowSettings(loss_weighting=weighted), flux_scheduler, dev)
        assert meta["ss_model_prediction_type"] == "raw" and "ss_weighting_scheme" not in meta, meta
    unshifted = FluxRules.kohya_training_metadata(FlowSettings(timestep_sampling="uniform"),
                                                  {**flux_scheduler, "use_dynamic_shifting": False, "shift": 1.0},
                                                  schnell)
    assert unshifted["ss_timestep_sampling"] == "uniform" and "ss_guidance_scale" not in unshifted
    # flux_train_network.py writes `--model_type` (flux for dev and schnell alike; chroma is Chroma): it was missing.
    assert unshifted["ss_model_type"] == "flux"
    for drawn_otherwise in (FlowSettings(timestep_sampling="mode"), FlowSettings(logit_mean=0.5)):
        meta = FluxRules.kohya_training_metadata(drawn_otherwise, flux_scheduler, dev)
        assert not {"ss_timestep_sampling", "ss_weighting_scheme", "ss_sigmoid_scale"} & set(meta), meta
    sd3_scheduler = {"shift": 3.0}
    assert Sd3Rules.kohya_training_metadata(FlowSettings(), sd3_scheduler, {}) == {
        "ss_apply_lg_attn_mask": "False", "ss_apply_t5_attn_mask": "False", "ss_weighting_scheme": "logit_normal",
        "ss_logit_mean": "0.0", "ss_logit_std": "1.0"}
    assert Sd3Rules.kohya_training_metadata(FlowSettings(timestep_sampling="mode", mode_scale=1.0), sd3_scheduler,
                                            {})["ss_mode_scale"] == "1.0"
    assert "ss_weighting_scheme" not in Sd3Rules.kohya_training_metadata(FlowSettings(loss_weighting="cosmap"),
                                                                         sd3_scheduler, {})
    assert Sd1Rules.kohya_training_metadata(FlowSettings(), {}, {}) == {}


def test_a_per_sigma_column_over_image_sizes_says_the_span_of_sigmas_it_mixes():
    """Flux's dynamic shift gives each image size its own validation grid: over aspect buckets a val_loss_b{k} column
    mixes their sigmas, and the run's summary (whose grid labels the reports' per-sigma rows) named the first size's
    alone. Sizes of as many image tokens (24x40 and 40x24) share one grid, as SD3's constant shift gives every size."""
    from rangefinder.training.family_flux import FluxFamily
    from rangefinder.training.loop import validation_weighting_over

    flux = FluxFamily(FlowSettings(), 3.0, dynamic_shift={"base_image_seq_len": 256, "max_image_seq_len": 4096,
                                                          "base_shift": 0.5, "max_shift": 1.15})
    square = validation_weighting_over(flux, 2, [(64, 64)])
    assert "grid_span" not in square
    mixed = validation_weighting_over(flux, 2, [(64, 64), (64, 64), (96, 64)])
    tall = flux.validation_sigmas(2, (96, 64))
    assert mixed["grid"] == square["grid"] != tall
    assert mixed["grid_span"] == [[min(a, b), max(a, b)] for a, b in zip(square["grid"], tall, strict=True)]
    assert "grid_span" not in validation_weighting_over(flux, 2, [(48, 80), (80, 48)])
    assert "grid_span" not in validation_weighting_over(family(), 2, [(64, 64), (96, 64)])
