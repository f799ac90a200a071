"""Every tracking test runs against real MLflow stores (see fixtures.py) with a clean MLflow environment."""

import pytest

from tests.tracking.fixtures import *  # noqa: F401,F403  (the fixtures, for this folder)


@pytest.fixture(autouse=True)
def _clean_env(clean_mlflow_env):
    yield
