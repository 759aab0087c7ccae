"""How the step rollups of compacted steps are stored: one row per (series, bucket of BUCKET_STEPS steps,
incarnation) holding each step's figures over every rank (`step_rollup_packs`), not one row per step.

A `step_rollups` row took ~50 bytes on SQLite and ~125 on PostgreSQL (key, tuple header and index): 0.16 and
0.49 bytes per stored value of a compacted 256-rank run (bench/README.md "Storage"), against ~12 bytes a step
in a pack. A pack is the figures pack of runs/rank_packs.py (the block codec, every figure bit for bit) with
the steps as its keys.

Compaction (runs/compaction.py) moves a bucket's rows here in the transaction that moves its values into
blocks (`pack`), so the steps of a run that the rollup worker rolls up every round stay rows. A round that
rolls up compacted steps again (a value that arrived late for one, or a round given up) first turns their
packs back into rows (`unpack`, runs/rollups.py), and that bucket stays rows. A step is in a row or in a pack,
never both; reads (runs/step_rollups.py) take the rows and the packs of a range together (`read`,
`extent`).

Columns here are lists of numpy arrays in the order of the step rollups' reads: series, ALL_RANKS, step,
incarnation, n, total, lo, hi, nonfinite (`rank_packs.COLUMNS` with the step as the bucket).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from sqlalchemy import Connection, and_, delete, func, insert, literal, or_, select

from stepwatch_server.runs import rank_packs
from stepwatch_server.runs.queries import fetch_chunked
from stepwatch_server.storage import blocks
from stepwatch_server.storage.blocks import BLOCK_STEPS
from stepwatch_server.storage.chunks import chunk_size, chunks
from stepwatch_server.storage.models import StepRollup, StepRollupPack

BUCKET_STEPS = BLOCK_STEPS  # a pack holds the steps of one compacted bucket
ALL_RANKS = -1  # the rank of a step rollup (over every rank) where one key shape serves both kinds of rollup
INTEGERS = rank_packs.INTEGERS
_FIGURES = rank_packs.FIGURES
_INSERT_PACKS = 1_000  # packs (up to a few KB each) per INSERT statement
_INSERT_ROWS = 10_000  # step rollup rows (nine numbers each) per INSERT statement


def _rows_query(part: Sequence[int], first: int, last: int) -> Any:
    r = StepRollup
    return (
        select(r.series_id, literal(ALL_RANKS), r.step, r.incarnation, r.n, r.total, r.lo, r.hi, r.nonfinite)
        .where(r.series_id.in_(part), r.step >= first, r.step <= last)
        .order_by(r.series_id, r.step, r.incarnation)
    )


def pack(conn: Connection, ids: Sequence[int], first: int, last: int) -> int:
    """Move the step rollup rows of series `ids` in steps first..last into packs, one per (series, bucket,
    incarnation), merged with a pack already there (its steps that have no row); the number of packs
    written. A range that cuts a bucket keeps the bucket's packed steps outside it."""
    rows = fetch_chunked(conn, ids, lambda part: _rows_query(part, first, last), INTEGERS, fixed=2)
    if rows[0].size == 0:
        return 0
    held = read(
        conn, ids, first // BUCKET_STEPS * BUCKET_STEPS, (last // BUCKET_STEPS + 1) * BUCKET_STEPS - 1
    )
    cols = [np.concatenate([r, h]) for r, h in zip(rows, held, strict=True)]  # rows first: they win
    kept = blocks.first_of_each(cols[0], cols[2], cols[3])  # one per (series, step, incarnation)
    cols = [c[kept] for c in cols]
    sid, step, inc = cols[0], cols[2], cols[3]
    bucket = step // BUCKET_STEPS
    order = np.lexsort((step, inc, bucket, sid))
    sid, step, inc, bucket = sid[order], step[order], inc[order], bucket[order]
    figures = [c[order] for c in cols[4:]]
    counted = figures[0] + figures[4]  # n + nonfinite: the values each step sums
    packs = [
        {
            "series_id": int(sid[a]),
            "bucket": int(bucket[a]),
            "incarnation": int(inc[a]),
            "first_step": int(step[a]),
            "last_step": int(step[b - 1]),
            "n_values": int(counted[a:b].sum()),
            "data": data,
        }
        for a, b, data in rank_packs.encode_groups([sid, bucket, inc], step, figures)
    ]
    _remove(conn, ids, first // BUCKET_STEPS, last // BUCKET_STEPS)
    for i in range(0, len(packs), _INSERT_PACKS):
        conn.execute(insert(StepRollupPack), packs[i : i + _INSERT_PACKS])
    r = StepRollup
    for part in chunks(sorted(ids), chunk_size(conn, fixed=2)):
        conn.execute(delete(r).where(r.series_id.in_(part), r.step >= first, r.step <= last))
    return len(packs)


def unpack(conn: Connection, ids: Sequence[int], first: int, last: int) -> None:
    """Turn the packs of series `ids` that hold a step in first..last back into `step_rollups` rows (every
    step of their buckets), for a round of the rollup worker that writes those steps' rows again."""
    lo, hi = first // BUCKET_STEPS, last // BUCKET_STEPS
    cols = _read_packs(conn, ids, [StepRollupPack.bucket >= lo, StepRollupPack.bucket <= hi], 2)
    if cols[0].size == 0:
        return
    _remove(conn, ids, lo, hi)
    insert_rows(conn, [cols[0], cols[2], cols[3], *cols[4:]])


def insert_rows(conn: Connection, cols: Sequence[np.ndarray]) -> None:
    """Insert `step_rollups` rows from columns series, step, incarnation, n, total, lo, hi, nonfinite (a NaN
    extreme, of a step with no finite value, stored as NULL)."""
    names = ["series_id", "step", "incarnation", *_FIGURES]
    rows = [
        {
            name: (None if isinstance(v, float) and np.isnan(v) else v)
            for name, v in zip(names, row, strict=True)
        }
        for row in zip(*(c.tolist() for c in cols), strict=True)
    ]
    for i in range(0, len(rows), _INSERT_ROWS):
        conn.execute(insert(StepRollup), rows[i : i + _INSERT_ROWS])


def _remove(conn: Connection, ids: Sequence[int], lo: int, hi: int) -> None:
    """Delete the packs of series `ids` for buckets lo..hi."""
    p = StepRollupPack
    for part in chunks(sorted(ids), chunk_size(conn, fixed=2)):
        conn.execute(delete(p).where(p.series_id.in_(part), p.bucket >= lo, p.bucket <= hi))


def read(conn: Connection, ids: Sequence[int], first: int, last: int) -> list[np.ndarray]:
    """The step figures in the packs of series `ids` for steps first..last, sorted by (series, step,
    incarnation)."""
    p = StepRollupPack
    cols = _read_packs(conn, ids, [p.last_step >= first, p.first_step <= last], 2)
    inside = (cols[2] >= first) & (cols[2] <= last)
    return cols if inside.all() else [c[inside] for c in cols]


def _read_packs(conn: Connection, ids: Sequence[int], where: list[Any], params: int) -> list[np.ndarray]:
    """The decoded packs of series `ids` that match `where` (conditions binding `params` parameters)."""
    p = StepRollupPack
    found: list[Any] = []
    for part in chunks(sorted(ids), chunk_size(conn, fixed=params)):
        found += conn.execute(
            select(p.series_id, p.incarnation, p.data).where(p.series_id.in_(part), *where)
        ).all()
    if not found:
        return rank_packs.empty()
    (sid, inc), step, figures = rank_packs.unpack_keyed(found)
    cols = [sid, np.full(sid.size, ALL_RANKS, dtype=np.int64), step, inc, *figures]
    order = np.lexsort((inc, step, sid))
    return [c[order] for c in cols]


def extent(conn: Connection, ids: Sequence[int], first: int, last: int) -> tuple[int, int, int] | None:
    """(first step, last step, values summed) of what the packs of series `ids` hold in steps first..last,
    None if nothing: the packs wholly inside counted by their columns, the one or two a range cuts decoded."""
    p = StepRollupPack
    inside = and_(p.first_step >= first, p.last_step <= last)
    cut = and_(p.last_step >= first, p.first_step <= last, or_(p.first_step < first, p.last_step > last))
    found = []
    for part in chunks(sorted(ids), chunk_size(conn, fixed=4)):
        lo, hi, n = conn.execute(
            select(func.min(p.first_step), func.max(p.last_step), func.sum(p.n_values)).where(
                p.series_id.in_(part), inside
            )
        ).one()
        if lo is not None:
            found.append((int(lo), int(hi), int(n)))
    edges = _read_packs(conn, ids, [cut], 4)
    keep = (edges[2] >= first) & (edges[2] <= last)
    if keep.any():
        step = edges[2][keep]
        found.append((int(step.min()), int(step.max()), int((edges[4][keep] + edges[8][keep]).sum())))
    if not found:
        return None
    return min(f[0] for f in found), max(f[1] for f in found), sum(f[2] for f in found)
