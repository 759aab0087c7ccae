"""The bulk writer: validated batches -> database transactions, every batch whole or not at all.

Everything of a batch (its values, step timestamps, fingerprints, events, the rank's state and the
idempotency record `(session, seq)`) is written in one transaction, so a batch is either stored
whole and acknowledged, or not at all. Values go in as numpy columns, one statement for a whole
group (`INSERT_POINTS`, storage/bulk.py), never one ORM object per value; names are turned into small
integer series ids through a per-run dictionary that is cached in memory once committed. Statements are
built once per dialect (`_Statements`) and reused.

Group commit (`_Group`): the batches that arrive while a transaction is being written go together
into the next one. Those of the steady state (run, session and every name already stored) are written
with one statement of each kind for the whole group (`BatchWriter._write_known`): one INSERT of their
idempotency records, whose RETURNING tells the duplicates apart, one INSERT of all their values and one
of their step timestamps (numpy columns sent by the driver: storage/bulk.py), and one
executemany of the conditional rank UPDATE. A batch that creates something (a run's, a session's or a
rank's first batch, new names) is written alone (`_write_one`). Each caller is answered after the commit of the transaction holding its batch.

The transaction is kept to the writing itself, because on SQLite every other writer waits while one
holds the write lock: parsing and validation run before it, a large batch's rows are built before it
when its names are known (`prebuild`), a run's names are read in one query, and a run has at most
MAX_SERIES_PER_RUN names, so a batch can never make the transaction create more. A batch is never
split into several transactions: one that fails half-way (database down, disk full) must leave
nothing behind.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from sqlalchemy import (
    Boolean,
    Connection,
    Engine,
    Insert,
    Table,
    and_,
    bindparam,
    case,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as DatabaseTimeout

from stepwatch_server.errors import InvalidBatch
from stepwatch_server.ingest.schema import MAX_SERIES_PER_RUN, Batch, Column
from stepwatch_server.storage.bulk import BulkInsert
from stepwatch_server.storage.engine import write_transaction
from stepwatch_server.storage.models import (
    METRIC_STAT,
    AgentSession,
    Event,
    Fingerprint,
    IngestedBatch,
    Rank,
    Run,
    Series,
)
from stepwatch_server.storage.write_health import WriteHealth

log = logging.getLogger(__name__)

MAX_WRITE_ATTEMPTS = 5  # concurrent first batches of a run/rank/session race on unique keys; retry
MAX_CACHED_RUNS = 256  # runs whose series ids are kept in memory (most recently written first)
_SERIES_LOCK_KEY = -1  # PostgreSQL advisory lock (run_id, -1): adding a run's names (ranks are >= 0)


class SeriesIds:
    """Series ids by run, for the MAX_CACHED_RUNS runs written most recently: memory bounded by what is
    active, not by every run the collector ever saw (a run evicted reads its ids again from the
    database on its next batch). Thread-safe."""

    def __init__(self, max_runs: int = MAX_CACHED_RUNS) -> None:
        self.max_runs = max_runs
        self._runs: collections.OrderedDict[int, dict[tuple[str, str], int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._runs)

    def of_run(self, run_id: int) -> dict[tuple[str, str], int]:
        """The run's known ids (a copy: read while other threads add)."""
        with self._lock:
            known = self._runs.get(run_id)
            if known is None:
                return {}
            self._runs.move_to_end(run_id)
            return dict(known)

    def lookup(self, run_id: int, wanted: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int] | None:
        """The ids of `wanted`, or None unless every one is known (no copy of a big run's whole map)."""
        with self._lock:
            known = self._runs.get(run_id)
            if known is None:
                return None
            try:
                found = {key: known[key] for key in wanted}
            except KeyError:
                return None
            self._runs.move_to_end(run_id)
            return found

    def add(self, run_id: int, ids: Mapping[tuple[str, str], int]) -> None:
        with self._lock:
            self._runs.setdefault(run_id, {}).update(ids)
            self._runs.move_to_end(run_id)
            while len(self._runs) > self.max_runs:
                self._runs.popitem(last=False)

    def forget(self, run_id: int) -> None:
        with self._lock:
            self._runs.pop(run_id, None)


RUN_TOUCH_INTERVAL_S = 5.0  # runs.last_seen_at is refreshed at most this often (it is a hot row)

_FINGERPRINTS: Table = Fingerprint.__table__  # type: ignore[assignment]
_EVENTS: Table = Event.__table__  # type: ignore[assignment]
_SERIES: Table = Series.__table__  # type: ignore[assignment]
_BATCHES: Table = IngestedBatch.__table__  # type: ignore[assignment]
_RUNS: Table = Run.__table__  # type: ignore[assignment]
_RANKS: Table = Rank.__table__  # type: ignore[assignment]
_SESSIONS: Table = AgentSession.__table__  # type: ignore[assignment]


def _rank_update() -> Any:
    """One rank's state after a batch, in ONE statement that reads the row it updates (SET expressions see
    the row as it was): every stored batch adds its rows to `stored_values`; a late batch of an older
    incarnation changes only that, `last_seen_at` and `stored_to`; a newer incarnation takes over the identity
    and resets `last_step`; the same incarnation moves `last_step` forward only, and the heartbeat to a later
    one only; `stored_to` (the highest step stored, any incarnation) moves forward only. Parameters are
    prefixed `b_` (SQLAlchemy keeps the columns' own names for its SET clause); flags say which optional
    values the batch has, since a JSON NULL is not SQL NULL."""
    c = _RANKS.c

    def param(name: str, column: Any) -> Any:
        return bindparam(f"b_{name}", type_=column.type)

    inc = param("incarnation", c.incarnation)
    current = inc >= c.incarnation  # the batch's incarnation is the rank's (or newer)
    newer = inc > c.incarnation
    last = param("last_step", c.last_step)
    top = param("stored_to", c.stored_to)  # the batch's highest step (NULL: it has none), any incarnation
    hb_at = param("hb_at", c.last_heartbeat_at)
    has_hb = bindparam("b_has_hb", type_=Boolean)
    hb_newer = and_(has_hb, current, or_(c.last_heartbeat_at.is_(None), hb_at >= c.last_heartbeat_at, newer))
    has_version, has_counters = (
        bindparam("b_has_version", type_=Boolean),
        bindparam("b_has_counters", type_=Boolean),
    )
    identity = {name: case((current, param(name, c[name])), else_=c[name]) for name in RANK_IDENTITY}
    return (
        update(_RANKS)
        .where(c.run_id == bindparam("b_run_id"), c.rank == bindparam("b_rank"))
        .values(
            last_seen_at=param("now", c.last_seen_at),
            **identity,
            last_step=case(
                (newer, last),
                (and_(current, last.is_not(None), or_(c.last_step.is_(None), last > c.last_step)), last),
                else_=c.last_step,
            ),
            last_heartbeat_at=case((hb_newer, hb_at), else_=c.last_heartbeat_at),
            phase=case((hb_newer, param("phase", c.phase)), else_=c.phase),
            agent_version=case(
                (and_(current, has_version), param("agent_version", c.agent_version)), else_=c.agent_version
            ),
            agent_counters=case(
                (and_(current, has_counters), param("agent_counters", c.agent_counters)),
                else_=c.agent_counters,
            ),
            incarnation=case((newer, inc), else_=c.incarnation),
            stored_values=c.stored_values + bindparam("b_rows", type_=c.stored_values.type),
            stored_to=case((or_(c.stored_to.is_(None), top > c.stored_to), top), else_=c.stored_to),
        )
    )


RANK_IDENTITY = ("node", "local_rank", "world_size", "replica_group", "shard", "num_shards")


class _Statements:
    """The writer's statements, built once per dialect and reused: SQLAlchemy then finds each compiled
    form in its cache by the statement object (~15 us an execute) instead of building and keying a new
    expression every time (~100 us; a batch of the agent's default shape ran ten of them)."""

    def __init__(self, dialect: str) -> None:
        factory = pg_insert if dialect == "postgresql" else sqlite_insert
        run, session, rank = _RUNS.c, _SESSIONS.c, _RANKS.c
        self.run = select(run.id, run.world_size, run.last_seen_at).where(run.name == bindparam("b_name"))
        self.run_id = select(run.id).where(run.name == bindparam("b_name"))
        self.new_run = factory(_RUNS).on_conflict_do_nothing()
        self.touch_run = (
            update(_RUNS)
            .where(run.id == bindparam("b_id"))
            .values(
                world_size=bindparam("b_world_size"),
                last_seen_at=bindparam("b_now", type_=run.last_seen_at.type),
            )
        )
        self.session = select(session.run_id, session.rank, session.incarnation, session.first_step).where(
            session.id == bindparam("b_id")
        )
        self.first_step = (
            update(_SESSIONS)
            .where(session.id == bindparam("b_id"))
            .values(first_step=bindparam("b_first_step"))
        )
        self.last_incarnation = select(func.max(session.incarnation)).where(
            session.run_id == bindparam("b_run_id"), session.rank == bindparam("b_rank")
        )
        self.new_session = _SESSIONS.insert()
        self.batches = (
            factory(_BATCHES).on_conflict_do_nothing().returning(_BATCHES.c.session_id, _BATCHES.c.seq)
        )
        self.fingerprints = factory(_FINGERPRINTS).on_conflict_do_nothing()
        self.events = _EVENTS.insert()
        self.series = select(Series.stat, Series.name, Series.id).where(
            Series.run_id == bindparam("b_run_id")
        )
        self.new_series = factory(_SERIES).on_conflict_do_nothing()
        self.rank = _rank_update()
        self.new_rank = _RANKS.insert()
        self.rank_exists = select(rank.rank).where(
            rank.run_id == bindparam("b_run_id"), rank.rank == bindparam("b_rank")
        )


_STATEMENTS: dict[str, _Statements] = {}


def _statements(conn: Connection) -> _Statements:
    found = _STATEMENTS.get(conn.dialect.name)
    if found is None:
        found = _STATEMENTS[conn.dialect.name] = _Statements(conn.dialect.name)
    return found


@dataclass(frozen=True, slots=True)
class IngestResult:
    rows: int
    duplicates: int
    incarnation: int
    run_id: int
    restarted: bool = False  # this batch opened a new incarnation (> 1) of its rank
    duplicate: bool = False  # (session, seq) was stored before: nothing was written
    steps: tuple[int, int] | None = None  # the first and last step of the values stored (for rollups)
    new_run: bool = False  # this batch created its run's row (detection: a name seen before was deleted)

    def answer(self) -> dict[str, Any]:
        return {
            "accepted": True,
            "rows": self.rows,
            "duplicates": self.duplicates,
            "incarnation": self.incarnation,
        }


def insert_ignore(conn: Connection, table: Table) -> Insert:
    """`INSERT ... ON CONFLICT DO NOTHING` for the connection's dialect."""
    factory = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    return factory(table).on_conflict_do_nothing()


POINT_COLUMNS = ("series_id", "rank", "step", "incarnation", "value")
PointRow = tuple[int, int, int, int, float]
PREBUILD_MIN_ROWS = 10_000  # a batch of this many values has its rows built before the write lock
INSERT_POINTS = BulkInsert(
    "points", dict(zip(POINT_COLUMNS, ("integer", "integer", "bigint", "integer", "float8"), strict=True))
)
_INSERT_STEPS = BulkInsert(
    "steps",
    {"run_id": "integer", "rank": "integer", "step": "bigint", "incarnation": "integer", "ts": "float8"},
)
# The idempotency records of a group on PostgreSQL: the sessions, seqs and row counts as arrays, one time.
_INSERT_BATCHES_PG = (
    "INSERT INTO batches (session_id, seq, received_at, rows) "
    "SELECT s, q, %b, r FROM unnest(%b::text[], %b::bigint[], %b::integer[]) AS t(s, q, r) "
    "ON CONFLICT DO NOTHING RETURNING session_id, seq"
)


def insert_points(conn: Connection, rows: Sequence[PointRow] | Sequence[Mapping[str, Any]]) -> None:
    """The raw bulk insert of value rows `(series_id, rank, step, incarnation, value)`.

    Benchmarks and tests call it to write values without HTTP, parsing or validation; ingest writes the
    same statement from its batches' columns (`INSERT_POINTS`, storage/bulk.py). Rows are tuples in
    POINT_COLUMNS order (dicts keyed by those names are accepted too): ints, and a float or None value
    (None is stored as NaN). A row that already exists is skipped (ON CONFLICT DO NOTHING). The rollups
    are not touched here: the rollup worker (runs/rollup_worker.py) recomputes them after the commit.
    """
    if not rows:
        return
    columns: list[Any]
    if isinstance(rows[0], Mapping):
        columns = [[r[c] for r in cast("Sequence[Mapping[str, Any]]", rows)] for c in POINT_COLUMNS]
    else:
        columns = [list(col) for col in zip(*cast("Sequence[PointRow]", rows), strict=True)]
    columns[-1] = np.asarray(columns[-1], dtype=np.float64)  # None: NaN
    INSERT_POINTS.run(conn, columns)


def _insert_records(
    conn: Connection, st: _Statements, batches: Sequence[Batch], now: dt.datetime
) -> set[tuple[str, int]]:
    """The idempotency records of `batches` in one statement: the (session, seq) that were new (the
    others are duplicates). On PostgreSQL as arrays with the driver; on SQLite SQLAlchemy's multi-row
    INSERT (its driver's executemany cannot return rows). In (session, seq) order: with the rank rows
    (by run and rank) and run rows (by id) that `BatchWriter._write_known` locks in order too, two groups'
    transactions never wait for each other in a circle (a second copy of a batch waits at its record)."""
    batches = sorted(batches, key=lambda b: (b.session, b.seq))
    if conn.dialect.name == "postgresql":
        params = (
            now,
            [b.session for b in batches],
            [b.seq for b in batches],
            [b.value_rows() for b in batches],
        )
        found = conn.exec_driver_sql(_INSERT_BATCHES_PG, params).all()
    else:
        records = [
            {"session_id": b.session, "seq": b.seq, "received_at": now, "rows": b.value_rows()}
            for b in batches
        ]
        found = conn.execute(st.batches, records).all()
    return {(session, int(seq)) for session, seq in found}


def _write_again(error: Exception | None) -> bool:
    """The write failed for a reason that writing it once more mends: its pooled connection was dead (the
    database restarted: nothing of it committed), or PostgreSQL broke a deadlock by cancelling it (40P01:
    the transactions lock rank rows before the run's row, but a session row or a first batch's new rows
    may still meet in another order).
    Should a dead connection have lost only the COMMIT's answer, the batch is stored and the second write
    finds its idempotency record: it is answered as a duplicate (rows 0), like a batch sent twice, and is
    then not handed to detection or the rollups (a known limit, rare: a restart inside that instant)."""
    if not isinstance(error, DBAPIError):
        return False
    return error.connection_invalidated or getattr(error.orig, "sqlstate", None) == "40P01"


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _from_unix(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, dt.UTC)


def _wanted(batch: Batch) -> list[tuple[str, str]]:
    """The batch's series keys (stat, name), metrics first."""
    wanted = [(METRIC_STAT, name) for name in batch.metrics]
    return wanted + [(stat, name) for stat, cols in batch.tensors.items() for name in cols]


@dataclass(frozen=True, slots=True)
class _Points:
    """A batch's values as the columns of their rows (the rank and incarnation are the batch's)."""

    series: np.ndarray  # int64
    steps: np.ndarray  # int64
    values: np.ndarray  # float64, NaN/Inf as sent

    def __len__(self) -> int:
        return int(self.values.shape[0])


def _section(
    cols: Mapping[str, Column], steps: np.ndarray, ids: list[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of one block of columns over the same steps: column by column, as numpy whole."""
    n = steps.shape[0]
    values = np.stack([col.values for col in cols.values()]).ravel()
    series = np.repeat(np.asarray(ids, dtype=np.int64), n)
    at = np.tile(steps, len(cols))
    masks = [col.present for col in cols.values()]
    if any(mask is not None for mask in masks):  # JSON nulls: not stored
        keep = np.concatenate([np.ones(n, dtype=bool) if m is None else m for m in masks])
        return series[keep], at[keep], values[keep]
    return series, at, values


def _points(batch: Batch, series_ids: Mapping[tuple[str, str], int]) -> _Points:
    parts = []
    if batch.metrics and batch.steps.size:
        ids = [series_ids[(METRIC_STAT, name)] for name in batch.metrics]
        parts.append(_section(batch.metrics, batch.steps, ids))
    if batch.tensor_steps.size:
        for stat, cols in batch.tensors.items():
            if cols:
                parts.append(_section(cols, batch.tensor_steps, [series_ids[(stat, name)] for name in cols]))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return _Points(empty, empty, np.zeros(0, dtype=np.float64))
    if len(parts) == 1:
        return _Points(*parts[0])
    return _Points(*(np.concatenate(column) for column in zip(*parts, strict=True)))


def _insert_points_of(conn: Connection, batches: Sequence[tuple[Batch, int, _Points]]) -> None:
    """The values of (batch, incarnation, points) in one statement."""
    counts = [len(points) for _, _, points in batches]
    if not sum(counts):
        return
    INSERT_POINTS.run(
        conn,
        [
            np.concatenate([points.series for _, _, points in batches]),
            np.repeat([batch.rank for batch, _, _ in batches], counts),
            np.concatenate([points.steps for _, _, points in batches]),
            np.repeat([inc for _, inc, _ in batches], counts),
            np.concatenate([points.values for _, _, points in batches]),
        ],
    )


@dataclass(frozen=True, slots=True)
class _Prebuilt:
    """Value rows built before the transaction, for this run id and incarnation (BatchWriter.prebuild)."""

    run_id: int
    incarnation: int
    points: _Points


class _Duplicate(Exception):
    def __init__(self, result: IngestResult) -> None:
        super().__init__("duplicate batch")
        self.result = result


def _value_steps(batch: Batch) -> tuple[int, int] | None:
    """The first and last step of the batch's values (for the rollups)."""
    found = [a for a in (batch.steps, batch.tensor_steps) if a.size]
    return (min(int(a.min()) for a in found), max(int(a.max()) for a in found)) if found else None


def _insert_rows(conn: Connection, st: _Statements, batches: Sequence[tuple[Batch, int, int]]) -> None:
    """The step timestamps, fingerprints and events of (batch, run id, incarnation), all the batches'
    together: the timestamps as numpy columns (storage/bulk.py), the others one executemany each."""
    fingerprints, events = [], []
    for batch, run_id, inc in batches:
        fingerprints += [
            {
                "run_id": run_id,
                "rank": batch.rank,
                "step": s,
                "incarnation": inc,
                "replica_group": batch.replica_group,
                "shard": batch.shard,
                "value": v,
            }
            for s, v in zip(batch.fingerprint_steps.tolist(), batch.fingerprints, strict=True)
        ]
        events += [
            {
                "run_id": run_id,
                "rank": batch.rank,
                "step": e.step,
                "incarnation": inc,
                "ts": e.ts,
                "kind": e.kind,
                "data": e.data,
            }
            for e in batch.events
        ]
    counts = [batch.steps.shape[0] for batch, _, _ in batches]
    if sum(counts):
        _INSERT_STEPS.run(
            conn,
            [
                np.repeat([run_id for _, run_id, _ in batches], counts),
                np.repeat([batch.rank for batch, _, _ in batches], counts),
                np.concatenate([batch.steps for batch, _, _ in batches]),
                np.repeat([inc for _, _, inc in batches], counts),
                np.concatenate([batch.timestamps for batch, _, _ in batches]),
            ],
        )
    for statement, params in ((st.fingerprints, fingerprints), (st.events, events)):
        if params:
            conn.execute(statement, params)


def _rank_params(batch: Batch, run_id: int, incarnation: int, now: dt.datetime) -> dict[str, Any]:
    """The parameters of `_rank_update` for this batch."""
    hb = batch.heartbeat
    batch_last = int(batch.steps[-1]) if batch.steps.size else None
    if hb is not None and hb.last_step is not None:
        batch_last = hb.last_step if batch_last is None else max(batch_last, hb.last_step)
    return {
        "b_run_id": run_id,
        "b_rank": batch.rank,
        "b_now": now,
        "b_incarnation": incarnation,
        "b_last_step": batch_last,
        "b_stored_to": int(batch.steps[-1]) if batch.steps.size else None,
        "b_has_hb": hb is not None,
        "b_hb_at": None if hb is None else _from_unix(hb.ts),
        "b_phase": None if hb is None else hb.phase,
        "b_has_version": batch.agent_version is not None,
        "b_agent_version": batch.agent_version,
        "b_has_counters": batch.agent_counters is not None,
        "b_agent_counters": batch.agent_counters,
        "b_rows": batch.value_rows(),
        **{f"b_{name}": getattr(batch, name) for name in RANK_IDENTITY},
    }


def _new_rank(p: dict[str, Any]) -> dict[str, Any]:
    """The row of a rank seen for the first time, from its `_rank_params`."""
    return {
        "run_id": p["b_run_id"],
        "rank": p["b_rank"],
        **{name: p[f"b_{name}"] for name in RANK_IDENTITY},
        "incarnation": p["b_incarnation"],
        "last_step": p["b_last_step"],
        "last_seen_at": p["b_now"],
        "last_heartbeat_at": p["b_hb_at"],
        "phase": p["b_phase"],
        "agent_version": p["b_agent_version"],
        "agent_counters": p["b_agent_counters"],
        "stored_values": p["b_rows"],
        "stored_to": p["b_stored_to"],
    }


@dataclass(slots=True)
class Pending:
    """A batch waiting for its group's transaction, and what came of it."""

    batch: Batch
    prebuilt: _Prebuilt | None
    result: IngestResult | None = None
    error: Exception | None = None
    done: bool = False
    lead: bool = False  # this caller's thread writes the next group
    wake: threading.Event = field(default_factory=threading.Event)


MAX_KNOWN_RUNS = 4_096  # runs, and sessions, whose ids the writer keeps (BatchWriter._remember)
MAX_KNOWN_SESSIONS = 262_144
MAX_GROUP_BATCHES = 64  # batches in one group transaction
MAX_GROUP_VALUES = 200_000  # and values: a group's write lock is held about as long as one big batch's


class _Group:
    """Group commit without a timer: the batches that arrive while a transaction is being written wait
    and go together into the next one. The caller whose batch finds no writer at work writes; when its
    group is committed it wakes every caller of the group, and hands the writing to the oldest batch
    still waiting (so that no request thread writes others' groups for long). A lone batch is written
    at once, alone: no added latency when the collector is idle."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[Pending] = []
        self._busy = False

    def run(self, pending: Pending, write: Callable[[list[Pending]], None]) -> None:
        with self._lock:
            self._waiting.append(pending)
            if not self._busy:
                self._busy = pending.lead = True
        while not pending.done:
            if not pending.lead:
                pending.wake.wait()
                pending.wake.clear()
                continue
            with self._lock:  # the writer splits what it is given into transactions of bounded size
                group, self._waiting = self._waiting[:MAX_GROUP_BATCHES], self._waiting[MAX_GROUP_BATCHES:]
            try:
                write(group)
            except BaseException as exc:
                for item in group:
                    if item.result is None and item.error is None:
                        item.error = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
            finally:
                with self._lock:
                    for item in group:
                        item.done = True
                    pending.lead = False
                    if pending.done:  # hand the writing on, or stop
                        if self._waiting:
                            self._waiting[0].lead = True
                            self._waiting[0].wake.set()
                        else:
                            self._busy = False
                    else:
                        pending.lead = True  # its own batch is still waiting: the next group is its
                for item in group:
                    if item is not pending:
                        item.wake.set()


class BatchWriter:
    """Writes validated batches to one database. Thread-safe; one per engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._group = _Group()
        self._counts_lock = threading.Lock()
        self._groups = 0
        self._grouped = 0
        # What committed batches made known, so that the steady state (every batch's run, session and
        # names stored before) is written in bulk with no read: run name -> (id, world size, when its
        # row was last touched, monotonic); session -> (run id, rank, incarnation), once its first step
        # is stored. Ids never change; bounded, the oldest dropped first.
        self._runs: collections.OrderedDict[str, tuple[int, int, float]] = collections.OrderedDict()
        self._sessions: collections.OrderedDict[str, tuple[int, int, int]] = collections.OrderedDict()
        self._known_lock = threading.Lock()
        self.series_ids = SeriesIds()
        self.health = WriteHealth()  # /healthz reports a write that failed (a full disk answers SELECT 1)

    def write(self, batch: Batch) -> IngestResult:
        """Store `batch` (or recognise it as a duplicate) and return the answer's numbers.

        Returns only after the transaction that holds it committed. Raises InvalidBatch when the session
        id is already used by another run or rank. Batches written at the same time share one
        transaction (group commit, `_Group`): each in its own savepoint, so that one refused batch
        leaves the others' rows in place, and each caller answered only after that commit.
        """
        pending = Pending(batch, self.prebuild(batch))
        self._group.run(pending, self.write_group)
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def write_group(self, group: list[Pending]) -> None:
        """Store the batches of `group` (validated, waiting together), each getting its result or its
        error: in transactions of at most MAX_GROUP_BATCHES batches and MAX_GROUP_VALUES values
        (ingest/pipeline.py hands every body that waits here)."""
        part: list[Pending] = []
        values = 0
        for item in [*group, None]:
            rows = 0 if item is None else item.batch.value_rows()
            if part and (item is None or len(part) == MAX_GROUP_BATCHES or values + rows > MAX_GROUP_VALUES):
                with self._counts_lock:
                    self._groups += 1
                    self._grouped += len(part)
                self._write_group(part)
                again = [item for item in part if _write_again(item.error)]
                if again:  # a dead pooled connection, or a deadlock broken: once more
                    for item in again:
                        item.error = None
                    self._write_group(again)
                part, values = [], 0
            if item is not None:
                part.append(item)
                values += rows

    @property
    def group_sizes(self) -> tuple[int, int]:
        """(transactions of groups written, batches in them) since start: their ratio is the mean group."""
        with self._counts_lock:
            return self._groups, self._grouped

    def _write_one(self, batch: Batch, prebuilt: _Prebuilt | None) -> IngestResult:
        """`batch` alone in its own transaction, retried when it lost a race on a unique key."""
        for attempt in range(1, MAX_WRITE_ATTEMPTS + 1):
            new_series: dict[tuple[str, str], int] = {}
            try:
                with write_transaction(self.engine) as conn:
                    result = self._write(conn, batch, new_series, prebuilt)
            except _Duplicate as dup:  # raised inside the transaction, which rolled back
                return dup.result
            except IntegrityError:
                if attempt == MAX_WRITE_ATTEMPTS:
                    raise
                # A race on a unique key, or a row this writer remembered is gone (its run was deleted, by
                # this process or another): what it remembers of the run is read again.
                self.forget_run(batch.run)
                prebuilt = None
                log.debug("ingest race on a unique key (attempt %d); retrying", attempt)
                time.sleep(random.uniform(0.0, 0.01 * attempt))
                continue
            except (OperationalError, DatabaseTimeout) as exc:  # gone, full, read-only: a 503 (errors.py)
                self.health.failed(exc)
                raise
            self.health.stored()
            if new_series:  # cached only once committed
                self.series_ids.add(result.run_id, new_series)
            self._remember(batch, result, None)
            return result
        raise AssertionError("unreachable")

    def _write_group(self, group: list[Pending]) -> None:
        """The batches of `group` whose run, session and names are known (the steady state) in one
        transaction of bulk statements (`_write_known`); the others one by one (`_write_one`: they
        create rows, read what they need, and may race other first batches)."""
        known: list[tuple[Pending, tuple[int, int, dict[tuple[str, str], int]]]] = []
        unknown: list[Pending] = []
        for item in group:
            found = self._known(item.batch)
            if found is None:
                unknown.append(item)
            else:
                known.append((item, found))
        if known:
            self._write_known(known)
        for item in unknown:
            try:
                item.result = self._write_one(item.batch, item.prebuilt)
            except Exception as exc:
                item.error = exc

    def _known(self, batch: Batch) -> tuple[int, int, dict[tuple[str, str], int]] | None:
        """(run id, incarnation, series ids) when every one of them is known, else None."""
        with self._known_lock:
            run = self._runs.get(batch.run)
            session = self._sessions.get(batch.session)
        if run is None or session is None or session[:2] != (run[0], batch.rank):
            return None
        ids = self.series_ids.lookup(run[0], _wanted(batch))
        return None if ids is None else (run[0], session[2], ids)

    def forget_run(self, run: str, run_id: int | None = None) -> None:
        """Drop what this writer remembers of run `run` (id `run_id`, or the one it knows): its id, its
        sessions and its series ids, so the next batch of that name reads (or creates) them afresh. Called
        when the run was deleted here, and when a write missed a row it named (deleted by another process)."""
        with self._known_lock:
            known = self._runs.pop(run, None)
            ids = {i for i in (run_id, known[0] if known else None) if i is not None}
            for session in [s for s, (rid, _, _) in self._sessions.items() if rid in ids]:
                del self._sessions[session]
        for i in ids:
            self.series_ids.forget(i)

    def _remember(self, batch: Batch, result: IngestResult, touched: float | None) -> None:
        """After a commit: the batch's run and (once it holds a step) its session."""
        with self._known_lock:
            old = self._runs.get(batch.run)
            when = touched if touched is not None or old is None else old[2]
            self._runs[batch.run] = (result.run_id, batch.world_size, when or time.monotonic())
            self._runs.move_to_end(batch.run)
            while len(self._runs) > MAX_KNOWN_RUNS:
                self._runs.popitem(last=False)
            if batch.steps.size and not result.duplicate:
                self._sessions[batch.session] = (result.run_id, batch.rank, result.incarnation)
                self._sessions.move_to_end(batch.session)
                while len(self._sessions) > MAX_KNOWN_SESSIONS:
                    self._sessions.popitem(last=False)

    def _write_known(
        self, entries: list[tuple[Pending, tuple[int, int, dict[tuple[str, str], int]]]]
    ) -> None:
        """Batches of known runs, sessions and names in ONE transaction: one multi-row INSERT of their
        idempotency records (RETURNING those that were new: the others are duplicates), one INSERT of
        all their values and one of their step timestamps (storage/bulk.py), one executemany each of
        fingerprints and events (when there are any) and of the rank UPDATE, and the run rows that are
        due a touch. Should it fail for any reason but the
        database's (a 503 for all), each batch is written again alone, so that only a bad one fails."""
        now, mono = _utcnow(), time.monotonic()
        first: dict[tuple[str, int], Pending] = {}
        for item, _ in entries:
            first.setdefault((item.batch.session, item.batch.seq), item)
        touch: dict[int, int] = {}
        with self._known_lock:
            for item, (run_id, _, _) in entries:
                _, world_size, touched = self._runs.get(item.batch.run, (run_id, -1, 0.0))
                if world_size != item.batch.world_size or mono - touched > RUN_TOUCH_INTERVAL_S:
                    touch[run_id] = item.batch.world_size
        try:
            with write_transaction(self.engine) as conn:
                st = _statements(conn)
                new = _insert_records(conn, st, [item.batch for item in first.values()], now)
                fresh = [
                    (item, info)
                    for item, info in entries
                    if first[(item.batch.session, item.batch.seq)] is item
                ]
                fresh = [(item, info) for item, info in fresh if (item.batch.session, item.batch.seq) in new]
                points = []
                for item, (run_id, inc, ids) in fresh:
                    pre = item.prebuilt
                    if pre is not None and (pre.run_id, pre.incarnation) == (run_id, inc):
                        points.append((item.batch, inc, pre.points))
                    else:
                        points.append((item.batch, inc, _points(item.batch, ids)))
                _insert_points_of(conn, points)
                _insert_rows(conn, st, [(item.batch, run_id, inc) for item, (run_id, inc, _) in fresh])
                params = [_rank_params(item.batch, run_id, inc, now) for item, (run_id, inc, _) in fresh]
                params.sort(key=lambda p: (p["b_run_id"], p["b_rank"]))  # rows locked in one order
                if params and conn.execute(st.rank, params).rowcount != len(params):
                    for p in params:  # a rank row missing: each again (the UPDATE is idempotent)
                        if not conn.execute(st.rank, p).rowcount:
                            conn.execute(st.new_rank, _new_rank(p))
                for run_id, world_size in sorted(touch.items()):
                    conn.execute(st.touch_run, {"b_id": run_id, "b_world_size": world_size, "b_now": now})
        except (OperationalError, DatabaseTimeout) as exc:  # gone, full, read-only: a 503 for each
            self.health.failed(exc)
            for item, _ in entries:
                item.error = exc
            return
        except Exception:
            log.debug("a group of known batches failed; writing each alone", exc_info=True)
            for item, _ in entries:
                try:
                    item.result = self._write_one(item.batch, item.prebuilt)
                except Exception as exc:
                    item.error = exc
            return
        self.health.stored()
        stored = {id(item) for item, _ in fresh}
        for item, (run_id, inc, _) in entries:
            rows_in = item.batch.value_rows()
            if id(item) in stored:
                item.result = IngestResult(
                    rows=rows_in, duplicates=0, incarnation=inc, run_id=run_id,
                    steps=_value_steps(item.batch) if rows_in else None,
                )  # fmt: skip
            else:  # stored before, or a second copy within this group
                item.result = IngestResult(
                    rows=0, duplicates=rows_in, incarnation=inc, run_id=run_id, duplicate=True
                )
            self._remember(item.batch, item.result, mono if run_id in touch else None)

    def prebuild(self, batch: Batch) -> _Prebuilt | None:
        """A large batch's value rows, built before the write transaction from reads alone, when its run,
        its incarnation and every one of its names are known already (the steady state of a wide run):
        on SQLite every other writer waits while a transaction holds the write lock, and building a
        million rows is about a sixth of storing them. None when something must be created first; the
        transaction then builds the rows itself, and also when what it finds differs from these reads."""
        if batch.value_rows() < PREBUILD_MIN_ROWS:
            return None
        with self.engine.connect() as conn:  # reads only: no write lock (SQLite's WAL readers never wait)
            run_id = conn.execute(select(Run.id).where(Run.name == batch.run)).scalar()
            if run_id is None:
                return None
            session = conn.execute(
                select(AgentSession.run_id, AgentSession.rank, AgentSession.incarnation).where(
                    AgentSession.id == batch.session
                )
            ).first()
            if session is None:  # a new session: the transaction picks the next incarnation (likely this)
                previous = conn.execute(
                    select(func.max(AgentSession.incarnation)).where(
                        AgentSession.run_id == run_id, AgentSession.rank == batch.rank
                    )
                ).scalar()
                incarnation = int(previous or 0) + 1
            elif (session.run_id, session.rank) == (run_id, batch.rank):
                incarnation = int(session.incarnation)
            else:
                return None  # a session conflict: the transaction refuses it
            wanted = _wanted(batch)
            ids = self.series_ids.of_run(run_id)
            if any(key not in ids for key in wanted):
                ids = self._stored_series(conn, run_id)  # committed ids: safe to cache
                if any(key not in ids for key in wanted):
                    return None
                self.series_ids.add(run_id, ids)
        return _Prebuilt(run_id, incarnation, _points(batch, ids))

    # -- inside the transaction -------------------------------------------------------------

    def _write(
        self,
        conn: Connection,
        batch: Batch,
        new_series: dict[tuple[str, str], int],
        prebuilt: _Prebuilt | None = None,
    ) -> IngestResult:
        now = _utcnow()
        st = _statements(conn)
        run_id, touch, created = self._run_id(conn, st, batch, now)
        incarnation, new_session = self._session(conn, st, batch, run_id, now)
        rows = batch.value_rows()
        if not _insert_records(
            conn, st, [batch], now
        ):  # (session, seq) already stored: store nothing, say so
            raise _Duplicate(
                IngestResult(rows=0, duplicates=rows, incarnation=incarnation, run_id=run_id, duplicate=True)
            )

        if prebuilt is not None and (prebuilt.run_id, prebuilt.incarnation) == (run_id, incarnation):
            points = prebuilt.points  # every name had an id already: none to create, none to count
        else:
            points = _points(batch, self._series(conn, st, run_id, batch, new_series))
        _insert_points_of(conn, [(batch, incarnation, points)])
        _insert_rows(conn, st, [(batch, run_id, incarnation)])
        self._rank(conn, st, batch, run_id, incarnation, now)
        if touch:  # last, as in a group's transaction (`_write_known`): rank rows, then the run's
            conn.execute(st.touch_run, {"b_id": run_id, "b_world_size": batch.world_size, "b_now": now})
        return IngestResult(
            rows=rows,
            duplicates=0,
            incarnation=incarnation,
            run_id=run_id,
            restarted=new_session and incarnation > 1,
            new_run=created,
            steps=_value_steps(batch) if len(points) else None,
        )

    def _run_id(
        self, conn: Connection, st: _Statements, batch: Batch, now: dt.datetime
    ) -> tuple[int, bool, bool]:
        """The run's id (its row created if new), whether its row is due a touch (done by the caller), and
        whether this call created it."""
        row = conn.execute(st.run, {"b_name": batch.run}).first()
        if row is None:
            created = conn.execute(
                st.new_run,
                {"name": batch.run, "world_size": batch.world_size, "created_at": now, "last_seen_at": now},
            ).rowcount  # 0 when a concurrent first batch created it
            return int(conn.execute(st.run_id, {"b_name": batch.run}).scalar_one()), False, created == 1
        run_id, world_size, last_seen = int(row[0]), int(row[1]), row[2]
        # The run row is shared by every rank: update it only when something changed, so that
        # concurrent ranks do not queue on its row lock.
        due = world_size != batch.world_size or (now - last_seen).total_seconds() > RUN_TOUCH_INTERVAL_S
        return run_id, due, False

    def _session(
        self, conn: Connection, st: _Statements, batch: Batch, run_id: int, now: dt.datetime
    ) -> tuple[int, bool]:
        row = conn.execute(st.session, {"b_id": batch.session}).first()
        first_step = int(batch.steps[0]) if batch.steps.size else None
        if row is not None:
            if row.run_id != run_id or row.rank != batch.rank:
                raise InvalidBatch(
                    f"session: {batch.session!r} already belongs to another run or rank; "
                    "use a new session id per process and rank",
                    field="session",
                    code="session_conflict",
                )
            if row.first_step is None and first_step is not None:
                conn.execute(st.first_step, {"b_id": batch.session, "b_first_step": first_step})
            return int(row.incarnation), False
        if conn.dialect.name == "postgresql":
            # Serialise the creation of new sessions of one rank (held until commit), so that two
            # sessions starting at once read each other's incarnation instead of colliding.
            conn.execute(select(func.pg_advisory_xact_lock(run_id, batch.rank)))
        previous = conn.execute(st.last_incarnation, {"b_run_id": run_id, "b_rank": batch.rank}).scalar()
        incarnation = int(previous or 0) + 1
        # Should two writers still pick the same max+1 (SQLite across processes), the unique
        # constraint (run_id, rank, incarnation) fails one of them and write() retries it.
        conn.execute(
            st.new_session,
            {
                "id": batch.session,
                "run_id": run_id,
                "rank": batch.rank,
                "incarnation": incarnation,
                "first_step": first_step,
                "started_at": now,
            },
        )
        return incarnation, True

    def _series(
        self,
        conn: Connection,
        st: _Statements,
        run_id: int,
        batch: Batch,
        new_series: dict[tuple[str, str], int],
    ) -> dict[tuple[str, str], int]:
        """The batch's series ids, creating the names the run does not have yet, unless that would take
        the run past MAX_SERIES_PER_RUN (InvalidBatch; the transaction then rolls back whole)."""
        wanted = _wanted(batch)
        known = self.series_ids.of_run(run_id)
        missing = [key for key in wanted if key not in known]
        if not missing:  # the steady state: every name cached, nothing read
            return {key: known[key] for key in wanted}
        stored = self._stored_series(conn, run_id)  # the whole dictionary: at most the limit, one query
        new = [key for key in dict.fromkeys(missing) if key not in stored]
        if new and conn.dialect.name == "postgresql":
            # Writers that add names to one run take turns (until commit), so that each counts the
            # others' names and the limit holds exactly; those that only found names stored by others
            # (the ranks of a starting run) do not queue. SQLite's one writer gives the same for free.
            conn.execute(select(func.pg_advisory_xact_lock(run_id, _SERIES_LOCK_KEY)))
            stored = self._stored_series(conn, run_id)
            new = [key for key in new if key not in stored]
        if len(stored) + len(new) > MAX_SERIES_PER_RUN:
            field = "metrics" if any(stat == METRIC_STAT for stat, _ in new) else "tensors.stats"
            raise InvalidBatch(
                f"{field}: run {batch.run!r} would have {len(stored) + len(new):,} series names "
                f"({len(stored):,} stored and {len(new):,} new in this batch); the limit is "
                f"{MAX_SERIES_PER_RUN:,} per run (each metric name and each tensor statistic of a module "
                "counts): reuse names, or log fewer modules",
                field=field,
                code="too_many_series",
            )
        if new:
            conn.execute(st.new_series, [{"run_id": run_id, "stat": s, "name": n} for s, n in new])
            stored = self._stored_series(conn, run_id)
        new_series.update(stored)  # cached once committed: the run's names need not be read again
        return {key: stored[key] for key in wanted}

    @staticmethod
    def _stored_series(conn: Connection, run_id: int) -> dict[tuple[str, str], int]:
        found = conn.execute(_statements(conn).series, {"b_run_id": run_id})
        return {(stat, name): sid for stat, name, sid in found}

    def _rank(
        self, conn: Connection, st: _Statements, batch: Batch, run_id: int, incarnation: int, now: dt.datetime
    ) -> None:
        """The rank's row: one conditional UPDATE (`_rank_update`, which also takes PostgreSQL's row lock),
        and an INSERT when the rank has none yet (two first batches at once: one fails the primary key
        and write() tries it again, as an update)."""
        params = _rank_params(batch, run_id, incarnation, now)
        if conn.execute(st.rank, params).rowcount:
            return
        conn.execute(st.new_rank, _new_rank(params))
