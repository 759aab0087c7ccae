"""Read queries. Values come back as numpy columns; the routes shape them into JSON.

Series return, for each (rank, step), the value of the latest incarnation: rows are read ordered
by (series, rank, step, incarnation) along the primary key and the last row of each step wins.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, Row, Select, func, select

from stepwatch_server.errors import NotFound
from stepwatch_server.storage import blocks
from stepwatch_server.storage.chunks import chunk_size, chunks
from stepwatch_server.storage.disk import database_bytes, share
from stepwatch_server.storage.models import (
    METRIC_STAT,
    AgentSession,
    Event,
    Fingerprint,
    Point,
    Rank,
    Run,
    Series,
    StepRecord,
)

STEP_TIME_METRIC = "time.step_ms"
RECENT_STEPS = 64  # the median step time is taken over at most this many recent steps


@dataclass(frozen=True, slots=True)
class RankSeries:
    series_id: int
    rank: int
    steps: np.ndarray
    values: np.ndarray


def _later(a: dt.datetime | None, b: dt.datetime | None) -> dt.datetime | None:
    if a is None or b is None:
        return a or b
    return max(a, b)


def find_run(conn: Connection, name: str) -> Row[Any]:
    """The run's row (id, name, world_size, created_at, last_seen_at), or 404."""
    row = conn.execute(select(*Run.__table__.c).where(Run.name == name)).first()
    if row is None:
        raise NotFound(f"run {name!r} not found; GET /api/v1/runs lists the runs", field="run")
    return row


def _rank_summary() -> Select[int, int, int | None, dt.datetime, int]:
    return select(
        Rank.run_id,
        func.count().label("ranks"),
        func.max(Rank.last_step).label("last_step"),
        func.max(Rank.last_seen_at).label("last_seen_at"),
        func.sum(Rank.stored_values).label("stored_values"),
    ).group_by(Rank.run_id)


def run_summaries(conn: Connection, run_id: int | None = None) -> list[dict[str, Any]]:
    """Every run (or run `run_id`), most recently seen first, with its disk use: `stored_values`, and
    `stored_bytes`, its share of the database's size by stored values (storage/disk.py)."""
    summary = _rank_summary().subquery()
    query = (
        select(
            Run.name,
            Run.world_size,
            Run.created_at,
            Run.last_seen_at,
            summary.c.ranks,
            summary.c.last_step,
            summary.c.last_seen_at.label("ranks_seen_at"),
            summary.c.stored_values,
        )
        .outerjoin(summary, summary.c.run_id == Run.id)
        .order_by(Run.last_seen_at.desc(), Run.id.desc())
    )
    if run_id is not None:
        query = query.where(Run.id == run_id)
    size = database_bytes(conn)
    all_values = int(conn.execute(select(func.coalesce(func.sum(Rank.stored_values), 0))).scalar_one())
    out = []
    for run in conn.execute(query):
        values = int(run.stored_values or 0)
        out.append(
            {
                "name": run.name,
                "world_size": run.world_size,
                "created_at": run.created_at,
                "last_seen_at": _later(run.last_seen_at, run.ranks_seen_at),
                "last_step": run.last_step,
                "ranks": run.ranks or 0,
                "stored_values": values,
                "stored_bytes": share(size, values, all_values),
            }
        )
    return out


def series_names(conn: Connection, run_id: int) -> tuple[list[str], dict[str, list[str]]]:
    metrics: list[str] = []
    tensors: dict[str, list[str]] = {}
    rows = conn.execute(
        select(Series.stat, Series.name).where(Series.run_id == run_id).order_by(Series.stat, Series.name)
    )
    for stat, name in rows:
        if stat == METRIC_STAT:
            metrics.append(name)
        else:
            tensors.setdefault(stat, []).append(name)
    return metrics, tensors


def restarts(conn: Connection, run_id: int) -> list[dict[str, Any]]:
    rows = conn.execute(
        select(AgentSession.rank, AgentSession.incarnation, AgentSession.first_step, AgentSession.started_at)
        .where(AgentSession.run_id == run_id, AgentSession.incarnation > 1)
        .order_by(AgentSession.started_at, AgentSession.rank)
    )
    return [{"rank": r, "incarnation": i, "first_step": s, "at": at} for r, i, s, at in rows]


def series_ids(conn: Connection, run_id: int, stat: str, name: str | None) -> dict[int, str]:
    query = select(Series.id, Series.name).where(Series.run_id == run_id, Series.stat == stat)
    if name is not None:
        query = query.where(Series.name == name)
    return {sid: n for sid, n in conn.execute(query.order_by(Series.name))}


def read_points(
    conn: Connection,
    ids: list[int],
    rank: int | None,
    from_step: int | None,
    to_step: int | None,
    ranks: list[int] | None = None,
) -> list[RankSeries]:
    """Each (series, rank)'s points in step order, latest incarnation per step (`read_values`)."""
    sid, rank_numbers, steps, _inc, values = read_values(conn, ids, rank, from_step, to_step, ranks)
    if sid.size == 0:
        return []
    return _split_latest(sid, rank_numbers, steps, values)


def read_values(
    conn: Connection,
    ids: list[int],
    rank: int | None,
    from_step: int | None,
    to_step: int | None,
    ranks: list[int] | None = None,
) -> blocks.Columns:
    """Every stored value of series `ids` (of `rank`, or all ranks) in from_step..to_step, every
    incarnation, as columns (series, rank, step, incarnation, value) ordered by the first four: the rows
    of `points` and the values of `blocks` (runs/compaction.py) together. Where both hold the same key
    (a value re-sent after its step was compacted) the block's, written first, comes last, so it is the
    one `_split_latest` keeps, as `points` keeps the first write. Naming the `ranks` (every rank of the
    run) lets a step range seek the primary key instead of scanning all steps."""
    if not ids:
        return blocks.empty_columns()

    def query(part: Sequence[int]) -> Any:
        q = select(Point.series_id, Point.rank, Point.step, Point.incarnation, Point.value).where(
            Point.series_id.in_(part)
        )
        if rank is not None:
            q = q.where(Point.rank == rank)
        elif ranks is not None:
            q = q.where(Point.rank.in_(ranks))
        if from_step is not None:
            q = q.where(Point.step >= from_step)
        if to_step is not None:
            q = q.where(Point.step <= to_step)
        return q.order_by(Point.series_id, Point.rank, Point.step, Point.incarnation)

    rows = fetch_chunked(conn, ids, query, (0, 1, 2, 3), fixed=len(ranks or ()) + 4)  # NULL -> nan
    return _with_blocks(rows, blocks.read_columns(conn, ids, rank, ranks, from_step, to_step))


def _with_blocks(rows: blocks.Columns, held: blocks.Columns) -> blocks.Columns:
    """Rows and block-held columns in one order (series, rank, step, incarnation), the block's last
    where both hold a key (`read_values`)."""
    if held[0].size == 0:
        return rows
    cols = blocks.join([rows, held])
    source = np.concatenate(
        [np.zeros(rows[0].shape[0], dtype=np.int8), np.ones(held[0].shape[0], dtype=np.int8)]
    )
    order = np.lexsort((source, cols[3], cols[2], cols[1], cols[0]))
    return [c[order] for c in cols]


def fetch_chunked(
    conn: Connection,
    ids: Sequence[int],
    query: Callable[[Sequence[int]], Any],
    integers: Sequence[int],
    fixed: int = 0,
) -> list[np.ndarray]:
    """`fetch_columns` of `query(part)` for the sorted `ids` in parts that fit one statement's bind
    parameters (storage/chunks.py; `fixed`: the statement's other parameters), joined: a query
    ordered by series id first comes back in that order."""
    parts = [
        fetch_columns(conn, query(part), integers)
        for part in chunks(sorted(ids), chunk_size(conn, fixed=fixed))
    ]
    if len(parts) == 1:
        return parts[0]
    return [np.concatenate([p[i] for p in parts]) for i in range(len(parts[0]))]


_EXACT = float(2**53)  # integers of smaller magnitude are exact as float64
STEP_INTEGERS = (0, 1, 2)  # rank, step, incarnation: the integer columns of a read of `steps`


def fetch_columns(
    conn: Connection, statement: Any, integers: Sequence[int], params: dict[str, Any] | None = None
) -> list[np.ndarray]:
    """The rows of a SELECT as one array per column, read straight from the driver's cursor: at 100k
    rows SQLAlchemy's Row objects and a per-column conversion cost as much as the fetch itself. The
    columns at the indices `integers` come back as int64 (exact, steps up to 2**62 included), the
    others as float64 (NULL -> NaN)."""
    result = conn.execute(statement, params)
    try:
        width = len(result.cursor.description)
        rows = result.cursor.fetchall()
    finally:
        result.close()
    floats = np.array(rows, dtype=np.float64).reshape(len(rows), width)
    cols = [floats[:, i] for i in range(width)]
    for i in integers:
        col = cols[i]
        # Every integer below 2**53 in magnitude is exact as a float64: cast back in one call. Larger
        # ones (a step near 2**62) may have lost bits: read again from the rows, one by one.
        if not col.size or float(np.abs(col).max()) < _EXACT:
            cols[i] = col.astype(np.int64)
        else:
            cols[i] = np.fromiter((row[i] for row in rows), dtype=np.int64, count=len(rows))
    return cols


def _split_latest(
    sid: np.ndarray, ranks: np.ndarray, steps: np.ndarray, values: np.ndarray
) -> list[RankSeries]:
    same_key = (sid[1:] == sid[:-1]) & (ranks[1:] == ranks[:-1])
    keep = np.ones(sid.shape[0], dtype=bool)
    keep[:-1] = ~(same_key & (steps[1:] == steps[:-1]))  # the last incarnation of a step wins
    sid, ranks, steps, values = sid[keep], ranks[keep], steps[keep], values[keep]
    bounds = np.flatnonzero((sid[1:] != sid[:-1]) | (ranks[1:] != ranks[:-1])) + 1
    starts = np.concatenate([[0], bounds])
    ends = np.concatenate([bounds, [sid.shape[0]]])
    return [
        RankSeries(int(sid[a]), int(ranks[a]), steps[a:b], values[a:b])
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
    ]


def read_steps(
    conn: Connection, run_id: int, rank: int | None, from_step: int | None, to_step: int | None
) -> list[RankSeries]:
    """Each rank's step end times (Unix seconds), latest incarnation per step: the `steps` rows and the
    times compacted into blocks together."""
    query = select(StepRecord.rank, StepRecord.step, StepRecord.incarnation, StepRecord.ts).where(
        StepRecord.run_id == run_id
    )
    if rank is not None:
        query = query.where(StepRecord.rank == rank)
    if from_step is not None:
        query = query.where(StepRecord.step >= from_step)
    if to_step is not None:
        query = query.where(StepRecord.step <= to_step)
    found = fetch_columns(
        conn, query.order_by(StepRecord.rank, StepRecord.step, StepRecord.incarnation), STEP_INTEGERS
    )
    rows = blocks.step_time_columns(found)
    cols = _with_blocks(rows, blocks.read_step_times(conn, run_id, rank, from_step, to_step))
    if cols[0].size == 0:
        return []
    return _split_latest(cols[0], cols[1], cols[2], cols[4])


def num_shards(conn: Connection, run_id: int) -> int:
    """Shards per replica as the ranks last said (the largest; 1 before any rank did)."""
    value = conn.execute(select(func.max(Rank.num_shards)).where(Rank.run_id == run_id)).scalar()
    return int(value) if value else 1


def rank_states(conn: Connection, run_id: int) -> list[dict[str, Any]]:
    ranks = conn.execute(select(*Rank.__table__.c).where(Rank.run_id == run_id).order_by(Rank.rank)).all()
    medians = median_step_ms(conn, run_id)
    return [
        {
            "rank": r.rank,
            "node": r.node,
            "local_rank": r.local_rank,
            "world_size": r.world_size,
            "replica_group": r.replica_group,
            "shard": r.shard,
            "num_shards": r.num_shards,
            "incarnation": r.incarnation,
            "last_step": r.last_step,
            "last_seen_at": r.last_seen_at,
            "last_heartbeat_at": r.last_heartbeat_at,
            "phase": r.phase,
            "median_step_ms": medians.get(r.rank),
            "agent": {"version": r.agent_version, "counters": r.agent_counters or {}},
        }
        for r in ranks
    ]


def median_step_ms(conn: Connection, run_id: int) -> dict[int, float]:
    """Per rank, the median of `time.step_ms` over its recent steps (current incarnation), from the rows
    and the blocks alike (a run silent for a day is compacted to its last step: runs/compaction.py).

    Falls back to the spacing of the step end times when the metric was not sent.
    """
    ranks = conn.execute(
        select(Rank.rank, Rank.incarnation, Rank.last_step)
        .where(Rank.run_id == run_id, Rank.last_step.is_not(None))
        .order_by(Rank.rank)
    ).all()
    if not ranks:
        return {}
    numbers, incarnations, lasts = (np.array(c, dtype=np.int64) for c in zip(*ranks, strict=True))
    sid = conn.execute(
        select(Series.id).where(
            Series.run_id == run_id, Series.stat == METRIC_STAT, Series.name == STEP_TIME_METRIC
        )
    ).scalar()
    # Ranks whose recent steps lie in the same blocks are read together, each group over its own steps: a
    # rank far behind the others (stopped, or hung) does not widen the others' read to the whole run.
    lows = lasts - RECENT_STEPS + 1
    keys = np.stack([lows // blocks.BLOCK_STEPS, lasts // blocks.BLOCK_STEPS], axis=1)
    _, group = np.unique(keys, axis=0, return_inverse=True)
    parts = []
    for g in range(int(group.max()) + 1):
        mine = group.ravel() == g
        low, high, members = int(lows[mine].min()), int(lasts[mine].max()), numbers[mine].tolist()
        if sid is not None:
            parts.append(read_values(conn, [int(sid)], None, low, high, members))
        else:
            found = fetch_columns(
                conn,
                select(StepRecord.rank, StepRecord.step, StepRecord.incarnation, StepRecord.ts)
                .where(
                    StepRecord.run_id == run_id,
                    StepRecord.rank.in_(members),
                    StepRecord.step >= low,
                    StepRecord.step <= high,
                )
                .order_by(StepRecord.rank, StepRecord.step, StepRecord.incarnation),
                STEP_INTEGERS,
            )
            held = blocks.read_step_times(conn, run_id, None, low, high)
            parts.append(_with_blocks(blocks.step_time_columns(found), held))
    cols = blocks.join(parts)
    order = np.lexsort((cols[3], cols[2], cols[1]))
    _, rank, step, inc, values = (c[order] for c in cols)
    at = np.searchsorted(numbers, rank).clip(0, numbers.size - 1)
    keep = (numbers[at] == rank) & (inc == incarnations[at]) & (step > lasts[at] - RECENT_STEPS)
    rank, step, values = rank[keep], step[keep], values[keep]
    if sid is None:  # a step's time: its end time less the one before, where the step before is there
        follows = (rank[1:] == rank[:-1]) & (step[1:] == step[:-1] + 1)
        rank, values = rank[1:][follows], (values[1:] - values[:-1])[follows] * 1000.0
    finite = np.isfinite(values)
    rank, values = rank[finite], values[finite]
    if rank.size == 0:
        return {}
    starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    return {
        int(rank[a]): float(np.median(values[a:b]))
        for a, b in zip(starts.tolist(), [*starts[1:].tolist(), rank.size], strict=True)
    }


def read_fingerprints(
    conn: Connection, run_id: int, from_step: int | None, to_step: int | None
) -> list[dict[str, Any]]:
    query = select(*Fingerprint.__table__.c).where(Fingerprint.run_id == run_id)
    if from_step is not None:
        query = query.where(Fingerprint.step >= from_step)
    if to_step is not None:
        query = query.where(Fingerprint.step <= to_step)
    query = query.order_by(Fingerprint.rank, Fingerprint.step, Fingerprint.incarnation)
    latest: dict[tuple[int, int], Row[Any]] = {}
    for fp in conn.execute(query):
        latest[(fp.rank, fp.step)] = fp  # ordered by incarnation: the last one wins
    per_rank: dict[int, dict[str, Any]] = {}
    for (rank, step), fp in latest.items():
        entry = per_rank.setdefault(
            rank,
            {"rank": rank, "replica_group": fp.replica_group, "shard": fp.shard, "steps": [], "values": []},
        )
        entry["steps"].append(step)
        entry["values"].append(fp.value)
    return list(per_rank.values())


def read_events(
    conn: Connection,
    run_id: int,
    kind: str | None,
    rank: int | None,
    from_step: int | None,
    to_step: int | None,
    limit: int,
) -> list[dict[str, Any]]:
    query = select(*Event.__table__.c).where(Event.run_id == run_id)
    if kind is not None:
        query = query.where(Event.kind == kind)
    if rank is not None:
        query = query.where(Event.rank == rank)
    if from_step is not None:
        query = query.where(Event.step >= from_step)
    if to_step is not None:
        query = query.where(Event.step <= to_step)
    query = query.order_by(Event.step, Event.ts, Event.rank, Event.id).limit(limit)
    return [
        {
            "rank": e.rank,
            "step": e.step,
            "incarnation": e.incarnation,
            "ts": e.ts,
            "kind": e.kind,
            "data": e.data,
        }
        for e in conn.execute(query)
    ]
