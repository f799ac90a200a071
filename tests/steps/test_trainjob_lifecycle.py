"""The TrainJob's lifecycle, end to end: the multi-node training steps' own code (rangefinder.launch.trainjob), the
Kubeflow SDK's TrainerClient and the kubernetes client, unmodified, against a loopback Kubernetes API server
(tests/kube_apiserver.py) reached through a real kubeconfig (KUBECONFIG).

The test plays Trainer, JobSet and the kubelet: it scripts the TrainJob's pods, their log lines and its conditions,
and checks what the step does with them: node 0's log in the step's log, a return on Complete, one clear error
naming the TrainJob and the fix on Failed or at the deadline (and the TrainJob deleted), the TrainJob deleted when
the step's process gets SIGTERM, and the pod that submitted it as its owner.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rangefinder.config import RangefinderConfig
from rangefinder.errors import RangefinderError
from rangefinder.launch import processes as launch
from rangefinder.launch import trainjob
from tests.kube_apiserver import GROUP, Cluster, check_against_crd, loopback_cluster

NS = "team-a"
TRAINJOBS = rf"/apis/{GROUP}/v1alpha1/namespaces/{NS}/trainjobs"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    kubeconfig = tmp_path / "kubeconfig"
    with loopback_cluster(kubeconfig, NS) as c:
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.setenv("RANGEFINDER_NAMESPACE", NS)  # the pipeline's downward API: the pod's namespace
        for var in ("KFP_POD_NAME", "KFP_POD_UID"):
            monkeypatch.delenv(var, raising=False)
        yield c


def _cfg(tmp_path: Path, **distributed) -> RangefinderConfig:
    return RangefinderConfig(
        kubernetes={"gpu_count": 0, "data_mount_path": str(tmp_path / "data"), "mlflow_secret": None,
                    "hf_token_secret": None},
        distributed={"num_nodes": 2, "poll_seconds": 0.2, **distributed},
    )


def _job(tmp_path: Path) -> Path:
    return tmp_path / "data" / "work" / "run-1" / ".finetune.launch" / "launch-job.json"


def _run(cfg: RangefinderConfig, job: Path) -> None:
    trainjob.run_trainjob(cfg, job, step_name="finetune", processes_per_node=1, worker_module=launch.WORKER_MODULE)


def _deleted_after_create(cluster: Cluster) -> bool:
    """The TrainJob the step created is gone, by the step's own DELETE (not only the pre-submit clean-up)."""
    posts = [i for i, r in enumerate(cluster.requests) if r.method == "POST" and r.code == 201]
    deletes = [i for i, r in enumerate(cluster.requests)
               if r.method == "DELETE" and r.code == 200 and re.fullmatch(TRAINJOBS + "/[^/]+", r.path)]
    return bool(posts) and any(d > posts[-1] for d in deletes) and not cluster.trainjobs


def test_the_step_streams_node_0_and_returns_when_the_trainjob_completes(cluster, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KFP_POD_NAME", "rangefinder-abc12-system-container-impl-1234567890")
    monkeypatch.setenv("KFP_POD_UID", "0f0e2a57-5f5d-4c1a-9d55-6a4a2b1c3d4e")

    def script(c: Cluster, job: dict) -> None:
        name = job["metadata"]["name"]
        time.sleep(0.5)  # Created: no pods yet
        c.start_nodes(name, phase="Pending")  # scheduled, pulling the image: no log to stream
        time.sleep(0.5)
        c.set_phase(name, "Running")
        c.log(name, 1, "node 1 line: never streamed")
        c.log(name, 0, "epoch 1: val_loss 0.3100")
        time.sleep(0.6)
        c.unavailable_gets = 2  # an API server restarting: two reads of the TrainJob fail
        time.sleep(1.0)
        c.log(name, 0, "epoch 2: val_loss 0.2900", "rank 0: wrote final/")
        c.finish(name, "Complete", "AllJobsCompleted", "jobset completed successfully")

    cluster.on_create = script
    cfg = _cfg(tmp_path)
    _run(cfg, _job(tmp_path))

    (job,) = cluster.trainjobs.values()  # a completed TrainJob stays, for its record
    assert trainjob._condition(job, "Complete"), "the step returned before the TrainJob completed"
    out = capsys.readouterr().out.splitlines()
    name = job["metadata"]["name"]
    assert out[0].startswith(f"rangefinder: TrainJob {NS}/{name} submitted (2 nodes x 1 processes")
    assert [line for line in out if "val_loss" in line or "final/" in line] == \
        ["epoch 1: val_loss 0.3100", "epoch 2: val_loss 0.2900", "rank 0: wrote final/"]
    assert not any("node 1" in line for line in out)
    assert any(r.code == 503 for r in cluster.requests), "the unavailable API server was not exercised"

    # What was created: the SDK's TrainJob, valid for the CRD, owned by the pod that submitted it.
    (post,) = cluster.calls("POST", TRAINJOBS)
    assert check_against_crd(post.body, cluster.schema) == [] and cluster.warnings == []
    assert post.body["metadata"]["ownerReferences"] == [{
        "apiVersion": "v1", "kind": "Pod", "name": "rangefinder-abc12-system-container-impl-1234567890",
        "uid": "0f0e2a57-5f5d-4c1a-9d55-6a4a2b1c3d4e", "controller": False}]
    assert post.body["spec"]["trainer"]["numNodes"] == 2
    assert post.body["spec"]["activeDeadlineSeconds"] == 72 * 3600
    # Before submitting, the step removed any previous attempt's TrainJob (there was none: 404); after, nothing.
    deletes = cluster.calls("DELETE", TRAINJOBS + "/.*")
    assert [r.code for r in deletes] == [404]
    assert all(r.code != 401 for r in cluster.requests)  # the kubeconfig's credentials were used


def _previous_attempt(cluster: Cluster, tmp_path: Path) -> tuple[str, list[str]]:
    """A TrainJob of the step's name left by an earlier attempt, its two node pods running."""
    name = trainjob.trainjob_name(_job(tmp_path), "finetune")
    with cluster.cond:
        cluster.trainjobs[(NS, name)] = {
            "apiVersion": f"{GROUP}/v1alpha1", "kind": "TrainJob", "_created": time.time(),
            "metadata": {"name": name, "namespace": NS, "uid": "earlier-attempt", "resourceVersion": "1"},
            "spec": {"trainer": {"numNodes": 2}}}
    return name, cluster.start_nodes(name)


def test_a_retried_step_submits_only_once_the_previous_attempts_pods_have_stopped(cluster, tmp_path, capsys):
    """Deleting the earlier attempt's TrainJob only starts its pods' graceful stop, in which each rank writes a
    checkpoint into the run's folder; a new TrainJob created at once would resume from, and write into, that folder
    beside them. The step waits until none of the earlier pods is listed, then submits."""
    name, old = _previous_attempt(cluster, tmp_path)
    cluster.pods_linger = 1.5

    def script(c: Cluster, job: dict) -> None:
        c.start_nodes(name)
        c.finish(name, "Complete", "AllJobsCompleted", "jobset completed successfully")

    cluster.on_create = script
    _run(_cfg(tmp_path), _job(tmp_path))
    (delete,) = [r for r in cluster.calls("DELETE", TRAINJOBS + "/.*") if r.code == 200]
    (post,) = cluster.calls("POST", TRAINJOBS)
    assert post.at >= cluster.pods_gone_at[name] >= delete.at + 1.5
    assert not any(key[1] in old for key in cluster.pods)
    assert "deleted TrainJob" in capsys.readouterr().out


def test_pods_of_the_previous_attempt_that_do_not_stop_are_one_error_and_nothing_is_submitted(cluster, tmp_path,
                                                                                              monkeypatch):
    name, old = _previous_attempt(cluster, tmp_path)
    cluster.pods_linger = 30.0  # longer than the step waits here
    monkeypatch.setattr(trainjob, "RETIRE_TIMEOUT", 1.0)
    with pytest.raises(RangefinderError) as e:
        _run(_cfg(tmp_path), _job(tmp_path))
    message = str(e.value)
    assert f"2 pods of the previous attempt's TrainJob {NS}/{name}" in message and "\n" not in message
    assert f"kubectl get pods -n {NS} -l jobset.sigs.k8s.io/jobset-name={name}" in message
    assert cluster.calls("POST", TRAINJOBS) == []


def test_a_failed_trainjob_is_one_error_naming_it_and_is_deleted(cluster, tmp_path, capsys):
    def script(c: Cluster, job: dict) -> None:
        name = job["metadata"]["name"]
        c.start_nodes(name)
        c.log(name, 0, "epoch 1: val_loss 0.3100")
        c.log(name, 1, "Traceback (most recent call last):", "torch.OutOfMemoryError: CUDA out of memory on rank 1")
        time.sleep(0.5)
        c.finish(name, "Failed", "FailedJobs", "jobset failed due to reaching max restarts")

    cluster.on_create = script
    with pytest.raises(RangefinderError) as e:
        _run(_cfg(tmp_path), _job(tmp_path))
    name = trainjob.trainjob_name(_job(tmp_path), "finetune")
    message = str(e.value)
    assert f"TrainJob {NS}/{name} failed (FailedJobs: jobset failed due to reaching max restarts)" in message
    assert "run the step again to resume from the newest checkpoint" in message and "\n" not in message
    assert _deleted_after_create(cluster)
    out = capsys.readouterr().out
    assert "epoch 1: val_loss 0.3100" in out  # node 0, streamed
    # The other node's last lines, read before its pod was deleted with the TrainJob.
    assert re.search(r"the last lines of node-1 \(pod .*\):\n  Traceback.*\n  torch.OutOfMemoryError", out)


def test_the_trainjob_stopped_at_its_deadline_is_deleted_with_a_clear_error(cluster, tmp_path):
    cluster.enforce_deadlines = True  # Trainer's controller: Failed, reason DeadlineExceeded
    cluster.on_create = lambda c, job: c.start_nodes(job["metadata"]["name"])
    cfg = _cfg(tmp_path, timeout_hours=2 / 3600)
    started = time.monotonic()
    with pytest.raises(RangefinderError, match=r"TrainJob team-a/rf-finetune-\w+ was stopped at its deadline, "
                                               r"distributed.timeout_hours \(2 s; DeadlineExceeded: TrainJob "
                                               r"exceeded its active deadline\), and deleted; raise it"):
        _run(cfg, _job(tmp_path))
    assert 2 <= time.monotonic() - started < 30
    (post,) = cluster.calls("POST", TRAINJOBS)
    assert post.body["spec"]["activeDeadlineSeconds"] == 2
    assert _deleted_after_create(cluster)


def test_without_the_controllers_deadline_the_step_gives_up_and_deletes_it(cluster, tmp_path):
    cluster.on_create = lambda c, job: c.start_nodes(job["metadata"]["name"])  # runs forever
    with pytest.raises(RangefinderError, match=r"did not finish within distributed.timeout_hours \(1 s\), so "
                                               "the step deleted it; raise it or train for fewer epochs"):
        _run(_cfg(tmp_path, timeout_hours=1 / 3600), _job(tmp_path))
    assert _deleted_after_create(cluster)


def test_a_trainjob_deleted_by_someone_else_ends_the_step_with_a_clear_error(cluster, tmp_path):
    def script(c: Cluster, job: dict) -> None:
        c.start_nodes(job["metadata"]["name"])
        time.sleep(0.5)
        c.delete_trainjob(job["metadata"]["name"])  # kubectl delete trainjob

    cluster.on_create = script
    with pytest.raises(RangefinderError, match=r"TrainJob team-a/rf-finetune-\w+ was deleted while the step waited"):
        _run(_cfg(tmp_path), _job(tmp_path))


def test_sigterm_deletes_the_trainjob(cluster, tmp_path):
    """KFP cancels a run by deleting its pods: the step's process gets SIGTERM and must take its TrainJob with it."""
    cluster.on_create = lambda c, job: (c.start_nodes(job["metadata"]["name"]),
                                        c.log(job["metadata"]["name"], 0, "node 0 is training"))
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(_cfg(tmp_path).model_dump_json())
    driver = textwrap.dedent("""
        import sys
        from pathlib import Path
        from rangefinder.config import RangefinderConfig
        from rangefinder.errors import RangefinderError
        from rangefinder.launch import processes as launch
        from rangefinder.launch import trainjob
        cfg = RangefinderConfig.model_validate_json(Path(sys.argv[1]).read_text())
        try:
            trainjob.run_trainjob(cfg, Path(sys.argv[2]), step_name="finetune", processes_per_node=1,
                                  worker_module=launch.WORKER_MODULE)
        except RangefinderError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    """)
    src = Path(launch.__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", driver, str(cfg_file), str(_job(tmp_path))], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while "node 0 is training\n" not in lines:  # submitted, running, and its log streamed
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, f"node 0's log never reached the step's output: {lines}"
            time.sleep(0.05)
        assert len(cluster.trainjobs) == 1
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    assert re.fullmatch(r"error: the step was cancelled \(SIGTERM\); its TrainJob team-a/rf-finetune-\w+ is deleted. "
                        r"Run the step again to resume from the newest checkpoint\n", err), err
    assert _deleted_after_create(cluster)


def test_the_owner_is_the_submitting_pod_only_inside_a_kfp_pod_of_the_same_namespace(monkeypatch):
    monkeypatch.setenv("RANGEFINDER_NAMESPACE", NS)
    for var in ("KFP_POD_NAME", "KFP_POD_UID"):
        monkeypatch.delenv(var, raising=False)
    assert trainjob.pod_owner_reference(NS) is None  # outside KFP: no pod to own it
    monkeypatch.setenv("KFP_POD_NAME", "p-1")
    monkeypatch.setenv("KFP_POD_UID", "u-1")
    assert trainjob.pod_owner_reference(NS) == {"apiVersion": "v1", "kind": "Pod", "name": "p-1", "uid": "u-1",
                                                "controller": False}
    # A TrainJob in another namespace (distributed.namespace) cannot be owned by the pod: the garbage collector
    # would take the cross-namespace owner for absent and delete the TrainJob at once.
    assert trainjob.pod_owner_reference("other-team") is None


@pytest.mark.slow
def test_a_two_node_trainjob_trains_and_the_step_reads_its_result(cluster, split_dir, tiny_model_dir, tmp_path,
                                                                   capsys, monkeypatch):
    """The whole path: the step (launch.run_training) copies the split onto the data volume, writes the job file and
    submits the TrainJob; the loopback kubelet runs each node's own command (torchrun -m rangefinder.launch.processes
    JOB, 2 nodes x 1 gloo process, with Trainer's PET_* variables); the step streams node 0's real output and reads
    rank 0's result from the volume. In chunks of 3 x 2 images with 2 micro-batches an update, so that the last
    micro-batch of the epoch is partial: the plain stream's split between two ranks and the planner's count (once
    tests/training/test_multiprocess.py's own torchrun launch)."""
    from rangefinder.data.split import read_split
    from rangefinder.planning import plan_for
    from rangefinder.training.spec import TrainSpec
    from tests.kube_apiserver import run_nodes_here

    monkeypatch.setenv("PYTHONPATH", str(Path(launch.__file__).resolve().parents[2]))  # the nodes' image
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cluster.on_create = run_nodes_here
    cfg = RangefinderConfig(
        training={"processes_per_node": 1, "batch_size": 3, "grad_accum": 2, "lr": 2e-4, "seed": 7,
                  "cache_dir": str(tmp_path / "data" / "cache" / "encoded")},
        validation={"every_epochs": 1, "timesteps": 2},
        finetune={"epochs": 1},
        kubernetes={"gpu_count": 0, "data_mount_path": str(tmp_path / "data"), "mlflow_secret": None,
                    "hf_token_secret": None},
        distributed={"num_nodes": 2, "poll_seconds": 0.5},
    )
    ft = TrainSpec.finetune(cfg, read_split(split_dir), bounds=(1e-4, 3e-4), lr=2e-4,
                            world_size=launch.step_world_size(cfg))
    assert ft.training.world_size == 2
    out_dir = tmp_path / "data" / "work" / "run-1" / "finetune"
    result = launch.run_training(cfg, TrainSpec(ft.training, cfg.validation, split_dir=split_dir,
                                                model=str(tiny_model_dir)), out_dir=out_dir, step_name="finetune")

    # Rank 0's result, from the volume: 16 images in chunks of 3 x 2 processes, one epoch: 3 micro-batch steps, the
    # last one partial (4 images), 2 updates.
    planned = plan_for(ft.training, len(read_split(split_dir).train))
    assert result.status == "ok" and result.updates == result.planned_updates == planned.total_updates == 2
    with open(out_dir / "updates.csv", newline="") as f:
        updates = list(csv.DictReader(f))
    assert len(updates) == 2 and float(updates[-1]["epoch"]) == 1.0
    checkpoint = out_dir / "checkpoints" / "checkpoint-000002"
    assert (checkpoint / "rng-0.pt").is_file() and (checkpoint / "rng-1.pt").is_file()
    assert result.out_dir == out_dir and (out_dir / "final").is_dir() and (out_dir / "metrics.csv").is_file()
    summary = json.loads((out_dir / "run_summary.json").read_text())
    assert summary["validation_pairs_by_rank"][0] == summary["validation_pairs_by_rank"][1] > 0
    (job,) = cluster.trainjobs.values()
    assert trainjob._condition(job, "Complete")
    # The job's own split copy on the volume, which the nodes trained on.
    assert (out_dir.parent / ".finetune.launch" / "split").is_dir()
    # Node 0's real output, streamed; node 1's log stayed in its pod.
    out = capsys.readouterr().out
    node0 = cluster.logs[(NS, cluster.node_pod(job["metadata"]["name"], 0))]
    node1 = cluster.logs[(NS, cluster.node_pod(job["metadata"]["name"], 1))]
    assert node0 and all(line in out for line in node0)
    assert any(line not in node0 and line not in out for line in node1)
