"""A Hugging Face hub stand-in for tests that must not touch the network.

- `make_cached_repo`: a model repo laid out in a Hugging Face cache exactly as `hf download` leaves it
  (`models--org--name/{blobs/<sha256>, refs/<ref>, snapshots/<commit>/<path> -> ../../blobs/<sha256>}`), made from a
  local diffusers folder (the tiny model), so `from_pretrained("org/name")` resolves it with HF_HUB_OFFLINE=1.
- `FakeHubServer`: an HTTP server on loopback that answers the hub's metadata calls the way the hub does for a
  gated repo, a missing repo and a missing revision (status codes and `X-Error-Code` headers, which huggingface_hub
  turns into GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError). Point HF_ENDPOINT at it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional


def make_cached_repo(cache: Path, repo_id: str, source: Path, *, refs: tuple[str, ...] = ("main",),
                     commit: Optional[str] = None) -> str:
    """Put the files of `source` into `cache` as hub repo `repo_id` at one commit, with `refs` pointing at it.
    Returns the commit hash."""
    files = sorted(p for p in Path(source).rglob("*") if p.is_file())
    commit = commit or hashlib.sha1(b"".join(p.read_bytes() for p in files) + repo_id.encode()).hexdigest()
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for p in files:
        data = p.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(p, blob)
        link = snapshot / p.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return commit


class FakeHubServer:
    """The hub's answers for three repos: `gated_repo` (public metadata, files behind a licence), anything else
    (not found), and revision `missing_revision` of the gated repo (not found)."""

    def __init__(self, gated_repo: str = "gated-org/gated-model", missing_revision: str = "no-such-branch"):
        self.gated_repo, self.missing_revision = gated_repo, missing_revision
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: dict, error_code: Optional[str] = None):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if error_code:
                    self.send_header("X-Error-Code", error_code)
                    self.send_header("X-Error-Message", body.get("error", ""))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _answer(self):
                server.requests.append(f"{self.command} {self.path}")
                path = self.path.split("?")[0]
                if path.startswith("/api/models/"):
                    repo, _, revision = path[len("/api/models/"):].partition("/revision/")
                    if repo != server.gated_repo:
                        return self._send(401, {"error": "Repository Not Found"}, "RepoNotFound")
                    if revision == server.missing_revision:
                        return self._send(404, {"error": f"Invalid rev id: {revision}"}, "RevisionNotFound")
                    return self._send(200, {"id": repo, "modelId": repo, "sha": "0" * 40, "gated": "manual",
                                            "private": False, "siblings": [{"rfilename": "model_index.json"}]})
                if path.startswith(f"/{server.gated_repo}/resolve/"):
                    return self._send(403, {"error": "Access to model is restricted: accept the conditions"},
                                      "GatedRepo")
                return self._send(401, {"error": "Repository Not Found"}, "RepoNotFound")

            do_GET = do_HEAD = _answer

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeHubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
