"""A loopback Kubernetes API server for the TrainJob lifecycle tests: the cluster, not the thing under test.

The multi-node training steps (rangefinder.launch.trainjob) talk to Kubernetes through the real `kubernetes` client
and the Kubeflow SDK's TrainerClient. No kube-apiserver binary can be had here, so this module serves, on
127.0.0.1, exactly the REST paths those two call, with Kubernetes' JSON shapes:

- discovery `GET /apis` (APIGroupList) and the Trainer control plane's ConfigMap the SDK reads on start;
- `(cluster)trainingruntimes` GETs: the `torch-distributed` ClusterTrainingRuntime of Trainer v2.3.0 (the fixture);
- TrainJob create / get / list / delete under `/apis/trainer.kubeflow.org/v1alpha1/namespaces/<ns>/trainjobs`,
  checked on create against the TrainJob CRD's OpenAPI schema (422 Invalid, as the API server answers), with
  `uid`, `creationTimestamp`, `resourceVersion` filled in and 409 AlreadyExists / 404 NotFound as Status objects;
- pods listed by label selector (`=` and `in (...)`, as the SDK sends them), and a pod's log, whole, by
  `tailLines`, or followed (chunked, line by line as they come, ended when the container ends or the pod goes).

The test plays Trainer, JobSet and the kubelet: it scripts the TrainJob's pods, their phases and log lines and its
conditions (`start_nodes`, `log`, `finish`), or lets `enforce_deadlines` fail a TrainJob at its
activeDeadlineSeconds (reason DeadlineExceeded, as Trainer's controller does). Deleting a TrainJob deletes its pods,
as the garbage collector does through the JobSet. Every request is recorded (`requests`) and every wait here has a
timeout. Shapes follow kubeflow/trainer v2.3.0 (pkg/apis/trainer/v1alpha1/trainjob_types.go) and the SDK's reads
(kubeflow/trainer/backends/kubernetes/backend.py in kubeflow 0.5.0).
"""

from __future__ import annotations

import contextlib
import gzip
import http.server
import itertools
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional
from urllib.parse import parse_qs, urlsplit

import jsonschema
import yaml

FIXTURES = Path(__file__).parent / "steps" / "fixtures" / "kubeflow-trainer-v2.3.0"
GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
TOKEN = "loopback-test-token"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
RJOB_NAME = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX = "batch.kubernetes.io/job-completion-index"
WAIT = 60.0  # s, the longest any wait in this module or a test's script blocks


def trainjob_schema() -> dict:
    with gzip.open(FIXTURES / "trainer.kubeflow.org_trainjobs.yaml.gz") as f:
        crd = yaml.safe_load(f)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == VERSION]
    return version["schema"]["openAPIV3Schema"]


def unknown_fields(obj: Any, schema: dict, path: str = "") -> list[str]:
    """Fields the schema does not declare (the API server would prune them: a silent loss)."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("x-kubernetes-int-or-string"):
        return []
    found = []
    if isinstance(obj, dict) and "properties" in schema:
        for k, v in obj.items():
            if k not in schema["properties"]:
                found.append(f"{path}.{k}")
            else:
                found += unknown_fields(v, schema["properties"][k], f"{path}.{k}")
    elif isinstance(obj, dict) and isinstance(schema.get("additionalProperties"), dict):
        for k, v in obj.items():
            found += unknown_fields(v, schema["additionalProperties"], f"{path}.{k}")
    elif isinstance(obj, list) and "items" in schema:
        for i, v in enumerate(obj):
            found += unknown_fields(v, schema["items"], f"{path}[{i}]")
    return found


def check_against_crd(obj: dict, schema: dict) -> list[str]:
    problems = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]
    return problems + [f"{p}: not in the schema" for p in unknown_fields(obj, schema)]


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str, **details: Any) -> dict:
    """A Kubernetes Status object (metav1.Status), as the API server answers a failed request."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": details, "code": code}


def _selects(selector: str, labels: dict) -> bool:
    """A label selector of `key=value`, `key!=value` and `key in (a, b)` terms, comma-separated."""
    for term in re.split(r",(?![^()]*\))", selector):
        term = term.strip()
        if m := re.fullmatch(r"([\w./-]+)\s+in\s+\(([^)]*)\)", term):
            if labels.get(m[1]) not in {v.strip() for v in m[2].split(",")}:
                return False
        elif "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.strip()) != v.strip().lstrip("="):
                return False
        elif term:
            raise ValueError(f"label selector term not understood by the loopback server: {term!r}")
    return True


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Optional[dict]
    code: int = 0
    at: float = field(default_factory=time.monotonic)  # when it came


@dataclass
class Cluster:
    """What the API server stores, and the test's levers on it."""

    namespace: str
    runtimes: dict[str, dict] = field(default_factory=dict)
    trainjobs: dict[tuple[str, str], dict] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict] = field(default_factory=dict)
    logs: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    status_posts: list[dict] = field(default_factory=list)  # what the status server took, in order
    enforce_deadlines: bool = False
    unavailable_gets: int = 0  # answer the next N TrainJob GETs with 503, as an API server restarting does
    on_create: Optional[Callable[[Cluster, dict], None]] = None
    # Seconds a deleted TrainJob's pods stay, terminating (deletionTimestamp set), before they are gone: the grace
    # period in which an evicted rank writes its checkpoint. 0: gone with the TrainJob.
    pods_linger: float = 0.0
    pods_gone_at: dict[str, float] = field(default_factory=dict)  # TrainJob name -> when its last pod went
    closed: bool = False

    def __post_init__(self) -> None:
        self.cond = threading.Condition()
        self.schema = trainjob_schema()
        self._rv = itertools.count(1000)
        runtime = yaml.safe_load((FIXTURES / "torch_distributed.yaml").read_text())
        runtime["metadata"].update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion="1")
        self.runtimes.setdefault(runtime["metadata"]["name"], runtime)

    # --- what the test reads ----------------------------------------------------------------------------------

    def calls(self, method: str, pattern: str) -> list[Request]:
        with self.cond:
            return [r for r in self.requests if r.method == method and re.fullmatch(pattern, r.path)]

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
        """Until predicate() is true (under the lock), at most `timeout` seconds."""
        end = time.monotonic() + timeout
        with self.cond:
            while not (value := predicate()):
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"the loopback cluster waited {timeout:g} s for {what}")
                self.cond.wait(min(left, 0.5))
            return value

    def wait_for_trainjob(self, timeout: float = WAIT) -> dict:
        return self.wait(lambda: next(iter(self.trainjobs.values()), None), "a TrainJob", timeout)

    # --- the test's script: Trainer, JobSet and the kubelet -------------------------------------------------------

    def start_nodes(self, name: str, phase: str = "Running") -> list[str]:
        """The TrainJob's JobSet starts one pod per node (JobSet's names and labels), in `phase`."""
        with self.cond:
            job = self.trainjobs[(self.namespace, name)]
            trainer = job["spec"].get("trainer") or {}
            nodes = trainer.get("numNodes", 1)
            names = []
            for i in range(nodes):
                pod_name = f"{name}-node-0-{i}-{uuid.uuid4().hex[:5]}"
                resources = trainer.get("resourcesPerNode") or {}
                self.pods[(self.namespace, pod_name)] = {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {
                        "name": pod_name, "namespace": self.namespace, "uid": str(uuid.uuid4()),
                        "creationTimestamp": _now(), "resourceVersion": str(next(self._rv)),
                        "labels": {JOBSET_NAME: name, RJOB_NAME: "node", JOB_INDEX: str(i),
                                   "jobset.sigs.k8s.io/job-index": "0",
                                   "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"},
                    },
                    "spec": {"containers": [{
                        "name": "node", "image": trainer.get("image", ""), "command": trainer.get("command", []),
                        "env": [*trainer.get("env", []), {"name": "PET_NPROC_PER_NODE", "value": "1"},
                                {"name": "PET_NODE_RANK", "value": str(i)}],
                        "resources": resources,
                    }]},
                    "status": {"phase": phase, "podIP": f"10.0.0.{10 + i}"},
                }
                self.logs[(self.namespace, pod_name)] = []
                names.append(pod_name)
            self.cond.notify_all()
            return names

    def node_pod(self, name: str, node: int) -> str:
        with self.cond:
            return next(p["metadata"]["name"] for p in self.pods.values()
                        if p["metadata"]["labels"][JOBSET_NAME] == name
                        and p["metadata"]["labels"][JOB_INDEX] == str(node))

    def set_phase(self, name: str, phase: str) -> None:
        with self.cond:
            for pod in self.pods.values():
                if pod["metadata"]["labels"][JOBSET_NAME] == name:
                    pod["status"]["phase"] = phase
            self.cond.notify_all()

    def log(self, name: str, node: int, *lines: str) -> None:
        pod = self.node_pod(name, node)
        with self.cond:
            self.logs[(self.namespace, pod)].extend(lines)
            self.cond.notify_all()

    def finish(self, name: str, kind: str, reason: str, message: str) -> None:
        """The JobSet ended: the pods' containers end, and Trainer copies the JobSet's condition (Complete or
        Failed) onto the TrainJob."""
        phase = "Succeeded" if kind == "Complete" else "Failed"
        with self.cond:
            for pod in self.pods.values():
                if pod["metadata"]["labels"][JOBSET_NAME] == name:
                    pod["status"]["phase"] = phase
            self._set_condition(name, kind, reason, message)

    def _set_condition(self, name: str, kind: str, reason: str, message: str) -> None:
        job = self.trainjobs[(self.namespace, name)]
        job.setdefault("status", {}).setdefault("conditions", []).append(
            {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": _now()})
        job["metadata"]["resourceVersion"] = str(next(self._rv))
        self.cond.notify_all()

    def delete_trainjob(self, name: str) -> Optional[dict]:
        """Delete it, and its pods with it, as the garbage collector does through the JobSet."""
        with self.cond:
            job = self.trainjobs.pop((self.namespace, name), None)
            self._delete_pods_of(name)
            return job

    def _delete_pods_of(self, name: str) -> None:
        keys = [k for k, p in self.pods.items() if p["metadata"]["labels"][JOBSET_NAME] == name]
        if self.pods_linger > 0 and keys:
            for key in keys:  # terminating: listed, with a deletionTimestamp, until the grace period is over
                self.pods[key]["metadata"]["deletionTimestamp"] = _now()
            gone = threading.Timer(self.pods_linger, self._pods_gone, args=(name, keys))
            gone.daemon = True  # a test that ends first does not wait for it
            gone.start()
            return
        self._pods_gone(name, keys)

    def _pods_gone(self, name: str, keys: list[tuple[str, str]]) -> None:
        with self.cond:
            for key in keys:
                self.pods.pop(key, None)
            self.pods_gone_at[name] = time.monotonic()
            self.cond.notify_all()

    def tick(self) -> None:
        """Trainer's deadline: a TrainJob running past spec.activeDeadlineSeconds fails, its pods terminated."""
        if not self.enforce_deadlines:
            return
        with self.cond:
            for (_, name), job in self.trainjobs.items():
                deadline = job["spec"].get("activeDeadlineSeconds")
                conditions = (job.get("status") or {}).get("conditions") or []
                if deadline and not conditions and time.time() - job["_created"] > deadline:
                    self._delete_pods_of(name)
                    self._set_condition(name, "Failed", "DeadlineExceeded", "TrainJob exceeded its active deadline")

    # --- the API --------------------------------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict, body: Optional[dict]) -> tuple[int, Any]:
        parts = path.strip("/").split("/")
        ns_tj = re.fullmatch(rf"apis/{GROUP}/{VERSION}/namespaces/([^/]+)/trainjobs(?:/([^/]+))?", path.strip("/"))
        with self.cond:
            if path.rstrip("/") == "/apis" and method == "GET":
                return 200, self._groups()
            if m := re.fullmatch(rf"apis/{GROUP}/{VERSION}/clustertrainingruntimes/([^/]+)", path.strip("/")):
                if m[1] in self.runtimes:
                    return 200, self.runtimes[m[1]]
                return 404, status(404, "NotFound", f'clustertrainingruntimes.{GROUP} "{m[1]}" not found',
                                   name=m[1], group=GROUP, kind="clustertrainingruntimes")
            if m := re.fullmatch(rf"apis/{GROUP}/{VERSION}/namespaces/([^/]+)/trainingruntimes/([^/]+)",
                                 path.strip("/")):
                return 404, status(404, "NotFound", f'trainingruntimes.{GROUP} "{m[2]}" not found',
                                   name=m[2], group=GROUP, kind="trainingruntimes")
            if m := re.fullmatch(rf"apis/{GROUP}/{VERSION}/namespaces/([^/]+)/trainjobs/([^/]+)/status",
                                 path.strip("/")):
                return self._trainer_status(method, m[1], m[2], body)
            if ns_tj:
                return self._trainjobs(method, ns_tj[1], ns_tj[2], body)
            if parts[:2] == ["api", "v1"] and len(parts) >= 4 and parts[2] == "namespaces":
                ns, rest = parts[3], parts[4:]
                if rest == ["configmaps", "kubeflow-trainer-public"] and ns == "kubeflow-system":
                    return 200, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
                        "name": "kubeflow-trainer-public", "namespace": ns}, "data": {
                        "kubeflow_trainer_version": "v2.3.0"}}
                if rest == ["pods"] and method == "GET":
                    selector = query.get("labelSelector", [""])[0]
                    items = [p for (pns, _), p in self.pods.items()
                             if pns == ns and _selects(selector, p["metadata"]["labels"])]
                    return 200, {"kind": "PodList", "apiVersion": "v1",
                                 "metadata": {"resourceVersion": str(next(self._rv))}, "items": items}
            return 404, status(404, "NotFound", "the server could not find the requested resource")

    def _groups(self) -> dict:
        groups = ["apps", "batch", "jobset.x-k8s.io", GROUP]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
             "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v}}
            for g, v in ((g, VERSION if g == GROUP else "v1") for g in groups)]}

    def _trainjobs(self, method: str, ns: str, name: Optional[str], body: Optional[dict]) -> tuple[int, Any]:
        def public(job: dict) -> dict:
            return {k: v for k, v in job.items() if not k.startswith("_")}

        def not_found() -> tuple[int, dict]:
            return 404, status(404, "NotFound", f'trainjobs.{GROUP} "{name}" not found', name=name, group=GROUP,
                               kind="trainjobs")

        if method == "POST" and name is None:
            assert body is not None
            name = body.get("metadata", {}).get("name")
            problems = [p for p in check_against_crd(body, self.schema) if not p.endswith("not in the schema")]
            if problems:
                return 422, status(422, "Invalid", f'TrainJob.{GROUP} "{name}" is invalid: {"; ".join(problems)}',
                                   name=name, group=GROUP, kind="TrainJob")
            self.warnings += [p for p in check_against_crd(body, self.schema) if p.endswith("not in the schema")]
            if (ns, name) in self.trainjobs:
                return 409, status(409, "AlreadyExists", f'trainjobs.{GROUP} "{name}" already exists', name=name,
                                   group=GROUP, kind="trainjobs")
            job = json.loads(json.dumps(body))
            job["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1,
                                   resourceVersion=str(next(self._rv)))
            job["_created"] = time.time()
            self.trainjobs[(ns, name)] = job
            self.cond.notify_all()
            if self.on_create is not None:
                threading.Thread(target=self.on_create, args=(self, public(job)), daemon=True).start()
            return 201, public(job)
        if method == "GET" and name is None:
            return 200, {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainJobList",
                         "metadata": {"resourceVersion": str(next(self._rv))},
                         "items": [public(j) for (jns, _), j in self.trainjobs.items() if jns == ns]}
        if method == "GET":
            if self.unavailable_gets > 0:
                self.unavailable_gets -= 1
                return 503, status(503, "ServiceUnavailable", "the server is currently unable to handle the request")
            return (200, public(self.trainjobs[(ns, name)])) if (ns, name) in self.trainjobs else not_found()
        if method == "DELETE" and name is not None:
            if (ns, name) not in self.trainjobs:
                return not_found()
            job = self.trainjobs.pop((ns, name))
            self._delete_pods_of(name)  # the garbage collector, through the JobSet
            return 200, public(job)
        return 405, status(405, "MethodNotAllowed", f"{method} is not supported")

    def _trainer_status(self, method: str, ns: str, name: str, body: Optional[dict]) -> tuple[int, Any]:
        """Trainer's status server (TrainJobStatus feature, KEP-2779; pkg/statusserver/server.go in v2.3.0): a POST
        of `{"trainerStatus": {...}}` is checked against the CRD's status schema (and its rule that lastUpdatedTime
        is set) and applied to the TrainJob's `status.trainerStatus`."""
        if method != "POST":
            return 405, status(405, "MethodNotAllowed", f"{method} is not supported")
        if (ns, name) not in self.trainjobs:
            return 404, status(404, "NotFound", "Train job not found")
        trainer_status = (body or {}).get("trainerStatus")
        if trainer_status is None:
            return 200, body
        schema = self.schema["properties"]["status"]["properties"]["trainerStatus"]
        problems = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(trainer_status)]
        if "lastUpdatedTime" not in trainer_status:
            problems.append("lastUpdatedTime is required when trainerStatus is present")
        if problems:
            return 422, status(422, "Invalid", "; ".join(problems))
        self.trainjobs[(ns, name)].setdefault("status", {})["trainerStatus"] = trainer_status
        self.status_posts.append(trainer_status)
        self.cond.notify_all()
        return 200, body

    def follow_log(self, ns: str, pod: str) -> Iterator[str]:
        """A followed log: each line as it is added; ends when the container ends or the pod goes."""
        sent = 0
        end = time.monotonic() + 10 * WAIT
        while time.monotonic() < end:
            with self.cond:
                lines = self.logs.get((ns, pod), [])
                new, sent = lines[sent:], len(lines)
                p = self.pods.get((ns, pod))
                over = self.closed or p is None or p["status"]["phase"] in ("Succeeded", "Failed")
                if not new and not over:
                    self.cond.wait(0.5)
                    continue
            yield from new
            if over and not new:
                return


def reply_json(handler: http.server.BaseHTTPRequestHandler, code: int, obj: Any) -> None:
    """Answer `handler`'s request with `obj` as JSON, its length given (the loopback servers' tests share it)."""
    data = json.dumps(obj).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked logs, as the API server speaks
    cluster: Cluster

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        request = Request(method, url.path, query, body)
        with self.cluster.cond:
            self.cluster.requests.append(request)
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            request.code = 401
            return self._json(401, status(401, "Unauthorized", "Unauthorized"))
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log", url.path)
        if m and method == "GET":
            request.code = self._log(m[1], m[2], query)
            return None
        code, obj = self.cluster.handle(method, url.path, query, body)
        request.code = code
        return self._json(code, obj)

    def _log(self, ns: str, pod: str, query: dict) -> int:
        with self.cluster.cond:
            p = self.cluster.pods.get((ns, pod))
            container = query.get("container", [""])[0]
            if p is None:
                self._json(404, status(404, "NotFound", f'pods "{pod}" not found', name=pod, kind="pods"))
                return 404
            if container != "node":
                self._json(400, status(400, "BadRequest", f"container {container} is not valid for pod {pod}"))
                return 400
            lines = list(self.cluster.logs[(ns, pod)])
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        # The Python client sends follow=True; the API server parses it as Go's strconv.ParseBool does.
        if query.get("follow", ["false"])[0] not in ("1", "t", "T", "true", "TRUE", "True"):
            tail = int(query.get("tailLines", ["0"])[0]) or len(lines)
            data = "".join(f"{line}\n" for line in lines[-tail:]).encode()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return 200
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with contextlib.suppress(OSError):
            for line in self.cluster.follow_log(ns, pod):
                data = f"{line}\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        return 200

    def _json(self, code: int, obj: Any) -> None:
        reply_json(self, code, obj)

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._serve("DELETE")

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def loopback_cluster(kubeconfig: Path, namespace: str = "team-a") -> Iterator[Cluster]:
    """Serve a Cluster on 127.0.0.1 and write a kubeconfig (bearer token, default namespace) that points at it."""
    cluster = Cluster(namespace=namespace)
    handler = type("Handler", (_Handler,), {"cluster": cluster})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    stop = threading.Event()

    def ticker() -> None:
        while not stop.wait(0.1):
            cluster.tick()

    threading.Thread(target=ticker, daemon=True).start()
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "loopback",
        "clusters": [{"name": "loopback", "cluster": {"server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "users": [{"name": "loopback", "user": {"token": TOKEN}}],
        "contexts": [{"name": "loopback", "context": {"cluster": "loopback", "user": "loopback",
                                                      "namespace": namespace}}],
    }))
    try:
        yield cluster
    finally:
        stop.set()
        with cluster.cond:
            cluster.closed = True
            cluster.cond.notify_all()
        server.shutdown()
        server.server_close()


def run_nodes_here(c: Cluster, job: dict, *, timeout: float = 600.0) -> None:
    """The kubelet, on this machine: each node's container command as a local process, with the environment
    Trainer's torch plugin gives it (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT: kubeflow/trainer
    pkg/constants/constants.go), its output as the pod's log; the JobSet's condition from the exit codes. Use it as
    `Cluster.on_create`. The data volume is this machine's disk (kubernetes.data_mount_path points into it)."""
    import os
    import socket
    import subprocess
    import sys

    name = job["metadata"]["name"]
    trainer = job["spec"]["trainer"]
    pods = c.start_nodes(name)
    with socket.socket() as s:  # the master's port (node 0's pod IP is 127.0.0.1 here)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = list(trainer["command"])
    if command[0] == "torchrun":  # the image's console script; the same module here
        command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    procs = []
    for rank, _ in enumerate(pods):
        env = {**os.environ, **{e["name"]: e["value"] for e in trainer.get("env", []) if "value" in e},
               "PET_NNODES": str(len(pods)), "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "127.0.0.1",
               "PET_MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda p=proc, r=rank: [c.log(name, r, line.rstrip("\n")) for line in p.stdout],
                         daemon=True).start()
        procs.append(proc)
    end = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    time.sleep(0.5)  # the last lines into the logs before the containers count as ended
    if all(code == 0 for code in codes):
        c.finish(name, "Complete", "AllJobsCompleted", "jobset completed successfully")
    else:
        c.finish(name, "Failed", "FailedJobs", f"jobset failed: exit codes {codes}")
