"""A real `mlflow server`, started with the manifest's --allowed-hosts, answers a client that uses the in-cluster
tracking URI (KubernetesConfig.mlflow_tracking_uri) and refuses any other Host: the check MLflow makes on every
request, run as the cluster would run it, minus the cluster."""

from __future__ import annotations

import http.client
from urllib.parse import urlparse

import pytest

from rangefinder.config import KubernetesConfig
from tests.tracking.conftest import start_mlflow_server, stop_mlflow_server

PATH = "/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"


def _status(server_uri: str, host_header: str) -> int:
    server = urlparse(server_uri)
    conn = http.client.HTTPConnection(server.hostname, server.port, timeout=30)
    try:
        conn.request("GET", PATH, headers={"Host": host_header})
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.slow
def test_mlflow_accepts_the_in_cluster_name_and_nothing_else(rendered, tmp_path):
    deployment = rendered["mlflow"].find("Deployment", "mlflow")
    (flag,) = [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
               if a.startswith("--allowed-hosts=")]
    uri, proc = start_mlflow_server(tmp_path / "server", allowed_hosts=flag.split("=", 1)[1])
    try:
        in_cluster = urlparse(KubernetesConfig().mlflow_tracking_uri)
        assert _status(uri, in_cluster.netloc) == 200  # what the MLflow client sends: host:port
        assert _status(uri, "localhost:5000") == 200  # kubectl port-forward svc/mlflow 5000
        assert _status(uri, f"attacker.example:{in_cluster.port}") == 403
        assert _status(uri, f"{in_cluster.hostname}.attacker.example:{in_cluster.port}") == 403
    finally:
        stop_mlflow_server(proc)
