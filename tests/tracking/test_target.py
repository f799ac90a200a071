"""Where runs go, and the fail-fast check: a down server or refused credentials stop a step before any training."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from rangefinder.config import RangefinderConfig, TrackingConfig
from rangefinder.errors import TrackingError
from rangefinder.tracking import check_tracking_server, resolve_experiment_name, resolve_tracking_uri, step_run
from tests.tracking.fixtures import free_port


def test_uri_from_config_then_environment_then_local_sqlite(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert resolve_tracking_uri(None) == f"sqlite:///{tmp_path / 'mlflow.db'}"  # absolute: subprocesses agree
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert resolve_tracking_uri(RangefinderConfig()) == "http://mlflow.example:5000"
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri="sqlite:////tmp/x/mlflow.db"))
    assert resolve_tracking_uri(cfg) == "sqlite:////tmp/x/mlflow.db"


def test_a_local_store_lands_in_its_folder_or_its_folder_is_refused(monkeypatch, tmp_path, capsys):
    """A folder named with a `%` before two hex digits (SQLAlchemy decodes `%41` to `A`) or a `?` (a URI's query):
    a local run's store, and the working folder's default, were written in another folder than the one named (`run
    x` for `run %20x`), where the run's own `mlflow ui` line did not look. Refused in one line, before the demo makes
    anything; other names (`#`, `%` alone, spaces, é) hold the store."""
    from mlflow import MlflowClient

    from rangefinder.cli.main import main as cli_main
    from rangefinder.pipelines.local_run import local_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    kept = tmp_path / "out #1 50% é"
    MlflowClient(local_tracking_uri(kept)).search_experiments()
    assert [p.name for p in tmp_path.rglob("*")] == [kept.name, "mlflow.db"]
    capsys.readouterr()
    for name, mark, what in (("run %41", "%41", "an escape of 'A'"), ("run ?q", "?", "a URI's query")):
        assert cli_main(["demo", "--out", str(tmp_path / name / "demo")]) == 2
        assert capsys.readouterr().err == (
            f"rangefinder demo: error: --out {tmp_path / name / 'demo'} holds {mark!r}, which MLflow's "
            f"sqlite:/// URI reads as {what}, so the store would be written in another folder; rename the folder, or "
            "set MLFLOW_TRACKING_URI to a store elsewhere\n")
        assert not (tmp_path / name).exists()
    (tmp_path / "cwd %20").mkdir()
    monkeypatch.chdir(tmp_path / "cwd %20")
    with pytest.raises(TrackingError, match="^the folder of the MLflow database .*cwd %20 holds '%20', which"):
        resolve_tracking_uri(None)
    # A relative tracking.tracking_uri is refused with its own name as the way out: it wins over MLFLOW_TRACKING_URI.
    with pytest.raises(TrackingError, match=r"rename the folder, or set tracking\.tracking_uri to a store elsewhere$"):
        resolve_tracking_uri(TrackingConfig(tracking_uri="sqlite:///mlflow.db"))


def test_experiment_name_from_environment_wins(monkeypatch):
    from rangefinder.pipelines.local_run import check_environment_paths

    assert resolve_experiment_name(TrackingConfig(experiment_name="mine")) == "mine"
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "kfp-experiment")
    assert resolve_experiment_name(TrackingConfig(experiment_name="mine")) == "kfp-experiment"
    # Refused as tracking.experiment_name is, not in MLflow's traceback from the first step; by demo and run --local
    # before they write anything.
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", " ")
    with pytest.raises(TrackingError, match="^MLFLOW_EXPERIMENT_NAME is empty or only blank space, which MLflow "):
        resolve_experiment_name(TrackingConfig(experiment_name="mine"))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team/" + "x" * 500)
    with pytest.raises(TrackingError) as refused:
        check_environment_paths(RangefinderConfig())
    assert str(refused.value) == ("MLFLOW_EXPERIMENT_NAME is 505 characters long; MLflow takes an experiment name of "
                                  "at most 500, or unset it for tracking.experiment_name")


def test_server_down_fails_in_seconds_with_the_uri_and_the_fix():
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(TrackingError) as e:
        check_tracking_server(uri)
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert uri in msg and "MLFLOW_TRACKING_URI" in msg and "port-forward" in msg


def test_the_check_tries_no_more_often_and_waits_no_longer_than_the_users_mlflow_settings_ask(monkeypatch):
    """The check's own retries (2, at urllib3's backoff of 0.5) unless MLFLOW_HTTP_REQUEST_MAX_RETRIES or
    MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR ask for less: with MLflow's calls set to fail at once, every step still sat
    through the check's ~1 s of backoff. A real HTTP server on loopback answers 503 (a restarting pod behind its
    proxy, which the check retries) and counts the requests."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    tries: list[str] = []

    class Restarting(BaseHTTPRequestHandler):
        def do_GET(self):
            tries.append(self.path)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Restarting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"http://127.0.0.1:{server.server_address[1]}"

    def check() -> float:
        tries.clear()
        t0 = time.monotonic()
        with pytest.raises(TrackingError, match="HTTP 503"):
            check_tracking_server(uri)
        return time.monotonic() - t0

    try:
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")  # more than the check's own: the check's 2
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")  # no wait between them (0.5 x 2 s before)
        assert check() < 0.9 and len(tries) == 3, tries
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        check()
        assert len(tries) == 1, tries
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "many")  # not a number: the check keeps its own
        check()
        assert len(tries) == 3, tries
    finally:
        server.shutdown()
        server.server_close()


def test_step_run_against_a_down_server_raises_before_the_body_runs():
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=f"http://127.0.0.1:{free_port()}"))
    entered = False
    with pytest.raises(TrackingError):
        with step_run(cfg, "train"):
            entered = True
    assert not entered


@pytest.mark.parametrize("uri,driver", [("mysql://127.0.0.1/runs", "MySQLdb"), ("mssql://127.0.0.1/runs", "pyodbc")])
def test_a_sql_store_without_its_driver_names_the_driver_before_the_body_runs(uri, driver):
    """A local run on a postgresql:// store (no psycopg here) stopped its first step with
    "ModuleNotFoundError: No module named 'psycopg'", naming neither the URI nor a way on."""
    if importlib.util.find_spec(driver) is not None:
        pytest.skip(f"{driver} is installed here")
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=uri))
    entered = False
    with pytest.raises(TrackingError) as e:
        with step_run(cfg, "train"):
            entered = True
    assert not entered
    assert str(e.value).startswith(f"the tracking URI {uri} needs the Python database driver {driver}, which is not "
                                   "installed here;")


def test_a_server_that_is_up_passes(mlflow_server_uri):
    check_tracking_server(mlflow_server_uri)


def test_host_header_not_allowed_names_allowed_hosts(mlflow_server_uri):
    # The fixture's server allows only 127.0.0.1:PORT, so "localhost" is refused as MLflow refuses foreign names.
    port = mlflow_server_uri.rsplit(":", 1)[1]
    with pytest.raises(TrackingError, match="--allowed-hosts"):
        check_tracking_server(f"http://localhost:{port}")


def test_not_an_mlflow_server(mlflow_server_uri):
    with pytest.raises(TrackingError, match="did not answer like an MLflow tracking server"):
        check_tracking_server(mlflow_server_uri + "/not-mlflow")


def test_unwritable_sqlite_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(TrackingError, match="writable location"):
        check_tracking_server(f"sqlite:///{blocker / 'sub' / 'mlflow.db'}")


def test_a_new_sqlite_store_waits_for_another_process_making_it(tmp_path):
    """Two runs started at once on one new database (one MLFLOW_TRACKING_URI in two terminals) each ran MLflow's
    migrations on it: both failed, and the file was left half-migrated for every later run. The check opens the store
    under a flock on the database's folder, which this test holds as the other process making it would."""
    db = tmp_path / "mlflow.db"
    done = threading.Event()

    def check() -> None:
        check_tracking_server(f"sqlite:///{db}")
        done.set()

    other = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(other, fcntl.LOCK_EX)
    thread = threading.Thread(target=check)
    thread.start()
    try:
        assert not done.wait(0.5) and not db.exists()  # waits, and makes nothing meanwhile
    finally:
        os.close(other)
    thread.join(60)
    assert done.is_set()
    with sqlite3.connect(db) as con:  # the store was opened (made) under the lock
        assert con.execute("SELECT name FROM sqlite_master WHERE name = 'experiments'").fetchone()


def test_a_ctrl_c_while_the_check_waits_for_the_store_leaves_its_folder_open_nowhere(tmp_path):
    """A Ctrl-C while the check waits for another process making the store (a local run's end opens it on Ctrl-C)
    left the descriptor of the database's folder open for the rest of the process."""
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    other = os.open(tmp_path, os.O_RDONLY)
    fcntl.flock(other, fcntl.LOCK_EX)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            check_tracking_server(f"sqlite:///{tmp_path / 'mlflow.db'}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.close(other)
    opened = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            opened.append(os.readlink(f"/proc/self/fd/{fd}"))
    assert str(tmp_path) not in opened


def test_a_damaged_sqlite_database_is_one_line_naming_it(tmp_path):
    """A file that is no SQLite database where MLFLOW_TRACKING_URI points (a download cut short, another tool's file):
    the check passed it, and the step failed in SQLAlchemy's words, with the query it ran."""
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"not a database, but long enough for SQLite to read a header from it" * 20)
    with pytest.raises(TrackingError) as e:
        check_tracking_server(f"sqlite:///{db}")
    said = str(e.value)
    assert f"the MLflow database {db} cannot be opened" in said and "file is not a database" in said, said
    assert "\n" not in said and "SELECT" not in said and "move it away" in said, said
    assert db.read_bytes().startswith(b"not a database")  # left as it was


def test_missing_credentials_are_refused_with_the_variables_to_set(mlflow_auth_server):
    uri, _, _ = mlflow_auth_server
    with pytest.raises(TrackingError) as e:
        check_tracking_server(uri)
    msg = str(e.value)
    assert "401" in msg and "MLFLOW_TRACKING_USERNAME" in msg and "none of them is set" in msg


def test_wrong_password_is_refused_and_never_shown(mlflow_auth_server, monkeypatch):
    uri, user, _ = mlflow_auth_server
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong-password-123")
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=uri))
    with pytest.raises(TrackingError) as e:
        with step_run(cfg, "train"):
            pytest.fail("the step body must not run")
    assert "refused the credentials" in str(e.value)
    assert "wrong-password-123" not in str(e.value)


def test_a_credential_copied_with_its_line_break_is_named_unshown(mlflow_server_uri, mlflow_auth_server, monkeypatch):
    """A secret copied with its newline: MLFLOW_TRACKING_TOKEN's made every request fail in requests' words, read as
    "cannot reach the MLflow tracking server (no answer)" of a server that was up; a password's was refused as a
    wrong one with no word on why. Each is named, never its value."""
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-6630\n")
    with pytest.raises(TrackingError) as e:
        check_tracking_server(mlflow_server_uri)
    assert str(e.value) == ("MLFLOW_TRACKING_TOKEN holds a space, line break or control character (not shown), "
                            "which no request can carry; set it to the token alone")
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN")
    uri, user, password = mlflow_auth_server
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password + "\n")
    with pytest.raises(TrackingError) as e:
        check_tracking_server(uri)
    assert "refused the credentials (HTTP 401)" in str(e.value) and str(e.value).endswith(
        "(now set: MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD; MLFLOW_TRACKING_PASSWORD starts or ends with a "
        "space or line break: set it without)")
    assert password not in str(e.value)


def test_right_credentials_log_a_run(mlflow_auth_server, monkeypatch):
    uri, user, password = mlflow_auth_server
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=uri))
    with step_run(cfg, "train") as run:
        run.log_metrics({"train_loss": 0.5}, step=1)
    run_data = run.client.get_run(run.run_id)
    assert run_data.info.status == "FINISHED"
    assert run_data.data.metrics["train_loss"] == 0.5
    values = list(run_data.data.params.values()) + list(run_data.data.tags.values())
    assert not any(password in v for v in values)
    # The server is checked once per process and credentials: others are checked again, refused before the body.
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "changed-password-456")
    with pytest.raises(TrackingError, match="refused the credentials"), step_run(cfg, "train"):
        pytest.fail("the step body must not run")


def test_an_answer_of_500_is_a_server_away_and_a_refusal_is_not():
    """What MLflow's REST client raises for an answer: a 5xx (the server's database away behind it, a restarting
    pod behind its proxy) is waited for and spooled like no answer; a 4xx refuses the record and is raised."""
    from mlflow.exceptions import RestException

    from rangefinder.tracking.target import server_unreachable

    for code in ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE"):  # HTTP 500, 503
        assert server_unreachable(RestException({"error_code": code, "message": "database is away"})), code
    for code in ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST"):  # HTTP 400, 404
        assert not server_unreachable(RestException({"error_code": code, "message": "refused"})), code


def test_a_deleted_experiment_is_refused_naming_the_restore(sqlite_tracking_uri):
    """Runs made in a deleted experiment are hidden from the UI: a step refuses it before it trains."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=sqlite_tracking_uri)
    client.delete_experiment(client.create_experiment("binned"))
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=sqlite_tracking_uri, experiment_name="binned"))
    with pytest.raises(TrackingError, match="'binned' is deleted; restore it"), step_run(cfg, "train"):
        pytest.fail("the step body must not run")


def _auth_user(uri: str, admin: tuple[str, str]) -> tuple[str, str]:
    """A new user of the basic-auth server at `uri` (its permission: the server's default, READ), made by `admin`."""
    import uuid

    import requests

    user, password = f"user-{uuid.uuid4().hex[:8]}", f"pw-{uuid.uuid4().hex}"
    reply = requests.post(f"{uri}/api/2.0/mlflow/users/create", json={"username": user, "password": password},
                          auth=admin, timeout=10)
    assert reply.status_code == 200, reply.text
    return user, password


def test_a_user_with_read_only_is_told_the_permission_it_needs_before_the_body_runs(mlflow_auth_server, monkeypatch):
    """The check reads (get-experiment-by-name), which READ allows: making the run was refused with MLflow's
    traceback ending in `failed with error code 403 != 200. Response body: 'Permission denied'`."""
    import uuid

    from mlflow import MlflowClient

    uri, admin, admin_password = mlflow_auth_server
    reader, password = _auth_user(uri, (admin, admin_password))
    name = f"read-only-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", admin)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", admin_password)
    MlflowClient(uri).create_experiment(name)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", reader)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=uri, experiment_name=name))
    with pytest.raises(TrackingError) as e, step_run(cfg, "train"):
        pytest.fail("the step body must not run")
    assert str(e.value).startswith(f"the MLflow tracking server at {uri} accepted the credentials but denied access "
                                   "(HTTP 403); the user in MLFLOW_TRACKING_USERNAME needs EDIT permission on the "
                                   "experiment"), str(e.value)
    assert password not in str(e.value) and "\n" not in str(e.value)


def test_relog_by_a_user_the_server_denies_says_the_permission_not_that_it_stopped_answering(
        mlflow_auth_server, monkeypatch, tmp_path, capsys):
    """`rangefinder relog` by a user that may read the run but not write it: its check only reads, and the first
    record's 403, a refusal that waits in a step's spool, was said as a server that "stopped answering again", with
    `relog` to run again once it answers, of a server that answered all along."""
    import uuid

    from mlflow import MlflowClient

    from rangefinder.cli.main import main as cli_main
    from rangefinder.tracking.spool import Spool

    uri, admin, admin_password = mlflow_auth_server
    reader, password = _auth_user(uri, (admin, admin_password))
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", admin)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", admin_password)
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment(f"relog-read-only-{uuid.uuid4().hex[:8]}")).info.run_id
    spool = Spool(tmp_path / "spool" / f"train-{run_id}.jsonl", tracking_uri=uri, run_id=run_id, step="train")
    spool.append({"kind": "params", "run_id": run_id, "params": {"lr": "0.001"}})
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", reader)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    assert cli_main(["relog", str(spool.path)]) != 0
    err = capsys.readouterr().err
    assert "(HTTP 403)" in err and "EDIT permission" in err and "stopped answering" not in err, err
    assert f"rangefinder relog {spool.path}" in err and password not in err, err
    assert spool.path.is_file()


def _log_a_param_and_end(uri: str, experiment: str, run_id: str, spool: Path) -> None:
    """A step's run at `uri` that logs one param and ends, waiting for nothing (server_wait_seconds 0)."""
    from mlflow import MlflowClient

    from rangefinder.tracking import StepRun

    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=uri, server_wait_seconds=0))
    step = StepRun(client=MlflowClient(uri), run_id=run_id, experiment_id=experiment, step_name="train",
                   parent_run_id=None, tracking_uri=uri, cfg=cfg, spool_dir=spool)
    step.log_params({"lr": 0.001})
    step.finish()


def test_a_step_whose_user_the_server_denies_writing_ends_naming_the_credentials_not_an_outage(
        mlflow_auth_server, monkeypatch, tmp_path, caplog):
    """A user the server lets read the run but not write it (its admin took EDIT away while the step ran): the
    check at the step's end only reads, and the records' 403 met sending the spool was said as the server that
    stopped answering, so the last line said to relog when the server answers again, of a server that answered."""
    import logging
    import uuid

    from mlflow import MlflowClient

    uri, admin, admin_password = mlflow_auth_server
    reader, password = _auth_user(uri, (admin, admin_password))
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", admin)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", admin_password)
    admin_client = MlflowClient(uri)
    experiment = admin_client.create_experiment(f"denied-{uuid.uuid4().hex[:8]}")
    run_id = admin_client.create_run(experiment).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", reader)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    caplog.set_level(logging.WARNING)
    _log_a_param_and_end(uri, experiment, run_id, tmp_path / "spool")
    end = [r.getMessage() for r in caplog.records if "did not take everything" in r.getMessage()]
    assert len(end) == 1 and "set to credentials the server takes, run: rangefinder relog" in end[0], end
    assert "when the server answers again" not in end[0], end


def test_credentials_refused_mid_run_are_said_with_the_variables_and_what_was_logged_is_kept(
        mlflow_auth_server, monkeypatch, tmp_path, caplog):
    """The admin changes the step's user's password while it trains: the basic-auth server answers 401, which was
    taken for an outage (`MLflow ... is not answering (no answer)`). It is said as a refusal naming the variables to
    set; the training goes on and what it logs waits in the spool for credentials the server takes, no secret in it."""
    import logging
    import uuid

    import requests

    from rangefinder.tracking import child_run
    from rangefinder.tracking.spool import read_spool

    uri, admin, admin_password = mlflow_auth_server
    user, password = _auth_user(uri, (admin, admin_password))
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    new_password = f"pw-{uuid.uuid4().hex}"
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=uri, experiment_name=f"rotated-{user}",
                                                    server_wait_seconds=0))
    caplog.set_level(logging.WARNING)
    with step_run(cfg, "train", spool_dir=tmp_path / "spool") as run:  # the user made the experiment: may write it
        run.log_params({"before": 1})
        reply = requests.patch(f"{uri}/api/2.0/mlflow/users/update-password", auth=(admin, admin_password),
                               json={"username": user, "password": new_password}, timeout=10)
        assert reply.status_code == 200, reply.text
        # A halving candidate opened now: its run is made, as for a server away, once the credentials are taken.
        with child_run(cfg, run, "train", run_name="candidate", tags={}, description="a candidate") as child:
            child.log_metrics({"val_loss": 0.7}, step=1)
        run.log_params({"after": 2})
        run.log_metrics({"train_loss": 0.5}, step=1)
    said = [r.getMessage() for r in caplog.records]
    refused = [line for line in said if "refused the credentials (HTTP 401)" in line]
    assert len(refused) == 1 and "MLFLOW_TRACKING_PASSWORD" in refused[0] and str(tmp_path / "spool") in refused[0]
    assert not any("not answering" in line for line in said), said
    end = [line for line in said if "did not take everything" in line]
    assert len(end) == 1 and end[0].endswith(
        "with MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) set to credentials the "
        f"server takes, run: rangefinder relog {run.spool.path} {child.spool.path}"), end
    kept = read_spool(run.spool.path)
    assert kept.counts() == {"params": 1, "metrics": 1, "end": 1}, kept.counts()
    assert read_spool(child.spool.path).counts()["create"] == 1
    for text in [*said, *(p.read_text() for p in (tmp_path / "spool").rglob("*") if p.is_file())]:
        assert password not in text and new_password not in text and admin_password not in text


def test_a_tls_server_the_check_cannot_trust_names_the_settings_not_an_outage(mlflow_server_uri, tmp_path, monkeypatch):
    """An ingress's self-signed certificate, a CA bundle path that is no file, an https:// URI of a plain-HTTP port:
    each was "cannot reach the MLflow tracking server", a check that it runs and of its port-forward, an outage
    waited for. Each names what to set, and the certificate trusted by MLFLOW_TRACKING_SERVER_CERT_PATH gets in."""
    from rangefinder.tracking.target import ServerAway
    from tests.tracking.fixtures import relay, self_signed_tls

    context, cert = self_signed_tls(tmp_path)
    with relay(free_port(), mlflow_server_uri, tls=context) as uri:
        with pytest.raises(TrackingError) as e:
            check_tracking_server(uri)
        assert not isinstance(e.value, ServerAway)
        assert str(e.value) == (
            f"the MLflow tracking server at {uri} presented a TLS certificate this machine does not trust (self-signed "
            "certificate); set MLFLOW_TRACKING_SERVER_CERT_PATH to the PEM file of its certificate or of the CA that "
            "signed it (or MLFLOW_TRACKING_INSECURE_TLS=true to skip the check, on a network you trust)")
        monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(tmp_path / "no-such.pem"))
        with pytest.raises(TrackingError, match=r"^MLFLOW_TRACKING_SERVER_CERT_PATH names \S+no-such.pem, which is no "
                           "file here; set it to the PEM file of the certificate of the MLflow tracking server at "):
            check_tracking_server(uri)
        _, other = self_signed_tls(tmp_path / "another")  # a file that exists, of another server's certificate
        monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(other))
        with pytest.raises(TrackingError) as e:
            check_tracking_server(uri)
        assert str(e.value).startswith(f"MLFLOW_TRACKING_SERVER_CERT_PATH names {other}, which does not verify the "
                                       f"TLS certificate the MLflow tracking server at {uri} presented"), e.value
        monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(cert))
        check_tracking_server(uri)
        # Both set, which MLflow refuses before any request: it was "cannot reach the MLflow tracking server".
        monkeypatch.setenv("MLFLOW_TRACKING_INSECURE_TLS", "true")
        with pytest.raises(TrackingError, match="^MLFLOW_TRACKING_INSECURE_TLS and MLFLOW_TRACKING_SERVER_CERT_PATH "
                           "are both set, which MLflow refuses; unset one: "):
            check_tracking_server(uri)
        monkeypatch.delenv("MLFLOW_TRACKING_INSECURE_TLS")
    monkeypatch.delenv("MLFLOW_TRACKING_SERVER_CERT_PATH")
    plain = mlflow_server_uri.replace("http://", "https://")
    with pytest.raises(TrackingError, match=r"does not answer TLS on that port .*: http:// or https://$") as e:
        check_tracking_server(plain)
    assert not isinstance(e.value, ServerAway)


def test_a_ca_bundle_variable_that_names_no_file_is_the_one_named(monkeypatch):
    """requests reads its CA bundle from REQUESTS_CA_BUNDLE (or CURL_CA_BUNDLE) where MLFLOW_TRACKING_SERVER_CERT_PATH
    is unset, and fails alike where it names no file: the check said MLFLOW_TRACKING_SERVER_CERT_PATH named the
    path, a variable that was not set, and left the one to fix unsaid."""
    monkeypatch.delenv("MLFLOW_TRACKING_SERVER_CERT_PATH", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/nonexistent/ca.pem")
    with pytest.raises(TrackingError, match=r"^REQUESTS_CA_BUNDLE names /nonexistent/ca.pem, which is no file here; "
                       r"set it to the PEM file .*, or unset it$"):
        check_tracking_server(f"https://127.0.0.1:{free_port()}")


def test_an_empty_cert_path_beside_insecure_tls_is_the_pair_mlflow_refuses(monkeypatch):
    """MLflow refuses MLFLOW_TRACKING_SERVER_CERT_PATH set at all beside MLFLOW_TRACKING_INSECURE_TLS=true, empty too
    (a manifest's `value: ""`): the check let an empty one through, and said MLflow's refusal as a server that did
    not answer, waited for as an outage."""
    from rangefinder.tracking.target import ServerAway

    monkeypatch.setenv("MLFLOW_TRACKING_INSECURE_TLS", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", "")
    with pytest.raises(TrackingError, match="^MLFLOW_TRACKING_INSECURE_TLS and MLFLOW_TRACKING_SERVER_CERT_PATH are "
                       "both set, which MLflow refuses; unset one: ") as e:
        check_tracking_server(f"https://127.0.0.1:{free_port()}")
    assert not isinstance(e.value, ServerAway)


def test_an_artifact_store_the_step_cannot_write_stops_it_at_its_first_artifact_naming_serve_artifacts(
        mlflow_server_uri, tmp_path):
    """A server started with --no-serve-artifacts hands each client its artifact root to write itself (s3://... with
    no boto3 or credentials, a folder of the server's disk): the step failed at its config.yaml with the store's own
    error as a traceback (`No module named 'boto3'`). An experiment's own artifact location is such a root, here a
    folder under a file, which no process can write."""
    import uuid

    from mlflow import MlflowClient

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    name = f"unwritable-store-{uuid.uuid4().hex[:8]}"
    MlflowClient(mlflow_server_uri).create_experiment(name, artifact_location=str(blocker / "artifacts"))
    cfg = RangefinderConfig(tracking=TrackingConfig(tracking_uri=mlflow_server_uri, experiment_name=name))
    with pytest.raises(TrackingError) as e, step_run(cfg, "train", spool_dir=tmp_path / "spool") as run:
        run.log_config(cfg)
        pytest.fail("the step must stop at its first artifact")
    assert str(e.value).startswith(f"MLflow run {run.run_id} keeps its artifacts in "), str(e.value)
    assert "which this process cannot write (" in str(e.value) and str(e.value).endswith(
        "start the MLflow server with --serve-artifacts (the default: the steps then upload through it to its "
        "--artifacts-destination), or give the steps what that store needs (its client library, e.g. boto3 for "
        "s3://, and its credentials)"), str(e.value)
    ended = run.client.get_run(run.run_id)
    assert ended.info.status == "FAILED" and "--serve-artifacts" in ended.data.tags["rangefinder.error"]


def test_an_image_that_cannot_be_read_is_not_blamed_on_the_artifact_store(mlflow_server_uri, tmp_path):
    """Only what fails writing to the store names it: a record's own picture that cannot be read is its own error."""
    import uuid

    from mlflow import MlflowClient
    from PIL import UnidentifiedImageError

    from rangefinder.tracking.spool import apply_record

    client = MlflowClient(mlflow_server_uri)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    experiment = client.create_experiment(f"unread-{uuid.uuid4().hex[:8]}", artifact_location=str(blocker / "a"))
    run_id = client.create_run(experiment).info.run_id
    (tmp_path / "grid.png").write_bytes(b"not a png")
    with pytest.raises(UnidentifiedImageError):
        apply_record(client, {"kind": "image", "run_id": run_id, "path": str(tmp_path / "grid.png"),
                              "artifact_file": "samples/grid.png"})


def test_a_host_header_refused_mid_run_is_said_as_the_host_not_a_permission(mlflow_server_uri, tmp_path, caplog):
    """A server restarted without --allowed-hosts while a step runs answers its calls 403, `Invalid Host header`: the
    step said the user needed EDIT permission and, at its end, to relog with other credentials. Its records wait as
    for a refusal, said as the Host header and the option that lets it in."""
    import logging
    import uuid

    from mlflow import MlflowClient

    host_uri = f"http://localhost:{mlflow_server_uri.rsplit(':', 1)[1]}"  # a name the fixture's server does not allow
    client = MlflowClient(mlflow_server_uri)
    experiment = client.create_experiment(f"host-{uuid.uuid4().hex[:8]}")
    run_id = client.create_run(experiment).info.run_id
    caplog.set_level(logging.WARNING)
    _log_a_param_and_end(host_uri, experiment, run_id, tmp_path / "spool")
    said = [r.getMessage() for r in caplog.records]
    (refused,) = [line for line in said if "Host header" in line and "goes on" in line]
    (end,) = [line for line in said if "did not take everything" in line]
    for line in (refused, end):
        assert "--allowed-hosts" in line and "permission" not in line and "credentials" not in line, line


def test_a_store_file_this_process_cannot_write_for_now_is_waited_out_and_a_refused_value_is_not():
    """MLflow raises every query SQLite cannot run as TEMPORARILY_UNAVAILABLE. A full or failing disk, a database made
    read-only or moved while the step ran is mended by its user, and the records kept are sent then: failing the step
    mid-training over one record would lose what it trained. A value the store refuses is no outage: no wait gets it
    in (the driver's words tell them apart)."""
    import sqlite3

    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    from rangefinder.tracking.target import store_unavailable

    def raised(words: str) -> MlflowException:
        try:
            try:
                raise sqlite3.OperationalError(words)
            except sqlite3.OperationalError as cause:
                raise MlflowException(str(cause), error_code=TEMPORARILY_UNAVAILABLE) from cause  # as MLflow's session
        except MlflowException as e:
            return e

    for words in ("database is locked", "database or disk is full", "disk I/O error",
                  "attempt to write a readonly database", "unable to open database file"):
        assert store_unavailable(raised(words)), words
    assert not store_unavailable(raised("malformed JSON"))
