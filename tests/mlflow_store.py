"""An empty MLflow SQLite store with MLflow's whole schema, made once and copied wherever a test opens a new store.

A new `sqlite:///...` store runs every one of MLflow's schema migrations before its first call: about 10 s on the
2-core test machine (9.5 s measured at load 9, 2026-11-26), and the suite opens dozens (a fresh store per test is
what keeps tests apart). The copy is the file MLflow's own `_initialize_tables` wrote, with no experiment in it: the
store that opens it finds its tables and creates its default experiment itself, with the test's own artifact root,
as it does on a new file. Kept on disk (under the tiny models' cache), keyed by MLflow's version and schema head.

Used by tests/conftest.py (every store this process opens, and every fork of this process: no MLflow connection
crosses it) and `start_mlflow_server` (the server's store).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
from pathlib import Path
from typing import Any


def template() -> Path:
    """The migrated, empty store's file: made on first use (a file lock keeps concurrent sessions from making it
    twice), then read from the cache."""
    import mlflow
    import sqlalchemy
    from filelock import FileLock
    from mlflow.store.db import utils

    from rangefinder.models.tiny import default_cache_dir

    head = utils._get_latest_schema_revision()
    final = default_cache_dir() / "mlflow-store" / f"mlflow-{mlflow.__version__}-{head}.db"
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if not final.is_file():
            part = final.with_name(f"{final.name}.{os.getpid()}.part")
            part.unlink(missing_ok=True)
            engine = sqlalchemy.create_engine(f"sqlite:///{part}")
            try:
                _INITIALIZE_TABLES(engine)
            finally:
                engine.dispose()
            os.replace(part, final)  # whole or absent: a killed build leaves only a .part
    return final


def seed(db: Path) -> None:
    """`db` starts as the template, unless it exists already (a server restarted on its store keeps it)."""
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template(), db)


def _initialize_from_template(engine: Any) -> None:
    """In place of MLflow's `_initialize_tables`: a SQLite store gets the template's tables through SQLite's backup
    (the store's engine already holds the file open); any other database migrates as MLflow does."""
    if engine.url.get_backend_name() != "sqlite":
        _INITIALIZE_TABLES(engine)
        return
    source = sqlite3.connect(template())
    raw = engine.raw_connection()
    try:
        source.backup(raw.driver_connection)
    finally:
        raw.close()
        source.close()


def _original() -> Any:
    from mlflow.store.db import utils

    return utils._initialize_tables


_INITIALIZE_TABLES = _original()


# MLflow's SQLAlchemy stores keep one engine per database URI for the process (a class's `_engine_map`), and each
# engine keeps its connections open in its pool.
_ENGINE_MAPS = (("mlflow.store.tracking.sqlalchemy_store", "SqlAlchemyStore"),
                ("mlflow.store.model_registry.sqlalchemy_store", "SqlAlchemyStore"),
                ("mlflow.store.jobs.sqlalchemy_store", "SqlAlchemyJobStore"))


def close_sqlite_connections() -> None:
    """Close the database connections MLflow's stores hold open in this process, so that none crosses a fork: a
    forked child that opens a store this process had open (the same URI) gets MLflow's cached engine, and with it
    this process's open SQLite connection, which must not cross a fork (https://sqlite.org/howtocorrupt.html#fork).
    In a `ForkedMlflowCli`, which closes every inherited file descriptor, `mlflow server`'s first query on that
    connection failed with "disk I/O error" (a test read the demo's store with an MlflowClient, then the session's
    server started on it); in a multiprocessing fork, child and parent would share the connection's descriptor while
    SQLite's locks on it are the parent's alone. The engines stay: each opens a new connection on its next query."""
    for module_name, store in _ENGINE_MAPS:
        module = sys.modules.get(module_name)  # a store module never imported has no engine
        if module is not None:
            for engine in list(getattr(module, store)._engine_map.values()):
                engine.dispose()


def install() -> None:
    """New SQLite stores opened by this process start from the template: the tracking store calls
    `_initialize_tables` through its module, the model registry's store by the name it imported. And every fork of
    this process (os.fork, multiprocessing's fork context) first closes MLflow's open connections
    (`close_sqlite_connections`)."""
    from mlflow.store.db import utils
    from mlflow.store.model_registry import sqlalchemy_store as registry

    utils._initialize_tables = registry._initialize_tables = _initialize_from_template
    global _FORK_HOOK_REGISTERED
    if not _FORK_HOOK_REGISTERED:  # os.register_at_fork cannot unregister: once per process
        os.register_at_fork(before=close_sqlite_connections)
        _FORK_HOOK_REGISTERED = True


_FORK_HOOK_REGISTERED = False
