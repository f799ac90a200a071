"""The embedded tiny SD3.5 model: SD3's structure at 32 px, built from config offline and deterministically.

Its architecture follows diffusers' own SD3 test components (tests/pipelines/stable_diffusion_3/
test_pipeline_stable_diffusion_3.py, `get_dummy_components`): an `SD3Transformer2DModel` (MMDiT), two
`CLIPTextModelWithProjection` encoders (CLIP ViT-L's and OpenCLIP bigG's places; widths 32 and 48, so that
single-file loaders tell them apart by width as they do 768 and 1280) and a `T5EncoderModel`. Unlike the test
components, nothing is downloaded: T5 is built from a `T5Config` and tokenised by ByT5's tokenizer, which needs no
vocabulary file; the transformer normalises q and k with RMSNorm as SD3.5 does (`qk_norm="rms_norm"`), cuts the
latents into 2 x 2 patches as SD3 does, and its joint attention is as wide as T5 (the CLIP hidden states, 32 + 48,
are zero-padded to T5's 96, as StableDiffusion3Pipeline.encode_prompt pads 2048 to 4096).

The VAE and the CLIP tokenizer are the tiny SD model's (tiny.py), already pre-trained; the VAE's config gets a
`shift_factor` (the mean of its latents on the pre-training images), as SD3's VAE has one. The transformer and the
three encoders are then pre-trained briefly on stripes with the flow objective (sigma logit-normal, shift 3), so
that fine-tuning on shapes starts from a model that knows colours, as with the tiny SD model. It is built on first
the defaults ships as package data, as the tiny SD model's (models/shipped.py).
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
T5_MAX_LENGTH = 77  # T5 tokens per caption (diffusers' SD3 training examples' max_sequence_length default)
SD3_SHIFT = 3.0  # SD3's FlowMatchEulerDiscreteScheduler shift


@dataclass(frozen=True)
class TinySd3Settings:
    seed: int = 0
    layers: int = 2
    heads: int = 4
    head_dim: int = 8
    text_hidden: int = 32  # CLIP ViT-L's place
    text_hidden_2: int = 48  # OpenCLIP bigG's place
    pooled_dim: int = 32  # each CLIP's projection (CLIP-L's: the identity, so its width); the pooled input is both
    text_layers: int = 3  # SD3 conditions on CLIP's penultimate layer
    t5_width: int = 96  # >= 32 + 48: the CLIP rows are padded to it
    t5_layers: int = 2
    pretrain_images: int = 128
    steps: int = 150
    batch: int = 16
    lr: float = 1e-3
    cond_dropout: float = 0.1


SHIPPED_NAME = "tiny-sd3"  # its weights ship as package data (models/shipped.py), as the tiny SD model's


def settings_key(settings: TinySd3Settings) -> str:
    # the base it is built on: the tiny SD model's cache name
    return tiny.builder_key(settings, f"{BUILDER_VERSION}|{tiny.cache_name(tiny.TinyModelSettings())}", (__file__,))


def cache_name(settings: TinySd3Settings) -> str:
    """Keyed by the shipped files' digests for the shipped model, else by settings_key."""
    return tiny.keyed_cache_name(SHIPPED_NAME, settings, TinySd3Settings(), settings_key)


def ensure_tiny_sd3_model(cache_dir: str | Path | None = None, settings: Optional[TinySd3Settings] = None) -> Path:
    """The folder of the embedded tiny SD3 model: the shipped weights, copied into the cache once (seconds); or, for
    other settings, built once per cache on the tiny SD model's VAE and tokenizer."""
    settings = settings or TinySd3Settings()
    return tiny.ensure_derived_model(cache_dir, SHIPPED_NAME, settings, TinySd3Settings(), settings_key,
                                     "SD3", lambda out, base: build_tiny_sd3_model(out, base, settings))


def build_tiny_sd3_components(settings: TinySd3Settings, base: Path) -> dict[str, Any]:
    """Randomly initialised transformer and text encoders (seeded), with the tiny SD model's VAE and tokenizer."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import (
        ByT5Tokenizer,
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
    )

    torch.manual_seed(settings.seed)
    tokenizer = CLIPTokenizer.from_pretrained(str(base), subfolder="tokenizer", local_files_only=True)
    vae = AutoencoderKL.from_pretrained(str(base), subfolder="vae", local_files_only=True)
    tokenizer_3 = ByT5Tokenizer()

    def clip_config(hidden: int) -> Any:
        return CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
            num_hidden_layers=settings.text_layers, num_attention_heads=4, max_position_embeddings=77,
            projection_dim=settings.pooled_dim, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )

    text_encoder = CLIPTextModelWithProjection(clip_config(settings.text_hidden))
    # SD3's CLIP-L pools without a projection: its single file has none, and its readers take it as the identity
    # (ComfyUI's sd3_clip.py, diffusers' single_file_utils.py); so here too, kept frozen.
    with torch.no_grad():
        text_encoder.text_projection.weight.copy_(torch.eye(settings.text_hidden))
    text_encoder.text_projection.requires_grad_(False)
    text_encoder_2 = CLIPTextModelWithProjection(clip_config(settings.text_hidden_2))
    text_encoder_3 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_3), d_model=settings.t5_width, d_kv=settings.t5_width // 4, d_ff=settings.t5_width * 2,
        num_layers=settings.t5_layers, num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0,
        feed_forward_proj="gated-gelu",  # T5 v1.1 (T5-XXL's kind)
        pad_token_id=tokenizer_3.pad_token_id, eos_token_id=tokenizer_3.eos_token_id,
    ))
    latent_side = int(vae.config.sample_size) // 2 ** (len(vae.config.block_out_channels) - 1)
    transformer = SD3Transformer2DModel(
        sample_size=latent_side, patch_size=2, in_channels=int(vae.config.latent_channels),
        out_channels=int(vae.config.latent_channels), num_layers=settings.layers,
        attention_head_dim=settings.head_dim, num_attention_heads=settings.heads,
        caption_projection_dim=settings.heads * settings.head_dim, joint_attention_dim=settings.t5_width,
        pooled_projection_dim=2 * settings.pooled_dim, pos_embed_max_size=4 * latent_side, qk_norm="rms_norm",
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=SD3_SHIFT)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2,
            "text_encoder_3": text_encoder_3, "tokenizer": tokenizer, "tokenizer_2": tokenizer,
            "tokenizer_3": tokenizer_3, "scheduler": scheduler}


def sd3_conditioning(encoders: Any, ids: Any, ids_2: Any, ids_3: Any) -> tuple[Any, Any]:
    """(hidden (B, 77 + L3, D3), pooled (B, P1 + P2)), as StableDiffusion3Pipeline.encode_prompt computes them; the
    SD3 family's conditioning (training/family_sd3.py) and the pre-training's here."""
    import torch

    te1, te2, te3 = encoders
    out_1 = te1(ids, output_hidden_states=True)
    out_2 = te2(ids_2, output_hidden_states=True)
    t5 = te3(ids_3)[0]
    clip = torch.cat([out_1.hidden_states[-2], out_2.hidden_states[-2]], dim=-1)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    pooled = torch.cat([out_1.text_embeds, out_2.text_embeds], dim=-1)
    return torch.cat([clip, t5.to(clip.dtype)], dim=-2), pooled


def _pretrain(parts: dict[str, Any], settings: TinySd3Settings, log: Callable[[str], None]) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    net, vae, tok, tok3 = (parts[k] for k in ("transformer", "vae", "tokenizer", "tokenizer_3"))
    encoders = (parts["text_encoder"], parts["text_encoder_2"], parts["text_encoder_3"])
    g = torch.Generator().manual_seed(settings.seed)
    resolution = int(vae.config.sample_size)
    stripes, captions = tiny._images("stripes", 5_000_011 + settings.seed, settings.pretrain_images, resolution)
    with torch.no_grad():
        z = vae.encode(stripes).latent_dist.mode()
    shift = round(float(z.mean()), 4)
    vae.register_to_config(shift_factor=shift)
    latents = (z - shift) * vae.config.scaling_factor
    clip_ids = tok(captions + [""], padding="max_length", max_length=77, truncation=True,
                   return_tensors="pt").input_ids
    t5_ids = tok3(captions + [""], padding="max_length", max_length=T5_MAX_LENGTH, truncation=True,
                  return_tensors="pt").input_ids
    modules = (net, *encoders)
    for m in modules:
        m.train()
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=1e-2)
    t0, running = time.time(), None
    for _ in range(settings.steps):
        idx = torch.randint(0, len(latents), (settings.batch,), generator=g)
        drop = torch.rand(len(idx), generator=g) < settings.cond_dropout
        rows = torch.where(drop, torch.full_like(idx, len(captions)), idx)  # the last row is ""
        x0 = latents[idx]
        noise = torch.randn(x0.shape, generator=g)
        # The flow objective (training/family_flow.py, not imported: models must not import the engine): sigma
        # logit-normal, shifted; x_t on the straight line; the velocity noise - x0 as target.
        u = torch.sigmoid(torch.randn(len(idx), generator=g, dtype=torch.float64))
        sigma = (SD3_SHIFT * u / (1 + (SD3_SHIFT - 1) * u)).clamp(0.0, 1.0).float()
        s = sigma.view(-1, 1, 1, 1)
        hidden, pooled = sd3_conditioning(encoders, clip_ids[rows], clip_ids[rows], t5_ids[rows])
        pred = net(hidden_states=(1 - s) * x0 + s * noise, timestep=sigma * 1000, encoder_hidden_states=hidden,
                   pooled_projections=pooled, return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)
        running = tiny.update_step(opt, loss, params, running)
    for m in modules:
        m.eval()
    log(f"tiny SD3 model: transformer {settings.steps} steps in {time.time() - t0:.0f}s, flow loss ~{running:.4f}")
    return {"flow_loss": float(running or 0.0), "vae_shift_factor": shift}


def build_tiny_sd3_model(out_dir: str | Path, base: Path, settings: Optional[TinySd3Settings] = None,
                         log: Optional[Callable[[str], None]] = None) -> Path:
    """Build and save the tiny SD3 model into `out_dir` (written under a temporary name, then renamed)."""
    from diffusers import StableDiffusion3Pipeline

    settings = settings or TinySd3Settings()
    log = log or tiny._log_stderr

    def build() -> tuple[dict[str, Any], dict[str, Any]]:
        parts = build_tiny_sd3_components(settings, base)
        return parts, _pretrain(parts, settings, log)

    return tiny.save_built_model(out_dir, StableDiffusion3Pipeline, build, {
        "builder_version": BUILDER_VERSION, "family": "sd3", "settings": dataclasses.asdict(settings),
        "vae_and_tokenizer_from": base.name})
