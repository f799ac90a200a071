"""The small interface through which a fine-tuning method plugs into the training engine.

The engine (src/rangefinder/training/) knows nothing about full fine-tuning, LoRA or textual inversion. It asks the
method, in this order:

1. `setup(sd, weight_dtype)`: freeze what does not train, add adapters or tokens, cast frozen weights.
2. `transform_caption(text)`: e.g. textual inversion puts its placeholder token into every caption.
3. `text_encoder_changes`: whether the text encoder's output can change during training. When False the engine
   caches the text embeddings once (with the latents); when True it encodes prompts every micro-batch (how a
   prompt is encoded is the model family's business: family.py).
4. `trainable_modules()`: the modules the engine hands to accelerate (`prepare`), switches between train/eval mode
   and enables gradient checkpointing on.
5. `param_groups()`: what the optimizer updates. A group may carry `lr_scale` (its LR is the schedule's LR times
   that); every other key (e.g. `weight_decay`) is passed to the optimizer as is.
6. `after_optimizer_step()`: called after every optimizer update (e.g. textual inversion restores the embedding
   rows of the tokens it does not train). It counts the updates (`updates_taken`); overrides call super().
7. `trainable_state_dict()` / `load_trainable_state_dict()`: what a checkpoint stores (as safetensors) and how a
   resume puts it back. Keys are prefixed by the module name (`unet.`, `text_encoder.`), and `method.updates` holds
   `updates_taken`, so a resumed run's deliverables still say how many updates made them. Bit-exact round trip.
8. `save_final(sd, out_dir)`: write the deliverable (a diffusers folder, adapter files, learned embeddings) into
   an empty folder; the engine writes to a temporary name and renames it into place, and swaps EMA weights in
   before calling it when EMA is on.

EMA, the optimizer, LR schedules, checkpoints and validation stay in the engine; methods only say *what* trains.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch

from rangefinder.training.family_rules import check_method_family

if TYPE_CHECKING:
    from rangefinder.config import TrainingConfig
    from rangefinder.formats.model_spec import SpecFacts
    from rangefinder.models.loading import SDComponents


UPDATES_KEY = "method.updates"  # in `trainable_state_dict`: `updates_taken`, an int64 scalar


class Method(ABC):
    """One way of fine-tuning: which weights train, how prompts are encoded, what is saved."""

    name: ClassVar[str]
    # Whether an empty caption is something this method can train on (textual inversion: a prompt template fills
    # it). The others train on captions, and a split with captionless images (`split --captionless`) is refused.
    fills_empty_captions: ClassVar[bool] = False

    def __init__(self, cfg: TrainingConfig) -> None:
        self.cfg = cfg
        # Optimizer updates taken: the deliverables record it (A1111 shows an embedding's `step`). None when unknown
        # (resumed from a checkpoint written before it was kept).
        self.updates_taken: Optional[int] = 0
        # Epochs the weights were trained for (the run's, or the checkpoint's it was rebuilt from): the deliverables
        # record it, not the budget, so a checkpoint chosen before the end says its own. None when unknown.
        self.epochs_trained: Optional[float] = None
        # The run's title, resolution and start, which the deliverables' model spec names (set, like epochs_trained,
        # by the run's end and by a model rebuilt from a checkpoint; None: the files name no title, size or date).
        self.spec_facts: Optional[SpecFacts] = None
        # The checkpoints, by update, whose average these weights are (the fine-tune's window average,
        # steps/average.py); None: one point of the run. The deliverables name them beside the updates and epochs,
        # which are then the newest one's: the training that made the average, not a checkpoint it is.
        self.averaged_updates: Optional[tuple[int, ...]] = None

    # --- setup -------------------------------------------------------------------------------------------------

    @classmethod
    def check_family(cls, family: str) -> None:
        """ConfigError when the method cannot train a model of `family` ("sd1" | "sdxl" | "sd3" | "flux"), told from
        the name alone (family_rules.check_method_family, the rule the checks before a run apply too)."""
        check_method_family(cls.name, family)

    @abstractmethod
    def setup(self, sd: SDComponents, weight_dtype: torch.dtype) -> None:
        """Set requires_grad, add adapters/tokens, cast frozen modules to `weight_dtype` (trainable ones stay fp32).

        Called once, before caching, before the optimizer is built and before accelerate wraps anything. The VAE is
        frozen and cast by the loop; the method owns the UNet and the text encoder.
        """

    def transform_caption(self, text: str) -> str:
        """The caption the model is trained on for an item's caption (identity unless the method needs a token)."""
        return text

    @property
    @abstractmethod
    def text_encoder_changes(self) -> bool:
        """True when the text encoder's output changes during training (no text-embedding cache then)."""

    @abstractmethod
    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        """Modules holding trainable parameters, by name ('unet', 'text_encoder')."""

    @abstractmethod
    def param_groups(self) -> list[dict[str, Any]]:
        """Optimizer parameter groups: [{'params': [...], optional 'lr_scale': float, other AdamW keys}]."""

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter the optimizer updates (EMA tracks these), in a fixed order."""
        return [p for g in self.param_groups() for p in g["params"]]

    # --- during training ----------------------------------------------------------------------------------------

    def after_optimizer_step(self) -> None:
        """Hook after each optimizer update (textual inversion restores the frozen embedding rows here); overrides
        call super(), which counts the update."""
        if self.updates_taken is not None:
            self.updates_taken += 1

    # --- persistence ------------------------------------------------------------------------------------------

    @abstractmethod
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores: the trained tensors, keys prefixed 'unet.' / 'text_encoder.'."""

    @abstractmethod
    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Put back what `trainable_state_dict` returned (resume); must round-trip bit for bit."""

    @abstractmethod
    def save_final(self, sd: SDComponents, out_dir: Path) -> None:
        """Write the finished model into the empty folder `out_dir`."""

    def output_metadata(self, sd: SDComponents, extra: Optional[dict[str, Any]] = None) -> dict[str, str]:
        """The facts every file of the deliverable carries (formats.weights_file.training_metadata): the base model
        `sd` came from, the revision it resolved to (`rangefinder.base_model_revision`) and its family
        (`rangefinder.family`), the method's own settings (`extra`), the updates and
        epochs that trained the weights, and which checkpoints they average when they are an average
        (`rangefinder.averaged_updates`)."""
        from rangefinder.formats.weights_file import training_metadata

        facts = dict(extra or {})
        if getattr(sd, "family", None):  # which loader the files are for (sample and register read it)
            facts["family"] = sd.family
        if self.averaged_updates:
            facts["averaged_updates"] = list(self.averaged_updates)
        resolved = getattr(sd, "resolved", None)
        return training_metadata(self.cfg, getattr(sd, "source", None), extra=facts, updates=self.updates_taken,
                                 epochs=self.epochs_trained,
                                 base_model_revision=None if resolved is None else resolved.revision)

    def trained_prediction_type(self, sd: SDComponents) -> Optional[str]:
        """What the weights were trained to predict, for the deliverables to name their base model: the setting
        training.prediction_type, which overrides the model's, else its training scheduler's. The setting comes first
        because parts set up without the run's family keep the base model's scheduler as is, while a run's own and a
        model rebuilt from its checkpoint (training/restore.py) have the override registered (family.py
        `_checked_prediction_type`). None for a flow family, whose scheduler predicts no epsilon or v."""
        return self.cfg.prediction_type or sd.noise_scheduler.config.get("prediction_type")

    def _with_updates(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` plus the update count, for `trainable_state_dict`."""
        if self.updates_taken is not None:
            state[UPDATES_KEY] = torch.tensor(self.updates_taken, dtype=torch.int64)
        return state

    def _restore_updates(self, state: dict[str, torch.Tensor]) -> None:
        """The update count back from a checkpoint's state, for `load_trainable_state_dict`."""
        count = state.get(UPDATES_KEY)
        self.updates_taken = None if count is None else int(count)


class ModuleMethod(Method):
    """A method whose trainable parameters are those with requires_grad in a few whole modules (full fine-tuning,
    LoRA adapters): `setup` fills `self._modules` ({'unet': ..., 'text_encoder': ...}); one optimizer group."""

    _modules: dict[str, torch.nn.Module]

    def trainable_modules(self) -> dict[str, torch.nn.Module]:
        return dict(self._modules)

    def param_groups(self) -> list[dict[str, Any]]:
        params = [p for m in self._modules.values() for p in m.parameters() if p.requires_grad]
        return [{"params": params}]


def cast_frozen(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """A frozen module in `dtype`, cast only where it is not already: diffusers' ModelMixin.to warns on every cast of
    a model it lists no fp32 modules for ("should be kept in float32: []. Casting directly with `to()` can lead to
    inconsistent results"), so a Flux or SD3 LoRA run at fp32 printed it for a cast that changed nothing."""
    if any(p.dtype != dtype for p in module.parameters()):
        module.to(dtype)


def module_state(prefix: str, module: torch.nn.Module, only_trainable: bool = False) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with `prefix.` in front of each key, detached and contiguous (safetensors wants that)."""
    if only_trainable:
        names = {n for n, p in module.named_parameters() if p.requires_grad}
        items = [(n, p) for n, p in module.named_parameters() if n in names]
    else:
        items = list(module.state_dict().items())
    return {f"{prefix}.{k}": v.detach().contiguous() for k, v in items}


def split_state(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of `state` under `prefix.`, with the prefix removed."""
    cut = len(prefix) + 1
    return {k[cut:]: v for k, v in state.items() if k.startswith(prefix + ".")}
