"""bench.fixtures builds the models the GPU benchmarks run on at their published sizes, from config with random
weights (no download is possible). The sizes are checked on the meta device, where they cost nothing; the folder the
builder writes is checked by building it with the tiny SDXL's own configs and training it through the engine."""

from __future__ import annotations

import json

import pytest

# CLIP's tokenizer: 49,408 tokens, <|startoftext|> 49406, <|endoftext|> 49407 (also the padding).
CLIP_TOKENS = (49408, 49407, 49406, 49407)


@pytest.mark.parametrize("family, sizes", [
    # The published parameter counts: SD 1.5 (UNet, VAE, CLIP ViT-L/14), SDXL base 1.0 (its UNet, VAE, the same
    # ViT-L/14 and OpenCLIP ViT-bigG/14 with its projection).
    ("sd1", {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480}),
    ("sdxl", {"unet": 2_567_463_684, "vae": 83_653_863, "text_encoder": 123_060_480,
              "text_encoder_2": 694_659_840}),
])
def test_sized_parts_have_the_published_sizes(family, sizes):
    import torch

    from bench.fixtures import sized_parts

    with torch.device("meta"):
        parts = sized_parts(family, {"tokenizer": CLIP_TOKENS, "tokenizer_2": CLIP_TOKENS})
    assert {name: sum(p.numel() for p in m.parameters()) for name, m in parts.items()} == sizes


def test_a_sized_sdxl_folder_is_read_as_sdxl_and_trains(tiny_sdxl_dir, tmp_path):
    """The SDXL builder's folder, built with the tiny SDXL's configs in SDXL's layout (the full size would take
    minutes and 14 GB here): the loader reads it as SDXL, and the engine trains a LoRA on it, as the GPU session's
    SDXL-sized whole run does."""
    from bench.fixtures import SIZED, sized_model, tiny_setup
    from rangefinder.config import DataConfig, TrainingConfig, ValidationConfig
    from rangefinder.training.family_detection import detect_family
    from rangefinder.training.loop import TrainSpec, train

    parts = {}
    for folder, (cls_name, _) in SIZED["sdxl"].items():
        config = json.loads((tiny_sdxl_dir / folder / "config.json").read_text())
        if cls_name.startswith("CLIP"):  # the architecture alone: the vocabulary comes from the tokenizer
            config = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "max_position_embeddings", "hidden_act",
                                             "projection_dim")}
        parts[folder] = (cls_name, config)
    model = sized_model(tmp_path / "sdxl-sized", "sdxl", parts=parts)
    assert not (tmp_path / "sdxl-sized.tmp").exists()
    assert detect_family(model) == "sdxl"
    assert sorted(p.name for p in model.iterdir()) == sorted(
        ["model_index.json", "scheduler", "tokenizer", "tokenizer_2", "unet", "vae", "text_encoder",
         "text_encoder_2"])
    setup = tiny_setup(tmp_path, images=10, resolution=32)
    cfg = TrainingConfig(method="lora", batch_size=4, steps=2, lr=1e-4, schedule="constant", seed=0,
                         cache_dir=str(tmp_path / "cache"))
    result = train(TrainSpec(cfg, ValidationConfig(every_epochs=0), split_dir=setup.split_dir, model=str(model),
                             data=DataConfig(resolution=32)), out_dir=tmp_path / "run", save_final=False)
    summary = json.loads(result.summary_path.read_text())
    assert result.updates == 2 and summary["family"] == "sdxl", summary
