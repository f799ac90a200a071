"""The compiled pipeline (default config) asks the cluster only for what manifests/ provides.

Where test_manifest_agreement compares the manifests with KubernetesConfig's defaults, this reads the Kubernetes
settings KFP will really apply, from the compiled IR's platform spec: the Secret and keys each step reads, the PVC
it mounts, its pod labels, node selector, tolerations and image.
"""

from __future__ import annotations

import pytest
import yaml

from rangefinder import container_images as images
from rangefinder.config import RangefinderConfig
from tests.manifests.manifest_support import MANIFESTS, pod_specs


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, monkeypatch_module) -> tuple[dict, dict]:
    """(executor -> container image, executor -> Kubernetes platform settings) of the default pipeline."""
    from rangefinder.pipelines.pipeline import compile_pipeline

    path = tmp_path_factory.mktemp("compiled") / "pipeline.yaml"
    compile_pipeline(RangefinderConfig(), str(path))
    spec, platform = yaml.load_all(path.read_text(), Loader=yaml.CSafeLoader)  # libyaml: seconds faster
    container_images = {name: e["container"]["image"] for name, e in spec["deploymentSpec"]["executors"].items()
                        if "container" in e}
    return container_images, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


@pytest.fixture(scope="module")
def monkeypatch_module():
    # The release's default image names, whatever the developer's shell overrides.
    mp = pytest.MonkeyPatch()
    for var in ("RANGEFINDER_IMAGE", "RANGEFINDER_CPU_IMAGE", "RANGEFINDER_REGISTRY"):
        mp.delenv(var, raising=False)
    yield mp
    mp.undo()


def _namespace_objects(rendered):
    return rendered["pipeline-namespace"]


def test_every_secret_and_key_a_step_reads_is_shipped(compiled, rendered):
    _, executors = compiled
    r = _namespace_objects(rendered)
    seen = 0
    for name, k8s in executors.items():
        for ref in k8s.get("secretAsEnv", []):
            seen += 1
            secret = r.find("Secret", ref["secretName"])
            missing = {m["secretKey"] for m in ref["keyToEnv"]} - set(secret["stringData"])
            assert not missing, f"{name} reads {sorted(missing)} from Secret/{ref['secretName']}, which lacks them"
    assert seen, "no step reads the MLflow Secret: the pipeline would log nowhere"


def test_every_pvc_a_step_mounts_is_shipped(compiled, rendered):
    _, executors = compiled
    r = _namespace_objects(rendered)
    mounts = [m for k8s in executors.values() for m in k8s.get("pvcMount", [])]
    assert mounts
    for m in mounts:
        assert r.has("PersistentVolumeClaim", m["constant"]), f"no PVC {m['constant']} in manifests/pipeline-namespace"


def test_steps_that_log_to_mlflow_are_admitted_by_its_network_policy(compiled, rendered):
    _, executors = compiled
    peer = rendered["mlflow"].find("NetworkPolicy", "mlflow-from-pipeline-pods")["spec"]["ingress"][0]["from"][0]
    wanted = peer["podSelector"]["matchLabels"]
    for name, k8s in executors.items():
        if k8s.get("secretAsEnv"):
            labels = k8s.get("podMetadata", {}).get("labels", {})
            assert wanted.items() <= labels.items(), f"{name} logs to MLflow but lacks the labels {wanted}"


def test_steps_that_never_reach_mlflow_are_not_admitted_by_its_network_policy(compiled, rendered):
    # Every step's pod carried MLflow's client label, prepare-dataset's and choose-lr's too, which never talk to it:
    # the NetworkPolicy opened MLflow to pods that have no business there.
    _, executors = compiled
    peer = rendered["mlflow"].find("NetworkPolicy", "mlflow-from-pipeline-pods")["spec"]["ingress"][0]["from"][0]
    wanted = peer["podSelector"]["matchLabels"]
    secret = RangefinderConfig().kubernetes.mlflow_secret
    outside = {name: k8s for name, k8s in executors.items()
               if not any(ref["secretName"] == secret for ref in k8s.get("secretAsEnv", []))}
    assert {"exec-prepare-dataset", "exec-choose-lr"} <= set(outside), sorted(outside)
    for name, k8s in outside.items():
        labels = k8s.get("podMetadata", {}).get("labels", {})
        assert not wanted.items() <= labels.items(), f"{name} never reaches MLflow but carries {wanted}"


def test_gpu_steps_land_on_the_example_node_pool(compiled, rendered):
    container_images, executors = compiled
    (group,) = yaml.safe_load((MANIFESTS / "examples" / "gpu-node-pool" / "eksctl-nodegroup.yaml").read_text())[
        "managedNodeGroups"]
    (job,) = [d for d in rendered["examples/gpu-node-pool"].docs if d["kind"] == "Job"]
    (job_spec,) = pod_specs(job)
    gpu_steps = {name: k8s for name, k8s in executors.items() if "nodeSelector" in k8s}
    assert gpu_steps, "no step selects the GPU pool"
    for name, k8s in gpu_steps.items():
        assert k8s["nodeSelector"]["labels"].items() <= group["labels"].items(), name
        assert k8s["nodeSelector"]["labels"] == job_spec["nodeSelector"], name
        for taint in group["taints"]:
            assert any(t["key"] == taint["key"] and t["effect"] == taint["effect"] and t["operator"] == "Exists"
                       for t in k8s["tolerations"]), f"{name} does not tolerate {taint}"
        # The GPU check Job proves the very image the GPU steps run.
        assert container_images[name] == job_spec["containers"][0]["image"] == images.trainer_image(), name


def test_every_step_image_is_a_released_image(compiled):
    container_images, _ = compiled
    released = {images.trainer_image(), images.cpu_image()}
    assert set(container_images.values()) <= released, set(container_images.values()) - released
