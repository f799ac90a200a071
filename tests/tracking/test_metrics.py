"""The batched metric sink: values reach MLflow in few requests, survive a server that blinks, and the engine's
MetricSink protocol is what it implements."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from rangefinder.errors import TrackingError
from rangefinder.tracking import BatchedMetricLogger
from rangefinder.training import MetricSink
from tests.tracking.fixtures import free_port


@pytest.fixture
def run_id(mlflow_server_uri):
    client = MlflowClient(tracking_uri=mlflow_server_uri)
    exp = client.get_experiment_by_name("metrics") or client.get_experiment(client.create_experiment("metrics"))
    return client.create_run(exp.experiment_id).info.run_id


def test_values_are_sent_in_batches_and_all_arrive(mlflow_server_uri, run_id):
    client = MlflowClient(tracking_uri=mlflow_server_uri)
    sink = BatchedMetricLogger(client, run_id, flush_every=300, flush_seconds=3600)
    assert isinstance(sink, MetricSink)
    for update in range(250):  # 2 values each (None is "not measured"): one flush at 300, the rest on close
        sink.log_metrics({"lr": 1e-4, "train_loss": 1.0 / (update + 1), "grad_norm": None}, step=update)
    assert sink.sent == 300 and sink.pending == 200
    sink.close()
    assert sink.sent == 500
    history = client.get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in history) == list(range(250))
    with sink.__class__(client, run_id) as odd:
        odd.log_metrics({"val_loss@b0 (mean)": 0.5}, step=1)  # MLflow would refuse the whole batch for '@()'
    assert client.get_metric_history(run_id, "val_loss_b0 _mean_")[0].value == 0.5
    with pytest.raises(TrackingError, match="closed"):
        sink.log_metrics({"lr": 1.0}, step=251)


def test_a_down_server_loses_nothing_until_close_reports_it(mlflow_server_uri, run_id):
    down = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")
    sink = BatchedMetricLogger(down, run_id, flush_every=2, flush_seconds=3600)
    sink.log_metrics({"train_loss": 0.5, "lr": 1e-4}, step=1)  # the flush fails; training goes on
    sink.log_metrics({"train_loss": 0.4, "lr": 1e-4}, step=2)  # not tried again so soon: no stall per update
    assert sink.pending == 4 and sink.sent == 0
    sink.client = MlflowClient(tracking_uri=mlflow_server_uri)  # the server is back
    sink.close()
    assert sink.sent == 4
    up = MlflowClient(tracking_uri=mlflow_server_uri)
    assert [m.value for m in sorted(up.get_metric_history(run_id, "train_loss"), key=lambda m: m.step)] == [0.5, 0.4]

    never = BatchedMetricLogger(down, run_id, flush_every=100)
    never.log_metrics({"train_loss": 0.3}, step=3)
    with pytest.raises(TrackingError, match="could not send 1 metric values"):
        never.close()
