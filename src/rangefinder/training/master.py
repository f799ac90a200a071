"""training.weights_dtype: bf16. The trained module's weights are held in bf16 and its forward runs without autocast,
while the optimizer steps an fp32 master copy of them: the gradients are cast into the master once per update, and
the stepped master is copied back into the bf16 weights. Checkpoints, the EMA and the saved model read the master.

Under bf16 autocast (weights_dtype fp32, the default) every use of an fp32 weight is cast to bf16, and group norm
and softmax cast their bf16 inputs up to fp32 and back: on an H100 those copies were 28 % of the UNet's GPU time
(bench/RESULTS.md, "GPU rows measured"). Mixed precision with master weights in the optimizer is the other common
recipe (Micikevicius et al. 2018, "Mixed Precision Training", section 3.1); no library in the project's stack offers
it for a single process without taking over the training loop (DeepSpeed's bf16 optimizer, FSDP's mixed precision
policy), so it is these few lines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rangefinder.errors import ConfigError


class MasterWeights:
    """fp32 masters of a module's bf16 parameters, in the same order."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        with torch.no_grad():
            self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
        self._master_of = {id(p): m for p, m in zip(params, self.masters, strict=True)}

    def param_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The method's optimizer parameter groups with each parameter replaced by its master."""
        return [{**g, "params": [self._master_of[id(p)] for p in g["params"]]} for g in groups]

    def gradients_in(self) -> None:
        """The update's accumulated bf16 gradients, cast into the masters' (and freed from the bf16 weights)."""
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    def weights_out(self) -> None:
        """The masters, rounded into the bf16 weights the forward runs with."""
        with torch.no_grad():
            torch._foreach_copy_(list[torch.Tensor](self.params), list[torch.Tensor](self.masters))

    @contextlib.contextmanager
    def fp32_weights(self) -> Iterator[None]:
        """The module's parameters *are* the fp32 masters while inside (their storage, not a copy): what is read from
        the module inside (a checkpoint's or the saved model's weights) is the master, and what is loaded into it
        inside (a resumed checkpoint's) goes into the master. The bf16 weights are refreshed from the masters after."""
        kept = [p.data for p in self.params]
        for p, m in zip(self.params, self.masters, strict=True):
            p.data = m.data
        try:
            yield
        finally:
            for p, k in zip(self.params, kept, strict=True):
                p.data = k
            self.weights_out()


def to_bf16_module(module: torch.nn.Module) -> None:
    """`module` in bf16, and its floating inputs of two or more dimensions (latents, text states, SDXL's time ids)
    cast to bf16 as they come in: without autocast the forward computes in its weights' dtype. One-dimensional ones
    (timesteps) are left to the model, which embeds them in fp32 and casts the embedding itself."""
    module.to(torch.bfloat16)

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(torch.bfloat16) if x.is_floating_point() and x.dim() >= 2 else x
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(cast(v) for v in x)
        return x

    def pre_hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return cast(args), cast(kwargs)

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)


def check_bf16_weights(mixed_precision: str, processes: int) -> None:
    """What weights_dtype bf16 needs of the machine, checked where the run starts (the config allows `auto`)."""
    if mixed_precision != "bf16":
        raise ConfigError(f"training.weights_dtype: bf16 needs bf16 mixed precision, but this run resolved "
                          f"mixed_precision to {mixed_precision!r} (auto is bf16 only on a GPU that has it); set "
                          f"training.mixed_precision: bf16, or weights_dtype: fp32")
    if processes > 1:
        raise ConfigError(f"training.weights_dtype: bf16 runs in one process (this run has {processes}): its "
                          f"gradients would be all-reduced in bf16, which is not measured; set weights_dtype: fp32")
