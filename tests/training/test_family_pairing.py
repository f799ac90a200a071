"""A run and a base model of different families, or a resolution the family does not support: one clear error."""

from __future__ import annotations

import pytest

from rangefinder.config import DataConfig, TrainingConfig, ValidationConfig
from rangefinder.errors import ConfigError
from rangefinder.training.loop import TrainSpec, train


def test_resuming_an_sd1_run_on_an_sdxl_base_is_refused(split_dir, tiny_model_dir, tiny_sdxl_dir, tmp_path):
    cfg = TrainingConfig(batch_size=8, steps=1, checkpoint_every_updates=1, cache_dir=str(tmp_path / "cache"))
    off = ValidationConfig(every_epochs=0)
    out = tmp_path / "run"
    train(TrainSpec(cfg, off, split_dir=split_dir, model=tiny_model_dir), out_dir=out, save_final=False)
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match=r"cannot resume: .* Stable Diffusion 1\.x/2\.x run but the base model "
                                          r".* is Stable Diffusion XL"):
        train(TrainSpec(cfg.model_copy(update={"resume": True}), off, split_dir=split_dir, model=tiny_sdxl_dir),
              out_dir=out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # nothing written or lost


def test_a_resolution_below_the_family_floor_is_refused(split_dir, tiny_sdxl_dir, tmp_path):
    cfg = TrainingConfig(batch_size=8, steps=1, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"data.resolution: 8 px is below what Stable Diffusion XL supports .*"
                                          r"native 32 px, at least 16 px"):
        train(TrainSpec(cfg, ValidationConfig(every_epochs=0), split_dir=split_dir, model=tiny_sdxl_dir,
                        data=DataConfig(resolution=8)), out_dir=tmp_path / "run")
