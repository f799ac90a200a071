"""Two processes (torchrun, gloo on CPU): the stream is split between them and the counts still match the planner."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rangefinder.config import TrainingConfig
from rangefinder.data.split import read_split
from rangefinder.planning import plan_for

CHILD = Path(__file__).with_name("engine_child.py")


@pytest.mark.slow
def test_two_processes_take_the_planned_updates(split_dir, tiny_model_dir, tmp_path):
    training = dict(batch_size=3, grad_accum=2, epochs=1, world_size=2, checkpoint_every_updates=100,
                    cache_dir=str(tmp_path / "cache"))
    out = tmp_path / "out"
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps(dict(split_dir=str(split_dir), model=str(tiny_model_dir), out_dir=str(out),
                                        training=training, validation=dict(every_updates=1))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(CHILD), str(settings)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]

    # 16 images in chunks of 3 x 2 processes: 3 micro-batch steps, the last one partial (4 images), 2 updates.
    expected = plan_for(TrainingConfig(**training), len(read_split(split_dir).train))
    with open(out / "updates.csv", newline="") as f:
        updates = list(csv.DictReader(f))
    assert len(updates) == expected.total_updates == 2
    assert float(updates[-1]["epoch"]) == 1.0
    checkpoint = out / "checkpoints" / "checkpoint-000002"
    assert (checkpoint / "rng-0.pt").is_file() and (checkpoint / "rng-1.pt").is_file()
    assert json.loads((out / "run_summary.json").read_text())["status"] == "ok"
