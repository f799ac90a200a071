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
    return method_class(cfg.method)(cfg)


def method_class(name: str) -> type[Method]:
    """The class of training.method `name` (imported now); ConfigError for a name or a module this build lacks."""
    target = METHODS.get(name)
    if target is None:
        raise ConfigError(f"training.method: unknown method {name!r}; choose one of {', '.join(METHODS)}")
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise ConfigError(f"training.method: {name!r} is not available in this build; use 'full'") from None
    cls: type[Method] = getattr(module, cls_name)
    return cls
