"""Content hashes of files, read in 1 MiB blocks so that a multi-GB checkpoint never sits in memory whole."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Union

_BLOCK = 1 << 20


def hash_file_into(h: Any, path: Union[str, Path]) -> None:
    """Feed the bytes of `path` to the hashlib object `h`."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)


def file_sha256(path: Union[str, Path]) -> str:
    """The hex sha256 of a file's bytes (checkpoint checksums, the latent cache's keys)."""
    h = hashlib.sha256()
    hash_file_into(h, path)
    return h.hexdigest()
