"""A training run in a process of its own, for the resume test: `python engine_child.py SETTINGS.json`.

SETTINGS holds split_dir, model, out_dir, training (TrainingConfig fields), validation, and optionally
kill_at_update: the process SIGKILLs itself while logging that update (no cleanup, no atexit), as a crash would.
"""

import json
import os
import signal
import sys

import torch


class KillAt:
    def __init__(self, update):
        self.update = update

    def log_metrics(self, metrics, step):
        if self.update is not None and step == self.update and "train_loss" in metrics and "val_loss" not in metrics:
            os.kill(os.getpid(), signal.SIGKILL)


def main(path):
    torch.set_num_threads(1)  # every run of the comparison computes with the same reduction order
    s = json.loads(open(path).read())
    from rangefinder.config import TrainingConfig, ValidationConfig
    from rangefinder.training.loop import TrainSpec, train

    result = train(TrainSpec(TrainingConfig(**s["training"]), ValidationConfig(**s["validation"]),
                             split_dir=s["split_dir"], model=s["model"]),
                   out_dir=s["out_dir"], metric_sink=KillAt(s.get("kill_at_update")))
    print(json.dumps(result.as_dict()))


if __name__ == "__main__":
    main(sys.argv[1])
