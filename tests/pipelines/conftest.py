"""Fixtures for the pipeline tests."""

from tests.tracking.fixtures import mlflow_server_uri  # noqa: F401  (a real `mlflow server` on loopback)
