"""The model and data the benchmarks run on: the embedded tiny model with a synthetic dataset and its split, and
(on CUDA) a randomly initialised model of Stable Diffusion 1.5's size, built from config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class BenchSetup:
    model_dir: Path
    dataset_dir: Path
    split_dir: Path
    resolution: int  # pixels the model trains at
    kind: str
    images: int


def tiny_setup(work_dir: Path, kind: str = "shapes", images: int = 20, seed: int = 0, resolution: int = 32,
               val_split: float = 0.2, split_seed: int = 555) -> BenchSetup:
    """The embedded tiny model (shared cache) and `images` synthetic images of `kind`, split as the pipeline does.

    The defaults are the embedded default: 20 shapes at 32 px, val 0.2 and stabilize 0.2 with the split seed the
    config uses (`rangefinder demo` and the prepare step make the same dataset).
    """
    from rangefinder.data.split import split_dataset
    from rangefinder.data.synthetic import make_synthetic_dataset
    from rangefinder.models.tiny import ensure_tiny_base_model

    work_dir = Path(work_dir)
    dataset = work_dir / f"{kind}-{images}-seed{seed}-{resolution}px"
    make_synthetic_dataset(dataset, kind=kind, count=images, seed=seed, resolution=resolution)
    split_dir = work_dir / f"split-{dataset.name}-val{val_split:g}"
    if not (split_dir / "split.json").exists():
        split_dataset(dataset, split_dir, val_split=val_split, stabilize_split=0.2, seed=split_seed)
    return BenchSetup(ensure_tiny_base_model(), dataset, split_dir, resolution, kind, images)


# Stable Diffusion 1.5's UNet (860 M parameters), VAE and CLIP ViT-L/14 text encoder, as their published configs
# give them. Weights are random: a speed benchmark needs the shapes and the FLOPs, not the trained values.
SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
)
SD15_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=512,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    scaling_factor=0.18215,
)
SD15_TEXT = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)


def sd15_sized_model(out_dir: Path, seed: int = 0) -> Path:
    """A diffusers folder with SD 1.5-sized UNet, VAE and text encoder (random weights), and the tiny model's
    tokenizer and scheduler (no download is possible; the tokenizer's vocabulary size only changes an embedding
    lookup). Reused when already there."""
    import shutil

    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from rangefinder.models.tiny import ensure_tiny_base_model

    out_dir = Path(out_dir)
    done = out_dir / "model_index.json"
    if done.exists():
        return out_dir
    tiny = ensure_tiny_base_model()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.manual_seed(seed)
    UNet2DConditionModel(**SD15_UNET).save_pretrained(tmp / "unet")
    AutoencoderKL(**SD15_VAE).save_pretrained(tmp / "vae")
    tokenizer = CLIPTokenizer.from_pretrained(tiny, subfolder="tokenizer")
    text_cfg = CLIPTextConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **SD15_TEXT)
    CLIPTextModel(text_cfg).save_pretrained(tmp / "text_encoder")
    for part in ("tokenizer", "scheduler"):
        shutil.copytree(tiny / part, tmp / part)
    shutil.copyfile(tiny / "model_index.json", tmp / "model_index.json")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def sd15_setup(work_dir: Path, images: int = 32, resolution: int = 512, model_dir: Optional[Path] = None) -> BenchSetup:
    """The SD 1.5-sized model and `images` shapes at `resolution` (512 px, SD 1.5's native size)."""
    from rangefinder.data.split import split_dataset
    from rangefinder.data.synthetic import make_synthetic_dataset

    work_dir = Path(work_dir)
    model = sd15_sized_model(model_dir or work_dir / "sd15-sized")
    dataset = work_dir / f"shapes-{images}-{resolution}px"
    make_synthetic_dataset(dataset, kind="shapes", count=images, seed=0, resolution=resolution)
    split_dir = work_dir / f"split-{dataset.name}"
    if not (split_dir / "split.json").exists():
        split_dataset(dataset, split_dir, val_split=0.2, stabilize_split=0.2, seed=555)
    return BenchSetup(model, dataset, split_dir, resolution, "shapes", images)
