"""Statements whose bind parameters grow with their input (an IN list, a multi-row VALUES), cut into
chunks that every driver accepts.

psycopg sends at most 65,535 parameters per statement; SQLite allows SQLITE_MAX_VARIABLE_NUMBER,
250,000 on modern builds but 32,766 (or 999 before 3.32) on others. A statement over the limit fails
whatever its data, so a run with more series than that could never be rolled up (issue 14). Every
statement that names a growing list of ids goes through `chunks` with a size from `chunk_size`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from typing import TypeVar

from sqlalchemy import Connection

T = TypeVar("T")

MAX_BIND_PARAMS = 32_766  # per statement: under psycopg's 65,535 and the lowest common SQLite build's


def bind_limit(conn: Connection) -> int:
    """The most bind parameters one statement may hold on `conn`: MAX_BIND_PARAMS, or SQLite's own
    limit for this connection when it is lower."""
    if conn.dialect.name == "sqlite":
        driver = conn.connection.driver_connection
        if isinstance(driver, sqlite3.Connection):
            return min(MAX_BIND_PARAMS, driver.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
    return MAX_BIND_PARAMS


def chunk_size(conn: Connection, per_item: int = 1, fixed: int = 0) -> int:
    """How many items fit in one statement on `conn` when each takes `per_item` parameters and the
    statement has `fixed` others (at least one item)."""
    return max(1, (bind_limit(conn) - fixed) // per_item)


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """`items` in consecutive slices of at most `size` (none for no items)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
