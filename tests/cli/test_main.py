"""`rangefinder.cli.main.main` as an entry point that one process calls more than once (a notebook, a test harness,
a user's Python), with sys.stderr swapped between the calls."""

from __future__ import annotations

import os
import subprocess
import sys

# A fresh process: the libraries bind their log handler to sys.stderr on their import, which this one did long ago.
CALLS_TWICE = """
import contextlib, io, logging, sys
from rangefinder.cli.main import main

assert "huggingface_hub" not in sys.modules  # the first call imports it
for _ in range(2):
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = main(["sample", "--model", "org/not-in-the-cache", "--out", sys.argv[1], "--steps", "1"])
    assert code == 2 and err.getvalue().startswith("rangefinder sample: error:"), err.getvalue()
    err.close()  # the cell's or the harness's stream, gone
logging.getLogger("huggingface_hub.file_download").warning("a hub warning after the commands")
"""


def test_a_library_logs_to_the_stderr_of_now_after_the_command_that_imported_it(tmp_path):
    """huggingface_hub (diffusers, transformers, torch alike) adds a StreamHandler on its import, bound to sys.stderr
    as it is then, and `sample --model HUB_ID` imports it: after a call under a redirected sys.stderr whose stream was
    then closed, every later line of the library was "--- Logging error --- ValueError: I/O operation on closed
    file" on the stderr of the time. It is written there, once."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HF_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), RANGEFINDER_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", CALLS_TWICE, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "a hub warning after the commands\n"
