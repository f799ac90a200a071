"""Secrets out of every line a user or a log sees: `redact` replaces what a text carries of one with ***.

Below every layer (tracking's params and tags, a step's or a command's error line, rangefinder.errors) so that each
can use it. By value: anything equal to the value of a secret-looking environment variable (MLFLOW_TRACKING_PASSWORD,
HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...), and well-known token shapes (Hugging Face, GitHub, AWS, JWT); in URLs: the
`user:password@` part of any URL is dropped. (By name, a secret setting: config.is_secret_key.)
"""

from __future__ import annotations

import os
import re
from typing import Any

# What stands for a hidden value (config.REDACTED names it for the settings).
REDACTED = "***"

# Environment variables whose values are secrets wherever they turn up.
_SECRET_ENV = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL", re.IGNORECASE)
_TOKEN_SHAPES = re.compile(
    r"hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{20,}"  # GitHub
    r"|AKIA[0-9A-Z]{16}"  # AWS access key id
    r"|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"  # JWT (bearer tokens, service-account tokens)
)
URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
_MIN_SECRET_LEN = 4  # shorter env values ("1", "true") would redact half of every message


def _env_secrets() -> list[str]:
    env: dict[str, str] = {}
    for _ in range(5):  # another thread (mlflow's telemetry) may change os.environ while we copy it
        try:
            env = dict(os.environ)
            break
        except (KeyError, RuntimeError):
            continue
    vals = {v for k, v in env.items() if _SECRET_ENV.search(k) and v and len(v) >= _MIN_SECRET_LEN}
    return sorted(vals, key=len, reverse=True)  # longest first, so a secret containing another is hidden whole


def redact(text: Any) -> str:
    """`text` as a string with every secret it carries replaced by ***."""
    s = str(text)
    s = URL_USERINFO.sub(r"\g<scheme>", s)
    for secret in _env_secrets():
        s = s.replace(secret, REDACTED)
    return _TOKEN_SHAPES.sub(REDACTED, s)


def error_line(e: BaseException, limit: int) -> str:
    """`e`'s message as one line a log or an error can carry: its first line, redacted and cut to `limit` characters;
    its type's name where it has none."""
    return redact(e).splitlines()[0][:limit] if str(e) else type(e).__name__
