"""The tiny models' weights, shipped as package data and installed into the cache by digest.

Pre-training the tiny models is float arithmetic on the user's CPU: an Intel Xeon and an AMD EPYC build different
weights from the same seed, and the demo then prints different decisions. So the folders the builders write
(tiny.py, tiny_sdxl.py) ship with the package, under `weights/<name>/`, each listed with its files' sha256 in
`weights/<name>.sha256` (`sha256sum` format: `cd weights && sha256sum -c tiny-sd.sha256` checks them). Installing
one is a copy, checked file by file against those digests: seconds, and the same bytes on every machine.

The cached folder is named by the digest list, so new shipped weights are a new cache entry, never a stale one.
`rangefinder make-base-model --rebuild` (`make tiny-weights`) runs the builders and writes these files again.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from rangefinder.errors import RangefinderError
from rangefinder.formats.atomic import atomic_dir, write_text
from rangefinder.formats.digest import file_sha256

SHIPPED_DIR = Path(__file__).resolve().parent / "weights"
MANIFEST_SUFFIX = ".sha256"
REBUILD_HINT = "reinstall rangefinder, or rebuild the weights with `make tiny-weights`"


def manifest_path(name: str, weights_dir: Path = SHIPPED_DIR) -> Path:
    return weights_dir / f"{name}{MANIFEST_SUFFIX}"


def is_shipped(name: str, weights_dir: Path = SHIPPED_DIR) -> bool:
    return manifest_path(name, weights_dir).is_file()


def read_manifest(name: str, weights_dir: Path = SHIPPED_DIR) -> dict[str, str]:
    """{path under the model's folder: sha256} from `<name>.sha256`, whose paths start with `<name>/`."""
    digests: dict[str, str] = {}
    for line in manifest_path(name, weights_dir).read_text().splitlines():
        digest, _, path = line.partition("  ")
        if not path.startswith(f"{name}/") or len(digest) != 64:
            raise RangefinderError(f"{manifest_path(name, weights_dir)} has a malformed line {line!r}; {REBUILD_HINT}")
        digests[path.removeprefix(f"{name}/")] = digest
    return digests


def shipped_key(name: str, weights_dir: Path = SHIPPED_DIR) -> str:
    """The cache key of the shipped model: a hash of its digest list, so it changes whenever any shipped file does."""
    return hashlib.sha256(b"shipped|" + manifest_path(name, weights_dir).read_bytes()).hexdigest()[:16]


def install_shipped(name: str, out: Path, weights_dir: Path = SHIPPED_DIR) -> Path:
    """Copy the shipped model `name` to `out` (absent or empty), checking each copied file against its digest.

    The folder appears complete or not at all (formats/atomic.py); a file that differs from its digest (a damaged
    install, or weights changed without `make tiny-weights`) stops it with one line saying so.
    """
    src = weights_dir / name
    with atomic_dir(out, replace=False) as tmp:
        for rel, digest in sorted(read_manifest(name, weights_dir).items()):
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if not (src / rel).is_file():
                raise RangefinderError(f"shipped model file {src / rel} is missing; {REBUILD_HINT}")
            shutil.copyfile(src / rel, target)
            if file_sha256(target) != digest:
                raise RangefinderError(f"shipped model file {src / rel} does not match its sha256 in "
                                       f"{manifest_path(name, weights_dir)}; {REBUILD_HINT}")
    return out


def write_shipped(name: str, built: Path, weights_dir: Path = SHIPPED_DIR) -> Path:
    """Make the folder `built` (a builder's output) the shipped model `name`: its files and their digest list."""
    files = sorted(p for p in Path(built).rglob("*") if p.is_file())
    lines = [f"{file_sha256(p)}  {name}/{p.relative_to(built).as_posix()}" for p in files]
    folder = weights_dir / name
    with atomic_dir(folder) as tmp:
        shutil.copytree(built, tmp, dirs_exist_ok=True)
    write_text(manifest_path(name, weights_dir), "\n".join(lines) + "\n")
    return folder
