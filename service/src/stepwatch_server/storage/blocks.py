"""The `blocks` table: a rank's values of every series over one bucket of BLOCK_STEPS steps, one
incarnation, as one compressed row (storage/codec.py), the compact form of `points` rows once a run has
moved on (runs/compaction.py writes them; README "Disk use, retention and deleting a run").

A block holds its steps' end times too (the `steps` rows' `ts`), as the row of series id STEP_TIMES
(`step_time_columns`, `read_step_times`, `last_step_before`). Values are handed around as five numpy
columns in `points` order: series id, rank, step, incarnation, value (`Columns`). `encode_rows` turns such columns into block rows; `read_columns` reads a range of
a run's blocks back into columns, keeping only the series and steps asked for. A run whose
`compacted_to` is NULL or below the range has no block there, and costs one small query.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from sqlalchemy import Connection, LargeBinary, bindparam, func, insert, select, text
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from stepwatch_server.storage.chunks import chunk_size, chunks
from stepwatch_server.storage.codec import Block, decode_flat, encode_many
from stepwatch_server.storage.models import Run, ValueBlock

# A block's bucket of steps. Wide enough that SQLite's overflow pages (a row over ~1 KB spills into 4 KiB
# pages, the last one part empty) and zstd's frame cost little per value: ~13 KB a block of 256 steps x 7
# metrics; 64 steps left ~40% of the pages empty (bench/README.md "Storage").
BLOCK_STEPS = 256

Columns = list[np.ndarray]  # [series_id, rank, step, incarnation] int64, [value] float64

# PostgreSQL stores a value over ~2 KB out of line in chunks of this many bytes (TOAST_MAX_CHUNK_SIZE with
# its default 8 KB pages), four to a page; a block's last, part-filled chunk left a gap that no whole one
# fits (a block of ~4.1 KB took 1.33 times its bytes). Its whole chunks go in `tail`, the rest in the row.
TOAST_CHUNK = 1996


class _BlockBytes(FunctionElement[bytes]):
    """A block's bytes in a SELECT (`DATA`): `data || tail` where PostgreSQL split them, `data` on SQLite."""

    type = LargeBinary()
    inherit_cache = True


@compiles(_BlockBytes)
def _whole(element: _BlockBytes, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(ValueBlock.__table__.c.data, **kw)


@compiles(_BlockBytes, "postgresql")
def _joined(element: _BlockBytes, compiler: SQLCompiler, **kw: Any) -> str:
    table = ValueBlock.__table__.c
    data, tail = (compiler.process(c, **kw) for c in (table.data, table.tail))
    return f"({data} || coalesce({tail}, ''::bytea))"


DATA = _BlockBytes()


def insert_rows(conn: Connection, run_id: int, rows: Sequence[dict[str, Any]]) -> None:
    """Insert block rows (`encode_rows`) of run `run_id`, their bytes split as `ValueBlock` says."""
    if not rows:
        return
    postgres = conn.dialect.name == "postgresql"
    stored = []
    for row in rows:
        data = row["data"]
        cut = len(data) % TOAST_CHUNK if postgres and len(data) >= TOAST_CHUNK else len(data)
        stored.append({**row, "run_id": run_id, "data": data[:cut], "tail": data[cut:] or None})
    conn.execute(insert(ValueBlock), stored)


# A block also holds its steps' end times (the `steps` table's `ts`, Unix seconds), as the row of this series
# id, which no `series` row has (ids start at 1). They are not values: `n_values` leaves them out.
STEP_TIMES = 0


def empty_columns() -> Columns:
    ints = np.zeros(0, dtype=np.int64)
    return [ints, ints, ints, ints, np.zeros(0, dtype=np.float64)]


def join(parts: Sequence[Columns]) -> Columns:
    parts = [p for p in parts if p[0].size]
    if not parts:
        return empty_columns()
    if len(parts) == 1:
        return parts[0]
    return [np.concatenate([p[i] for p in parts]) for i in range(5)]


def _groups(*keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The order that sorts rows by `keys` (first key first) and the starts of each run of equal keys."""
    order = np.lexsort(tuple(reversed(keys)))
    change = np.zeros(order.shape[0], dtype=bool)
    if order.size:
        change[0] = True
    for k in keys:
        s = k[order]
        change[1:] |= s[1:] != s[:-1]
    return order, np.flatnonzero(change)


def first_of_each(*keys: np.ndarray) -> np.ndarray:
    """The index of the first row of each distinct tuple of `keys` (columns of one length), in row order."""
    _, first = np.unique(np.stack(keys, axis=1), axis=0, return_index=True)
    first.sort()
    return first


def encode_rows(cols: Columns) -> list[dict[str, Any]]:
    """Block rows (rank, bucket, incarnation, n_values, data; no run id) of the values in `cols`. Where
    the same (series, rank, step, incarnation) is given twice the first one is kept (`points` keeps
    the first write too: ON CONFLICT DO NOTHING)."""
    sid, rank, step, inc, value = cols
    if sid.size == 0:
        return []
    bucket = step // BLOCK_STEPS
    order, starts = _groups(rank, bucket, inc)  # a stable sort: each group's rows in the given order
    ends = np.append(starts[1:], order.shape[0])
    rows: list[dict[str, Any]] = []
    made: list[Block] = []
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        at = order[a:b]
        steps, step_index = np.unique(step[at], return_inverse=True)
        series, series_index = np.unique(sid[at], return_inverse=True)
        cell = series_index * steps.shape[0] + step_index
        present = np.zeros(series.shape[0] * steps.shape[0], dtype=bool)
        present[cell] = True
        if np.count_nonzero(present) < at.shape[0]:  # a (series, step) given twice: the first one kept
            _, first = np.unique(cell, return_index=True)  # numpy: the first occurrences
            first.sort()
            at, cell = at[first], cell[first]
        values = np.zeros(present.shape, dtype=np.float64)
        values[cell] = value[at]
        shape = (series.shape[0], steps.shape[0])
        i = at[0]
        rows.append(
            {
                "rank": int(rank[i]),
                "bucket": int(bucket[i]),
                "incarnation": int(inc[i]),
                "n_values": int(np.count_nonzero(sid[at] != STEP_TIMES)),
            }
        )
        made.append(Block(steps, series, values.reshape(shape), present.reshape(shape)))
    for row, data in zip(rows, encode_many(made), strict=True):
        row["data"] = data
    return rows


def decode_row(rank: int, incarnation: int, data: bytes, wanted: np.ndarray | None = None) -> Columns:
    """A block row's values (of series `wanted`, sorted ids; None: all) as columns, series by series in step
    order."""
    return decode_rows([(rank, incarnation, data)], wanted)


def decode_rows(found: Sequence[tuple[Any, Any, Any]], wanted: np.ndarray | None = None) -> Columns:
    """Block rows (rank, incarnation, data) as columns (of series `wanted`, sorted ids; None: all), decoded
    together (codec.decode_flat): block by block, each block's series by series in step order."""
    flat = decode_flat([bytes(d) for *_, d in found], wanted)
    ranks = np.array([int(rank) for rank, *_ in found], dtype=np.int64)
    incarnations = np.array([int(inc) for _, inc, _ in found], dtype=np.int64)
    return [flat.series, ranks[flat.block], flat.step, incarnations[flat.block], flat.value]


_COMPACTED = text(
    "SELECT DISTINCT series.run_id, runs.compacted_to FROM series JOIN runs ON runs.id = series.run_id "
    "WHERE series.id IN :ids AND runs.compacted_to IS NOT NULL"
).bindparams(bindparam("ids", expanding=True))


def compacted_runs(conn: Connection, ids: Sequence[int]) -> dict[int, int]:
    """{run id: compacted_to} of the runs of series `ids` that have blocks."""
    found: dict[int, int] = {}
    for part in chunks(sorted(ids), chunk_size(conn)):
        found.update({int(r): int(c) for r, c in conn.execute(_COMPACTED, {"ids": list(part)})})
    return found


def read_columns(
    conn: Connection,
    ids: Sequence[int],
    rank: int | None,
    ranks: Sequence[int] | None,
    first: int | None,
    last: int | None,
) -> Columns:
    """The block-held values of series `ids` (of rank `rank`, or of `ranks`, or all) in steps first..last,
    all incarnations, unordered."""
    if not ids:
        return empty_columns()
    lo = 0 if first is None else max(0, first)
    runs = {r: c for r, c in compacted_runs(conn, ids).items() if c >= lo}
    wanted = np.asarray(sorted(ids), dtype=np.int64)
    return join(
        [_run_columns(conn, run_id, c, wanted, rank, ranks, first, last) for run_id, c in runs.items()]
    )


def step_time_columns(found: Sequence[np.ndarray]) -> Columns:
    """`steps` columns (rank, step, incarnation, ts; `queries.fetch_columns`) as columns of series id
    STEP_TIMES."""
    rank, step, inc, ts = found
    return [np.full(rank.shape[0], STEP_TIMES, dtype=np.int64), rank, step, inc, ts]


def read_step_times(
    conn: Connection, run_id: int, rank: int | None, first: int | None, last: int | None
) -> Columns:
    """The block-held step end times of run `run_id` (of rank `rank`, or all) in steps first..last, all
    incarnations, unordered; series id STEP_TIMES."""
    top = compacted_to(conn, run_id)
    if top is None or top < (0 if first is None else first):
        return empty_columns()
    return _run_columns(conn, run_id, top, np.array([STEP_TIMES]), rank, None, first, last)


def _run_columns(
    conn: Connection,
    run_id: int,
    top: int,
    wanted: np.ndarray,
    rank: int | None,
    ranks: Sequence[int] | None,
    first: int | None,
    last: int | None,
) -> Columns:
    """Series `wanted` (sorted ids) of run `run_id`'s blocks over steps first..last (up to `top`, its
    compacted_to)."""
    lo = 0 if first is None else max(0, first)
    hi = top if last is None else min(last, top)
    q = select(ValueBlock.rank, ValueBlock.incarnation, DATA).where(
        ValueBlock.run_id == run_id,
        ValueBlock.bucket >= lo // BLOCK_STEPS,
        ValueBlock.bucket <= hi // BLOCK_STEPS,
    )
    if rank is not None:
        q = q.where(ValueBlock.rank == rank)
    elif ranks is not None:
        q = q.where(ValueBlock.rank.in_(list(ranks)))
    cols = decode_rows(conn.execute(q).all(), wanted)
    keep = np.ones(cols[0].size, dtype=bool)
    if first is not None:
        keep &= cols[2] >= first
    if last is not None:
        keep &= cols[2] <= last
    return [c[keep] for c in cols]


_STEP_TIMES = np.array([STEP_TIMES], dtype=np.int64)
SCAN_BLOCKS = 64  # blocks a query reads when a rank's blocks are scanned in step order


def last_step_before(
    conn: Connection, run_id: int, rank: int, after: int, up_to: int, cutoff: float
) -> int | None:
    """The highest step of rank `rank` in after+1..up_to whose block-held end time is before `cutoff`
    (expiry's horizon), None if none is. Buckets are read upwards and the scan stops at the first time at
    or after the cutoff: times grow with steps, and stopping early can only keep more."""
    top = compacted_to(conn, run_id)
    if top is None or top <= after:
        return None
    hi = min(up_to, top)
    found: int | None = None
    bucket = max(0, after + 1) // BLOCK_STEPS
    while bucket <= hi // BLOCK_STEPS:
        page = conn.execute(
            select(ValueBlock.bucket, ValueBlock.incarnation, DATA)
            .where(
                ValueBlock.run_id == run_id,
                ValueBlock.rank == rank,
                ValueBlock.bucket >= bucket,
                ValueBlock.bucket <= hi // BLOCK_STEPS,
            )
            .order_by(ValueBlock.bucket, ValueBlock.incarnation)
            .limit(SCAN_BLOCKS)
        ).all()
        if not page:
            break
        for _, incarnation, data in page:
            _, _, step, _, ts = decode_row(rank, int(incarnation), bytes(data), _STEP_TIMES)
            at = (step > after) & (step <= hi)
            order = np.argsort(step[at], kind="stable")
            step, ts = step[at][order], ts[at][order]
            late = np.flatnonzero(~(ts < cutoff))  # a NaN time counts as late
            before = step if not late.size else step[: late[0]]
            if before.size:
                found = max(-1 if found is None else found, int(before[-1]))
            if late.size:
                return found
        bucket = int(page[-1][0]) + 1
    return found


_LOCK_KEY = -2  # PostgreSQL advisory lock (run_id, -2): moving a run's values (ingest's names use -1)


def lock_run(conn: Connection, run_id: int) -> None:
    """Serialise the transactions that move a run's values between rows and blocks (compaction) or
    aggregate them (a roll-up deciding whether blocks are involved), across processes. SQLite's one
    writer does this already."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(run_id, _LOCK_KEY)))


def compacted_to(conn: Connection, run_id: int) -> int | None:
    value = conn.execute(select(Run.compacted_to).where(Run.id == run_id)).scalar()
    return None if value is None else int(value)
