"""How much the database takes on disk, and each run's share of it (README "Disk use, retention and deleting a run")."""

from __future__ import annotations

import contextlib
import os

from sqlalchemy import Connection, text


def database_bytes(conn: Connection) -> int:
    """The database's size: PostgreSQL's `pg_database_size`; SQLite's pages plus its write-ahead log."""
    if conn.dialect.name == "postgresql":
        return int(conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one())
    pages = int(conn.execute(text("PRAGMA page_count")).scalar_one())
    size = pages * int(conn.execute(text("PRAGMA page_size")).scalar_one())
    path = conn.execute(text("PRAGMA database_list")).first()
    if path is not None and path[2]:  # "" for an in-memory database
        with contextlib.suppress(OSError):  # no WAL file (checkpointed and removed)
            size += os.path.getsize(f"{path[2]}-wal")
    return size


def share(total_bytes: int, values: int, all_values: int) -> int:
    """A run's estimated bytes: the database's size shared out over the runs by their stored values."""
    return round(total_bytes * values / all_values) if all_values > 0 else 0
