"""The IaC security scan (checkov) and the "restricted" Pod Security Standard over everything we ship.

checkov runs once per session over the rendered manifests, the Dockerfiles and the CI example, plus a deliberately
insecure canary that must fail (so a scan that silently checks nothing cannot pass). A finding is acceptable only
when skipped inline (`checkov.io/skipN: CKV_...=<reason>` annotations, which survive rendering) with a reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.manifests.manifest_support import REPO, find_tool, pod_specs

FRAMEWORKS = ("kubernetes", "dockerfile", "github_actions")

CANARY_POD = """\
apiVersion: v1
kind: Pod
metadata:
  name: canary
  namespace: canary
spec:
  hostNetwork: true
  containers:
    - name: c
      image: example.org/c:latest
      securityContext:
        privileged: true
"""
CANARY_DOCKERFILE = "FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n"


@pytest.fixture(scope="session")
def checkov_report(rendered, tmp_path_factory) -> dict:
    """checkov's JSON results by framework, over a tree holding what we ship and the canary."""
    tool = find_tool("checkov")
    root = tmp_path_factory.mktemp("checkov")
    (root / "rendered").mkdir()
    for r in rendered.values():
        shutil.copy(r.path, root / "rendered" / r.path.name)
    shutil.copytree(REPO / "images", root / "images", ignore=shutil.ignore_patterns("*.txt", "*.md"))
    shutil.copytree(REPO / ".github" / "workflows", root / ".github" / "workflows")
    (root / "canary").mkdir()
    (root / "canary" / "pod.yaml").write_text(CANARY_POD)
    (root / "canary" / "Dockerfile.canary").write_text(CANARY_DOCKERFILE)
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_LOG_LEVEL": "ERROR"}
    proc = subprocess.run(
        [tool, "--directory", str(root), "--framework", *FRAMEWORKS, "--output", "json", "--skip-download",
         "--compact"],
        capture_output=True, text=True, timeout=600, env=env, cwd=root,
    )
    assert proc.stdout.strip(), f"checkov printed nothing (exit {proc.returncode}): {proc.stderr[-2000:]}"
    data = json.loads(proc.stdout)
    reports = data if isinstance(data, list) else [data]
    return {r["check_type"]: r for r in reports}


def _in(path: str, folder: str) -> bool:
    return path.lstrip("/").startswith(folder + "/")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_checkov_finds_nothing_in_what_we_ship(checkov_report, framework):
    assert framework in checkov_report, f"checkov scanned no {framework} files: {sorted(checkov_report)}"
    failed = [f"{c['check_id']} {c['resource']} ({c['file_path']}): {c['check_name']}"
              for c in checkov_report[framework]["results"]["failed_checks"] if not _in(c["file_path"], "canary")]
    assert not failed, "\n".join(failed)


def test_every_checkov_skip_says_why(checkov_report):
    skipped = [c for r in checkov_report.values() for c in r["results"]["skipped_checks"]]
    assert skipped, "expected the justified skips in manifests/ (image digests, the postgres uid)"
    for c in skipped:
        reason = (c.get("check_result") or {}).get("suppress_comment", "")
        assert len(reason.split()) >= 5, f"{c['check_id']} on {c['resource']} is skipped without a reason: {reason!r}"


def test_checkov_catches_the_insecure_canary(checkov_report):
    for framework in ("kubernetes", "dockerfile"):
        failed = {c["check_id"] for c in checkov_report[framework]["results"]["failed_checks"]
                  if _in(c["file_path"], "canary")}
        assert failed, f"checkov found nothing wrong with the {framework} canary: the scan is not checking"
    failed_k8s = {c["check_id"] for c in checkov_report["kubernetes"]["results"]["failed_checks"]}
    assert "CKV_K8S_16" in failed_k8s  # privileged container


# ---------------------------------------------------------------------------------------------------------------
# Pod Security Standards, "restricted" profile (https://kubernetes.io/docs/concepts/security/pod-security-standards/)


def _restricted_violations(spec: dict) -> list[str]:
    problems = []
    pod_sc = spec.get("securityContext", {})
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            problems.append(f"{flag} is set")
    for v in spec.get("volumes", []):
        allowed = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                   "secret", "name"}
        if set(v) - allowed:
            problems.append(f"volume {v['name']} has a disallowed type {sorted(set(v) - allowed)}")
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            problems.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append(f"{name}: runs as uid 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile is {seccomp!r}, not RuntimeDefault")
        # Beyond "restricted", but every workload we ship allows it: writes go to declared volumes only.
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: root filesystem is writable")
        limits = c.get("resources", {}).get("limits", {})
        if not ("cpu" in limits and "memory" in limits):
            problems.append(f"{name}: no cpu/memory limits")
    return problems


def test_every_workload_meets_the_restricted_pod_security_standard(rendered):
    seen = 0
    problems = []
    for r in rendered.values():
        for d in r.docs:
            for spec in pod_specs(d):
                seen += 1
                where = f"{r.entry}: {d['kind']}/{d['metadata']['name']}"
                problems += [f"{where}: {p}" for p in _restricted_violations(spec)]
    assert seen >= 3, "expected the MLflow Deployment, the PostgreSQL StatefulSet and the GPU check Job"
    assert not problems, "\n".join(problems)


def test_the_restricted_check_rejects_an_insecure_pod():
    import yaml

    assert _restricted_violations(yaml.safe_load(CANARY_POD)["spec"])


def test_the_mlflow_namespace_enforces_restricted(rendered):
    ns = rendered["mlflow"].find("Namespace", "rangefinder")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
