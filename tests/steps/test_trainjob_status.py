"""Trainer's TrainJobStatus feature (Trainer 2.2+, KEP-2779): rank 0 reports the progress and the latest losses into
the TrainJob's `status.trainerStatus` through the Kubeflow SDK's `update_trainjob_status`, against the loopback API
server (tests/kube_apiserver.py), which plays Trainer's status server and checks each post against the CRD."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import yaml
from kubeflow.trainer.backends.kubernetes import utils as sdk_utils

from rangefinder.config import RangefinderConfig
from rangefinder.launch import processes as launch
from rangefinder.launch import trainjob
from tests.kube_apiserver import GROUP, TOKEN, loopback_cluster

NS = "team-a"


class Recorded:
    """The step's MLflow sink, as far as the wrapper is concerned: what it was given."""

    run_id = "run-1"

    def __init__(self) -> None:
        self.rows: list[tuple[dict, int]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.append((metrics, step))

    def log_image(self, image, artifact_file=None, *, key=None, step=None) -> None:
        self.rows.append(({"image": key}, step or 0))


@pytest.fixture
def trainjob_url(tmp_path, monkeypatch):
    """A TrainJob made as the step makes it, on a loopback cluster; its status URL, token and CA set as Trainer's
    TrainJobStatus plugin sets them on every node."""
    kubeconfig = tmp_path / "kubeconfig"
    with loopback_cluster(kubeconfig, NS) as cluster:
        server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        cfg = RangefinderConfig(kubernetes={"gpu_count": 0, "mlflow_secret": None, "hf_token_secret": None},
                                distributed={"num_nodes": 2})
        job = tmp_path / "launch-job.json"
        trainer, options = trainjob.trainer_and_options(cfg, job, "rf-finetune-status", 1, launch.WORKER_MODULE)
        obj = trainjob.trainjob_manifest(trainer, options, trainjob.runtime_stub("torch-distributed"))
        request = urllib.request.Request(f"{server}/apis/{GROUP}/v1alpha1/namespaces/{NS}/trainjobs",
                                         data=json.dumps(obj).encode(), method="POST",
                                         headers={"Authorization": f"Bearer {TOKEN}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as r:
            assert r.status == 201
        token = tmp_path / "token"
        token.write_text(TOKEN)
        url = f"{server}/apis/{GROUP}/v1alpha1/namespaces/{NS}/trainjobs/rf-finetune-status/status"
        monkeypatch.setenv(trainjob.STATUS_URL_ENV, url)
        monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_TOKEN", str(token))
        monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_CA_CERT", raising=False)
        # The SDK keeps its throttle and token per process; each test starts as a fresh node would.
        monkeypatch.setattr(sdk_utils, "_last_update_time", 0.0)
        monkeypatch.setattr(sdk_utils, "_cached_token", None)
        yield cluster


def _status(cluster) -> dict:
    with cluster.cond:
        return json.loads(json.dumps(cluster.trainjobs[(NS, "rf-finetune-status")].get("status", {})))


def test_rank_0_reports_progress_and_the_latest_validation_loss_into_the_trainjobs_status(trainjob_url):
    cluster = trainjob_url
    inner = Recorded()
    sink = trainjob.status_sink(inner, planned_updates=lambda: 40)
    assert isinstance(sink, trainjob.TrainJobStatusSink)
    sink.log_metrics({"train_loss": 0.31, "lr": 1e-5}, step=9)
    sink.log_metrics({"val_loss": 0.2875}, step=10)  # within the SDK's 5 s: not posted, but kept
    sink.log_image(None, key="sample", step=10)  # the engine's other calls reach the step's own sink
    assert inner.rows == [({"train_loss": 0.31, "lr": 1e-5}, 9), ({"val_loss": 0.2875}, 10), ({"image": "sample"}, 10)]

    first = _status(cluster)["trainerStatus"]
    assert first["progressPercentage"] == 22  # 9 of 40 updates
    assert {m["name"]: m["value"] for m in first["metrics"]} == {"train_loss": "0.31", "update": "9"}

    assert sink.finish()  # the end is posted whatever the throttle says, with the newest losses
    last = _status(cluster)["trainerStatus"]
    assert last["progressPercentage"] == 100 and last["lastUpdatedTime"]
    assert {m["name"]: m["value"] for m in last["metrics"]} == {"val_loss": "0.2875", "train_loss": "0.31",
                                                                "update": "10"}
    assert len(cluster.status_posts) == 2


def test_without_the_feature_rank_0_keeps_its_own_sink(monkeypatch):
    monkeypatch.delenv(trainjob.STATUS_URL_ENV, raising=False)
    inner = Recorded()

    def not_counted() -> int:
        raise AssertionError("a run without the feature counts no updates for it (the count may read the split)")

    assert trainjob.status_sink(inner, planned_updates=not_counted) is inner


def test_the_status_server_refuses_a_post_the_crd_refuses(trainjob_url):
    # The loopback status server is a real check: a progress over 100 is refused, as the CRD's schema says.
    url = trainjob.os.environ[trainjob.STATUS_URL_ENV]
    body = {"trainerStatus": {"progressPercentage": 140, "lastUpdatedTime": "2026-11-26T00:00:00Z"}}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 422
    assert "trainerStatus" not in _status(trainjob_url)


def test_the_trainjob_carries_no_field_trainer_2_2_removed(trainjob_url):
    # Trainer 2.2 removed the torch policy's numProcPerNode and the TrainJob's podTemplateOverrides (RuntimePatches
    # replaced them); the processes per node go to torchrun itself (--nproc_per_node) or come from the GPUs.
    with trainjob_url.cond:
        obj = trainjob_url.trainjobs[(NS, "rf-finetune-status")]
        spec = obj["spec"]
    assert "podTemplateOverrides" not in spec and "numProcPerNode" not in spec["trainer"]
    assert spec["runtimePatches"][0]["manager"]
    assert Path(str(spec["trainer"]["command"][-1])).name == "launch-job.json"


@pytest.mark.slow
def test_a_training_process_of_rank_0_reports_into_its_trainjobs_status(trainjob_url, split_dir, tiny_model_dir,
                                                                        tmp_path, monkeypatch):
    # The node's own entry point (torchrun runs it: rangefinder.launch.processes), on one process, with the variables
    # the TrainJobStatus plugin sets: the posts come from the training itself.
    from dataclasses import replace

    from rangefinder.data.split import read_split
    from rangefinder.training.spec import TrainSpec

    monkeypatch.delenv("RANK", raising=False)
    cfg = RangefinderConfig(training={"batch_size": 4, "cache_dir": str(tmp_path / "cache")},
                            validation={"every_epochs": 1, "timesteps": 2}, finetune={"epochs": 2})
    # The tiny model at its own resolution, no samples during training (the fine-tune's settings otherwise).
    spec = replace(TrainSpec.finetune(cfg, read_split(split_dir), lr=2e-4, bounds=(1e-4, 3e-4), world_size=1),
                   model=str(tiny_model_dir), data=None, sampling=None)
    job = launch.write_job(cfg, spec, tmp_path / "out", save_final=False, step_name="finetune", mlflow_run_id=None)
    assert launch.worker(job) == 0
    posts = trainjob_url.status_posts
    assert posts[0]["progressPercentage"] < 100 and posts[-1]["progressPercentage"] == 100
    last = {m["name"]: m["value"] for m in posts[-1]["metrics"]}
    assert float(last["val_loss"]) > 0 and int(last["update"]) > 0
    assert _status(trainjob_url)["trainerStatus"] == posts[-1]
