"""A few real optimizer updates through a Method, without the engine, so the methods are tested on their own.

The engine's own loop runs the same interface in tests/methods/test_with_engine.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass
class Parts:
    """The fields of rangefinder.models.loading.SDComponents the methods use."""

    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: object
    noise_scheduler: object
    source: str
    family: str = "sd1"
    model_dir: Path | None = None
    text_encoder_2: torch.nn.Module | None = None
    tokenizer_2: object = None
    text_encoder_3: torch.nn.Module | None = None  # SD3's T5
    tokenizer_3: object = None

    def text_encoders(self) -> dict[str, torch.nn.Module]:
        named = {"text_encoder": self.text_encoder, "text_encoder_2": self.text_encoder_2}
        return {k: v for k, v in named.items() if v is not None}


def load_parts(model_dir: Path) -> Parts:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    d = str(model_dir)
    return Parts(
        unet=UNet2DConditionModel.from_pretrained(d, subfolder="unet"),
        vae=AutoencoderKL.from_pretrained(d, subfolder="vae"),
        text_encoder=CLIPTextModel.from_pretrained(d, subfolder="text_encoder"),
        tokenizer=CLIPTokenizer.from_pretrained(d, subfolder="tokenizer"),
        noise_scheduler=DDPMScheduler.from_pretrained(d, subfolder="scheduler"),
        source=d,
    )


def train_updates(method, parts: Parts, captions: list[str], updates: int, lr: float, seed: int = 0) -> list[float]:
    """`updates` AdamW steps of the epsilon-prediction loss on random latents; returns the losses."""
    g = torch.Generator().manual_seed(seed)
    groups = method.param_groups()
    opt = torch.optim.AdamW([{k: v for k, v in grp.items() if k != "lr_scale"} for grp in groups], lr=lr)
    size = parts.unet.config.sample_size
    texts = [method.transform_caption(c) for c in captions]
    ids = parts.tokenizer(texts, padding="max_length", max_length=parts.tokenizer.model_max_length,
                          truncation=True, return_tensors="pt").input_ids
    for m in method.trainable_modules().values():
        m.train()
    losses = []
    for _ in range(updates):
        latents = torch.randn((len(texts), 4, size, size), generator=g)
        noise = torch.randn(latents.shape, generator=g)
        t = torch.randint(0, parts.noise_scheduler.config.num_train_timesteps, (len(texts),), generator=g)
        hidden = parts.text_encoder(ids, return_dict=False)[0]  # SD 1.x conditioning: the last hidden state
        pred = parts.unet(parts.noise_scheduler.add_noise(latents, noise, t), t, hidden).sample
        loss = F.mse_loss(pred, noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        method.after_optimizer_step()
        losses.append(float(loss.detach()))
    return losses


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def pipeline_image(pipe, prompt: str, seed: int = 0, steps: int = 4):
    import numpy as np

    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator("cpu").manual_seed(seed)
    img = pipe(prompt, num_inference_steps=steps, guidance_scale=3.0, generator=g, output_type="np").images[0]
    return np.asarray(img)


def unet_output(unet: torch.nn.Module) -> torch.Tensor:
    """The UNet's output on one fixed noisy latent, timestep and conditioning (seeded), to compare two UNets by."""
    g = torch.Generator().manual_seed(1)
    size = unet.config.sample_size
    x = torch.randn(1, 4, size, size, generator=g)
    h = torch.randn(1, 77, unet.config.cross_attention_dim, generator=g)
    with torch.no_grad():
        return unet(x, torch.tensor([500]), h).sample
