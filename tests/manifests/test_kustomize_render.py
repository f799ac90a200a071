"""Every kustomize entry point renders, into well-formed objects with released images and placeholder-only Secrets."""

from __future__ import annotations

import pytest

from tests.manifests.manifest_support import entry_points, pod_specs

ENTRY_POINTS = entry_points()


def test_the_expected_entry_points_exist():
    # A renamed or lost folder would otherwise just drop out of every check below.
    assert {".", "mlflow", "pipeline-namespace", "overlays/external-database", "overlays/kubeflow-profile",
            "examples/gpu-node-pool"} <= set(ENTRY_POINTS)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_entry_point_renders(rendered_all, entry):
    r = rendered_all[entry]
    assert r.returncode == 0, f"kubectl kustomize manifests/{entry} failed: {r.stderr}"
    assert r.docs, f"manifests/{entry} rendered no objects"
    for d in r.docs:
        assert d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name"), d
        # Everything is namespaced explicitly except the cluster-scoped kinds.
        if d["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert d["metadata"].get("namespace"), f"{entry}: {d['kind']}/{d['metadata']['name']} has no namespace"


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_images_are_resolved_and_pinned(rendered, entry):
    # A kustomize `images:` entry that stops matching leaves the bare placeholder name, which no registry serves.
    for d in rendered[entry].docs:
        for spec in pod_specs(d):
            for c in spec.get("initContainers", []) + spec["containers"]:
                name, _, tag = c["image"].rpartition(":")
                assert name and tag and tag != "latest", f"{entry}: {c['name']} image {c['image']!r} is not pinned"
                assert not c["image"].startswith("rangefinder-"), f"{entry}: unresolved image {c['image']!r}"


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_secrets_hold_placeholders_only(rendered, entry):
    # The committed Secrets are templates: anything that looks like a credential must be empty or CHANGE-ME.
    credential_words = ("PASSWORD", "SECRET", "TOKEN", "ACCESS_KEY", "URI")
    for d in rendered[entry].docs:
        if d["kind"] != "Secret":
            continue
        assert "data" not in d, f"{entry}: Secret/{d['metadata']['name']} uses base64 data; templates use stringData"
        for key, value in d.get("stringData", {}).items():
            if not any(w in key for w in credential_words):
                continue
            with_password = "://" in value and "@" in value  # a URI with credentials in it
            if key.endswith("URI") and not with_password:
                continue
            assert value == "" or "CHANGE-ME" in value, (
                f"{entry}: Secret/{d['metadata']['name']} key {key} holds a value that is not a placeholder")
