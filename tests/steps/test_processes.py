"""The fine-tune on several processes of one node (torch.distributed.run, gloo on CPU), through the steps' launcher.

Two uninterrupted runs of the fine-tune's own training settings (`TrainSpec.finetune`) at the same global
batch of 4, made once for the module: one process (batch 4) and two processes (batch 2 each). The curves agree within
float tolerance, each rank validated only its share of the set, and the checkpoints are rank 0's. The two-process
run is the reference for one run interrupted twice (SIGTERM to one rank after the first checkpoint, then the
halving's pause in its resume), which ends with its weights, and for the bf16 all-reduce.
"""

from __future__ import annotations

import csv
import json
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import RangefinderConfig, SamplingConfig, resolve_processes_per_node
from rangefinder.data.split import read_split
from rangefinder.errors import ConfigError, Preempted, RangefinderError
from rangefinder.formats import checkpoints
from rangefinder.launch import processes as launch
from rangefinder.training.samples import read_index
from rangefinder.training.spec import TrainSpec

UNET = Path("final") / "unet" / "diffusion_pytorch_model.safetensors"


def _cfg(processes: int, batch: int, cache: Path) -> RangefinderConfig:
    return RangefinderConfig(
        training={"processes_per_node": processes, "batch_size": batch, "lr": 2e-4, "seed": 7,
                  "cache_dir": str(cache), "random_flip": True, "cond_dropout": 0.2, "noise_offset": 0.05},
        validation={"every_epochs": 1, "timesteps": 2},
        finetune={"epochs": 3},
    )


def _spec(cfg: RangefinderConfig, split_dir: Path, model: Path, sampling=None, **training) -> TrainSpec:
    ft = TrainSpec.finetune(cfg, read_split(split_dir), bounds=(1e-4, 3e-4), lr=2e-4,
                            world_size=launch.step_world_size(cfg))
    tc = ft.training.model_validate({**ft.training.model_dump(), **training})
    # Built by hand around the fine-tune's settings (changed by `training`): the engine plans it.
    return TrainSpec(tc, cfg.validation, split_dir=split_dir, model=str(model), sampling=sampling)


# Samples during training in the two-process runs: rank 0 renders them (the job file carries the settings).
SAMPLING = SamplingConfig(num_inference_steps=2, every_validations=2)


def _val_losses(out: Path) -> list[float]:
    with open(out / "metrics.csv", newline="") as f:
        return [float(r["val_loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def one_thread():
    """Every run here computes on one torch thread, as the launched processes do (OMP_NUM_THREADS)."""
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        yield
    torch.set_num_threads(before)


@dataclass(frozen=True)
class Runs:
    """The uninterrupted runs every test here compares with: one process (`one`), two (`two`, with samples)."""

    one: Path
    two: Path
    cfg: RangefinderConfig
    spec: TrainSpec


@pytest.fixture(scope="module")
def runs(one_thread, split_dir, tiny_model_dir, tmp_path_factory) -> Runs:
    work = tmp_path_factory.mktemp("processes")
    cache = work / "cache"
    one, two = _cfg(1, 4, cache), _cfg(2, 2, cache)
    spec1, spec2 = _spec(one, split_dir, tiny_model_dir), _spec(two, split_dir, tiny_model_dir, SAMPLING)
    assert (spec1.training.world_size, spec2.training.world_size) == (1, 2)
    # 16 images at global batch 4: 4 updates an epoch, 12 in all; a checkpoint every epoch.
    assert spec2.training.checkpoint_every_updates == 4
    single = launch.run_training(one, spec1, out_dir=work / "one")
    double = launch.run_training(two, spec2, out_dir=work / "two")
    assert single.updates == double.updates == 12 and single.status == double.status == "ok"
    return Runs(one=work / "one", two=work / "two", cfg=two, spec=spec2)


@pytest.mark.slow
def test_two_processes_train_what_one_does(runs):
    # The same images, flips, timesteps and noise per update: the validation curves agree up to float rounding
    # (DDP sums the two halves' gradients in another order than one process does).
    a, b = _val_losses(runs.one), _val_losses(runs.two)
    assert len(a) == len(b) == 4
    # The baseline: the same model and fixed noise, each rank scoring half of the pairs (other batches: last bits).
    assert b[0] == pytest.approx(a[0], rel=1e-6)
    assert a[1:] != a[:-1]  # the curve moves (the comparison below is not of four copies of one number)
    assert b == pytest.approx(a, rel=1e-4)
    # Validation ran once over the set, not once per rank: each rank scored its share of the (item, k) pairs.
    (one_pass,) = json.loads((runs.one / "run_summary.json").read_text())["validation_pairs_by_rank"]
    shares = json.loads((runs.two / "run_summary.json").read_text())["validation_pairs_by_rank"]
    assert len(shares) == 2 and sum(shares) == one_pass and shares[0] == shares[1], shares
    # Rank 0 rendered the samples: validations 0 to 3 at every 2nd and the last.
    assert [e["update"] for e in read_index(runs.two)["samples"]] == [0, 8, 12]
    assert read_index(runs.one) is None

    # Rank 0 wrote every checkpoint (its weights, optimizer and state); each rank added only its RNG states.
    for ckpt in checkpoints.list_checkpoints(runs.two / "checkpoints"):
        state = checkpoints.read_state(ckpt)
        assert state["written_by"] == {"rank": 0, "world_size": 2}
        assert (ckpt / "rng-0.pt").is_file() and (ckpt / "rng-1.pt").is_file() and not (ckpt / "rng-2.pt").exists()


@pytest.mark.slow
def test_an_interrupted_two_process_run_ends_as_the_uninterrupted_one(runs, split_dir, tiny_model_dir, tmp_path):
    """One run, interrupted twice, ends as the shared uninterrupted two-process run: bit-identical curve, samples
    index and weights. Each interruption in turn is asserted where it stopped, so a break in either fails here.

    1. Evicted after the first checkpoint: SIGTERM to rank 1 only. Rank 0 never gets it, yet both stop at the same
       update boundary (they sum their flags there) and write a checkpoint at it together, then the step fails; the
       resume goes on from there. (SIGKILL of a whole run: training/test_resume.py)
    2. The pause the fine-tune's successive halving uses, given to that resume: it reaches every process through
       the job file, both stop at the first validation after the update given (8), and the run goes on from there.
    """
    cut = tmp_path / "cut"
    # The step's own call (launch.run_training: torchrun, then the ranks' outcome read back) in a thread, so that
    # rank 1 can be found among this process's children and signalled; its error is what the step would raise.
    outcome: dict[str, Exception] = {}

    def step() -> None:
        try:
            launch.run_training(runs.cfg, runs.spec, out_dir=cut, step_name="finetune")
        except Exception as e:  # handed to the test's thread and asserted there
            outcome["error"] = e

    thread = threading.Thread(target=step)
    thread.start()
    deadline = time.monotonic() + 300
    while not checkpoints.list_checkpoints(cut / "checkpoints") and thread.is_alive():
        assert time.monotonic() < deadline, "no checkpoint within 5 minutes"
        time.sleep(0.02)
    rank1 = min((c for c in psutil.Process().children(recursive=True) if c.environ().get("RANK") == "1"),
                key=lambda c: c.create_time())  # the worker itself, not a process it started
    rank1.send_signal(signal.SIGTERM)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert not (cut / "final").exists(), "the run ended before it could be stopped: the resume is not tested"
    done = [checkpoints.checkpoint_update(c) for c in checkpoints.list_checkpoints(cut / "checkpoints")]
    stopped = max(done)
    # Before the validation at 8, so that the pause below stops the resumed run there.
    assert stopped < 8, f"stopped at update {stopped}: the pause after the resume is not tested"
    # One error in the step, the rank's own type and sentence (the ranks' error file, read after torchrun failed).
    assert isinstance(outcome.get("error"), Preempted), outcome
    assert f"stopped by SIGTERM at update {stopped} of 12" in str(outcome["error"]), outcome
    stopped_at = checkpoints.list_checkpoints(cut / "checkpoints")[-1]
    assert checkpoints.verify(stopped_at) is None and (stopped_at / "rng-1.pt").is_file()

    # Without resume, the engine refuses a folder that holds a run (each rank runs this same check before it trains;
    # a rank's error reaching the step as one error of its own type is the SIGTERM's above). One process, here.
    one = _cfg(1, 4, Path(runs.cfg.training.cache_dir))
    fresh = _spec(one, split_dir, tiny_model_dir, resume=False)
    with pytest.raises(ConfigError, match="already holds a run; pass --resume"):
        launch.run_training(one, fresh, out_dir=runs.one)

    # training.resume is on in the fine-tune's settings: the resume goes on from the SIGTERM's checkpoint, and pauses.
    paused = launch.run_training(runs.cfg, runs.spec, out_dir=cut, pause_after_update=stopped + 1)
    assert (paused.status, paused.resumed_from, paused.updates, paused.final_dir) == ("paused", stopped, 8, None)
    on = launch.run_training(runs.cfg, runs.spec, out_dir=cut)
    assert (on.status, on.resumed_from, on.updates) == ("ok", 8, 12)

    assert _val_losses(cut) == _val_losses(runs.two)
    assert [e["update"] for e in read_index(cut)["samples"]] == [0, 8, 12]  # whole: no duplicate, no gap
    w, r = load_file(str(runs.two / UNET)), load_file(str(cut / UNET))
    assert w.keys() == r.keys() and all(torch.equal(w[k], r[k]) for k in w)


@pytest.mark.slow
def test_bf16_gradient_all_reduce_trains_close_to_fp32(runs, split_dir, tiny_model_dir, tmp_path):
    """training.allreduce_dtype: bf16 makes DDP sum the gradients in bf16 (half the bytes per update): the run
    trains like the fp32 one (the shared two-process run: fp32 is the default), but not bit for bit (which shows
    the hook was on the wire)."""
    assert runs.spec.training.allreduce_dtype == "fp32"
    spec = _spec(runs.cfg, split_dir, tiny_model_dir, SAMPLING, allreduce_dtype="bf16")
    bf16 = launch.run_training(runs.cfg, spec, out_dir=tmp_path / "bf16")
    assert bf16.updates == 12 and bf16.status == "ok"
    a, b = _val_losses(runs.two), _val_losses(tmp_path / "bf16")
    assert a[0] == b[0]  # the same model before any update
    assert b == pytest.approx(a, rel=1e-2)
    w, r = load_file(str(runs.two / UNET)), load_file(str(tmp_path / "bf16" / UNET))
    assert not all(torch.equal(w[k], r[k]) for k in w), "bf16 all-reduce changed nothing: the hook is not in use"
    changed = max(float((w[k] - r[k]).abs().max()) for k in w)
    assert changed < 1e-3, changed  # rounding, not another run


def test_bad_process_counts_are_one_clear_error(split_dir, tiny_model_dir, tmp_path):
    # More processes than the node's GPUs.
    with pytest.raises(ConfigError, match="sees only 2 GPU"):
        resolve_processes_per_node(4, gpus=2)
    assert resolve_processes_per_node("auto", gpus=0) == 1 and resolve_processes_per_node("auto", gpus=8) == 8
    assert resolve_processes_per_node(8, gpus=8) == 8  # one process per GPU, as many as the node has
    assert resolve_processes_per_node(2, gpus=0) == 2  # no GPU: gloo processes on the CPU
    # A global batch larger than the training set (16 images): 4 processes x 8 images.
    cfg = _cfg(4, 8, tmp_path / "cache")
    with pytest.raises(ConfigError, match="global batch.*32.*larger than the 16 training images"):
        launch.run_training(cfg, _spec(cfg, split_dir, tiny_model_dir), out_dir=tmp_path / "big")
    assert not (tmp_path / "big").exists()
    launch.check_global_batch(cfg.training.model_copy(update={"batch_size": 4, "world_size": 4}), 16)  # full-cycle


def test_a_new_attempt_never_reads_an_earlier_attempt_s_outcome(split_dir, tiny_model_dir, tmp_path):
    """A step run again (a KFP retry) writes its job where the killed attempt did: that attempt's result or a rank's
    error file would be read as this attempt's when its processes end without one."""
    cfg = _cfg(2, 2, tmp_path / "cache")
    spec = _spec(cfg, split_dir, tiny_model_dir)

    def job():
        return launch.write_job(cfg, spec, tmp_path / "out", save_final=True, step_name="finetune", mlflow_run_id=None)

    folder = job().parent
    (folder / launch.RESULT_NAME).write_text("{}")
    (folder / f"{launch.ERROR_PREFIX}1.json").write_text(json.dumps({"rank": 1, "type": "Preempted", "message": "x"}))
    with pytest.raises(RangefinderError, match="ended without a result"):
        launch.read_result(job())


def test_torch_threads_come_from_the_environment_and_a_bad_value_is_one_clear_error(monkeypatch):
    """$RANGEFINDER_TORCH_THREADS sets torch's CPU threads in a training step, one process or several (local runs
    set 1: tests/pipelines/test_local_run.py reads it back from a step's run summary)."""
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv(launch.THREADS_ENV, "1")
        launch.apply_torch_threads()
        assert torch.get_num_threads() == 1
        for bad in ("two", "0", "-1"):
            monkeypatch.setenv(launch.THREADS_ENV, bad)
            with pytest.raises(ConfigError, match=f"RANGEFINDER_TORCH_THREADS='{bad}' is not a thread count"):
                launch.apply_torch_threads()
    finally:
        torch.set_num_threads(before)
