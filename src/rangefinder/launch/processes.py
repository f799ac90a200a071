"""One training run of a step on every accelerator of its node, or of several nodes.

The range test, the fine-tune and the retrain call `run_training` instead of the engine's `train()`:

- one process (`training.processes_per_node` resolves to 1, one node): `train()` in the step's own process;
- several processes on one node: PyTorch's own launcher, `python -m torch.distributed.run --standalone
  --nproc_per_node N -m rangefinder.launch.processes JOB.json`; each process runs `train()` (accelerate + DDP; gloo on
  CPU, NCCL on GPUs) and rank 0 writes the result;
- several nodes (`distributed.num_nodes` > 1): a Kubeflow Trainer v2 TrainJob whose runtime (`torch-distributed`)
  runs torchrun on every node with the same entrypoint (rangefinder.launch.trainjob).

JOB.json (a `LaunchJob`) holds the whole config (no credentials: the config refuses them; they come from the
environment) and the run's TrainSpec as its own JSON, so every process, on any node, rebuilds the same run. The
engine keeps the single-process contracts across processes: validation measures the whole set once, each rank its
share with the same fixed noise, and every rank gets every loss (training.validation.Shard); rank 0 alone writes
checkpoints (atomically), metrics.csv, final/ and the MLflow metrics (into the step's run, opened and ended by the
step's process), and the divergence stop sees the same losses on every rank. A killed run resumes from its
newest whole checkpoint when the step is run again (`training.resume`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from pydantic import TypeAdapter

from rangefinder.config import RangefinderConfig, TrainingConfig, resolve_processes_per_node
from rangefinder.errors import ConfigError, RangefinderError
from rangefinder.formats.atomic import write_json
from rangefinder.launch.trainjob import TrainJobStatusSink, status_sink
from rangefinder.training.sinks import MetricSink
from rangefinder.training.spec import JSONValue, TrainResult, TrainSpec

if TYPE_CHECKING:
    from rangefinder.data.split import Split

WORKER_MODULE = "rangefinder.launch.processes"  # this module: `python -m` runs `worker` in every process
JOB_NAME = "launch-job.json"
RESULT_NAME = "launch-result.json"
ERROR_PREFIX = "launch-error-"


def processes_per_node(cfg: RangefinderConfig, gpus: Optional[int] = None) -> int:
    """`training.processes_per_node` resolved for this step. One node: auto = the GPUs this pod sees (1 on CPU).
    Several nodes: the step's own pod only submits the TrainJob, so auto = `kubernetes.gpu_count` per node."""
    setting = cfg.training.processes_per_node
    if cfg.distributed.num_nodes > 1:
        return resolve_processes_per_node(setting, cfg.kubernetes.gpu_count)
    return resolve_processes_per_node(setting, gpus)


def step_world_size(cfg: RangefinderConfig, gpus: Optional[int] = None) -> int:
    """The training steps' world size: processes per node x nodes (the batch arithmetic's world_size)."""
    return processes_per_node(cfg, gpus) * cfg.distributed.num_nodes


def batch_note(tc: TrainingConfig) -> str:
    """The global batch in words, for the step's report."""
    eff = tc.batch_size * tc.grad_accum * tc.world_size
    return (f"global batch {eff} = {tc.batch_size} per device x {tc.world_size} process(es) x "
            f"{tc.grad_accum} accumulation")


def check_global_batch(tc: TrainingConfig, train_images: int) -> None:
    """Several processes with a global batch above the training set would leave devices without images."""
    if tc.world_size > 1:
        eff = tc.batch_size * tc.grad_accum * tc.world_size
        if eff > train_images:
            raise ConfigError(
                f"the global batch, batch_size {tc.batch_size} x grad_accum {tc.grad_accum} x {tc.world_size} "
                f"processes = {eff}, is larger than the {train_images} training images; lower training.batch_size "
                "or training.grad_accum, or use fewer processes (training.processes_per_node, distributed.num_nodes)"
            )


THREADS_ENV = "RANGEFINDER_TORCH_THREADS"


def apply_torch_threads() -> None:
    """torch's CPU threads from $RANGEFINDER_TORCH_THREADS, when set (local runs set 1: pipelines.local_run)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{THREADS_ENV}={value!r} is not a thread count; set a whole number of 1 or more, or unset "
                          "it for torch's own choice")
    import torch

    torch.set_num_threads(int(value))


def run_training(cfg: RangefinderConfig, spec: TrainSpec, *, out_dir: Path, metric_sink: Optional[MetricSink] = None,
                 save_final: bool = True, step_name: str = "train", pause_after_update: Optional[int] = None,
                 split: Optional[Split] = None) -> TrainResult:
    """Train `spec` (whose world_size is `step_world_size`) in as many processes as it says. `metric_sink`: the
    step's MLflow run (a StepRun, or a training.PrefixedSink around it) or None. `pause_after_update`: the engine's
    (training.loop.train). `split`: the split at spec.split_dir as the step read it (one process trains from it;
    several read it each)."""
    from rangefinder.training.loop import train

    tc = spec.training
    if spec.plan is None:  # a spec built by hand: plan it here (impossible batch arithmetic fails here)
        spec = replace(spec, plan=spec.plan_from(split if split is not None else _read(spec)))
    assert spec.plan is not None
    check_global_batch(tc, spec.plan.train_images)
    apply_torch_threads()  # a bad value fails here, before any process starts; torchrun's processes apply it again
    if tc.world_size == 1:
        return train(spec, out_dir=out_dir, metric_sink=metric_sink, save_final=save_final,
                     pause_after_update=pause_after_update, split=split)
    out_dir = Path(out_dir)
    if cfg.distributed.num_nodes > 1:
        # The nodes see the data volume, not this pod's disk: the split (a KFP artifact here) goes beside the job.
        import shutil

        shared_split = job_dir(out_dir) / "split"
        shutil.copytree(spec.split_dir, shared_split, dirs_exist_ok=True)
        spec = replace(spec, split_dir=shared_split)
    job = write_job(cfg, spec, out_dir, save_final=save_final, step_name=step_name,
                    mlflow_run_id=getattr(metric_sink, "run_id", None),
                    metric_prefix=getattr(metric_sink, "prefix", None), pause_after_update=pause_after_update)
    if cfg.distributed.num_nodes > 1:
        from rangefinder.launch.trainjob import run_trainjob

        run_trainjob(cfg, job, step_name=step_name, processes_per_node=processes_per_node(cfg),
                     worker_module=WORKER_MODULE)
    else:
        _torchrun(job, tc.world_size)
    return read_result(job)


def _read(spec: TrainSpec) -> Split:
    from rangefinder.data.split import read_split

    return read_split(spec.split_dir)


# ---------------------------------------------------------------------------------------------------------------
# The job file: what every process reads


@dataclass(frozen=True)
class LaunchJob:
    """What every process of a run reads: the config, the run's spec (its own JSON), where it writes, and where its
    metrics go (rank 0 reopens the step's MLflow run by its id)."""

    config: RangefinderConfig
    spec: TrainSpec
    out_dir: Path
    save_final: bool
    step_name: str
    mlflow_run_id: Optional[str] = None
    metric_prefix: Optional[str] = None
    pause_after_update: Optional[int] = None

    def to_json(self) -> dict[str, JSONValue]:
        return _JOB.dump_python(self, mode="json")

    @classmethod
    def from_json(cls, data: dict[str, JSONValue]) -> LaunchJob:
        return _JOB.validate_python(data)


_JOB: TypeAdapter[LaunchJob] = TypeAdapter(LaunchJob)


def job_dir(out_dir: Path) -> Path:
    """Beside the run's folder (not in it: the run's folder is the engine's)."""
    return Path(out_dir).parent / f".{Path(out_dir).name}.launch"


def write_job(cfg: RangefinderConfig, spec: TrainSpec, out_dir: Path, *, save_final: bool, step_name: str,
              mlflow_run_id: Optional[str], metric_prefix: Optional[str] = None,
              pause_after_update: Optional[int] = None) -> Path:
    folder = job_dir(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [folder / RESULT_NAME, *folder.glob(f"{ERROR_PREFIX}*.json")]:
        old.unlink(missing_ok=True)  # a previous attempt's outcome must not be read as this one's
    job = LaunchJob(config=cfg, spec=replace(spec, split_dir=Path(spec.split_dir).resolve()),
                    out_dir=Path(out_dir).resolve(), save_final=save_final, step_name=step_name,
                    mlflow_run_id=mlflow_run_id, metric_prefix=metric_prefix, pause_after_update=pause_after_update)
    path = folder / JOB_NAME
    write_json(path, job.to_json())
    return path


def read_result(job: Path) -> TrainResult:
    """Rank 0's TrainResult, or the first rank's error as one RangefinderError."""
    folder = job.parent
    _raise_rank_error(folder)
    path = folder / RESULT_NAME
    if not path.is_file():
        raise RangefinderError(
            f"the training processes ended without a result ({path} is missing); the log above says why. Run the "
            "step again: it resumes from the newest whole checkpoint"
        )
    return TrainResult.from_json(json.loads(path.read_text()))


def _raise_rank_error(folder: Path) -> None:
    """The first rank's own error (its type, if it is ours), when a rank wrote one."""
    errors = sorted(folder.glob(f"{ERROR_PREFIX}*.json"))
    if errors:
        from rangefinder import errors as error_types

        e = json.loads(errors[0].read_text())
        kind = getattr(error_types, str(e.get("type")), RangefinderError)  # the rank's own error type, if it is ours
        raise (kind if isinstance(kind, type) and issubclass(kind, RangefinderError) else RangefinderError)(
            e["message"])


def torchrun_command(job: Path, nproc: int) -> list[str]:
    """PyTorch's elastic launcher (torchrun) on this one node, running `worker` in `nproc` processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(nproc), "-m", WORKER_MODULE, str(job)]


def _torchrun(job: Path, nproc: int) -> None:
    """Run the processes; their output goes to the step's log as it comes."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default for several processes, without its warning
    with subprocess.Popen(torchrun_command(job, nproc), env=env, preexec_fn=sigterm_when_parent_dies()) as proc, \
            _forward_sigterm(proc):
        rc = proc.wait()
    if rc != 0:
        # A rank's own error, if it wrote one; else (a rank killed, a crash) torchrun's status, not read_result's
        # "ended without a result", which named only the hidden job folder's missing file.
        _raise_rank_error(job.parent)
        raise RangefinderError(
            f"the {nproc} training processes failed (torchrun exit status {rc}); the log above says why. Run the "
            "step again: it resumes from the newest whole checkpoint"
        )


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def sigterm_when_parent_dies() -> Optional[Callable[[], None]]:
    """What makes a process get SIGTERM when the process that started it dies, on Linux (prctl PR_SET_PDEATHSIG);
    None elsewhere. Called in a child between fork and exec (Popen's preexec_fn), or by a process on itself.

    torchrun starts its ranks in sessions of their own, and nothing stops them when their launcher dies: a step (or
    `rangefinder train`) killed with SIGKILL, or a torchrun the OOM killer took, left the ranks training on, orphans
    that held the output folder's lock (the resume was refused: "in use by another training run") and wrote into
    it. With this, a launcher's death reaches torchrun and each rank as the SIGTERM of an eviction: the ranks write a
    checkpoint at the current update together and stop (training/preemption.py)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: nothing is loaded between fork and exec

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return set_death_signal


def _stop_with_parent() -> None:
    """A rank: SIGTERM when its torchrun dies (sigterm_when_parent_dies); at once if it is already gone."""
    set_death_signal = sigterm_when_parent_dies()
    if set_death_signal is None:
        return
    parent = os.getppid()
    set_death_signal()
    if os.getppid() != parent:  # torchrun died before the death signal was set: it never comes
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def _forward_sigterm(proc: subprocess.Popen) -> Iterator[None]:
    """SIGTERM to the step (a pod eviction) goes on to torchrun, which passes it to every rank: they write a
    checkpoint at the current update and stop (training/preemption.py), and the step fails so that its retry goes
    on from there. Without this the step would die at once and leave the ranks to the pod's SIGKILL."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------------------------
# One process of the run (torchrun's entrypoint, here and on every node of a TrainJob)


def worker(job_path: Path) -> int:
    from rangefinder.training.loop import train
    from rangefinder.training.sinks import PrefixedSink

    _stop_with_parent()
    job = LaunchJob.from_json(json.loads(Path(job_path).read_text()))
    rank = int(os.environ.get("RANK", "0"))
    folder = Path(job_path).parent
    apply_torch_threads()
    sink = None
    if rank == 0 and job.mlflow_run_id:
        from rangefinder.tracking.runs import step_metric_sink

        sink = step_metric_sink(job.config, job.mlflow_run_id, job.step_name)
    engine_sink: Optional[MetricSink] = sink
    if sink is not None and job.metric_prefix:
        engine_sink = PrefixedSink(sink, job.metric_prefix)
    if rank == 0:  # the TrainJob's status, when Trainer's TrainJobStatus feature gave this node a server
        engine_sink = status_sink(engine_sink, lambda: (job.spec.plan or job.spec.plan_from(_read(job.spec)))
                                  .total_updates)
    try:
        result = train(job.spec, out_dir=job.out_dir, metric_sink=engine_sink, save_final=job.save_final,
                       pause_after_update=job.pause_after_update)
    except RangefinderError as e:
        write_json(folder / f"{ERROR_PREFIX}{rank}.json", {"rank": rank, "type": type(e).__name__, "message": str(e)})
        print(f"rangefinder training process {rank}: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if sink is not None:
            sink.close()
    if rank == 0:
        write_json(folder / RESULT_NAME, result.to_json())
        if isinstance(engine_sink, TrainJobStatusSink):
            engine_sink.finish()  # 100 % in the TrainJob's status
    return 0


if __name__ == "__main__":
    raise SystemExit(worker(Path(sys.argv[1])))
