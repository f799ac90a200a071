"""rangefinder.container_images: the one place that names the image tags, tied to the package version, overridable at
run time."""

from __future__ import annotations

import subprocess
import sys

import pytest

import rangefinder
from rangefinder import container_images as images
from rangefinder.errors import ConfigError
from tests.manifests.manifest_support import REPO

OVERRIDES = ("RANGEFINDER_IMAGE", "RANGEFINDER_CPU_IMAGE", "RANGEFINDER_MLFLOW_IMAGE", "RANGEFINDER_REGISTRY")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in OVERRIDES:
        monkeypatch.delenv(var, raising=False)


def test_default_names_carry_the_package_version():
    refs = {"trainer": images.trainer_image(), "cpu": images.cpu_image(), "mlflow": images.mlflow_server_image()}
    assert refs == images.default_images()
    for ref in refs.values():
        assert ref.endswith(f":{rangefinder.__version__}")
    assert len(set(refs.values())) == 3


def test_overrides_are_read_when_called_not_at_import(monkeypatch):
    monkeypatch.setenv("RANGEFINDER_IMAGE", "registry.example.com/ml/trainer:dev")
    monkeypatch.setenv("RANGEFINDER_CPU_IMAGE", "registry.example.com/ml/cpu:dev")
    assert images.trainer_image() == "registry.example.com/ml/trainer:dev"
    assert images.cpu_image() == "registry.example.com/ml/cpu:dev"
    monkeypatch.delenv("RANGEFINDER_IMAGE")
    assert images.trainer_image() == images.default_images()["trainer"]


def test_a_registry_mirror_keeps_names_and_tags(monkeypatch):
    monkeypatch.setenv("RANGEFINDER_REGISTRY", "mirror.example.com/team/")
    assert images.cpu_image() == f"mirror.example.com/team/rangefinder-cpu:{rangefinder.__version__}"
    # The release's defaults (what CI pushes) do not move with a developer's mirror.
    assert images.default_images()["cpu"].startswith(images.DEFAULT_REGISTRY + "/")


def test_a_config_value_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("RANGEFINDER_IMAGE", "registry.example.com/ml/trainer:env")
    assert images.trainer_image("registry.example.com/ml/trainer:cfg") == "registry.example.com/ml/trainer:cfg"


@pytest.mark.parametrize("bad", [
    "my image:1", "registry.example.com/x:", ":1.0", "x@",
    # What the kubelet refuses as InvalidImageName, leaving the pod waiting for good: a path in upper case, a tag
    # with a character tags do not have, a digest too short to be one.
    "registry.example.com/Team/Trainer:1", "registry.example.com/team/trainer:1.0+cu130",
    "registry.example.com/team/trainer@sha256:abc123",
])
def test_a_malformed_reference_is_refused_with_its_source(monkeypatch, bad):
    monkeypatch.setenv("RANGEFINDER_CPU_IMAGE", bad)
    with pytest.raises(ConfigError, match="RANGEFINDER_CPU_IMAGE"):
        images.cpu_image()
    with pytest.raises(ConfigError, match="kubernetes.image"):
        images.trainer_image(bad)


def test_references_follow_the_kubelet_s_grammar(monkeypatch):
    """What the kubelet takes (a registry's port, upper case in the domain, digests with or without a tag) is taken;
    a mirror whose path is in upper case makes every default name one it refuses."""
    for good in ("trainer", "localhost:5000/ml/trainer:dev", "Registry.Example.com/ml/trainer:1", "a__b/c_d-e.f:T_1",
                 "registry.example.com/team/trainer@sha256:" + "0" * 64,
                 "registry.example.com/team/trainer:1@sha256:" + "a" * 64):
        assert images.trainer_image(good) == good
    monkeypatch.setenv("RANGEFINDER_REGISTRY", "mirror.example.com/Team")
    with pytest.raises(ConfigError, match="RANGEFINDER_REGISTRY='mirror.example.com/Team/rangefinder-cpu:"):
        images.cpu_image()


def test_the_module_prints_the_references_for_build_scripts():
    # The Makefile's `images` target and the CI example read these lines with a bare Python and PYTHONPATH=src:
    # -S keeps site-packages out, so this fails if container_images.py (or rangefinder/__init__) starts needing a
    # dependency.
    out = subprocess.run([sys.executable, "-S", "-m", "rangefinder.container_images"], capture_output=True,
                         text=True, cwd=REPO, check=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "src"}).stdout
    assert dict(line.split("=", 1) for line in out.splitlines()) == images.default_images()
