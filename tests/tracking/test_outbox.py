"""One outbox (issue 32): the same MLflow outage is handled the same way whether a step trains in its own process or
in two (torchrun, gloo), where rank 0's worker logs the curve and the sample grids into the step's run.

Everything is real: a `mlflow server` on loopback, stopped after the step logged its settings and before it trains,
restarted on the same store and port after the steps ended. What arrived is read back from the server, what did not
from the spool; both agree between one process and two, one warning line said so each time, and replaying the spools
(what `rangefinder relog` does) then completes both runs alike.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rangefinder.config import RangefinderConfig, SamplingConfig, TrainingConfig, ValidationConfig
from rangefinder.tracking import step_run
from rangefinder.tracking.spool import SPOOL_ENV, read_spool, replay
from tests.tracking.fixtures import free_port, start_mlflow_server, stop_mlflow_server

pytestmark = pytest.mark.slow

AWAY_LINE = "is not answering"  # the outbox's one line for an outage


def _events(spool: Path) -> list[tuple]:
    """The spool's records in order, one entry per thing logged (values and paths left out: two processes round
    differently, and files are copies)."""
    out: list[tuple] = []
    for r in read_spool(spool).records:
        if r["kind"] == "metrics":
            out += [("metric", key, step) for key, _value, _ts, step in r["metrics"]]
        elif r["kind"] == "image":
            out.append(("image", r["key"], r["step"]))
        elif r["kind"] == "tags":
            out.append(("tags", tuple(sorted(r["tags"]))))
        elif r["kind"] == "artifact":
            out.append(("artifact", r["artifact_path"]))
        else:
            out.append((r["kind"],))
    return out


def _in_mlflow(client: MlflowClient, run_id: str) -> dict:
    """What the server holds of a run: param names, metric name -> steps, image steps, artifacts, status."""
    run = client.get_run(run_id)
    metrics = {k: sorted(m.step for m in client.get_metric_history(run_id, k)) for k in run.data.metrics}
    images = sorted(int(Path(f.path).name.split("+step+")[1].split("+")[0])
                    for f in client.list_artifacts(run_id, "images") if f.path.endswith(".png"))
    return {"params": sorted(run.data.params), "metrics": metrics, "images": images,
            "curves": [f.path for f in client.list_artifacts(run_id, "curves")],
            "status": run.info.status, "status_tag": run.data.tags.get("status")}


def test_an_outage_is_handled_alike_with_one_process_and_two(tmp_path, split_dir, tiny_model_dir, monkeypatch,
                                                             caplog, capfd):
    from rangefinder.launch.processes import run_training
    from rangefinder.training.loop import TrainSpec

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "spool"))  # the steps' and their workers' spool folder
    port = free_port()
    server_dir = tmp_path / "server"
    uri, proc = start_mlflow_server(server_dir, port=port)
    caplog.set_level(logging.WARNING)

    def setup(n: int) -> tuple[RangefinderConfig, TrainSpec]:
        # No wait at the step's end (server_wait_seconds 0: one last check, then the relog line); the bounded wait
        # itself: test_spool.py's dead-server step and test_server_loss.py.
        cfg = RangefinderConfig.model_validate({
            "training": {"processes_per_node": n},
            "tracking": {"tracking_uri": uri, "experiment_name": f"outage-{n}", "server_wait_seconds": 0}})
        # 16 images at a global batch of 4 (4 per process alone, 2 each on two): 4 updates, a validation and a
        # sample grid every 2.
        tc = TrainingConfig(batch_size=4 // n, world_size=n, lr=1e-4, seed=7, steps=4,
                            cache_dir=str(tmp_path / "cache"))
        return cfg, TrainSpec(tc, ValidationConfig(every_updates=2), split_dir=split_dir, model=str(tiny_model_dir),
                              sampling=SamplingConfig(num_inference_steps=2, every_validations=1))

    def said() -> list[str]:
        """What this process logged and its workers printed since the last call."""
        lines = [r.getMessage() for r in caplog.records] + capfd.readouterr().err.splitlines()
        caplog.clear()
        return lines

    outcome: dict[int, dict] = {1: {}, 2: {}}
    try:
        (cfg1, spec1), (cfg2, spec2) = setup(1), setup(2)
        # Both steps open their run and log their settings; then one outage covers both to their ends.
        with step_run(cfg1, "finetune") as run1, step_run(cfg2, "finetune") as run2:
            for cfg, run in ((cfg1, run1), (cfg2, run2)):
                run.log_config(cfg)
            stop_mlflow_server(proc)
            said()
            for n, cfg, spec, run in ((1, cfg1, spec1, run1), (2, cfg2, spec2, run2)):
                result = run_training(cfg, spec, out_dir=tmp_path / f"train-{n}", metric_sink=run,
                                      step_name="finetune")
                run.log_artifact(result.metrics_csv, "curves")
                run.log_decisions({"best_val_loss": result.best_val_loss, "status": "ok"})
                outcome[n].update(run_id=run.run_id, said=said())
        at_end = said()  # the two steps' last lines, as they ended
        for n in (1, 2):
            (spool,) = (tmp_path / "spool").glob(f"*-{outcome[n]['run_id']}.jsonl")
            outcome[n].update(spool=spool, kept=_events(spool),
                              away_lines=[line for line in outcome[n]["said"] if AWAY_LINE in line],
                              relog_lines=[line for line in at_end if f"rangefinder relog {spool}" in line])

        uri, proc = start_mlflow_server(server_dir, port=port)
        client = MlflowClient(tracking_uri=uri)
        for n in (1, 2):
            outcome[n]["arrived"] = _in_mlflow(client, outcome[n]["run_id"])

        # The same handling: what reached the server before the outage, what waits in the spool, in the same order,
        # and one line saying the server is away and one naming the relog command.
        one, two = outcome[1], outcome[2]
        assert one["arrived"] == two["arrived"]
        assert one["arrived"]["params"] and one["arrived"]["status"] == "RUNNING" and not one["arrived"]["metrics"]
        assert one["kept"] == two["kept"]
        kinds = [e[0] for e in one["kept"]]
        assert kinds.count("image") == 3 and kinds[-1] == "end" and ("artifact", "curves") in one["kept"]
        first_image = kinds.index("image")
        assert ("metric", "validation/val_loss", 0) in one["kept"][:first_image]  # logged before it: first
        for n in (1, 2):
            assert len(outcome[n]["away_lines"]) == 1, (n, outcome[n]["away_lines"])
            assert f"keeps what it logs in {tmp_path / 'spool'} " in outcome[n]["away_lines"][0]
            assert len(outcome[n]["relog_lines"]) == 1, (n, outcome[n]["relog_lines"])

        # Once the server answers, relog puts the rest in, and the two runs hold the same record.
        for n in (1, 2):
            assert not replay(outcome[n]["spool"], client).left  # what `rangefinder relog` does
        whole = {n: _in_mlflow(client, outcome[n]["run_id"]) for n in (1, 2)}
        assert whole[1] == whole[2]
        assert whole[1]["metrics"]["train_loss"] == list(range(1, 5)) and whole[1]["images"] == [0, 2, 4]
        assert whole[1]["status"] == "FINISHED" and whole[1]["status_tag"] == "ok"
        assert whole[1]["curves"] == ["curves/metrics.csv"]
    finally:
        stop_mlflow_server(proc)
