"""One training run of a step on every accelerator of its node, or of several nodes.

The range test, the fine-tune and the retrain call `run_training` instead of the engine's `train()`:

- one process (`training.processes_per_node` resolves to 1, one node): `train()` in the step's own process;
- several processes on one node: PyTorch's own launcher, `python -m torch.distributed.run --standalone
  --nproc_per_node N -m rangefinder.steps.launch JOB.json`; each process runs `train()` (accelerate + DDP; gloo on
  CPU, NCCL on GPUs) and rank 0 writes the result;
- several nodes (`distributed.num_nodes` > 1): a Kubeflow Trainer v2 TrainJob whose runtime (`torch-distributed`)
  runs torchrun on every node with the same entrypoint (rangefinder.steps.trainjob).

JOB.json holds the whole config (no credentials: the config refuses them; they come from the environment) and the
run's TrainSpec, so every process, on any node, rebuilds the same run. The engine keeps the single-process
contracts across processes: validation measures the whole set once, each rank its share with the same fixed noise,
and every rank gets every loss (training.validation.Shard); rank 0 alone writes
checkpoints (atomically), metrics.csv, final/ and the MLflow metrics (into the step's run, opened and ended by
the step's process), and the divergence stop sees the same losses on every rank. A killed run resumes from its
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from rangefinder.config import (
    DataConfig,
    ModelConfig,
    RangefinderConfig,
    SamplingConfig,
    TrainingConfig,
    ValidationConfig,
    plan_for,
    resolve_processes_per_node,
)
from rangefinder.errors import ConfigError, RangefinderError
from rangefinder.formats.atomic import write_json

WORKER_MODULE = "rangefinder.steps.launch"  # this module: `python -m` runs `worker` in every process
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


def run_training(cfg: RangefinderConfig, spec: Any, *, out_dir: Path, metric_sink: Any = None,
                 save_final: bool = True, step_name: str = "train", pause_after_update: Optional[int] = None) -> Any:
    """Train `spec` (a training.TrainSpec whose world_size is `step_world_size`) in as many processes as it
    says; returns the engine's TrainResult. `metric_sink`: the step's MLflow run (a StepRun, or a
    training.PrefixedSink around it) or None. `pause_after_update`: the engine's (training.loop.train)."""
    from rangefinder.training.loop import train

    tc: TrainingConfig = spec.training
    split_n = _train_images(spec)
    check_global_batch(tc, split_n)
    plan_for(tc, split_n)  # impossible batch arithmetic fails here, before any process starts
    apply_torch_threads()  # a bad value fails here, before any process starts; torchrun's processes apply it again
    if tc.world_size == 1:
        return train(spec, out_dir=out_dir, metric_sink=metric_sink, save_final=save_final,
                     pause_after_update=pause_after_update)
    out_dir = Path(out_dir)
    if cfg.distributed.num_nodes > 1:
        # The nodes see the data volume, not this pod's disk: the split (a KFP artifact here) goes beside the job.
        import dataclasses
        import shutil

        shared_split = job_dir(out_dir) / "split"
        shutil.copytree(spec.split_dir, shared_split, dirs_exist_ok=True)
        spec = dataclasses.replace(spec, split_dir=shared_split)
    job = write_job(cfg, spec, out_dir, save_final=save_final, step_name=step_name,
                    mlflow_run_id=getattr(metric_sink, "run_id", None),
                    metric_prefix=getattr(metric_sink, "prefix", None), pause_after_update=pause_after_update)
    if cfg.distributed.num_nodes > 1:
        from rangefinder.steps.trainjob import run_trainjob

        run_trainjob(cfg, job, step_name=step_name, processes_per_node=processes_per_node(cfg),
                     worker_module=WORKER_MODULE)
    else:
        _torchrun(job, tc.world_size)
    return read_result(job)


def _train_images(spec: Any) -> int:
    from rangefinder.data.split import read_split

    split = read_split(spec.split_dir)
    return len(split.train) + (len(split.val) if spec.train_on == "train+val" else 0)


# ---------------------------------------------------------------------------------------------------------------
# The job file: what every process reads


def job_dir(out_dir: Path) -> Path:
    """Beside the run's folder (not in it: the run's folder is the engine's)."""
    return Path(out_dir).parent / f".{Path(out_dir).name}.launch"


def write_job(cfg: RangefinderConfig, spec: Any, out_dir: Path, *, save_final: bool, step_name: str,
              mlflow_run_id: Optional[str], metric_prefix: Optional[str] = None,
              pause_after_update: Optional[int] = None) -> Path:
    folder = job_dir(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [folder / RESULT_NAME, *folder.glob(f"{ERROR_PREFIX}*.json")]:
        old.unlink(missing_ok=True)  # a previous attempt's outcome must not be read as this one's
    job = {
        "config": cfg.model_dump(mode="json"),
        "training": spec.training.model_dump(mode="json"),
        "validation": spec.validation.model_dump(mode="json"),
        "split_dir": str(Path(spec.split_dir).resolve()),
        "model": spec.model.model_dump(mode="json") if isinstance(spec.model, ModelConfig) else
        (None if spec.model is None else str(spec.model)),
        "data": spec.data.model_dump(mode="json") if spec.data is not None else None,
        "train_on": spec.train_on,
        "sampling": spec.sampling.model_dump(mode="json") if spec.sampling is not None else None,
        "out_dir": str(Path(out_dir).resolve()),
        "save_final": save_final,
        "step_name": step_name,
        "mlflow_run_id": mlflow_run_id,
        "metric_prefix": metric_prefix,
        "pause_after_update": pause_after_update,
    }
    path = folder / JOB_NAME
    write_json(path, job)
    return path


def read_result(job: Path) -> Any:
    """Rank 0's TrainResult, or the first rank's error as one RangefinderError."""
    from rangefinder.training.loop import TrainResult

    folder = job.parent
    errors = sorted(folder.glob(f"{ERROR_PREFIX}*.json"))
    if errors:
        from rangefinder import errors as error_types

        e = json.loads(errors[0].read_text())
        kind = getattr(error_types, str(e.get("type")), RangefinderError)  # the rank's own error type, if it is ours
        raise (kind if isinstance(kind, type) and issubclass(kind, RangefinderError) else RangefinderError)(
            e["message"])
    path = folder / RESULT_NAME
    if not path.is_file():
        raise RangefinderError(
            f"the training processes ended without a result ({path} is missing); the log above says why. Run the "
            "step again: it resumes from the newest whole checkpoint"
        )
    d = json.loads(path.read_text())
    paths = ("out_dir", "metrics_csv", "updates_csv", "summary_path", "final_dir")
    d.update({k: Path(d[k]) if d[k] is not None else None for k in paths})
    d["checkpoints"] = [Path(p) for p in d["checkpoints"]]
    return TrainResult(**d)


def torchrun_command(job: Path, nproc: int) -> list[str]:
    """PyTorch's elastic launcher (torchrun) on this one node, running `worker` in `nproc` processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(nproc), "-m", WORKER_MODULE, str(job)]


def _torchrun(job: Path, nproc: int) -> None:
    """Run the processes; their output goes to the step's log as it comes."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default for several processes, without its warning
    with subprocess.Popen(torchrun_command(job, nproc), env=env) as proc, _forward_sigterm(proc):
        rc = proc.wait()
    if rc != 0:
        read_result(job)  # a rank's own error, if it wrote one
        raise RangefinderError(
            f"the {nproc} training processes failed (torchrun exit status {rc}); the log above says why. Run the "
            "step again: it resumes from the newest whole checkpoint"
        )


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
    from rangefinder.training.loop import TrainSpec, train

    job = json.loads(Path(job_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    folder = Path(job_path).parent
    apply_torch_threads()
    cfg = RangefinderConfig.model_validate(job["config"])
    model = job["model"]
    spec = TrainSpec(
        TrainingConfig.model_validate(job["training"]), ValidationConfig.model_validate(job["validation"]),
        split_dir=job["split_dir"],
        model=ModelConfig.model_validate(model) if isinstance(model, dict) else model,
        data=DataConfig.model_validate(job["data"]) if job["data"] is not None else None,
        train_on=job["train_on"],
        sampling=SamplingConfig.model_validate(job["sampling"]) if job.get("sampling") is not None else None,
    )
    sink: Any = None
    if rank == 0 and job.get("mlflow_run_id"):
        from rangefinder.tracking.runs import step_metric_sink

        sink = step_metric_sink(cfg, job["mlflow_run_id"], job["step_name"])
    engine_sink = sink
    if sink is not None and job.get("metric_prefix"):
        from rangefinder.training import PrefixedSink

        engine_sink = PrefixedSink(sink, job["metric_prefix"])
    try:
        result = train(spec, out_dir=job["out_dir"], metric_sink=engine_sink, save_final=job["save_final"],
                       pause_after_update=job.get("pause_after_update"))
    except RangefinderError as e:
        write_json(folder / f"{ERROR_PREFIX}{rank}.json", {"rank": rank, "type": type(e).__name__, "message": str(e)})
        print(f"rangefinder training process {rank}: error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if sink is not None:
            sink.close()
    if rank == 0:
        write_json(folder / RESULT_NAME, result.as_dict())
    return 0


if __name__ == "__main__":
    raise SystemExit(worker(Path(sys.argv[1])))
