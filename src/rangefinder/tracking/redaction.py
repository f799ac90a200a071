"""Keeping secrets out of MLflow: params, tags, run names and error messages pass through `redact` first.

Three nets, because a config or a message can carry a secret in several ways:
1. by name: a setting whose last dotted part names a secret (`password`, `api_key`, `token`, ...), but for the
   settings that only name a Kubernetes Secret or its key (config.SECRET_REFERENCES);
2. by value: anything equal to the value of a secret-looking environment variable (MLFLOW_TRACKING_PASSWORD,
   HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...), and well-known token shapes (Hugging Face, GitHub, AWS, JWT);
3. in URLs: the `user:password@` part of any URL is dropped.
"""

from __future__ import annotations

import re
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

# The rules for what is a secret setting and a URL with credentials live with the settings (config reads them when
# it validates); they are used from here too.
from rangefinder.config import CREDENTIALS_FIX, REDACTED, is_secret_key, uri_credentials
from rangefinder.redaction import URL_USERINFO, error_line, redact

__all__ = ["CREDENTIALS_FIX", "REDACTED", "RedactingWriter", "error_line", "is_secret_key", "redact", "safe_uri",
           "uri_credentials", "url_with_credentials"]


def url_with_credentials(text: str) -> Optional[str]:
    """The first URL in `text` that carries `user[:password]@`, shown without them; None when there is none."""
    m = URL_USERINFO.search(text)
    if not m:
        return None
    url = re.match(r"[^\s\"',]*", text[m.start():])
    return safe_uri(url.group(0) if url else m.group(0))


def safe_uri(uri: str) -> str:
    """A tracking URI fit for a message or a tag: no `user:password@`, no query string (it may hold a token)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return redact(uri)
    if not parts.scheme or parts.scheme in ("sqlite", "file", "postgresql", "mysql", "mssql") and "@" not in uri:
        return redact(uri)
    netloc = parts.hostname or ""
    if parts.port:
        netloc = f"{netloc}:{parts.port}"
    return redact(urlunsplit((parts.scheme, netloc, parts.path, "", "")))


class RedactingWriter:
    """A text stream that passes whole lines through `redact` on their way to `stream` (a log file, the terminal).

    Text is held until its line ends, so a secret written in two pieces (print writes the text, then the newline)
    is still seen whole; `flush` writes out what is held.
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self._held = ""

    def write(self, text: str) -> int:
        self._held += text
        if "\n" in self._held:
            lines, self._held = self._held.rsplit("\n", 1)
            self.stream.write(redact(lines) + "\n")
        return len(text)

    def flush(self) -> None:
        if self._held:
            self.stream.write(redact(self._held))
            self._held = ""
        self.stream.flush()

    def isatty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())
