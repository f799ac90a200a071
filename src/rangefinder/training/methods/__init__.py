"""Fine-tuning methods behind one interface (base.Method). `make_method(cfg)` picks one by `training.method`."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from rangefinder.errors import ConfigError

if TYPE_CHECKING:
    from rangefinder.config import TrainingConfig
    from rangefinder.training.methods.base import Method

# training.method -> "module:Class"; imported only when chosen.
METHODS = {
    "full": "rangefinder.training.methods.full:FullFineTune",
    "lora": "rangefinder.training.methods.lora:LoraMethod",
    "textual_inversion": "rangefinder.training.methods.textual_inversion:TextualInversion",
}


def make_method(cfg: TrainingConfig) -> Method:
    target = METHODS.get(cfg.method)
    if target is None:
        raise ConfigError(f"training.method: unknown method {cfg.method!r}; choose one of {', '.join(METHODS)}")
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise ConfigError(f"training.method: {cfg.method!r} is not available in this build; use 'full'") from None
    return getattr(module, cls_name)(cfg)
