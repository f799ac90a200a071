"""Fixtures for the pipeline tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.tracking.fixtures import mlflow_server_uri  # noqa: F401  (a real `mlflow server` on loopback)


@dataclass(frozen=True)
class DemoRun:
    """The unchanged `rangefinder demo`, run once as a new user runs it: what it printed (--json) and its folder."""

    summary: dict[str, Any]  # the printed result
    out_dir: Path
    run: Any  # rangefinder.pipelines.local_run.LocalRun, read back from the run's folder: task outputs and artifacts


@pytest.fixture(scope="session")
def demo_run(tiny_model_dir, tmp_path_factory) -> DemoRun:
    """The whole default demo (range test, zoom, the 80-epoch fine-tune with successive halving, grid, registry;
    config.DEMO_RUN), run unchanged through the CLI in a process of its own, with no MLflow or thread setting from
    the test's environment: so it writes sqlite:///<out>/mlflow.db, the local default, and its steps pick their
    threads as a user's do. Shared by the tests that read a whole local run (issue 32: the demo's run must run whole
    anyway, to prove its settings learn, so it is also the run whose record, reports and pages are read):
    test_demo_learns.py, test_local_run.py, test_reports_in_browser.py, one xdist group (tests/conftest.py)."""
    from rangefinder.pipelines.local_run import LocalRun, _collect

    out = tmp_path_factory.mktemp("demo") / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_") and k != "RANGEFINDER_TORCH_THREADS"}
    r = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "demo", "--out", str(out), "--json"],
                       capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout)
    run = LocalRun(out_dir=out, run_dir=Path(s["pipeline_root"]), tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    _collect(run)  # every task's outputs and artifacts, as the run itself read them before it printed
    return DemoRun(summary=s, out_dir=out, run=run)


@pytest.fixture(scope="session")
def demo_run_mlflow(demo_run):
    """A real `mlflow server` on the demo run's own store (<out>/mlflow.db), started once for the tests that read
    that record through it (test_local_run.py through MlflowClient, test_reports_in_browser.py in a browser), one
    server start instead of one per test; they only read it."""
    from tests.tracking.fixtures import start_mlflow_server, stop_mlflow_server

    uri, proc = start_mlflow_server(demo_run.out_dir)
    yield uri
    stop_mlflow_server(proc)
