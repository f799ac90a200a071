"""A local diffusers folder's revision: a fingerprint of its weights, read without torch and without reading them.

A hub id resolves to a snapshot's commit and a single file to its sha256 (model.resolved_revision), and the registry
tells two versions made from other weights of one base model apart by it. A folder (a PVC mount, `/models/sd15`)
has neither, and someone who replaces the weights inside it leaves its path as it was. `folder_revision` gives it
one, `weights:<32 hex>`, told apart from a hub commit (40 hex) and a file's `sha256:<64 hex>` at a glance.

It is a sha256 of, file by file in a fixed order (model_index.json, then the parts model_index.json names):
- each `.safetensors` file's header (the JSON of every tensor's name, dtype, shape and data offsets, and the file's
  metadata) and the first SAMPLE_BYTES bytes of each tensor's data, read at its offset;
- each pickle weights file (`.bin`, which diffusers and transformers load with torch.load(weights_only=True); it is
  never unpickled here): its size, its first PICKLE_HEAD bytes and its last PICKLE_TAIL bytes, or all of it under
  PICKLE_WHOLE_UNDER bytes. torch.save's zip keeps its central directory at the end, with a CRC-32 of every tensor's
  storage (torch's default), so the tail sees a change anywhere in the file;
- each part's config and tokenizer files (`.json`, `.txt`, `.model`), whole: the architecture, the scheduler's
  settings and the vocabulary.

What it detects: another architecture, dtype or layout; a file added, removed or renamed among those; any change to
a config or tokenizer file; any change to the leading SAMPLE_BYTES bytes of any tensor (SAMPLE_BYTES // 2 values in
fp16). A fine-tune changes every tensor, and a LoRA merged into the weights adds a dense B @ A to each matrix it
touches, so another set of weights changes those bytes (weights_digest in loading.py argues the same for the loaded
parameters). What it does not: two folders alike in all of that and unlike only further into some tensors (an
edit of a few rows deep inside a matrix), which no training or merge makes; and files the load does not read
(README, images, Flax or ONNX weights). It is no checksum against damage: a copy cut short is caught only where the
header places data past the file's end.

Cost: a fixed number of bytes per tensor, whatever the model's size. SD 1.5 has about 1,100 tensors in its UNet, VAE
and text encoder: about 300 KB read (headers included) in some 1,100 small reads, made 16 at a time so that a network
volume's round trips overlap. On 2 busy Xeon cores, a folder laid out as SD 1.5's (1,130 tensors, 4.3 GB) took
0.02-0.06 s from the page cache and 0.05-0.13 s from a virtio disk with its files evicted, where a sha256 of its 4 GB
takes tens of seconds. A file whose samples lie within ONE_READ_BYTES is read in one read instead: the tiny
models take 1-5 ms (tests/models/test_fingerprint.py), where a read a tensor through the threads took 8-25 ms.

No library does this: safetensors' safe_open gives names, dtypes and shapes but not the offsets to read a tensor's
bytes at without loading it, huggingface_hub's parse_local_safetensors_file_metadata (added late 2025, after the
huggingface_hub>=0.34 pyproject.toml allows) parses the header but keeps its length, which the offsets count from,
to itself, and a hub snapshot is named by its commit, not by a hash of its files. The header is read as the format
defines it (https://huggingface.co/docs/safetensors/index#format): 8 bytes of little-endian length, then the JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rangefinder.errors import ConfigError
from rangefinder.formats.weights_file import FOLDER_REVISION_PREFIX

SAMPLE_BYTES = 256  # of each tensor's data, from its start: 64 fp32 values (weights_digest reads 64 too)
# safetensors refuses a header over 100 MB (its MAX_HEADER_SIZE); one that claims more is damaged.
MAX_HEADER_BYTES = 100_000_000
READ_THREADS = 16  # reads of tensors' samples in flight at once (_read_spans)
# Samples lying within this many bytes of data are read in one read and cut apart: in a small model's file (the
# tiny models' 0.2-5 MB) a read a tensor cost more in the pool's hand-offs than in reading (8-25 ms a folder, at
# every resolve-config, against 1-5 ms), and one read is one round trip on a network volume. SD 1.5's ~1,100
# samples span gigabytes, read a sample at a time.
ONE_READ_BYTES = 8 << 20  # above the tiny models' largest file (5.4 MB); 80 ms at 100 MB/s off a slow volume
PICKLE_HEAD = 64 << 10  # bytes of a pickle weights file's start: its pickle of the tensors' names and shapes
PICKLE_TAIL = 1 << 20  # bytes of its end: a torch zip's central directory (~100 B a tensor, with their CRC-32s)
PICKLE_WHOLE_UNDER = PICKLE_HEAD + PICKLE_TAIL  # a smaller pickle file is hashed whole
PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth")
CONFIG_SUFFIXES = (".json", ".txt", ".model")  # configs, tokenizer vocabularies and merges, sentencepiece models


def folder_revision(folder: Path, setting: str = "model.base_model") -> str:
    """`weights:<32 hex>`, the fingerprint of the diffusers folder `folder`'s weights and configs (this module's
    docstring says what it does and does not tell apart); ConfigError naming `setting`, the one that gave the folder,
    and the file whose safetensors header cannot be read."""
    h = hashlib.sha256(b"rangefinder folder revision 1\n")
    try:
        with ThreadPoolExecutor(READ_THREADS) as pool:
            for path in _fingerprinted_files(folder):
                h.update(f"\n{path.relative_to(folder).as_posix()}\n".encode())
                name = path.name.lower()
                if name.endswith(".safetensors"):
                    _hash_safetensors(h, path, pool)
                elif name.endswith(PICKLE_SUFFIXES):
                    _hash_pickle(h, path)
                else:
                    h.update(path.read_bytes())
    except _Unreadable as e:
        raise ConfigError(f"{setting}: {e.path} is not a readable safetensors file ({e.why}); copy the model's "
                          "folder again from where it came, or replace that file") from None
    except OSError as e:  # a file unreadable (permissions, a mount gone) after the folder's check found it
        raise ConfigError(f"{setting}: cannot read {e.filename or folder} ({e.strerror or e}); check the "
                          "folder's files can be read by this step") from None
    return f"{FOLDER_REVISION_PREFIX}{h.hexdigest()[:32]}"


def _fingerprinted_files(folder: Path) -> list[Path]:
    """model_index.json, then the weights, config and tokenizer files directly inside each part it names, in a fixed
    order."""
    index = json.loads((folder / "model_index.json").read_text())
    parts = sorted(p for p, entry in index.items() if not p.startswith("_") and isinstance(entry, list)
                   and (folder / p).is_dir())
    files = [folder / "model_index.json"]
    for part in parts:
        files += sorted(f for f in (folder / part).iterdir() if f.is_file()
                        and f.name.lower().endswith((".safetensors", *PICKLE_SUFFIXES, *CONFIG_SUFFIXES)))
    return files


def _hash_safetensors(h: Any, path: Path, pool: ThreadPoolExecutor) -> None:
    """Feed `h` the file's header and the first SAMPLE_BYTES bytes of each tensor's data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _Unreadable(path, f"{size} bytes, shorter than a header's length")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise _Unreadable(path, f"its first 8 bytes give a header of {length} bytes, in a file of {size}")
        header_bytes = f.read(length)
        try:
            header = json.loads(header_bytes)
        except (UnicodeDecodeError, ValueError):
            raise _Unreadable(path, "its header is not JSON") from None
        if not isinstance(header, dict):
            raise _Unreadable(path, "its header is not a JSON object")
        h.update(header_bytes)
        base = 8 + length
        spans = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            offsets = info.get("data_offsets") if isinstance(info, dict) else None
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                    and 0 <= offsets[0] <= offsets[1]):
                raise _Unreadable(path, f"tensor {name!r} in its header has no valid data_offsets")
            if base + offsets[1] > size:
                raise _Unreadable(path, f"it is cut short: its header places tensor {name!r} up to byte "
                                        f"{base + offsets[1]} of a file of {size} bytes")
            spans.append((offsets[0], min(offsets[1], offsets[0] + SAMPLE_BYTES)))
        for sample in _read_spans(f, base, sorted(spans), pool):
            h.update(sample)


def _read_spans(f: Any, base: int, spans: list[tuple[int, int]], pool: ThreadPoolExecutor) -> list[bytes]:
    """The bytes of each (start, end) span of the data at `base` in the open file `f`, in that order. Read by the
    `pool`'s threads where the OS reads at an offset (os.pread): on a network volume each small read waits a round
    trip (about 1 ms), which ~1,100 reads one after another would add up to a second."""
    if not spans:
        return []
    first, last = spans[0][0], max(end for _, end in spans)
    if last - first <= ONE_READ_BYTES:
        f.seek(base + first)
        data = f.read(last - first)
        return [data[start - first:end - first] for start, end in spans]
    if not hasattr(os, "pread"):  # Windows: one after another, in the file's order
        out = []
        for start, end in spans:
            f.seek(base + start)
            out.append(f.read(end - start))
        return out
    fd = f.fileno()
    return list(pool.map(lambda span: os.pread(fd, span[1] - span[0], base + span[0]), spans))


def _hash_pickle(h: Any, path: Path) -> None:
    """Feed `h` a pickle weights file's size and its first and last bytes (all of it when small), never unpickled."""
    size = path.stat().st_size
    h.update(f"{size}\n".encode())
    with open(path, "rb") as f:
        if size < PICKLE_WHOLE_UNDER:
            h.update(f.read())
            return
        h.update(f.read(PICKLE_HEAD))
        f.seek(size - PICKLE_TAIL)
        h.update(f.read(PICKLE_TAIL))


class _Unreadable(Exception):
    """A weights file whose safetensors header cannot be read: said by folder_revision, naming its setting."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why

