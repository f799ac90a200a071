"""Talking to a Kubeflow Pipelines endpoint: upload (or reuse) the pipeline, create a run or a recurring run.

Endpoint and credentials are found the way `kfp.Client` finds them:

- the endpoint is `--host`, else `$KF_PIPELINES_ENDPOINT`;
- the token is `--token`, else the service-account token a pod gets from a projected volume
  (`$KF_PIPELINES_SA_TOKEN_PATH`, default `/var/run/secrets/kubeflow/pipelines/token`), else none (a port-forward
  or an endpoint without auth);
- the KFP UI the result's links point at is `--ui-url`, else `$KF_PIPELINES_UI_ENDPOINT`, else the endpoint (which
  is the UI only where it is the UI's proxy: resolve_ui_url).

Before handing over to `kfp.Client` (which retries a refused healthz for half a minute), one quick request to the
healthz endpoint turns "nothing listens there", "the token was refused", "an auth proxy sent it to its login page" and
"its certificate is not trusted" into one clear sentence each (the token is not sent on along a redirect); it trusts
what kfp's own requests trust (certifi's CAs, or `--ca-cert`). Every request, kfp's included, gives up once connecting,
or waiting for the server's answer, has taken `--request-timeout` seconds, and is not sent again (urllib3 sent a GET
that timed out three times more), so an endpoint that accepts the connection and never answers ends the command after
that long instead of hanging it. The two waits are counted apart, the second as the longest silence between the
server's bytes (a socket's timeout: neither urllib3 nor urllib has another), so a request whose connection took nearly
the whole timeout may wait as long again for its answer, and a server that keeps sending, however slowly, is not cut
off. kfp's own lines ("Pipeline details: ...") are kept off stdout, which holds the command's result (`--json` is JSON
alone).

A pipeline version is named after the package version and a hash of the compiled YAML, compiled reproducibly (the
same bytes from one process to the next: rangefinder.pipelines.reproducible): submitting the same config twice, from
two CI jobs say, reuses the uploaded version; a changed one becomes a new version of the same pipeline. Two submits
racing to upload the same pipeline or version both end up with the one that won.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import ssl
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rangefinder.errors import RangefinderError
from rangefinder.formats.text import is_header_token

ENDPOINT_ENV = "KF_PIPELINES_ENDPOINT"
UI_ENDPOINT_ENV = "KF_PIPELINES_UI_ENDPOINT"  # kfp.Client's own: the KFP UI its links point at
SA_TOKEN_ENV = "KF_PIPELINES_SA_TOKEN_PATH"
SA_TOKEN_DEFAULT_PATH = "/var/run/secrets/kubeflow/pipelines/token"
HEALTHZ_PATH = "/apis/v2beta1/healthz"
# KFP 1.x's: a v1 API server answers it and 404 on HEALTHZ_PATH (the v2beta1 API came with KFP 2.0).
V1_HEALTHZ_PATH = "/apis/v1beta1/healthz"
REQUEST_TIMEOUT_S = 30.0  # --request-timeout default: one request (not an upload of many, nor --wait)
# A run's states in KFP v2 (V2beta1RuntimeState) after which it changes no more. kfp.Client.wait_for_run_completion
# knows no CANCELED (it waited out the whole timeout on a cancelled run).
FINAL_STATES = ("SUCCEEDED", "SKIPPED", "FAILED", "CANCELED")
WAIT_TRIES = 5  # polls in a row that may fail (a timeout, HTTP 5xx) before --wait gives up
# A run in one of these did not do its work, so `submit --once` starts another.
UNDONE_STATES = ("SKIPPED", "FAILED", "CANCELING", "CANCELED")


class EndpointError(RangefinderError):
    """The KFP endpoint cannot be reached, or refuses the credentials."""


# ---------------------------------------------------------------------------------------------------------------
# Cron (6 fields, as KFP's scheduler reads them: robfig/cron with seconds)

_CRON_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (
    ("seconds", 0, 59, {}),
    ("minutes", 0, 59, {}),
    ("hours", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, {m: i + 1 for i, m in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"))}),
    ("day of week", 0, 6, {d: i for i, d in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}),
)
_CRON_EXAMPLE = "'0 0 3 * * *' (every day at 03:00:00)"
_DAYS_IN_MONTH = {1: 31, 2: 29, 3: 31, 4: 30, 5: 31, 6: 30, 7: 31, 8: 31, 9: 30, 10: 31, 11: 30, 12: 31}  # leap years'
# robfig/cron v1's descriptors, which KFP's API server and scheduler take too (cron.Parse), and `@every` with a Go
# duration: the interval form of a schedule.
_CRON_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
_GO_DURATION_PART = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)"
_GO_DURATION_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def validate_cron(expr: str) -> str:
    """Check a 6-field cron expression (seconds minutes hours day-of-month month day-of-week), or one of robfig/cron's
    descriptors (@daily, @every 12h, ...); return it normalised.

    Raises ConfigError naming the field at fault. KFP's scheduler uses robfig/cron with a seconds field, so a
    5-field crontab line is refused with the fix rather than silently meaning something else.
    """
    from rangefinder.errors import ConfigError

    if expr.strip().startswith("@"):
        return _validate_cron_descriptor(expr)
    fields = expr.split()
    if len(fields) == 5:
        raise ConfigError(
            f"cron {expr!r} has 5 fields; KFP schedules take 6 (seconds first): try '0 {' '.join(fields)}'"
        )
    if len(fields) != 6:
        raise ConfigError(
            f"cron {expr!r} has {len(fields)} fields; give 6: seconds minutes hours day-of-month month day-of-week, "
            f"e.g. {_CRON_EXAMPLE}"
        )
    covered: list[set[int]] = []  # each field's values
    for value, (name, lo, hi, names) in zip(fields, _CRON_FIELDS, strict=True):
        if value == "?":
            if name not in ("day of month", "day of week"):
                raise ConfigError(f"cron {expr!r}: '?' is only allowed in day-of-month or day-of-week, not {name}")
            covered.append(set(range(lo, hi + 1)))
            continue
        covered.append(set().union(*(_check_cron_part(expr, part, name, lo, hi, names) for part in value.split(","))))
    days, months = covered[3], covered[4]
    # A date no month of the schedule has (the 30th of February): robfig/cron, KFP's, takes it and never runs it, so
    # the recurring run was made, said nothing and trained nothing. Where day-of-week is also set, either matches.
    if fields[5] in ("*", "?") and not any(d <= _DAYS_IN_MONTH[m] for d in days for m in months):
        dates = " or ".join(str(d) for d in sorted(days))
        raise ConfigError(f"cron {expr!r}: no month it names has a day {dates}, so KFP would never run it; give a "
                          "day one of its months has (cron has no last day of the month: 28 is in every month)")
    return " ".join(fields)


def _validate_cron_descriptor(expr: str) -> str:
    from rangefinder.errors import ConfigError

    word, _, rest = expr.strip().partition(" ")
    if word in _CRON_DESCRIPTORS and not rest.strip():
        return word
    if word != "@every":
        raise ConfigError(f"cron {expr!r}: KFP knows {', '.join(_CRON_DESCRIPTORS)} and @every DURATION; or give 6 "
                          f"fields, e.g. {_CRON_EXAMPLE}")
    duration = rest.strip()
    if not duration or not re.fullmatch(f"(?:{_GO_DURATION_PART})+", duration):
        raise ConfigError(f"cron {expr!r}: @every takes one duration such as 12h, 90m or 1h30m (units h, m, s; no d: "
                          "a week is 168h)")
    seconds = sum(float(n) * _GO_DURATION_UNIT_S[u] for n, u in re.findall(_GO_DURATION_PART, duration))
    if seconds < 1:
        raise ConfigError(f"cron {expr!r}: @every {duration} is under a second (KFP would run it every second); give "
                          "the interval, e.g. @every 12h")
    return f"@every {duration}"


def _check_cron_part(expr: str, part: str, name: str, lo: int, hi: int, names: dict[str, int]) -> set[int]:
    """The values one comma-separated entry of a cron field covers; ConfigError where it is not one robfig/cron
    takes."""
    from rangefinder.errors import ConfigError

    def number(tok: str) -> int:
        t = tok.lower()
        if t in names:
            return names[t]
        if not re.fullmatch(r"\d+", tok):
            raise ConfigError(f"cron {expr!r}: {name} field has {tok!r}, which is not a number in {lo}-{hi}")
        v = int(tok)
        if not lo <= v <= hi:
            # crontab(5) takes 7 for Sunday too; robfig/cron, KFP's, does not.
            sunday = "; Sunday is 0 (or sun)" if name == "day of week" and v == 7 else ""
            raise ConfigError(f"cron {expr!r}: {name} must be in {lo}-{hi} (got {v}){sunday}")
        return v

    base, _, step = part.partition("/")
    if step:
        if not re.fullmatch(r"\d+", step) or int(step) == 0:
            raise ConfigError(f"cron {expr!r}: step {step!r} in the {name} field must be a positive whole number")
    every = int(step or 1)
    if base == "*":
        return set(range(lo, hi + 1, every))
    if not base:
        raise ConfigError(f"cron {expr!r}: empty entry in the {name} field")
    start, dash, end = base.partition("-")
    a = number(start)
    b = a if not (dash or step) else hi  # robfig/cron: "N/step" runs from N to the field's end
    if dash:
        b = number(end)
        if b < a:
            raise ConfigError(f"cron {expr!r}: range {base!r} in the {name} field runs backwards")
    return set(range(a, b + 1, every))


# ---------------------------------------------------------------------------------------------------------------
# Endpoint and credentials


@dataclass(frozen=True)
class Endpoint:
    host: str
    token: Optional[str]  # a bearer token given by hand
    token_path: Optional[Path]  # a service-account token file (re-read by kfp on every request)
    ca_cert: Optional[str] = None  # a CA bundle to trust instead of certifi's
    timeout_s: float = REQUEST_TIMEOUT_S
    token_note: str = ""  # why there is no token, where $KF_PIPELINES_SA_TOKEN_PATH names no file

    def bearer(self) -> Optional[str]:
        if self.token:
            return self.token
        if self.token_path is not None:
            return checked_token(self.token_path.read_text(), f"the token file {self.token_path}")
        return None

    def describe_auth(self) -> str:
        if self.token:
            return "token from --token"
        if self.token_path is not None:
            # An empty file (a CI secret that was never filled in) sends no token at all; the refusal said only the
            # file's name, as if a token had been refused.
            try:
                empty = not self.bearer()
            except OSError:
                empty = False
            return f"service-account token {self.token_path}{', which is empty: no token was sent' if empty else ''}"
        return f"no token{self.token_note}"

    def ssl_context(self) -> ssl.SSLContext:
        """What kfp's requests trust (kfp_server_api: the CA bundle given, else certifi's), so the probe fails where
        they would."""
        import certifi

        return ssl.create_default_context(cafile=self.ca_cert or certifi.where())


def checked_token(token: str, where: str) -> str:
    """The bearer token of `where` (--token, a token file) without the blanks around it (a CI secret's trailing
    newline); ConfigError, the token unshown, where it is not one: a newline or space inside made http.client raise a
    traceback that printed the token, and a copied `Bearer ` prefix was sent twice and refused as a wrong token."""
    from rangefinder.errors import ConfigError

    token = token.strip()
    if token.lower().startswith("bearer "):
        raise ConfigError(f"{where} starts with 'Bearer ', which the request adds itself; give the token alone")
    if not is_header_token(token):
        raise ConfigError(f"{where} holds a space, line break or control character, which no bearer token has (not "
                          "shown); give the token alone, as one line")
    return token


def resolve_endpoint(host: Optional[str] = None, token: Optional[str] = None, ca_cert: Optional[str] = None,
                     timeout_s: float = REQUEST_TIMEOUT_S) -> Endpoint:
    from rangefinder.config import uri_credentials
    from rangefinder.errors import ConfigError

    flag = "--host" if host else f"${ENDPOINT_ENV}"
    host = (host or os.environ.get(ENDPOINT_ENV, "")).strip()
    if not host:
        raise ConfigError(f"no KFP endpoint: pass --host URL or set ${ENDPOINT_ENV} (e.g. http://localhost:8080 "
                          "after `kubectl port-forward -n kubeflow svc/ml-pipeline-ui 8080:80`)")
    held = uri_credentials(host)
    if held:  # named, never shown: the URL goes into messages and the run's link
        raise ConfigError(f"{flag} holds {held}; give the endpoint's URL alone and the credentials as a bearer "
                          f"token (--token, or a token file named by ${SA_TOKEN_ENV})")
    if not re.match(r"^https?://", host):
        raise ConfigError(f"{flag} {host!r} must start with http:// or https://")
    if ca_cert is not None and not Path(ca_cert).is_file():
        raise ConfigError(f"--ca-cert {ca_cert}: no such file; give the PEM file of the CA that signed the "
                          "endpoint's certificate")
    if ca_cert is not None:
        # Read as the probe and kfp read it: a file holding no certificate (a private key, a DER file) failed the
        # probe as "cannot reach the KFP endpoint (NO_CERTIFICATE_OR_CRL_FOUND); check --host".
        try:
            ssl.create_default_context(cafile=ca_cert)
        except ssl.SSLError as e:
            raise ConfigError(f"--ca-cert {ca_cert} holds no PEM certificate ({getattr(e, 'reason', None) or e}); "
                              "give the PEM file (-----BEGIN CERTIFICATE-----) of the CA that signed the endpoint's "
                              "certificate") from None
    host = host.rstrip("/")
    token = checked_token(token, "--token") if token else None
    token_path, note = None, ""
    if not token:
        named = os.environ.get(SA_TOKEN_ENV)
        p = Path(named or SA_TOKEN_DEFAULT_PATH)
        token_path = p if p.is_file() else None
        if named and token_path is None:
            note = f": ${SA_TOKEN_ENV} names {named}, which is not a file"
    return Endpoint(host=host, token=token or None, token_path=token_path, ca_cert=ca_cert, timeout_s=timeout_s,
                    token_note=note)


def check_dataset_uri(uri: str) -> None:
    """ConfigError unless `uri` (--dataset-uri) is an object-store URI without credentials. It becomes a parameter of
    the run, shown in the KFP UI, and was sent as given: a password in it went there, and a folder's path made a run
    whose importer failed on the cluster. resolve-config checks the run form's dataset_uri the same way."""
    from rangefinder.steps.resolve_config import check_dataset_uri as check

    check(uri, "--dataset-uri", "set data.dataset_dir in the config and leave --dataset-uri out")


def resolve_ui_url(ui_url: Optional[str], host: str) -> tuple[str, bool]:
    """(where the links of the result point, whether the KFP UI's URL was given): `--ui-url`, else
    `$KF_PIPELINES_UI_ENDPOINT`, else the endpoint, which serves the UI only where it is the UI's proxy
    (ml-pipeline-ui, as a port-forward of it), not the API server (ml-pipeline, port 8888, in the cluster). As
    kfp.Client's links (_get_url_prefix), a URL without a scheme is http://; a page of the UI copied from the browser
    (`.../#/runs`) counts up to its `#`, which starts the UI's own routes."""
    from rangefinder.config import page_base_url, uri_credentials
    from rangefinder.errors import ConfigError

    flag = "--ui-url" if ui_url else f"${UI_ENDPOINT_ENV}"
    url = (ui_url or os.environ.get(UI_ENDPOINT_ENV, "")).strip()
    if not url:
        return host, False
    held = uri_credentials(url)
    if held:
        raise ConfigError(f"{flag} holds {held}, which the printed links would show; give the KFP UI's URL alone")
    return page_base_url(url), True


def _tls_problem(ep: Endpoint, reason: BaseException) -> Optional[str]:
    """One sentence for a TLS failure (`reason` from urllib or urllib3), or None when it is not one."""
    if isinstance(reason, ssl.SSLCertVerificationError):
        return (f"the KFP endpoint {ep.host} presented a certificate this machine does not trust "
                f"({reason.verify_message}); pass --ca-cert FILE with the CA that signed it")
    if isinstance(reason, ssl.SSLError):
        return (f"the TLS handshake with the KFP endpoint {ep.host} failed ({reason.reason or reason}); if it "
                "serves plain HTTP (a port-forward does), use http://")
    return None


def _healthz_request(ep: Endpoint, path: str) -> urllib.request.Request:
    req = urllib.request.Request(ep.host + path, headers={"Accept": "application/json"})
    bearer = ep.bearer()
    if bearer:
        # Not sent on along a redirect (urllib's headers are, to whatever host it points at): an auth proxy's login
        # page, say, on another host.
        req.add_unredirected_header("Authorization", f"Bearer {bearer}")
    return req


def _kfp_v1_version(ep: Endpoint) -> Optional[str]:
    """The release a KFP 1.x API server names on its V1_HEALTHZ_PATH (its `tag_name`, '' where it names none), or
    None where that path does not answer JSON either: asked only once HEALTHZ_PATH answered 404."""
    try:
        context = ep.ssl_context() if ep.host.startswith("https://") else None
        with urllib.request.urlopen(_healthz_request(ep, V1_HEALTHZ_PATH), timeout=ep.timeout_s,
                                    context=context) as resp:
            said = json.loads(resp.read() or b"{}")
    except (OSError, ValueError):  # urllib's errors are OSErrors; not JSON
        return None
    return str(said.get("tag_name") or "") if isinstance(said, dict) else None


def check_endpoint(ep: Endpoint) -> dict:
    """One GET of the healthz endpoint; EndpointError with one clear sentence when it fails. Returns its JSON
    (`multi_user` says whether runs need a namespace)."""
    req = _healthz_request(ep, HEALTHZ_PATH)
    try:
        context = ep.ssl_context() if ep.host.startswith("https://") else None
        with urllib.request.urlopen(req, timeout=ep.timeout_s, context=context) as resp:
            body = resp.read()
            final = urllib.parse.urlsplit(resp.geturl())
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise EndpointError(
                f"the KFP endpoint {ep.host} refused the credentials (HTTP {e.code}, {ep.describe_auth()}); "
                "pass a valid --token or check the service account's access to the namespace"
            ) from None
        if e.code >= 500:
            raise EndpointError(f"the KFP endpoint {ep.host} answered HTTP {e.code} {e.reason} on {HEALTHZ_PATH}: "
                                "the KFP API server (ml-pipeline) or the proxy before it is failing; try again "
                                "later or check its pods") from None
        v1 = _kfp_v1_version(ep) if e.code == 404 else None
        if v1 is not None:
            # kfp 2's client speaks the v2beta1 API alone; its requests would each be answered 404 in turn.
            raise EndpointError(
                f"the KFP endpoint {ep.host} is Kubeflow Pipelines {v1 or '1.x'}, a KFP v1 API server ({HEALTHZ_PATH} "
                f"answered HTTP 404, {V1_HEALTHZ_PATH} answered); rangefinder needs KFP v2 (2.x): upgrade the "
                "install to Kubeflow Pipelines 2.x, or pass --host of one that runs it") from None
        raise EndpointError(f"the KFP endpoint {ep.host} answered HTTP {e.code} {e.reason} on {HEALTHZ_PATH}; "
                            "check that --host is the KFP API (ml-pipeline or its UI proxy)") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        tls = _tls_problem(ep, reason) if isinstance(reason, BaseException) else None
        if tls:
            raise EndpointError(tls) from None
        if isinstance(reason, TimeoutError):
            raise EndpointError(f"the KFP endpoint {ep.host} did not answer within {ep.timeout_s:g} s; check "
                                f"--host / ${ENDPOINT_ENV}, or allow more with --request-timeout") from None
        raise EndpointError(f"cannot reach the KFP endpoint {ep.host} ({reason}); check --host / ${ENDPOINT_ENV} "
                            "and that the port-forward or ingress is up") from None
    if final.path != urllib.parse.urlsplit(ep.host + HEALTHZ_PATH).path:
        # An auth proxy in front of KFP (oauth2-proxy, Dex) sends a request it does not let in to its login page,
        # which answers 200 with HTML: it was "did not answer JSON; is --host the KFP endpoint?".
        where = f"{final.scheme}://{final.netloc.rsplit('@', 1)[-1]}{final.path}"  # its query holds the login's state
        raise EndpointError(f"the KFP endpoint {ep.host} redirected the request to {where}, as an auth proxy sends one "
                            f"it does not let in to its login page ({ep.describe_auth()}); pass a valid --token")
    try:
        return json.loads(body or b"{}")
    except json.JSONDecodeError:
        raise EndpointError(f"{ep.host}{HEALTHZ_PATH} did not answer JSON; is --host the KFP endpoint?") from None


def _timeouts_not_retried():
    """urllib3's default retries (3), less those after a timeout: a GET whose answer did not come in time was sent
    again three times, so a stalled endpoint held the command for 4x --request-timeout (a connect that timed out, any
    method, alike). The server that did not answer once is not asked again; a dropped connection still is."""
    import urllib3

    class TimeoutsNotRetried(urllib3.Retry):
        def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
            if isinstance(error, urllib3.exceptions.TimeoutError):  # ConnectTimeoutError, ReadTimeoutError
                raise error
            return super().increment(method, url, response, error, _pool, _stacktrace)

    return TimeoutsNotRetried(urllib3.Retry.DEFAULT.total)


@contextlib.contextmanager
def _session(ep: Endpoint) -> Iterator[None]:
    """Around everything kfp does: each request gives up after ep.timeout_s (kfp passes its requests no timeout and
    has no setting for one, so kfp_server_api's one request method gets it while the block runs, as the compiler's
    `inspect` is swapped in pipeline.py) and is not sent again after a timeout (the clients kfp makes in the block
    get kfp_server_api's `retries` setting: _timeouts_not_retried), kfp's prints ("Pipeline details: <link>") and its
    FutureWarning stay off the terminal (the result names the run and its link), and its failures become one
    sentence (_kfp_errors)."""
    from kfp_server_api import rest

    init, request = rest.RESTClientObject.__init__, rest.RESTClientObject.request

    def timeouts_not_retried(self, configuration: Any, *args: Any, **kwargs: Any) -> None:
        if configuration.retries is None:
            configuration.retries = _timeouts_not_retried()
        init(self, configuration, *args, **kwargs)

    def with_timeout(self, *args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        return request(self, *args, _request_timeout=_request_timeout or (ep.timeout_s, ep.timeout_s), **kwargs)

    rest.RESTClientObject.__init__ = timeouts_not_retried
    rest.RESTClientObject.request = with_timeout
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), _kfp_errors(ep):
            warnings.filterwarnings("ignore", message="This client only works with Kubeflow Pipeline",
                                    category=FutureWarning)
            yield
    finally:
        rest.RESTClientObject.__init__, rest.RESTClientObject.request = init, request


def connect(ep: Endpoint, namespace: Optional[str] = None):
    """A `kfp.Client` for the endpoint, after the quick reachability and credentials check. Call it inside
    `_session(ep)`."""
    import kfp
    from kfp.client.set_volume_credentials import ServiceAccountTokenVolumeCredentials

    from rangefinder.errors import ConfigError

    health = check_endpoint(ep)
    kwargs: dict[str, Any] = {"host": ep.host}
    if ep.token:
        kwargs["existing_token"] = ep.token
    elif ep.token_path is not None:
        kwargs["credentials"] = ServiceAccountTokenVolumeCredentials(str(ep.token_path))
    if ep.ca_cert:
        kwargs["ssl_ca_cert"] = ep.ca_cert
    if namespace:
        kwargs["namespace"] = namespace
    client = kfp.Client(**kwargs)
    # kfp finds a namespace in ~/.config/kfp/context.json or, in a pod, its service account's; without one a
    # multi-user endpoint refuses the experiment after the pipeline is uploaded, in its own words.
    if health.get("multi_user") and not client.get_user_namespace():
        raise ConfigError(f"the KFP endpoint {ep.host} is multi-user: pass --namespace with your Kubeflow "
                          "profile's namespace")
    return client


class _kfp_errors:
    """Turn kfp_server_api / urllib3 failures inside a block into EndpointError with one sentence."""

    def __init__(self, ep: Endpoint):
        self.ep = ep

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, RangefinderError):
            return False
        import kfp_server_api
        import urllib3

        if isinstance(exc, kfp_server_api.ApiException):
            said = _server_message(exc)
            if exc.status == 0:  # kfp_server_api's own wrap of a failed TLS handshake or connection
                last = str(exc.reason).splitlines()[-1]
                raise EndpointError(f"lost the KFP endpoint {self.ep.host} ({last})") from None
            if exc.status in (401, 403):
                raise EndpointError(f"the KFP endpoint {self.ep.host} refused the request (HTTP {exc.status}, "
                                    f"{self.ep.describe_auth()}{': ' + said if said else ''}); pass a valid --token, "
                                    "or check the account's access to the namespace (--namespace)") from None
            raise EndpointError(
                f"the KFP endpoint {self.ep.host} answered HTTP {exc.status} {exc.reason}{': ' + said if said else ''}"
            ) from None
        reason: BaseException = exc
        if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
            reason = exc.reason
        if isinstance(reason, (urllib3.exceptions.TimeoutError, TimeoutError)):
            raise EndpointError(f"the KFP endpoint {self.ep.host} did not answer a request within "
                                f"{self.ep.timeout_s:g} s; try again, or allow more with --request-timeout") from None
        if isinstance(reason, urllib3.exceptions.SSLError) and reason.args and isinstance(reason.args[0],
                                                                                           BaseException):
            reason = reason.args[0]
        tls = _tls_problem(self.ep, reason)
        if tls:
            raise EndpointError(tls) from None
        if isinstance(exc, (urllib3.exceptions.HTTPError, OSError)):
            raise EndpointError(f"lost the KFP endpoint {self.ep.host} ({reason})") from None
        return False


def _server_message(exc) -> str:
    """What the KFP API server said about a refused request (its JSON `error` or `message`), on one line."""
    body = exc.body if isinstance(exc.body, str) else ""
    try:
        said = json.loads(body)
        text = str(said.get("error") or said.get("message") or "") if isinstance(said, dict) else body
    except ValueError:
        text = body
    return " ".join(text.split())[:300]


# ---------------------------------------------------------------------------------------------------------------
# Pipeline upload, runs, recurring runs


def package_version_name(package_path: str | Path) -> str:
    from rangefinder import __version__

    digest = hashlib.sha256(Path(package_path).read_bytes()).hexdigest()[:12]
    return f"v{__version__}-{digest}"


def _filter_by_name(name: str) -> str:
    return json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": name}]})


def _already_exists(exc: BaseException) -> bool:
    """An upload refused because the same name was uploaded meanwhile (HTTP 409, AlreadyExists): another submit of
    the same config, a CI job retried beside the first, won the race."""
    import kfp_server_api

    return isinstance(exc, kfp_server_api.ApiException) and exc.status == 409


def _version_named(client, pipeline_id: str, version_name: str) -> Optional[str]:
    versions = client.list_pipeline_versions(pipeline_id=pipeline_id, page_size=10,
                                             filter=_filter_by_name(version_name)).pipeline_versions or []
    return next((v.pipeline_version_id for v in versions if v.display_name == version_name), None)


def ensure_pipeline_version(
    client, package_path: str, pipeline_name: str, description: str = ""
) -> tuple[str, str, bool]:
    """(pipeline_id, version_id, uploaded): reuse the pipeline and the version of the same name, else upload."""
    version_name = package_version_name(package_path)
    pipeline_id = client.get_pipeline_id(pipeline_name)
    uploaded = False
    if pipeline_id is None:
        try:
            pipeline_id = client.upload_pipeline(package_path, pipeline_name=pipeline_name,
                                                 description=description).pipeline_id
            uploaded = True
        except Exception as e:
            if not _already_exists(e):
                raise
            pipeline_id = client.get_pipeline_id(pipeline_name)
            if pipeline_id is None:
                raise
    version_id = _version_named(client, pipeline_id, version_name)
    if version_id is not None:
        return pipeline_id, version_id, uploaded
    try:
        version = client.upload_pipeline_version(package_path, pipeline_version_name=version_name,
                                                 pipeline_id=pipeline_id, description=description)
    except Exception as e:
        version_id = _version_named(client, pipeline_id, version_name) if _already_exists(e) else None
        if version_id is None:
            raise
        return pipeline_id, version_id, uploaded
    return pipeline_id, version.pipeline_version_id, True


def find_experiment(client, name: str) -> Optional[Any]:
    """The experiment of that name in the user's namespace, or None. The first request made in the namespace: KFP
    refuses it (HTTP 403) where the account may not use the namespace, so submit asks it before uploading anything."""
    try:
        return client.get_experiment(experiment_name=name)
    except ValueError as e:  # kfp's word for "none of that name"
        if not str(e).startswith("No experiment is found with name"):
            raise
    return None


def make_experiment(client, name: str) -> tuple[Any, bool]:
    """(experiment, created): an experiment of that name in the user's namespace, where find_experiment found none.
    kfp's create_experiment gets or makes one without saying which, so a misspelt --experiment made a new experiment
    unseen and the run went there. A second submit making the same one meanwhile (HTTP 409) shares it."""
    try:
        return client.create_experiment(name), True
    except Exception as e:
        if not _already_exists(e):
            raise
        return client.get_experiment(experiment_name=name), False


@dataclass
class Submission:
    host: str
    ui_url: str  # the KFP UI the links point at (resolve_ui_url)
    pipeline_id: str
    version_id: str
    uploaded: bool
    experiment: str
    experiment_id: str
    name: str  # the run's or the recurring run's display name
    run_id: Optional[str] = None
    reused_run: Optional[bool] = None  # --once found a run of the name and started none
    recurring_run_id: Optional[str] = None
    replaced: list[str] = field(default_factory=list)  # recurring runs of the same name disabled by --replace
    experiment_created: bool = False  # there was no experiment of the name: this submit made it
    ui_url_given: bool = False  # False: ui_url is the endpoint, taken to serve the UI too
    state: Optional[str] = None
    timed_out: Optional[bool] = None  # --wait ran out of time with the run still going
    # Why --wait stopped reading the run's state, the run made (the endpoint stopped answering, refused the token)
    wait_error: Optional[str] = None
    # Why --replace left a recurring run of the name enabled beside the one made (the endpoint failed to disable it)
    replace_error: Optional[str] = None

    # The KFP UI's routes, as kfp.Client links a run (`{ui}/#/runs/details/{id}`) and the UI its recurring runs.
    @property
    def run_url(self) -> Optional[str]:
        return f"{self.ui_url}/#/runs/details/{self.run_id}" if self.run_id else None

    @property
    def recurring_run_url(self) -> Optional[str]:
        return f"{self.ui_url}/#/recurringrun/details/{self.recurring_run_id}" if self.recurring_run_id else None


def wait_for_run(client, run_id: str, timeout_s: float, poll_s: float = 5.0) -> tuple[str, bool]:
    """(state, timed_out): poll the run until it is in one of FINAL_STATES, or `timeout_s` has passed. A day's wait
    outlives a proxy's restart: a poll that times out or gets HTTP 5xx is tried again, up to WAIT_TRIES in a row."""
    deadline = time.monotonic() + timeout_s
    failed = 0
    state = "RUNTIME_STATE_UNSPECIFIED"
    while True:
        try:
            state = str(client.get_run(run_id).state or "RUNTIME_STATE_UNSPECIFIED").upper()
            failed = 0
        except Exception as e:
            failed += 1
            if not _passing(e) or failed >= WAIT_TRIES:
                raise
        left = deadline - time.monotonic()
        if state in FINAL_STATES or left <= 0:
            return state, state not in FINAL_STATES
        time.sleep(min(poll_s, left))


def _passing(exc: BaseException) -> bool:
    """A failure the next request may not meet: a timeout, a dropped connection, HTTP 5xx."""
    import kfp_server_api
    import urllib3

    if isinstance(exc, kfp_server_api.ApiException):
        return exc.status == 0 or exc.status >= 500
    return isinstance(exc, (urllib3.exceptions.HTTPError, OSError))


def _enabled_recurring_runs(client, experiment_id: str, name: str) -> list:
    found = client.list_recurring_runs(experiment_id=experiment_id, page_size=100,
                                       filter=_filter_by_name(name)).recurring_runs or []
    return [r for r in found if r.display_name == name and str(r.status or "").upper() != "DISABLED"]


def _live_run(client, experiment_id: str, name: str):
    """The newest run of `name` in the experiment that has not failed, been cancelled or skipped; None if none."""
    found = client.list_runs(experiment_id=experiment_id, page_size=100, sort_by="created_at desc",
                             filter=_filter_by_name(name)).runs or []
    return next((r for r in found if r.display_name == name and str(r.state or "").upper() not in UNDONE_STATES),
                None)


def submit(
    cfg,
    *,
    host: Optional[str] = None,
    token: Optional[str] = None,
    experiment: Optional[str] = None,
    run_name: Optional[str] = None,
    dataset_uri: str = "",
    wait: bool = False,
    timeout_s: float = 24 * 3600,
    cron: Optional[str] = None,
    namespace: Optional[str] = None,
    ca_cert: Optional[str] = None,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    ui_url: Optional[str] = None,
    once: bool = False,
    replace: bool = False,
    max_concurrency: int = 1,
    catchup: bool = False,
    poll_s: float = 5.0,
) -> Submission:
    """Compile `cfg` into a package, upload or reuse it, and create a run (or a recurring run when `cron` is set).

    `once` (runs, with `run_name`): a run of that name in the experiment that has not failed, been cancelled or
    skipped is taken instead of starting another (a CI job retried after the run was created). A recurring run is
    refused where the experiment has an enabled one of the same name, unless `replace`: then the new one is created
    and the old ones disabled."""
    from rangefinder.errors import ConfigError
    from rangefinder.pipelines.pipeline import PIPELINE_DESCRIPTION, PIPELINE_NAME
    from rangefinder.pipelines.reproducible import compile_reproducibly
    from rangefinder.steps.resolve_config import parameters_from_config

    if cron is not None:
        cron = validate_cron(cron)  # before any network traffic
    check_dataset_uri(dataset_uri)
    if once and not run_name:
        raise ConfigError("--once needs --name: it looks for an earlier run of that name in the experiment")
    if not 1 <= max_concurrency <= 10:
        raise ConfigError(f"max concurrency must be in 1-10, as KFP allows (got {max_concurrency})")
    params = parameters_from_config(cfg, dataset_uri=dataset_uri)
    experiment = experiment or cfg.tracking.experiment_name
    ep = resolve_endpoint(host, token, ca_cert, request_timeout_s)
    ui_url, ui_url_given = resolve_ui_url(ui_url, ep.host)
    with _session(ep):
        client = connect(ep, namespace)
        # Before the upload (a shared pipeline, which any account may upload): a namespace the account may not use
        # was refused only at the experiment, with the pipeline and its version left behind.
        found = find_experiment(client, experiment)
        with tempfile.TemporaryDirectory(prefix="rangefinder-submit-") as tmp:
            package = compile_reproducibly(cfg, str(Path(tmp) / "pipeline.yaml"))
            pipeline_id, version_id, uploaded = ensure_pipeline_version(client, package, PIPELINE_NAME,
                                                                        PIPELINE_DESCRIPTION)
        exp, experiment_created = (found, False) if found is not None else make_experiment(client, experiment)
        # A recurring run is found again by its name: one name whatever the config, so a changed config meets the
        # schedule it replaces. A run's default name tells its version apart.
        name = run_name or (PIPELINE_NAME if cron is not None else f"{PIPELINE_NAME}-{version_id[:8]}")
        sub = Submission(host=ep.host, ui_url=ui_url, pipeline_id=pipeline_id, version_id=version_id,
                         uploaded=uploaded, experiment=experiment, experiment_id=exp.experiment_id, name=name,
                         experiment_created=experiment_created, ui_url_given=ui_url_given)
        sa = cfg.kubernetes.service_account
        if cron is not None:
            old = _enabled_recurring_runs(client, exp.experiment_id, name)
            if old and not replace:
                ids = ", ".join(f"{r.recurring_run_id} ({_cron_of(r)})" for r in old)
                raise RangefinderError(
                    f"experiment {experiment!r} already has an enabled recurring run named {name!r}: {ids}; pass "
                    "--replace to disable it once the new one is made, or another --name to keep both")
            rr = client.create_recurring_run(
                experiment_id=exp.experiment_id, job_name=name, cron_expression=cron, params=params,
                pipeline_id=pipeline_id, version_id=version_id, max_concurrency=max_concurrency,
                no_catchup=not catchup, service_account=sa,
            )
            sub.recurring_run_id = rr.recurring_run_id
            # The new one is made whatever disabling the old ones meets: its id stays the result, and one left
            # enabled is said beside it (two schedules of the name would train side by side).
            for r in old:
                try:
                    with _kfp_errors(ep):
                        client.disable_recurring_run(r.recurring_run_id)
                except EndpointError as e:
                    sub.replace_error = f"recurring run {r.recurring_run_id} is still enabled ({e})"
                    break
                sub.replaced.append(r.recurring_run_id)
            return sub
        live = _live_run(client, exp.experiment_id, name) if once else None
        if live is not None:
            sub.run_id, sub.reused_run = live.run_id, True
        else:
            run = client.run_pipeline(exp.experiment_id, name, params=params, pipeline_id=pipeline_id,
                                      version_id=version_id, service_account=sa)
            sub.run_id = run.run_id
            if once:
                sub.reused_run = False
        if wait:
            # The run is made whatever the wait meets: its id and link stay the result, and the failure is said
            # beside them (it ended the command as if nothing had been submitted, the run going on unnamed).
            try:
                with _kfp_errors(ep):
                    sub.state, sub.timed_out = wait_for_run(client, sub.run_id, timeout_s, poll_s)
            except EndpointError as e:
                sub.wait_error = str(e)
    return sub


def _cron_of(recurring_run) -> str:
    trigger = getattr(recurring_run, "trigger", None)
    cron = getattr(getattr(trigger, "cron_schedule", None), "cron", None)
    return f"cron {cron!r}" if cron else "no cron"
