"""The model and data the benchmarks run on: the embedded tiny model with a synthetic dataset and its split, and
(on CUDA) a randomly initialised model of Stable Diffusion 1.5's size, built from config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


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


# SDXL base 1.0's UNet (2.57 B parameters), VAE and two text encoders (CLIP ViT-L/14 and OpenCLIP ViT-bigG/14, the
# second with its projection), as their published configs give them.
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
)
SDXL_VAE = {**SD15_VAE, "sample_size": 1024, "scaling_factor": 0.13025}
SDXL_TEXT = {**SD15_TEXT, "projection_dim": 768}
SDXL_TEXT_2 = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                   max_position_embeddings=77, hidden_act="gelu", projection_dim=1280)
# family -> the parts a sized model has: folder -> (class name, config); the text encoders take the vocabulary of the
# tiny model's tokenizer beside them.
SIZED = {
    "sd1": {"unet": ("UNet2DConditionModel", SD15_UNET), "vae": ("AutoencoderKL", SD15_VAE),
            "text_encoder": ("CLIPTextModel", SD15_TEXT)},
    "sdxl": {"unet": ("UNet2DConditionModel", SDXL_UNET), "vae": ("AutoencoderKL", SDXL_VAE),
             "text_encoder": ("CLIPTextModel", SDXL_TEXT),
             "text_encoder_2": ("CLIPTextModelWithProjection", SDXL_TEXT_2)},
}


def tokenizer_for(text_encoder: str) -> str:
    """The folder of the tokenizer beside a text encoder's folder (text_encoder_2 -> tokenizer_2)."""
    return text_encoder.replace("text_encoder", "tokenizer")


def sized_parts(family: str, tokens: dict[str, tuple[int, int, int, int]],
                parts: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The randomly initialised modules of a `family` model at its published size (or of `parts`, the same layout
    with other configs), each text encoder with the vocabulary size and pad, bos and eos ids its tokenizer has
    (`tokens`, by tokenizer folder). Built on the current default device: under `torch.device("meta")` they cost no
    memory, which is how the sizes are checked."""
    import diffusers
    import transformers

    built: dict[str, Any] = {}
    for folder, (cls_name, config) in (parts or SIZED[family]).items():
        if cls_name.startswith("CLIP"):
            vocab, pad, bos, eos = tokens[tokenizer_for(folder)]
            cfg = transformers.CLIPTextConfig(vocab_size=vocab, pad_token_id=pad, bos_token_id=bos,
                                              eos_token_id=eos, **config)
            built[folder] = getattr(transformers, cls_name)(cfg)
        else:
            built[folder] = getattr(diffusers, cls_name).from_config(config)
    return built


def sized_model(out_dir: Path, family: str = "sd1", seed: int = 0, device: Optional[str] = None,
                parts: Optional[dict[str, Any]] = None) -> Path:
    """A diffusers folder of a `family` model at its published size (SIZED; or `parts`), random weights, with the
    embedded tiny model's tokenizers, scheduler and model_index.json (no download is possible; a tokenizer's
    vocabulary size only changes an embedding lookup). `device` builds the modules there (a GPU initialises SDXL's
    3.4 B parameters in seconds, where a CPU takes minutes); they are saved in fp32 either way. Reused when already
    there; written beside and renamed, so a half-written folder never looks finished."""
    import shutil

    import torch
    from transformers import CLIPTokenizer

    from rangefinder.models.loading import TINY_MODELS, import_named

    out_dir = Path(out_dir)
    if (out_dir / "model_index.json").exists():
        return out_dir
    tiny = Path(import_named(TINY_MODELS[family])(None))
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    layout = parts or SIZED[family]
    tokenizers = [tokenizer_for(f) for f in layout if f.startswith("text_encoder")]
    tokens = {}
    for t in tokenizers:
        tok = CLIPTokenizer.from_pretrained(tiny, subfolder=t)
        tokens[t] = (len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        built = sized_parts(family, tokens, parts)
    for folder, module in built.items():
        module.save_pretrained(tmp / folder)
    for part in (*tokenizers, "scheduler"):
        shutil.copytree(tiny / part, tmp / part)
    shutil.copyfile(tiny / "model_index.json", tmp / "model_index.json")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def sd15_sized_model(out_dir: Path, seed: int = 0) -> Path:
    """The SD 1.5-sized model (sized_model for sd1). Reused when already there."""
    return sized_model(out_dir, "sd1", seed)


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
