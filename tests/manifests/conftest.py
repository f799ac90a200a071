"""Session fixtures of the manifest tests: `kubectl` and every entry point rendered once (manifest_support.py)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.manifests.manifest_support import MANIFESTS, Rendered, entry_points, find_tool


@pytest.fixture(scope="session")
def kubectl() -> str:
    return find_tool("kubectl")


@pytest.fixture(scope="session")
def rendered_all(kubectl, tmp_path_factory) -> dict[str, Rendered]:
    """`kubectl kustomize` of every entry point, rendered once; failures are kept for test_kustomize_render."""
    out_dir = tmp_path_factory.mktemp("rendered")
    result = {}
    for entry in entry_points():
        proc = subprocess.run([kubectl, "kustomize", str(MANIFESTS / entry)], capture_output=True, text=True,
                              timeout=120)
        path = out_dir / (entry.replace("/", "__").replace(".", "root") + ".yaml")
        path.write_text(proc.stdout)
        docs = [d for d in yaml.safe_load_all(proc.stdout) if d] if proc.returncode == 0 else []
        result[entry] = Rendered(entry, path, proc.returncode, proc.stderr, docs)
    return result


@pytest.fixture(scope="session")
def rendered(rendered_all) -> dict[str, Rendered]:
    """The rendered entry points, for tests that need them all to render."""
    broken = {e: r.stderr.strip() for e, r in rendered_all.items() if r.returncode != 0}
    assert not broken, f"kustomize failed: {broken}"
    return rendered_all
