"""The safetensors file every export writes: its tensors, and the run's facts in its metadata.

Every output file (formats/single_file.py, lora.py, embeddings.py) carries the run's facts as `rangefinder.*`
metadata keys (`export_metadata`), and is written to a temporary name and renamed (formats/atomic.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from rangefinder import __version__
from rangefinder.formats.atomic import atomic_path, give_usual_mode

# `rangefinder.base_model` of a file trained on the embedded tiny model (model.base_model unset); the model's own
# source (models/loading.py) adds its folder after it.
EMBEDDED_BASE_MODEL = "embedded tiny model"
# How `rangefinder.base_model_revision` (model.resolved_revision) starts for a local base model: a single file's
# sha256 (models/loading.py), a folder's and the embedded model's fingerprint (models/fingerprint.py); a hub
# snapshot's is its bare commit. The values are in files, tags and cache keys already written: never change them.
FILE_REVISION_PREFIX = "sha256:"
FOLDER_REVISION_PREFIX = "weights:"
LOCAL_REVISION_PREFIXES = (FILE_REVISION_PREFIX, FOLDER_REVISION_PREFIX)


def export_metadata(
    *,
    method: str,
    base_model: Optional[str] = None,
    base_model_revision: Optional[str] = None,
    lr: Optional[float] = None,
    epochs: Optional[float] = None,
    updates: Optional[int] = None,
    extra: Optional[Mapping[str, Any]] = None,
) -> dict[str, str]:
    """Metadata for a weights file. safetensors metadata holds strings only, so numbers are written with repr.
    `base_model_revision`: what `base_model` resolved to (model.resolved_revision: a hub snapshot's commit, a single
    file's "sha256:<hex>", a folder's "weights:<hex>"), so that a file found later names the weights it was trained
    on, not only a path or an id whose weights may have changed since. A path under the home folder is written from
    `~` (under_home)."""
    meta = {
        "rangefinder.version": __version__,
        "rangefinder.method": method,
        "rangefinder.base_model": under_home(base_model) if base_model else EMBEDDED_BASE_MODEL,
    }
    if base_model_revision:
        meta["rangefinder.base_model_revision"] = base_model_revision
    if lr is not None:
        meta["rangefinder.lr"] = repr(float(lr))
    if epochs is not None:
        meta["rangefinder.epochs"] = repr(float(epochs))
    if updates is not None:
        meta["rangefinder.updates"] = str(int(updates))
    for k, v in (extra or {}).items():
        meta[k if "." in k else f"rangefinder.{k}"] = v if isinstance(v, str) else json.dumps(v)
    return meta


def under_home(base_model: str) -> str:
    """`base_model` with the home folder of the process writing it as `~`, wherever a path starts with it (the name
    of a folder or file, or the embedded model's "embedded tiny model (<its cache folder>)"): a file is made to be
    shared, and its header told everyone the account name of the machine it was trained on (/home/<user>/...). The
    readers of the name on that machine expand `~` (base_model_path). Other paths are written whole."""
    import re

    # os.path's, which leaves "~" as it is where no home folder can be told (HOME unset, and this process's user not
    # in the passwd database: a container under an arbitrary UID), where pathlib's Path.home() raises RuntimeError.
    home = os.path.expanduser("~").rstrip("/")
    if not home or home.startswith("~"):  # a home of "/" would make every absolute path "~..."
        return base_model
    return re.sub(rf"(^|\()(?:{re.escape(home)})(?=/|\)|$)", r"\1~", base_model)


def base_model_path(base_model: str) -> Path:
    """The path a file's `rangefinder.base_model` names, `~` expanded as under_home wrote it (a pipeline's steps also
    write model.base_model as it was spelt, `~/...` included), by os.path's expanduser: a file from elsewhere may
    name the home of a user not here, which it leaves as written, where pathlib's raises RuntimeError."""
    return Path(os.path.expanduser(base_model))


def names_embedded_model(base_model: str) -> bool:
    """Whether a file's `rangefinder.base_model` names the embedded tiny model: "embedded tiny model (<its cache
    folder>)" as a run on it writes the name, the bare name, or "None" as early releases wrote it."""
    return base_model == "None" or base_model.startswith(EMBEDDED_BASE_MODEL)


def training_metadata(
    cfg, base_model: Optional[str] = None, extra=None, updates: Optional[int] = None, epochs: Optional[float] = None,
    base_model_revision: Optional[str] = None,
) -> dict[str, str]:
    """The facts every output file carries: base model and the revision it resolved to, method, LR (or the
    schedule's range), budget, updates and epochs taken, version. `epochs`: the epochs the weights were trained for;
    without it (unknown) the epochs budget, when the budget is in epochs."""
    info: dict[str, Any] = {"schedule": cfg.schedule}
    if cfg.schedule != "constant":
        info.update(lr_min=cfg.lr_min, lr_max=cfg.lr_max)
    if cfg.steps is not None:
        info.update(steps=cfg.steps, steps_unit=cfg.steps_unit)
    info["effective_batch"] = cfg.batch_size * cfg.grad_accum * cfg.world_size
    info.update(extra or {})
    return export_metadata(
        method=cfg.method,
        base_model=base_model,
        base_model_revision=base_model_revision,
        lr=cfg.lr,
        epochs=cfg.epochs if epochs is None else epochs,
        updates=updates,
        extra=info,
    )


def save_safetensors(tensors: Mapping[str, Any], path: Path, metadata: Optional[Mapping[str, str]] = None) -> Path:
    """Write to a temporary name and rename, so a half-written file never looks finished; the file gets the mode a
    usual write gives (formats.atomic.give_usual_mode)."""
    from safetensors.torch import save_file

    # safetensors refuses shared or non-contiguous storage; a clone per tensor keeps the caller's tensors intact.
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp),
                  metadata=dict(metadata or {}))
        _sort_metadata(tmp)
        give_usual_mode(tmp)  # safetensors makes it 0600
    return Path(path)


def _sort_metadata(path: Path) -> None:
    """Put the header's `__metadata__` in key order, in place. safetensors writes it from a hash map whose order
    changes from process to process, so the same weights and facts made a file with other bytes (another sha256)
    in every run, a resumed one included. Only the order moves: the header keeps its length, so nothing else in
    the file does. A header that would not re-serialize to the same length is left as written."""
    import json

    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        raw = f.read(size)
        header = json.loads(raw)
        meta = header.get("__metadata__")
        if not isinstance(meta, dict) or len(meta) < 2:
            return
        header["__metadata__"] = dict(sorted(meta.items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(text) != len(raw.rstrip(b" ")):
            return
        f.seek(8)
        f.write(text.ljust(size, b" "))


def read_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def pickle_format(path: Path) -> Optional[str]:
    """What pickle format a file that should be safetensors is in, read off its first bytes alone (nothing of it is
    unpickled): "a pickle" (protocol 2 or later, as a .ckpt of torch's legacy format starts), "a PyTorch zip file" (a
    zip holding a pickle, torch.save's default), or None. A .ckpt renamed .safetensors was said to be "damaged"."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return None
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a pickle"
    if head == b"PK\x03\x04":
        return "a PyTorch zip file"
    return None
