"""One outbox (issue 32): the same MLflow outage is handled the same way whether a step trains in its own process or
in two (torchrun, gloo), where rank 0's worker logs the curve and the sample grids into the step's run.

Everything is real: a `mlflow server` on loopback, stopped after the step logged its settings and before it trains,
restarted on the same store and port after the steps ended. What arrived is read back from the server, what did not
from the spool; both agree between one process and two, one warning line said so each time, and replaying the spools
(what `rangefinder relog` does) then completes both runs alike. A step with child runs says one outage once too.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from mlflow import MlflowClient

from rangefinder.config import RangefinderConfig, SamplingConfig, TrainingConfig, ValidationConfig
from rangefinder.tracking import step_run
from rangefinder.tracking.spool import SPOOL_ENV, read_spool, replay
from tests.tracking.fixtures import free_port, relay, start_mlflow_server, stop_mlflow_server

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


@pytest.mark.slow
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


def test_one_outage_of_a_step_with_child_runs_is_said_once_and_its_end_once(tmp_path, mlflow_server_uri, caplog):
    """A step with child runs (the fine-tune's halving candidates, its cooldown) has an outbox per run: one outage was
    said once per run, each line naming another spool file, and "answers again" once per run that sent its spool (or
    not at all for a child whose spool another's record pulled in). The step's runs share one link to the server:
    one line when the first of them starts spooling, naming the step's spool folder, and one when the server answers,
    saying what was sent for all of them. No training: a parent run made on the session's server, reached through a
    port where nothing answers, then a relay to it (the server coming back)."""
    from rangefinder.tracking import StepRun, child_run

    live = MlflowClient(tracking_uri=mlflow_server_uri)
    exp = live.get_experiment_by_name("outage") or live.get_experiment(live.create_experiment("outage"))
    parent_id = live.create_run(exp.experiment_id, run_name="finetune").info.run_id
    port = free_port()
    uri = f"http://127.0.0.1:{port}"  # nothing answers there until the relay starts
    cfg = RangefinderConfig(tracking={"tracking_uri": uri, "experiment_name": "outage", "server_wait_seconds": 0})
    folder = tmp_path / "spool"
    caplog.set_level(logging.WARNING)
    step = StepRun(client=MlflowClient(tracking_uri=uri), run_id=parent_id, experiment_id=exp.experiment_id,
                   step_name="finetune", parent_run_id=None, tracking_uri=uri, cfg=cfg, spool_dir=folder)
    step.set_tags({"status": "racing"})  # the step's first record to find the server away
    children = []
    for name in ("lr_mid", "lr_high"):
        with child_run(cfg, step, f"finetune_{name}", run_name=name, tags={"halving.candidate": name},
                       description=f"candidate {name}") as child:
            child.log_metrics({"val_loss": 0.5}, step=1)
            children.append(child.run_id)
    for child_id in children:
        step.set_run_tags(child_id, {"halving.outcome": "kept"})
    said = [r.getMessage() for r in caplog.records]
    away = [line for line in said if AWAY_LINE in line]
    assert len(away) == 1 and f"keeps what it logs in {folder} " in away[0], said
    # Why, in the words the step's server check uses: it was urllib3's error, cut off at 300 characters mid-word.
    assert f"MLflow at {uri} is not answering (connection refused); step finetune goes on" in away[0], away
    assert len(list(folder.glob("*.jsonl"))) == 3  # the step's own spool and each child's
    # The children ended with the server away: the step, going on, sends their spools; no relog line of their own.
    assert not any("rangefinder relog" in line for line in said), said

    caplog.clear()
    with relay(port, mlflow_server_uri):
        step.finish()
    said = [r.getMessage() for r in caplog.records]
    back = [line for line in said if "answers again" in line]
    assert len(back) == 1 and f"step finetune sent what it had kept in {folder}: " in back[0], said
    assert back[0].endswith("2 runs made, 5 tags, 2 metric values, 2 ends of the run, for 3 runs")
    assert not list(folder.glob("*.jsonl")) and not any(AWAY_LINE in line for line in said)
    made = live.search_runs([exp.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'")
    assert sorted(r.data.tags["halving.candidate"] for r in made) == ["lr_high", "lr_mid"]
    assert [(r.data.tags["halving.outcome"], r.data.metrics) for r in made] == [
        ("kept", {"validation/val_loss": 0.5})] * 2
    assert live.get_run(parent_id).info.status == "FINISHED"


def test_a_record_mlflow_refuses_in_a_child_run_s_spool_is_named_and_the_step_s_own_records_still_go(
        tmp_path, mlflow_server_uri, caplog):
    """The server, back, refuses a record a child run kept (its run deleted meanwhile, here a run it never had): the
    step's own records, sent with the children's spools when it answers, waited behind it, the step's run was left
    RUNNING, and a log call of the step would raise MLflow's refusal of another run's record. The child's spool is
    named and left for `rangefinder relog`; the step's own go."""
    from rangefinder.tracking import StepRun

    live = MlflowClient(tracking_uri=mlflow_server_uri)
    exp = live.get_experiment_by_name("outage") or live.get_experiment(live.create_experiment("outage"))
    parent_id = live.create_run(exp.experiment_id, run_name="finetune").info.run_id
    port = free_port()
    uri = f"http://127.0.0.1:{port}"  # nothing answers there until the relay starts
    cfg = RangefinderConfig(tracking={"tracking_uri": uri, "experiment_name": "outage", "server_wait_seconds": 0})
    folder = tmp_path / "spool"
    caplog.set_level(logging.WARNING)
    step = StepRun(client=MlflowClient(tracking_uri=uri), run_id=parent_id, experiment_id=exp.experiment_id,
                   step_name="finetune", parent_run_id=None, tracking_uri=uri, cfg=cfg, spool_dir=folder)
    child = StepRun(client=step.client, run_id="0" * 32, experiment_id=exp.experiment_id, step_name="finetune_lr_mid",
                    parent_run_id=parent_id, tracking_uri=uri, cfg=cfg, spool_dir=folder, link=step.outbox.link)
    child.set_tags({"halving.candidate": "lr_mid"})  # spooled: the server is away
    step.set_tags({"status": "racing"})
    caplog.clear()
    with relay(port, mlflow_server_uri):
        step.finish()
    said = " ".join(r.getMessage() for r in caplog.records)
    (left,) = folder.glob("*.jsonl")
    assert left.name.startswith("finetune_lr_mid-") and f"refused a tags record of run {'0' * 32}" in said, said
    assert f"rangefinder relog {left}" in said, said
    run = live.get_run(parent_id)
    assert run.data.tags["status"] == "racing" and run.info.status == "FINISHED"
