"""The container images the steps run in: the one place that names their tags.

Tags follow the package version (`rangefinder.__version__`), so a pipeline compiled from release X runs in the images
built from release X. The Dockerfiles are in `images/`; `.github/workflows/images.yml` builds and pushes them under
these same names, and manifests/ pins the MLflow server image to the same tag.

Each name can be overridden at run time (read when called, never at import):

- `RANGEFINDER_IMAGE`: the whole trainer image reference (CUDA; the training and sampling steps);
- `RANGEFINDER_CPU_IMAGE`: the whole CPU image reference (the cheap steps: resolve-config, prepare-dataset,
  choose-lr, register-model, record-status);
- `RANGEFINDER_MLFLOW_IMAGE`: the whole MLflow server image reference;
- `RANGEFINDER_REGISTRY`: the registry and namespace the three default names live under (a mirror, say).
"""

from __future__ import annotations

import os
import re
from typing import Optional

from rangefinder import __version__
from rangefinder.errors import ConfigError

DEFAULT_REGISTRY = "ghcr.io/rangefinder"
TRAINER_REPOSITORY = "rangefinder-trainer"
CPU_REPOSITORY = "rangefinder-cpu"
MLFLOW_REPOSITORY = "rangefinder-mlflow"


# The grammar of an image reference (distribution/reference, which the kubelet parses): [domain[:port]/]path[:tag]
# [@digest], the path's components in lower case. A pod with any other image never starts: the kubelet leaves it
# waiting (InvalidImageName, not a failure), so its step would hang, never retried, until the run's deadline.
_DOMAIN_COMPONENT = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_REFERENCE = re.compile(rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::[\w][\w.-]{{0,127}})?"
                              r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")


def registry() -> str:
    """The registry/namespace prefix of the default image names ($RANGEFINDER_REGISTRY wins)."""
    value = os.environ.get("RANGEFINDER_REGISTRY", "").strip().rstrip("/")
    return value or DEFAULT_REGISTRY


def image_tag() -> str:
    """The tag every image of this release carries: the package version."""
    return __version__


def _reference(repository: str, env_name: str) -> str:
    override = os.environ.get(env_name, "").strip()
    if override:
        _check_reference(override, env_name)
        return override
    ref = f"{registry()}/{repository}:{image_tag()}"
    if os.environ.get("RANGEFINDER_REGISTRY", "").strip():
        _check_reference(ref, "RANGEFINDER_REGISTRY")
    return ref


def _check_reference(ref: str, where: str) -> None:
    if not _IMAGE_REFERENCE.fullmatch(ref):
        raise ConfigError(f"{where}={ref!r} is not an image reference; use e.g. registry.example.com/team/name:tag "
                          "(the path in lower case), or name@sha256:<digest>")


def trainer_image(override: Optional[str] = None) -> str:
    """The CUDA trainer image (`images/Dockerfile.trainer`): `override`, else $RANGEFINDER_IMAGE, else the default."""
    if override:
        _check_reference(override, "kubernetes.image")
        return override
    return _reference(TRAINER_REPOSITORY, "RANGEFINDER_IMAGE")


def cpu_image(override: Optional[str] = None) -> str:
    """The CPU image (`images/Dockerfile.cpu`): `override`, else $RANGEFINDER_CPU_IMAGE, else the default."""
    if override:
        _check_reference(override, "kubernetes.cpu_image")
        return override
    return _reference(CPU_REPOSITORY, "RANGEFINDER_CPU_IMAGE")


def mlflow_server_image() -> str:
    """The MLflow tracking server image (`images/Dockerfile.mlflow`), deployed by manifests/mlflow."""
    return _reference(MLFLOW_REPOSITORY, "RANGEFINDER_MLFLOW_IMAGE")


def default_images() -> dict[str, str]:
    """Every image of this release under its default name (no overrides): what CI builds and pushes."""
    tag = image_tag()
    return {
        "trainer": f"{DEFAULT_REGISTRY}/{TRAINER_REPOSITORY}:{tag}",
        "cpu": f"{DEFAULT_REGISTRY}/{CPU_REPOSITORY}:{tag}",
        "mlflow": f"{DEFAULT_REGISTRY}/{MLFLOW_REPOSITORY}:{tag}",
    }


if __name__ == "__main__":
    # `python -m rangefinder.container_images` prints NAME=REFERENCE lines; the Makefile and the CI example read them.
    refs = {"trainer": trainer_image(), "cpu": cpu_image(), "mlflow": mlflow_server_image()}
    for name, ref in refs.items():
        print(f"{name}={ref}")
