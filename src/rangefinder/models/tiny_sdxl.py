"""The embedded tiny SDXL model: SDXL's structure at 32 px, built from config offline and deterministically.

Its architecture follows diffusers' own SDXL test components (tests/pipelines/stable_diffusion_xl/
test_stable_diffusion_xl.py, `get_dummy_components`): two small CLIP text encoders, a `CLIPTextModel` (SDXL's ViT-L)
and a `CLIPTextModelWithProjection` (SDXL's OpenCLIP bigG, whose pooled, projected output conditions the UNet), and
a UNet with `addition_embed_type="text_time"`, whose added embedding takes the pooled vector and the six size
numbers (`projection_class_embeddings_input_dim` = 6 * `addition_time_embed_dim` + the pooled width). The UNet's
cross-attention width is the two encoders' hidden widths together, since SDXL concatenates their penultimate
hidden states.

The VAE and the tokenizer are the tiny SD model's (tiny.py), already pre-trained: a VAE is the same in both
families. The UNet and the text encoders are then pre-trained briefly, as SDXL conditions them, on the stripes
dataset, so that fine-tuning on shapes starts from a model that already knows colours, as with the tiny SD model.
The model built with the default settings ships as package data, as the tiny SD model's (models/shipped.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rangefinder.models import tiny

BUILDER_VERSION = 1  # bump when the builder changes what it writes (the cache key also hashes this file's source)


@dataclass(frozen=True)
class TinySdxlSettings:
    seed: int = 0
    unet_channels: tuple[int, ...] = (32, 64)
    transformer_layers: tuple[int, ...] = (1, 2)  # per level, as SDXL deepens its lower levels (its 1, 2, 10)
    addition_time_embed_dim: int = 8
    # The encoders' widths differ, as SDXL's (768 and 1280): single-file loaders tell them apart by their widths.
    text_hidden: int = 32  # the first (CLIP ViT-L's place)
    text_hidden_2: int = 48  # the second (OpenCLIP bigG's place); the UNet attends to both, 32 + 48 wide
    pooled_dim: int = 32  # the second encoder's projection: the pooled vector
    text_layers: int = 3  # SDXL conditions on the penultimate layer: with 3, two layers shape the conditioning
    text_heads: int = 4
    # A brief denoising pre-training of the UNet and text encoders on stripes (tiny.py's stage 2).
    pretrain_images: int = 128
    unet_steps: int = 150
    unet_batch: int = 16
    unet_lr: float = 1e-3
    cond_dropout: float = 0.1


SHIPPED_NAME = "tiny-sdxl"  # its weights ship as package data (models/shipped.py), as the tiny SD model's


def settings_key(settings: TinySdxlSettings) -> str:
    # the base it is built on: the tiny SD model's cache name
    return tiny.builder_key(settings, f"{BUILDER_VERSION}|{tiny.cache_name(tiny.TinyModelSettings())}", (__file__,))


def cache_name(settings: TinySdxlSettings) -> str:
    """Keyed by the shipped files' digests for the shipped model, else by settings_key."""
    return tiny.keyed_cache_name(SHIPPED_NAME, settings, TinySdxlSettings(), settings_key)


def ensure_tiny_sdxl_model(cache_dir: str | Path | None = None, settings: Optional[TinySdxlSettings] = None) -> Path:
    """The folder of the embedded tiny SDXL model: the shipped weights, copied into the cache once (seconds); or, for
    other settings, built once per cache on the tiny SD model's VAE and tokenizer."""
    settings = settings or TinySdxlSettings()
    return tiny.ensure_derived_model(cache_dir, SHIPPED_NAME, settings, TinySdxlSettings(), settings_key,
                                     "SDXL", lambda out, base: build_tiny_sdxl_model(out, base, settings))


def build_tiny_sdxl_components(settings: TinySdxlSettings, base: Path) -> dict[str, Any]:
    """Randomly initialised UNet and text encoders (seeded), with the tiny SD model's VAE and tokenizer."""
    import torch
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    torch.manual_seed(settings.seed)
    tokenizer = CLIPTokenizer.from_pretrained(str(base), subfolder="tokenizer", local_files_only=True)
    vae = AutoencoderKL.from_pretrained(str(base), subfolder="vae", local_files_only=True)

    def clip_config(hidden: int) -> Any:
        return CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
            num_hidden_layers=settings.text_layers, num_attention_heads=settings.text_heads,
            max_position_embeddings=77, projection_dim=settings.pooled_dim,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )

    text_encoder = CLIPTextModel(clip_config(settings.text_hidden))
    text_encoder_2 = CLIPTextModelWithProjection(clip_config(settings.text_hidden_2))
    n_vae = len(vae.config.block_out_channels)
    n = len(settings.unet_channels)
    unet = UNet2DConditionModel(
        sample_size=int(vae.config.sample_size) // 2 ** (n_vae - 1),
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=settings.unet_channels,
        down_block_types=("DownBlock2D",) * (n - 1) + ("CrossAttnDownBlock2D",),
        up_block_types=("CrossAttnUpBlock2D",) + ("UpBlock2D",) * (n - 1),
        transformer_layers_per_block=settings.transformer_layers,
        attention_head_dim=8,
        use_linear_projection=True,  # as SDXL
        cross_attention_dim=settings.text_hidden + settings.text_hidden_2,
        addition_embed_type="text_time",
        addition_time_embed_dim=settings.addition_time_embed_dim,
        projection_class_embeddings_input_dim=6 * settings.addition_time_embed_dim + settings.pooled_dim,
        norm_num_groups=8,
    )
    # SDXL's sampling scheduler and noise schedule (its scheduler_config.json: Euler, scaled linear).
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        steps_offset=1, timestep_spacing="leading", prediction_type="epsilon",
    )
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2,
            "tokenizer": tokenizer, "tokenizer_2": tokenizer, "scheduler": scheduler}


def sdxl_conditioning(text_encoder: Any, text_encoder_2: Any, ids: Any, ids_2: Any) -> tuple[Any, Any]:
    """(hidden (B, 77, D1+D2), pooled (B, P)): SDXL's conditioning, as its pipeline's `encode_prompt` computes it:
    the penultimate hidden states of both encoders concatenated, and the second encoder's projected pooled output."""
    import torch

    out_1 = text_encoder(ids, output_hidden_states=True)
    out_2 = text_encoder_2(ids_2, output_hidden_states=True)
    hidden = torch.cat([out_1.hidden_states[-2], out_2.hidden_states[-2]], dim=-1)
    return hidden, out_2.text_embeds


def _pretrain(parts: dict[str, Any], settings: TinySdxlSettings, log: Callable[[str], None]) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler

    unet, vae, te1, te2, tok = (parts[k] for k in ("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer"))
    scheduler = DDPMScheduler.from_config(parts["scheduler"].config)
    g = torch.Generator().manual_seed(settings.seed)
    resolution = int(vae.config.sample_size)
    stripes, captions = tiny._images("stripes", 3_000_017 + settings.seed, settings.pretrain_images, resolution)
    with torch.no_grad():
        latents = vae.encode(stripes).latent_dist.mode() * vae.config.scaling_factor
    tokens = tok(captions + [""], padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    caption_ids, empty_ids = tokens[:-1], tokens[-1:]
    # original size, crop top-left, target size: the images are made at the resolution, uncropped.
    time_ids = torch.tensor([[resolution, resolution, 0, 0, resolution, resolution]], dtype=torch.float32)
    modules = (unet, te1, te2)
    for m in modules:
        m.train()
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=settings.unet_lr, weight_decay=1e-2)
    t0, running = time.time(), None
    for _ in range(settings.unet_steps):
        idx = torch.randint(0, len(latents), (settings.unet_batch,), generator=g)
        ids = caption_ids[idx].clone()
        ids[torch.rand(len(idx), generator=g) < settings.cond_dropout] = empty_ids
        noise = torch.randn(latents[idx].shape, generator=g)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (len(idx),), generator=g)
        hidden, pooled = sdxl_conditioning(te1, te2, ids, ids)
        pred = unet(scheduler.add_noise(latents[idx], noise, t), t, hidden,
                    added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids.expand(len(idx), -1)}).sample
        loss = F.mse_loss(pred, noise)
        running = tiny.update_step(opt, loss, params, running)
    for m in modules:
        m.eval()
    log(f"tiny SDXL model: UNet {settings.unet_steps} steps in {time.time() - t0:.0f}s, denoising loss ~{running:.4f}")
    return {"unet_loss": float(running or 0.0)}


def build_tiny_sdxl_model(out_dir: str | Path, base: Path, settings: Optional[TinySdxlSettings] = None,
                          log: Optional[Callable[[str], None]] = None) -> Path:
    """Build and save the tiny SDXL model into `out_dir` (written under a temporary name, then renamed)."""
    from diffusers import StableDiffusionXLPipeline

    settings = settings or TinySdxlSettings()
    log = log or tiny._log_stderr

    def build() -> tuple[dict[str, Any], dict[str, Any]]:
        parts = build_tiny_sdxl_components(settings, base)
        return parts, _pretrain(parts, settings, log)

    return tiny.save_built_model(out_dir, StableDiffusionXLPipeline, build, {
        "builder_version": BUILDER_VERSION, "family": "sdxl", "settings": dataclasses.asdict(settings),
        "vae_and_tokenizer_from": base.name})
