"""Fixtures for the bench tests."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class VersusSmoke:
    """`python -m bench.versus --smoke --unseen-images 4` on SD 1.x, run once: what main returned and printed, and
    the JSON it saved. Tests read it and write nothing into its folder."""

    out: Path
    result: dict[str, Any]
    printed: str


@pytest.fixture(scope="session")
def sd1_versus_smoke(tmp_path_factory: pytest.TempPathFactory) -> VersusSmoke:
    """The SD 1.x smoke case of bench.versus, every arm and the grid, scored on 4 unseen images. test_versus.py
    checks it whole; the probes that re-run its (a) (test_timesteps_probe.py, test_seed_soup_probe.py) start from
    it instead of a smoke of their own, which trained the same (a) and arms again. The three files are one xdist
    group (tests/conftest.py), so it is made once."""
    from bench.versus import main

    root = tmp_path_factory.mktemp("versus-smoke")
    out = root / "versus.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = main(["--smoke", "--family", "sd1", "--out", str(out), "--work-dir", str(root / "work"),
                       "--unseen-images", "4"])
    return VersusSmoke(out=out, result=result, printed=printed.getvalue())
