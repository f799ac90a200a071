"""The flow families (training/family_sd3.py, family_flux.py) read against diffusers' own pipelines and functions on
the tiny SD3 and Flux: what the transformer is given in training is what the family's pipeline gives it when samples
are rendered, and the validation grid's shift is the scheduler's."""

from __future__ import annotations

import pytest
import torch

from rangefinder.config import ModelConfig, TrainingConfig

FLOW_DIRS = {"sd3": "tiny_sd3_dir", "flux": "tiny_flux_dir"}


def loaded(family: str, request: pytest.FixtureRequest):
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.families import family_for

    sd = load_sd_components(ModelConfig(base_model=str(request.getfixturevalue(FLOW_DIRS[family]))))
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
