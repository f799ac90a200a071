"""bench.ema_memory counts what the engine's EMA holds: on the embedded tiny model, the same trained parameters as
the engine's own methods train (full and LoRA, built on real weights), and the copy diffusers' EMAModel makes of
them, byte for byte, from the meta-device build the bench uses for the full-size UNets."""

from __future__ import annotations

import json


def test_the_count_is_the_engine_s_trained_weights_and_their_fp32_copy(tiny_model_dir):
    import torch

    from bench.ema_memory import ema_bytes
    from rangefinder.config import ModelConfig, TrainingConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.methods import make_method

    unet_config = json.loads((tiny_model_dir / "unet" / "config.json").read_text())
    for method in ("full", "lora"):
        row = ema_bytes(unet_config, method)
        engine = make_method(TrainingConfig(method=method))
        engine.setup(load_sd_components(ModelConfig(base_model=str(tiny_model_dir))), torch.float32)
        trained = [p for p in engine.trainable_parameters() if p.requires_grad]
        assert row["trained_parameters"] == sum(p.numel() for p in trained), method
        assert row["ema_bytes"] == 4 * row["trained_parameters"] and row["dtype"] == "torch.float32"
        assert row["largest_parameter_bytes"] == 4 * max(p.numel() for p in trained)
    # LoRA trains a small share of the UNet; full fine-tuning all of it.
    assert ema_bytes(unet_config, "full")["trained_parameters"] == row["model_parameters"]
    assert row["trained_parameters"] < row["model_parameters"] / 10
