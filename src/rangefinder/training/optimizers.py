"""training.optimizer: the optimizers users of diffusion trainers expect, made from the run's parameter groups.

- adamw: torch AdamW (fused where the build has it), with training.adam_beta1/2, adam_epsilon and weight_decay;
- adamw8bit: bitsandbytes AdamW8bit with the same settings (CUDA only);
- prodigy: prodigyopt's Prodigy (LR-free: it estimates the step size d; the LR multiplies it, 1.0 by default),
  with training.prodigy's arguments (unset: the package's defaults);
- prodigy_schedule_free: prodigy-plus-schedule-free's ProdigyPlusScheduleFree (LR-free and schedule-free);
- adamw_schedule_free: schedulefree's AdamWScheduleFree (schedule-free: a constant LR, weights averaged);
- adafactor: transformers' Adafactor, with relative_step, scale_parameter and warmup_init off so that the run's LR
  (training.lr, the range test's ramp) is the LR it steps with: the setting transformers' documentation gives for
  an external LR; otherwise Adafactor computes its own time-dependent LR and ignores the one it is given.

Every optimizer but AdamW starts from its package's own documented defaults (betas, eps, weight decay, d0, ...):
those are what a user of the package gets, and what the bench compares. Each keeps its whole state in
`state_dict()` (tensors, numbers, strings, None), which a checkpoint saves and `torch.load(weights_only=True)` reads
back, so a resumed run continues bit for bit (tests/training/test_optimizers.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from rangefinder.config import TrainingConfig
from rangefinder.errors import ConfigError

if TYPE_CHECKING:
    import torch

# The pip package each optimizer but adamw and adafactor needs: prodigyopt is a dependency of rangefinder (the
# prodigy_step LR finder trains with it); the others come with the extra `optimizers` (pip install
# 'rangefinder[optimizers]'), bitsandbytes with `cuda`.
PACKAGES = {"prodigy": "prodigyopt", "prodigy_schedule_free": "prodigy-plus-schedule-free",
            "adamw_schedule_free": "schedulefree", "adamw8bit": "bitsandbytes"}
# Prodigy as diffusers' advanced_diffusion_training README recommends it (lr 1.0, the constant schedule, these
# arguments): what the prodigy_step LR finder trains with (rangefinder.steps.prodigy_step_size), as training.prodigy.
PRODIGY_SETTINGS: dict[str, Any] = {"betas": (0.9, 0.99), "weight_decay": 0.01, "use_bias_correction": True,
                                    "safeguard_warmup": True}


def check_optimizer(cfg: TrainingConfig, cuda: bool, instead: str = "choose training.optimizer: adamw on this machine"
                    ) -> None:
    """What can be known before loading anything: adamw8bit needs CUDA (`cuda`: whether the machine that trains has
    it; `instead`: the fix there)."""
    if cfg.optimizer == "adamw8bit" and not cuda:
        raise ConfigError(f"training.optimizer adamw8bit (use_8bit_adam) needs a CUDA GPU (bitsandbytes); {instead}")


def make_optimizer(cfg: TrainingConfig, groups: list[dict], lr: float) -> torch.optim.Optimizer:
    """The run's optimizer over `groups` (method.param_groups()), at `lr` (the schedule's first LR)."""
    import torch  # here, not above: `compile` checks the optimizer (check_optimizer) without loading torch

    name = cfg.optimizer
    if name in ("adamw", "adamw8bit"):
        kwargs: dict[str, Any] = dict(
            lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay
        )
        if name == "adamw8bit":
            bnb = _package(name, "bitsandbytes", "'rangefinder[cuda]'")
            return bnb.optim.AdamW8bit(groups, **kwargs)
        # The fused kernel does the whole update in one pass (CUDA, and CPU in recent torch); not in older builds.
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError, ValueError):
            return torch.optim.AdamW(groups, **kwargs)
    if name == "prodigy":
        return require_prodigy(f"training.optimizer {name}").Prodigy(groups, lr=lr, **cfg.prodigy.kwargs())
    if name == "prodigy_schedule_free":
        plus = _package(name, "prodigyplus", "'rangefinder[optimizers]'")
        return plus.ProdigyPlusScheduleFree(groups, lr=lr)
    if name == "adamw_schedule_free":
        optimizer = _package(name, "schedulefree", "'rangefinder[optimizers]'").AdamWScheduleFree(groups, lr=lr)
        optimizer.train()  # it starts in eval mode and refuses to step there
        return optimizer
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    raise ConfigError(f"training.optimizer {name!r} is not one this version knows")  # the config's Literal stops it


def step_optimizer(name: str, optimizer: Any) -> dict[str, Optional[float]]:
    """Take the optimizer's step (`name`: training.optimizer); returns the step sizes of its row of updates.csv, of
    the first parameter group (the method's main one):

    - `lr_effective`: the step size this update took. Prodigy's d x lr, and with use_bias_correction its bias
      correction (prodigyopt's dlr; prodigy-plus-schedule-free's get_dlr with its rectification), read before the
      step, which then moves d for the next one; schedule-free AdamW's warmed-up LR; else the LR it was given (AdamW
      and AdamW8bit apply their bias correction to their moments, not to it; Adafactor steps with it, its own LR off).
    - `prodigy_d_lr`: Prodigy's d x lr after the update, its estimate of the step size for the next one, without
      the bias correction: what lr_finder prodigy_step reads (analysis.prodigy_step); None for the others.
    """
    group = optimizer.param_groups[0]
    lr_free = name in ("prodigy", "prodigy_schedule_free")
    took: Any = None
    if name == "prodigy":
        # prodigyopt's step: dlr = d * lr * bias_correction, of the shared d and the largest group lr, at its count k.
        beta1, beta2 = group["betas"]
        k = group["k"]
        bias_correction = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1)) if group["use_bias_correction"] \
            else 1
        took = group["d"] * max(g["lr"] for g in optimizer.param_groups) * bias_correction
    elif name == "prodigy_schedule_free":
        plus = getattr(optimizer, "optimizer", optimizer)  # the package's own, inside accelerate's wrapper
        took = plus.get_dlr(group)
        if group["use_bias_correction"]:
            took, _, _ = plus.get_bias_correction(took, plus.get_betas(group)[1], group["k"])
    optimizer.step()
    if name == "adamw_schedule_free":  # the LR its step used, warmup included: set by the step, for logging
        took = group.get("scheduled_lr") or group["lr"]
    elif not lr_free:
        took = group["lr"]
    return {"lr_effective": float(took),
            "prodigy_d_lr": float(group["d"]) * float(group["lr"]) if lr_free else None}


def require_prodigy(wanted_by: str, instead: str = "choose training.optimizer: adamw") -> Any:
    """The prodigyopt module; ConfigError naming what needs it (`wanted_by`) and the fix when this install lacks it
    (it is a dependency of rangefinder, so only a broken or partial install does)."""
    import importlib

    try:
        return importlib.import_module("prodigyopt")
    except ImportError:
        raise ConfigError(f"{wanted_by} needs the prodigyopt package, a dependency of rangefinder missing from this "
                          f"install: pip install prodigyopt (or reinstall rangefinder), or {instead}") from None


def _package(name: str, module: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"training.optimizer {name} needs the {PACKAGES[name]} package: pip install {extra} "
                          f"(or pip install {PACKAGES[name]}), or choose training.optimizer: adamw") from None
