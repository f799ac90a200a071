"""A training run in a process of its own, for the resume test: `python engine_child.py SETTINGS.json`.

SETTINGS holds split_dir, model, out_dir, training (TrainingConfig fields), validation, and optionally data
(DataConfig fields);
kill_at_update: the process SIGKILLs itself while logging that update (no cleanup, no atexit), as a crash would;
pause_at_update: it creates the file `pause_marker` and sleeps (until killed) while logging that update;
sampling (SamplingConfig fields): samples during training; mlflow ({tracking_uri, run_id}): the run also logs to that
MLflow run through the multi-process workers' sink (tracking.runs.step_metric_sink), images included;
max_file_bytes: no file it writes may grow past that many bytes (RLIMIT_FSIZE; a write past it fails with EFBIG,
as on a full disk);
eio_at_update: from that update on, every rename the process makes fails with EIO, as on a failing disk (a seccomp
filter: the kernel itself returns the error; every file the run publishes is renamed into place);
A RangefinderError is printed on one line with exit status 2, as the CLI does.
"""

import ctypes
import errno
import json
import os
import resource
import signal
import sys
import time

import torch


def fail_with_eio(*syscalls: int) -> None:
    """A seccomp filter on this process: the given system calls (x86_64 numbers) return EIO from now on, as on a
    failing disk."""

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

    load, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    audit_arch_x86_64, allow, fail = 0xC000003E, 0x7FFF0000, 0x00050000 | errno.EIO
    n = len(syscalls)
    # Another architecture: allowed. Each listed call jumps to the last instruction (fail); none: the one before.
    code = [(load, 0, 0, 4), (jeq, 0, n + 1, audit_arch_x86_64), (load, 0, 0, 0),
            *[(jeq, n - i, 0, nr) for i, nr in enumerate(syscalls)], (ret, 0, 0, allow), (ret, 0, 0, fail)]
    prog = Prog(len(code), (Insn * len(code))(*[Insn(*c) for c in code]))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(317, 1, 1, ctypes.byref(prog)) != 0:  # NO_NEW_PRIVS; TSYNC
        raise OSError(ctypes.get_errno(), "cannot install the seccomp filter")


def fail_renames_with_eio():
    """rename, renameat and renameat2 return EIO from now on."""
    fail_with_eio(82, 264, 316)


class KillAt:
    def __init__(self, update, pause_at=None, pause_marker=None, eio_at=None):
        self.update, self.pause_at, self.pause_marker, self.eio_at = update, pause_at, pause_marker, eio_at

    def log_metrics(self, metrics, step):
        if "train_loss" not in metrics or "val_loss" in metrics:
            return
        if self.eio_at is not None and step == self.eio_at:
            fail_renames_with_eio()
        if self.update is not None and step == self.update:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.pause_at is not None and step == self.pause_at:
            open(self.pause_marker, "w").close()
            while True:
                time.sleep(1)


class KillAtWithMlflow(KillAt):
    """KillAt, also logging to a real MLflow run (metrics and the samples' images)."""

    def __init__(self, sink, *a):
        super().__init__(*a)
        self.sink, self.run_id = sink, sink.run_id

    def log_metrics(self, metrics, step):
        self.sink.log_metrics(metrics, step)
        super().log_metrics(metrics, step)

    def log_image(self, image, artifact_file=None, *, key=None, step=None):
        self.sink.log_image(image, artifact_file, key=key, step=step)


def main(path):
    torch.set_num_threads(1)  # every run of the comparison computes with the same reduction order
    s = json.loads(open(path).read())
    if s.get("max_file_bytes"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (s["max_file_bytes"], s["max_file_bytes"]))
    from rangefinder.config import DataConfig, SamplingConfig, TrainingConfig, ValidationConfig, parse_config
    from rangefinder.errors import RangefinderError
    from rangefinder.training.loop import TrainSpec, train

    data = DataConfig(**s["data"]) if s.get("data") else None  # e.g. aspect-ratio buckets
    sampling = SamplingConfig(**s["sampling"]) if s.get("sampling") else None
    kill = (s.get("kill_at_update"), s.get("pause_at_update"), s.get("pause_marker"), s.get("eio_at_update"))
    if s.get("mlflow"):
        from rangefinder.tracking.runs import step_metric_sink

        cfg = parse_config({"tracking": {"tracking_uri": s["mlflow"]["tracking_uri"]}})
        sink = KillAtWithMlflow(step_metric_sink(cfg, s["mlflow"]["run_id"], "finetune"), *kill)
    else:
        sink = KillAt(*kill)
    try:
        result = train(TrainSpec(TrainingConfig(**s["training"]), ValidationConfig(**s["validation"]),
                                 split_dir=s["split_dir"], model=s["model"], data=data, sampling=sampling),
                       out_dir=s["out_dir"], metric_sink=sink)
    except RangefinderError as e:
        print(f"rangefinder train: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result.as_dict()))


if __name__ == "__main__":
    main(sys.argv[1])
