"""Learning-rate schedules by name, as pure functions of the update index.

`lr_at(u)` is the LR used by update u (0-based) of a run of `total_updates` updates. Being a pure function of u, a
schedule needs no state of its own in a checkpoint: resuming at update u gives the same LR as never stopping.

- constant:    lr.
- linear-ramp: lr_min + (lr_max - lr_min) * (u + 1) / U. The LR range test of Smith 2017 ("Cyclical Learning Rates
               for Training Neural Networks", section 3.3); it starts one step above lr_min (default 0), so no update
               is spent at LR 0, and the last update uses lr_max.
- exp-ramp:    lr_min * (lr_max / lr_min) ** (u / (U - 1)): geometric from lr_min to lr_max (the fastai-style range
               test, which resolves small LRs better).
- cosine:      linear warmup over `warmup_updates` to lr ((u + 1) / W * lr), then half a cosine from lr down to
               lr_min (default 0) at the end (Loshchilov & Hutter 2017, "SGDR", without restarts).
- wsd:         warmup, stable, decay (Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed
               Training Durations"): the linear warmup of cosine, lr until the last D = ceil(decay_fraction * U)
               updates, then linear to lr_min (default 0): lr_min + (lr - lr_min) * (U - u) / (D + 1), so the last
               update still moves. Until the decay starts it is the constant schedule, update for update: the
               fine-tune's cooldown (steps/cooldown.py) branches a constant-LR run into it.
- triangular, triangular2, exp_range: Smith 2017, section 3.1, between lr_min (default 0) and lr_max, with a
               half-cycle ("step size") of `cycle_epochs` epochs' worth of updates. triangular2 halves the amplitude
               every cycle; exp_range scales it by gamma ** u.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rangefinder.config import CYCLIC_SCHEDULES, RAMP_SCHEDULES, TrainingConfig
from rangefinder.errors import ConfigError

SCHEDULES = ("constant", "linear-ramp", "exp-ramp", "cosine", "wsd") + CYCLIC_SCHEDULES


@dataclass(frozen=True)
class LRSchedule:
    name: str
    total_updates: int
    lr: float  # constant LR and the peak of cosine (after scale_lr)
    lr_min: float
    lr_max: float
    warmup_updates: int = 0
    step_size: float = 1.0  # half-cycle of the cyclical schedules, in updates
    gamma: float = 1.0
    decay_fraction: float = 0.2  # wsd: the share of the updates that decay

    def __call__(self, update: int) -> float:
        return lr_at(self, update)

    @property
    def is_ramp(self) -> bool:
        return self.name in RAMP_SCHEDULES


def make_schedule(cfg: TrainingConfig, total_updates: int, updates_per_epoch: float, lr: float) -> LRSchedule:
    """The schedule of one run. `lr` is cfg.lr after scale_lr; ramp and cycle bounds are absolute LRs."""
    if cfg.schedule not in SCHEDULES:
        raise ConfigError(f"training.schedule: unknown schedule {cfg.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    lr_min = cfg.lr_min if cfg.lr_min is not None else 0.0
    lr_max = cfg.lr_max if cfg.lr_max is not None else lr
    if cfg.schedule in RAMP_SCHEDULES + CYCLIC_SCHEDULES and lr_max <= lr_min:
        raise ConfigError(f"training.lr_max ({lr_max:g}) must be above training.lr_min ({lr_min:g}) for {cfg.schedule}")
    if cfg.schedule == "exp-ramp" and lr_min <= 0:
        raise ConfigError("training.lr_min: an exp-ramp needs lr_min > 0 (it climbs geometrically), e.g. 1e-7")
    return LRSchedule(
        name=cfg.schedule,
        total_updates=total_updates,
        lr=lr,
        lr_min=lr_min,
        lr_max=lr_max,
        warmup_updates=cfg.warmup_updates,
        step_size=max(1.0, cfg.cycle_epochs * updates_per_epoch),
        gamma=cfg.exp_range_gamma,
        decay_fraction=cfg.decay_fraction,
    )


def decay_updates(total_updates: int, decay_fraction: float) -> int:
    """How many of a wsd run's `total_updates` decay: ceil(decay_fraction * U), at least 1 and at most U."""
    return min(total_updates, max(1, math.ceil(decay_fraction * total_updates - 1e-9)))


def lr_at(s: LRSchedule, u: int) -> float:
    U = s.total_updates
    if s.name == "constant":
        return s.lr
    if s.name == "linear-ramp":
        return s.lr_min + (s.lr_max - s.lr_min) * (u + 1) / U
    if s.name == "exp-ramp":
        if U == 1:
            return s.lr_max
        return s.lr_min * (s.lr_max / s.lr_min) ** (u / (U - 1))
    if s.name == "cosine":
        if u < s.warmup_updates:
            return s.lr * (u + 1) / s.warmup_updates
        decay_len = max(1, U - s.warmup_updates)
        progress = (u - s.warmup_updates) / decay_len
        return s.lr_min + 0.5 * (s.lr - s.lr_min) * (1.0 + math.cos(math.pi * progress))
    if s.name == "wsd":
        if u < s.warmup_updates:
            return s.lr * (u + 1) / s.warmup_updates
        decay = decay_updates(U, s.decay_fraction)
        if u < U - decay:
            return s.lr
        return s.lr_min + (s.lr - s.lr_min) * (U - u) / (decay + 1)
    if s.name in CYCLIC_SCHEDULES:
        cycle = math.floor(1 + u / (2 * s.step_size))
        x = abs(u / s.step_size - 2 * cycle + 1)
        amplitude = (s.lr_max - s.lr_min) * max(0.0, 1.0 - x)
        if s.name == "triangular2":
            amplitude /= 2 ** (cycle - 1)
        elif s.name == "exp_range":
            amplitude *= s.gamma**u
        return s.lr_min + amplitude
    raise ConfigError(f"training.schedule: unknown schedule {s.name!r}; choose one of {', '.join(SCHEDULES)}")
