"""Exact resume: a run SIGKILLed after its second checkpoint, or paused half-way, and resumed ends exactly like the
one never stopped (made once for the module)."""

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


# The settings of the uninterrupted run every interruption below is compared with: 16 images / batch 4 = 4 updates
# an epoch, 12 in all, validated every epoch (0, 4, 8, 12), a checkpoint every 3 updates, the newest 2 kept.
TRAINING = dict(batch_size=4, epochs=3, lr=2e-4, seed=11, checkpoint_every_updates=3, keep_checkpoints=2,
                random_flip=True, cond_dropout=0.2, min_snr_gamma=5.0, noise_offset=0.05, use_ema=True, ema_decay=0.9)
VALIDATION = dict(every_epochs=1)


@pytest.fixture(scope="module")
def settings(split_dir, tiny_model_dir, tmp_path_factory) -> dict:
    """The run's settings as engine_child.py reads them; the encoded latents cached once for every run here."""
    training = {**TRAINING, "cache_dir": str(tmp_path_factory.mktemp("encoded"))}
    return dict(split_dir=str(split_dir), model=str(tiny_model_dir), training=training, validation=VALIDATION)


def run_here(settings: dict, out: Path, pause_after_update: int | None = None, **training):
    """The run in this process (one torch thread, as in the child)."""
    spec = TrainSpec(TrainingConfig(**{**settings["training"], **training}),
                     ValidationConfig(**settings["validation"]), split_dir=settings["split_dir"],
                     model=settings["model"])
    return train(spec, out_dir=out, pause_after_update=pause_after_update)


@pytest.fixture(scope="module")
def whole(settings, tmp_path_factory) -> Path:
    """The uninterrupted run, made once: the reference for every interruption."""
    out = tmp_path_factory.mktemp("uninterrupted") / "whole"
    result = run_here(settings, out)
    assert result.status == "ok" and result.updates == 12
    return out


def _sigkill_inside_update_7(settings: dict, cut: Path, tmp_path: Path) -> None:
    """SIGKILLed after its second checkpoint, with torn saves left behind, then resumed. Only the crash needs a
    process of its own."""
    killed = run_child({**settings, "out_dir": str(cut), "kill_at_update": 7}, tmp_path, "killed")
    assert killed.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["checkpoint-000003", "checkpoint-000006"]
    assert not (cut / "final").exists() and not (cut / "run_summary.json").exists()
    # A save torn by a crash must be ignored: a temporary folder, and a folder that never got its state.json.
    (cut / "checkpoints" / "checkpoint-000009.tmp").mkdir()
    torn = cut / "checkpoints" / "checkpoint-000008"
    torn.mkdir()
    (torn / "weights.safetensors").write_bytes(b"half a file")

    resumed = run_here(settings, cut, resume=True)
    assert resumed.resumed_from == 6 and resumed.updates == 12
    # keep_checkpoints=2: only the newest two whole checkpoints remain, the torn ones are gone or ignored.
    kept = sorted(p.name for p in (cut / "checkpoints").iterdir() if not p.name.endswith(".tmp"))
    assert kept[-2:] == ["checkpoint-000009", "checkpoint-000012"]


def _pause_after_update_5(settings: dict, cut: Path, tmp_path: Path) -> None:
    """The engine's pause (the fine-tune's successive halving trains two LRs half-way with it): the run stops at the
    first validation at or after the update asked for, with a checkpoint there and no final weights, and the same
    settings resumed go on from there. Asked again, a paused run stays paused."""
    # Validated at 0, 4, 8 and 12: asked for 5, it pauses at 8 (checkpoints 3, 6 and 8).
    paused = run_here(settings, cut, 5, resume=True)
    assert (paused.status, paused.updates, paused.final_dir) == ("paused", 8, None)
    assert not (cut / "final").exists()
    assert [int(r["update"]) for r in csv.DictReader(open(cut / "metrics.csv"))] == [0, 4, 8]
    assert json.loads((cut / "run_summary.json").read_text())["status"] == "paused"
    again = run_here(settings, cut, 5, resume=True)
    assert (again.status, again.resumed_from, again.updates) == ("paused", 8, 8)
    resumed = run_here(settings, cut, resume=True)
    assert (resumed.status, resumed.resumed_from, resumed.updates) == ("ok", 8, 12)


@pytest.mark.slow
@pytest.mark.parametrize("interrupt", [_sigkill_inside_update_7, _pause_after_update_5], ids=["sigkill", "pause"])
def test_an_interrupted_run_resumed_equals_the_uninterrupted_one(settings, whole, interrupt, tmp_path):
    """Exact resume: the interrupted run ends with the uninterrupted run's curves and weights, bit for bit."""
    cut = tmp_path / "cut"
    interrupt(settings, cut, tmp_path)
    for name in ("metrics.csv", "updates.csv"):
        assert (cut / name).read_text() == (whole / name).read_text(), name
    a = load_file(str(whole / "final" / "unet" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(cut / "final" / "unet" / "diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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
    """A checkpoint written before a training setting existed (here training.allreduce_dtype) resumes: the missing
    setting counts as its default. Set to something else, the resume is refused as before."""
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
