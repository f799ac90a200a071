"""The DDPM objective behind the family seam (training/family.py, family_sdxl.py): noising, the epsilon and v
targets, the training timesteps, min-SNR weighting, caption dropout, and SDXL's size conditioning, each checked
against its formula (the engine's runs only compare runs with each other)."""

from __future__ import annotations

import pytest
import torch

from rangefinder.training.family import ImageGeometry, Sd1Family
from rangefinder.training.family_sdxl import SdxlFamily

T = 1000


def scheduler():
    from diffusers import DDPMScheduler

    return DDPMScheduler(num_train_timesteps=T, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")


def sd1(prediction_type: str = "epsilon") -> Sd1Family:
    return Sd1Family(None, scheduler(), prediction_type)


def draws(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_noising_and_the_epsilon_and_v_targets_are_the_forward_process_s():
    x0, noise, t = draws(3, 4, 2, 2, seed=0), draws(3, 4, 2, 2, seed=1), torch.tensor([0, 500, 999])
    abar = scheduler().alphas_cumprod[t].view(-1, 1, 1, 1)
    alpha, sigma = abar.sqrt(), (1 - abar).sqrt()
    assert torch.allclose(sd1().noised(x0, noise, t), alpha * x0 + sigma * noise, atol=1e-6)
    assert torch.equal(sd1("epsilon").target(x0, noise, t), noise)
    assert torch.allclose(sd1("v_prediction").target(x0, noise, t), alpha * noise - sigma * x0, atol=1e-6)


def test_the_denoiser_sees_the_noised_latents_and_is_scored_against_the_target():
    from rangefinder.training.family import Denoiser

    seen = {}

    def unet(x, t, cond, return_dict=False):  # the UNet's call as family.predict makes it
        seen.update(x=x, t=t, cond=cond)
        return (x * 2,)

    x0, noise, cond = draws(2, 4, 2, 2, seed=0), draws(2, 4, 2, 2, seed=1), draws(2, 3, 5, seed=2)
    t = torch.tensor([10, 900])
    f = sd1("v_prediction")
    pred, target = Denoiser(f, unet)(x0, noise, t, cond)
    assert torch.equal(seen["x"], f.noised(x0, noise, t)) and torch.equal(seen["t"], t)
    assert torch.equal(seen["cond"], cond) and torch.equal(pred, 2 * seen["x"])
    assert torch.equal(target, f.target(x0, noise, t))


def test_training_timesteps_are_uniform_over_all_of_0_to_T():
    t = sd1().sample_timesteps(20_000, torch.Generator().manual_seed(0), (4, 4))
    assert t.dtype == torch.int64 and int(t.min()) == 0 and int(t.max()) == T - 1
    assert float((t < T // 2).double().mean()) == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize("prediction_type, denominator", [("epsilon", 0.0), ("v_prediction", 1.0)])
def test_min_snr_weights_are_min_snr_gamma_over_snr_or_snr_plus_1(prediction_type, denominator):
    """Hang et al. 2023: min(SNR, gamma) / SNR for epsilon, / (SNR + 1) for v; SNR = abar / (1 - abar)."""
    t, gamma = torch.tensor([0, 200, 500, 999]), 5.0
    abar = scheduler().alphas_cumprod[t].double()
    snr = abar / (1 - abar)
    assert bool((snr[:1] > gamma).all()) and bool((snr[-1:] < gamma).all())  # both sides of the clip are checked
    expected = snr.clamp(max=gamma) / (snr + denominator)
    f = sd1(prediction_type)
    assert torch.allclose(f.loss_weights(t, gamma).double(), expected, rtol=1e-4)
    assert torch.equal(f.loss_weights(t, None), torch.ones(4))


def test_caption_dropout_gives_the_dropped_items_the_empty_caption_and_keeps_the_others():
    cond, empty = draws(3, 4, 5, seed=0), draws(1, 4, 5, seed=1)
    out = sd1().drop_captions(cond, empty, torch.tensor([True, False, True]))
    assert torch.equal(out[0], empty[0]) and torch.equal(out[2], empty[0]) and torch.equal(out[1], cond[1])


# ---------------------------------------------------------------------------------------------------------------
# SDXL: the size conditioning rides in the conditioning's last row


P, L, D = 3, 4, 8  # pooled width, text length, text width


def sdxl() -> SdxlFamily:
    return SdxlFamily(None, scheduler(), "epsilon", pooled_dim=P)


GEOMETRY = [ImageGeometry((600, 800), (12, 34), (512, 768)), ImageGeometry((1024, 1024), (0, 0), (1024, 1024))]


def test_sdxl_size_row_is_original_size_crop_then_target_size_and_survives_caption_dropout():
    f = sdxl()
    text = draws(2, L + 1, D, seed=0)  # hidden states and the pooled row, as the text cache stores them
    cond = f.with_images(text, GEOMETRY)
    assert cond.shape == (2, L + 2, D) and torch.equal(cond[:, :-1], text)
    assert cond[0, -1, :6].tolist() == [600, 800, 12, 34, 512, 768] and not cond[:, -1, 6:].any()
    empty = draws(1, L + 1, D, seed=1)
    dropped = f.drop_captions(cond, empty, torch.tensor([False, True]))
    assert torch.equal(dropped[:, -1], cond[:, -1])  # each image keeps its own sizes
    assert torch.equal(dropped[1, :-1], empty[0]) and torch.equal(dropped[0], cond[0])


def test_sdxl_unet_gets_the_hidden_states_the_pooled_vector_and_the_time_ids_from_their_rows():
    f = sdxl()
    cond = f.with_images(draws(2, L + 1, D, seed=0), GEOMETRY)
    seen = {}

    def unet(x, t, hidden, added_cond_kwargs, return_dict=False):
        seen.update(hidden=hidden, **added_cond_kwargs)
        return (x,)

    f.predict(unet, draws(2, 4, 2, 2, seed=1), draws(2, 4, 2, 2, seed=2), torch.tensor([1, 2]), cond)
    assert torch.equal(seen["hidden"], cond[:, :L]) and torch.equal(seen["text_embeds"], cond[:, L, :P])
    assert seen["time_ids"].tolist() == [[600, 800, 12, 34, 512, 768], [1024, 1024, 0, 0, 1024, 1024]]


def test_sdxl_token_id_conditioning_keeps_the_sizes_row_when_the_text_encoders_train():
    """With a text encoder training the conditioning holds token ids, (N, 3, 77): the two tokenizers' ids and the
    add_time_ids row, which must come through the encoding as the last row."""
    from types import SimpleNamespace

    class Encoder:  # a CLIP's output as encode_prompt reads it: hidden states and (bigG) the pooled embedding
        def __call__(self, ids, output_hidden_states=True):
            hidden = ids.float().unsqueeze(-1).expand(*ids.shape, D // 2) / 1000
            return SimpleNamespace(hidden_states=[hidden * 3, hidden * 2, hidden], text_embeds=hidden[:, 0, :P])

    f = sdxl()
    ids = torch.stack([torch.arange(77).repeat(2, 1), torch.arange(100, 177).repeat(2, 1)], dim=1)  # (2, 2, 77)
    out = f.conditioning([Encoder(), Encoder()], f.with_images(ids, GEOMETRY))
    assert out.shape == (2, 77 + 2, D)
    assert out[:, -1, :6].tolist() == [[600, 800, 12, 34, 512, 768], [1024, 1024, 0, 0, 1024, 1024]]
    assert torch.allclose(out[:, -2, :P], torch.full((2, P), 0.1))  # bigG's pooled row (its first token, id 100)
