"""Checkpoints that are either whole or absent, and resume from the newest whole one.

A checkpoint is a folder `checkpoints/checkpoint-<update:06d>/` holding:
- `weights.safetensors`: the method's trained tensors (Method.trainable_state_dict);
- `optimizer.pt`, and `ema.pt` / `scaler.pt` when used;
- `rng-<rank>.pt`: Python, NumPy, torch CPU/CUDA RNG states and the training generator of each process;
- `state.json`: update, micro-batches done (the stream position), the metrics and per-update rows so far, and
  what the loop needs to go on exactly as if never stopped. Written last.
It is assembled under a temporary name and renamed into place, so a killed run leaves either a whole checkpoint or a
`.tmp` folder that resume ignores (and the next save removes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

_NAME = re.compile(r"^checkpoint-(\d+)$")
REQUIRED = ("weights.safetensors", "optimizer.pt", "state.json")


def checkpoint_name(update: int) -> str:
    return f"checkpoint-{update:06d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Whole checkpoints under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and all((p / f).is_file() for f in REQUIRED):
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: Path) -> Optional[Path]:
    found = list_checkpoints(root)
    return found[-1] if found else None


def begin(root: Path, update: int) -> Path:
    """A fresh temporary folder for the checkpoint of `update` (main process)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp"):  # left by a run killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f"{checkpoint_name(update)}.tmp"
    tmp.mkdir()
    return tmp


def tmp_folder(root: Path, update: int) -> Path:
    return root / f"{checkpoint_name(update)}.tmp"


def write_rng(tmp: Path, rank: int, states: dict[str, Any]) -> None:
    torch.save(states, tmp / f"rng-{rank}.pt")


def write_main(
    tmp: Path,
    *,
    weights: dict[str, torch.Tensor],
    optimizer: dict,
    state: dict[str, Any],
    ema: Optional[dict] = None,
    scaler: Optional[dict] = None,
) -> None:
    save_file(weights, str(tmp / "weights.safetensors"))
    torch.save(optimizer, tmp / "optimizer.pt")
    if ema is not None:
        torch.save(ema, tmp / "ema.pt")
    if scaler is not None:
        torch.save(scaler, tmp / "scaler.pt")
    # state.json last: its presence is part of what makes a checkpoint whole.
    (tmp / "state.json").write_text(json.dumps(state, indent=1))


def commit(tmp: Path, keep: int) -> Path:
    """Rename the finished temporary folder into place, then drop all but the newest `keep` checkpoints."""
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    if final.exists():  # the same update saved again (e.g. the end of a resumed run that had already finished)
        old = final.with_name(final.name + ".old.tmp")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    for stale in list_checkpoints(final.parent)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load(path: Path, rank: int) -> dict[str, Any]:
    """Everything a checkpoint holds, as written."""
    out: dict[str, Any] = {
        "path": path,
        "weights": load_file(str(path / "weights.safetensors")),
        "optimizer": torch.load(path / "optimizer.pt", weights_only=False),
        "state": json.loads((path / "state.json").read_text()),
        "ema": torch.load(path / "ema.pt", weights_only=False) if (path / "ema.pt").is_file() else None,
        "scaler": torch.load(path / "scaler.pt", weights_only=False) if (path / "scaler.pt").is_file() else None,
    }
    rng = path / f"rng-{rank}.pt"
    out["rng"] = torch.load(rng, weights_only=False) if rng.is_file() else None
    return out
