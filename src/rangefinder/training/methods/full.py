"""Full fine-tuning: every UNet weight trains (and the text encoder's, when asked); the result is a whole pipeline."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rangefinder.training.family_detection import FAMILY_LAYOUTS, import_named
from rangefinder.training.methods.base import ModuleMethod, module_state, split_state

if TYPE_CHECKING:
    from rangefinder.models.loading import SDComponents


class FullFineTune(ModuleMethod):
    name = "full"

    def setup(self, sd: SDComponents, weight_dtype: torch.dtype) -> None:
        # Trainable weights stay fp32 under mixed precision (autocast computes in half; training.weights_dtype bf16
        # casts them down after, keeping an fp32 master); the frozen text encoder can be cast down to save memory.
        self._modules: dict[str, torch.nn.Module] = {"unet": sd.unet}
        sd.unet.requires_grad_(True)
        _cast(sd.unet, torch.float32)
        for name, te in sd.text_encoders().items():  # SDXL, SD3: both CLIP encoders
            if self.cfg.train_text_encoder:
                te.requires_grad_(True)
                _cast(te, torch.float32)
                self._modules[name] = te
                for frozen in FAMILY_LAYOUTS[sd.family].frozen:  # SD3's CLIP-L projection: the identity
                    part, _, param = frozen.partition(".")
                    if part == name:
                        te.get_submodule(param).requires_grad_(False)
            else:
                te.requires_grad_(False)
                _cast(te, weight_dtype)

    @property
    def text_encoder_changes(self) -> bool:
        return self.cfg.train_text_encoder

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for name, module in self._modules.items():
            state.update(module_state(name, module))
        return self._with_updates(state)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, module in self._modules.items():
            module.load_state_dict(split_state(state, name), strict=True)
        self._restore_updates(state)

    def save_final(self, sd: SDComponents, out_dir: Path) -> None:
        from rangefinder.formats.single_file import SINGLE_FILE_NAME

        save_pipeline(sd, out_dir)
        meta = self.output_metadata(sd)
        # The same weights as one file in the layout ComfyUI and A1111 load: the original SD or SGM layout
        # (formats/single_file.py), Stability's SD3 layout (single_file_sd3.py), Flux's transformer in Black Forest
        # Labs' layout (flux_layout.py).
        import_named(FAMILY_LAYOUTS[sd.family].single_file_export)(out_dir, out_dir / SINGLE_FILE_NAME, meta,
                                                                   facts=self.spec_facts)


def save_pipeline(sd: SDComponents, out_dir: Path) -> None:
    """The family's pipeline folder (StableDiffusion, StableDiffusionXL, StableDiffusion3 or FluxPipeline; diffusers
    layout) that `from_pretrained` loads, in fp32 safetensors, under transformers 4.x and 5.x alike (see
    `formats.diffusers_folder.save_pipeline_folder`)."""
    import diffusers

    from rangefinder.formats.diffusers_folder import save_pipeline_folder
    from rangefinder.training.samples import sampling_scheduler

    layout = FAMILY_LAYOUTS[sd.family]
    # A copy: the pipeline's constructor rewrites outdated scheduler configs in place. Either predicts what the
    # training scheduler does: training.prediction_type, which the family registered there.
    scheduler = type(sd.noise_scheduler).from_config(sd.noise_scheduler.config)
    if layout.samples_with_its_scheduler and sd.model_dir is not None and (sd.model_dir / "scheduler").is_dir():
        scheduler = sampling_scheduler(sd)  # the base model's own (SD 1.5 ships PNDM, SDXL Euler), not DDPM
    parts = {layout.denoiser: sd.unet, "vae": sd.vae, "text_encoder": sd.text_encoder, "tokenizer": sd.tokenizer,
             "scheduler": scheduler, **{name: getattr(sd, name) for name in layout.parts}}
    pipe: Any = getattr(diffusers, layout.pipeline)(**parts, **dict(layout.pipeline_kwargs))
    # Frozen parts may have been cast to half for training; the saved model is fp32 like its base.
    modules = (("vae", sd.vae), *sd.text_encoders().items(), ("unet", sd.unet),
               *((("text_encoder_3", sd.text_encoder_3),) if sd.text_encoder_3 is not None else ()))
    dtypes = {n: m.dtype for n, m in modules}
    try:
        for n in dtypes:
            _cast(getattr(sd, n), torch.float32)
        save_pipeline_folder(pipe, out_dir)
    finally:
        for n, dt in dtypes.items():
            _cast(getattr(sd, n), dt)


def _cast(module: torch.nn.Module, dtype: torch.dtype) -> None:
    # Only when needed: diffusers warns on every cast of a loaded model.
    if module.dtype != dtype:
        module.to(dtype)
