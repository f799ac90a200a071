"""LoRA (Hu et al. 2021, arXiv:2106.09685) through peft: low-rank adapters on the UNet's attention projections.

The base weights are frozen (and may be cast to half); only the adapters train, stay fp32, enter the optimizer and
go into checkpoints. The adapter output is scaled by alpha / rank, as in peft and kohya's sd-scripts. The text
encoder gets adapters too when `training.lora.train_text_encoder` (or `training.train_text_encoder`) is set, on
CLIP's attention projections as in diffusers' LoRA examples.

Outputs in `final/` (src/rangefinder/formats/lora.py): `pytorch_lora_weights.safetensors` (diffusers'
`load_lora_weights` and ComfyUI; alpha/rank folded into the weights) and `lora_kohya.safetensors` (kohya's layout
with `.alpha`: A1111, ComfyUI, kohya), both with the run's metadata.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rangefinder.config import FAMILY_NAMES
from rangefinder.errors import ConfigError
from rangefinder.training.families import family_rules
from rangefinder.training.family_detection import FAMILY_LAYOUTS, import_named
from rangefinder.training.methods.base import ModuleMethod, cast_frozen, module_state, split_state

if TYPE_CHECKING:
    from rangefinder.models.loading import SDComponents

# CLIP's attention projections (transformers' CLIPAttention), the text-encoder counterpart of to_q/to_k/to_v/to_out.0.
TEXT_ENCODER_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "out_proj"]
# The layer types peft's LoRA wraps (peft.tuners.lora.layer's dispatchers).
_ADAPTABLE = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
# A path's repeated-block prefix (`down_blocks.0.attentions.1.transformer_blocks.0.`, `single_transformer_blocks.3.`),
# cut off to name a layer as it recurs in every block.
_BLOCK_PREFIX = re.compile(r"^(.*\.)?(transformer_blocks|single_transformer_blocks|attentions|resnets|layers)\.\d+\.")


def check_target_modules(denoiser: torch.nn.Module, targets: list[str], family: str) -> None:
    """Every name of training.lora.target_modules names a layer of the denoiser as peft matches it (the module's
    path, or its end after a dot: peft.tuners.tuners_utils.check_target_module_exists): a name of another trainer's
    layout (kohya's `img_attn.qkv` for Flux) stopped a run in peft's traceback when no name matched, and was skipped
    without a word when another did."""
    layers = [n for n, m in denoiser.named_modules() if isinstance(m, _ADAPTABLE)]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in layers)]
    if missing:
        names = sorted({_BLOCK_PREFIX.sub("", n) for n in layers})
        denoiser_name = {"unet": "UNet"}.get(FAMILY_LAYOUTS[family].denoiser, FAMILY_LAYOUTS[family].denoiser)
        raise ConfigError(f"training.lora.target_modules: {', '.join(map(repr, missing))} names no layer of the "
                          f"{FAMILY_NAMES.get(family, family)} {denoiser_name} (diffusers' module "
                          f"paths, or their ends, as peft matches them); name some of its layers: {', '.join(names)}")


class LoraMethod(ModuleMethod):
    name = "lora"

    def setup(self, sd: SDComponents, weight_dtype: torch.dtype) -> None:
        from peft import LoraConfig

        s = self.cfg.lora
        sd.unet.requires_grad_(False)
        cast_frozen(sd.unet, weight_dtype)
        for te in sd.text_encoders().values():
            te.requires_grad_(False)
            te.to(weight_dtype)
        # Gaussian init of A and zero B (peft's "gaussian", as diffusers' LoRA examples): the adapter starts as a no-op,
        # so update 0 validates the base model itself.
        # peft annotates lora_alpha as int but only uses lora_alpha / r, so a fractional alpha is fine.
        alpha: Any = s.alpha
        check_target_modules(sd.unet, list(s.target_modules), sd.family)
        sd.unet.add_adapter(
            LoraConfig(r=s.rank, lora_alpha=alpha, lora_dropout=s.dropout, init_lora_weights="gaussian",
                       target_modules=list(s.target_modules))
        )
        self._modules: dict[str, torch.nn.Module] = {"unet": sd.unet}
        if self._lora_text_encoder:
            for name, te in sd.text_encoders().items():  # SDXL: both encoders
                te.add_adapter(
                    LoraConfig(r=s.rank, lora_alpha=alpha, lora_dropout=s.dropout, init_lora_weights="gaussian",
                               target_modules=TEXT_ENCODER_TARGET_MODULES)
                )
                self._modules[name] = te
        for m in self._modules.values():
            for p in m.parameters():
                if p.requires_grad:  # the adapters: fp32 master weights under mixed precision
                    p.data = p.data.float()
        self._sd = sd

    @property
    def _lora_text_encoder(self) -> bool:
        # `training.train_text_encoder` (the CLI's flag) means the same for LoRA: adapters on the text encoder too.
        return self.cfg.lora.train_text_encoder or self.cfg.train_text_encoder

    @property
    def text_encoder_changes(self) -> bool:
        return self._lora_text_encoder

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for name, module in self._modules.items():
            state.update(module_state(name, module, only_trainable=True))
        return self._with_updates(state)

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, module in self._modules.items():
            part = split_state(state, name)
            params = {n: p for n, p in module.named_parameters() if p.requires_grad}
            if set(part) != set(params):
                missing, extra = sorted(set(params) - set(part)), sorted(set(part) - set(params))
                raise ValueError(
                    f"LoRA checkpoint does not match the adapters of {name} (missing {missing[:3]}, unexpected "
                    f"{extra[:3]}); resume with the same training.lora settings"
                )
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(part[n])
        self._restore_updates(state)

    def save_final(self, sd: SDComponents, out_dir: Path) -> None:
        lora = self.cfg.lora
        meta = self.output_metadata(sd, extra={"lora_rank": str(lora.rank), "lora_alpha": repr(float(lora.alpha)),
                                               "lora_target_modules": lora.target_modules})
        te = sd.text_encoder if "text_encoder" in self._modules else None
        te_2 = sd.text_encoder_2 if "text_encoder_2" in self._modules else None
        # Diffusers' names and kohya's, in the family's layout (formats/lora.py); both name the base model, by the
        # denoiser's config and what it was trained to predict, in their model spec.
        # The kohya file also says, in sd-scripts' keys, how a flow model's objective trained (family_rules.py).
        trainer = family_rules(sd.family).kohya_training_metadata(self.cfg.flow, sd.noise_scheduler.config,
                                                                  sd.unet.config)
        import_named(FAMILY_LAYOUTS[sd.family].lora_export)(out_dir, sd.unet, te, te_2,
                                                            meta,
                                                            prediction_type=self.trained_prediction_type(sd),
                                                            facts=self.spec_facts, trainer_metadata=trainer)
