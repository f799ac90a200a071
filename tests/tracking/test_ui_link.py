"""Issue 35 item 5, landing: `demo` and `run --local` print the link that opens MLflow's model-training runs table
(MLflow 3.x's UI otherwise lands on its GenAI view) beside the command that serves the UI."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from rangefinder.config import RangefinderConfig, TrackingConfig, parse_config
from rangefinder.errors import ConfigError
from rangefinder.pipelines.local_run import LocalRun, _experiment_id
from rangefinder.steps.register_model import Registered, result_markdown
from rangefinder.tracking import step_run
from rangefinder.tracking.target import mlflow_executable, run_ui_link, ui_link, ui_url_hint


def _ui_bundle() -> str:
    js = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    return "".join(p.read_text(errors="replace") for p in sorted(js.glob("main.*.js")))


def test_the_link_names_a_route_and_view_the_installed_ui_has():
    """The installed UI reads `workflowType` from the query, knows `machine_learning`, and has a `runs` tab: if a
    later MLflow renames them, this fails instead of the printed link silently landing on the GenAI view."""
    bundle = _ui_bundle()
    assert 'get("workflowType")' in bundle and 'MACHINE_LEARNING="machine_learning"' in bundle
    assert '"/experiments/:experimentId/:tabName"' in bundle and 'Runs="runs"' in bundle
    _, link = ui_link("sqlite:///x.db", "7")
    assert link == "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"


def test_a_local_runs_summary_links_the_experiment_its_steps_logged_to(sqlite_tracking_uri, tmp_path):
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=sqlite_tracking_uri, experiment_name="landing"))
    with step_run(cfg, "finetune") as run:
        run.log_metrics({"val_loss": 0.5}, step=1)
    exp_id = _experiment_id(sqlite_tracking_uri, cfg)
    summary = LocalRun(out_dir=tmp_path, run_dir=tmp_path, tracking_uri=sqlite_tracking_uri,
                       experiment_id=exp_id).summary()
    assert summary["mlflow_ui"] == f"{mlflow_executable()} ui --backend-store-uri {sqlite_tracking_uri}"
    assert summary["mlflow_link"] == f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs?workflowType=machine_learning"
    # With tracking.ui_url on another port of this machine, the command served on 5000 and the link pointed at 8080:
    # the command serves where the link points.
    summary = LocalRun(out_dir=tmp_path, run_dir=tmp_path, tracking_uri=sqlite_tracking_uri, experiment_id=exp_id,
                       ui_url="http://localhost:8080").summary()
    assert summary["mlflow_ui"] == f"{mlflow_executable()} ui --backend-store-uri {sqlite_tracking_uri} --port 8080"
    assert summary["mlflow_link"].startswith("http://localhost:8080/#/experiments/")
    # The linked experiment is the one holding the step's run.
    found = MlflowClient(tracking_uri=sqlite_tracking_uri).search_runs([exp_id])
    assert [r.info.run_id for r in found] == [run.run_id]


def test_a_server_is_linked_without_its_credentials_and_without_a_command():
    command, link = ui_link("https://u:hunter2-pw@mlflow.example:5000/", "3")
    assert command is None
    assert link == "https://mlflow.example:5000/#/experiments/3/runs?workflowType=machine_learning"
    assert "hunter2" not in link


def test_the_ui_command_pasted_into_a_shell_opens_the_store_under_a_folder_with_a_space(tmp_path):
    """`run --local --out "run 1"` printed `mlflow ui --backend-store-uri sqlite:////.../run 1/mlflow.db`, which a
    shell splits in two: the UI opened a store named `sqlite:////.../run`."""
    db = tmp_path / "run 1 ü" / "mlflow.db"
    db.parent.mkdir()
    uri = f"sqlite:///{db}"
    exp_id = MlflowClient(tracking_uri=uri).create_experiment("landing")
    command, _ = ui_link(uri, exp_id)
    assert command is not None
    words = shlex.split(command)
    assert words[1:3] == ["ui", "--backend-store-uri"] and len(words) == 4
    assert MlflowClient(tracking_uri=words[3]).get_experiment(exp_id).name == "landing"


def test_the_ui_command_runs_from_a_shell_without_the_venv_on_its_path(sqlite_tracking_uri, tmp_path, monkeypatch):
    """`make demo` runs .venv/bin/rangefinder with no venv activated: the `mlflow_ui` line said `mlflow ui ...`, which
    that shell does not find. Its command is this interpreter's mlflow, by path where PATH lacks it."""
    monkeypatch.setenv("PATH", str(tmp_path))  # a shell whose PATH holds no mlflow
    command, _ = ui_link(sqlite_tracking_uri, "0")
    assert command is not None
    executable = shlex.split(command)[0]
    assert Path(executable) == Path(sys.executable).parent / "mlflow"
    version = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PATH": str(tmp_path)})
    assert version.returncode == 0 and "version" in version.stdout, version.stderr[-500:]
    # With this interpreter's bin first on PATH (an activated venv), the command is the short name it finds.
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    assert shlex.split(ui_link(sqlite_tracking_uri, "0")[0] or "")[0] == "mlflow"


# Issue K item 1: the links a cluster's run shows point where the browser goes, not at the pods' in-cluster address.

IN_CLUSTER = "http://mlflow.mlflow.svc:5000"


def test_the_ui_url_set_is_where_the_links_point_and_no_hint_is_given():
    ui = TrackingConfig(ui_url="mlflow.example.org/prefix/#/experiments/3?x=1").ui_url
    assert ui == "http://mlflow.example.org/prefix"  # a page copied from the browser: up to its #, with a scheme
    command, link = run_ui_link(IN_CLUSTER, "3", "abc", ui)
    assert (command, link) == (None, "http://mlflow.example.org/prefix/#/experiments/3/runs/abc")
    assert ui_url_hint(IN_CLUSTER, ui) is None
    # A local store still needs its UI served; the link goes to where the person said it is served.
    command, link = ui_link("sqlite:///x.db", "7", "http://localhost:8080/")
    assert command is not None and "--backend-store-uri sqlite:///x.db --port 8080" in command
    assert link == "http://localhost:8080/#/experiments/7/runs?workflowType=machine_learning"
    assert shlex.split(ui_link("sqlite:///x.db", "7", "http://127.0.0.1:5000")[0] or "")[-1] == "sqlite:///x.db"
    # Where no `mlflow ui` option serves the link (a proxy's https, another host), the line says so in a comment a
    # shell skips when it is pasted.
    for ui_url in ("https://mlflow.example.org", "http://devbox.lan:8080", "http://localhost",
                   "http://localhost:8080/my%20ui"):
        command, link = ui_link("sqlite:///x.db", "7", ui_url)
        assert command is not None and link.startswith(f"{ui_url}/#/")
        assert command.endswith(f"  # serves http://127.0.0.1:5000; the link points at {ui_url} (tracking.ui_url), "
                                "which must forward there"), command
        assert shlex.split(command, comments=True)[1:] == ["ui", "--backend-store-uri", "sqlite:///x.db"]


def test_a_ui_url_with_a_path_gets_the_command_that_serves_the_ui_under_it():
    """`tracking.ui_url: http://localhost:8080/mlflow` printed `mlflow ui` on 127.0.0.1:5000 with a comment, where
    `mlflow ui --port 8080 --static-prefix /mlflow` serves that link: MLflow 3.17 serves the page, its static files
    and its ajax-api under the prefix (tried on a real `mlflow ui`: `/mlflow/` and `/mlflow/ajax-api/...` 200)."""
    ui = TrackingConfig(ui_url="http://localhost:8080/mlflow/#/experiments/3").ui_url
    command, link = ui_link("sqlite:///x.db", "7", ui)
    assert link == "http://localhost:8080/mlflow/#/experiments/7/runs?workflowType=machine_learning"
    assert command is not None and shlex.split(command, comments=True)[1:] == [
        "ui", "--backend-store-uri", "sqlite:///x.db", "--port", "8080", "--static-prefix", "/mlflow"], command
    assert shlex.split(ui_link("sqlite:///x.db", "7", "http://[::1]:5000/a/b-c")[0] or "")[-4:] == [
        "--host", "::1", "--static-prefix", "/a/b-c"]


def test_a_ui_url_on_ipv6_loopback_gets_the_command_that_serves_it():
    """`tracking.ui_url: http://[::1]:5055` printed `mlflow ui` on 127.0.0.1:5000 with a comment, where `mlflow ui
    --host ::1 --port 5055` serves that link: MLflow's host check lets `[::1]:5055` in with no --allowed-hosts."""
    from mlflow.server.security_utils import get_default_allowed_hosts, is_allowed_host_header

    ui = TrackingConfig(ui_url="http://[::1]:5055/").ui_url
    command, link = ui_link("sqlite:///x.db", "7", ui)
    assert link == "http://[::1]:5055/#/experiments/7/runs?workflowType=machine_learning"
    assert command is not None and shlex.split(command, comments=True)[1:] == [
        "ui", "--backend-store-uri", "sqlite:///x.db", "--host", "::1", "--port", "5055"], command
    assert shlex.split(ui_link("sqlite:///x.db", "7", "http://[::1]:5000")[0] or "")[-2:] == ["--host", "::1"]
    # The Host header a browser sends for each link the command serves is one the installed MLflow answers.
    for served in ("localhost:8080", "127.0.0.1:8080", "[::1]:5055"):
        assert is_allowed_host_header(get_default_allowed_hosts(), served), served
    # Another loopback MLflow would refuse (403) keeps the comment; so does [::1] with no port (80, root's).
    for ui_url in ("http://127.0.0.2:8080", "http://[::1]"):
        command, _ = ui_link("sqlite:///x.db", "7", ui_url)
        assert command is not None and "  # serves http://127.0.0.1:5000;" in command, command
    assert not is_allowed_host_header(get_default_allowed_hosts(), "127.0.0.2:8080")


@pytest.mark.parametrize("uri,host", [
    (IN_CLUSTER, "mlflow.mlflow.svc"),
    ("http://mlflow.rangefinder.svc.cluster.local:5000", "mlflow.rangefinder.svc.cluster.local"),
    ("http://mlflow:5000", "mlflow"),
    ("http://localhost:5000", None),
    ("http://127.0.0.1:5000", None),
    ("https://mlflow.example.org", None),
    ("sqlite:///mlflow.db", None),
])
def test_an_in_cluster_tracking_uri_without_a_ui_url_says_what_to_set(uri, host):
    """Unset, the link is today's (the tracking URI's) and, where that names a Service, the result says so and names
    the setting, in the run form's words and the config's."""
    hint = ui_url_hint(uri, None)
    if host is None:
        assert hint is None
        return
    assert hint is not None and host in hint and "mlflow_ui_url" in hint and "tracking.ui_url" in hint
    _, link = run_ui_link(uri, "3", "abc")
    assert link.startswith(uri + "/#/")
    markdown = result_markdown(Registered(model_uri="models:/m/1", version="1", weights=Path("w"), mlflow_link=link,
                                          mlflow_hint=hint), lr=1e-4, length=("Epochs trained", "2"), weights="w",
                               why="")
    (row,) = [r for r in markdown.splitlines() if r.startswith("| MLflow |")]
    assert f"]({link})" in row and "tracking.ui_url" in row


@pytest.mark.parametrize("given,held", [("https://alice:hunter2-pw@mlflow.example.org", "a user name and password"),
                                        ("https://mlflow.example.org/?token=hunter2-pw", "a secret in its query")])
def test_a_ui_url_with_credentials_is_refused_unshown(given, held):
    with pytest.raises(ConfigError) as e:
        parse_config({"tracking": {"ui_url": given}})
    msg = str(e.value)
    assert msg.startswith("tracking.ui_url:") and held in msg and "hunter2" not in msg and "alice" not in msg, msg
    # The fix is the browser's own sign-in, not a model's token (the scan of every URL in a config says it first).
    assert "the browser signs in itself" in msg and "HF_TOKEN" not in msg, msg
    assert TrackingConfig(ui_url="  ").ui_url is None  # blank: unset, as the run form's empty string
