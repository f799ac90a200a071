"""What a step could not log to MLflow, kept on disk until `rangefinder relog SPOOL` logs it.

Every logging call of a step (tracking/runs.py) is a *record*: a JSON object naming the run and what to log
(metrics, params, tags, dataset inputs, an artifact, a text, an image, the run's end). `apply_record` is the one
place a record reaches MLflow, live or replayed, so a relog does exactly what the step would have done.

A run a step could not make while the server was away (a child run: a halving candidate's, the cooldown's) is named
by a pending id (`PENDING`) until it is made: its spool starts with a `create` record, which makes it, and the id
MLflow gave it is noted beside the spool (`made_run`), so every record naming the pending id, in that spool or in
another (the fine-tune's tags on its candidates), reaches the run made. A record whose run is not made yet waits as
for a server away (`RunNotMadeYet`).

A spool is a JSON Lines file: a header (the tracking URI without credentials, the run and its step), then one record
per line. Each line goes out in one `write` to a file opened for appending and is fsynced, so a step killed while
writing leaves whole lines and at worst a torn last one, which reading skips and counts (and the next append ends
first, so that its record is not read as the torn line's tail). Files a record names
(artifacts, images) are copied beside the spool when it is written, because a pod's output folder is gone by the
time someone relogs. A replay that stops part-way rewrites the spool (atomically) to what is left, so nothing is
logged twice and nothing is dropped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from rangefinder.config import expand_home
from rangefinder.errors import TrackingError
from rangefinder.formats.atomic import atomic_dir, write_text
from rangefinder.tracking.redaction import error_line, safe_uri

_log = logging.getLogger(__name__)

SPOOL_ENV = "RANGEFINDER_MLFLOW_SPOOL"  # the folder spools go to; a local run sets it inside its output folder
SPOOL_VERSION = 1
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
# In a spool folder, while an outage is said (tracking/outbox.py): a line per process that said it, of the run ids its
# outboxes log to (a training worker's is one of the step process's runs), with those it learned of since. Read and
# written under the folder's lock (outbox.spool_lock); a line none of whose runs has a spool left is an outage over
# (sent, or relogged after the process that said it was killed).
AWAY_MARKER = "away-said.txt"
MAX_PARAMS_PER_BATCH = 100
MAX_TAGS_PER_BATCH = 100
# What MLflow's SQL store keeps of a param's, a metric's or a tag's key and of a run's name (its columns'
# String(250)): a longer key it refuses ("exceeds the maximum length", which failed the step), a longer name SQLite
# keeps whole and the SQL servers refuse.
MLFLOW_NAME_CHARS = 250


def mlflow_key(key: str) -> str:
    """`key` (a param's, a metric's or a tag's), or where longer than MLflow keeps (a node selector's label key, up
    to 317 characters, under `kubernetes.node_selector.`; a user's own step's decision or tag), its start and a note
    of how much was cut, with a digest of the whole key that keeps two of one start apart; in the characters MLflow
    takes in a key. A param's whole key is in the run's config.yaml."""
    if len(key) <= MLFLOW_NAME_CHARS:
        return key
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    for width in range(1, 8):  # the note's length depends on the number of characters it says were cut
        head = MLFLOW_NAME_CHARS - len(f"...  chars cut {digest}") - width
        if len(str(len(key) - head)) == width:
            break
    return f"{key[:head]}... {len(key) - head} chars cut {digest}"


# What each kind of record is called in a warning, singular and plural.
_KIND_WORDS = {
    "metrics": ("metric value", "metric values"),
    "params": ("param", "params"),
    "tags": ("tag", "tags"),
    "inputs": ("dataset input", "dataset inputs"),
    "artifact": ("artifact", "artifacts"),
    "text": ("text artifact", "text artifacts"),
    "image": ("image", "images"),
    "end": ("end of the run", "ends of the run"),
    "create": ("run made", "runs made"),
}

PENDING = "pending-"  # the id of a run not made yet: PENDING + a uuid4's hex


class RunNotMadeYet(TrackingError):
    """A record names a pending run whose `create` record has not reached MLflow yet: it waits, as for a server away."""


def made_run(folder: Path, run_id: str) -> Optional[str]:
    """The id MLflow gave the pending run `run_id`, as noted in the spool folder `folder` when it was made; None if
    it is not made yet. Any other id is returned as it is."""
    if not run_id.startswith(PENDING):
        return run_id
    with contextlib.suppress(OSError):
        return (Path(folder) / f"{run_id}.run_id").read_text().strip() or None
    return None


def spool_dir(explicit: Optional[str | os.PathLike] = None) -> Path:
    """Where a step's spool goes: `explicit`, else $RANGEFINDER_MLFLOW_SPOOL, else $RANGEFINDER_WORK/mlflow-spool (the
    data volume on a cluster, which outlives the pod), else ./mlflow-spool."""
    if explicit is not None:
        return Path(explicit)
    if os.environ.get(SPOOL_ENV, "").strip():
        return expand_home(os.environ[SPOOL_ENV], f"${SPOOL_ENV}")
    if os.environ.get("RANGEFINDER_WORK", "").strip():
        return expand_home(os.environ["RANGEFINDER_WORK"], "$RANGEFINDER_WORK") / "mlflow-spool"
    return Path("mlflow-spool").absolute()


def record_size(record: Mapping[str, Any]) -> int:
    """How many things a record logs: its metric values, params or tags, else 1."""
    for key in ("metrics", "params", "tags", "datasets"):
        if key in record:
            return len(record[key])
    return 1


def describe(counts: Mapping[str, int]) -> str:
    """{"metrics": 812, "artifact": 2} -> "812 metric values, 2 artifacts"."""
    parts = []
    for kind, n in counts.items():
        one, many = _KIND_WORDS.get(kind, (kind, kind))
        parts.append(f"{n} {one if n == 1 else many}")
    return ", ".join(parts) or "nothing"


# ---------------------------------------------------------------------------------------------------------------
# Applying a record: the one way anything a step logs reaches MLflow


def apply_record(client: Any, record: Mapping[str, Any], base: Optional[Path] = None,
                 folder: Optional[Path] = None) -> None:
    """Log one record to MLflow through `client`; relative file paths are read from `base` (the spool's folder). A
    pending run's id is looked up in (and a `create` record notes the run made in) `folder`, by default `base`."""
    from mlflow.entities import Metric, Param, RunTag

    kind, run_id = record["kind"], record["run_id"]
    ids = folder if folder is not None else base
    if run_id.startswith(PENDING):
        made = made_run(ids, run_id) if ids is not None else None
        if kind == "create":
            if made is None:  # (a replay cut off after the run was made does not make a second one)
                run = client.create_run(record["experiment_id"], run_name=record["run_name"],
                                        tags=record["run_tags"])
                write_text(Path(ids or ".") / f"{run_id}.run_id", run.info.run_id + "\n")
            return
        if made is None and ids is not None:
            # Its own spool, beside this one, makes it first (the fine-tune's tags on a candidate whose run, opened
            # while the server was away, is made when the server answers).
            for pending in sorted(Path(ids).glob(f"*-{run_id}.jsonl")):
                replay(pending, client)
            made = made_run(ids, run_id)
        if made is None:
            raise RunNotMadeYet(f"run {run_id} is not made in MLflow yet (its spool's first record makes it)")
        run_id = made
    if kind == "metrics":
        # Keys cut as a step cuts them now (mlflow_key): a spool written before may hold one MLflow refuses.
        rows = [Metric(mlflow_key(key), float(value), int(ts), int(step))
                for key, value, ts, step in record["metrics"]]
        for i in range(0, len(rows), MAX_METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=rows[i: i + MAX_METRICS_PER_BATCH], synchronous=True)
    elif kind == "params":
        # A resumed or replayed run may have some already: the same value is skipped, a different one kept as it
        # was (MLflow params cannot change) with a warning.
        existing = client.get_run(run_id).data.params
        new = []
        for k, v in record["params"].items():
            k = mlflow_key(k)
            if k not in existing:
                new.append(Param(k, v))
            elif existing[k] != v:
                _log.warning("param %s already logged as %r; keeping it (MLflow params cannot change), not %r",
                             k, existing[k], v)
        for i in range(0, len(new), MAX_PARAMS_PER_BATCH):
            client.log_batch(run_id, params=new[i: i + MAX_PARAMS_PER_BATCH], synchronous=True)
    elif kind == "tags":
        tags = [RunTag(mlflow_key(k), v) for k, v in record["tags"].items()]
        for i in range(0, len(tags), MAX_TAGS_PER_BATCH):
            client.log_batch(run_id, tags=tags[i: i + MAX_TAGS_PER_BATCH], synchronous=True)
    elif kind == "inputs":
        from mlflow.entities import Dataset, DatasetInput, InputTag

        inputs = [DatasetInput(Dataset(name=d["name"], digest=d["digest"], source_type=d["source_type"],
                                       source=d["source"], profile=d["profile"]),
                               tags=[InputTag("mlflow.data.context", d["context"])]) for d in record["datasets"]]
        client.log_inputs(run_id, datasets=inputs)
    elif kind in ("artifact", "text", "image"):
        _apply_artifact(client, run_id, record, base)
    elif kind == "end":
        # mlflow prints the run's URL on stdout, where it would break a command's --json output.
        with contextlib.redirect_stdout(sys.stderr):
            client.set_terminated(run_id, status=record["status"])
    else:
        raise TrackingError(f"unknown MLflow spool record kind {kind!r}; was the spool written by a newer rangefinder?")


def _apply_artifact(client: Any, run_id: str, record: Mapping[str, Any], base: Optional[Path]) -> None:
    """apply_record's files: an artifact (file or folder), a text, an image (a step's or an image metric's)."""
    kind = record["kind"]
    if kind == "artifact":
        path = _resolve(record["path"], base)
        if not path.exists():
            raise TrackingError(f"cannot log {path} to MLflow: no such file or folder")
        with _store_named(client, run_id):
            if path.is_dir():
                client.log_artifacts(run_id, str(path), record.get("artifact_path"))
            else:
                client.log_artifact(run_id, str(path), record.get("artifact_path"))
    elif kind == "text":
        with _store_named(client, run_id):
            client.log_text(run_id, record["text"], record["artifact_file"])
    elif kind == "image":
        image = record.get("image")
        if image is None:
            from PIL import Image

            with Image.open(_resolve(record["path"], base)) as im:
                image = im.convert("RGB")
        with _store_named(client, run_id):
            if record.get("key") is not None:
                client.log_image(run_id, image, key=record["key"], step=int(record.get("step") or 0),
                                 synchronous=True)
            else:
                client.log_image(run_id, image, artifact_file=record["artifact_file"])


@contextlib.contextmanager
def _store_named(client: Any, run_id: str) -> Iterator[None]:
    """An error of the block, which writes to run `run_id`'s artifact store, raised as _unwritable_store's
    TrackingError where the store is one this process writes itself and cannot."""
    try:
        yield
    except Exception as e:
        unwritable = _unwritable_store(client, run_id, e)
        if unwritable is None:
            raise
        raise unwritable from None


# The artifact URIs whose files go through the tracking server (served artifacts), whose failures are the server's.
_SERVED_ARTIFACTS = ("mlflow-artifacts", "http", "https")


def _unwritable_store(client: Any, run_id: str, e: Exception) -> Optional[TrackingError]:
    """The TrackingError saying that run `run_id`'s artifact store is one this process cannot write, where `e`
    (raised logging a file to it) came from there; None for another error (the server away or refusing us, which
    the caller waits for or names). A server started with --no-serve-artifacts hands each client its artifact root
    (s3://..., a folder of its own disk) to write itself: the step failed with `No module named 'boto3'`, or
    botocore's NoCredentialsError, as a traceback."""
    from urllib.parse import urlsplit

    from rangefinder.tracking.target import refused_credentials, server_unreachable

    if server_unreachable(e) or refused_credentials(e) is not None:
        return None
    try:
        store = client.get_run(run_id).info.artifact_uri
    except Exception:
        return None
    scheme = urlsplit(store).scheme.lower()
    if scheme in _SERVED_ARTIFACTS:
        return None
    if scheme in ("", "file") and _writable_folder(store):
        return None  # a store this process writes: the failure is the file's own (a link to nowhere, a full disk)
    why = error_line(e, 200)
    if urlsplit(str(client.tracking_uri)).scheme.lower() in ("http", "https"):
        fix = ("start the MLflow server with --serve-artifacts (the default: the steps then upload through it to its "
               "--artifacts-destination), or give the steps what that store needs (its client library, e.g. boto3 "
               "for s3://, and its credentials)")
    else:
        fix = ("set MLFLOW_TRACKING_URI (or tracking.tracking_uri) to a store whose artifact folder this process "
               "can write")
    return TrackingError(f"MLflow run {run_id} keeps its artifacts in {safe_uri(store)}, which this process cannot "
                         f"write ({type(e).__name__}: {why}); {fix}")


def _writable_folder(store: str) -> bool:
    """Whether this process can make and write the local folder of artifact URI `store` (its nearest folder that
    exists is a folder it may write)."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    path = Path(local_file_uri_to_path(store)).absolute()
    for q in (path, *path.parents):
        if q.exists() or q.is_symlink():
            return q.is_dir() and os.access(q, os.W_OK)
    return False


def _resolve(path: str, base: Optional[Path]) -> Path:
    """A live record's own path; a replayed one's inside the spool's folder, where the spool copied it. A spool that
    names any other file (edited, or not written by rangefinder) would have relog upload whatever it points at."""
    if base is None:
        return Path(path)
    p = (base / path).resolve()
    if Path(path).is_absolute() or not p.is_relative_to(base.resolve()):
        raise TrackingError(f"a spool record names {path}, outside the spool's folder {base}; a spool only names "
                            "the copies it keeps beside it: relog only spools rangefinder wrote")
    return p


# ---------------------------------------------------------------------------------------------------------------
# The spool file


@dataclass
class Spool:
    """The spool of one step run, created on its first record."""

    path: Path
    tracking_uri: str
    run_id: str
    step: str
    counts: Counter = field(default_factory=Counter)  # what this process put in it, by kind

    @property
    def files_dir(self) -> Path:
        return self.path.with_name(self.path.stem + ".files")

    def exists(self) -> bool:
        return self.path.is_file()

    def append(self, record: Mapping[str, Any]) -> None:
        """Add one record (copying the files it names beside the spool) as one fsynced, appended line."""
        record = self._keep_files(dict(record))
        lines = []
        if not self.path.exists():
            lines.append({"kind": "spool", "version": SPOOL_VERSION, "tracking_uri": safe_uri(self.tracking_uri),
                          "run_id": self.run_id, "step": self.step})
        lines.append(record)
        data = "".join(json.dumps(r, default=str) + "\n" for r in lines).encode("utf-8")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            end = os.fstat(fd).st_size
            if end and os.pread(fd, 1, end - 1) != b"\n":
                # A line torn by a write cut off (a full disk, a power loss): ended first, or this record would be read
                # as its tail and dropped with it.
                data = b"\n" + data
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        self.counts[record["kind"]] += record_size(record)

    def _keep_files(self, record: dict) -> dict:
        """A copy of the file or folder (or in-memory image) the record names, under files_dir, named relatively."""
        if record["kind"] not in ("artifact", "image"):
            return record
        kept_before = [f for f in self.files_dir.iterdir() if not f.name.startswith(".")] \
            if self.files_dir.is_dir() else []
        n = len(kept_before)
        with atomic_dir(self.files_dir / str(n)) as tmp:
            if record.get("image") is not None:
                from PIL import Image

                image = record.pop("image")
                image = image if isinstance(image, Image.Image) else Image.fromarray(image)
                image.save(tmp / "image.png")
                kept = "image.png"
            else:
                src = Path(record["path"])
                kept = src.name
                if src.is_dir():
                    shutil.copytree(src, tmp / kept)
                elif src.is_file():
                    shutil.copy2(src, tmp / kept)
                else:
                    raise TrackingError(f"cannot log {src} to MLflow: no such file or folder")
        record["path"] = str(Path(self.files_dir.name) / str(n) / kept)
        return record


@dataclass
class SpoolContents:
    header: dict
    records: list[dict]
    torn: int  # lines that could not be read (a write cut off by a kill): skipped

    def counts(self) -> Counter:
        c: Counter = Counter()
        for r in self.records:
            c[r["kind"]] += record_size(r)
        return c


def read_spool(path: str | os.PathLike) -> SpoolContents:
    p = Path(path)
    if not p.is_file():
        raise TrackingError(f"{p} does not exist; pass the spool file (*.jsonl) a step named in its warning")
    header: Optional[dict] = None
    records: list[dict] = []
    torn = 0
    with open(p, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if not isinstance(obj, dict) or "kind" not in obj:
                torn += 1
            elif obj["kind"] == "spool":
                header = header or obj
            else:
                records.append(obj)
    if header is None:
        raise TrackingError(f"{p} is not an MLflow spool written by rangefinder (no header line)")
    # The header as _Spool.append writes it: a file edited by hand or cut may lack a field or hold another type.
    wrong = [k for k, t in (("version", int), ("tracking_uri", str), ("run_id", str))
             if not isinstance(header.get(k), t) or isinstance(header.get(k), bool)]
    if wrong:
        raise TrackingError(f"{p} has a damaged header line ({', '.join(wrong)} missing or not a "
                            f"{'number' if wrong == ['version'] else 'valid value'}); it was edited or is not a "
                            "spool rangefinder wrote: restore it, or log its run again")
    torn += sum(1 for r in records if not isinstance(r.get("run_id"), str))
    records = [r for r in records if isinstance(r.get("run_id"), str)]  # a record without its run: torn
    if header["version"] > SPOOL_VERSION:
        raise TrackingError(f"{p} was written by a newer rangefinder (spool version {header['version']}); "
                            "relog it with that version")
    return SpoolContents(header=header, records=records, torn=torn)


@dataclass
class ReplayResult:
    sent: Counter
    left: Counter  # what is still in the spool (the server stopped answering again)
    torn: int
    refused: Optional[int] = None  # where `left` is kept for a refusal of the credentials: its HTTP status
    host: bool = False  # that refusal was of the Host header (target.host_refused), not of the credentials


def replay(path: str | os.PathLike, client: Any) -> ReplayResult:
    """Log every record of the spool at `path` in order. When all went, the spool (and its files) is removed; when
    the server stops answering (or taking the credentials: a password changed) part-way, the spool is rewritten to
    what is left and the result says what.

    Any other error (a run deleted meanwhile, a record MLflow refuses) raises TrackingError naming the record; the
    records before it are logged and dropped from the spool, that one and the rest are kept.
    """
    from rangefinder.tracking.target import host_refused, refused_credentials, server_unreachable

    p = Path(path)
    contents = read_spool(p)
    sent: Counter = Counter()
    for i, record in enumerate(contents.records):
        try:
            apply_record(client, record, base=p.parent)
        except Exception as e:
            rest = contents.records[i:]
            _rewrite(p, contents.header, rest)
            if server_unreachable(e) or isinstance(e, RunNotMadeYet) or refused_credentials(e) is not None:
                left: Counter = Counter()
                for r in rest:
                    left[r["kind"]] += record_size(r)
                return ReplayResult(sent=sent, left=left, torn=contents.torn, refused=refused_credentials(e),
                                    host=host_refused(e))
            msg = error_line(e, 300)
            raise TrackingError(f"MLflow refused a {record['kind']} record of run {record['run_id']} in {p} ({msg}); "
                                f"logged {describe(sent)} before it, which are dropped from the spool") from None
        sent[record["kind"]] += record_size(record)
    p.unlink()
    files = p.with_name(p.stem + ".files")
    shutil.rmtree(files, ignore_errors=True)
    write_said_away(p.parent, said_away(p.parent))  # an outage whose spools are all sent now is over
    return ReplayResult(sent=sent, left=Counter(), torn=contents.torn)


def said_away(folder: Path) -> list[set[str]]:
    """AWAY_MARKER's lines in `folder`, each the run ids of an outage said, less those whose runs have no spool left
    (an outage over: its spools sent by whoever sent them, or relogged after the process that said it was killed)."""
    try:
        text = (folder / AWAY_MARKER).read_text()
    except FileNotFoundError:
        return []
    lines = [set(line.split()) for line in text.splitlines()]
    return [line for line in lines if any(next(folder.glob(f"*-{run_id}.jsonl"), None) for run_id in line)]


def write_said_away(folder: Path, lines: list[set[str]]) -> None:
    """AWAY_MARKER as `lines` (written whole under a temporary name, then renamed), or removed when there are none."""
    marker = folder / AWAY_MARKER
    if lines:
        write_text(marker, "".join(" ".join(sorted(line)) + "\n" for line in lines))
    else:
        marker.unlink(missing_ok=True)


def _rewrite(path: Path, header: dict, records: list[dict]) -> None:
    write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in [header, *records]))
