"""A training checkpoint's model, outside the run that wrote it: the grid's checkpoint columns and the fine-tune's
chosen model.

The run's method is rebuilt on the base model (adapters, new tokens) and the checkpoint's tensors are put back, as a
resume does; the run's family is set up on it first, so its scheduler predicts what the run trained
(`training.prediction_type` over the base model's). When the run kept an EMA average, the average replaces them: it
is what that run validated and what it saves as its final weights, so the chosen model is the one whose validation
loss was measured. Likewise a schedule-free optimizer's averaged weights (its eval mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rangefinder.formats import checkpoints

if TYPE_CHECKING:
    from rangefinder.config import TrainingConfig
    from rangefinder.formats.model_spec import SpecFacts
    from rangefinder.models.loading import ResolvedModel, SDComponents
    from rangefinder.training.methods.base import Method


def method_from_checkpoint(ckpt_dir: Path, base_model: Path, variant: str | None = None
                           ) -> tuple[Method, SDComponents]:
    """(method, parts): the base model's parts (in its weights' `variant`, model.variant, as the run loaded them) in
    fp32 on the CPU, carrying the checkpoint's trained weights.

    The files read are first checked against the checkpoint's manifest: a damaged checkpoint is one RangefinderError
    naming it, before anything is loaded."""
    return _rebuilt(Path(ckpt_dir), _intact_training(ckpt_dir), base_model, variant)


def _intact_training(ckpt_dir: Path) -> TrainingConfig:
    """The training settings the checkpoint's run had, once its files are checked against its manifest."""
    from rangefinder.config import TrainingConfig

    checkpoints.require_intact(ckpt_dir)
    return TrainingConfig.model_validate(checkpoints.read_state(ckpt_dir)["training"])


def _rebuilt(ckpt_dir: Path, cfg: TrainingConfig, base_model: Path,
             variant: str | None = None) -> tuple[Method, SDComponents]:
    """method_from_checkpoint's model, from a checkpoint already checked (_intact_training)."""
    import torch

    from rangefinder.config import SCHEDULE_FREE_OPTIMIZERS, ModelConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.families import family_for
    from rangefinder.training.methods import make_method

    method = make_method(cfg)
    sd = load_sd_components(ModelConfig(base_model=str(base_model), variant=variant))
    # As the run did (setup.py): its family registers training.prediction_type on the model's scheduler, which the
    # saved folder, the single file and the samples then predict; the base model's own would be sampled as what it
    # predicted before (an epsilon model fine-tuned into v-prediction, sampled as epsilon: noise).
    family_for(sd, cfg)
    method.setup(sd, torch.float32)
    method.load_trainable_state_dict(checkpoints.read_weights(ckpt_dir))
    state = checkpoints.read_state(ckpt_dir)
    method.epochs_trained = checkpoint_epoch(state)
    method.spec_facts = _spec_facts(ckpt_dir, state)
    # In the run's order (Run.schedule_free_eval around Run.ema_weights): a schedule-free optimizer's eval mode, then
    # the EMA, which replaces every trainable tensor; the other way round the optimizer averaged the EMA with its z,
    # a model the run never validated nor saved.
    if cfg.optimizer in SCHEDULE_FREE_OPTIMIZERS:
        _to_averaged_weights(ckpt_dir, cfg, method)
    ema_state = checkpoints.read_ema(ckpt_dir)
    if ema_state is not None:
        from diffusers.training_utils import EMAModel

        params = method.trainable_parameters()
        ema = EMAModel(params, decay=cfg.ema_decay)
        ema.load_state_dict(ema_state)
        ema.copy_to(params)
    return method, sd


def checkpoint_epoch(state: dict[str, Any]) -> float | None:
    """The epochs a checkpoint's weights trained for, from its state.json: its `epoch`, or in one an older rangefinder
    wrote (without it) the epoch of its own update's row in the run's updates (`update_rows`). None where neither is
    there: the files then say the run's epochs budget, which is not this checkpoint's."""
    if state.get("epoch") is not None:
        return float(state["epoch"])
    row = next((r for r in state.get("update_rows") or () if r.get("update") == state.get("update")), None)
    return None if row is None or row.get("epoch") is None else float(row["epoch"])


def _spec_facts(ckpt_dir: Path, state: dict[str, Any]) -> SpecFacts:
    """The title, resolution and start the checkpoint's run recorded (training/state.py RunState), which its final
    files name: a model written out of the checkpoint says what the run's own final/ says. A checkpoint from before
    they were kept: the run's folder name (the engine's own default title), and no date."""
    from rangefinder.formats.model_spec import SpecFacts

    run_dir = Path(ckpt_dir).resolve().parent.parent  # <run>/checkpoints/checkpoint-<update>
    return SpecFacts(title=state.get("title") or run_dir.name,
                     resolution=state.get("identity", {}).get("data", {}).get("resolution"),
                     date=state.get("started") or None)


def delivered_state(ckpt_dir: Path, base_model: Path) -> dict[str, Any]:
    """The trained tensors the checkpoint's run delivers (trainable_state_dict's keys): the checkpoint's own, or, where
    the run kept an EMA average or ran a schedule-free optimizer, the averaged weights it validated. Only those need
    the method rebuilt on the base model; the manifest is checked once either way."""
    from rangefinder.config import SCHEDULE_FREE_OPTIMIZERS

    cfg = _intact_training(ckpt_dir)
    if not (Path(ckpt_dir) / checkpoints.EMA_NAME).is_file() and cfg.optimizer not in SCHEDULE_FREE_OPTIMIZERS:
        return checkpoints.read_weights(ckpt_dir)
    method, _ = _rebuilt(Path(ckpt_dir), cfg, Path(base_model))
    return method.trainable_state_dict()


def _to_averaged_weights(ckpt_dir: Path, cfg: TrainingConfig, method: Method) -> None:
    """A schedule-free run's checkpoint holds the weights it steps from (y, for an exact resume) and, in the
    optimizer's state, the sequence z; the model it delivers is its eval mode, the average x, which the optimizer
    computes from both: rebuilt over the same parameter groups, loaded (weights_only) and put in eval mode."""
    from rangefinder.training.optimizers import make_optimizer

    checkpoints.require_intact(ckpt_dir, only=(checkpoints.OPTIMIZER_NAME,))
    optimizer: Any = make_optimizer(cfg, method.param_groups(), cfg.lr)  # schedule-free: has eval()
    optimizer.load_state_dict(checkpoints.read_optimizer(ckpt_dir))
    optimizer.eval()


@dataclass(frozen=True)
class AveragedWeights:
    """Trained tensors of one run written in place of a checkpoint's (the average of several of its checkpoints, or
    a greedy soup), and the updates of the checkpoints they average, which the files' metadata names."""

    tensors: dict[str, Any]
    updates: tuple[int, ...] = ()


def save_checkpoint_model(ckpt_dir: Path, base_model: Path, out_dir: Path, base: ResolvedModel | None = None,
                          weights: AveragedWeights | None = None, variant: str | None = None) -> Path:
    """Write the checkpoint's model into `out_dir` in the method's own output format, the files `final/` holds (a
    diffusers folder and single file; LoRA files; embeddings). Whole or absent (a temporary name, then a rename).
    `base`: the base model as the run resolved it, whose source and revision the files' metadata name (default: the
    folder `base_model` and its fingerprint; a single file's or a hub id's folder is no longer what the run named,
    nor has the revision it resolved to). `weights`: trained tensors of the
    same run to write in place of the checkpoint's (`ckpt_dir` is the newest of the checkpoints they average).
    `variant`: the base model's (model.variant)."""
    from rangefinder.formats.atomic import atomic_dir

    method, sd = method_from_checkpoint(Path(ckpt_dir), Path(base_model), variant)
    if weights is not None:
        method.load_trainable_state_dict(weights.tensors)
        method.averaged_updates = tuple(weights.updates) or None
    if base is not None:
        sd.source, sd.resolved = base.source, base
    with atomic_dir(out_dir) as tmp:
        method.save_final(sd, tmp)
    return Path(out_dir)
