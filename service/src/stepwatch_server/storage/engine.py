"""Engine creation for the two supported databases.

SQLite (the embedded default) runs in WAL mode so that readers never block the writer, with a busy
timeout so that a second process waits instead of failing, foreign keys on, and `synchronous=FULL`
because a batch is acknowledged only once it is durable. SQLite has one writer at a time; inside
this process writers queue on `write_lock()` rather than spinning on SQLITE_BUSY, and write
transactions start with BEGIN IMMEDIATE so that a read-then-write transaction never has to upgrade
its lock (the classic SQLite deadlock). PostgreSQL is reached through psycopg 3, without a ping
before each use of a pooled connection (a round trip for every ingest transaction: a seventh of them
at the agent's cadence): a connection that died with a database restart fails its first statement,
SQLAlchemy then discards every connection of the pool opened before, and ingest writes the batch again
once on a new connection (ingest/store.py `BatchWriter.write_group`); a read that meets such a
connection answers 503 once, and a background worker's round fails once (retried on its next round).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url

SQLITE_BUSY_TIMEOUT_MS = 30_000
_SQLITE_BUSY_CODES = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED (an extended code's low byte)
# PostgreSQL: serialization_failure, deadlock_detected, lock_not_available (lock_timeout)
_PG_CONTENTION_STATES = frozenset({"40001", "40P01", "55P03"})
_SQLITE_WRITE_LOCK = threading.Lock()  # one writer per process and database file is all SQLite allows
_BEGIN_OPTION = "stepwatch_sqlite_begin"


def normalise_url(url: str) -> str:
    """`postgresql://` and `postgres://` mean psycopg 3 here (psycopg2 is not a dependency)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def database_busy(error: BaseException) -> bool:
    """Whether `error` says another writer held what a statement needed for longer than it waited (SQLite
    busy or locked; PostgreSQL a lock timeout, a deadlock broken or a serialization failure): contention,
    which passes, as opposed to a statement that fails the same way each time it runs."""
    orig = getattr(error, "orig", None)
    code = getattr(orig, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _SQLITE_BUSY_CODES
    return getattr(orig, "sqlstate", None) in _PG_CONTENTION_STATES


def is_sqlite(engine: Engine | Connection) -> bool:
    return engine.dialect.name == "sqlite"


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for `url`, configured for stepwatch's write pattern."""
    url = normalise_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
        # Readers run in the thread pool (40 threads): give them connections instead of pool waits.
        kwargs.setdefault("pool_size", 20)
        kwargs.setdefault("max_overflow", 20)
        engine = create_engine(url, connect_args={"check_same_thread": False}, **kwargs)
        _configure_sqlite(engine)
        return engine
    if parsed.get_backend_name() == "postgresql":
        kwargs.setdefault("pool_size", 10)
        kwargs.setdefault("max_overflow", 20)
        return create_engine(url, **kwargs)
    raise ValueError(
        f"unsupported database URL {parsed.render_as_string(hide_password=True)!r}: "
        "use sqlite:///path.db or postgresql+psycopg://user@host/db"
    )


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module so that BEGIN is ours (below).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = FULL")
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(_BEGIN_OPTION, "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")


@contextlib.contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """A connection inside one write transaction, committed on success, rolled back on error.

    On SQLite the process-wide write lock is held for the whole transaction and the transaction
    starts with BEGIN IMMEDIATE.
    """
    if is_sqlite(engine):
        with _SQLITE_WRITE_LOCK, engine.connect() as conn:
            conn = conn.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})
            with conn.begin():
                yield conn
    else:
        with engine.begin() as conn:
            yield conn
