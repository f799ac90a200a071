"""Exact resume: a run SIGKILLed after its second checkpoint and resumed ends exactly like one never stopped."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.training.loop import TrainSpec, train

CHILD = Path(__file__).with_name("engine_child.py")


def run_child(settings: dict, tmp: Path, name: str) -> subprocess.CompletedProcess:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(settings))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(CHILD), str(path)], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_sigkill_after_second_checkpoint_then_resume_equals_uninterrupted(split_dir, tiny_model_dir, tmp_path):
    training = dict(
        batch_size=4, epochs=3, lr=2e-4, seed=11, checkpoint_every_updates=3, keep_checkpoints=2,
        random_flip=True, cond_dropout=0.2, min_snr_gamma=5.0, noise_offset=0.05, use_ema=True, ema_decay=0.9,
        cache_dir=str(tmp_path / "cache"),
    )
    base = dict(split_dir=str(split_dir), model=str(tiny_model_dir), training=training,
                validation=dict(every_epochs=1))

    # The uninterrupted run and the resume run here (one torch thread, as in the child); only the crash needs a
    # process of its own.
    train(TrainSpec(TrainingConfig(**training), ValidationConfig(**base["validation"]), split_dir=split_dir,
                    model=tiny_model_dir),
          out_dir=tmp_path / "whole")

    # 16 images / batch 4 = 4 updates per epoch, 12 in all; checkpoints at 3 and 6, then killed inside update 7.
    cut = tmp_path / "cut"
    killed = run_child({**base, "out_dir": str(cut), "kill_at_update": 7}, tmp_path, "killed")
    assert killed.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["checkpoint-000003", "checkpoint-000006"]
    assert not (cut / "final").exists() and not (cut / "run_summary.json").exists()
    # A save torn by a crash must be ignored: a temporary folder, and a folder that never got its state.json.
    (cut / "checkpoints" / "checkpoint-000009.tmp").mkdir()
    torn = cut / "checkpoints" / "checkpoint-000008"
    torn.mkdir()
    (torn / "weights.safetensors").write_bytes(b"half a file")

    resumed = train(TrainSpec(TrainingConfig(**training, resume=True), ValidationConfig(**base["validation"]),
                              split_dir=split_dir, model=tiny_model_dir),
                    out_dir=cut)
    assert resumed.resumed_from == 6 and resumed.updates == 12

    for name in ("metrics.csv", "updates.csv"):
        assert (cut / name).read_text() == (tmp_path / "whole" / name).read_text(), name
    a = load_file(str(tmp_path / "whole" / "final" / "unet" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(cut / "final" / "unet" / "diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # keep_checkpoints=2: only the newest two whole checkpoints remain, the torn ones are gone or ignored.
    kept = sorted(p.name for p in (cut / "checkpoints").iterdir() if not p.name.endswith(".tmp"))
    assert kept[-2:] == ["checkpoint-000009", "checkpoint-000012"]


@pytest.mark.slow
def test_tag_shuffle_changes_the_conditioning_and_resumes_exactly(shapes_dataset_dir, tiny_model_dir, tmp_path):
    import shutil

    from rangefinder.data.split import split_dataset

    # Tag-style captions: "shape, circle, blue, on white" from "a blue circle on a white background".
    data = tmp_path / "tagged"
    data.mkdir()
    for png in sorted(Path(shapes_dataset_dir).glob("*.png"))[:8]:
        words = png.with_suffix(".txt").read_text().split()
        shutil.copy(png, data / png.name)
        (data / png.with_suffix(".txt").name).write_text(f"shape, {words[2]}, {words[1]}, on {words[-2]}")
    split_dir = tmp_path / "split"
    split_dataset(data, split_dir, val_split=0.25, seed=1)  # 6 train, 2 val
    training = dict(batch_size=3, epochs=2, lr=2e-4, seed=5, shuffle_tags=True, keep_tokens=1,
                    checkpoint_every_updates=2, cache_dir=str(tmp_path / "cache"))
    validation = dict(every_epochs=1)

    def run(out: Path, **kw):
        return train(TrainSpec(TrainingConfig(**{**training, **kw}), ValidationConfig(**validation),
                               split_dir=split_dir, model=tiny_model_dir), out_dir=out)

    whole = run(tmp_path / "whole")
    # Only fixed captions are encoded once and cached: 2 val, 2 stabilize and "" (the 6 training ones vary).
    assert whole.updates == 4 and whole.cache["text"] == {"encoded": 5, "reused": 0}
    run(tmp_path / "fixed", shuffle_tags=False)
    shuffled_rows = (tmp_path / "whole" / "updates.csv").read_text().splitlines()
    fixed_rows = (tmp_path / "fixed" / "updates.csv").read_text().splitlines()
    assert shuffled_rows[1] != fixed_rows[1]  # same images, timesteps and noise: only the captions' order differs

    cut = tmp_path / "cut"
    base = dict(split_dir=str(split_dir), model=str(tiny_model_dir), training=training, validation=validation)
    killed = run_child({**base, "out_dir": str(cut), "kill_at_update": 3}, tmp_path, "killed")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = run(cut, resume=True)
    assert resumed.resumed_from == 2 and resumed.updates == 4
    for name in ("metrics.csv", "updates.csv"):
        assert (cut / name).read_text() == (tmp_path / "whole" / name).read_text(), name


def test_a_checkpoint_older_than_a_setting_resumes_with_its_default(split_dir, tiny_model_dir, tmp_path):
    """A checkpoint written before a training setting existed (here training.allreduce_dtype, and training.optimizer
    with the old use_8bit_adam beside it) resumes: the missing setting counts as its default. Set to something else,
    the resume is refused as before."""
    from rangefinder.errors import ConfigError
    from rangefinder.formats import checkpoints
    from rangefinder.formats.digest import file_sha256

    cfg = TrainingConfig(batch_size=4, lr=1e-4, seed=3, steps=2, cache_dir=str(tmp_path / "cache"),
                         checkpoint_every_updates=1, keep_checkpoints=2)
    val = ValidationConfig(every_epochs=0)
    out = tmp_path / "run"
    train(TrainSpec(cfg.model_copy(update={"steps": 1}), val, split_dir=split_dir, model=tiny_model_dir),
          out_dir=out, save_final=False)
    (ckpt,) = checkpoints.list_checkpoints(out / "checkpoints")
    state = json.loads((ckpt / "state.json").read_text())
    del state["training"]["allreduce_dtype"]  # as a checkpoint from before the setting
    del state["training"]["optimizer"]  # and from before training.optimizer replaced use_8bit_adam
    state["training"]["use_8bit_adam"] = False
    state["training"]["steps"] = 2
    state["total_updates"] = 2
    (ckpt / "state.json").write_text(json.dumps(state))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["sha256"]["state.json"] = file_sha256(ckpt / "state.json")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    (out / "run_summary.json").unlink()

    with pytest.raises(ConfigError, match=r"different settings \(training.allreduce_dtype\)"):
        train(TrainSpec(cfg.model_copy(update={"resume": True, "allreduce_dtype": "bf16"}), val, split_dir=split_dir,
                        model=tiny_model_dir), out_dir=out, save_final=False)
    resumed = train(TrainSpec(cfg.model_copy(update={"resume": True}), val, split_dir=split_dir,
                              model=tiny_model_dir), out_dir=out, save_final=False)
    assert resumed.resumed_from == 1 and resumed.updates == 2


def test_a_run_paused_half_way_goes_on_to_end_exactly_as_one_never_paused(split_dir, tiny_model_dir, tmp_path):
    """The engine's pause (the fine-tune's successive halving trains two LRs half-way with it): the run stops at the
    first validation at or after the update asked for, with a checkpoint there and no final weights, and the same
    settings resumed end with the uninterrupted run's curve and weights. Asked again, a paused run stays paused."""
    training = dict(batch_size=4, epochs=3, lr=2e-4, seed=4, checkpoint_every_updates=3, keep_checkpoints=10,
                    random_flip=True, use_ema=True, ema_decay=0.9, cache_dir=str(tmp_path / "cache"), resume=True)

    def run(out: Path, **kw):
        return train(TrainSpec(TrainingConfig(**training), ValidationConfig(every_epochs=1), split_dir=split_dir,
                               model=tiny_model_dir), out_dir=out, **kw)

    whole = run(tmp_path / "whole")
    # 4 updates an epoch, validated at 0, 4, 8 and 12: asked for 5, it pauses at 8 (checkpoints 3, 6 and 8).
    paused = run(tmp_path / "cut", pause_after_update=5)
    assert (paused.status, paused.updates, paused.final_dir) == ("paused", 8, None)
    assert not (tmp_path / "cut" / "final").exists()
    assert [int(r["update"]) for r in csv.DictReader(open(tmp_path / "cut" / "metrics.csv"))] == [0, 4, 8]
    assert json.loads((tmp_path / "cut" / "run_summary.json").read_text())["status"] == "paused"
    again = run(tmp_path / "cut", pause_after_update=5)
    assert (again.status, again.resumed_from, again.updates) == ("paused", 8, 8)

    resumed = run(tmp_path / "cut")
    assert (resumed.status, resumed.resumed_from, resumed.updates) == ("ok", 8, 12) and whole.updates == 12
    for name in ("metrics.csv", "updates.csv"):
        assert (tmp_path / "cut" / name).read_text() == (tmp_path / "whole" / name).read_text(), name
    a = load_file(str(tmp_path / "whole" / "final" / "unet" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "final" / "unet" / "diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
