"""The embedded tiny Stable Diffusion model: built from config, briefly pre-trained, offline and deterministic.

It has every part of SD 1.x (UNet2DConditionModel, AutoencoderKL, CLIP text encoder and tokenizer, DDPM scheduler)
in diffusers' folder layout, only a few hundred times smaller, so that the whole method runs on a laptop CPU in
minutes. The tokenizer's vocabulary is written here, from the caption words of the synthetic datasets and the
prompt templates of textual inversion; every such word is a single token.

Pre-training, in two stages, on data the demo never uses (see src/rangefinder/data/synthetic.py):
1. the VAE as an autoencoder on stripes and on shapes drawn with seeds the demo never uses, so that decoded latents
   look like images (blurred: a few hundred steps, about two minutes);
2. the UNet (and text encoder) as a denoiser on the *stripes* dataset only, timesteps leaning to the noisy end, so
   that it reads its captions' colour words; what the demo later does on shapes is then fine-tuning of a model that
   already knows colours, not training from scratch.

Two traps of a freshly initialised VAE are handled as Stable Diffusion handles them: latents are scaled by
`scaling_factor` = 1 / std of the training latents (Rombach et al. 2022, sec. 4.3 and app. G), and images are
encoded with the posterior's mode, not a sample.

The model built with the default settings ships as package data (models/shipped.py), since float arithmetic on
another CPU builds other weights: `ensure_tiny_base_model` copies it into the cache, and `rangefinder
make-base-model --rebuild` (`make tiny-weights`) runs this builder to write it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rangefinder.config import expand_home
from rangefinder.formats.atomic import atomic_dir
from rangefinder.formats.diffusers_folder import save_pipeline_folder
from rangefinder.models import shipped

# ---------------------------------------------------------------------------------------------------------------
# Settings and cache

BUILDER_VERSION = 3  # bump when the builder changes what it writes (the cache key also hashes this file's source)


@dataclass(frozen=True)
class TinyModelSettings:
    resolution: int = 32  # pixels; the VAE downsamples by 4, so latents are (4, 8, 8)
    seed: int = 0
    # Architecture. Cross-attention at both levels (8x8 and 4x4), as SD 1.x has it at all but its lowest level: with
    # attention at 4x4 alone the pre-trained UNet ignored its captions (docs/demo-learning.md).
    unet_channels: tuple[int, ...] = (32, 64)
    vae_channels: tuple[int, ...] = (16, 32, 32)
    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 4
    max_length: int = 77  # tokens, as in CLIP
    # Pre-training (see the module docstring): about 4 minutes on one idle CPU core, run by `make tiny-weights` (the
    # default settings' model ships as package data: models/shipped.py). The UNet's share reads the captions, which
    # 300 steps of 16 did not (docs/demo-learning.md).
    pretrain_images: int = 256  # per kind
    vae_steps: int = 400  # reconstruction MSE ~0.08 in [-1, 1] units, about a 4x blur (a flat colour scores 0.18)
    vae_batch: int = 16
    vae_lr: float = 1e-3  # faster rates stall at the flat-colour solution
    unet_steps: int = 300
    unet_batch: int = 64
    unet_lr: float = 2e-3
    # Timesteps drawn as T * u ** power (u uniform): power < 1 leans to the noisy end, where the picture's colours
    # are decided and only the caption can tell them. Uniform draws (power 1) left the captions unread.
    timestep_power: float = 0.5
    cond_dropout: float = 0.1  # captions dropped to "" so classifier-free guidance has an unconditional branch


def default_cache_dir() -> Path:
    env = os.environ.get("RANGEFINDER_CACHE")
    return expand_home(env, "$RANGEFINDER_CACHE") if env else Path.home() / ".cache" / "rangefinder"


def library_versions() -> str:
    """torch, diffusers and transformers versions, for the cache keys of the models built on them: float arithmetic
    in another version builds other weights."""
    import diffusers
    import torch
    import transformers

    return f"{torch.__version__}|{diffusers.__version__}|{transformers.__version__}"


def builder_key(settings: Any, stamp: str, sources: tuple[str, ...]) -> str:
    """A tiny model's cache key: the hash of its settings, a stamp (the builder version, with the libraries or the
    base model it is built on) and its builders' source files. The four tiny models share it."""
    h = hashlib.sha256()
    h.update(json.dumps(dataclasses.asdict(settings), sort_keys=True).encode())
    h.update(stamp.encode())
    for mod_file in sources:
        h.update(Path(mod_file).read_bytes())
    return h.hexdigest()[:16]


def keyed_cache_name(shipped_name: str, settings: Any, default: Any, key: Callable[[Any], str]) -> str:
    """The cached folder's name, `shipped_name` + a key: the shipped files' digests when `settings` are the `default`
    the shipped weights were built with (a test checks their rangefinder_tiny.json says so), else `key(settings)`."""
    if shipped_uses(shipped_name, settings, default):
        return f"{shipped_name}-{shipped.shipped_key(shipped_name)}"
    return f"{shipped_name}-{key(settings)}"


def shipped_uses(shipped_name: str, settings: Any, default: Any) -> bool:
    """Whether the shipped weights `shipped_name` are these settings' model."""
    return bool(settings == default) and shipped.is_shipped(shipped_name)


def settings_key(settings: TinyModelSettings) -> str:
    """Hash of the settings, the builder's source and the library versions: a change to any rebuilds the model."""
    from rangefinder.data import synthetic

    return builder_key(settings, f"{BUILDER_VERSION}|{library_versions()}", (__file__, synthetic.__file__))


SHIPPED_NAME = "tiny-sd"  # its weights ship as package data (models/shipped.py)


def uses_shipped_weights(settings: TinyModelSettings) -> bool:
    return shipped_uses(SHIPPED_NAME, settings, TinyModelSettings())


def shipped_files() -> Optional[Path]:
    """The embedded model's folder as shipped, to read its configs without installing it; None where its weights are
    not shipped (ensure_tiny_base_model then builds it)."""
    return shipped.SHIPPED_DIR / SHIPPED_NAME if uses_shipped_weights(TinyModelSettings()) else None


def cache_name(settings: TinyModelSettings) -> str:
    return keyed_cache_name(SHIPPED_NAME, settings, TinyModelSettings(), settings_key)


def ensure_tiny_base_model(cache_dir: str | Path | None = None, settings: Optional[TinyModelSettings] = None) -> Path:
    """Return the folder of the embedded tiny model: the shipped weights, copied into the cache once (seconds); or,
    for other settings, built once per cache (a few minutes on 2 CPU cores).

    Concurrent callers (several test sessions, pipeline steps) wait on a file lock instead of writing it twice.
    """
    from filelock import FileLock

    settings = settings or TinyModelSettings()
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / cache_name(settings)
    if (final / "model_index.json").is_file():
        return final
    with FileLock(str(final) + ".lock"):
        if not (final / "model_index.json").is_file():
            if uses_shipped_weights(settings):
                shipped.install_shipped(SHIPPED_NAME, final)
            else:
                _log_stderr(f"building the embedded tiny model into {final} (once; a few minutes on 2 CPU cores)")
                build_tiny_base_model(final, settings)
    return final


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer: a CLIP BPE vocabulary written locally

# diffusers' textual-inversion prompt templates (object and style) use these words; the initializer tokens "object"
# and "style" must be single tokens.
TEMPLATE_WORDS = (
    "a photo of the rendering cropped clean dirty dark my cool close up bright good one rendition nice small weird "
    "large painting in style picture object"
).split()
EXTRA_WORDS = "image with shape color colour pattern big tiny left right top bottom middle center".split()


def vocabulary_words() -> list[str]:
    from rangefinder.data.synthetic import CAPTION_WORDS

    return sorted(set(CAPTION_WORDS) | set(TEMPLATE_WORDS) | set(EXTRA_WORDS))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-level alphabet: every byte maps to a printable character (Radford et al. 2019)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def tokenizer_vocab_and_merges(words: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP BPE vocabulary in which each of `words` is one token.

    Merges grow each word from its end ("d</w>" <- "e"+"d</w>" <- "r"+"ed</w>"): the only symbol carrying "</w>" is
    the last, so at every point exactly one merge applies and merge ranks cannot make words collide. Any other text
    still tokenizes (into bytes), as with CLIP.
    """
    alphabet = list(_bytes_to_unicode().values())
    vocab_list = alphabet + [c + "</w>" for c in alphabet]
    merges: list[tuple[str, str]] = []
    seen = set(vocab_list)
    for w in words:
        for k in range(len(w) - 2, -1, -1):
            pair = (w[k], w[k + 1:] + "</w>")
            merged = w[k:] + "</w>"
            if merged not in seen:
                seen.add(merged)
                merges.append(pair)
                vocab_list.append(merged)
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab_list)}, merges


def build_tokenizer(max_length: int = 77):
    from transformers import CLIPTokenizer

    vocab, merges = tokenizer_vocab_and_merges(vocabulary_words())
    # tokenizers' BPE takes the merges as (a, b) pairs; transformers annotates them as strings.
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# Architecture


def build_tiny_components(settings: TinyModelSettings) -> dict:
    """Randomly initialised parts (seeded by `settings.seed`), in SD 1.x's structure."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(settings.seed)
    tokenizer = build_tokenizer(settings.max_length)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=settings.text_hidden,
            intermediate_size=settings.text_hidden * 2,
            num_hidden_layers=settings.text_layers,
            num_attention_heads=settings.text_heads,
            max_position_embeddings=settings.max_length,
            projection_dim=settings.text_hidden,
            # The real ids: CLIP pools at the first eos, which then stays right after tokens are added.
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    n_vae = len(settings.vae_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n_vae,
        up_block_types=("UpDecoderBlock2D",) * n_vae,
        block_out_channels=settings.vae_channels,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=settings.resolution,
    )
    latent_size = settings.resolution // 2 ** (n_vae - 1)
    n_unet = len(settings.unet_channels)
    unet = UNet2DConditionModel(
        sample_size=latent_size,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=settings.unet_channels,
        down_block_types=("CrossAttnDownBlock2D",) * n_unet,
        up_block_types=("CrossAttnUpBlock2D",) * n_unet,
        cross_attention_dim=settings.text_hidden,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    # SD 1.x's noise schedule and objective.
    scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        prediction_type="epsilon",
        steps_offset=1,
    )
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": scheduler}


# ---------------------------------------------------------------------------------------------------------------
# Pre-training


def _images(kind: str, seed: int, count: int, resolution: int):
    import numpy as np
    import torch

    from rangefinder.data.pixels import to_model_array
    from rangefinder.data.synthetic import render_item

    arrays, captions = [], []
    for i in range(count):
        img, caption = render_item(kind, seed, i, resolution)
        arrays.append(to_model_array(img, resolution))
        captions.append(caption)
    return torch.from_numpy(np.stack(arrays)), captions  # (N, 3, R, R) in [-1, 1]


def pretrain_vae(vae: Any, data: Any, steps: int, batch: int, lr: float, g: Any) -> tuple[Any, float]:
    """The first stage of the tiny models' pre-training (the SD model's and Flux's): `vae` trained on `data` ((N, 3,
    R, R) in [-1, 1]) as a plain autoencoder through the posterior's mode, `steps` Adam steps of `batch` images drawn
    with the generator `g`, then frozen. Returns the mode latents of all of `data` and their reconstruction MSE.

    Sampling and a KL term slow this short training down; the engine encodes with the mode anyway
    (training.latent_sampling), and a small penalty on the latents' size keeps them from drifting (the callers
    normalise them after)."""
    import torch
    import torch.nn.functional as F

    vae.train()
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(0, len(data), (batch,), generator=g)
        x = data[idx]
        z = vae.encode(x).latent_dist.mode()
        recon = vae.decode(z).sample
        loss = F.mse_loss(recon, x) + 1e-4 * z.pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    vae.eval()
    vae.requires_grad_(False)
    with torch.no_grad():
        latents = vae.encode(data).latent_dist.mode()
        recon_mse = F.mse_loss(vae.decode(latents).sample, data).item()
    return latents, recon_mse


def _pretrain(parts: dict, settings: TinyModelSettings, log: Callable[[str], None]) -> dict:
    import torch
    import torch.nn.functional as F

    unet, vae, text_encoder, tokenizer, scheduler = (
        parts["unet"], parts["vae"], parts["text_encoder"], parts["tokenizer"], parts["scheduler"]
    )
    g = torch.Generator().manual_seed(settings.seed)
    n = settings.pretrain_images
    # Seeds far from the small seeds a user passes to `make-dataset`, so the demo never sees these images.
    stripes, stripe_captions = _images("stripes", 1_000_003 + settings.seed, n, settings.resolution)
    shapes, _ = _images("shapes", 2_000_003 + settings.seed, n, settings.resolution)

    # --- stage 1: VAE on stripes and shapes, as a plain autoencoder (pretrain_vae)
    vae_data = torch.cat([stripes, shapes])
    t0 = time.time()
    # all_latents: (2N, 4, h, w), stripes then shapes
    all_latents, recon_mse = pretrain_vae(vae, vae_data, settings.vae_steps, settings.vae_batch, settings.vae_lr, g)
    scaling = float(1.0 / all_latents.std())  # over both kinds: the demo's shapes get unit-variance latents too
    latents = all_latents[:n]  # stripes only from here on
    vae.register_to_config(scaling_factor=scaling)
    log(f"tiny model: VAE {settings.vae_steps} steps in {time.time() - t0:.0f}s, recon MSE {recon_mse:.4f}, "
        f"scaling_factor {scaling:.4f}")

    # --- stage 2: UNet and text encoder as an epsilon-prediction denoiser on stripes (DDPM, Ho et al. 2020)
    latents = latents * scaling
    tokens = tokenizer(
        stripe_captions + [""], padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
        return_tensors="pt",
    ).input_ids
    caption_ids, empty_ids = tokens[:-1], tokens[-1:]
    unet.train()
    text_encoder.train()
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=settings.unet_lr, weight_decay=1e-2)
    t0 = time.time()
    running = None
    for _ in range(settings.unet_steps):
        idx = torch.randint(0, len(latents), (settings.unet_batch,), generator=g)
        z0 = latents[idx]
        ids = caption_ids[idx].clone()
        drop = torch.rand(len(idx), generator=g) < settings.cond_dropout
        ids[drop] = empty_ids
        noise = torch.randn(z0.shape, generator=g)
        steps = scheduler.config.num_train_timesteps
        u = torch.rand(len(idx), generator=g)
        t = (steps * u ** settings.timestep_power).long().clamp(max=steps - 1)
        zt = scheduler.add_noise(z0, noise, t)
        cond = text_encoder(ids)[0]
        pred = unet(zt, t, encoder_hidden_states=cond).sample
        loss = F.mse_loss(pred, noise)
        running = update_step(opt, loss, params, running)
    unet.eval()
    text_encoder.eval()
    log(f"tiny model: UNet {settings.unet_steps} steps in {time.time() - t0:.0f}s, denoising loss ~{running:.4f}")
    return {"vae_recon_mse": recon_mse, "scaling_factor": scaling, "unet_loss": running}


# ---------------------------------------------------------------------------------------------------------------
# Build


def update_step(opt: Any, loss: Any, params: list[Any], running: Optional[float]) -> float:
    """One pre-training update of the tiny models' denoisers: backward, gradients clipped to norm 1, the optimizer's
    step. Returns the loss's running mean (decay 0.95) for the builder's log line."""
    import torch

    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return float(loss.item()) if running is None else 0.95 * running + 0.05 * loss.item()


def ensure_derived_model(cache_dir: str | Path | None, shipped_name: str, settings: Any, default: Any,
                         key: Callable[[Any], str], what: str, build: Callable[[Path, Path], Any]) -> Path:
    """The cached folder of a tiny model built on the tiny SD model (SDXL's, SD3's, Flux's; named by
    keyed_cache_name): the shipped weights `shipped_name` copied in once when `settings` are their `default`, else
    `build(folder, tiny SD folder)` once per cache, under a file lock."""
    from filelock import FileLock

    from rangefinder.models import shipped

    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / keyed_cache_name(shipped_name, settings, default, key)
    if (final / "model_index.json").is_file():
        return final
    with FileLock(str(final) + ".lock"):
        if (final / "model_index.json").is_file():
            pass
        elif shipped_uses(shipped_name, settings, default):
            shipped.install_shipped(shipped_name, final)
        else:
            base = ensure_tiny_base_model(root)  # its own lock: the SD model is built first, once
            _log_stderr(f"building the embedded tiny {what} model into {final} (once)")
            build(final, base)
    return final


def _log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)  # stdout stays clean for `--json`


@contextmanager
def deterministic_build() -> Iterator[None]:
    """One torch thread and deterministic algorithms inside, under a forked RNG; the caller's settings after.

    One thread: the same reduction order, hence bit-for-bit the same weights, whatever the core count; and for
    layers this small a second thread gains little while it loses much on a busy machine."""
    import torch

    was_deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(threads)


def build_tiny_base_model(
    out_dir: str | Path, settings: Optional[TinyModelSettings] = None, log: Optional[Callable[[str], None]] = None
) -> Path:
    """Build, pre-train and save the tiny model into `out_dir` (written under a temporary name, then renamed)."""
    from diffusers import StableDiffusionPipeline

    settings = settings or TinyModelSettings()
    log = log or _log_stderr
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} already exists and is not empty")

    def build() -> tuple[dict[str, Any], dict[str, Any]]:
        parts = build_tiny_components(settings)
        return parts, _pretrain(parts, settings, log=log)

    def pipeline(**parts: Any) -> Any:
        return StableDiffusionPipeline(**parts, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)

    return save_built_model(out, pipeline, build, {"builder_version": BUILDER_VERSION,
                                                   "settings": dataclasses.asdict(settings),
                                                   "vocabulary": vocabulary_words()})


def save_built_model(out_dir: str | Path, pipeline: Callable[..., Any],
                     build: Callable[[], tuple[dict[str, Any], dict[str, Any]]], info: dict[str, Any]) -> Path:
    """A tiny model (the SD model's, SDXL's, SD3's, Flux's) built into `out_dir`, written under a temporary name and
    renamed: its parts made and pre-trained by `build` (the parts, and the pre-training's figures) under
    deterministic_build, bit for bit the same weights whatever the core count; saved as the diffusers folder of
    `pipeline(**parts)`, with rangefinder_tiny.json, `info` and the figures as "pretraining"."""
    out = Path(out_dir).expanduser().resolve()
    with atomic_dir(out, replace=False) as tmp:
        with deterministic_build():
            parts, stats = build()
        # With vocab.json/merges.txt and the `text_model.` weight names, so transformers 4.x loads it too.
        save_pipeline_folder(pipeline(**parts), tmp)
        text = json.dumps({**info, "pretraining": stats}, indent=2, sort_keys=True) + "\n"
        (tmp / "rangefinder_tiny.json").write_text(text)
    return out


def copy_model(src: Path, out_dir: str | Path) -> Path:
    """Copy a model folder to `out_dir` (new or empty), complete or not at all."""
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        from rangefinder.errors import RangefinderError

        raise RangefinderError(f"{out} already exists and is not empty; pass a new --out folder (nothing was changed)")
    with atomic_dir(out, replace=False) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
    return out
