"""Secrets never reach MLflow: by key name, by value (secret environment variables, token shapes), in URLs."""

from __future__ import annotations

from rangefinder.tracking import flatten_params, redact, safe_uri


def test_urls_lose_their_credentials_and_query():
    assert safe_uri("http://bob:s3cr3t@mlflow.example:5000/prefix?token=abc") == "http://mlflow.example:5000/prefix"
    assert safe_uri("sqlite:////tmp/out/mlflow.db") == "sqlite:////tmp/out/mlflow.db"
    assert safe_uri("postgresql://user:pw@db:5432/mlflow") == "postgresql://db:5432/mlflow"
    assert redact("see https://bob:s3cr3t@host/x and more") == "see https://host/x and more"


def test_values_of_secret_environment_variables_and_token_shapes(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2-long")
    monkeypatch.setenv("SOME_DEBUG_FLAG", "hunter2-long-not-a-secret-name")  # a name that says nothing
    text = "pw hunter2-long, hf hf_ABCDEFGHIJKLMNOPQRSTUVWXYZ, aws AKIAABCDEFGHIJKLMNOP"
    assert redact(text) == "pw ***, hf ***, aws ***"


def test_secret_named_settings_are_hidden_and_look_alikes_kept():
    params = flatten_params({
        "hub": {"token": "abc", "password": "p", "api_key": "k", "client_secret": "c"},
        "textual_inversion": {"placeholder_token": "<rf-concept>", "initializer_token": "object"},
        "training": {"lr": 1e-4, "target_modules": ["to_k", "to_q"]},
        "sampling": {"prompts": ["x" * 600]},
    })
    assert [params[f"hub.{k}"] for k in ("token", "password", "api_key", "client_secret")] == ["***"] * 4
    assert params["textual_inversion.placeholder_token"] == "<rf-concept>"
    assert params["textual_inversion.initializer_token"] == "object"
    assert params["training.lr"] == "0.0001" and params["training.target_modules"] == '["to_k","to_q"]'
    assert len(params["sampling.prompts"]) <= 500 and params["sampling.prompts"].endswith("chars)")
