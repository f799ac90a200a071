"""Compiling the pipeline to the same bytes from one process to the next.

The same DAG compiles to differently named (equivalent) YAML from one process to the next, for two reasons in KFP 2.17
and protobuf: the compiler orders a OneOf's channels by iterating a set of them (kfp/dsl/pipeline_channel.py,
`list(set(pipeline_channels))`: Python's per-process string hashing), and it merges the sub-pipelines' components by
iterating protobuf maps, whose order in the C (upb) implementation changes between processes, so the numbered names
(`comp-condition-3-2`, ...) land on different groups. Neither can be fixed once the interpreter runs, so what must
be the same every time (the published files; the package `submit` names its pipeline version after the hash of) is
compiled in a child process with both fixed: hash seed 0 and protobuf's pure-Python maps (ordered dicts).

    python -m rangefinder.pipelines.reproducible CONFIG.json PACKAGE.yaml   # the child `compile_reproducibly` starts
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from rangefinder.config import RangefinderConfig, parse_config
from rangefinder.errors import ConfigError, RangefinderError
from rangefinder.formats.atomic import write_bytes

DETERMINISTIC_ENV = {"PYTHONHASHSEED": "0", "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
# What this process compiled, by config and the environment the compile reads ($RANGEFINDER_IMAGE and the other image
# overrides: rangefinder.container_images): the same bytes again, so a second submit of a config in one process (a
# script scheduling several, the tests) costs no second child.
_COMPILED: dict[str, bytes] = {}


def compiles_deterministically() -> bool:
    """Whether this process compiles a DAG to the same bytes every time (it was started with DETERMINISTIC_ENV)."""
    return all(os.environ.get(k) == v for k, v in DETERMINISTIC_ENV.items())


def compile_reproducibly(cfg: RangefinderConfig, package_path: str) -> str:
    """`compile_pipeline(cfg, package_path)`, byte for byte the same for the same config, code and environment: here
    when this process compiles deterministically, else in a child process that does (a few seconds: protobuf's
    pure-Python maps are slower). Errors come back as the ConfigError or RangefinderError the compile raised."""
    from rangefinder.pipelines.pipeline import compile_pipeline

    # The settings the config was given, not its defaults: the child reads them back into the same config (what a
    # config was given is what its checks and warnings speak of).
    given = cfg.model_dump_json(exclude_unset=True)
    read = sorted((k, v) for k, v in os.environ.items() if k.startswith(("RANGEFINDER_", "KFP_")))
    key = hashlib.sha256(json.dumps([given, read]).encode()).hexdigest()
    if key in _COMPILED:
        write_bytes(package_path, _COMPILED[key])  # whole or absent, as the compile writes it
        return package_path
    if compiles_deterministically():
        compile_pipeline(cfg, package_path)
    else:
        _compile_in_child(given, package_path)
    _COMPILED[key] = Path(package_path).read_bytes()
    return package_path


def _compile_in_child(given: str, package_path: str) -> None:
    config_path = Path(package_path).with_suffix(".config.json")
    config_path.write_text(given, encoding="utf-8")
    try:
        proc = subprocess.run([sys.executable, "-m", "rangefinder.pipelines.reproducible", str(config_path),
                               package_path], capture_output=True, text=True, timeout=600,
                              env={**os.environ, **DETERMINISTIC_ENV})
    finally:
        config_path.unlink(missing_ok=True)
    if proc.returncode == 0:
        return
    refused: Optional[dict] = None
    try:
        refused = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        pass
    if isinstance(refused, dict) and "error" in refused:
        raise (ConfigError if refused.get("kind") == "ConfigError" else RangefinderError)(refused["error"])
    raise RangefinderError(f"compiling the pipeline failed: {proc.stderr.strip()[-2000:]}")


def main(argv: Optional[list[str]] = None) -> int:
    from rangefinder.pipelines.pipeline import compile_pipeline

    config_json, package_path = argv if argv is not None else sys.argv[1:]
    try:
        compile_pipeline(parse_config(json.loads(Path(config_json).read_text(encoding="utf-8"))), package_path)
    except RangefinderError as e:
        kind = "ConfigError" if isinstance(e, ConfigError) else "RangefinderError"
        print(json.dumps({"error": str(e), "kind": kind}))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
