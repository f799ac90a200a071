"""The embedded tiny Flux.1-dev model: Flux's structure at 32 px, built from config offline and deterministically.

Its architecture follows diffusers' own Flux test components (tests/pipelines/flux/test_pipeline_flux.py,
`get_dummy_components`): a `FluxTransformer2DModel` with one double-stream and one single-stream block and the
guidance embedding (Flux.1-dev is guidance-distilled), a CLIP text encoder whose pooled output only is used, a T5
encoder whose hidden states are the sequence the transformer attends to, an `AutoencoderKL` without quant convs,
and `FlowMatchEulerDiscreteScheduler`. Two departures, both so that it builds with nothing downloaded:
- T5 is built from a `T5Config` (diffusers' test loads hf-internal-testing/tiny-random-t5 from the hub), and its
  tokenizer is ByT5's, which reads bytes and so needs no vocabulary file;
- the CLIP tokenizer is the tiny SD model's (tiny.py), whose caption words are single tokens.
The VAE has Flux's 16 latent channels, its own `shift_factor` and `scaling_factor` (Flux normalises latents as
(z - shift) * scale), and downsamples by 4, so 32 px images are 8x8 latents and 16 tokens of 2x2 patches.

Pre-training, as the tiny SD model's (tiny.py): the VAE as an autoencoder on stripes and shapes, then the transformer
and the CLIP encoder on stripes with the rectified-flow objective Flux is trained with (x_t = (1 - sigma) x_0 +
sigma * noise, target noise - x_0; sigma logit-normal, Esser et al. 2024, arXiv:2403.03206), the guidance input held
at `guidance` (Flux.1-dev's default of 3.5). T5 stays at its initialisation: Flux never trains it, and fixed
random features of the caption bytes still tell the captions apart. Captions are not dropped: a
guidance-distilled model has no unconditional branch.
The model built with the default settings ships as package data, as the other tiny models' (models/shipped.py).
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
class TinyFluxSettings:
    resolution: int = 32  # pixels; the VAE downsamples by 4: (16, 8, 8) latents, 4x4 = 16 packed tokens
    seed: int = 0
    vae_channels: tuple[int, ...] = (16, 32, 32)
    latent_channels: int = 16  # Flux's
    # The transformer: diffusers' test config (1 + 1 blocks, 2 heads of 16, rope axes 4 + 4 + 8 = 16).
    num_layers: int = 1
    num_single_layers: int = 1
    attention_head_dim: int = 16
    num_attention_heads: int = 2
    axes_dims_rope: tuple[int, ...] = (4, 4, 8)
    clip_hidden: int = 32  # the pooled vector's width (Flux's pooled_projection_dim)
    clip_layers: int = 2
    t5_d_model: int = 32  # the text sequence's width (Flux's joint_attention_dim)
    t5_layers: int = 2
    t5_heads: int = 4
    t5_max_length: int = 64  # bytes of caption (Flux.1-dev: 512 T5 tokens)
    guidance: float = 3.5  # the guidance input while pre-training (FluxPipeline's default guidance_scale)
    pretrain_images: int = 256  # per kind
    vae_steps: int = 300
    vae_batch: int = 16
    vae_lr: float = 1e-3
    transformer_steps: int = 300
    transformer_batch: int = 32
    transformer_lr: float = 2e-3


SHIPPED_NAME = "tiny-flux"  # its weights ship as package data (models/shipped.py), as the other tiny models'


def settings_key(settings: TinyFluxSettings) -> str:
    """Hash of the settings, this builder's and the tiny SD builder's source and the library versions."""
    from rangefinder.data import synthetic

    return tiny.builder_key(settings, f"{BUILDER_VERSION}|{tiny.library_versions()}",
                            (__file__, tiny.__file__, synthetic.__file__))


def cache_name(settings: TinyFluxSettings) -> str:
    """Keyed by the shipped files' digests for the shipped model, else by settings_key."""
    return tiny.keyed_cache_name(SHIPPED_NAME, settings, TinyFluxSettings(), settings_key)


def ensure_tiny_flux_model(cache_dir: str | Path | None = None, settings: Optional[TinyFluxSettings] = None) -> Path:
    """The folder of the embedded tiny Flux model: the shipped weights, copied into the cache once (seconds); or, for
    other settings, built once per cache (about 80 s on one core), under a file lock (tiny.ensure_derived_model;
    the Flux builder uses nothing of the tiny SD model but its tokenizer's vocabulary)."""
    settings = settings or TinyFluxSettings()
    return tiny.ensure_derived_model(cache_dir, SHIPPED_NAME, settings, TinyFluxSettings(), settings_key,
                                     "Flux", lambda final, _base: build_tiny_flux_model(final, settings))


def build_tiny_flux_components(settings: TinyFluxSettings) -> dict[str, Any]:
    """Randomly initialised parts (seeded), in FluxPipeline's structure."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import ByT5Tokenizer, CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(settings.seed)
    tokenizer = tiny.build_tokenizer(77)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=settings.clip_hidden, intermediate_size=settings.clip_hidden * 2,
        num_hidden_layers=settings.clip_layers, num_attention_heads=4, max_position_embeddings=77,
        projection_dim=settings.clip_hidden, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))
    tokenizer_2 = ByT5Tokenizer(model_max_length=settings.t5_max_length)
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=settings.t5_d_model, d_kv=settings.t5_d_model // settings.t5_heads,
        d_ff=settings.t5_d_model * 2, num_layers=settings.t5_layers, num_heads=settings.t5_heads,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, pad_token_id=tokenizer_2.pad_token_id,
        eos_token_id=tokenizer_2.eos_token_id,
    ))
    n_vae = len(settings.vae_channels)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n_vae,
        up_block_types=("UpDecoderBlock2D",) * n_vae, block_out_channels=settings.vae_channels, layers_per_block=1,
        latent_channels=settings.latent_channels, norm_num_groups=8, sample_size=settings.resolution,
        use_quant_conv=False, use_post_quant_conv=False,  # as Flux's VAE
    )
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=settings.latent_channels * 4, num_layers=settings.num_layers,
        num_single_layers=settings.num_single_layers, attention_head_dim=settings.attention_head_dim,
        num_attention_heads=settings.num_attention_heads, joint_attention_dim=settings.t5_d_model,
        pooled_projection_dim=settings.clip_hidden, guidance_embeds=True, axes_dims_rope=settings.axes_dims_rope,
    )
    # Flux.1-dev's scheduler config: shift from the image's token count, between base_shift and max_shift.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "text_encoder_2": text_encoder_2, "tokenizer_2": tokenizer_2, "scheduler": scheduler}


def flux_text_conditioning(parts: dict[str, Any], captions: list[str], max_length: int) -> tuple[Any, Any]:
    """(pooled (N, P), T5 hidden states (N, L, D)): Flux's conditioning, as FluxPipeline.encode_prompt computes it
    (CLIP's pooled output, T5's last hidden state, both padded to their fixed lengths)."""
    clip_ids = parts["tokenizer"](captions, padding="max_length", max_length=77, truncation=True,
                                  return_tensors="pt").input_ids
    t5_ids = parts["tokenizer_2"](captions, padding="max_length", max_length=max_length, truncation=True,
                                  return_tensors="pt").input_ids
    pooled = parts["text_encoder"](clip_ids).pooler_output
    hidden = parts["text_encoder_2"](t5_ids)[0]
    return pooled, hidden


def _pretrain(parts: dict[str, Any], settings: TinyFluxSettings, log: Callable[[str], None]) -> dict[str, float]:
    import torch
    import torch.nn.functional as F
    from diffusers import FluxPipeline

    vae, transformer, te = parts["vae"], parts["transformer"], parts["text_encoder"]
    g = torch.Generator().manual_seed(settings.seed)
    n, res = settings.pretrain_images, settings.resolution
    stripes, captions = tiny._images("stripes", 4_000_037 + settings.seed, n, res)
    shapes, _ = tiny._images("shapes", 5_000_011 + settings.seed, n, res)

    # --- stage 1: the VAE as an autoencoder through the posterior's mode (tiny.pretrain_vae, as the SD model's)
    t0 = time.time()
    z_all, recon = tiny.pretrain_vae(vae, torch.cat([stripes, shapes]), settings.vae_steps, settings.vae_batch,
                                     settings.vae_lr, g)
    shift, scaling = float(z_all.mean()), float(1.0 / z_all.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scaling)
    log(f"tiny Flux model: VAE {settings.vae_steps} steps in {time.time() - t0:.0f}s, recon MSE {recon:.4f}, "
        f"shift_factor {shift:.4f}, scaling_factor {scaling:.4f}")

    # --- stage 2: transformer and CLIP encoder, rectified flow on stripes; T5 frozen (Flux never trains it)
    latents = (z_all[:n] - shift) * scaling
    b, c, h, w = latents.shape
    with torch.no_grad():
        _, t5_all = flux_text_conditioning(parts, captions, settings.t5_max_length)
    clip_ids = parts["tokenizer"](captions, padding="max_length", max_length=77, truncation=True,
                                  return_tensors="pt").input_ids
    parts["text_encoder_2"].requires_grad_(False)
    img_ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(settings.t5_max_length, 3)
    transformer.train()
    te.train()
    params = list(transformer.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=settings.transformer_lr, weight_decay=1e-2)
    t0, running = time.time(), None
    for _ in range(settings.transformer_steps):
        idx = torch.randint(0, n, (settings.transformer_batch,), generator=g)
        x0 = latents[idx]
        noise = torch.randn(x0.shape, generator=g)
        sigma = torch.sigmoid(torch.randn(len(idx), generator=g))
        xt = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
        pred = transformer(
            hidden_states=FluxPipeline._pack_latents(xt, len(idx), c, h, w), timestep=sigma,
            guidance=torch.full((len(idx),), settings.guidance), pooled_projections=te(clip_ids[idx]).pooler_output,
            encoder_hidden_states=t5_all[idx], txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0]
        target = FluxPipeline._pack_latents(noise - x0, len(idx), c, h, w)
        loss = F.mse_loss(pred, target)
        running = tiny.update_step(opt, loss, params, running)
    transformer.eval()
    te.eval()
    log(f"tiny Flux model: transformer {settings.transformer_steps} steps in {time.time() - t0:.0f}s, flow loss "
        f"~{running:.4f}")
    return {"vae_recon_mse": recon, "shift_factor": shift, "scaling_factor": scaling,
            "transformer_loss": float(running or 0.0)}


def build_tiny_flux_model(out_dir: str | Path, settings: Optional[TinyFluxSettings] = None,
                          log: Optional[Callable[[str], None]] = None) -> Path:
    """Build, pre-train and save the tiny Flux model into `out_dir` (written under a temporary name, then renamed)."""
    from diffusers import FluxPipeline

    settings = settings or TinyFluxSettings()
    log = log or tiny._log_stderr

    def build() -> tuple[dict[str, Any], dict[str, Any]]:
        parts = build_tiny_flux_components(settings)
        return parts, _pretrain(parts, settings, log)

    return tiny.save_built_model(out_dir, FluxPipeline, build, {
        "builder_version": BUILDER_VERSION, "family": "flux", "settings": dataclasses.asdict(settings)})
