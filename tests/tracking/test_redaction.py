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


def test_a_redacting_stream_sees_secrets_written_in_pieces(monkeypatch):
    import io

    from rangefinder.tracking.redaction import RedactingWriter

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "rf-Secret-4417-pw")
    sink = io.StringIO()
    w = RedactingWriter(sink)
    for piece in ("uri http://alice:pw1234", "5@host:5000/x and rf-Secr", "et-4417-pw", "\n", "tail rf-Secret-4417-pw"):
        w.write(piece)
    assert sink.getvalue() == "uri http://host:5000/x and ***\n"  # nothing of an unfinished line yet
    w.flush()
    assert sink.getvalue() == "uri http://host:5000/x and ***\ntail ***"


def test_uri_credentials_names_what_is_there_never_the_value():
    from rangefinder.tracking.redaction import uri_credentials

    assert uri_credentials("http://alice:pw@host:5000") == "a user name and password"
    assert uri_credentials("https://alice@host") == "a user name"
    assert uri_credentials("https://host/api?token=abc&x=1") == "a secret in its query (token=)"
    for clean in ("http://host:5000", "sqlite:////tmp/a@b.db", "https://host/?placeholder_token=x", "databricks"):
        assert uri_credentials(clean) is None, clean
