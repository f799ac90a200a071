"""Where runs go (tracking URI, experiment) and the fail-fast check that the server is there and takes our credentials.

A training step that only finds out at its end that MLflow is unreachable loses an hour of GPU time and the record
of it, so every run-opening call checks first, with a short timeout and no long retry loop. Later calls get bounded
timeouts too (`bound_http_requests`): a server that dies mid-run costs a step seconds per call, not minutes.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union
from urllib.parse import unquote, urlsplit

from rangefinder.config import expand_home, experiment_name_problem
from rangefinder.errors import TrackingError
from rangefinder.formats.text import is_header_token
from rangefinder.tracking.redaction import CREDENTIALS_FIX, safe_uri, uri_credentials

if TYPE_CHECKING:
    from rangefinder.config import RangefinderConfig, TrackingConfig

# What the tracking calls take as `cfg`: the whole config, or only its tracking section (None: the defaults).
TrackingSource = Union["RangefinderConfig", "TrackingConfig"]

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # in the working folder, as `mlflow ui` / `mlflow server` expect
CHECK_TIMEOUT_S = 5.0  # per request; a healthy server answers the check in milliseconds
CHECK_RETRIES = 2  # a restarting server or a blip gets two more chances (0.5 s, 1 s apart), then we stop
CHECK_BACKOFF_FACTOR = 0.5  # urllib3's: no wait before the first retry, 2 x this before the second
_CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
_checked: set[tuple[str, str]] = set()
TAG_NOTE = "mlflow.note.content"  # a run's or an experiment's description in MLflow's UI (Markdown)
# The description of an experiment rangefinder creates (one it finds keeps its own, or none).
EXPERIMENT_DESCRIPTION = (
    "Stable Diffusion fine-tunes by rangefinder: one parent run per pipeline run, named after its KFP run, with a "
    "child run per step (LR range test, fine-tune, retrain, sample grid, registration) holding its curves, decisions "
    "and reports. Each parent run's description says which weights it delivered and which registered model version "
    "holds them."
)


class ServerAway(TrackingError):
    """The tracking server did not answer the check (down, unreachable, timed out): worth waiting for, unlike an
    answer that refuses us (credentials, Host header, not an MLflow server). `reason`: a few words, e.g.
    "connection refused"."""

    def __init__(self, message: str, reason: str = "no answer") -> None:
        super().__init__(message)
        self.reason = reason


class CredentialsRefused(TrackingError):
    """The tracking server answered, refusing our credentials (HTTP 401) or their user (403): no outage, and nothing
    waiting for the server fixes it; the credentials do."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class HostRefused(CredentialsRefused):
    """The tracking server answered 403 to the Host header the request named (MLflow 3's --allowed-hosts check,
    `Invalid Host header`), not to the credentials: nothing waiting for it fixes it either; the server's options do
    (or a name it allows)."""


# What every MLflow HTTP call of a step may cost, unless the user's environment says otherwise. MLflow's defaults
# (120 s timeout, 7 retries with backoff factor 2) keep one call retrying ~4 minutes against a dead server, and
# the training loop logs every few updates. 20 s still covers a busy server answering a metadata call (it takes
# milliseconds when healthy); 2 retries at 1 s, 2 s ride out a blip or a restarting pod. A dead server then costs a
# call ~5 s (connection refused) and at most ~65 s (no answer at all). A very large artifact upload through a slow
# artifact store may need MLFLOW_HTTP_REQUEST_TIMEOUT raised, which is respected.
HTTP_LIMITS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
}


def bound_http_requests() -> None:
    """Give this process's MLflow HTTP calls the bounded timeout and retries of HTTP_LIMITS, keeping any of those
    variables the user has set. MLflow reads them at every call, so this works whenever it runs."""
    for name, value in HTTP_LIMITS.items():
        os.environ.setdefault(name, value)


def no_artifact_bars_off_a_terminal() -> None:
    """MLflow's artifact progress bars off where stderr is no terminal (a CI job's log, a pod's), unless the user set
    MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR: MLflow draws them with tqdm, on by default, and logging a model copies its
    files through the download path, so `rangefinder register` wrote a `Downloading artifacts: 8%|...` bar of
    carriage returns into the log of every job that registered. MLflow reads the variable at every call."""
    if sys.stderr is None or not sys.stderr.isatty():
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


def tracking_settings(cfg: Optional[TrackingSource] = None) -> TrackingConfig:
    """The TrackingConfig inside `cfg` (a RangefinderConfig, a TrackingConfig, or None for the defaults)."""
    from rangefinder.config import TrackingConfig

    if cfg is None:
        return TrackingConfig()
    if isinstance(cfg, TrackingConfig):
        return cfg
    tracking = getattr(cfg, "tracking", None)
    if isinstance(tracking, TrackingConfig):
        return tracking
    raise TypeError(f"expected a RangefinderConfig or TrackingConfig, got {type(cfg).__name__}")


def resolve_tracking_uri(cfg: Optional[TrackingSource] = None) -> str:
    """tracking.tracking_uri, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working folder.

    A relative sqlite path is made absolute here, so that the steps a local run starts in other folders (kfp.local
    subprocesses) write to the same database. A URI with credentials in it is refused (TrackingError).
    """
    setting = tracking_settings(cfg).tracking_uri
    uri = (setting or env_tracking_uri() or DEFAULT_TRACKING_URI).strip()
    db = sqlite_path(uri, "tracking.tracking_uri" if setting else "$MLFLOW_TRACKING_URI")
    if db is not None and not uri.startswith("sqlite:////"):
        query = uri.split("?", 1)[1] if "?" in uri else ""
        uri = sqlite_uri(db, "the folder of the MLflow database", "tracking.tracking_uri" if setting else
                         "MLFLOW_TRACKING_URI") + (f"?{query}" if query else "")
    return uri


def sqlite_uri(db: Path, where: str, instead: str = "MLFLOW_TRACKING_URI") -> str:
    """The sqlite:/// URI of the database file `db` (made absolute); TrackingError naming `where` (what the folder
    is), and `instead` (the setting that would put the store elsewhere: a relative tracking.tracking_uri wins over
    the variable), when no URI names it: SQLAlchemy decodes a `%` before two hex digits (`run %20x` opened `run  x`)
    and reads a `?` as the URI's query, so the store was written in another folder than the one named, where the
    run's `mlflow ui` line did not look; escaped, they reach SQLAlchemy whole, but MLflow makes the escaped text's
    folder beside it (mlflow.store.db.utils._make_parent_dirs_if_sqlite, 3.17)."""
    path = str(Path(db).absolute())
    bad = re.search(r"%[0-9A-Fa-f]{2}|\?", path)
    if bad:
        what = "a URI's query" if bad.group() == "?" else f"an escape of {unquote(bad.group())!r}"
        raise TrackingError(f"{where} {Path(path).parent} holds {bad.group()!r}, which MLflow's sqlite:/// URI reads "
                            f"as {what}, so the store would be written in another folder; rename the folder, or set "
                            f"{instead} to a store elsewhere")
    return "sqlite:///" + path


def env_tracking_uri() -> Optional[str]:
    """$MLFLOW_TRACKING_URI, or None; TrackingError when it carries credentials."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or None
    if uri:
        refuse_uri_credentials(uri, "MLFLOW_TRACKING_URI")
    return uri


def refuse_uri_credentials(uri: str, where: str) -> None:
    """TrackingError when `uri` (given as `where`) carries credentials: they belong in their own variables, which
    MLflow reads and nothing here prints."""
    held = uri_credentials(uri)
    if held:
        raise TrackingError(f"{where} ({safe_uri(uri)}) holds {held}; remove it from the URI and {CREDENTIALS_FIX}")


def resolve_experiment_name(cfg: Optional[TrackingSource] = None) -> str:
    """$MLFLOW_EXPERIMENT_NAME wins (KFP's MLflow plugin and users set it), else tracking.experiment_name;
    TrackingError where MLflow would refuse the variable's name, as the config refuses the setting's: a step ended in
    MLflow's traceback."""
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return tracking_settings(cfg).experiment_name
    problem = experiment_name_problem(name)
    if problem:
        raise TrackingError(f"MLFLOW_EXPERIMENT_NAME {problem}, or unset it for tracking.experiment_name")
    return name


def _credential_hint() -> str:
    set_vars = [v for v in _CREDENTIAL_VARS if os.environ.get(v)]
    now = f"now set: {', '.join(set_vars)}" if set_vars else "none of them is set now"
    # A secret copied with its line break (`kubectl get secret ... | base64 -d` into a CI variable) is refused like a
    # wrong one; say which, never the value.
    padded = [v for v in set_vars if os.environ[v] != os.environ[v].strip()]
    if padded:
        now += f"; {', '.join(padded)} starts or ends with a space or line break: set it without"
    return (
        "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (basic auth) or MLFLOW_TRACKING_TOKEN (bearer) "
        f"to credentials the server accepts ({now})"
    )


def _check_token_variable() -> None:
    """TrackingError where MLFLOW_TRACKING_TOKEN cannot go in a header: a line break or space in it (a secret copied
    with its newline) made every request fail in requests' own words, which the check read as "cannot reach the
    MLflow tracking server (no answer)"."""
    token = os.environ.get("MLFLOW_TRACKING_TOKEN") or ""
    if not is_header_token(token):
        raise TrackingError("MLFLOW_TRACKING_TOKEN holds a space, line break or control character (not shown), which "
                            "no request can carry; set it to the token alone")


def _check_tls_variables() -> None:
    """TrackingError where MLFLOW_TRACKING_INSECURE_TLS and MLFLOW_TRACKING_SERVER_CERT_PATH are both set, which
    MLflow refuses before any request (mlflow.utils.rest_utils.http_request): it was said as "cannot reach the MLflow
    tracking server (no answer)" of a server that was up, and waited for as an outage."""
    from mlflow.environment_variables import MLFLOW_TRACKING_INSECURE_TLS, MLFLOW_TRACKING_SERVER_CERT_PATH

    with contextlib.suppress(ValueError):  # not a boolean: MLflow's own calls say so
        # Set at all, empty too (a manifest's `value: ""`): MLflow's test is `is not None`.
        if MLFLOW_TRACKING_INSECURE_TLS.get() and MLFLOW_TRACKING_SERVER_CERT_PATH.get() is not None:
            raise TrackingError("MLFLOW_TRACKING_INSECURE_TLS and MLFLOW_TRACKING_SERVER_CERT_PATH are both set, which "
                                "MLflow refuses; unset one: MLFLOW_TRACKING_SERVER_CERT_PATH trusts the server's "
                                "certificate, MLFLOW_TRACKING_INSECURE_TLS skips the check")


def check_tracking_server(uri: str, *, experiment_name: str = "Default", timeout: float = CHECK_TIMEOUT_S) -> None:
    """Raise TrackingError unless `uri` can be written to: the server answers and accepts our credentials.

    For http(s) this makes one cheap authenticated REST call (get-experiment-by-name) with mlflow's own request
    helper, so the credentials, TLS and auth-plugin settings are exactly those later logging uses. For sqlite it
    makes sure the database's folder exists. For a SQL server it makes sure its driver is installed. Other stores
    (file, databricks) and reaching a SQL server are left to mlflow.
    """
    scheme = urlsplit(uri).scheme.lower()
    if scheme in ("http", "https"):
        _check_http(uri, experiment_name, timeout)
    elif scheme == "sqlite":
        _check_sqlite(uri)
    elif scheme.split("+")[0] in SQL_SERVERS:
        _check_sql_driver(uri)


def await_tracking_server(uri: str, seconds: float) -> None:
    """check_tracking_server every few seconds until the server answers, for up to `seconds` (one check at least);
    raises the last ServerAway when it never did. Any other TrackingError (credentials, ...) is raised at once."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            check_tracking_server(uri, timeout=max(1.0, min(CHECK_TIMEOUT_S, deadline - time.monotonic())))
            return
        except ServerAway:
            if time.monotonic() >= deadline:
                raise
        time.sleep(max(0.0, min(2.0, deadline - time.monotonic())))


def ensure_tracking_server(uri: str, *, experiment_name: str = "Default") -> None:
    """check_tracking_server once per process and (uri, credentials); steps call it through the run-opening calls."""
    key = (uri, "|".join(os.environ.get(v, "") for v in _CREDENTIAL_VARS))
    if key in _checked:
        return
    check_tracking_server(uri, experiment_name=experiment_name)
    _checked.add(key)


# The SQL servers MLflow keeps runs in directly (mlflow.store.db.db_types), each through a driver of its own.
SQL_SERVERS = ("postgresql", "mysql", "mssql")


def _check_sql_driver(uri: str) -> None:
    """TrackingError when the Python driver a SQL server's URI needs is not installed: the step said only
    "ModuleNotFoundError: No module named 'psycopg'". SQLAlchemy imports it when the engine is made, before any
    connection."""
    import sqlalchemy

    try:
        sqlalchemy.create_engine(uri)
    except ModuleNotFoundError as e:
        raise TrackingError(
            f"the tracking URI {safe_uri(uri)} needs the Python database driver {e.name}, which is not installed "
            "here; install it where the steps run (this environment, the step image), or point "
            "MLFLOW_TRACKING_URI (or tracking.tracking_uri) at an MLflow server (http://...)"
        ) from None
    except Exception:  # a URI SQLAlchemy cannot read: mlflow says what is wrong with it
        return


def _check_sqlite(uri: str) -> None:
    db = sqlite_path(uri)  # sqlite:///relative.db, sqlite:////absolute.db; in-memory databases need nothing
    if db is None:
        return
    folder = db.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrackingError(
            f"cannot create the folder {folder} of the MLflow database {safe_uri(uri)} ({e.strerror}); "
            "set MLFLOW_TRACKING_URI or tracking.tracking_uri to a writable location"
        ) from None
    if not os.access(folder, os.W_OK):
        raise TrackingError(
            f"the folder {folder} of the MLflow database {safe_uri(uri)} is not writable; "
            "set MLFLOW_TRACKING_URI or tracking.tracking_uri to a writable location"
        )
    _open_sqlite_store(uri, folder)


def _open_sqlite_store(uri: str, folder: Path) -> None:
    """Open this process's MLflow store of `uri` while holding an exclusive flock on the database's folder, so that
    one process at a time runs MLflow's schema migrations on a new file and the others find its tables made. Two
    runs started at once on one new database (two terminals with the same MLFLOW_TRACKING_URI) each migrated it: both
    steps failed ("table _alembic_tmp_experiments already exists", "Online migration expected to match one row"),
    and the file was left half-migrated, refusing every later run. The folder is locked, not a file in it: SQLite's
    own locks on the database are POSIX locks, which closing any descriptor of the file would drop, and no lock file
    is left beside the user's database. MLflow keeps the store it opened for the process (its registry's cache), so
    later calls reuse it. Where the folder cannot be flocked (some network file systems), it opens unlocked, as
    before."""
    import fcntl

    from mlflow import MlflowClient

    fd: Optional[int] = None
    try:
        with contextlib.suppress(OSError):
            fd = os.open(folder, os.O_RDONLY)
            # Another's migration takes seconds; SIGINT still ends the wait (the descriptor closed below, not left).
            fcntl.flock(fd, fcntl.LOCK_EX)
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as e:  # SQLAlchemy's and MLflow's errors, each with the query or the schema versions it met
        raise TrackingError(_unopenable(uri, e)) from None
    finally:
        if fd is not None:
            os.close(fd)  # drops the flock


def _unopenable(uri: str, e: BaseException) -> str:
    """Why the SQLite database of `uri` cannot be opened, in one line: the driver's own words (SQLAlchemy wraps them
    with the query it ran; MLflow, for a schema older than its own, says how to upgrade it), and the fix. A damaged
    file (a copy cut short, another tool's file) passed the check, and the step failed in SQLAlchemy's words, over
    several lines."""
    why = _driver_words(e)
    fix = ("wait for the process holding it (a sqlite3 shell, `mlflow gc`) to finish, then run again"
           if "locked" in why else "move it away (a new one is made in its place), or point MLFLOW_TRACKING_URI (or "
           "tracking.tracking_uri) at another database")
    return f"the MLflow database {sqlite_path(uri)} cannot be opened: {why}; {fix}"


def _driver_words(e: BaseException) -> str:
    """The first line of the innermost cause of `e`: a SQL driver's own words ("database is locked", "disk I/O error"),
    without the query SQLAlchemy and MLflow wrap them in; its type's name where it says none."""
    while e.__cause__ is not None:
        e = e.__cause__
    return (str(e).splitlines() or [type(e).__name__])[0]


def _check_retries() -> tuple[int, float]:
    """The check's retries and backoff factor: CHECK_RETRIES and CHECK_BACKOFF_FACTOR, or fewer and shorter where the
    user's MLFLOW_HTTP_REQUEST_MAX_RETRIES or MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR (HTTP_LIMITS) ask for less: someone
    who set MLflow's calls to fail at once (0 retries) waited the check's ~1 s of backoff at every step all the same.
    Larger values keep the check's own: it is the fail-fast call."""
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR, MLFLOW_HTTP_REQUEST_MAX_RETRIES

    retries, backoff = CHECK_RETRIES, CHECK_BACKOFF_FACTOR
    with contextlib.suppress(ValueError):  # not a number: MLflow's own calls say so; the check keeps its values
        if MLFLOW_HTTP_REQUEST_MAX_RETRIES.defined:
            retries = max(0, min(retries, int(MLFLOW_HTTP_REQUEST_MAX_RETRIES.get())))
    with contextlib.suppress(ValueError):
        if MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.defined:
            backoff = max(0.0, min(backoff, float(MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.get())))
    return retries, backoff


def _check_http(uri: str, experiment_name: str, timeout: float) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    where = safe_uri(uri)
    _check_token_variable()
    _check_tls_variables()
    retries, backoff = _check_retries()
    try:
        resp = http_request(
            get_default_host_creds(uri),
            "/api/2.0/mlflow/experiments/get-by-name",
            "GET",
            params={"experiment_name": experiment_name},
            max_retries=retries,
            backoff_factor=backoff,
            backoff_jitter=0.0,
            timeout=timeout,
            raise_on_status=False,
        )
    except MlflowException as e:
        tls = _tls_problem(uri, str(e))
        if tls is not None:  # an answer we will not take, not an outage: waiting for it would not help
            raise TrackingError(tls) from None
        reason = _connection_reason(str(e))
        raise ServerAway(
            f"cannot reach the MLflow tracking server at {where} ({reason}); check MLFLOW_TRACKING_URI "
            "(or tracking.tracking_uri), that the server is running, and any port-forward to it "
            "(e.g. kubectl -n rangefinder port-forward svc/mlflow 5000)", reason
        ) from None

    status = resp.status_code
    body = resp.text[:500] if resp.text else ""
    if status in (200, 404) and _is_mlflow_json(resp):
        return  # 404 RESOURCE_DOES_NOT_EXIST: the experiment is new, which is fine; we were let in
    if status == 403 and "host" in body.lower():
        raise HostRefused(_host_message(uri), status)
    if status in (401, 403):
        raise CredentialsRefused(refusal_message(uri, status), status)
    raise TrackingError(
        f"{where} did not answer like an MLflow tracking server (HTTP {status}); check MLFLOW_TRACKING_URI "
        "(scheme, host, port and path prefix) and the server's log"
    )


# Where a CA bundle path comes from, MLflow's variable first (rest_utils' verify=), then those requests reads itself.
_CA_BUNDLE_VARS = ("MLFLOW_TRACKING_SERVER_CERT_PATH", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


def _tls_problem(uri: str, message: str) -> Optional[str]:
    """What to fix where the TLS handshake with the server at `uri` failed (`message`: MLflow's error, which wraps
    urllib3's), or None for another failure. Each was said as "cannot reach the MLflow tracking server", with a check
    that it runs and of its port-forward, and waited for as an outage: a self-signed certificate, a CA bundle path
    that does not exist, an https:// URI of a server that speaks plain HTTP."""
    where = safe_uri(uri)
    if "certificate verify failed" in message.lower():
        why = re.search(r"certificate verify failed: ([^(')]+)", message, re.IGNORECASE)
        detail = f" ({why.group(1).strip()})" if why else ""
        # MLflow's own bundle was given, and holds neither the server's certificate nor its CA: told to set the
        # variable that was already set, the user looked for a typo in its name. (REQUESTS_CA_BUNDLE is often the
        # system's bundle, set by the image: the line below is the one for it.)
        given = _CA_BUNDLE_VARS[0]
        if os.environ.get(given):
            return (f"{given} names {os.environ[given]}, which does not verify the TLS certificate the MLflow tracking "
                    f"server at {where} presented{detail}; set it to the PEM file of that server's certificate or of "
                    "the CA that signed it")
        return (f"the MLflow tracking server at {where} presented a TLS certificate this machine does not "
                f"trust{detail}; set MLFLOW_TRACKING_SERVER_CERT_PATH to the PEM file of its certificate or of the CA "
                "that signed it (or MLFLOW_TRACKING_INSECURE_TLS=true to skip the check, on a network you trust)")
    bundle = re.search(r"Could not find a suitable TLS CA certificate bundle, invalid path: (.+)$", message)
    if bundle:
        # requests takes its bundle from REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE where MLflow's own variable is unset.
        path = bundle.group(1).strip()
        named = next((v for v in _CA_BUNDLE_VARS if os.environ.get(v) == path), _CA_BUNDLE_VARS[0])
        return (f"{named} names {path}, which is no file here; set it to the PEM file of the certificate of the "
                f"MLflow tracking server at {where} or of its CA" + ("" if named == _CA_BUNDLE_VARS[0] else
                                                                     ", or unset it"))
    if "wrong_version_number" in message.lower() or "wrong version number" in message.lower():
        return (f"the MLflow tracking server at {where} does not answer TLS on that port (it serves plain HTTP "
                "there?); check the scheme of MLFLOW_TRACKING_URI (or tracking.tracking_uri): http:// or https://")
    return None


def _host_message(uri: str) -> str:
    return (f"the MLflow tracking server at {safe_uri(uri)} rejected the request's Host header (HTTP 403); start it "
            f"with --allowed-hosts including '{urlsplit(uri).netloc.rsplit('@', 1)[-1]}' (or reach it by an allowed "
            "name)")


def host_refused(e: BaseException) -> bool:
    """Whether `e` is the server's 403 to the request's Host header (HostRefused, or MLflow's own `Invalid Host
    header` answer to a call: mlflow/server/security_utils.py INVALID_HOST_MSG), not to the credentials."""
    return isinstance(e, HostRefused) or (answer_status(e) == 403 and "invalid host header" in str(e).lower())


def refusal_message(uri: str, status: int, host: bool = False) -> str:
    """What to fix where the server at `uri` refused us: HTTP 401 (no credentials, or ones it no longer takes: a
    password changed while a step ran) or 403 (a user without permission: READ on the experiment may not make a run;
    or, with `host` (host_refused), a Host header it does not allow: a server restarted without --allowed-hosts
    mid-run was said to deny the user EDIT permission)."""
    where = safe_uri(uri)
    if host:
        return _host_message(uri)
    if status == 401:
        return f"the MLflow tracking server at {where} refused the credentials (HTTP 401); " + _credential_hint()
    return (f"the MLflow tracking server at {where} accepted the credentials but denied access (HTTP 403); the user "
            "in MLFLOW_TRACKING_USERNAME needs EDIT permission on the experiment: ask the server's admin, or "
            + _credential_hint())


def answer_status(e: BaseException) -> Optional[int]:
    """The HTTP status of the answer an MLflow call got, or None where it got none (down, unreachable, timed out).
    An answer that is not MLflow's JSON (basic auth's `Permission denied`, a proxy's HTML page) comes as a plain
    MlflowException of rest_utils.verify_rest_response's wording, whose status only its message carries."""
    import requests  # type: ignore[import-untyped]  # no stubs in the pinned set
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(e, RestException):
        return int(e.get_http_status_code())
    if isinstance(e, requests.exceptions.HTTPError):  # artifact uploads raise the response's own error
        return e.response.status_code if e.response is not None else None
    if isinstance(e, MlflowException):
        found = re.match(r"API request to endpoint \S+ failed with error code (\d{3}) ", str(e))
        return int(found.group(1)) if found else None
    return None


def refused_credentials(e: BaseException) -> Optional[int]:
    """401 or 403 where an MLflow call's answer refused our credentials or their user, else None: a refusal of the
    user, not of the record, which the same records sent with credentials the server takes get through."""
    if isinstance(e, CredentialsRefused):  # the server check's
        return e.status
    status = answer_status(e)
    return status if status in (401, 403) else None


@contextlib.contextmanager
def refusals_named(uri: str) -> Iterator[None]:
    """Raise a refusal of our credentials (refused_credentials) in the block as the TrackingError that says what to
    fix: MLflow's own was a traceback ending in `API request to endpoint /api/2.0/mlflow/runs/create failed with
    error code 403 != 200. Response body: 'Permission denied'` where the check let a READ user in."""
    try:
        yield
    except Exception as e:
        status = refused_credentials(e)
        if status is None:
            raise
        host = host_refused(e)
        raise (HostRefused if host else CredentialsRefused)(refusal_message(uri, status, host), status) from None


def server_unreachable(e: BaseException) -> bool:
    """Whether an error from an MLflow call means the server did not answer (down, unreachable, timed out, or a
    5xx from it or a proxy in front), as opposed to an answer refusing the request (a bad value, a deleted run)."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(e, ServerAway):
        return True
    if isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
        return True
    status = answer_status(e)
    if status is not None:  # an answer: a refusal (a 401 of a changed password too) is no outage
        return status >= 500
    if isinstance(e, requests.exceptions.HTTPError):
        return True  # no response to read
    # mlflow's http_request wraps every failure to get any answer in a plain MlflowException of this wording.
    return isinstance(e, MlflowException) and (str(e).startswith("API request to") or store_unavailable(e))


def store_error(e: BaseException) -> bool:
    """Whether `e` is a query a SQL store MLflow opens in this process (sqlite:///, postgresql://) could not run:
    MLflow's session raises every driver OperationalError as TEMPORARILY_UNAVAILABLE (mlflow/store/db/utils.py), an
    outage (store_unavailable) or not (a value the store refuses, a file this process cannot write)."""
    from mlflow.exceptions import MlflowException

    return isinstance(e, MlflowException) and e.error_code == "TEMPORARILY_UNAVAILABLE"


# A SQL driver's words (_driver_words, lowercase) for a store that is away, not refusing: SQLite's lock, a server
# refusing or losing the connection, gone away, out of connections, timing out, restarting (PostgreSQL, MySQL); and
# a store's file this process cannot write for now (a full disk, a failing one, a database made read-only or moved
# while the step ran), which its user mends, after which the records kept are sent: failing the step mid-training
# over a record would lose what it trained.
_OUTAGE_WORDS = ("database is locked", "database table is locked", "disk is full", "disk i/o error",
                 "no space left", "readonly database", "unable to open database file", "connection refused",
                 "could not connect",
                 "can't connect", "lost connection", "closed the connection", "connection reset",
                 "connection is closed", "connection already closed", "server has gone away", "too many connections",
                 "timeout", "timed out", "deadlock", "starting up", "shutting down", "terminating connection",
                 "could not translate host name")


def store_unavailable(e: BaseException) -> bool:
    """Whether `e` is a SQL store opened in this process not answering a query (store_error), what a server behind
    HTTP answers as a 503: a SQLite database another program holds in a transaction longer than MLflow waits (its
    20 s: a sqlite3 shell, `mlflow gc`), a database server gone, out of connections or timing out. The driver's own
    words tell it from a value the store refuses under the same code (MySQL's `Incorrect string value` of an emoji in
    a utf8mb3 column, SQLite's `too many SQL variables`), which no wait gets in: spooled, it was tried at every
    relog for ever."""
    return store_error(e) and any(words in _driver_words(e).lower() for words in _OUTAGE_WORDS)


def away_reason(e: BaseException) -> str:
    """Why the server did not answer (`server_unreachable(e)`), in the few words the server check says it in:
    "connection refused", "timed out", "HTTP 503", ... (mlflow's own message is urllib3's, hundreds of characters)."""
    if isinstance(e, ServerAway):
        return e.reason
    status = answer_status(e)
    if status is not None:
        return f"HTTP {status}"
    if store_error(e):
        why = _driver_words(e)[:200]
        return why + (" by another program, such as a sqlite3 shell or `mlflow gc`" if why == "database is locked"
                      else "")
    return _connection_reason(str(e))


def _is_mlflow_json(resp: Any) -> bool:
    try:
        data = resp.json()
    except ValueError:
        return False
    return isinstance(data, dict) and ("experiment" in data or "error_code" in data)


def _connection_reason(message: str) -> str:
    low = message.lower()
    for needle, reason in (
        ("connection refused", "connection refused"),
        ("name or service not known", "unknown host name"),
        ("nodename nor servname", "unknown host name"),
        ("temporary failure in name resolution", "unknown host name"),
        ("timed out", "timed out"),
        ("certificate verify failed", "TLS certificate not trusted; set MLFLOW_TRACKING_SERVER_CERT_PATH"),
        ("max retries exceeded", "no answer after retries"),
    ):
        if needle in low:
            return reason
    return "no answer"


def default_experiment_id(client: Any, cfg: Optional[TrackingSource] = None) -> str:
    """$MLFLOW_EXPERIMENT_ID if set (KFP's plugin), else the id of the named experiment, created when missing, with
    EXPERIMENT_DESCRIPTION as its description (an experiment found, someone's own or KFP's, is left as it is)."""
    from mlflow.exceptions import MlflowException

    exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
    if exp_id:
        return exp_id
    name = resolve_experiment_name(cfg)
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            raise TrackingError(
                f"the MLflow experiment {name!r} is deleted; restore it (mlflow experiments restore) or set "
                "MLFLOW_EXPERIMENT_NAME / tracking.experiment_name to another name"
            )
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=_local_artifact_location(client.tracking_uri),
                                        tags={TAG_NOTE: EXPERIMENT_DESCRIPTION})
    except MlflowException:
        # Another step created it between our look-up and create (steps of one pipeline may start together).
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def sqlite_path(uri: str, where: Optional[str] = None) -> Optional[Path]:
    """The database file of a sqlite:/// URI (absolute), None for other URIs and in-memory databases. `where`: what
    set the URI, which ConfigError names where its path begins with the home folder of no user here."""
    if urlsplit(uri).scheme.lower() != "sqlite" or "://" not in uri:
        return None
    path = unquote(uri.split("://", 1)[1].split("?", 1)[0])
    path = path[1:] if path.startswith("/") else path
    if not path or path.startswith(":memory:"):
        return None
    return expand_home(path, where or f"the MLflow database of {safe_uri(uri)}").absolute()


def _local_artifact_location(uri: str) -> Optional[str]:
    # With a local database, mlflow would put artifacts in ./mlruns of whatever folder the step runs in; keeping
    # them beside the database keeps one run's record in one place (the demo's --out folder).
    db = sqlite_path(uri)
    return (db.parent / "mlartifacts").as_uri() if db else None


# MLflow 3.x's UI opens on its GenAI view (traces, tokens, cost) unless the URL says otherwise: its experiment page
# reads `workflowType` from the query (`machine_learning` or `genai`; the built UI, mlflow/server/js) and its `runs`
# tab is the model-training runs table. `mlflow ui` serves on this port unless told otherwise.
UI_RUNS_ROUTE = "#/experiments/{experiment_id}/runs?workflowType=machine_learning"
UI_RUN_ROUTE = "#/experiments/{experiment_id}/runs/{run_id}"  # one run's page (the same UI's runs/:runUuid route)
MLFLOW_UI_PORT = 5000
# The loopback hosts a link may name that `mlflow ui` serves, each with the options that bind it there. MLflow 3's
# host check lets them in by default (mlflow/server/security_utils.py, LOCALHOST_VARIANTS: a Host of `[::1]:5055`
# answers 200 with no --allowed-hosts), where another loopback (127.0.0.2) would need --allowed-hosts as well.
MLFLOW_UI_LOOPBACKS: dict[str, tuple[str, ...]] = {"localhost": (), "127.0.0.1": (), "::1": ("--host", "::1")}


def mlflow_executable() -> str:
    """`mlflow` where the shell finds this interpreter's own, else the path of the one beside the interpreter:
    `make demo` runs .venv/bin/rangefinder with no venv activated, and there `mlflow` alone is not found (or is
    another install's, which may not read this store's schema)."""
    beside = Path(sys.executable).parent / "mlflow"
    found = shutil.which("mlflow")
    if beside.is_file() and (found is None or Path(found).resolve() != beside.resolve()):
        return str(beside)
    return "mlflow"


def ui_link(uri: str, experiment_id: str, ui_url: Optional[str] = None) -> tuple[Optional[str], str]:
    """(the command that serves MLflow's UI for `uri`, or None when `uri` is a server; the link that opens the
    experiment's model-training runs table in that UI). `ui_url`: the UI's address as the browser sees it
    (tracking.ui_url, checked and trimmed there), which the link is built on instead of `uri`. Credentials in `uri`
    never appear in either. The command is quoted for a shell: a local store under a folder with a space in its name
    (`--out "run 1"`) split in two when pasted. It serves where `ui_url` points (ui_command)."""
    return _ui_page(uri, ui_url, UI_RUNS_ROUTE.format(experiment_id=experiment_id))


def _ui_page(uri: str, ui_url: Optional[str], route: str) -> tuple[Optional[str], str]:
    """(ui_link's command, the link to `route` of the UI that serves `uri`: `ui_url`, the server, or `mlflow ui`'s)."""
    if urlsplit(uri).scheme.lower() in ("http", "https"):
        return None, f"{(ui_url or safe_uri(uri)).rstrip('/')}/{route}"
    return ui_command(uri, ui_url), f"{(ui_url or f'http://127.0.0.1:{MLFLOW_UI_PORT}').rstrip('/')}/{route}"


def ui_command(uri: str, ui_url: Optional[str] = None) -> str:
    """`mlflow ui` for the local store `uri`, serving where the link built on `ui_url` points: the command served on
    5000 while the link pointed at, say, 8080. Where `ui_url` names a loopback and a port, the command serves there:
    the loopback `mlflow ui` binds by default (localhost, 127.0.0.1) with no --host, IPv6's `[::1]` with `--host ::1`,
    the port with `--port`, and a path (`http://localhost:8080/mlflow`) with `--static-prefix /mlflow`, under which
    MLflow 3.17's `mlflow ui` serves the page, its static files and its ajax-api (tried on a real one: `/mlflow/` and
    `/mlflow/ajax-api/2.0/mlflow/experiments/search` answer 200, `/` 404). Elsewhere (another host, https, no port,
    a path with characters other than letters, digits and `-._~/`: an ingress, a proxy or a tunnel serves it) no
    option of the command reaches the link, and a shell comment on its line says where it serves and that the link
    needs what forwards there. The port served is the link's own: nothing in a URL tells an SSH tunnel's local end
    (8080) from the remote port it forwards to (5000), so the README asks for one port at both."""
    command = [mlflow_executable(), "ui", "--backend-store-uri", safe_uri(uri)]
    if ui_url is None:
        return shlex.join(command)
    parts = urlsplit(ui_url)
    try:
        port = parts.port
    except ValueError:  # not a port number: the link names no place a command could serve
        port = None
    host = (parts.hostname or "").lower()
    prefix = parts.path.strip("/")
    served_here = parts.scheme.lower() == "http" and host in MLFLOW_UI_LOOPBACKS and port is not None
    # A path as it is typed: one percent-encoded (or with a space) is not the prefix a route of MLflow's would match.
    if served_here and re.fullmatch(r"[A-Za-z0-9._~/-]*", prefix):
        command += list(MLFLOW_UI_LOOPBACKS[host])
        if port != MLFLOW_UI_PORT:
            command += ["--port", str(port)]
        if prefix:  # MLflow wants it with a leading `/` and none at its end
            command += ["--static-prefix", f"/{prefix}"]
        return shlex.join(command)
    shown = " ".join(ui_url.split())  # one line: a pasted comment must not end early
    return (f"{shlex.join(command)}  # serves http://127.0.0.1:{MLFLOW_UI_PORT}; the link points at {shown} "
            "(tracking.ui_url), which must forward there")


def run_ui_link(uri: str, experiment_id: str, run_id: str,
                ui_url: Optional[str] = None) -> tuple[Optional[str], str]:
    """`ui_link` for one run: the command that serves the UI for `uri` (None for a server) and the link that opens
    the run's page there (its params, metrics, description and artifacts), without credentials."""
    return _ui_page(uri, ui_url, UI_RUN_ROUTE.format(experiment_id=experiment_id, run_id=run_id))


def in_cluster_host(uri: str) -> Optional[str]:
    """The host of a server URI that names a Kubernetes Service (`mlflow.mlflow.svc`, `...svc.cluster.local`, or a
    name without a dot, `mlflow`, as a pod in its namespace resolves it), which a browser outside the cluster cannot
    open; None for another host (localhost, a port-forward's, an ingress's) and for a store that is no server."""
    parts = urlsplit(uri)
    host = (parts.hostname or "").rstrip(".").lower()
    if parts.scheme.lower() not in ("http", "https") or not host or host == "localhost":
        return None
    service = host.endswith((".svc", ".svc.cluster.local")) or ("." not in host and ":" not in host)  # ":": IPv6
    return host if service else None


def ui_url_hint(uri: str, ui_url: Optional[str]) -> Optional[str]:
    """What to set where a run's MLflow link is built on an in-cluster tracking URI (in_cluster_host) for want of
    tracking.ui_url, in one sentence; None where the link needs none."""
    host = None if ui_url else in_cluster_host(uri)
    if host is None:
        return None
    return (f"the link is built on the tracking URI the pods use ({host} is a name inside the cluster); set the MLflow "
            "UI's address as your browser opens it in the run form's mlflow_ui_url, or tracking.ui_url in the config")
