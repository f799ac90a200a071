"""The run tree and what a step logs, read back through MlflowClient, on a real server and on a local sqlite store."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from mlflow import MlflowClient
from PIL import Image

from rangefinder import __version__
from rangefinder.config import RangefinderConfig, TrackingConfig
from rangefinder.planning import plan_for
from rangefinder.tracking import ensure_parent_run, finish_pipeline_run, folder_digest, step_run


@pytest.fixture(params=["server", "sqlite"])
def cfg(request, tmp_path) -> RangefinderConfig:
    uri = request.getfixturevalue("mlflow_server_uri" if request.param == "server" else "shared_sqlite_tracking_uri")
    # A fresh experiment per test keeps searches by tag independent of the other tests on the shared server.
    name = f"t-{request.node.name}-{tmp_path.name}"
    return RangefinderConfig(
        model={"base_model": "/models/sd15"},
        training={"epochs": 2, "batch_size": 2, "grad_accum": 2, "scale_lr": "linear", "lr": 1e-5},
        tracking=TrackingConfig(tracking_uri=uri, experiment_name=name, log_every_updates=2),
    )


def _client(cfg) -> MlflowClient:
    return MlflowClient(tracking_uri=cfg.tracking.tracking_uri)


def test_run_tree_metrics_decisions_and_artifacts(cfg, tmp_path, capsys):
    parent_id = ensure_parent_run(cfg, name="rf-demo-1", kfp_run_id="kfp-123", kfp_run_name="rf-demo-1",
                                  tags={"rangefinder.dataset_digest": "d1g35t"})
    assert ensure_parent_run(cfg, kfp_run_id="kfp-123") == parent_id  # any later step finds the same parent

    plan = plan_for(cfg.training, train_images=16)
    csv = tmp_path / "metrics.csv"
    csv.write_text("update,epoch,lr,train_loss,val_loss\n0,0,1e-5,,1.0\n")
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.html").write_text("<html></html>")
    (report / "lr_curve.png").write_bytes(b"\x89PNG fake")

    with step_run(cfg, "lr_range_test", parent_run_id=parent_id) as run:
        run.log_config(cfg, plan=plan)
        for update in range(1, 9):
            metrics = {"lr": 1e-5 * update, "train_loss": 1.0 / update, "grad_norm": 0.1 * update}
            if update % 4 == 0:  # a validation measurement
                metrics.update(val_loss=2.0 / update, stabilize_loss=1.5 / update, val_loss_b0=3.0 / update)
            run.log_metrics(metrics, step=update)
        run.log_metrics({"val_loss": 1.0, "val_loss_b0": 1.2}, step=3)  # kept although 3 % 2: validation
        run.log_metrics({"val_loss": float("nan")}, step=9)  # a diverged point stays visible
        assert run.metrics.pending > 0  # buffered, not one request per update
        run.log_artifact(csv, "curves")
        run.log_artifact(report, "report")
        grid = tmp_path / "grid.png"
        Image.fromarray(np.full((8, 16, 3), 200, dtype=np.uint8)).save(grid)
        run.log_image(grid, key="sample_grid", step=8)
        run.log_image(np.zeros((8, 8, 3), dtype=np.uint8), artifact_file="samples/first.png")
        run.log_decisions({"lr_low": 2e-5, "lr_high": np.float64(6e-5), "lr_mid": 4e-5, "quality": 0.75,
                           "status": "ok", "flags": ["zoomed", "censored_right"], "needs_zoom": np.bool_(False),
                           "detail": {"points": np.int64(5)}})
    with step_run(cfg, "select_steps", parent_run_id=parent_id) as run2:
        run2.log_decisions({"recommended_epochs": 12, "status": "still_improving"})
    finish_pipeline_run(cfg, parent_id)
    assert "View run" not in capsys.readouterr().out  # stdout stays clean for the CLI's --json

    client = _client(cfg)
    parent = client.get_run(parent_id)
    assert parent.info.run_name == "rf-demo-1" and parent.info.status == "FINISHED"
    ptags = parent.data.tags
    assert ptags["kfp.run_id"] == "kfp-123" and ptags["kfp.run_name"] == "rf-demo-1"
    assert ptags["rangefinder.version"] == __version__
    assert ptags["rangefinder.base_model"] == "/models/sd15"
    assert ptags["rangefinder.dataset_digest"] == "d1g35t"
    assert len(ptags["mlflow.source.git.commit"]) == 40
    assert parent.data.params["training.batch_size"] == "2"  # the parent carries the pipeline's settings

    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    assert sorted(r.info.run_name for r in children) == ["lr_range_test", "select_steps"]
    assert all(r.info.status == "FINISHED" for r in children)

    child = client.get_run(run.run_id)
    params = child.data.params
    assert params["training.grad_accum"] == "2"
    # Only the settings that apply: a local full fine-tune on one node without retrain shows no other method's, no
    # pod's, no multi-node and no retrain settings; the whole config is the run's config.yaml (issue 35).
    assert not [k for k in params if k.startswith(("training.lora.", "training.textual_inversion.", "kubernetes.",
                                                   "distributed.runtime", "retrain.schedule"))], sorted(params)
    assert params["distributed.num_nodes"] == "1" and params["retrain.enabled"] == "False"
    # Nor the training fields each pipeline run sets itself (its LR, budget, schedule): the planner's are there.
    assert not {"training.lr", "training.epochs", "training.schedule", "training.scale_lr"} & params.keys()
    assert float(params["plan.lr"]) == pytest.approx(4e-5)
    import yaml

    for run_id in (run.run_id, parent_id):
        (tmp_path / run_id).mkdir()
        path = client.download_artifacts(run_id, "config.yaml", str(tmp_path / run_id))
        whole = yaml.safe_load(open(path).read())
        resolved = json.loads(cfg.model_dump_json())
        assert whole == resolved, run_id  # the Kubernetes Secrets' names too: they are not credentials
    assert not [k for k in parent.data.params if k.startswith("kubernetes.")]
    assert params["plan.effective_batch"] == "4" and float(params["plan.updates_per_epoch"]) == 4
    assert float(params["plan.lr"]) == pytest.approx(4e-5)  # scaled: 1e-5 x effective batch 4

    def history(key):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run.run_id, key), key=lambda m: m.step)]

    assert [s for s, _ in history("train_loss")] == [2, 4, 6, 8]  # log_every_updates=2 thins per-update metrics
    assert history("grad_norm")[-1] == (8, pytest.approx(0.8))
    val = history("validation/val_loss")
    assert [s for s, _ in val] == [3, 4, 8, 9] and val[1][1] == pytest.approx(0.5) and math.isnan(val[3][1])
    assert [s for s, _ in history("stabilize_loss")] == [4, 8]
    assert history("validation/val_loss_b0")[0] == (3, pytest.approx(1.2))

    # LRs are tags, in 4 digits (a single-value metric is a bar chart that reads "0.00"); other numbers metrics.
    assert child.data.tags["lr_mid"] == "4.000e-05" and "lr_mid" not in child.data.metrics
    assert child.data.metrics["detail.points"] == 5 and child.data.metrics["quality"] == 0.75
    assert child.data.tags["status"] == "ok" and child.data.tags["flags"] == "zoomed,censored_right"
    assert child.data.tags["needs_zoom"] == "false" and float(child.data.tags["lr_high"]) == pytest.approx(6e-5)
    # The parent gets each step's decisions under the same keys as the step's run (one key per quantity).
    assert ptags["lr_mid"] == "4.000e-05" and parent.data.metrics["quality"] == 0.75
    assert parent.data.metrics["recommended_epochs"] == 12
    assert ptags["status"] == "still_improving"  # the later step's
    assert not any(k.startswith(("lr_range_test.", "select_steps.")) for k in ptags), ptags

    top = {a.path for a in client.list_artifacts(run.run_id)}
    assert {"curves", "report", "images", "samples"} <= top
    series = [a.path for a in client.list_artifacts(run.run_id, "images")]
    assert any(p.startswith("images/sample_grid+step+8+") and p.endswith(".png") for p in series), series
    assert [a.path for a in client.list_artifacts(run.run_id, "curves")] == ["curves/metrics.csv"]
    assert {a.path for a in client.list_artifacts(run.run_id, "report")} == {"report/report.html",
                                                                             "report/lr_curve.png"}
    local = client.download_artifacts(run.run_id, "curves/metrics.csv", str(tmp_path / "dl"))
    assert open(local).read() == csv.read_text()


@pytest.mark.parametrize("family", ["sd1", "flux"])
def test_a_run_s_params_leave_out_the_other_objective_s_settings(family, request):
    """A DDPM model's runs showed the flow-matching objective's 8 settings (training.flow.*), and a flow model's
    DDPM's (min_snr_gamma, prediction_type, noise_offset): each family refuses the other kind's unless left unset,
    so as params they said nothing but looked like choices. Left out once the family can be told from the model."""
    from rangefinder.tracking.runs import applicable_params

    model = request.getfixturevalue("tiny_model_dir" if family == "sd1" else "tiny_flux_dir")
    params = applicable_params(RangefinderConfig.model_validate({"model": {"base_model": str(model)}}))
    flow = [k for k in params if k.startswith("training.flow.")]
    ddpm = {"training.min_snr_gamma", "training.prediction_type", "training.noise_offset"} & params.keys()
    if family == "sd1":
        assert not flow and ddpm == {"training.min_snr_gamma", "training.prediction_type", "training.noise_offset"}
    else:
        assert "training.flow.timestep_sampling" in flow and not ddpm
    assert "training.batch_size" in params
    # Where the family cannot be told yet (a hub id not resolved), nothing is left out on its account.
    unresolved = applicable_params(RangefinderConfig.model_validate({"model": {"base_model": "org/not-resolved"}}))
    assert "training.flow.timestep_sampling" in unresolved and "training.noise_offset" in unresolved


def test_steps_nest_under_mlflow_run_id_when_kfp_sets_it(cfg, monkeypatch, tmp_path):
    client = _client(cfg)
    exp = client.create_experiment(cfg.tracking.experiment_name + "-kfp", artifact_location=tmp_path.as_uri())
    kfp_run = client.create_run(exp, run_name="kfp-plugin-run").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", kfp_run)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", exp)

    assert ensure_parent_run(cfg, name="ignored") == kfp_run
    with step_run(cfg, "split") as run:
        run.log_metrics({"train_images": 16}, step=0)
    child = client.get_run(run.run_id)
    assert child.data.tags["mlflow.parentRunId"] == kfp_run and child.info.experiment_id == exp
    finish_pipeline_run(cfg, kfp_run)  # the plugin's run is the plugin's to end
    assert client.get_run(kfp_run).info.status == "RUNNING"


def test_another_process_finds_the_same_parent(mlflow_server_uri):
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=mlflow_server_uri, experiment_name="cross-process"))
    parent_id = ensure_parent_run(cfg, name="rf-cross-process")
    code = (
        "import sys, json; from rangefinder.config import RangefinderConfig; "
        "from rangefinder.tracking import ensure_parent_run; "
        "cfg = RangefinderConfig.model_validate(json.loads(sys.argv[1])); "
        "print(ensure_parent_run(cfg, name='rf-cross-process'))"
    )
    out = subprocess.run([sys.executable, "-c", code, cfg.model_dump_json()], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == parent_id


def test_of_two_parents_a_race_left_every_step_takes_the_first(shared_sqlite_tracking_uri):
    """Two steps that start together may each make the parent: each then keeps the earliest of the key's parents,
    the later one's step deletes its own, and so every step nests under one parent (the newest would leave one step
    under each, when the first looked before the second made its own)."""
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=shared_sqlite_tracking_uri,
                                                    experiment_name="parent-race"))
    first = ensure_parent_run(cfg, name="rf-race")
    client = _client(cfg)
    made = client.get_run(first)
    second = client.create_run(made.info.experiment_id, start_time=made.info.start_time + 1000,
                               tags={"rangefinder.pipeline_run": "rf-race"}).info.run_id
    assert second != first and ensure_parent_run(cfg, name="rf-race") == first


def test_two_local_runs_that_drew_one_kfp_run_id_keep_their_own_parent_runs(sqlite_tracking_uri, tmp_path,
                                                                           monkeypatch):
    """kfp.local draws a run's id from 10^8 numbers (kfp.local.placeholder_utils.make_random_id): of a few thousand
    local runs logging to one experiment (a team's MLflow server), two likely drew the same. The parent was found by
    that id alone, so the newer run's steps nested under the older run's parent: its fine-tune, with the older one's
    failed, went on in that failed run as a retry, and its exit step ended the older parent. The real resolve-config
    and record-status steps, given what kfp.local gives them (one id, each run's name as kfp.local makes it: the
    pipeline's name and its start to the microsecond), keep each run's tree apart. On the data volume
    ($RANGEFINDER_WORK, as a cluster's pods have it) the exit step removes the succeeded run's work folder, whose runs
    are in their artifacts, and keeps the failed one's, which a retry of that run resumes from: every scheduled run's
    checkpoints and weights stayed there until the volume was full."""
    from kfp.local.executor_input_utils import get_local_pipeline_resource_name

    from rangefinder.config import demo_config
    from rangefinder.pipelines.pipeline import PIPELINE_NAME
    from rangefinder.steps.record_status import run_record_status
    from rangefinder.steps.resolve_config import load_step_config, parameters_from_config, run_resolve_config

    drawn = "72033077"  # the same id, drawn twice
    experiment = "local-runs"
    client = MlflowClient(sqlite_tracking_uri)
    work = tmp_path / "work"
    (work / "mlflow-spool").mkdir(parents=True)  # the steps' spools, on the same volume
    monkeypatch.setenv("RANGEFINDER_WORK", str(work))

    def local_run(fails: bool) -> tuple[str, str]:
        params = parameters_from_config(demo_config(tracking={"tracking_uri": sqlite_tracking_uri,
                                                              "experiment_name": experiment}))
        name = get_local_pipeline_resource_name(PIPELINE_NAME)
        resolved = run_resolve_config(params.pop("base_config"), pipeline_job_id=drawn, pipeline_job_name=name,
                                      **params)
        cfg = load_step_config(resolved.config_json)
        checkpoint = work / resolved.mlflow_parent_run_id / "finetune" / "checkpoints" / "checkpoint-000004"
        checkpoint.mkdir(parents=True)  # where the training steps' work_dir puts their runs
        with pytest.raises(ValueError) if fails else contextlib.nullcontext():
            with step_run(cfg, "finetune", parent_run_id=resolved.mlflow_parent_run_id) as ft:
                if fails:
                    raise ValueError("out of memory at update 3")
        run_record_status(state="FAILED" if fails else "SUCCEEDED", mlflow_experiment=experiment,
                          pipeline_job_id=drawn, pipeline_job_name=name)
        return resolved.mlflow_parent_run_id, ft.run_id

    monday, monday_finetune = local_run(fails=True)
    tuesday, tuesday_finetune = local_run(fails=False)
    assert tuesday != monday and tuesday_finetune != monday_finetune
    finetune = client.get_run(tuesday_finetune)
    assert finetune.data.tags["mlflow.parentRunId"] == tuesday and finetune.data.tags["rangefinder.attempt"] == "1"
    assert client.get_run(monday_finetune).info.status == "FAILED"  # not taken up again by Tuesday's run
    states = {run_id: (r.info.status, r.data.tags["rangefinder.final_state"])
              for run_id in (monday, tuesday) for r in [client.get_run(run_id)]}
    assert states == {monday: ("FAILED", "FAILED"), tuesday: ("FINISHED", "SUCCEEDED")}
    assert sorted(p.name for p in work.iterdir()) == sorted([monday, "mlflow-spool"])  # the spools beside it stay
    assert (work / monday / "finetune" / "checkpoints" / "checkpoint-000004").is_dir()


def test_a_step_called_in_a_notebook_leaves_mlflow_s_process_settings_as_it_found_them(sqlite_tracking_uri, tmp_path,
                                                                                        monkeypatch):
    """A notebook's kernel after a step: the step's store stayed MLflow's tracking URI (and $MLFLOW_TRACKING_URI,
    which mlflow.set_tracking_uri exports) and its $MLFLOW_HTTP_REQUEST_* limits stayed set, so the next step called
    without a tracking setting logged to the earlier step's store, not to the user's own or the default. What a step
    sets is put back when it returns and when it raises; the user's own settings stay."""
    import os

    import mlflow
    import mlflow.tracking.fluent as fluent

    from rangefinder.config import demo_config
    from rangefinder.errors import ConfigError
    from rangefinder.steps.record_status import run_record_status
    from rangefinder.steps.resolve_config import parameters_from_config, run_resolve_config

    def state() -> tuple:
        return ({k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}, mlflow.get_tracking_uri(),
                mlflow.active_run(), fluent._active_experiment_id)

    def resolve(job: str, **model: str) -> str:
        params = parameters_from_config(demo_config(model=model, tracking={"tracking_uri": sqlite_tracking_uri,
                                                                           "experiment_name": "kernel"}))
        return run_resolve_config(params.pop("base_config"), pipeline_job_id=job, **params).mlflow_parent_run_id

    mlflow.set_tracking_uri(None)  # a fresh kernel's (clean_mlflow_env puts back what was there)
    monkeypatch.chdir(tmp_path)
    before = state()
    assert resolve("job-1") and state() == before and not mlflow.is_tracking_uri_set()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a step that raises once its parent run is made
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ConfigError, match="org/not-downloaded"):
        resolve("job-2", base_model="org/not-downloaded")
    assert state() == before

    mine = f"sqlite:///{tmp_path / 'mine.db'}"  # the user's own store and timeout
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mine)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")
    before = state()
    assert resolve("job-3") and state() == before and mlflow.get_tracking_uri() == mine
    run_record_status(state="SUCCEEDED", mlflow_experiment="kernel", pipeline_job_id="job-4")  # no setting: mine
    assert MlflowClient(mine).get_experiment_by_name("kernel") is not None


def test_the_exit_handler_ends_the_parent_as_kfp_ended_the_run_and_names_only_a_failure(sqlite_tracking_uri,
                                                                                         monkeypatch):
    """record-status's state, as MLflow shows the parent run: cancelled KILLED, failed or unknown FAILED, succeeded
    FINISHED. Only a run that did not succeed carries the error and the failed task (KFP fills failed_task with the
    exit handler's own group even when nothing failed), and the error redacted: a token in it never reaches MLflow."""
    from rangefinder.config import REDACTED
    from rangefinder.steps.record_status import run_record_status

    for var in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_tracking_uri)
    token = "hf_" + "a1" * 15
    ended = {"CANCELED": "KILLED", "FAILED": "FAILED", "": "FAILED", "SUCCEEDED": "FINISHED"}
    for state, status in ended.items():
        assert run_record_status(state=state, error_message=f"HTTP 401 with {token}", failed_task="exit-handler-1",
                                 mlflow_experiment="exits", pipeline_job_id=f"job-{state or 'none'}") == status
    client = MlflowClient(sqlite_tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("exits").experiment_id])
    by_state = {r.data.tags["rangefinder.final_state"]: r for r in runs}
    assert sorted(by_state) == sorted(s or "UNKNOWN" for s in ended)
    for state, status in ended.items():
        run = by_state[state or "UNKNOWN"]
        failed = status != "FINISHED"
        assert run.info.status == status
        assert run.data.tags.get("rangefinder.failed_task") == ("exit-handler-1" if failed else None)
        assert run.data.tags.get("rangefinder.error") == (f"HTTP 401 with {REDACTED}" if failed else None)


def test_a_failing_step_is_marked_failed_with_its_error(cfg):
    with pytest.raises(ValueError):
        with step_run(cfg, "train") as run:
            run.log_metrics({"train_loss": 0.3}, step=2)
            run.set_tags({"rangefinder.prompts": "a cat, " * 1000})
            raise ValueError("loss is NaN at update 7")
    data = _client(cfg).get_run(run.run_id)
    assert data.info.status == "FAILED"
    assert data.data.tags["rangefinder.error"] == "ValueError: loss is NaN at update 7"
    # A tag over MAX_TAG_CHARS says it was cut, as a param does: cut without a word, it read as the whole value.
    assert data.data.tags["rangefinder.prompts"] == "a cat, " * 711 + "a c...(+2020 chars)"
    assert data.data.metrics["train_loss"] == 0.3  # what was measured before the failure is kept


def test_no_secret_reaches_params_tags_or_errors(cfg, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnopqrstuvwxyz123456")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pa55-w0rd-xyz")
    leaky = cfg.model_copy(deep=True)
    leaky.model.base_model = "https://bob:pa55-w0rd-xyz@models.example/sd15"
    leaky.sampling.prompts = ["a cat hf_abcdefghijklmnopqrstuvwxyz123456"]
    leaky.training.method = "textual_inversion"  # its settings apply, so they are params
    with pytest.raises(RuntimeError):
        with step_run(leaky, "train", tags={"note": "token pa55-w0rd-xyz"}) as run:
            run.log_config(leaky)
            run.log_params({"hub.token": "whatever-it-is", "api_key": "k-123456"})
            run.log_decisions({"status": "auth with pa55-w0rd-xyz"}, to_parent=False)
            raise RuntimeError("could not open https://bob:pa55-w0rd-xyz@models.example")
    data = _client(cfg).get_run(run.run_id).data
    config_yaml = open(_client(cfg).download_artifacts(run.run_id, "config.yaml", str(tmp_path))).read()
    everything = json.dumps({"params": data.params, "tags": data.tags}) + config_yaml
    for secret in ("pa55-w0rd-xyz", "hf_abcdefghijklmnopqrstuvwxyz123456", "whatever-it-is", "k-123456"):
        assert secret not in everything
    assert data.params["model.base_model"] == "https://models.example/sd15"
    assert data.params["hub.token"] == "***"
    # Look-alikes that are not secrets stay readable.
    assert data.params["training.textual_inversion.placeholder_token"] == "<rf-concept>"


def test_the_logged_config_yaml_reads_back_and_compiles_with_no_credential(mlflow_server_uri, monkeypatch, tmp_path):
    """A run's config.yaml is there to be read back (`compile --config`, `run --local --config`): the Kubernetes
    Secrets' names are in it as set (a Secret's name is not a credential; masked, they made 3 validation errors), a
    credential is not, and a value hidden for holding one is one line naming the setting to fill in."""
    import yaml

    from rangefinder.config import load_config
    from tests.cli.test_bad_input import assert_one_line_error, in_process

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-pw-7781")
    secrets = {"mlflow_secret": "team-mlflow", "hf_token_secret": "team-hf", "hf_token_secret_key": "HF_READ_TOKEN"}
    cfg = RangefinderConfig(
        model={"base_model": "/models/sd15"}, kubernetes=secrets, sampling={"prompts": ["a ***bold*** red circle"]},
        tracking=TrackingConfig(tracking_uri=mlflow_server_uri, experiment_name=f"config-yaml-{tmp_path.name}"))
    leaky = cfg.model_copy(update={"sampling": cfg.sampling.model_copy(update={"prompts": ["a cat s3cret-pw-7781"]})})
    read_back = {}
    for name, logged in (("clean", cfg), ("leaky", leaky)):
        with step_run(logged, "finetune") as run:
            run.log_config(logged)
        (tmp_path / name).mkdir()
        read_back[name] = _client(cfg).download_artifacts(run.run_id, "config.yaml", str(tmp_path / name))
        assert "s3cret-pw-7781" not in open(read_back[name]).read()
        kubernetes = yaml.safe_load(open(read_back[name]))["kubernetes"]
        assert {k: kubernetes[k] for k in secrets} == secrets

    assert load_config(read_back["clean"]) == cfg  # what run --local runs
    package = tmp_path / "pipeline.yaml"
    proc = in_process("compile", "--config", read_back["clean"], "--out", str(package))
    assert proc.returncode == 0, proc.stderr
    compiled = package.read_text()
    assert all(f"secretName: {s}" in compiled for s in ("team-mlflow", "team-hf")) and "HF_READ_TOKEN" in compiled

    for command in (("compile", "--out", str(tmp_path / "p2.yaml")), ("run", "--local", "--out", str(tmp_path / "o"))):
        assert_one_line_error(in_process(*command, "--config", read_back["leaky"]),
                              "sampling.prompts.0: *** stands where MLflow's copy", "write the setting's value")
    assert not (tmp_path / "p2.yaml").exists() and not (tmp_path / "o").exists()


def test_dataset_manifests_are_artifacts_and_dataset_inputs(mlflow_server_uri, split_dir, tmp_path):
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=mlflow_server_uri, experiment_name="datasets"))
    parent_id = ensure_parent_run(cfg, name="rf-datasets")
    with step_run(cfg, "split", parent_run_id=parent_id) as run:
        digest = run.log_dataset_manifest(split_dir)
    client = MlflowClient(tracking_uri=mlflow_server_uri)
    # The split's size and what it left out, in the runs table: a week whose folder took a bad file shows it there.
    tags = client.get_run(parent_id).data.tags
    assert (tags["rangefinder.dataset_images"], tags["rangefinder.skipped_files"]) == ("20", "0")
    from rangefinder.data.split import split_dataset

    data = tmp_path / "week"
    data.mkdir()
    for i in range(4):
        Image.new("RGB", (16, 16), (60 * i, 0, 0)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(f"image {i}")
    (data / "cut.png").write_bytes((data / "0.png").read_bytes()[:40])  # a copy cut short
    (data / "cut.txt").write_text("cut")
    Image.new("RGB", (16, 16), (0, 90, 0)).save(data / "uncaptioned.png")
    split_dataset(data, tmp_path / "split", val_split=0.2)
    with step_run(cfg, "split") as bad_week:
        bad_week.log_dataset_manifest(tmp_path / "split")
    tags = client.get_run(bad_week.run_id).data.tags
    assert (tags["rangefinder.dataset_images"], tags["rangefinder.skipped_files"]) == ("4", "2")
    names = {a.path for a in client.list_artifacts(run.run_id, "dataset")}
    assert {"dataset/train.jsonl", "dataset/val.jsonl", "dataset/stabilize.jsonl", "dataset/split.json"} <= names
    child = client.get_run(run.run_id)
    assert child.data.tags["rangefinder.dataset_digest"] == digest
    assert client.get_run(parent_id).data.tags["rangefinder.dataset_digest"] == digest
    inputs = {d.dataset.name.rsplit("-", 1)[1]: d for d in child.inputs.dataset_inputs}
    assert set(inputs) == {"train", "val", "stabilize"}
    rows = {part: json.loads(d.dataset.profile)["num_rows"] for part, d in inputs.items()}
    assert rows == {part: len((split_dir / f"{part}.jsonl").read_text().splitlines()) for part in rows}
    assert {t.key: t.value for t in inputs["val"].tags}["mlflow.data.context"] == "validation"
    # The validation set's digest is a tag of the run and of its parent, whose row in the runs table has no Datasets:
    # its chosen_val_loss beside another run's compares only where the two validation sets are the same.
    val = inputs["val"].dataset.digest
    assert child.data.tags["rangefinder.validation_digest"] == val == folder_digest(split_dir, "val.jsonl")
    assert client.get_run(parent_id).data.tags["rangefinder.validation_digest"] == val


def test_a_ctrl_c_inside_a_step_s_model_load_ends_the_step_interrupted_not_failed(shared_sqlite_tracking_uri,
                                                                                  tiny_model_dir, tmp_path):
    """A real SIGINT inside safetensors' read of a weight while a step loads the base model outside the engine's
    train() (sample-images, register-model's export): torch turns it into a ValueError and diffusers into "Unable to
    load weights from checkpoint file", which the loader reports as a folder it cannot load. The step ended with
    `error: ConfigError: model.base_model: cannot load the diffusers folder ...` and its MLflow run FAILED; it now
    leaves as the Ctrl-C it is, its run KILLED."""
    import signal

    from rangefinder.config import ModelConfig
    from rangefinder.errors import one_line_errors
    from rangefinder.models.loading import load_sd_components
    from tests.training.test_caching import sigint_inside_the_next_cache_read

    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=shared_sqlite_tracking_uri,
                                                    experiment_name=f"ctrl-c-{tmp_path.name}"))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal's foreground
    try:
        with pytest.raises(KeyboardInterrupt), one_line_errors("sample-images"), \
                step_run(cfg, "sample_images") as run:
            sigint_inside_the_next_cache_read()
            load_sd_components(ModelConfig(base_model=str(tiny_model_dir)))
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGINT, previous)
    assert _client(cfg).get_run(run.run_id).info.status == "KILLED"
    assert signal.getsignal(signal.SIGINT) is previous


def test_a_forked_mlflow_command_opens_a_store_this_process_has_open(tmp_path):
    """`ForkedMlflowCli` runs `mlflow` in a fork of the test process, which reuses MLflow's engine for a URI the test
    already opened. The test's open SQLite connection must not cross the fork: the child closes every inherited
    descriptor, and `mlflow server` started on the demo's store after a test had read it through an MlflowClient
    failed with "disk I/O error" (tests/pipelines, test_reports_in_browser.py before test_local_run.py)."""
    from tests.mlflow_store import seed
    from tests.tracking.fixtures import ForkedMlflowCli

    seed(tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert [e.name for e in MlflowClient(tracking_uri=uri).search_experiments()] == ["Default"]  # this process's
    env = {"PATH": "/usr/bin:/bin", "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true"}
    child = ForkedMlflowCli(["experiments", "search"], cwd=tmp_path, env=env, log=tmp_path / "child.log")
    assert child.wait(timeout=60) == 0, (tmp_path / "child.log").read_text()[-2000:]
    assert "Default" in (tmp_path / "child.log").read_text()


def test_a_run_name_and_a_param_key_over_mlflow_s_250_characters_are_cut_saying_so(cfg, monkeypatch):
    """A KFP run's name (or `--name`) becomes the parent run's name, and a node selector's label key (up to 317
    characters) a param's key, in a pod: MLflow keeps 250 of either (its SQL store's columns). A param key over it
    failed the step ("exceeds the maximum length"), a run name was kept whole by SQLite and refused by the SQL servers
    MLflow runs on. Both are cut, ending in a note of what was cut, the key with a digest that keeps two apart. So are
    a metric's and a tag's key, which a user's own step names (a decision per prompt): one over 250 characters failed
    the step with MLflow's "'Metric name' exceeds the maximum length"."""
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # in a pod: the kubernetes settings are params
    prefix = ".".join(["a" * 63] * 3 + ["b" * 61])  # a DNS subdomain of 253 characters
    labels = {f"{prefix}/{'c' * 63}": "gpu", f"{prefix}/{'c' * 62}d": "big"}
    long = cfg.model_copy(update={"kubernetes": cfg.kubernetes.model_copy(update={"node_selector": labels})})
    with step_run(long, "finetune", pipeline_run_name="nightly-" + "x" * 300, run_name="f" * 260) as run:
        run.log_config(long)
        per_prompt = "prompt_score." + "a red circle on a blue background " * 9  # 319 characters
        run.log_metrics({per_prompt + "curve": 0.5}, step=2)
        run.log_decisions({per_prompt + "colour": 0.8, per_prompt + "shape": 0.6, per_prompt + "verdict": "kept"},
                          to_parent=False)
        run.set_tags({per_prompt + "note": "bright"})
    client = _client(cfg)
    data = client.get_run(run.run_id).data
    cut = {k: v for k, v in {**data.metrics, **data.tags}.items() if k.startswith("prompt_score.")}
    assert len(cut) == 5 and all(len(k) == 250 and "chars cut" in k for k in cut), (data.metrics, data.tags)
    assert sorted(cut.values(), key=str) == sorted([0.5, 0.8, 0.6, "kept", "bright"], key=str)
    for run_id, name in ((run.parent_run_id, "nightly-"), (run.run_id, "f")):
        data = client.get_run(run_id)
        assert len(data.info.run_name) <= 250 and data.info.run_name.startswith(name)
        assert data.info.run_name.endswith("chars)"), data.info.run_name
        keys = [k for k in data.data.params if k.startswith("kubernetes.node_selector.")]
        assert len(keys) == 2 and all(len(k) == 250 and "chars cut" in k for k in keys), keys
        assert {data.data.params[k] for k in keys} == {"gpu", "big"}
