"""Deleting a run completely, in short transactions (README "Disk use, retention and deleting a run").

Every table is tied to a run by one column: its id (`run_id`), its series (`series_id`: the values and
their rollups), its sessions (`session_id`: the idempotency records), or its name (`run`: the alert
outbox). The big tables are emptied of the run's rows DELETE_CHUNK_ROWS at a time, each chunk in its own
write transaction, so that SQLite's one writer lets the other runs' ingest in between; the last
transaction deletes the run's row and what little is left (ranks, sessions, series, the rollup mark).
Until then the run is still listed, and a delete that was interrupted is finished by running it again:
every step deletes what is there, whatever was done before.

Deleting a run does not stop its ranks: a batch that arrives afterwards creates the run again. So a run
the dashboard shows as live (heard from within 30 s and not finished: dashboard/summary.py) is refused
unless forced.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, Table, delete, select, tuple_

from stepwatch_server.dashboard.summary import runs_overview
from stepwatch_server.storage.engine import write_transaction
from stepwatch_server.storage.models import ALL_TABLES, AgentSession, Run, Series

DELETE_CHUNK_ROWS = 20_000  # rows per transaction: ~50 ms of SQLite's write lock
Progress = Callable[[str, int, bool], None]  # after each chunk: (table, rows deleted so far, table done)


@dataclass(frozen=True, slots=True)
class RunRow:
    id: int
    name: str


def find(conn: Connection, name: str) -> RunRow | None:
    row = conn.execute(select(Run.id, Run.name).where(Run.name == name)).first()
    return None if row is None else RunRow(int(row.id), str(row.name))


def live_for(conn: Connection, run: RunRow) -> float | None:
    """Seconds since the run's last write when the dashboard shows it as live (dashboard/summary.py: heard
    from within its window and not finished, every rank's agent having closed its session), else None."""
    overview = runs_overview(conn, run.name)
    if not overview or not overview[0]["live"] or overview[0]["last_seen_at"] is None:
        return None
    return max(0.0, (dt.datetime.now(dt.UTC) - overview[0]["last_seen_at"]).total_seconds())


def _tie(table: Table, run: RunRow) -> ColumnElement[bool]:
    """The WHERE clause that selects run `run`'s rows of `table`."""
    c = table.c
    if table.name == Run.__tablename__:
        return c.id == run.id
    if "run_id" in c:
        return c.run_id == run.id
    if "series_id" in c:
        return c.series_id.in_(select(Series.id).where(Series.run_id == run.id).scalar_subquery())
    if "session_id" in c:
        return c.session_id.in_(
            select(AgentSession.id).where(AgentSession.run_id == run.id).scalar_subquery()
        )
    if "run" in c:
        return c.run == run.name
    raise AssertionError(f"table {table.name} is tied to a run by no column deletion.py knows")


# The tables emptied chunk by chunk before the run's row goes: every table but those holding a row per
# rank, session, series or run (deleted with the run's row, in the last transaction), children first.
_SMALL = {"runs", "ranks", "sessions", "series", "rollup_marks"}
CHUNKED = tuple(t for t in reversed(ALL_TABLES) if t.name not in _SMALL)
for _table in ALL_TABLES:  # every table is tied to a run by some column (checked at import)
    _tie(_table, RunRow(0, ""))


def _chunk(table: Table, run: RunRow, rows: int) -> Any:
    """DELETE of at most `rows` of the run's rows of `table`, found by its primary key."""
    key = list(table.primary_key.columns)
    column = key[0] if len(key) == 1 else tuple_(*key)
    return delete(table).where(column.in_(select(*key).where(_tie(table, run)).limit(rows)))


def delete_run(
    engine: Engine, run: RunRow, *, chunk_rows: int = DELETE_CHUNK_ROWS, progress: Progress | None = None
) -> dict[str, int]:
    """Delete run `run` and every row of it; the rows deleted per table (0 where it held none)."""
    deleted = {t.name: 0 for t in ALL_TABLES}
    for table in CHUNKED:
        statement = _chunk(table, run, chunk_rows)
        while True:
            with write_transaction(engine) as conn:
                n = conn.execute(statement).rowcount
            deleted[table.name] += n
            if progress is not None and deleted[table.name]:
                progress(table.name, deleted[table.name], n < chunk_rows)
            if n < chunk_rows:
                break
    with write_transaction(engine) as conn:
        # The run's few rows of the small tables, its row, and any row of the big ones written while they
        # were emptied (a forced delete of a live run), children first: deleted here rather than left to
        # ON DELETE CASCADE, so nothing depends on SQLite's per-connection foreign_keys setting.
        for table in reversed(ALL_TABLES):
            n = conn.execute(delete(table).where(_tie(table, run))).rowcount
            deleted[table.name] += n
    if progress is not None:
        progress("runs", 1, True)
    return deleted
