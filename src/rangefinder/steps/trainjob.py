"""A training run across nodes: a Kubeflow Trainer v2 TrainJob (`trainer.kubeflow.org/v1alpha1`), submitted, watched
and removed through the Kubeflow SDK (`kubeflow.trainer`).

With `distributed.num_nodes` > 1 the range test, the fine-tune and the retrain do not train in their own pod: the
step's pod submits a TrainJob on the runtime `distributed.runtime` (Trainer's `torch-distributed`
ClusterTrainingRuntime), whose torch plugin starts the trainer container on every node with the PET_* variables
torchrun reads (nodes, node rank, master address and port, processes per node). Each node runs

    torchrun [--nproc_per_node N] -m <the launcher module> <job file on the data volume>

so every process rebuilds the same run from the job file, as on one node (rangefinder.steps.launch). Each node gets
the step's image, the data volume (split copy, caches, work folder, job file), the MLflow and Hugging Face Secrets as
secret references (never values), the pod labels MLflow's NetworkPolicy admits, the node selector, tolerations and
the GPUs, CPU and memory of `kubernetes.*`, per node. The step then streams node 0's log into its own log, waits for
the TrainJob to finish, deletes it when the step fails, times out or is cancelled (SIGTERM from KFP), and reads the
result from the data volume, so the DAG after it is unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from rangefinder.config import RangefinderConfig
from rangefinder.errors import ConfigError, RangefinderError

TRAINER_GROUP = "trainer.kubeflow.org"
TRAINER_API_VERSION = f"{TRAINER_GROUP}/v1alpha1"
NODE = "node"  # the runtime's replicated job and trainer container (Trainer's constants.Node)
DATA_VOLUME = "rangefinder-data"
SHM_VOLUME = "dshm"
ENTRYPOINT = ["torchrun"]  # what the torch-distributed runtime runs; it sets PET_NNODES, PET_NODE_RANK, ...
INSTALL_HINT = ("install Kubeflow Trainer v2 with its runtimes (kubectl apply --server-side -k "
                "\"https://github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0\" and "
                ".../manifests/overlays/runtimes?ref=v2.3.0), or set distributed.num_nodes: 1")


def trainjob_name(job: Path, step_name: str) -> str:
    """A DNS-1035 name, the same for every retry of one step of one run (a retry replaces its predecessor)."""
    digest = hashlib.sha256(str(Path(job).resolve()).encode()).hexdigest()[:10]
    return f"rf-{step_name.replace('_', '-')}-{digest}"[:63]


def trainer_and_options(cfg: RangefinderConfig, job: Path, name: str, processes_per_node: int,
                        worker_module: str) -> tuple[Any, list]:
    """The SDK's CustomTrainerContainer and options (name, labels, command, deadline, runtime patch) of the TrainJob
    whose nodes run `torchrun -m <worker_module> <job>` (rangefinder.steps.launch passes itself). `run_trainjob`
    hands exactly these to TrainerClient.train; `trainjob_manifest` builds the object they make."""
    from kubeflow.trainer import CustomTrainerContainer
    from kubeflow.trainer.options import (
        ActiveDeadlineSeconds,
        ContainerPatch,
        JobSetSpecPatch,
        JobSetTemplatePatch,
        JobSpecPatch,
        JobTemplatePatch,
        Labels,
        Name,
        PodSpecPatch,
        PodTemplatePatch,
        ReplicatedJobPatch,
        RuntimePatch,
        TrainerCommand,
        TrainingRuntimeSpecPatch,
    )

    from rangefinder.container_images import trainer_image
    from rangefinder.tracking.spool import SPOOL_ENV

    k8s = cfg.kubernetes
    if not k8s.data_pvc:
        raise ConfigError("distributed.num_nodes > 1 needs kubernetes.data_pvc: the nodes share the run's data, "
                          "caches and outputs through it (a ReadWriteMany volume)")
    mount = k8s.data_mount_path.rstrip("/")
    resources: dict[str, Any] = {"cpu": k8s.cpu_limit, "memory": k8s.memory_limit}
    if k8s.gpu_count > 0:
        resources[k8s.accelerator_type] = k8s.gpu_count
    env = {"RANGEFINDER_CACHE": f"{mount}/cache", "HF_HOME": f"{mount}/cache/huggingface",
           "RANGEFINDER_WORK": f"{mount}/work", SPOOL_ENV: f"{mount}/work/mlflow-spool"}
    secret_keys = list(k8s.mlflow_secret_keys) if k8s.mlflow_secret else []
    if "MLFLOW_TRACKING_URI" not in secret_keys:
        env["MLFLOW_TRACKING_URI"] = k8s.mlflow_tracking_uri
    secret_env: list[dict] = [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": k8s.mlflow_secret, "key": key}}} for key in secret_keys
    ]
    if k8s.hf_token_secret:
        secret_env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": k8s.hf_token_secret, "key": k8s.hf_token_secret_key, "optional": True}}})
    volumes = [{"name": DATA_VOLUME, "persistentVolumeClaim": {"claimName": k8s.data_pvc}},
               {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}}]
    mounts = [{"name": DATA_VOLUME, "mountPath": k8s.data_mount_path}, {"name": SHM_VOLUME, "mountPath": "/dev/shm"}]
    pod = PodSpecPatch(
        service_account_name=k8s.service_account,
        volumes=volumes,
        containers=[ContainerPatch(name=NODE, env=secret_env or None, volume_mounts=mounts)],
        image_pull_secrets=[{"name": s} for s in k8s.image_pull_secrets] or None,
        node_selector=dict(k8s.node_selector) if k8s.gpu_count > 0 and k8s.node_selector else None,
        tolerations=[t.model_dump(exclude_none=True) for t in k8s.tolerations] if k8s.gpu_count > 0 else None,
    )
    patch = RuntimePatch(training_runtime_spec=TrainingRuntimeSpecPatch(template=JobSetTemplatePatch(
        spec=JobSetSpecPatch(replicated_jobs=[ReplicatedJobPatch(name=NODE, template=JobTemplatePatch(
            spec=JobSpecPatch(template=PodTemplatePatch(metadata={"labels": dict(k8s.pod_labels)} or None,
                                                       spec=pod))))]))))
    # torchrun takes nodes, ranks and the master from the runtime's PET_* variables; processes per node too (the
    # GPUs of resourcesPerNode), unless training.processes_per_node asks for fewer.
    nproc = [] if k8s.gpu_count > 0 and processes_per_node == k8s.gpu_count else \
        ["--nproc_per_node", str(processes_per_node)]
    command = [*ENTRYPOINT, *nproc, "-m", worker_module, str(job)]
    trainer = CustomTrainerContainer(image=trainer_image(k8s.image), num_nodes=cfg.distributed.num_nodes,
                                     resources_per_node=resources, env=env)
    options = [
        Name(name),
        Labels({"app.kubernetes.io/part-of": "rangefinder", "app.kubernetes.io/component": "training"}),
        TrainerCommand(command),
        ActiveDeadlineSeconds(int(cfg.distributed.timeout_hours * 3600)),
        patch,
    ]
    return trainer, options


def runtime_stub(name: str) -> Any:
    """The runtime as the SDK describes it, for building the object without a cluster (the tests; `submit` reads
    the real one from the cluster)."""
    from kubeflow.trainer import Runtime, RuntimeTrainer
    from kubeflow.trainer.types.types import RuntimeKind, TrainerType

    return Runtime(name=name, kind=RuntimeKind.CLUSTER_TRAINING_RUNTIME,
                   trainer=RuntimeTrainer(trainer_type=TrainerType.CUSTOM_TRAINER, framework="torch", image=""))


def trainjob_manifest(trainer: Any, options: list, runtime: Any) -> dict:
    """The TrainJob object, built by the SDK's own code (options applied, then KubernetesBackend's spec builder),
    as TrainerClient.train would send it; without a cluster."""
    from kubeflow.trainer.backends.kubernetes.backend import KubernetesBackend
    from kubeflow.trainer.constants import constants
    from kubeflow_trainer_api import models

    backend = object.__new__(KubernetesBackend)  # no API client: only the object is built, nothing is sent
    job_spec: dict = {}
    for option in options:
        option(job_spec, trainer, backend)
    spec_section = job_spec.get("spec", {})
    spec = backend._get_trainjob_spec(runtime=runtime, trainer=trainer,
                                      trainer_overrides=spec_section.get("trainer", {}),
                                      runtime_patches=spec_section.get("runtimePatches"),
                                      active_deadline_seconds=spec_section.get("activeDeadlineSeconds"))
    meta = job_spec.get("metadata", {})
    obj = models.TrainerV1alpha1TrainJob(
        apiVersion=constants.API_VERSION, kind=constants.TRAINJOB_KIND,
        metadata=models.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=meta.get("name"), labels=meta.get("labels"),
                                                                 annotations=meta.get("annotations")),
        spec=spec)
    return obj.to_dict()


# ---------------------------------------------------------------------------------------------------------------
# On the cluster


def _namespace(cfg: RangefinderConfig) -> str:
    if cfg.distributed.namespace:
        return cfg.distributed.namespace
    if os.environ.get("RANGEFINDER_NAMESPACE"):  # the pipeline passes the pod's namespace (downward API)
        return os.environ["RANGEFINDER_NAMESPACE"]
    with contextlib.suppress(OSError):
        return Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
    return "default"


def check_trainer(api_client: Any, namespace: str, runtime: str) -> None:
    """Kubeflow Trainer's API group and the runtime exist; else one error saying how to install them."""
    from kubernetes import client

    try:
        groups = client.ApisApi(api_client).get_api_versions(_request_timeout=30)
    except Exception as e:
        raise RangefinderError(f"cannot reach the Kubernetes API to submit a TrainJob ({str(e).splitlines()[0]}); "
                               "distributed.num_nodes > 1 runs only on a cluster") from None
    if not any(g.name == TRAINER_GROUP for g in groups.groups or []):
        raise ConfigError(f"distributed.num_nodes > 1 needs Kubeflow Trainer, but this cluster has no TrainJob CRD "
                          f"(API group {TRAINER_GROUP}); {INSTALL_HINT}")
    custom = client.CustomObjectsApi(api_client)
    for scope in ("namespaced", "cluster"):
        try:
            if scope == "namespaced":
                custom.get_namespaced_custom_object(TRAINER_GROUP, "v1alpha1", namespace, "trainingruntimes", runtime,
                                                    _request_timeout=30)
            else:
                custom.get_cluster_custom_object(TRAINER_GROUP, "v1alpha1", "clustertrainingruntimes", runtime,
                                                 _request_timeout=30)
            return
        except client.ApiException as e:
            if e.status != 404:
                raise RangefinderError(f"cannot read the Trainer runtime {runtime!r} ({e.status} {e.reason}); grant "
                                       "the pipeline runner the RBAC of manifests/multi-node") from None
    raise ConfigError(f"the Kubeflow Trainer runtime {runtime!r} (distributed.runtime) is not installed in namespace "
                      f"{namespace} nor cluster-wide; {INSTALL_HINT}")


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """KFP cancels a run by deleting its pods (SIGTERM): turn it into an exception, so the TrainJob is deleted."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("the step was cancelled (SIGTERM)")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_trainjob(cfg: RangefinderConfig, job: Path, *, step_name: str, processes_per_node: int,
                 worker_module: str) -> None:
    """Submit the TrainJob, stream node 0's log, wait for it; delete it unless it completed."""
    from kubeflow.trainer import KubernetesBackendConfig, TrainerClient
    from kubeflow.trainer.constants import constants

    namespace = _namespace(cfg)
    trainer_client = TrainerClient(backend_config=KubernetesBackendConfig(namespace=namespace))
    backend = trainer_client.backend
    check_trainer(backend.core_api.api_client, namespace, cfg.distributed.runtime)
    runtime = trainer_client.get_runtime(cfg.distributed.runtime)
    name = trainjob_name(job, step_name)
    trainer, options = trainer_and_options(cfg, job, name, processes_per_node, worker_module)
    with contextlib.suppress(Exception):  # a previous attempt's TrainJob (the step was retried): replace it
        trainer_client.delete_job(name)
    completed = False
    with _sigterm_raises():
        try:
            trainer_client.train(runtime=runtime, trainer=trainer, options=options)
            print(f"rangefinder: TrainJob {namespace}/{name} submitted ({cfg.distributed.num_nodes} nodes x "
                  f"{processes_per_node} processes, runtime {cfg.distributed.runtime})", flush=True)
            threading.Thread(target=_stream_logs, args=(trainer_client, name), daemon=True).start()
            try:
                trainer_client.wait_for_job_status(name, status={constants.TRAINJOB_COMPLETE},
                                                   timeout=int(cfg.distributed.timeout_hours * 3600),
                                                   polling_interval=15)
            except RuntimeError as e:  # the SDK's "TrainJob ... is Failed"
                raise RangefinderError(f"TrainJob {namespace}/{name} failed ({str(e).splitlines()[0]}); its "
                                       "nodes' logs say why; run the step again to resume from the newest "
                                       "checkpoint") from None
            except TimeoutError:
                raise RangefinderError(f"TrainJob {namespace}/{name} did not finish within "
                                       f"distributed.timeout_hours ({cfg.distributed.timeout_hours:g} h); raise it "
                                       "or train for fewer epochs") from None
            completed = True
        finally:
            if not completed:
                with contextlib.suppress(Exception):
                    trainer_client.delete_job(name)


def _stream_logs(trainer_client: Any, name: str, retries: Optional[int] = 40) -> None:
    """Node 0's log into the step's log, as it comes (the first pod may take a while to start)."""
    import time

    for _ in range(retries or 1):
        printed = False
        try:
            for line in trainer_client.get_job_logs(name, follow=True):  # nothing while node 0 is pending
                print(line, flush=True)
                printed = True
        except Exception:
            pass
        if printed:
            return
        time.sleep(15)
