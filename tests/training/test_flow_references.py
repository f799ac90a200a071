"""The flow families (training/family_sd3.py, family_flux.py) read against diffusers' own pipelines and functions on
the tiny SD3 and Flux: what the transformer is given in training is what the family's pipeline gives it when samples
are rendered, and the validation grid's shift is the scheduler's. The UNet families (SD 1.x, SDXL) against their
pipelines' encode_prompt: the prompt embeddings training conditions on are those samples are rendered with."""

from __future__ import annotations

import pytest
import torch

from rangefinder.config import ModelConfig, TrainingConfig

FLOW_DIRS = {"sd3": "tiny_sd3_dir", "flux": "tiny_flux_dir"}


def loaded(family: str, request: pytest.FixtureRequest):
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.families import family_for

    sd = load_sd_components(ModelConfig(base_model=str(request.getfixturevalue(FLOW_DIRS[family]))))
    if family == "sd3":
        # The tiny model's two CLIP tokenizers are one; SD3's bigG tokenizer pads with "!", as SDXL's does, so its
        # ids differ from CLIP-L's and each encoder must be given its own.
        sd.tokenizer_2.pad_token = "!"
    return sd, family_for(sd, TrainingConfig())


@pytest.mark.parametrize("family", FLOW_DIRS)
def test_samples_call_the_transformer_as_training_does(family, request):
    """One Euler step of the family's sampling pipeline, called as samples during training and the grid call it
    (sampling_scheduler, pipeline_call_kwargs), from pure noise at sigma 1 lands at noise - v, where v is what
    training's `predict` gives for that noise at sigma 1 with the caption's cached conditioning: the same text
    encoders, pooled vectors and T5 length (SD3 trains on 77 T5 tokens, StableDiffusion3Pipeline's default is 256),
    timestep scale, Flux's packing, position ids (a non-square size, as an aspect-ratio bucket) and guidance input.
    SD3 at guidance_scale 1 has no classifier-free branch, so the step is the conditional velocity's."""
    from rangefinder.models.loading import pipeline_call_kwargs
    from rangefinder.training.family_flux import unpack_latents
    from rangefinder.training.samples import sampling_scheduler

    sd, fam = loaded(family, request)
    prompt = "a red circle on a blue background"
    with torch.no_grad():
        cond = fam.encode_prompt([getattr(sd, n) for n in fam.text_encoder_names()], fam.tokenize([prompt]))
    pipe = fam.sampling_pipeline(sd, sampling_scheduler(sd))
    pipe.set_progress_bar_config(disable=True)
    height, width = 32, 48
    down = 2 ** (len(sd.vae.config.block_out_channels) - 1)
    channels = int(sd.vae.config.latent_channels)
    noise = torch.randn(1, channels, height // down, width // down, generator=torch.Generator().manual_seed(1))
    latents = noise if family == "sd3" else pipe._pack_latents(noise, 1, channels, height // down, width // down)
    guidance = 1.0 if family == "sd3" else fam.guidance
    with torch.no_grad():
        stepped = pipe(prompt=prompt, num_inference_steps=1, guidance_scale=guidance, height=height, width=width,
                       latents=latents, output_type="latent", **pipeline_call_kwargs(pipe)).images
        velocity = fam.predict(sd.unet, torch.zeros_like(noise), noise, torch.ones(1), cond)
    if family == "flux":
        stepped = unpack_latents(stepped, channels, height // down, width // down)
    assert float(velocity.abs().mean()) > 0.1  # a velocity, not a no-op
    torch.testing.assert_close(stepped, noise - velocity, rtol=1e-5, atol=1e-5)


def test_the_flux_validation_grid_is_the_schedulers_shift_and_says_so(request):
    """With the scheduler's dynamic shifting (Flux.1-dev's config, and the tiny Flux's), each size's validation grid
    is diffusers' own: FlowMatchEulerDiscreteScheduler.time_shift at calculate_shift's mu for the packed image's
    token count (the mu FluxPipeline samples with); the run's statement of the grid names that shift and its mu, not
    the config's constant `shift` (3.0), which dynamic shifting does not apply."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from rangefinder.training.family_flow import FlowFamily

    sd, fam = loaded("flux", request)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(sd.noise_scheduler.config)
    c = scheduler.config
    assert c.use_dynamic_shifting and c.shift == 3.0
    unshifted = FlowFamily(fam.flow, 1.0).validation_sigmas(4, (4, 6))
    for latent_hw in [(4, 6), (64, 64), (96, 128)]:  # a tiny bucket, Flux at 1024 px and at 1536x2048 px
        mu = calculate_shift((latent_hw[0] // 2) * (latent_hw[1] // 2), c.base_image_seq_len, c.max_image_seq_len,
                             c.base_shift, c.max_shift)
        expected = scheduler.time_shift(mu, 1.0, torch.tensor(unshifted, dtype=torch.float64)).float()
        assert fam.validation_sigmas(4, latent_hw) == pytest.approx(expected.tolist(), rel=1e-6)
        statement = fam.validation_weighting(4, latent_hw).statement
        assert "shift 3" not in statement and f"mu {mu:.4g}" in statement


def test_flux_trains_at_the_guidance_and_the_constant_shift_training_flow_sets(request):
    """training.flow.guidance is the guidance input (3.5 unset: diffusers' and sd-scripts' default);
    training.flow.shift replaces the scheduler's resolution-dependent shift with that constant one at every size."""
    from rangefinder.config import FlowSettings
    from rangefinder.training.families import family_for
    from rangefinder.training.family_flow import FlowFamily

    sd, fam = loaded("flux", request)
    assert fam.guidance == 3.5
    assert family_for(sd, TrainingConfig(flow=FlowSettings(guidance=5.0))).guidance == 5.0
    fixed = family_for(sd, TrainingConfig(flow=FlowSettings(shift=2.0)))
    for latent_hw in [(4, 6), (64, 64)]:
        assert fixed.validation_sigmas(4, latent_hw) == FlowFamily(fixed.flow, 2.0).validation_sigmas(4, latent_hw)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_the_unet_families_train_on_the_prompt_embeddings_their_pipelines_sample_with(family, request):
    """What a UNet family's training conditions on (family.encode_prompt of family.tokenize, what the text cache
    holds) is what its diffusers pipeline's encode_prompt gives the UNet when samples are rendered: SD 1.x the last
    hidden state of 77 tokens, SDXL both encoders' penultimate hidden states side by side and the second's pooled
    text embedding."""
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.families import family_for
    from rangefinder.training.samples import sampling_scheduler

    fixture = {"sd1": "tiny_model_dir", "sdxl": "tiny_sdxl_dir"}[family]
    sd = load_sd_components(ModelConfig(base_model=str(request.getfixturevalue(fixture))))
    fam = family_for(sd, TrainingConfig())
    prompt = "a red circle on a blue background"
    pipe = fam.sampling_pipeline(sd, sampling_scheduler(sd))
    with torch.no_grad():
        cond = fam.encode_prompt([getattr(sd, n) for n in fam.text_encoder_names()], fam.tokenize([prompt]))
        out = pipe.encode_prompt(prompt=prompt, device=torch.device("cpu"), num_images_per_prompt=1,
                                 do_classifier_free_guidance=False)
    if family == "sd1":
        torch.testing.assert_close(cond, out[0])
        return
    embeds, pooled = out[0], out[2]
    torch.testing.assert_close(cond[:, :-1], embeds)
    torch.testing.assert_close(cond[:, -1, : pooled.shape[1]], pooled)
    assert not cond[:, -1, pooled.shape[1] :].any()
