"""What `training.use_ema` holds in memory (issue 34: the EMA's cost before it is a default): the bytes of diffusers'
`EMAModel` copy of the trained weights, for full fine-tuning and for LoRA at the shipped adapter settings, on UNets of
Stable Diffusion 1.5's and SDXL's published sizes.

The models are built on PyTorch's meta device: every tensor has its shape and dtype and no storage, so the count needs
no GPU and no 10 GB of memory. What is counted is what the engine builds (training.setup.prepare_run): the engine's own
method (rangefinder.training.methods) set up on the UNet, its trainable parameters handed to `EMAModel`, whose
`shadow_params` are the copy the EMA keeps on the training device. That copy is the EMA's whole resident cost: its
update (`EMAModel.step`, not foreach, as the engine makes it) works parameter by parameter, with two temporaries of one
parameter's size, so its scratch is at most twice the largest parameter, reported too.

    python -m bench.ema_memory [--out bench/results/ema_memory.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from bench.fixtures import SD15_UNET, SDXL_UNET

UNETS = {"sd15": (SD15_UNET, "sd1"), "sdxl": (SDXL_UNET, "sdxl")}  # name -> (UNet config, the model family)


def ema_bytes(unet_config: dict[str, Any], method: str, family: str = "sd1") -> dict[str, Any]:
    """The EMA's copy for `method` (full or lora, the shipped settings) on a UNet of `unet_config`: the engine's own
    method set up on it (the denoiser alone: no text encoder is trained by default), its trainable parameters handed
    to EMAModel as training.setup.prepare_run hands them."""
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel

    from rangefinder.config import TrainingConfig
    from rangefinder.models.loading import SDComponents
    from rangefinder.training.methods import make_method

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(unet_config)
        model_params = sum(p.numel() for p in unet.parameters())
        engine = make_method(TrainingConfig(method=method))
        engine.setup(SDComponents(unet=unet, vae=None, text_encoder=None, tokenizer=None, noise_scheduler=None,
                                  source="meta device", family=family), torch.float32)
        trainable = list(engine.trainable_parameters())
        ema = EMAModel(trainable, decay=0.9999)
    copy = sum(t.numel() * t.element_size() for t in ema.shadow_params)
    return {"method": method, "model_parameters": model_params,
            "trained_parameters": sum(p.numel() for p in trainable), "ema_bytes": copy,
            "largest_parameter_bytes": max(t.numel() * t.element_size() for t in ema.shadow_params),
            "dtype": str(ema.shadow_params[0].dtype)}


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m bench.ema_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write the rows as JSON here too")
    args = p.parse_args(argv)
    rows = [{"unet": name, **ema_bytes(cfg, method, family)} for name, (cfg, family) in UNETS.items()
            for method in ("full", "lora")]
    print("| UNet | method | trained parameters | EMA copy | the update's scratch (twice the largest parameter) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['unet']} | {r['method']} | {r['trained_parameters']:,} of {r['model_parameters']:,} | "
              f"{r['ema_bytes'] / 1e6:,.1f} MB ({r['dtype']}) | {2 * r['largest_parameter_bytes'] / 1e6:,.3f} MB |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
