"""submit / schedule against real loopback HTTP servers: the real kfp.Client talks to them, they record what it sent."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from rangefinder.config import parse_config
from rangefinder.errors import ConfigError
from rangefinder.pipelines.client import EndpointError, submit, validate_cron
from rangefinder.pipelines.pipeline import PIPELINE_NAME
from tests.kube_apiserver import reply_json


class FakeKFP:
    """Just enough of the KFP v2beta1 REST API for upload, experiments, runs and recurring runs.

    `hook(method, path, rec)` answers a request before the routes when it returns (code, body), or "hang" to answer
    never (until close); `multi_user` makes it refuse an experiment without a namespace, as KFP does, and a request
    in one of `denied_namespaces` (an experiment listed or made there) is refused HTTP 403, as KFP's authorization
    (a SubjectAccessReview of the user in that namespace) refuses an account the profile does not share."""

    def __init__(self, refuse: int | None = None, token: str | None = None, tls: tuple[str, str] | None = None):
        self.requests: list[dict] = []
        self.pipelines: dict[str, dict] = {}
        self.versions: dict[str, list[dict]] = {}
        self.experiments: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self.recurring_runs: dict[str, dict] = {}
        self.packages: dict[str, str] = {}  # version id -> uploaded YAML
        self.refuse = refuse
        self.token = token
        self.hook: Callable[[str, str, dict], Any] | None = None
        self.multi_user = False
        self.denied_namespaces: set[str] = set()
        self.run_state = "SUCCEEDED"  # what GET /runs/{id} says
        self.closed = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code: int, body: dict):
                reply_json(self, code, body)

            def _handle(self, method: str):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                url = urlparse(self.path)
                rec = {"method": method, "path": url.path, "query": parse_qs(url.query), "body": body,
                       "headers": {k.lower(): v for k, v in self.headers.items()}}
                fake.requests.append(rec)
                if fake.refuse:
                    return self._reply(fake.refuse, {"error": "denied", "code": 16, "message": "denied"})
                if fake.token and self.headers.get("Authorization") != f"Bearer {fake.token}":
                    return self._reply(401, {"error": "no token", "code": 16, "message": "no token"})
                hooked = fake.hook(method, url.path, rec) if fake.hook else None
                if hooked == "hang":
                    fake.closed.wait(60)
                    return None
                code, out = hooked or fake.route(method, url.path, rec)
                self._reply(code, out)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def _name_filter(rec) -> str | None:
        f = rec["query"].get("filter")
        if not f:
            return None
        return json.loads(f[0])["predicates"][0]["stringValue"]

    @staticmethod
    def _upload(rec) -> tuple[str, str]:
        msg = BytesParser(policy=HTTP).parsebytes(
            b"Content-Type: " + rec["headers"]["content-type"].encode() + b"\r\n\r\n" + rec["body"])
        (part,) = [p for p in msg.iter_parts() if p.get_param("name", header="content-disposition") == "uploadfile"]
        return part.get_filename(), part.get_payload(decode=True).decode()

    def route(self, method: str, path: str, rec) -> tuple[int, dict]:
        api = "/apis/v2beta1"
        if path == f"{api}/healthz":
            return 200, {"multi_user": self.multi_user}
        try:
            body = json.loads(rec["body"] or b"{}")
        except ValueError:  # an upload's multipart body
            body = {}
        namespace = rec["query"].get("namespace", [None])[0] or (body.get("namespace") if isinstance(body, dict)
                                                                 else None)
        if namespace in self.denied_namespaces:
            return 403, {"error": f"Failed to authorize with API: PermissionDenied: User 'ci@example.com' is not "
                                  f"authorized with reason:  (request: &ResourceAttributes{{Namespace:{namespace},"
                                  "Group:pipelines.kubeflow.org,Resource:experiments})", "code": 7}
        if method == "GET" and path == f"{api}/pipelines":
            name = self._name_filter(rec)
            found = [p for p in self.pipelines.values() if name is None or p["display_name"] == name]
            return 200, ({"pipelines": found, "total_size": len(found)} if found else {})
        if method == "POST" and path == f"{api}/pipelines/upload":
            pid = f"p{len(self.pipelines) + 1}"
            name = rec["query"]["name"][0]
            self.pipelines[pid] = {"pipeline_id": pid, "display_name": name}
            _, text = self._upload(rec)
            vid = f"{pid}-v0"
            self.versions[pid] = [{"pipeline_id": pid, "pipeline_version_id": vid, "display_name": name}]
            self.packages[vid] = text
            return 200, self.pipelines[pid]
        m = re.fullmatch(rf"{api}/pipelines/(\w+)/versions", path)
        if method == "GET" and m:
            name = self._name_filter(rec)
            found = [v for v in self.versions.get(m.group(1), []) if name is None or v["display_name"] == name]
            return 200, ({"pipeline_versions": found, "total_size": len(found)} if found else {})
        if method == "POST" and path == f"{api}/pipelines/upload_version":
            pid = rec["query"]["pipelineid"][0]
            vid = f"{pid}-v{len(self.versions[pid])}"
            v = {"pipeline_id": pid, "pipeline_version_id": vid, "display_name": rec["query"]["name"][0]}
            self.versions[pid].append(v)
            self.packages[vid] = self._upload(rec)[1]
            return 200, v
        if method == "GET" and path == f"{api}/experiments":
            name = self._name_filter(rec)
            found = [e for e in self.experiments.values() if e["display_name"] == name]
            return 200, ({"experiments": found, "total_size": len(found)} if found else {})
        if method == "POST" and path == f"{api}/experiments":
            e = json.loads(rec["body"])
            if self.multi_user and not e.get("namespace"):
                return 400, {"error": "Invalid input error: In multi-user mode, experiment namespace can't be empty",
                             "code": 3}
            eid = f"e{len(self.experiments) + 1}"
            self.experiments[eid] = {"experiment_id": eid, "display_name": e["display_name"],
                                     "namespace": e.get("namespace")}
            return 200, self.experiments[eid]
        if method == "POST" and path == f"{api}/runs":
            rid = f"r{len(self.runs) + 1}"
            self.runs[rid] = {"run_id": rid, "state": "PENDING", **json.loads(rec["body"])}
            return 200, self.runs[rid]
        if method == "GET" and path == f"{api}/runs":
            return 200, self._listed("runs", self.runs.values(), rec)
        m = re.fullmatch(rf"{api}/runs/(\w+)", path)
        if method == "GET" and m and m.group(1) in self.runs:
            return 200, {**self.runs[m.group(1)], "state": self.run_state}
        if method == "POST" and path == f"{api}/recurringruns":
            rrid = f"rr{len(self.recurring_runs) + 1}"
            self.recurring_runs[rrid] = {"recurring_run_id": rrid, "status": "ENABLED", **json.loads(rec["body"])}
            return 200, self.recurring_runs[rrid]
        if method == "GET" and path == f"{api}/recurringruns":
            return 200, self._listed("recurringRuns", self.recurring_runs.values(), rec)  # as KFP spells it
        m = re.fullmatch(rf"{api}/recurringruns/(\w+):disable", path)
        if method == "POST" and m and m.group(1) in self.recurring_runs:
            self.recurring_runs[m.group(1)]["status"] = "DISABLED"
            return 200, {}
        return 404, {"error": f"no route {method} {path}", "code": 5, "message": "not found"}

    def _listed(self, key: str, items, rec) -> dict:
        """A list answer: the items of the experiment_id and display_name asked for, newest first."""
        name = self._name_filter(rec)
        experiment = rec["query"].get("experiment_id", [None])[0]
        found = [i for i in reversed(list(items)) if (name is None or i["display_name"] == name)
                 and (experiment is None or i["experiment_id"] == experiment)]
        return {key: found, "total_size": len(found)} if found else {}

    def sent(self, method: str, path_end: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == method and r["path"].endswith(path_end)]


@pytest.fixture
def kfp_server():
    s = FakeKFP()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def _no_ambient_endpoint(monkeypatch, tmp_path):
    monkeypatch.delenv("KF_PIPELINES_ENDPOINT", raising=False)
    monkeypatch.delenv("KF_PIPELINES_UI_ENDPOINT", raising=False)
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setenv("HOME", str(tmp_path))  # kfp reads ~/.config/kfp/context.json


CFG = {"data": {"resolution": 256, "dataset_dir": "/data/sets/cats"}, "lr_range_test": {"lr_max": 0.02},
       "retrain": {"enabled": True}, "kubernetes": {"gpu_count": 2, "service_account": "sa-runner"},
       "tracking": {"experiment_name": "cats"}}


def test_submit_uploads_once_and_creates_a_run(kfp_server):
    cfg = parse_config(CFG)
    sub = submit(cfg, host=kfp_server.url, token="secret-token")
    assert sub.run_id == "r1" and sub.uploaded

    # The package uploaded is the compiled pipeline of this config.
    (upload,) = kfp_server.sent("POST", "/pipelines/upload_version")
    spec = next(yaml.load_all(kfp_server.packages[sub.version_id], Loader=yaml.CSafeLoader))
    assert spec["pipelineInfo"]["name"] == PIPELINE_NAME
    assert spec["root"]["inputDefinitions"]["parameters"]["resolution"]["defaultValue"] == 256
    ft = [e for n, e in spec["deploymentSpec"]["executors"].items() if n.startswith("exec-finetune")]
    assert ft and ft[0]["container"]["resources"]["accelerator"]["resourceCount"] == "2"
    assert re.fullmatch(r"v[\d.]+-[0-9a-f]{12}", upload["query"]["name"][0])

    # The run: the experiment of the config, that version, the config as parameters, the service account.
    (run,) = kfp_server.sent("POST", "/runs")
    body = json.loads(run["body"])
    assert body["experiment_id"] == sub.experiment_id
    assert kfp_server.experiments[sub.experiment_id]["display_name"] == "cats"
    assert body["pipeline_version_reference"] == {"pipeline_id": sub.pipeline_id,
                                                  "pipeline_version_id": sub.version_id}
    params = body["runtime_config"]["parameters"]
    assert params["resolution"] == 256 and params["lr_max"] == 0.02 and params["retrain"] is True
    assert params["dataset_dir"] == "/data/sets/cats"
    assert json.loads(params["base_config"])["data"]["resolution"] == 256
    assert body["service_account"] == "sa-runner"
    assert all(r["headers"].get("authorization") == "Bearer secret-token" for r in kfp_server.requests)
    # The run's default name, as `submit --help` says it: not the package's version name (v<version>-<hash>).
    assert body["display_name"] == f"{PIPELINE_NAME}-{sub.version_id[:8]}"
    from tests.cli.test_help import _commands

    assert "finetune-<the first 8 characters of version_id, the KFP pipeline version's id" in " ".join(
        _commands()["submit"].format_help().split())

    # The same config again reuses the pipeline and its version: nothing is uploaded twice.
    sub2 = submit(cfg, host=kfp_server.url, token="secret-token", wait=True, timeout_s=30)
    assert (sub2.pipeline_id, sub2.version_id, sub2.uploaded) == (sub.pipeline_id, sub.version_id, False)
    assert len(kfp_server.sent("POST", "/pipelines/upload")) == 1
    assert len(kfp_server.sent("POST", "/pipelines/upload_version")) == 1
    assert sub2.state and sub2.state.upper() == "SUCCEEDED"

    # A changed config is a new version of the same pipeline.
    sub3 = submit(parse_config({**CFG, "data": {"resolution": 512}}), host=kfp_server.url, token="secret-token",
                  dataset_uri="s3://bucket/cats")
    assert sub3.pipeline_id == sub.pipeline_id and sub3.version_id != sub.version_id
    assert sub3.uploaded  # a new version was uploaded, though the pipeline was there
    # --dataset-uri reaches the run, whose importer then reads the dataset from the object store.
    params = json.loads(kfp_server.sent("POST", "/runs")[-1]["body"])["runtime_config"]["parameters"]
    assert params["dataset_uri"] == "s3://bucket/cats"


def test_schedule_creates_a_recurring_run(kfp_server, monkeypatch):
    monkeypatch.setenv("KF_PIPELINES_ENDPOINT", kfp_server.url)  # the endpoint from the environment, as kfp does
    sub = submit(parse_config(CFG), cron="0 30 2 * * mon-fri")
    assert sub.recurring_run_id == "rr1"
    (rr,) = kfp_server.sent("POST", "/recurringruns")
    body = json.loads(rr["body"])
    assert body["trigger"]["cron_schedule"]["cron"] == "0 30 2 * * mon-fri"
    assert body["max_concurrency"] == "1" or body["max_concurrency"] == 1
    assert body["runtime_config"]["parameters"]["resolution"] == 256
    assert body["pipeline_version_reference"]["pipeline_version_id"] == sub.version_id
    assert body["service_account"] == "sa-runner"  # the recurring runs' pods run as the config's account too
    # More runs at once than KFP allows is refused here, before any request, as the command's flag refuses it.
    sent = len(kfp_server.requests)
    with pytest.raises(ConfigError, match=r"max concurrency must be in 1-10, as KFP allows \(got 11\)"):
        submit(parse_config(CFG), cron="@daily", max_concurrency=11)
    assert len(kfp_server.requests) == sent


def test_service_account_token_is_sent(kfp_server, monkeypatch, tmp_path):
    token = tmp_path / "token"
    token.write_text("sa-token\n")
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(token))
    kfp_server.token = "sa-token"
    sub = submit(parse_config(CFG), host=kfp_server.url)
    assert sub.run_id == "r1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_endpoint_is_one_clear_error():
    url = f"http://127.0.0.1:{_free_port()}"  # bound then closed: nothing listens there
    with pytest.raises(EndpointError, match=r"cannot reach the KFP endpoint http://127\.0\.0\.1:\d+"):
        submit(parse_config(CFG), host=url)


@pytest.mark.parametrize("code", [401, 403])
def test_refused_token_is_one_clear_error(code):
    s = FakeKFP(refuse=code)
    try:
        with pytest.raises(EndpointError, match=rf"refused the credentials \(HTTP {code}, token from --token\)"):
            submit(parse_config(CFG), host=s.url, token="wrong")
        assert len(s.requests) == 1  # one healthz probe, no retry loop, nothing uploaded
    finally:
        s.close()


def rangefinder_cli(*args: str, home, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`rangefinder ARGS` in a process of its own whose environment holds HOME and nothing else of ours (no ambient
    endpoint or token), bar the PYTHONPATH this test runs under, so it runs the code under test."""
    base = {"PATH": "", "HOME": str(home)}
    if os.environ.get("PYTHONPATH"):
        base["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run([sys.executable, "-m", "rangefinder.cli.main", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=timeout)


def _config_file(tmp_path) -> str:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    return str(cfg)


def test_cli_reports_refusal_on_one_line(tmp_path):
    s = FakeKFP(refuse=401)
    try:
        r = rangefinder_cli("submit", "--host", s.url, "--config", _config_file(tmp_path), "--token", "bad",
                            home=tmp_path)
    finally:
        s.close()
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused the credentials (HTTP 401" in lines[0]


@pytest.mark.parametrize("tag, named", [("1.8.5", "Kubeflow Pipelines 1.8.5"), ("", "Kubeflow Pipelines 1.x")])
def test_a_kfp_v1_api_server_is_named_as_one(kfp_server, tmp_path, tag, named):
    """A KFP 1.x API server answers its v1beta1 API and 404 on every v2beta1 path: the command said "answered HTTP
    404 Not Found on /apis/v2beta1/healthz; check that --host is the KFP API", of a host that is the KFP API. It
    says the server is KFP v1 (by the release its v1 healthz names) and that rangefinder needs 2.x."""
    kfp_server.hook = lambda method, path, rec: (
        (200, {"commit_sha": "0e8d2c8", "tag_name": tag, "multi_user": False})
        if path == "/apis/v1beta1/healthz" else (404, {"error": "Not Found", "code": 5}))
    proc = rangefinder_cli("submit", "--host", kfp_server.url, "--config", _config_file(tmp_path), home=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (f"the KFP endpoint {kfp_server.url} is {named}, a KFP v1 API server (/apis/v2beta1/healthz answered "
            "HTTP 404, /apis/v1beta1/healthz answered); rangefinder needs KFP v2 (2.x): upgrade the install to "
            "Kubeflow Pipelines 2.x, or pass --host of one that runs it") in proc.stderr, proc.stderr
    assert not kfp_server.sent("POST", "/pipelines/upload")
    # Only a server whose v1 healthz answers JSON is called KFP v1: one that answers 404 everywhere (a wrong path,
    # another service) is told to check --host, as before.
    kfp_server.hook = lambda method, path, rec: (404, {"error": "Not Found", "code": 5})
    with pytest.raises(EndpointError, match=r"answered HTTP 404 Not Found on /apis/v2beta1/healthz; check that "
                                            r"--host is the KFP API"):
        submit(parse_config(CFG), host=kfp_server.url)


def test_schedule_cli_rejects_bad_cron_before_any_request(tmp_path):
    s = FakeKFP()
    try:
        r = rangefinder_cli("schedule", "--host", s.url, "--config", _config_file(tmp_path), "--cron", "0 3 * * *",
                            home=tmp_path)
    finally:
        s.close()
    assert r.returncode == 2 and "5 fields" in r.stderr and "'0 0 3 * * *'" in r.stderr
    assert s.requests == []


@pytest.mark.parametrize("expr", ["0 0 3 * * *", "*/30 * * * * ?", "0 0 9 ? * 2-6", "0 15 10 1,15 jan-jun *",
                                  "0 0 0 * * SUN", "5-10/2 0 0 * * *", "0 0 3-3 * * *",  # a one-hour range
                                  # the 31st of the months from April every other month (August has one); the 29th of
                                  # February (leap years); the 31st of February or any Monday of it (either matches)
                                  "0 0 3 31 4/2 *", "0 0 3 29 2 *", "0 0 3 31 2 mon",
                                  # robfig/cron's descriptors, which KFP's API server parses too
                                  "@daily", "@weekly", "@every 12h", "@every 1h30m", "@every 90s"])
def test_valid_crons(expr):
    assert validate_cron(expr) == expr


@pytest.mark.parametrize("expr, message", [
    ("0 3 * * *", "5 fields"),
    ("* * * * * * *", "7 fields"),
    ("60 * * * * *", r"seconds must be in 0-59 \(got 60\)"),
    ("0 0 24 * * *", "hours must be in 0-23"),
    ("0 0 0 0 * *", "day of month must be in 1-31"),
    ("0 0 0 * 13 *", "month must be in 1-12"),
    ("0 0 0 * * 7", r"day of week must be in 0-6 \(got 7\); Sunday is 0 \(or sun\)$"),  # 7 is crontab(5)'s Sunday
    ("0 0 0 * * fun", "day of week field has 'fun'"),
    ("0 */0 * * * *", "step '0'"),
    ("0 10-5 * * * *", "runs backwards"),
    ("? * * * * *", r"'\?' is only allowed"),
    ("0 1,,2 * * * *", "empty entry"),
    ("@fortnightly", "KFP knows @yearly"),
    ("@daily 3", "KFP knows @yearly"),
    ("@every", "@every takes one duration"),
    ("@every 7d", "no d: a week is 168h"),
    ("@every 0s", "under a second"),
    # Dates no month named has: KFP would take the schedule and never run it.
    ("0 0 3 31 2 *", "no month it names has a day 31, so KFP would never run it"),
    ("0 0 3 30-31 feb ?", "no month it names has a day 30 or 31"),
    ("0 0 3 31 4,6,9,11 *", "no month it names has a day 31"),
])
def test_invalid_crons(expr, message):
    with pytest.raises(ConfigError, match=message):
        validate_cron(expr)


# ---------------------------------------------------------------------------------------------------------------
# What a CI job and a team scheduling retraining meet


def test_cli_json_is_the_result_alone(kfp_server, tmp_path):
    """`submit --json` prints one JSON document (the run's id and link in it) and nothing else: kfp's own
    "Pipeline details: ..." lines went to stdout before it, and its FutureWarning to stderr."""
    from tests.cli.test_bad_input import in_process

    r = in_process("submit", "--host", kfp_server.url, "--config", _config_file(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["run_id"] == "r1" and out["run_url"] == f"{kfp_server.url}/#/runs/details/r1"
    assert out["experiment"] == "cats" and out["uploaded"] is True
    assert r.stderr == ""


def test_the_same_config_from_another_process_reuses_the_version(kfp_server, tmp_path):
    """The version is named after the package's hash, and the package is compiled to the same bytes in every process
    (KFP's compiler numbers its components in an order Python's string hashing and protobuf's maps change from one
    process to the next): a CI job submitting the same config again uploads nothing."""
    cfg = _config_file(tmp_path)
    runs = [rangefinder_cli("submit", "--host", kfp_server.url, "--config", cfg, "--json", home=tmp_path,
                            env={"PYTHONHASHSEED": seed}) for seed in ("1", "2")]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr
    first, second = (json.loads(r.stdout) for r in runs)
    assert first["uploaded"] is True and second["uploaded"] is False
    assert second["version_id"] == first["version_id"]
    assert len(kfp_server.sent("POST", "/pipelines/upload_version")) == 1


def test_an_endpoint_that_stops_answering_ends_the_command(kfp_server):
    """An endpoint that answers the healthz probe and then nothing (a stuck proxy, a server under load) ends the
    submit after --request-timeout per request, in one sentence: kfp gives its requests no timeout at all."""
    probes: list[str] = []

    def hang_after_the_probe(method, path, rec):
        if path.endswith("/healthz") and not probes:
            probes.append(path)
            return None
        return "hang"

    kfp_server.hook = hang_after_the_probe
    start = time.monotonic()
    with pytest.raises(EndpointError, match=r"did not answer a request within 0\.5 s; .*--request-timeout"):
        submit(parse_config(CFG), host=kfp_server.url, request_timeout_s=0.5)
    assert time.monotonic() - start < 20
    import kfp_server_api.rest

    assert kfp_server_api.rest.RESTClientObject.request.__name__ == "request"  # kfp is left as it was
    assert kfp_server_api.rest.RESTClientObject.__init__.__name__ == "__init__"


class SilentAfterHealthz:
    """A bare TCP server: the first connection (the healthz probe) gets an answer, every later one is accepted and
    then never answered, as a stuck proxy does. `stalled` counts those."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.stalled = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        answered = False
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            if answered:
                self.stalled += 1
                self.held.append(conn)  # open, never read from nor written to
                continue
            conn.recv(65536)
            body = b'{"multi_user": false}'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            conn.close()
            answered = True

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_stalled_request_waits_request_timeout_once():
    """--request-timeout bounds the wait for an answer: urllib3 sent a GET that timed out three times again, so an
    endpoint that took the connection and said nothing held the command 4x --request-timeout."""
    s = SilentAfterHealthz()
    try:
        start = time.monotonic()
        with pytest.raises(EndpointError, match=r"did not answer a request within 1 s"):
            submit(parse_config(CFG), host=s.url, request_timeout_s=1.0)
        elapsed = time.monotonic() - start
    finally:
        s.close()
    assert s.stalled == 1  # asked once, not again
    assert elapsed < 2.5, elapsed  # 1 s, not 4


@pytest.mark.timeout(300)  # a wait that ignored --timeout 1 would otherwise hang here, not fail
@pytest.mark.parametrize("state, status, line", [
    ("CANCELED", 1, r"run r1 finished CANCELED; see http://\S+/#/runs/details/r1"),
    ("FAILED", 1, "run r1 finished FAILED"),
    ("RUNNING", 1, r"run r1 is still RUNNING after --timeout 1 s \(it goes on on the cluster\)"),
    ("SUCCEEDED", 0, None),
])
def test_wait_exit_status_and_result(kfp_server, tmp_path, state, status, line):
    """`submit --wait` ends on every final state (kfp's own wait knew no CANCELED and waited out --timeout, then
    said it had lost the endpoint) and says how in its exit status: 0 succeeded, 1 anything else, with the result
    (the run's id and link) on stdout all the same and one line on stderr."""
    from tests.cli.test_bad_input import in_process

    kfp_server.run_state = state
    r = in_process("submit", "--host", kfp_server.url, "--config", _config_file(tmp_path), "--json", "--wait",
                   "--timeout", "1")
    assert r.returncode == status, r.stderr
    out = json.loads(r.stdout)
    assert out["run_id"] == "r1" and out["state"] == state and out["run_url"].endswith("/#/runs/details/r1")
    if line:
        (only,) = r.stderr.strip().splitlines()
        assert re.search(line, only), only
    else:
        assert r.stderr == ""


def test_timeout_without_wait_is_said_to_be_ignored(kfp_server, tmp_path):
    """`--timeout` bounds `--wait`; alone it was taken without a word, and a CI job meaning to wait for the run got a
    command that returned, status 0, once the run was created."""
    r = rangefinder_cli("submit", "--host", kfp_server.url, "--config", _config_file(tmp_path), "--timeout", "3600",
                        "--json", home=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["run_id"] == "r1"
    assert r.stderr.splitlines() == ["rangefinder: warning: ignored by `rangefinder submit`: --timeout (it bounds "
                                     "--wait, which is not given: the command returns once the run is created)"]
    assert kfp_server.sent("GET", "/runs/r1") == []  # nothing waited for


def test_wait_outlasts_a_few_failed_polls(kfp_server):
    """A --wait of hours meets a proxy restarting: a poll answered HTTP 503 is tried again, not the end of the wait
    (the run goes on on the cluster either way)."""
    polls: list[int] = []

    def restarting(method, path, rec):
        if method == "GET" and re.search(r"/runs/r\d+$", path):
            polls.append(1)
            if len(polls) <= 2:
                return 503, {"error": "upstream connect error", "code": 14}
        return None

    kfp_server.hook = restarting
    sub = submit(parse_config(CFG), host=kfp_server.url, wait=True, timeout_s=30, poll_s=0.05)
    assert (sub.state, sub.timed_out, len(polls)) == ("SUCCEEDED", False, 3)


def test_wait_gives_up_after_its_tries_of_failed_polls(kfp_server, tmp_path):
    """An endpoint that keeps failing (HTTP 500 as much as 503) is polled WAIT_TRIES times in a row, then the wait
    ends with one line: not once (500 taken for a refusal), nor once more than it says. The run is made all the same:
    the result names it and the line says the wait, exit status 1 as for a run that did not succeed. The command
    ended as one that submitted nothing (status 2, the error alone), and a CI job lost the id of the run going on."""
    from rangefinder.pipelines.client import WAIT_TRIES
    from tests.cli.test_bad_input import in_process

    polls: list[int] = []

    def down(method, path, rec):
        if method == "GET" and re.search(r"/runs/r\d+$", path):
            polls.append(1)
            return (500, {"error": "internal error", "code": 13}) if len(polls) <= WAIT_TRIES else \
                (401, {"error": "token expired", "code": 16})
        return None

    kfp_server.hook = down
    sub = submit(parse_config(CFG), host=kfp_server.url, wait=True, timeout_s=30, poll_s=0.01)
    assert (sub.run_id, sub.state) == ("r1", None) and "HTTP 500" in sub.wait_error
    assert len(polls) == WAIT_TRIES
    # A refusal (a token that expired during a long wait) is not polled again.
    r = in_process("submit", "--host", kfp_server.url, "--config", _config_file(tmp_path), "--json", "--wait")
    assert r.returncode == 1 and json.loads(r.stdout)["run_id"] == "r2" and len(polls) == WAIT_TRIES + 1
    (only,) = r.stderr.strip().splitlines()
    assert re.fullmatch(r"rangefinder submit: run r2 was created, but --wait could not follow it: the KFP endpoint "
                        r"\S+ refused the request \(HTTP 401, .*token expired\).*; see http://\S+/#/runs/details/r2",
                        only), only


def test_two_submits_racing_to_upload_share_the_winner(kfp_server):
    """Two CI jobs submitting at once both find no pipeline (or version) and both upload; KFP refuses the second
    with HTTP 409 AlreadyExists. The loser takes the winner's upload instead of failing."""
    raced: list[str] = []

    def another_job_wins(method, path, rec):
        if method == "POST" and path.endswith(("/pipelines/upload", "/pipelines/upload_version")):
            kfp_server.route(method, path, rec)  # the other job's upload lands first...
            raced.append(path)
            return 409, {"error": "already exists", "code": 6, "message": "already exists"}  # ...and ours is refused
        return None

    kfp_server.hook = another_job_wins
    sub = submit(parse_config(CFG), host=kfp_server.url)
    assert len(raced) == 2 and sub.run_id == "r1"
    (pipeline,) = kfp_server.pipelines.values()
    assert sub.pipeline_id == pipeline["pipeline_id"]
    assert sub.version_id == kfp_server.versions[sub.pipeline_id][-1]["pipeline_version_id"]


def test_multi_user_endpoint_without_a_namespace_is_one_line_before_any_upload(kfp_server):
    kfp_server.multi_user = True
    with pytest.raises(ConfigError, match=r"is multi-user: pass --namespace"):
        submit(parse_config(CFG), host=kfp_server.url)
    assert not kfp_server.sent("POST", "/pipelines/upload") and not kfp_server.sent("POST", "/experiments")

    sub = submit(parse_config(CFG), host=kfp_server.url, namespace="team-a")
    assert kfp_server.experiments[sub.experiment_id]["namespace"] == "team-a"


def test_a_namespace_the_account_may_not_use_is_refused_before_any_upload(kfp_server, tmp_path):
    """The pipeline (a shared one, no namespace) was uploaded, then the experiment's lookup in the namespace refused:
    a refused submit left a pipeline and a version behind. The experiment is looked up first now, so the refusal
    comes before any upload; it names the server's reason and --namespace."""
    kfp_server.multi_user = True
    kfp_server.denied_namespaces = {"team-b"}
    proc = rangefinder_cli("submit", "--config", _config_file(tmp_path), "--host", kfp_server.url, "--namespace",
                           "team-b", home=tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "refused the request (HTTP 403" in proc.stderr and "Namespace:team-b" in proc.stderr, proc.stderr
    assert "--namespace" in proc.stderr
    assert not kfp_server.sent("POST", "/pipelines/upload") and not kfp_server.sent("POST", "/upload_version")
    assert not kfp_server.pipelines and not kfp_server.experiments

    sub = submit(parse_config(CFG), host=kfp_server.url, namespace="team-a")
    assert kfp_server.experiments[sub.experiment_id]["namespace"] == "team-a" and sub.experiment_created


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory) -> tuple[str, str]:
    """A certificate for 127.0.0.1 signed by itself, and its key (PEM files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kfp.test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                       serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    return str(folder / "cert.pem"), str(folder / "key.pem")


def test_tls_problems_are_one_line_naming_the_fix(self_signed):
    """A private CA's certificate: one line naming --ca-cert (the probe trusts what kfp trusts, certifi's CAs, so a
    CA only this machine's store holds no longer passes the probe and fails in kfp in urllib3's words); with
    --ca-cert both trust it. https:// to a plain-HTTP port: one line saying to use http://."""
    s = FakeKFP(tls=self_signed)
    plain = FakeKFP()
    try:
        with pytest.raises(EndpointError, match=r"presented a certificate this machine does not trust \(.*"
                                                r"self-signed.*\); pass --ca-cert FILE"):
            submit(parse_config(CFG), host=s.url)
        sub = submit(parse_config(CFG), host=s.url, ca_cert=self_signed[0])
        assert sub.run_id == "r1"
        with pytest.raises(EndpointError, match=r"TLS handshake with the KFP endpoint https://\S+ failed .*use "
                                                r"http://"):
            submit(parse_config(CFG), host=plain.url.replace("http://", "https://"))
    finally:
        s.close()
        plain.close()


def test_a_ca_cert_holding_no_certificate_is_said_before_any_request(self_signed, kfp_server, tmp_path):
    """--ca-cert given the server's private key (the file beside its certificate) or an empty file: one line saying
    the file holds no certificate, before any request; it was "cannot reach the KFP endpoint
    (NO_CERTIFICATE_OR_CRL_FOUND); check --host", sending the user after the endpoint."""
    empty = tmp_path / "ca.pem"
    empty.write_text("")
    for wrong in (self_signed[1], str(empty)):
        with pytest.raises(ConfigError, match=rf"^--ca-cert {re.escape(wrong)} holds no PEM certificate "
                                              r"\(NO_CERTIFICATE_OR_CRL_FOUND\); give the PEM file "):
            submit(parse_config(CFG), host=kfp_server.url.replace("http://", "https://"), ca_cert=wrong)
    assert kfp_server.requests == []


def test_a_login_page_an_auth_proxy_redirects_to_is_said_and_gets_no_token():
    """An auth proxy before KFP (oauth2-proxy, Dex) sends a request it does not let in (an expired token) to its
    login page, which answers 200 with HTML. That was "did not answer JSON; is --host the KFP endpoint?", and the
    token went along to the login page, wherever the redirect pointed. Now one line naming the redirect and the fix
    (not the login's query, which holds its state), and the token stays with the endpoint it was given for."""
    seen: list[tuple[str, str | None]] = []

    class LoginProxy(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            if self.path.startswith("/apis/"):
                self.send_response(302)
                self.send_header("Location", "/dex/auth?client_id=kubeflow-oidc&state=login-state-4411")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            page = b"<html><body>Log in to Your Account</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

    server = ThreadingHTTPServer(("127.0.0.1", 0), LoginProxy)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    host = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(EndpointError) as e:
            submit(parse_config(CFG), host=host, token="expired-token")
    finally:
        server.shutdown()
        server.server_close()
    assert str(e.value) == (f"the KFP endpoint {host} redirected the request to {host}/dex/auth, as an auth proxy "
                            "sends one it does not let in to its login page (token from --token); pass a valid "
                            "--token")
    assert seen == [("/apis/v2beta1/healthz", "Bearer expired-token"),
                    ("/dex/auth?client_id=kubeflow-oidc&state=login-state-4411", None)]


def test_a_request_refused_after_the_probe_says_why(kfp_server):
    """Healthz answers anyone; the pipelines API may refuse this account (a profile it has no access to). The line
    carries the server's reason, and names --namespace beside --token."""
    kfp_server.hook = lambda method, path, rec: None if path.endswith("/healthz") else (
        403, {"error": "User 'ci@example.com' is not authorized with reason: PermissionDenied", "code": 7})
    with pytest.raises(EndpointError, match=r"refused the request \(HTTP 403, token from --token: User "
                                            r"'ci@example.com' is not authorized.*\).*--namespace"):
        submit(parse_config(CFG), host=kfp_server.url, token="t")


def test_credentials_in_the_host_url_are_refused_unshown():
    with pytest.raises(ConfigError, match=r"--host holds a user name and password; .*--token") as e:
        submit(parse_config(CFG), host="https://ci:hunter2@kfp.example.com")
    assert "hunter2" not in str(e.value)


def test_a_token_as_a_ci_secret_holds_it_is_sent_or_refused_unshown(kfp_server, monkeypatch, tmp_path):
    """A CI secret's trailing newline (`--token "$KFP_TOKEN"`) made http.client raise a traceback that printed the
    token; it is stripped, as a token file's always was. A line break inside, or a copied `Bearer ` prefix (sent
    twice, and refused as a wrong token), is one line before any request, the token unshown."""
    kfp_server.token = "ci-token-5521"
    assert submit(parse_config(CFG), host=kfp_server.url, token="ci-token-5521\n").run_id == "r1"
    sent = len(kfp_server.requests)
    with pytest.raises(ConfigError, match=r"^--token starts with 'Bearer ', which the request adds itself; give the "
                                          r"token alone$"):
        submit(parse_config(CFG), host=kfp_server.url, token="Bearer ci-token-5521")
    with pytest.raises(ConfigError, match=r"^--token holds a space, line break or control character") as e:
        submit(parse_config(CFG), host=kfp_server.url, token="ci-token-5521\nci-token-5521")
    assert "5521" not in str(e.value)
    token_file = tmp_path / "token"
    token_file.write_text("ci-token-5521 ci-token-5521\n")
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(token_file))
    with pytest.raises(ConfigError, match=r"^the token file \S+token holds a space, line break or control character"):
        submit(parse_config(CFG), host=kfp_server.url)
    assert len(kfp_server.requests) == sent


def test_a_dataset_uri_with_credentials_or_no_object_store_is_refused_before_any_request(kfp_server, tmp_path):
    """--dataset-uri becomes a parameter of the run, shown in the KFP UI: one holding keys was sent with them, and a
    folder's path (the dataset_dir a CLI user knows) made a run whose importer failed on the cluster. Each is one line,
    the keys unshown, before any request (and before the warning that the URI replaces data.dataset_dir)."""
    with pytest.raises(ConfigError, match=r"^--dataset-uri holds a user name and password, .*KFP's own Secret$") as e:
        submit(parse_config(CFG), host=kfp_server.url, dataset_uri="s3://AKIAEXAMPLE:hunter2@bucket/cats")
    assert "hunter2" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^--dataset-uri holds a secret in its query \(token=\)"):
        submit(parse_config(CFG), host=kfp_server.url, dataset_uri="s3://bucket/cats?token=abc")
    r = rangefinder_cli("submit", "--host", kfp_server.url, "--config", _config_file(tmp_path), "--dataset-uri",
                        "/data/sets/cats", home=tmp_path)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "rangefinder submit: error: --dataset-uri '/data/sets/cats' is not an object-store URI (s3://, gs://, "
        "minio://), which KFP's importer downloads; for a folder on the data volume set data.dataset_dir in the "
        "config and leave --dataset-uri out"]
    assert kfp_server.requests == []
    assert submit(parse_config(CFG), host=kfp_server.url, dataset_uri="minio://mlpipeline/cats").run_id == "r1"


def test_a_token_path_that_names_no_file_or_an_empty_one_is_said(kfp_server, monkeypatch, tmp_path):
    kfp_server.token = "sa-token"
    monkeypatch.setenv("KF_PIPELINES_SA_TOKEN_PATH", str(tmp_path / "tokn"))
    with pytest.raises(EndpointError, match=r"\(HTTP 401, no token: \$KF_PIPELINES_SA_TOKEN_PATH names \S+tokn, "
                                            r"which is not a file\)"):
        submit(parse_config(CFG), host=kfp_server.url)
    # An empty token file (a CI secret never filled in) sends none: said so, not as if a token had been refused.
    (tmp_path / "tokn").write_text("\n")
    with pytest.raises(EndpointError, match=r"\(HTTP 401, service-account token \S+tokn, which is empty: no token "
                                            r"was sent\)"):
        submit(parse_config(CFG), host=kfp_server.url)


def test_once_reuses_a_live_run_of_the_name(kfp_server):
    """A CI job retried after its run was created starts no second training with --once --name; a run of the name
    that failed is started again."""
    cfg = parse_config(CFG)
    first = submit(cfg, host=kfp_server.url, run_name="release-1.2", once=True)
    again = submit(cfg, host=kfp_server.url, run_name="release-1.2", once=True)
    assert (first.reused_run, again.reused_run, again.run_id) == (False, True, first.run_id)
    # The newest run of the name is the one looked at: KFP lists oldest first unless asked otherwise.
    assert kfp_server.sent("GET", "/runs")[-1]["query"]["sort_by"] == ["created_at desc"]
    assert len(kfp_server.sent("POST", "/runs")) == 1

    kfp_server.runs[first.run_id]["state"] = "FAILED"
    retried = submit(cfg, host=kfp_server.url, run_name="release-1.2", once=True)
    assert retried.reused_run is False and retried.run_id != first.run_id
    with pytest.raises(ConfigError, match="--once needs --name"):
        submit(cfg, host=kfp_server.url, once=True)


def test_schedule_again_is_refused_unless_replace(kfp_server, tmp_path):
    """A second `schedule` of the same name in the experiment (a changed config, a re-run deploy job) would have
    added a second nightly retrain beside the first; the default name was the version's, so a changed config always
    did. It is refused, naming the one there; --replace makes the new one and disables the old."""
    from tests.cli.test_bad_input import in_process

    cfg = _config_file(tmp_path)
    r = in_process("schedule", "--host", kfp_server.url, "--config", cfg, "--cron", "0 0 3 * * *", "--json")
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)
    assert first["name"] == PIPELINE_NAME and first["recurring_run_url"].endswith("/#/recurringrun/details/rr1")

    r = in_process("schedule", "--host", kfp_server.url, "--config", cfg, "--cron", "0 0 4 * * *")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert f"experiment 'cats' already has an enabled recurring run named '{PIPELINE_NAME}': rr1 (cron " \
           "'0 0 3 * * *'); pass --replace" in line
    assert len(kfp_server.recurring_runs) == 1

    r = in_process("schedule", "--host", kfp_server.url, "--config", cfg, "--cron", "@every 12h", "--replace",
                   "--max-concurrency", "2", "--catchup", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["recurring_run_id"] == "rr2" and out["replaced"] == ["rr1"]
    assert kfp_server.recurring_runs["rr1"]["status"] == "DISABLED"
    body = json.loads(kfp_server.sent("POST", "/recurringruns")[-1]["body"])
    assert body["trigger"]["cron_schedule"]["cron"] == "@every 12h"
    assert int(body["max_concurrency"]) == 2 and body["no_catchup"] is False

    # Another name stands beside it.
    assert in_process("schedule", "--host", kfp_server.url, "--config", cfg, "--cron", "@weekly", "--name",
                      "weekly").returncode == 0

    # An old one the endpoint fails to disable stays enabled beside the new one: said, with the new one's result and
    # status 1. It ended as a schedule that made nothing (status 2, the error alone): two schedules trained nightly.
    kfp_server.hook = lambda method, path, rec: (503, {"error": "upstream connect error", "code": 14}) if (
        method == "POST" and path.endswith(":disable")) else None
    r = in_process("schedule", "--host", kfp_server.url, "--config", cfg, "--cron", "@daily", "--replace", "--json")
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["recurring_run_id"] == "rr4" and out["replaced"] == []
    assert kfp_server.recurring_runs["rr2"]["status"] != "DISABLED"
    (line,) = r.stderr.strip().splitlines()
    assert re.fullmatch(r"rangefinder schedule: recurring run rr4 was created, but recurring run rr2 is still enabled "
                        r"\(the KFP endpoint \S+ answered HTTP 503 .*\); run the same command again to disable it, "
                        r"or disable it in the KFP UI", line), line


def test_every_submit_flag_reaches_the_request(kfp_server, tmp_path):
    """--name, --once, --dataset-uri and --namespace, through the command as a CI job gives them: each was read by
    submit() in the tests above, but the command could drop one on its way there without a test noticing."""
    from tests.cli.test_bad_input import in_process

    cfg = _config_file(tmp_path)
    flags = ("submit", "--host", kfp_server.url, "--config", cfg, "--name", "release-1", "--once", "--dataset-uri",
             "s3://bucket/cats", "--namespace", "team-a", "--json")
    first = json.loads(in_process(*flags).stdout)
    body = json.loads(kfp_server.sent("POST", "/runs")[-1]["body"])
    assert (body["display_name"], body["runtime_config"]["parameters"]["dataset_uri"]) == ("release-1",
                                                                                           "s3://bucket/cats")
    assert kfp_server.experiments[first["experiment_id"]]["namespace"] == "team-a"
    again = json.loads(in_process(*flags).stdout)
    assert (again["run_id"], again["reused_run"]) == (first["run_id"], True)
    assert len(kfp_server.sent("POST", "/runs")) == 1


def test_a_made_experiment_is_said(kfp_server, tmp_path):
    """kfp's create_experiment gets or makes one without a word, so `--experiment catz` for cats put the run in a new
    experiment unseen. A missing experiment is still made (a scheduled job outlives a deleted one), and the result
    says so: `experiment_created` in --json, a note naming the flag to correct in the table."""
    from tests.cli.test_bad_input import in_process

    cfg = _config_file(tmp_path)
    first = json.loads(in_process("submit", "--host", kfp_server.url, "--config", cfg, "--json").stdout)
    assert (first["experiment"], first["experiment_created"]) == ("cats", True)
    again = json.loads(in_process("submit", "--host", kfp_server.url, "--config", cfg, "--json").stdout)
    assert (again["experiment_id"], again["experiment_created"]) == (first["experiment_id"], False)

    r = in_process("submit", "--host", kfp_server.url, "--config", cfg, "--experiment", "catz")
    assert r.returncode == 0, r.stderr
    (row,) = [line for line in r.stdout.splitlines() if line.startswith("experiment ")]
    assert row.split(None, 1)[1] == ("catz (created: KFP had no experiment of that name; if you meant an existing "
                                     "one, correct --experiment)")
    r = in_process("schedule", "--host", kfp_server.url, "--config", cfg, "--cron", "@daily", "--experiment", "catz")
    (row,) = [line for line in r.stdout.splitlines() if line.startswith("experiment ")]
    assert row.split() == ["experiment", "catz"]
    assert sorted(e["display_name"] for e in kfp_server.experiments.values()) == ["cats", "catz"]

    # Another submit made it between our look and our create (KFP refuses the second, HTTP 409): that one is used.
    def another_job_wins(method, path, rec):
        if method == "POST" and path.endswith("/experiments"):
            kfp_server.route(method, path, rec)
            return 409, {"error": "already exists", "code": 6, "message": "already exists"}
        return None

    kfp_server.hook = another_job_wins
    sub = submit(parse_config(CFG), host=kfp_server.url, experiment="dogs")
    assert kfp_server.experiments[sub.experiment_id]["display_name"] == "dogs" and not sub.experiment_created


def test_links_point_at_the_kfp_ui(kfp_server, tmp_path):
    """--host is often the API server (a port-forward of ml-pipeline, its in-cluster service), which serves no UI: the
    links went there all the same. --ui-url, else kfp's $KF_PIPELINES_UI_ENDPOINT, says where the UI is, and links
    its routes as kfp.Client does (`{ui}/#/runs/details/{id}`); without either, the table says the link assumes the
    endpoint serves the UI."""
    from tests.cli.test_bad_input import in_process

    cfg = _config_file(tmp_path)
    out = json.loads(in_process("submit", "--host", kfp_server.url, "--config", cfg, "--json", "--ui-url",
                                "https://kubeflow.example.com/pipeline/#/runs").stdout)  # copied from the browser
    assert out["run_url"] == "https://kubeflow.example.com/pipeline/#/runs/details/r1"
    assert (out["host"], out["ui_url"]) == (kfp_server.url, "https://kubeflow.example.com/pipeline")

    # kfp's variable, which kfp reads without a scheme as http://
    r = in_process("schedule", "--host", kfp_server.url, "--config", cfg, "--cron", "@daily",
                   env={"KF_PIPELINES_UI_ENDPOINT": "localhost:8080"})
    rows = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert rows["recurring_run_url"] == "http://localhost:8080/#/recurringrun/details/rr1"
    assert rows["ui_url"] == "http://localhost:8080"

    r = in_process("submit", "--host", kfp_server.url, "--config", cfg)
    rows = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert rows["run_url"] == f"{kfp_server.url}/#/runs/details/r2"
    assert rows["ui_url"] == (f"{kfp_server.url} (the endpoint, assumed to serve the KFP UI; where it does not, pass "
                              "--ui-url or set $KF_PIPELINES_UI_ENDPOINT)")

    # A password in it would be printed in every link: one line, before any request, not showing it.
    sent = len(kfp_server.requests)
    r = in_process("submit", "--host", kfp_server.url, "--config", cfg, "--ui-url", "https://ci:hunter2@kfp.example")
    (line,) = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "--ui-url holds a user name and password" in line and "hunter2" not in line
    assert len(kfp_server.requests) == sent
