"""Secrets never reach MLflow: by key name, by value (secret environment variables, token shapes), in URLs."""

from __future__ import annotations

from rangefinder.tracking import flatten_params, redact, safe_uri


def test_urls_lose_their_credentials_and_query():
    assert safe_uri("http://bob:s3cr3t@mlflow.example:5000/prefix?token=abc") == "http://mlflow.example:5000/prefix"
    assert safe_uri("sqlite:////tmp/out/mlflow.db") == "sqlite:////tmp/out/mlflow.db"
    assert safe_uri("postgresql://user:pw@db:5432/mlflow") == "postgresql://db:5432/mlflow"
    assert safe_uri("postgresql://user:pw@db/mlflow?password=pw") == "postgresql://db/mlflow"  # libpq's query too
    assert redact("see https://bob:s3cr3t@host/x and more") == "see https://host/x and more"


def test_values_of_secret_environment_variables_and_token_shapes(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2-long")
    monkeypatch.setenv("SOME_DEBUG_FLAG", "hunter2-long-not-a-secret-name")  # a name that says nothing
    text = "pw hunter2-long, hf hf_ABCDEFGHIJKLMNOPQRSTUVWXYZ, aws AKIAABCDEFGHIJKLMNOP"
    assert redact(text) == "pw ***, hf ***, aws ***"


def test_every_kind_of_secret_variable_is_hidden_whole_down_to_four_characters(monkeypatch):
    """A bearer token (MLFLOW_TRACKING_TOKEN) in no known shape, a secret that holds another one (hidden whole, not
    as *** and the rest), and a 4-character password (the shortest hidden)."""
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "opaque-bearer-9c1f")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "rf-pw-0451")
    monkeypatch.setenv("HF_TOKEN", "rf-pw-0451-and-more")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "w7Qz")
    assert redact("Bearer opaque-bearer-9c1f; rf-pw-0451-and-more, rf-pw-0451, w7Qz") == "Bearer ***; ***, ***, ***"


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
    # Pre-signed object store URLs (a dataset's): S3's (SigV4), GCS's and Azure's SAS grants.
    s3 = ("https://b.s3.amazonaws.com/d.zip?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA%2F20261207&"
          "X-Amz-Security-Token=FwoG&X-Amz-Signature=abc123")
    assert uri_credentials(s3) == "a secret in its query (X-Amz-Credential=, X-Amz-Security-Token=, X-Amz-Signature=)"
    assert uri_credentials("https://storage.googleapis.com/b/d?X-Goog-Signature=ab") == (
        "a secret in its query (X-Goog-Signature=)")
    assert uri_credentials("https://a.blob.core.windows.net/c/d?sv=2022&sig=abc%3D") == "a secret in its query (sig=)"
    for clean in ("http://host:5000", "sqlite:////tmp/a@b.db", "https://host/?placeholder_token=x", "databricks"):
        assert uri_credentials(clean) is None, clean


def test_only_the_settings_naming_a_kubernetes_secret_look_secret_and_are_kept():
    """No setting holds a credential (they come from the environment), so every setting whose name looks secret only
    names where one is kept, and is logged as it is (the run's config.yaml is read back); a new setting named like a
    credential must be decided on here, not logged as *** without a word."""
    from pydantic import BaseModel

    from rangefinder.config import SECRET_REFERENCES, RangefinderConfig, is_secret_key

    def settings(model: type[BaseModel], prefix: str = "") -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            sub = field.annotation
            out += settings(sub, f"{prefix}{name}.") if isinstance(sub, type) and issubclass(sub, BaseModel) else [
                prefix + name]
        return out

    names = settings(RangefinderConfig)
    assert "kubernetes.mlflow_secret" in names and "training.lora.rank" in names
    # The bare last part, out of its section, is what the name alone says.
    assert {n for n in names if is_secret_key(n.rsplit(".", 1)[-1])} == SECRET_REFERENCES
    params = flatten_params(RangefinderConfig())
    assert params["kubernetes.mlflow_secret"] == "mlflow-credentials"
    assert params["kubernetes.hf_token_secret_key"] == "HF_TOKEN"
    # The same words anywhere else are still hidden.
    assert flatten_params({"hf_token_secret": "x", "vault": {"mlflow_secret": "y"}}) == {
        "hf_token_secret": "***", "vault.mlflow_secret": "***"}


def test_a_logged_config_reads_back_refused_only_where_its_masking_hid_a_value(monkeypatch, tmp_path):
    """The run's config.yaml hides a value whole, a secret-named setting's (a pod label `api_key`) or a string's
    that held a secret (a prompt with the tracking password in it), and reading it back refuses exactly those, in one
    line naming each. A *** of the user's own ("a ***bold*** sign") was refused as a hidden secret too; it is a
    prompt, and reads back as it is."""
    import pytest
    import yaml

    from rangefinder.config import RangefinderConfig, load_config
    from rangefinder.errors import ConfigError
    from rangefinder.tracking.runs import config_text

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-pw-7781")
    clean = RangefinderConfig(sampling={"prompts": ["a ***bold*** sign", "***a star*** on white"]},
                              kubernetes={"pod_labels": {"team": "vision"}})
    leaky = clean.model_copy(update={
        "sampling": clean.sampling.model_copy(update={"prompts": ["a ***bold*** sign", "a cat s3cret-pw-7781"]}),
        "kubernetes": clean.kubernetes.model_copy(update={"pod_labels": {"team": "vision", "api_key": "k-123456"}})})
    for name, cfg in (("clean", clean), ("leaky", leaky)):
        (tmp_path / f"{name}.yaml").write_text(config_text(cfg))
    logged = yaml.safe_load((tmp_path / "leaky.yaml").read_text())
    assert logged["sampling"]["prompts"] == ["a ***bold*** sign", "***"]
    assert logged["kubernetes"]["pod_labels"] == {"team": "vision", "api_key": "***"}

    assert load_config(tmp_path / "clean.yaml") == clean
    with pytest.raises(ConfigError) as refused:
        load_config(tmp_path / "leaky.yaml")
    assert str(refused.value) == ("kubernetes.pod_labels.api_key, sampling.prompts.1: *** stands where MLflow's copy "
                                  "of a run's config hid a secret; write the setting's value in its place")
