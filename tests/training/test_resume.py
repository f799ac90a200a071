"""Exact resume: a run SIGKILLed after its second checkpoint and resumed ends exactly like one never stopped."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.training.loop import TrainSpec, train

CHILD = Path(__file__).with_name("engine_child.py")


def run_child(settings: dict, tmp: Path, name: str, fresh: bool = False) -> subprocess.CompletedProcess:
    child = start_child(settings, tmp, name, fresh)
    out, err = child.communicate(timeout=600)
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)


def start_child(settings: dict, tmp: Path, name: str, fresh: bool = False) -> subprocess.Popen | ForkedChild:
    """engine_child.py's run in a process of its own: by default a fork of this one (torch, diffusers and the engine
    already imported: a fresh interpreter spends ~9 CPU-s importing them before it trains), with `fresh` a new
    `python engine_child.py` (kept for the SIGKILL resume below, the whole real-process path)."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}))
    if not fresh:
        return ForkedChild(path, tmp / f"{name}.out", tmp / f"{name}.err")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(CHILD), str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _engine_child_main(path: str) -> None:
    from tests.training import engine_child

    engine_child.main(path)


def _as_a_fresh_process(out: str, err: str, target: Callable[..., object], *args: object) -> None:
    """In the fork: what a fresh `python engine_child.py path` has that this copy of the test process has not (its
    own stdout and stderr, default signal handlers, warnings on stderr rather than in pytest's log capture, one
    OpenMP thread), then `target`. Its exit status is target's (sys.exit(2) for a RangefinderError; SIGKILL: -9)."""
    import logging

    for fd, file in ((1, out), (2, err)):
        opened = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # the process's own, for its lifetime
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logging.root.handlers.clear()  # pytest's capture handlers: a fresh process prints warnings on stderr
    os.environ["OMP_NUM_THREADS"] = "1"
    target(*args)


class ForkedChild:
    """The part of subprocess.Popen the tests use, for `target(*args)` in a forked process (by default
    engine_child.main on a settings file)."""

    def __init__(self, path: Path, out: Path, err: Path, target: Callable[..., object] = _engine_child_main,
                 args: tuple | None = None) -> None:
        import multiprocessing

        self.args, self.out, self.err = [str(CHILD), str(path)], out, err
        target_args = args if args is not None else (str(path),)  # engine_child.main reads the settings file
        self.process = multiprocessing.get_context("fork").Process(
            target=_as_a_fresh_process, args=(str(out), str(err), target, *target_args))
        self.process.start()
        self.pid = self.process.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self.process.exitcode
        return self.returncode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL, unless it has ended (and been waited for)."""
        self.process.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.returncode = self.process.exitcode
        return self.out.read_text(), self.err.read_text()


# One uninterrupted reference run; each interruption below must end exactly like it (issue 32: one shared reference).
# 16 images / batch 4 = 4 updates per epoch, 12 in all; checkpoints every 3 updates, validation every epoch.
REFERENCE = dict(
    batch_size=4, epochs=3, lr=2e-4, seed=11, checkpoint_every_updates=3, keep_checkpoints=2,
    random_flip=True, cond_dropout=0.2, min_snr_gamma=5.0, noise_offset=0.05, use_ema=True, ema_decay=0.9,
)
VALIDATION = dict(every_epochs=1)


@pytest.fixture(scope="module")
def reference(split_dir, tiny_model_dir, tmp_path_factory) -> dict:
    """The uninterrupted run (here, one torch thread, as in the child), and the settings the interrupted runs share."""
    training = {**REFERENCE, "cache_dir": str(tmp_path_factory.mktemp("encoded"))}
    whole = tmp_path_factory.mktemp("reference") / "whole"
    train(TrainSpec(TrainingConfig(**training), ValidationConfig(**VALIDATION), split_dir=split_dir,
                    model=tiny_model_dir), out_dir=whole)
    return dict(split_dir=str(split_dir), model=str(tiny_model_dir), training=training, validation=VALIDATION,
                whole=whole)


def resume_here(reference: dict, out: Path, **kw):
    return train(TrainSpec(TrainingConfig(**{**reference["training"], "resume": True}),
                           ValidationConfig(**reference["validation"]), split_dir=reference["split_dir"],
                           model=reference["model"]), out_dir=out, **kw)


def assert_ends_like(reference: dict, out: Path) -> None:
    whole = reference["whole"]
    for name in ("metrics.csv", "updates.csv"):
        assert (out / name).read_text() == (whole / name).read_text(), name
    a = load_file(str(whole / "final" / "unet" / "diffusion_pytorch_model.safetensors"))
    b = load_file(str(out / "final" / "unet" / "diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def child_settings(reference: dict, out: Path, **kw) -> dict:
    return {k: v for k, v in reference.items() if k != "whole"} | {"out_dir": str(out)} | kw


@pytest.mark.slow
def test_sigkill_after_second_checkpoint_then_resume_equals_uninterrupted(reference, tmp_path):
    # Checkpoints at 3 and 6, then killed inside update 7.
    cut = tmp_path / "cut"
    killed = run_child(child_settings(reference, cut, kill_at_update=7), tmp_path, "killed", fresh=True)
    assert killed.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["checkpoint-000003", "checkpoint-000006"]
    assert not (cut / "final").exists() and not (cut / "run_summary.json").exists()
    # A save torn by a crash must be ignored: a temporary folder, and a folder that never got its state.json.
    (cut / "checkpoints" / "checkpoint-000009.tmp").mkdir()
    torn = cut / "checkpoints" / "checkpoint-000008"
    torn.mkdir()
    (torn / "weights.safetensors").write_bytes(b"half a file")

    resumed = resume_here(reference, cut)
    assert resumed.resumed_from == 6 and resumed.updates == 12
    assert_ends_like(reference, cut)
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

    changed = r"different settings or data \(training.allreduce_dtype \"fp32\" -> \"bf16\"\)"
    with pytest.raises(ConfigError, match=changed):
        train(TrainSpec(cfg.model_copy(update={"resume": True, "allreduce_dtype": "bf16"}), val, split_dir=split_dir,
                        model=tiny_model_dir), out_dir=out, save_final=False)
    resumed = train(TrainSpec(cfg.model_copy(update={"resume": True}), val, split_dir=split_dir,
                              model=tiny_model_dir), out_dir=out, save_final=False)
    assert resumed.resumed_from == 1 and resumed.updates == 2


def test_a_run_paused_half_way_goes_on_to_end_exactly_as_one_never_paused(reference, tmp_path):
    """The engine's pause (the fine-tune's successive halving trains two LRs half-way with it): the run stops at the
    first validation at or after the update asked for, with a checkpoint there and no final weights, and the same
    settings resumed end with the uninterrupted run's curve and weights. Asked again, a paused run stays paused."""
    cut = tmp_path / "cut"
    # 4 updates an epoch, validated at 0, 4, 8 and 12: asked for 5, it pauses at 8 (checkpoints 3, 6 and 8).
    paused = resume_here(reference, cut, pause_after_update=5)
    assert (paused.status, paused.updates, paused.final_dir) == ("paused", 8, None)
    assert not (cut / "final").exists()
    assert [int(r["update"]) for r in csv.DictReader(open(cut / "metrics.csv"))] == [0, 4, 8]
    assert json.loads((cut / "run_summary.json").read_text())["status"] == "paused"
    again = resume_here(reference, cut, pause_after_update=5)
    assert (again.status, again.resumed_from, again.updates) == ("paused", 8, 8)

    resumed = resume_here(reference, cut)
    assert (resumed.status, resumed.resumed_from, resumed.updates) == ("ok", 8, 12)
    assert_ends_like(reference, cut)


# ---------------------------------------------------------------------------------------------------------------
# A resume continues only the run it finds (issue 36, class 1)

SHORT = dict(batch_size=4, lr=1e-4, seed=3, steps=2, checkpoint_every_updates=1, keep_checkpoints=2)
SHORT_VALIDATION = dict(every_epochs=0, every_updates=1, timesteps=2, seed=0)


@pytest.fixture(scope="module")
def short_run(split_dir, tiny_model_dir, tmp_path_factory) -> dict:
    """A finished 2-update run with a checkpoint at each update, which the tests below copy and resume otherwise."""
    training = {**SHORT, "cache_dir": str(tmp_path_factory.mktemp("encoded"))}
    out = tmp_path_factory.mktemp("short") / "run"
    train(TrainSpec(TrainingConfig(**training), ValidationConfig(**SHORT_VALIDATION), split_dir=split_dir,
                    model=tiny_model_dir), out_dir=out, save_final=False)
    return dict(training=training, out=out)


LOCK = ".rangefinder.lock"  # rewritten by every run that holds the folder


def resume_short(short_run: dict, tmp_path: Path, split_dir, model, validation=SHORT_VALIDATION):
    import shutil

    out = Path(shutil.copytree(short_run["out"], tmp_path / "run"))
    def files() -> dict:
        return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != LOCK}

    before = files()
    spec = TrainSpec(TrainingConfig(**short_run["training"], resume=True), ValidationConfig(**validation),
                     split_dir=split_dir, model=model)
    try:
        return train(spec, out_dir=out, save_final=False)
    finally:  # a refused resume leaves the run as it was: its checkpoints and its curve
        assert files() == before


@pytest.mark.parametrize("older", [False, True], ids=["recorded", "older-checkpoint"])
def test_a_resumed_run_s_files_name_when_and_as_what_the_run_began(short_run, split_dir, tiny_model_dir, tmp_path,
                                                                   older):
    """The model spec's date and title (formats/model_spec.py SpecFacts) are what the run recorded when it began, kept
    in its checkpoints: resumed (here a copy of the finished run under another folder name, from its last
    checkpoint, whose start is set back to a day long past), final/ names that start and the first folder's name,
    not the resume's clock or folder, and run_summary.json says the same. A checkpoint an older rangefinder wrote
    recorded neither: its start is unknown, so final/ names no date (it named the resume's clock as the run's), and
    its title is the folder's name, as an export of that checkpoint names them (restore._spec_facts)."""
    import shutil

    from rangefinder.formats import checkpoints
    from rangefinder.formats.digest import file_sha256
    from rangefinder.formats.single_file import SINGLE_FILE_NAME
    from rangefinder.formats.weights_file import read_metadata

    out = Path(shutil.copytree(short_run["out"], tmp_path / "elsewhere"))
    newest = checkpoints.list_checkpoints(out / checkpoints.RUN_DIR)[-1]
    state = json.loads((newest / checkpoints.STATE_NAME).read_text())
    assert state["title"] == short_run["out"].name  # recorded at the start: the output folder's name, no spec title
    state["started"] = "2001-02-03T04:05:06+00:00"
    if older:
        del state["started"], state["title"]
    (newest / checkpoints.STATE_NAME).write_text(json.dumps(state))
    manifest = json.loads((newest / checkpoints.MANIFEST_NAME).read_text())
    manifest["sha256"][checkpoints.STATE_NAME] = file_sha256(newest / checkpoints.STATE_NAME)
    (newest / checkpoints.MANIFEST_NAME).write_text(json.dumps(manifest))

    spec = TrainSpec(TrainingConfig(**short_run["training"], resume=True), ValidationConfig(**SHORT_VALIDATION),
                     split_dir=split_dir, model=tiny_model_dir)
    resumed = train(spec, out_dir=out)
    assert (resumed.status, resumed.resumed_from) == ("ok", 2)
    meta = read_metadata(out / "final" / SINGLE_FILE_NAME)
    summary = json.loads((out / "run_summary.json").read_text())
    if older:
        assert "modelspec.date" not in meta and meta["modelspec.title"] == out.name
        assert (summary["started"], summary["title"]) == (None, out.name)
        return
    assert (meta["modelspec.date"], meta["modelspec.title"]) == ("2001-02-03T04:05:06+00:00", short_run["out"].name)
    assert (summary["started"], summary["title"]) == ("2001-02-03T04:05:06+00:00", short_run["out"].name)


def test_a_resume_with_other_validation_timesteps_and_seed_is_refused_naming_both(
        short_run, split_dir, tiny_model_dir, tmp_path):
    from rangefinder.errors import ConfigError

    other = {**SHORT_VALIDATION, "timesteps": 3, "seed": 7}
    with pytest.raises(ConfigError, match="cannot resume") as e:
        resume_short(short_run, tmp_path, split_dir, tiny_model_dir, validation=other)
    assert "validation.seed 0 -> 7" in str(e.value) and "validation.timesteps 2 -> 3" in str(e.value)
    assert "training." not in str(e.value)  # only what differs is named


def test_a_resume_with_a_setting_of_a_section_changed_names_that_setting(short_run, split_dir, tiny_model_dir,
                                                                        tmp_path):
    """training.flow.guidance or training.lora.rank changed: the refusal wrote the whole section's JSON before and
    after, for the reader to find the one value that differs."""
    from rangefinder.errors import ConfigError

    changed = {**short_run, "training": {**short_run["training"], "lora": {"rank": 8, "dropout": 0.1}}}
    with pytest.raises(ConfigError, match=r"different settings or data \(training.lora.dropout 0.0 -> 0.1; "
                                          r"training.lora.rank 4 -> 8\); resume with") as e:
        resume_short(changed, tmp_path, split_dir, tiny_model_dir)
    assert "alpha" not in str(e.value)


def test_a_resume_on_the_same_images_with_one_caption_changed_is_refused(
        short_run, shapes_dataset_dir, tiny_model_dir, tmp_path):
    """Same images, same sizes, same split: only one caption differs, and the run's data digest sees it."""
    import shutil

    from rangefinder.data.split import split_dataset
    from rangefinder.errors import ConfigError

    data = Path(shutil.copytree(shapes_dataset_dir, tmp_path / "data"))
    caption = sorted(data.glob("*.txt"))[0]
    caption.write_text(caption.read_text() + " at noon")
    other_split = tmp_path / "split"
    split_dataset(data, other_split, val_split=0.2, stabilize_split=0.2, seed=555)  # as the split_dir fixture
    with pytest.raises(ConfigError, match=r"cannot resume: .*the data \(another dataset, or images or captions "
                                          r"changed\)"):
        resume_short(short_run, tmp_path, other_split, tiny_model_dir)


def test_a_resume_with_one_validation_caption_changed_is_refused(short_run, shapes_dataset_dir, tiny_model_dir,
                                                                  split_dir, tmp_path):
    """The same training images and captions, one validation image's caption changed: the curve after the resume
    would be measured on another validation set than before it, so the run's data digest covers every subset."""
    import shutil

    from rangefinder.data.split import read_split, split_dataset
    from rangefinder.errors import ConfigError

    data = Path(shutil.copytree(shapes_dataset_dir, tmp_path / "data"))
    caption = (data / read_split(split_dir).val[0].file_name).with_suffix(".txt")
    caption.write_text(caption.read_text() + " at noon")
    other_split = tmp_path / "split"
    split_dataset(data, other_split, val_split=0.2, stabilize_split=0.2, seed=555)  # as the split_dir fixture
    assert [it.text for it in read_split(other_split).train] == [it.text for it in read_split(split_dir).train]
    with pytest.raises(ConfigError, match=r"cannot resume: .*the data \(another dataset, or images or captions "
                                          r"changed\)"):
        resume_short(short_run, tmp_path, other_split, tiny_model_dir)


def test_a_resume_on_another_base_model_of_the_same_family_is_refused(
        short_run, split_dir, tiny_model_dir, tmp_path):
    """A copy of the base model with one UNet weight changed (another fine-tune of the same architecture)."""
    import shutil

    from safetensors.torch import save_file

    from rangefinder.errors import ConfigError

    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 0.5
    save_file(tensors, str(weights))
    with pytest.raises(ConfigError, match=f"cannot resume: .*the base model \\(it started from .*, this is {model}"):
        resume_short(short_run, tmp_path, split_dir, model)


def test_a_resume_on_the_base_model_with_its_scheduler_predicting_otherwise_is_refused(
        short_run, split_dir, tiny_model_dir, tmp_path):
    """The same weights, the scheduler config edited to v_prediction (an SD 2.x 768-v folder's config put right
    mid-run): the weights' digest matched, and the run went on training another target than its first updates."""
    import shutil

    from rangefinder.errors import ConfigError

    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    config = model / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "prediction_type": "v_prediction"}))
    with pytest.raises(ConfigError, match=r"cannot resume: .*what the model is trained to predict \(epsilon -> "
                                          r"v_prediction: the base model's scheduler config"):
        resume_short(short_run, tmp_path, split_dir, model)


@pytest.mark.slow
def test_sigterm_mid_epoch_writes_a_checkpoint_there_and_the_kfp_local_retry_resumes_identical(reference, tmp_path):
    """A pod eviction or a spot preemption, through a kfp.local retry (kfp 2.17's local runner honours
    `set_retry`): the step gets SIGTERM while update 5 is in flight (mid-epoch 2, between the checkpoints at 3 and
    6). The update finishes, a checkpoint of update 5 is written well within Kubernetes' 30 s grace period, the
    error says so in one sentence and the step fails; its retry resumes at 5 (training.resume, as the pipeline's
    training steps set it) and ends exactly like the uninterrupted run."""
    import re

    from kfp import local

    from tests.training.preemptible_pipeline import preemptible

    out, report = tmp_path / "out", tmp_path / "first-try.json"
    settings = child_settings(reference, out, first_try_marker=str(tmp_path / "first-try"),
                              first_try_report=str(report))
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"),
               raise_on_error=True)
    run = preemptible(settings=json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}))

    first = json.loads(report.read_text())  # the evicted attempt
    assert first["type"] == "Preempted" and first["checkpoints"] == ["checkpoint-000003", "checkpoint-000005"]
    said = re.fullmatch(r"stopped by SIGTERM at update 5 of 12: checkpoint \S+checkpoint-000005 written ([\d.]+) s "
                        r"after the signal; run again with --resume .*", first["message"])
    assert said and float(said.group(1)) < 30, first["message"]
    assert run.output == 5  # the retry resumed at the checkpoint the SIGTERM wrote
    assert_ends_like(reference, out)


def test_after_the_run_sigterm_is_the_process_s_own_again():
    """Inside a run SIGTERM only asks for a checkpoint at the next update boundary; once the run is over, the handler
    the process had is back. Left in place, a step that goes on after training (export, upload, registration) would
    take Kubernetes' SIGTERM as a request nobody reads, and sit out the grace period until SIGKILL."""
    from rangefinder.training.preemption import on_sigterm

    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with on_sigterm() as request:
            signal.raise_signal(signal.SIGTERM)
            assert request.at is not None and got == []  # the run's request, not the process's handler
        signal.raise_signal(signal.SIGTERM)
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
