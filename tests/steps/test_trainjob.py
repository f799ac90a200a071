"""Training across nodes: the Kubeflow Trainer v2 TrainJob the training steps build, and the pipeline that submits it.

The TrainJob is built by the Kubeflow SDK's own code (rangefinder.launch.trainjob) and checked against the TrainJob
CRD's OpenAPI schema and the `torch-distributed` runtime of kubeflow/trainer v2.3.0 (fixtures/, README there). No
cluster is needed; the check for a cluster without Trainer talks to a loopback HTTP server that answers the two
Kubernetes API calls it makes. The TrainJob's lifecycle (wait, logs, deletion) is in test_trainjob_lifecycle.py.
"""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest
import yaml

from rangefinder.config import RangefinderConfig
from rangefinder.errors import ConfigError
from rangefinder.launch import processes as launch
from rangefinder.launch import trainjob
from tests import kube_apiserver
from tests.kube_apiserver import FIXTURES, check_against_crd

JOB = Path("/data/work/run-1/.finetune.launch/launch-job.json")


@pytest.fixture(scope="module")
def trainjob_schema() -> dict:
    return kube_apiserver.trainjob_schema()


@pytest.fixture(scope="module")
def runtime() -> dict:
    return yaml.safe_load((FIXTURES / "torch_distributed.yaml").read_text())


def _cfg(**distributed) -> RangefinderConfig:
    return RangefinderConfig(
        kubernetes={"gpu_count": 8, "image": "registry.example.org/rangefinder-trainer:1.2.3",
                    "image_pull_secrets": ["regcred"]},
        distributed={"num_nodes": 2, **distributed},
    )


def _manifest(cfg: RangefinderConfig, processes: int = 8) -> dict:
    trainer, options = trainjob.trainer_and_options(cfg, JOB, "rf-finetune-0123456789", processes,
                                                    launch.WORKER_MODULE)
    return trainjob.trainjob_manifest(trainer, options, trainjob.runtime_stub(cfg.distributed.runtime))


def test_the_trainjob_fits_the_crd_and_the_runtime(trainjob_schema, runtime, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cr3t-value-never-shipped")
    cfg = _cfg()
    obj = _manifest(cfg)
    assert check_against_crd(obj, trainjob_schema) == []
    assert obj["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and obj["kind"] == "TrainJob"

    # The runtime: the ClusterTrainingRuntime the fixture installs, with the torch policy (torchrun per node).
    spec = obj["spec"]
    assert (spec["runtimeRef"]["name"], spec["runtimeRef"]["kind"]) == (runtime["metadata"]["name"], runtime["kind"])
    assert runtime["metadata"]["name"] == "torch-distributed" and "torch" in runtime["spec"]["mlPolicy"]
    t = spec["trainer"]
    assert t["numNodes"] == 2 and t["image"] == cfg.kubernetes.image
    # torchrun reads nodes, node rank and master from the runtime's PET_* variables, and 8 processes per node (one
    # per GPU) from the command.
    assert t["command"] == ["torchrun", "--nproc_per_node", "8", "-m", "rangefinder.launch.processes", str(JOB)]
    assert t["resourcesPerNode"]["limits"] == t["resourcesPerNode"]["requests"] == \
        {"nvidia.com/gpu": 8, "cpu": "8", "memory": "48Gi"}
    env = {e["name"]: e["value"] for e in t["env"]}
    assert env["RANGEFINDER_WORK"] == "/data/work" and env["RANGEFINDER_CACHE"] == "/data/cache"
    assert spec["activeDeadlineSeconds"] == 72 * 3600

    # The patch targets the runtime's own replicated job and container (both `node`).
    (patch,) = spec["runtimePatches"]
    (rjob,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    runtime_jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] in [j["name"] for j in runtime_jobs]
    runtime_containers = [c["name"] for j in runtime_jobs
                          for c in j["template"]["spec"]["template"]["spec"]["containers"]]
    pod = rjob["template"]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["name"] in runtime_containers
    # Every node: the run's volume, the secrets as references, labels, placement and pull secret.
    assert {"name": "rangefinder-data", "persistentVolumeClaim": {"claimName": "rangefinder-data"}} in \
        pod["spec"]["volumes"]
    assert {"name": "rangefinder-data", "mountPath": "/data"} in container["volumeMounts"]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert refs["MLFLOW_TRACKING_PASSWORD"] == {"name": "mlflow-credentials", "key": "MLFLOW_TRACKING_PASSWORD"}
    # The Secret names the server: no plain MLFLOW_TRACKING_URI beside it (kubernetes.mlflow_tracking_uri's).
    assert refs["MLFLOW_TRACKING_URI"]["name"] == "mlflow-credentials" and "MLFLOW_TRACKING_URI" not in env
    assert refs["HF_TOKEN"] == {"name": "hf-token", "key": "HF_TOKEN", "optional": True}
    assert all("value" not in e for e in container["env"])
    assert "s3cr3t-value-never-shipped" not in json.dumps(obj)
    assert pod["metadata"]["labels"] == {"rangefinder.io/mlflow-client": "true"}  # MLflow's NetworkPolicy admits it
    assert pod["spec"]["nodeSelector"] == {"rangefinder.io/pool": "gpu"}
    assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["spec"]["serviceAccountName"] == "rangefinder-pipeline-runner"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]


def test_fewer_processes_than_gpus_are_passed_to_torchrun(trainjob_schema):
    obj = _manifest(_cfg(), processes=4)
    assert obj["spec"]["trainer"]["command"][:3] == ["torchrun", "--nproc_per_node", "4"]
    assert check_against_crd(obj, trainjob_schema) == []


def test_the_processes_per_node_are_the_command_s_whatever_trainer_would_count(trainjob_schema, runtime):
    """Trainer's torch plugin sets PET_NPROC_PER_NODE to "auto" only for a resource whose name holds "gpu", and to
    the node's CPU count otherwise: a MIG slice (1 device, 8 CPUs) left to it got 8 processes for a job planned for
    1. The command says the count itself, which torchrun takes over the variable."""
    cfg = RangefinderConfig(kubernetes={"gpu_count": 1, "accelerator_type": "nvidia.com/mig-1g.10gb"},
                            distributed={"num_nodes": 2})
    obj = _manifest(cfg, processes=launch.processes_per_node(cfg))
    t = obj["spec"]["trainer"]
    assert "gpu" not in "".join(t["resourcesPerNode"]["limits"]) and t["resourcesPerNode"]["limits"]["cpu"] == "8"
    assert t["command"][:3] == ["torchrun", "--nproc_per_node", "1"]
    assert check_against_crd(obj, trainjob_schema) == []


def test_every_node_s_processes_count_in_the_world_size_from_the_pods_gpus():
    """The step's pod only submits the TrainJob (it has no GPU): auto is kubernetes.gpu_count processes per node, and
    the batch arithmetic's world size (the LR's scaling, the updates per epoch) counts every node's."""
    cfg = _cfg()  # 2 nodes of 8 GPUs
    assert launch.processes_per_node(cfg, gpus=0) == 8
    assert launch.step_world_size(cfg, gpus=0) == 16


def test_cpu_nodes_are_not_sent_to_the_gpu_pool(trainjob_schema):
    """kubernetes.gpu_count 0 (gloo on CPU nodes): no GPU in the resources, and not the GPU pool's selector and
    toleration, which would keep the nodes pending where no GPU node is free."""
    obj = _manifest(RangefinderConfig(kubernetes={"gpu_count": 0}, distributed={"num_nodes": 2}), processes=1)
    pod = obj["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod, pod
    assert "nvidia.com/gpu" not in obj["spec"]["trainer"]["resourcesPerNode"]["limits"]
    assert check_against_crd(obj, trainjob_schema) == []


def test_every_node_carries_the_pod_labels_beside_mlflow_s():
    cfg = RangefinderConfig(kubernetes={"gpu_count": 8, "pod_labels": {"team": "vision"}}, distributed={"num_nodes": 2})
    (rjob,) = _manifest(cfg)["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["template"]["spec"]["template"]["metadata"]["labels"] == {"team": "vision",
                                                                          "rangefinder.io/mlflow-client": "true"}


def test_the_submitting_pod_as_owner_fits_the_crd(trainjob_schema):
    cfg = _cfg()
    trainer, options = trainjob.trainer_and_options(cfg, JOB, "rf-finetune-0123456789", 8, launch.WORKER_MODULE)
    owner = {"apiVersion": "v1", "kind": "Pod", "name": "p-1", "uid": "u-1", "controller": False}
    obj = trainjob.trainjob_manifest(trainer, options, trainjob.runtime_stub(cfg.distributed.runtime), [owner])
    assert obj["metadata"]["ownerReferences"] == [owner]
    assert check_against_crd(obj, trainjob_schema) == []


@pytest.mark.parametrize("breakage", ["misspelt field", "wrong type"])
def test_the_crd_check_rejects_a_broken_trainjob(trainjob_schema, breakage):
    obj = _manifest(_cfg())
    if breakage == "misspelt field":
        obj["spec"]["trainer"]["numNode"] = obj["spec"]["trainer"].pop("numNodes")
    else:
        obj["spec"]["trainer"]["numNodes"] = "two"
    assert check_against_crd(obj, trainjob_schema), breakage


def test_several_nodes_need_the_shared_volume():
    cfg = _cfg().model_copy(update={"kubernetes": _cfg().kubernetes.model_copy(update={"data_pvc": None})})
    with pytest.raises(ConfigError, match="needs kubernetes.data_pvc"):
        trainjob.trainer_and_options(cfg, JOB, "x", 8, launch.WORKER_MODULE)


# ---------------------------------------------------------------------------------------------------------------
# A cluster without Trainer, or without the runtime


class _Api(http.server.BaseHTTPRequestHandler):
    groups: list[str] = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.startswith("/apis/trainer.kubeflow.org/v1alpha1/"):
            body, code = {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}, 404
        elif self.path.split("?")[0].rstrip("/") == "/apis":
            body = {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
                 "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"}} for g in self.groups]}
            code = 200
        else:
            body, code = {"kind": "Status", "code": 404}, 404
        kube_apiserver.reply_json(self, code, body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("groups, match", [
    (["apps", "batch"], "no TrainJob CRD"),
    (["apps", "trainer.kubeflow.org"], "runtime 'torch-distributed'.*is not installed"),
])
def test_a_cluster_without_trainer_or_its_runtime_is_one_clear_error(groups, match):
    from kubernetes import client

    handler = type("Api", (_Api,), {"groups": groups})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        conf = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(ConfigError, match=match) as e:
            trainjob.check_trainer(client.ApiClient(conf), "kubeflow", "torch-distributed")
        assert "install Kubeflow Trainer v2" in str(e.value) and "num_nodes: 1" in str(e.value)
    finally:
        server.shutdown()


# ---------------------------------------------------------------------------------------------------------------
# The compiled pipeline


def test_the_compiled_pipeline_submits_from_light_pods_with_secrets_and_volume(tmp_path, monkeypatch):
    from rangefinder.pipelines.pipeline import compile_pipeline

    for var in ("RANGEFINDER_IMAGE", "RANGEFINDER_CPU_IMAGE", "RANGEFINDER_REGISTRY"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "pipeline.yaml"
    compile_pipeline(RangefinderConfig(distributed={"num_nodes": 2}), str(path))
    spec, platform = yaml.safe_load_all(path.read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    containers = {n: e["container"] for n, e in spec["deploymentSpec"]["executors"].items() if "container" in e}
    for step in ("lr-range-test", "finetune", "retrain-full"):
        name = f"exec-{step}"
        k8s, container = executors[name], containers[name]
        # The submitting pod: the data volume (job file, split, outputs), the MLflow Secret, its namespace for the
        # TrainJob; no GPU (the nodes have them), no GPU node pool.
        assert [m["constant"] for m in k8s["pvcMount"]] == ["rangefinder-data"], step
        assert {r["secretName"] for r in k8s["secretAsEnv"]} >= {"mlflow-credentials", "hf-token"}, step
        assert {"name": "RANGEFINDER_NAMESPACE", "fieldPath": "metadata.namespace"} in k8s["fieldPathAsEnv"], step
        assert "nodeSelector" not in k8s and "tolerations" not in k8s, step
        assert "accelerator" not in container.get("resources", {}), step
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert env["RANGEFINDER_NUM_NODES"] == "2" and env["RANGEFINDER_WORK"] == "/data/work", step
    # A preempted node's TrainJob is replaced by the step's retry, which resumes from the newest checkpoint.
    retried = {t["taskInfo"]["name"]: t.get("retryPolicy", {}).get("maxRetryCount")
               for c in spec["components"].values() for t in c.get("dag", {}).get("tasks", {}).values()
               if t["taskInfo"]["name"] in ("lr-range-test", "finetune", "retrain-full")}
    assert retried == dict.fromkeys(("lr-range-test", "finetune", "retrain-full"), 2)
    # Sampling still runs on one GPU node.
    assert executors["exec-sample-images"]["nodeSelector"]


def test_several_nodes_without_a_shared_volume_do_not_compile(tmp_path):
    from rangefinder.pipelines.pipeline import compile_pipeline

    cfg = RangefinderConfig(distributed={"num_nodes": 2}, kubernetes={"data_pvc": None})
    with pytest.raises(ConfigError, match="needs kubernetes.data_pvc"):
        compile_pipeline(cfg, str(tmp_path / "p.yaml"))
    assert not (tmp_path / "p.yaml").exists()
