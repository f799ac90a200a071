"""The batched metric sink: values reach MLflow in few requests through the run's outbox, a server that blinks loses
nothing (the values wait in the spool and go in order when it answers), and the engine's MetricSink protocol is what
it implements."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from rangefinder.errors import TrackingError
from rangefinder.tracking import BatchedMetricLogger
from rangefinder.tracking.outbox import Outbox
from rangefinder.tracking.spool import Spool, read_spool
from rangefinder.training import MetricSink
from tests.tracking.fixtures import free_port


@pytest.fixture
def run_id(mlflow_server_uri):
    client = MlflowClient(tracking_uri=mlflow_server_uri)
    exp = client.get_experiment_by_name("metrics") or client.get_experiment(client.create_experiment("metrics"))
    return client.create_run(exp.experiment_id).info.run_id


def outbox(client, run_id, tmp_path, **kw) -> Outbox:
    return Outbox(client, Spool(tmp_path / "spool" / f"finetune-{run_id}.jsonl", tracking_uri=client.tracking_uri,
                                run_id=run_id, step="finetune"), **kw)


def test_values_are_sent_in_batches_and_all_arrive(mlflow_server_uri, run_id, tmp_path):
    client = MlflowClient(tracking_uri=mlflow_server_uri)
    sink = BatchedMetricLogger(outbox(client, run_id, tmp_path, flush_every=300, flush_seconds=3600))
    assert isinstance(sink, MetricSink)
    for update in range(250):  # 2 values each (None is "not measured"): one flush at 300, the rest on close
        sink.log_metrics({"lr": 1e-4, "train_loss": 1.0 / (update + 1), "grad_norm": None}, step=update)
    assert sink.sent == 300 and sink.pending == 200
    sink.close()
    assert sink.sent == 500
    history = client.get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in history) == list(range(250))
    with sink.__class__(outbox(client, run_id, tmp_path)) as odd:
        odd.log_metrics({"val_loss@b0 (mean)": 0.5}, step=1)  # MLflow would refuse the whole batch for '@()'
    # The validation losses go under their chart section (tracking.metrics.VALIDATION_SECTION).
    assert client.get_metric_history(run_id, "validation/val_loss_b0 _mean_")[0].value == 0.5
    with pytest.raises(TrackingError, match="closed"):
        sink.log_metrics({"lr": 1.0}, step=251)


def test_a_down_server_loses_nothing_and_gets_everything_in_order_when_back(mlflow_server_uri, run_id, tmp_path):
    down = MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")
    box = outbox(down, run_id, tmp_path, flush_every=2, flush_seconds=3600)
    sink = BatchedMetricLogger(box)
    sink.log_metrics({"train_loss": 0.5, "lr": 1e-4}, step=1)  # the flush fails; training goes on
    assert box.away and read_spool(box.spool.path).counts() == {"metrics": 2}
    sink.log_metrics({"train_loss": 0.4, "lr": 1e-4}, step=2)  # not tried again so soon: no stall per update
    assert read_spool(box.spool.path).counts() == {"metrics": 4} and sink.sent == 0
    box.client = MlflowClient(tracking_uri=mlflow_server_uri)  # the server is back
    assert box.wait_for_server(5)
    sink.log_metrics({"train_loss": 0.3, "lr": 1e-4}, step=3)
    sink.close()
    assert not box.spool.exists() and not box.away
    up = MlflowClient(tracking_uri=mlflow_server_uri)
    history = sorted(up.get_metric_history(run_id, "train_loss"), key=lambda m: m.step)
    assert [m.value for m in history] == [0.5, 0.4, 0.3]


def test_an_image_goes_now_or_into_the_spool_while_the_server_is_down(mlflow_server_uri, run_id, tmp_path):
    """The multi-process workers' sink is also the engine's ImageSink: a sample grid reaches the run as one step
    of its image series at once, or waits in the step's spool for `rangefinder relog` when the server is away."""
    from PIL import Image

    from rangefinder.tracking.spool import replay
    from rangefinder.training import ImageSink

    png = tmp_path / "grid.png"
    Image.new("RGB", (40, 20), "red").save(png)
    # First the server is away (mlflow caches where a run's artifacts go once it has asked a live server, so the
    # down server comes first, as it would for a run that has logged nothing yet).
    away_box = outbox(MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}"), run_id, tmp_path)
    spool = away_box.spool
    away = BatchedMetricLogger(away_box)
    assert isinstance(away, ImageSink)
    away.log_image(png, key="samples_during_training", step=8)  # no error: training goes on
    assert read_spool(spool.path).counts() == {"image": 1}

    up = MlflowClient(tracking_uri=mlflow_server_uri)
    BatchedMetricLogger(outbox(up, run_id, tmp_path / "live")).log_image(png, key="samples_during_training", step=4)
    png.unlink()  # the run's folder may be gone by the time someone relogs: the spool kept its own copy
    replay(spool.path, up)

    names = [f.path.split("/")[-1] for f in up.list_artifacts(run_id, "images") if f.path.endswith(".png")]
    steps = sorted(int(n.split("+step+")[1].split("+")[0]) for n in names if n.startswith("samples_during_training"))
    assert steps == [4, 8], names
