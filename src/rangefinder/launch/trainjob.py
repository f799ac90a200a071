"""A training run across nodes: a Kubeflow Trainer v2 TrainJob (`trainer.kubeflow.org/v1alpha1`), submitted, watched
and removed through the Kubeflow SDK (`kubeflow.trainer`).

With `distributed.num_nodes` > 1 the range test, the fine-tune and the retrain do not train in their own pod: the
step's pod submits a TrainJob on the runtime `distributed.runtime` (Trainer's `torch-distributed`
ClusterTrainingRuntime), whose torch plugin starts the trainer container on every node with the PET_* variables
torchrun reads (nodes, node rank, master address and port, processes per node). Each node runs

    torchrun --nproc_per_node N -m <the launcher module> <job file on the data volume>

so every process rebuilds the same run from the job file, as on one node (rangefinder.launch.processes). Each node gets
the step's image, the data volume (split copy, caches, work folder, job file), the MLflow and Hugging Face Secrets as
secret references (never values), the pod labels MLflow's NetworkPolicy admits, the node selector, tolerations and
the GPUs, CPU and memory of `kubernetes.*`, per node. The step then streams node 0's log into its own log, waits for
the TrainJob to finish, deletes it when the step fails, times out or is cancelled (SIGTERM from KFP), and reads the
result from the data volume, so the DAG after it is unchanged. The step's pod owns the TrainJob (ownerReferences),
so Kubernetes' garbage collector removes it also when the pod vanishes without a SIGTERM (SIGKILL, node loss).

tests/steps/test_trainjob_lifecycle.py runs all of this, unmodified, against a loopback Kubernetes API server.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

from rangefinder.config import RangefinderConfig
from rangefinder.errors import ConfigError, RangefinderError
from rangefinder.training.sinks import MetricSink

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
    whose nodes run `torchrun --nproc_per_node N -m <worker_module> <job>` (rangefinder.launch.processes passes
    itself). `run_trainjob` hands exactly these to TrainerClient.train; `trainjob_manifest` builds the object they
    make."""
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
    labels = {**k8s.pod_labels, **k8s.mlflow_client_labels}  # every node logs to MLflow
    patch = RuntimePatch(training_runtime_spec=TrainingRuntimeSpecPatch(template=JobSetTemplatePatch(
        spec=JobSetSpecPatch(replicated_jobs=[ReplicatedJobPatch(name=NODE, template=JobTemplatePatch(
            spec=JobSpecPatch(template=PodTemplatePatch(metadata={"labels": labels} if labels else None,
                                                       spec=pod))))]))))
    # torchrun takes nodes, ranks and the master from the runtime's PET_* variables, and the processes per node from
    # the command, which wins over PET_NPROC_PER_NODE: Trainer sets that to "auto" only for a resource whose name
    # says "gpu" and to the node's CPU count otherwise, so a MIG slice (nvidia.com/mig-1g.10gb: 1 device) got 8
    # processes for a job file planned for 1 (runtime.GetNumGPUPerNode, torch plugin, Trainer v2.3.0).
    command = [*ENTRYPOINT, "--nproc_per_node", str(processes_per_node), "-m", worker_module, str(job)]
    trainer = CustomTrainerContainer(image=trainer_image(k8s.image), num_nodes=cfg.distributed.num_nodes,
                                     resources_per_node=resources, env=env)
    options = [
        Name(name),
        Labels({"app.kubernetes.io/part-of": "rangefinder", "app.kubernetes.io/component": "training"}),
        TrainerCommand(command),
        ActiveDeadlineSeconds(deadline_seconds(cfg)),
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


def trainjob_manifest(trainer: Any, options: list, runtime: Any,
                      owner_references: Optional[list[dict]] = None) -> dict:
    """The TrainJob object, built by the SDK's own code (options applied, then KubernetesBackend's spec builder),
    as TrainerClient.train would send it, plus `owner_references` (which train() has no option for); without a
    cluster."""
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
    owners = [models.IoK8sApimachineryPkgApisMetaV1OwnerReference.from_dict(o) for o in owner_references or []]
    obj = models.TrainerV1alpha1TrainJob(
        apiVersion=constants.API_VERSION, kind=constants.TRAINJOB_KIND,
        metadata=models.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=meta.get("name"), labels=meta.get("labels"),
                                                                 annotations=meta.get("annotations"),
                                                                 ownerReferences=owners or None),
        spec=spec)
    return obj.to_dict()


def pod_owner_reference(namespace: str) -> Optional[dict]:
    """The step's own pod as the TrainJob's owner, so that Kubernetes' garbage collector deletes the TrainJob (and
    its JobSet and pods) when the pod goes away without running our cleanup: SIGKILL, node loss, eviction.

    KFP v2 gives every executor container its pod's name and UID through the downward API (KFP_POD_NAME,
    KFP_POD_UID: kubeflow/pipelines backend/src/v2/compiler/argocompiler/common.go, `commonEnvs`). Outside a KFP
    pod there is none. An owner must live in the dependent's namespace (a cross-namespace owner counts as absent,
    and the collector would delete the TrainJob at once), so a TrainJob in another namespace
    (distributed.namespace) gets none either. Not `blockOwnerDeletion`: setting it needs delete rights on the pod."""
    name, uid = os.environ.get("KFP_POD_NAME"), os.environ.get("KFP_POD_UID")
    if not (name and uid) or _pod_namespace() != namespace:
        return None
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": uid, "controller": False}


# ---------------------------------------------------------------------------------------------------------------
# On the cluster


API_TIMEOUT = 60  # s, each call the step makes to the API server itself (the SDK's own calls wait up to 120 s)
NODE_0 = f"{NODE}-0"  # the SDK's name for node 0's step; its log is streamed
# How long a previous attempt's pods may take to stop once its TrainJob is deleted: each rank gets SIGTERM, writes a
# checkpoint at the current update (training/preemption.py) and exits, within the pod's grace period (Kubernetes'
# default 30 s; a runtime may set more). A new attempt started beside them would resume from, and write into, the
# same output folder while they still write there.
RETIRE_TIMEOUT = 600.0  # s
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"  # on every pod of a TrainJob's JobSet (named as the TrainJob)
TAIL_LINES = 30  # of every other node's log, printed when the TrainJob fails (its pods go with it)


def _pod_namespace() -> Optional[str]:
    """The namespace the step's pod runs in (None outside a pod)."""
    if os.environ.get("RANGEFINDER_NAMESPACE"):  # the pipeline passes the pod's namespace (downward API)
        return os.environ["RANGEFINDER_NAMESPACE"]
    with contextlib.suppress(OSError):
        return Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
    return None


def _namespace(cfg: RangefinderConfig) -> str:
    return cfg.distributed.namespace or _pod_namespace() or "default"


def check_trainer(api_client: Any, namespace: str, runtime: str) -> None:
    """Kubeflow Trainer's API group and the runtime exist; else one error saying how to install them."""
    from kubernetes import client

    try:
        groups = client.ApisApi(api_client).get_api_versions(_request_timeout=API_TIMEOUT)
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
                                                    _request_timeout=API_TIMEOUT)
            else:
                custom.get_cluster_custom_object(TRAINER_GROUP, "v1alpha1", "clustertrainingruntimes", runtime,
                                                 _request_timeout=API_TIMEOUT)
            return
        except client.ApiException as e:
            if e.status != 404:
                raise RangefinderError(f"cannot read the Trainer runtime {runtime!r} ({e.status} {e.reason}); grant "
                                       "the pipeline runner the RBAC of manifests/multi-node") from None
    raise ConfigError(f"the Kubeflow Trainer runtime {runtime!r} (distributed.runtime) is not installed in namespace "
                      f"{namespace} nor cluster-wide; {INSTALL_HINT}")


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """KFP cancels a run by deleting its pods (SIGTERM): turn it into an exception, so the TrainJob is deleted.
    KeyboardInterrupt, because no `except Exception` on the way (the SDK has many) may swallow it."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _TrainJobObject:
    """The step's own calls on its TrainJob, each with a timeout: create (the SDK's train() cannot set the
    ownerReference), read its conditions, delete."""

    def __init__(self, custom_api: Any, namespace: str, name: str):
        self.api, self.namespace, self.name = custom_api, namespace, name
        self.ref = f"{namespace}/{name}"

    def _args(self) -> tuple:
        return TRAINER_GROUP, "v1alpha1", self.namespace, "trainjobs"

    def create(self, obj: dict) -> None:
        from kubernetes import client

        try:
            self.api.create_namespaced_custom_object(*self._args(), obj, _request_timeout=API_TIMEOUT)
        except client.ApiException as e:
            hint = ("grant the pipeline runner the RBAC of manifests/multi-node" if e.status == 403 else
                    "delete it (kubectl delete trainjob -n {0} {1}) and run the step again" if e.status == 409 else
                    "the API server's answer says why")
            raise RangefinderError(f"cannot create TrainJob {self.ref} ({e.status} {e.reason}: "
                                   f"{_status_message(e)}); {hint.format(self.namespace, self.name)}") from None
        except Exception as e:
            raise RangefinderError(f"cannot reach the Kubernetes API to create TrainJob {self.ref} "
                                   f"({str(e).splitlines()[0]})") from None

    def read(self) -> Optional[dict]:
        """The TrainJob as the API server has it; None once it is gone."""
        from kubernetes import client

        try:
            return self.api.get_namespaced_custom_object(*self._args(), self.name, _request_timeout=API_TIMEOUT)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise

    def delete(self) -> bool:
        """Delete it (with its JobSet and pods, which the garbage collector follows); False if there was none."""
        from kubernetes import client

        try:
            self.api.delete_namespaced_custom_object(*self._args(), self.name, _request_timeout=API_TIMEOUT)
            return True
        except client.ApiException as e:
            if e.status == 404:
                return False
            hint = "grant the pipeline runner the RBAC of manifests/multi-node" if e.status == 403 else \
                f"delete it by hand: kubectl delete trainjob -n {self.namespace} {self.name}"
            raise RangefinderError(f"cannot delete TrainJob {self.ref} ({e.status} {e.reason}); {hint}") from None
        except Exception as e:
            raise RangefinderError(f"cannot reach the Kubernetes API to delete TrainJob {self.ref} "
                                   f"({str(e).splitlines()[0]}); delete it by hand: kubectl delete trainjob -n "
                                   f"{self.namespace} {self.name}") from None

    def wait_pods_gone(self, core_api: Any, timeout: float, poll: float) -> None:
        """Until no pod of this TrainJob's JobSet is left (deleting the TrainJob only starts their graceful stop);
        RangefinderError naming them when some outlive `timeout` or the API cannot be asked."""
        selector = f"{JOBSET_NAME_LABEL}={self.name}"
        end = time.monotonic() + timeout
        while True:
            try:
                pods = core_api.list_namespaced_pod(self.namespace, label_selector=selector,
                                                    _request_timeout=API_TIMEOUT).items
            except Exception as e:
                raise RangefinderError(f"cannot reach the Kubernetes API to see whether the pods of TrainJob "
                                       f"{self.ref} have stopped ({str(e).splitlines()[0]}); run the step again "
                                       f"once `kubectl get pods -n {self.namespace} -l {selector}` lists none"
                                       ) from None
            if not pods:
                return
            if time.monotonic() >= end:
                names = ", ".join(sorted(p.metadata.name for p in pods)[:3])
                raise RangefinderError(
                    f"{len(pods)} pods of the previous attempt's TrainJob {self.ref} ({names}) are still there "
                    f"{timeout:.0f} s after it was deleted; a new attempt beside them would write into the same "
                    f"output folder. Run the step again once `kubectl get pods -n {self.namespace} -l {selector}` "
                    "lists none")
            time.sleep(poll)


def _status_message(e: Any) -> str:
    """The message of a Kubernetes Status object in an ApiException's body."""
    import json

    with contextlib.suppress(Exception):
        return str(json.loads(e.body).get("message") or e.reason)
    return str(e.reason)


def _condition(obj: dict, kind: str) -> Optional[dict]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind and c.get("status") == "True":
            return c
    return None


def run_trainjob(cfg: RangefinderConfig, job: Path, *, step_name: str, processes_per_node: int,
                 worker_module: str) -> None:
    """Submit the TrainJob, stream node 0's log, wait for it; delete it unless it completed."""
    from kubeflow.trainer import KubernetesBackendConfig, TrainerClient

    namespace = _namespace(cfg)
    # KUBECONFIG read now (the client reads it once, at import); without it, the pod's service account.
    trainer_client = TrainerClient(backend_config=KubernetesBackendConfig(
        namespace=namespace, config_file=os.environ.get("KUBECONFIG") or None))
    backend = trainer_client.backend
    check_trainer(backend.core_api.api_client, namespace, cfg.distributed.runtime)
    runtime = trainer_client.get_runtime(cfg.distributed.runtime)
    name = trainjob_name(job, step_name)
    trainer, options = trainer_and_options(cfg, job, name, processes_per_node, worker_module)
    owner = pod_owner_reference(namespace)
    obj = trainjob_manifest(trainer, options, runtime, [owner] if owner else None)
    trainjob = _TrainJobObject(backend.custom_api, namespace, name)
    poll = cfg.distributed.poll_seconds
    stop = threading.Event()
    logs = threading.Thread(target=_stream_node0_log, args=(trainer_client, name, stop, poll), daemon=True)
    completed = False
    with _sigterm_raises():
        try:
            if trainjob.delete():  # a previous attempt's TrainJob (the step was retried): replace it
                print(f"rangefinder: deleted TrainJob {trainjob.ref} of a previous attempt; waiting for its pods "
                      "to stop", flush=True)
                trainjob.wait_pods_gone(backend.core_api, RETIRE_TIMEOUT, min(poll, 5.0))
            trainjob.create(obj)
            print(f"rangefinder: TrainJob {trainjob.ref} submitted ({cfg.distributed.num_nodes} nodes x "
                  f"{processes_per_node} processes, runtime {cfg.distributed.runtime}"
                  + (f", owned by pod {owner['name']}" if owner else "") + ")", flush=True)
            logs.start()
            _wait(cfg, trainer_client, trainjob)
            completed = True
        except KeyboardInterrupt:
            raise RangefinderError(f"the step was cancelled (SIGTERM); its TrainJob {trainjob.ref} is deleted. Run "
                                   "the step again to resume from the newest checkpoint") from None
        finally:
            stop.set()
            if not completed:
                try:
                    trainjob.delete()
                except RangefinderError as e:  # the step's own error goes on; this one must not be lost
                    print(f"rangefinder: {e}", file=sys.stderr, flush=True)
            if logs.is_alive():  # the log's last lines (a completed node 0's stream ends by itself)
                logs.join(timeout=max(2 * poll, 5.0))


def _wait(cfg: RangefinderConfig, trainer_client: Any, trainjob: _TrainJobObject) -> None:
    """Until the TrainJob is Complete; one RangefinderError when it failed, vanished, or outlived its deadline.

    Trainer itself stops a TrainJob at its activeDeadlineSeconds (condition Failed, reason DeadlineExceeded); the
    step gives up a few polls later in case nothing did. A few failed reads (an API server restarting) are waited
    out rather than taken for the job's end."""
    from kubeflow.trainer.constants import constants

    poll = cfg.distributed.poll_seconds
    hours = cfg.distributed.timeout_hours
    limit = f"{hours:g} h" if hours >= 1 else f"{hours * 3600:.0f} s"
    give_up = time.monotonic() + deadline_seconds(cfg) + 4 * poll
    misses = 0
    while True:
        left = give_up - time.monotonic()
        if left <= poll:
            raise RangefinderError(f"TrainJob {trainjob.ref} did not finish within distributed.timeout_hours "
                                   f"({limit}), so the step deleted it; raise it or train for fewer epochs, then "
                                   "run the step again to resume from the newest checkpoint")
        try:
            trainer_client.wait_for_job_status(trainjob.name, status={constants.TRAINJOB_COMPLETE}, timeout=left,
                                               polling_interval=poll)
            return
        except (RuntimeError, TimeoutError) as e:  # Failed, or a read that failed, or the SDK's own timeout
            try:
                obj = trainjob.read()
            except Exception:
                misses += 1
                if misses >= 5:
                    raise RangefinderError(f"lost the Kubernetes API while waiting for TrainJob {trainjob.ref} "
                                           f"({str(e).splitlines()[0]}), so the step deleted it; run the step again "
                                           "to resume from the newest checkpoint") from None
                time.sleep(poll)
                continue
        misses = 0
        if obj is None:
            raise RangefinderError(f"TrainJob {trainjob.ref} was deleted while the step waited for it (by hand, or "
                                   "with the run's pod); run the step again to resume from the newest checkpoint")
        if _condition(obj, constants.TRAINJOB_COMPLETE):
            return
        failed = _condition(obj, constants.TRAINJOB_FAILED)
        if failed is None:
            continue  # still running: the SDK's read failed once
        _print_other_nodes(trainer_client, trainjob)
        why = f"{failed.get('reason', '')}: {failed.get('message', '')}".strip(": ")
        if failed.get("reason") == "DeadlineExceeded":
            raise RangefinderError(f"TrainJob {trainjob.ref} was stopped at its deadline, distributed.timeout_hours "
                                   f"({limit}; {why}), and deleted; raise it or train for fewer epochs, then run "
                                   "the step again to resume from the newest checkpoint")
        raise RangefinderError(f"TrainJob {trainjob.ref} failed ({why}) and was deleted; the nodes' logs above say "
                               "why; fix that and run the step again to resume from the newest checkpoint")


def deadline_seconds(cfg: RangefinderConfig) -> int:
    """distributed.timeout_hours as the TrainJob's activeDeadlineSeconds (a positive integer)."""
    return max(1, math.ceil(cfg.distributed.timeout_hours * 3600))


def _node0_pod(trainer_client: Any, name: str) -> Optional[str]:
    steps = trainer_client.get_job(name).steps
    return next((s.pod_name for s in steps if s.name == NODE_0 and s.status != "Pending"), None)


def _stream_node0_log(trainer_client: Any, name: str, stop: threading.Event, poll: float) -> None:
    """Node 0's log into the step's log, as it comes. Every node-0 pod once: a JobSet restart makes new ones, and
    a pod's log is never printed twice. After `stop`, one last look, for a node 0 that ran and ended between two
    polls."""
    streamed: set[str] = set()
    while True:
        last = stop.is_set()
        with contextlib.suppress(Exception):  # node 0 not there yet, or gone: the next poll looks again
            pod = _node0_pod(trainer_client, name)
            if pod and pod not in streamed:
                streamed.add(pod)
                for line in trainer_client.get_job_logs(name, follow=not last):
                    print(line, flush=True)
        if last:
            return
        stop.wait(poll)


def _print_other_nodes(trainer_client: Any, trainjob: _TrainJobObject) -> None:
    """The end of every other node's log (the failing rank is often not rank 0), before they are deleted."""
    with contextlib.suppress(Exception):
        for step in trainer_client.get_job(trainjob.name).steps:
            if step.name == NODE_0 or not step.pod_name or step.status == "Pending":
                continue
            text = trainer_client.backend.core_api.read_namespaced_pod_log(
                step.pod_name, trainjob.namespace, container=NODE, tail_lines=TAIL_LINES,
                _request_timeout=API_TIMEOUT)
            print(f"rangefinder: the last lines of {step.name} (pod {step.pod_name}):", flush=True)
            for line in text.splitlines():
                print(f"  {line}", flush=True)


# Trainer's TrainJobStatus feature (KEP-2779, Trainer 2.2+): when it is on, the controller gives every node the URL of
# its status server (and a CA and a token), and what rank 0 posts there becomes the TrainJob's `status.trainerStatus`,
# which `kubectl get trainjob -o yaml` and the Kubeflow UI show.
STATUS_URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"


class TrainJobStatusSink:
    """Rank 0's metric sink in a TrainJob: passes everything on to `sink` (the step's MLflow run, or None) and reports
    the progress (updates done of `planned_updates`) and the latest validation and training loss to the TrainJob's
    status through the Kubeflow SDK's `update_trainjob_status` (which throttles to one post per 5 s and never raises;
    a post it drops is made up by the next one). 100 % is reported only by `finish`: until the run has ended, the
    planned length is an estimate (buckets, a divergence stop)."""

    def __init__(self, sink: Any, planned_updates: int) -> None:
        self.sink, self.planned_updates = sink, max(1, planned_updates)
        self.run_id = getattr(sink, "run_id", None)
        self.update = 0
        self.latest: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:
        # log_image, sink_id, ...: the wrapped sink's, so the engine sees what it would see without this wrapper
        if name == "sink":
            raise AttributeError(name)
        return getattr(self.sink, name)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.sink is not None:
            self.sink.log_metrics(metrics, step)
        self.update = max(self.update, step)
        for key in ("val_loss", "train_loss"):
            if metrics.get(key) is not None and math.isfinite(metrics[key]):
                self.latest[key] = float(metrics[key])
        self.report(min(99, int(100 * self.update / self.planned_updates)))

    def report(self, percent: int) -> bool:
        from kubeflow.trainer.backends.kubernetes.utils import update_trainjob_status

        metrics: dict[str, float | int | str] = {k: f"{v:.6g}" for k, v in self.latest.items()}
        metrics["update"] = self.update
        return update_trainjob_status(progress_percent=percent, metrics=metrics)

    def finish(self) -> bool:
        from kubeflow.trainer.backends.kubernetes import utils

        utils._last_update_time = 0.0  # the last word is not throttled away (the SDK has no other way to say so)
        return self.report(100)


def status_sink(sink: Optional[MetricSink], planned_updates: Callable[[], int]) -> Optional[MetricSink]:
    """`sink` wrapped to report to the TrainJob's status when Trainer's TrainJobStatus feature gave this node a
    status server; `sink` itself otherwise (no TrainJob, or the feature off). `planned_updates` is asked only when
    the feature is on: counting them may read the split (launch.processes.worker), which a run without it skips."""
    return TrainJobStatusSink(sink, planned_updates()) if os.environ.get(STATUS_URL_ENV) else sink
