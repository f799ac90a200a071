"""Real MLflow tracking targets for tests: a `mlflow server` on loopback, one with basic auth, and a local sqlite store.

tests/tracking/conftest.py loads these. Other test folders can use them with `pytest_plugins =
["tests.tracking.fixtures"]` in tests/conftest.py, or `from tests.tracking.fixtures import *` in their conftest.py
(session fixtures are then started once per session either way):

- `mlflow_server_uri` (session): `http://127.0.0.1:PORT` of a real `mlflow server` (sqlite backend, local artifact
  root, proxied artifacts), started once per session with `--allowed-hosts 127.0.0.1:PORT`. Every server here is
  `mlflow server`'s own command run in a fork of the test process (`ForkedMlflowCli`), which starts its uvicorn
  server as a fresh interpreter as ever.
- `mlflow_auth_server` (session): a server started with `--app-name basic-auth`; yields (uri, username, password).
  MLflow's basic auth needs Flask-WTF: the `dev` extra installs `mlflow[auth]`.
- `sqlite_tracking_uri`: `sqlite:///<tmp_path>/.../mlflow.db`, the local default, fresh per test;
  `shared_sqlite_tracking_uri` (session): one such store for many tests (give each its own experiment).
- `clean_mlflow_env`: no MLFLOW_* variables leak from the caller's shell into a test, a down server fails in seconds,
  and the global tracking URI is restored afterwards (autouse in tests/tracking only).
- `relay(port, uri)`: a server that comes back where nothing answered (a loopback relay to a running one); with
  `tls=` (a context from `self_signed_tls(folder)`), the server behind an ingress that ends TLS with its own
  certificate.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

_MLFLOW_VARS = (
    "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID",
    "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "KFP_RUN_ID", "KFP_RUN_NAME",
    "MLFLOW_WORKSPACE",
)
SERVER_START_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def relay(port: int, target: str, tls: Optional[ssl.SSLContext] = None) -> Iterator[str]:
    """A TCP relay from 127.0.0.1:`port` to the server at `target` (`http://host:port`) until the block ends: a
    server that comes back, on a port where nothing answered before, without starting one (seconds each). Yields the
    relay's URI. As a reverse proxy does, it gives the server its own Host header (a server here allows only its
    own address: `--allowed-hosts`). `tls`: the relay ends TLS with this context, as an ingress in front of MLflow
    does (`https://` then; self_signed_tls makes one)."""
    from urllib.parse import urlparse

    up = urlparse(target)
    listener = socket.create_server(("127.0.0.1", port))
    sockets: list[socket.socket] = [listener]
    host_here, host_there = f"Host: 127.0.0.1:{port}\r\n".encode(), f"Host: {up.netloc}\r\n".encode()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data.replace(host_here, host_there))
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        while True:
            try:
                near, _ = listener.accept()
            except OSError:
                return  # the listener closed: the block ended
            if tls is not None:
                try:
                    near = tls.wrap_socket(near, server_side=True)
                except (ssl.SSLError, OSError):
                    near.close()  # the client would not take the certificate: the next one may
                    continue
            try:
                far = socket.create_connection((up.hostname, up.port), timeout=10)
            except OSError:
                return
            far.settimeout(None)
            for end in (near, far):  # each piece on at once: Nagle's wait on a relayed request is 40 ms a call
                end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sockets.extend((near, far))
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def self_signed_tls(folder: Path) -> tuple[ssl.SSLContext, Path]:
    """A server-side TLS context with a fresh self-signed certificate for 127.0.0.1 (an EC key: milliseconds), and
    the certificate's PEM file, which a client trusts it by (MLFLOW_TRACKING_SERVER_CERT_PATH)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = folder / "server-cert.pem", folder / "server-key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    return context, cert_file


def _mlflow_cli() -> str:
    return str(Path(sys.executable).with_name("mlflow"))


class ForkedMlflowCli:
    """`mlflow ARGS` (the `mlflow` console script's own click command, `mlflow.cli.cli`) in a fork of this process,
    in a session of its own, its output to `log`: the part of subprocess.Popen the tests use (pid, poll, wait,
    returncode). The command starts its uvicorn server as a fresh interpreter, as `mlflow server` always does; only
    the CLI's own start is a fork, where mlflow is already imported (a fresh `mlflow` process spent ~4 CPU-s on its
    imports before it started that server, on every server start of the suite)."""

    def __init__(self, args: list[str], *, cwd: Path, env: dict, log: Path) -> None:
        import mlflow.cli  # before the fork: imported once per test process

        from tests.mlflow_store import close_sqlite_connections

        self.args, self.returncode = args, None
        log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        # The child's `mlflow server` opens its store through MLflow's engine for that URI, cached in this process: a
        # connection this process had open on it would be one whose descriptor the child closes below.
        close_sqlite_connections()
        pid = os.fork()
        if pid == 0:  # the child: what a fresh `mlflow` process started with start_new_session would have
            code = 1
            try:
                os.setsid()
                os.dup2(log_fd, 1)
                os.dup2(log_fd, 2)
                os.close(log_fd)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                # Nothing else of this process's: xdist's channel to its controller, other servers' sockets (a
                # Popen closes them too).
                os.closerange(3, os.sysconf("SC_OPEN_MAX"))
                sys.stdout = open(1, "w", buffering=1, closefd=False)
                sys.stderr = open(2, "w", buffering=1, closefd=False)
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_DFL)
                os.chdir(cwd)
                os.environ.clear()
                os.environ.update(env)
                mlflow.cli.cli.main(args=args, prog_name="mlflow", standalone_mode=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(log_fd)
        self.pid = pid

    def _reap(self, flags: int) -> Optional[int]:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, flags)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> Optional[int]:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["mlflow", *self.args], timeout or 0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode


def start_mlflow_server(workdir: Path, *, app_name: str | None = None, env: dict | None = None,
                        allowed_hosts: str | None = None, port: int | None = None,
                        extra_args: tuple[str, ...] = ()) -> tuple[str, ForkedMlflowCli]:
    """Start `mlflow server` on 127.0.0.1 and `port` (default: a free one); return (uri, process) once /health
    answers. A server restarted on its store and port is the same server to its clients."""
    from tests.mlflow_store import seed

    workdir.mkdir(parents=True, exist_ok=True)
    seed(workdir / "mlflow.db")  # the migrated, empty store: the server skips MLflow's migrations (about 10 s)
    port = port or free_port()
    cmd = [
        _mlflow_cli(), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
        "--artifacts-destination", str(workdir / "mlartifacts"),
        "--allowed-hosts", allowed_hosts or f"127.0.0.1:{port},127.0.0.1",
    ]
    if app_name:
        cmd += ["--app-name", app_name]
    cmd += list(extra_args)
    server_env = {k: v for k, v in os.environ.items() if k not in _MLFLOW_VARS}
    server_env.update(env or {})
    server_env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    server_env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")  # a third process we do not need
    # Own session, so teardown can stop the server and its uvicorn worker together.
    proc = ForkedMlflowCli(cmd[1:], cwd=workdir, env=server_env, log=workdir / "server.log")
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}: "
                               f"{(workdir / 'server.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                if r.status == 200:
                    return uri, proc
        except OSError:
            pass
        time.sleep(0.3)
    stop_mlflow_server(proc)
    raise RuntimeError(f"mlflow server did not answer on {uri} within {SERVER_START_TIMEOUT_S}s")


def stop_mlflow_server(proc: subprocess.Popen | ForkedMlflowCli) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture(scope="session")
def mlflow_server_uri(tmp_path_factory):
    uri, proc = start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"))
    yield uri
    stop_mlflow_server(proc)


@pytest.fixture(scope="session")
def mlflow_auth_server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mlflow-auth-server")
    username, password = "admin", "rf-Admin-pass-7431"
    ini = workdir / "basic_auth.ini"
    ini.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{workdir / 'basic_auth.db'}\n"
        f"admin_username = {username}\nadmin_password = {password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        # Without the cache every request re-runs PBKDF2, seconds each on a loaded 2-core machine.
        "auth_cache_ttl_seconds = 300\n"
    )
    env = {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": "rangefinder-tests"}
    uri, proc = start_mlflow_server(workdir, app_name="basic-auth", env=env)
    yield uri, username, password
    stop_mlflow_server(proc)


@pytest.fixture
def sqlite_tracking_uri(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlruns-local' / 'mlflow.db'}"


@pytest.fixture(scope="session")
def shared_sqlite_tracking_uri(tmp_path_factory) -> str:
    """One local store for the session: creating a sqlite store runs all of MLflow's migrations (seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow-sqlite') / 'mlflow.db'}"


@contextlib.contextmanager
def sqlite_busy_timeout(ms: int):
    """MLflow's SQLite store waits 20 s for a locked database (the PRAGMA busy_timeout it sets in each session); here
    `ms`, set after it on the same connection, so that a test meets the lock in a moment."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    def shorter(conn, cursor, statement, *_):
        if statement.lstrip().upper().startswith("PRAGMA BUSY_TIMEOUT"):
            cursor.execute(f"PRAGMA busy_timeout = {int(ms)}")

    event.listen(Engine, "after_cursor_execute", shorter)
    try:
        yield
    finally:
        event.remove(Engine, "after_cursor_execute", shorter)


@contextlib.contextmanager
def without_mlflow_run_env():
    """The MLflow run the environment may name (a tracking URI, a run id, an experiment) hidden from the block and
    put back after it: for module-scoped fixtures, which cannot use monkeypatch, running a step that must log to the
    store its config names."""
    names = ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME")
    saved = {v: os.environ.pop(v, None) for v in names}
    try:
        yield
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})


@pytest.fixture
def clean_mlflow_env(monkeypatch):
    import mlflow

    for var in _MLFLOW_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    # A down server must fail in seconds, not after mlflow's default minutes of back-off.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    yield
    if mlflow.active_run():
        mlflow.end_run()
    mlflow.set_tracking_uri(previous)


def check_logged_files_name_no_local_path(client, run_id: str, machine_dir: Path, folders: tuple[str, ...]) -> str:
    """The text files a step logged under `folders` of its MLflow run, read as someone on another machine downloads
    them: none names a path under `machine_dir` (the folder the step ran in), and each curve one names as
    `curves/<file> in this step's MLflow run` is in the run. Returns their text, joined."""
    import html
    import re
    import tempfile

    logged = {a.path for a in client.list_artifacts(run_id, "curves")}
    texts = []
    with tempfile.TemporaryDirectory() as tmp:
        for folder in folders:
            local = Path(client.download_artifacts(run_id, folder, tmp))
            files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
            texts += [html.unescape(p.read_text()) for p in files if p.suffix in (".html", ".md", ".json")]
    text = "\n".join(texts)
    assert texts and str(machine_dir) not in text, [t for t in texts if str(machine_dir) in t][0][:2000]
    named = set(re.findall(r"(curves/[\w.-]+) in this step's MLflow run", text))
    assert named and named <= logged, (named, logged)
    return text
