"""The plain text-to-image fine-tuning step, as diffusers' example trainer does it: the baseline the engine is timed
against (bench/speed_vs_reference.py).

Per micro-batch it does everything again: read and preprocess the images, tokenize the captions, encode the images
with the VAE (a posterior sample, times the scaling factor), run the frozen text encoder, then the UNet forward and
backward, clip, and step a plain AdamW (torch's default implementation, no fused kernel). Nothing is cached, the
attention is whatever diffusers picks by default, and precision is accelerate's mixed precision with the frozen
VAE and text encoder cast to the mixed dtype, as in the example. Written here from the description of that recipe
(diffusers `examples/text_to_image/train_text_to_image.py`); nothing else in the project uses it.

The engine's extras (cached latents and text, fused AdamW, deterministic batching, logging) are what the comparison
measures, so this loop deliberately has none of them. It trains on the same split folder, images and preprocessing
(rangefinder.data.pixels) as the engine, so the two see the same data.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F


@dataclass
class ReferenceResult:
    updates: int
    images: int
    setup_seconds: float  # model load, optimizer, data loader
    loop_seconds: float  # first update to last, CUDA synchronised
    updates_per_second: float
    images_per_second: float
    final_loss: float
    device: str
    mixed_precision: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _CaptionedImages(torch.utils.data.Dataset):
    """The split's training items: (3, H, W) pixels in [-1, 1] and (77,) token ids, made anew on every access."""

    def __init__(self, split_dir: Union[str, Path], tokenizer, resolution: int) -> None:
        from rangefinder.data.split import read_split

        split = read_split(split_dir)
        self.paths = [split.path_of(it) for it in split.train]
        self.captions = [it.text for it in split.train]
        self.tokenizer, self.resolution = tokenizer, resolution

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        from rangefinder.data.pixels import load_rgb, to_model_array

        pixels = torch.from_numpy(to_model_array(load_rgb(self.paths[i]), self.resolution, center_crop=True))
        ids = self.tokenizer(
            self.captions[i], max_length=self.tokenizer.model_max_length, padding="max_length", truncation=True,
            return_tensors="pt",
        ).input_ids[0]
        return {"pixel_values": pixels, "input_ids": ids}


def train_reference(
    model_dir: Union[str, Path],
    split_dir: Union[str, Path],
    *,
    updates: int,
    batch_size: int,
    resolution: int,
    lr: float = 1e-5,
    mixed_precision: str = "no",
    max_grad_norm: float = 1.0,
    seed: int = 0,
    gradient_checkpointing: bool = False,
    timed_from: int = 0,
) -> ReferenceResult:
    """Train the UNet of the model folder for `updates` optimizer steps of `batch_size` images; time the loop.

    `timed_from`: that many updates first, untimed (the first updates carry allocation and cuDNN's autotuning); the
    result counts and times the `updates` after them."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from diffusers.optimization import get_scheduler
    from transformers import CLIPTextModel, CLIPTokenizer

    t_setup = time.perf_counter()
    # accelerate keeps its settings process-wide; this run may use another precision than the run before it.
    AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision=mixed_precision)
    set_seed(seed)
    model_dir = str(model_dir)
    noise_scheduler = DDPMScheduler.from_pretrained(model_dir, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(model_dir, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(model_dir, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet")
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.train()
    if gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision, torch.float32)
    # Frozen parts in the mixed dtype; the trained UNet stays fp32 and autocast does the half-precision maths.
    for frozen in (vae, text_encoder):
        frozen.to(accelerator.device) if weight_dtype == torch.float32 else frozen.to(accelerator.device, weight_dtype)

    optimizer = torch.optim.AdamW(unet.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    dataset = _CaptionedImages(split_dir, tokenizer, resolution)
    if len(dataset) < batch_size:
        # drop_last with fewer images than a batch yields no batch at all, and the update loop below would spin
        # forever (it did, at batch 48 on 38 images, in the first GPU session).
        raise ValueError(f"the reference loop needs at least batch_size={batch_size} training images (it drops the "
                         f"last partial batch); the split has {len(dataset)}: use a larger dataset or a smaller batch")
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=True, num_workers=0, generator=torch.Generator().manual_seed(seed),
        # Every update sees exactly batch_size images, as the engine's (epoch-straddling) micro-batches do, so
        # images/s = batch_size x updates/s for both; the callers size the dataset for their largest batch.
        drop_last=True,
    )
    lr_scheduler = get_scheduler("constant", optimizer=optimizer, num_warmup_steps=0, num_training_steps=updates)
    unet, optimizer, loader, lr_scheduler = accelerator.prepare(unet, optimizer, loader, lr_scheduler)
    prediction_type = noise_scheduler.config.prediction_type
    num_timesteps = noise_scheduler.config.num_train_timesteps
    setup_seconds = time.perf_counter() - t_setup

    def synchronize() -> None:
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()

    done, images, loss_value = 0, 0, float("nan")
    synchronize()
    t0 = time.perf_counter()
    updates += timed_from
    while done < updates:
        for batch in loader:
            with accelerator.accumulate(unet):
                # (B, 4, h, w): the VAE runs on every batch, a fresh posterior sample each time.
                latents = vae.encode(batch["pixel_values"].to(weight_dtype)).latent_dist.sample()
                latents = latents * vae.config.scaling_factor
                noise = torch.randn_like(latents)
                bsz = latents.shape[0]
                timesteps = torch.randint(0, num_timesteps, (bsz,), device=latents.device).long()
                noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
                # (B, 77, D): the frozen text encoder also runs on every batch.
                encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
                if prediction_type == "epsilon":
                    target = noise
                elif prediction_type == "v_prediction":
                    target = noise_scheduler.get_velocity(latents, noise, timesteps)
                else:
                    raise ValueError(f"unknown prediction type {prediction_type!r}")
                model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
                loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(unet.parameters(), max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                done += 1
                images += bsz
                loss_value = float(loss.detach())  # as the example logs it: one sync per update
                if done == timed_from and timed_from:  # the untimed first updates are over: the clock starts
                    synchronize()
                    t0 = time.perf_counter()
                    images = 0
                if done >= updates:
                    break
    synchronize()
    loop_seconds = time.perf_counter() - t0
    done -= timed_from
    return ReferenceResult(
        updates=done,
        images=images,
        setup_seconds=setup_seconds,
        loop_seconds=loop_seconds,
        updates_per_second=done / loop_seconds,
        images_per_second=images / loop_seconds,
        final_loss=loss_value,
        device=str(accelerator.device),
        mixed_precision=mixed_precision,
    )


def main(argv: Optional[list[str]] = None) -> None:
    """`python -m bench.reference_loop`: the reference loop alone on the embedded tiny model (a quick look)."""
    import argparse
    import tempfile

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--updates", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    from bench.fixtures import tiny_setup

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        setup = tiny_setup(Path(tmp), "shapes", images=20, seed=0)
        r = train_reference(setup.model_dir, setup.split_dir, updates=args.updates, batch_size=args.batch_size,
                            resolution=setup.resolution)
    print(r.as_dict())


if __name__ == "__main__":
    main()
