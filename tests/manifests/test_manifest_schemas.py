"""Every rendered object validates, strictly (no unknown fields), against the schemas of a current Kubernetes release.

kubernetes-validate bundles the schemas, so this runs offline. The release is pinned here and moves with the tool.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.manifests.manifest_support import find_tool

KUBERNETES_VERSION = "1.37.0"

# A Deployment the validator must reject, once for a misspelt field (strictness) and once for a wrong type; if it
# passed either, the check above would prove nothing.
BROKEN = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: broken
spec:
  replicas: 1
  selector:
    matchLabels: {app: broken}
  template:
    metadata:
      labels: {app: broken}
    spec:
      containers:
        - name: c
          image: example.org/c:1
          ports:
            - containerPort: 8080
"""
BREAKAGES = {
    "unknown field": ("  replicas: 1\n", "  replica: 1\n", "replica"),
    "wrong type": ("containerPort: 8080", 'containerPort: "http"', "containerPort"),
}


@pytest.fixture(scope="module")
def kubernetes_validate() -> str:
    return find_tool("kubernetes-validate")


def _validate(tool: str, *paths) -> subprocess.CompletedProcess:
    return subprocess.run([tool, "--strict", "--kubernetes-version", KUBERNETES_VERSION, *map(str, paths)],
                          capture_output=True, text=True, timeout=300)


def test_rendered_objects_match_the_kubernetes_schemas(kubernetes_validate, rendered):
    proc = _validate(kubernetes_validate, *(r.path for r in rendered.values()))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Each object was checked against a schema, not skipped as an unknown kind.
    n_objects = sum(len(r.docs) for r in rendered.values())
    assert proc.stdout.count(" passed for resource ") == n_objects, proc.stdout


def test_the_unbroken_control_passes(kubernetes_validate, tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(BROKEN)
    proc = _validate(kubernetes_validate, good)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_the_validator_rejects_a_broken_object(kubernetes_validate, tmp_path, breakage):
    old, new, field_name = BREAKAGES[breakage]
    bad = tmp_path / "broken.yaml"
    bad.write_text(BROKEN.replace(old, new))
    proc = _validate(kubernetes_validate, bad)
    assert proc.returncode != 0, proc.stdout
    assert field_name in proc.stdout + proc.stderr
