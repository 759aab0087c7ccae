"""Reads of the per-rank rollups (`rank_rollups`, kept by runs/rollups.py): each rank's figures per
bucket of a level, and a heatmap's columns from the level that fits them (`read_columns`)."""

from __future__ import annotations

import numpy as np
from sqlalchemy import Connection, select

from stepwatch_server.runs.queries import fetch_columns
from stepwatch_server.runs.rollups import (
    LEVELS,
    ROLLUP_INTEGERS,
    Buckets,
    empty,
    from_points,
    level_steps,
    merge,
    resolve,
    rolled_to,
    run_ids_of,
    run_ranks,
)
from stepwatch_server.storage.models import RankRollup

RAW_READ_BUDGET = 200_000  # above this many raw values, a heatmap reads the rollups instead


def read(
    conn: Connection, ids: list[int], from_step: int | None, to_step: int | None, level: int = 0
) -> Buckets:
    """Per (series, rank, bucket of `level_steps(level)` steps) covering from_step..to_step (whole
    buckets): the rank rollups of the level's buckets wholly up to the watermark, the rest summed
    from the level below (from the raw points below level 0)."""
    if not ids:
        return empty()
    width = level_steps(level)
    first, last = (from_step or 0) // width, None if to_step is None else to_step // width
    ranks = run_ranks(conn, run_ids_of(conn, ids))
    return _read_level(conn, ids, level, first, last, rolled_to(conn, ids), ranks)


def _read_level(
    conn: Connection,
    ids: list[int],
    level: int,
    first: int,
    last: int | None,
    mark: int,
    ranks: list[int] | None,
) -> Buckets:
    """Buckets first..last (None: to the end) of `level`. The rows of the buckets below the cut (the
    first bucket not wholly up to `mark`) come from the table, a bucket of several incarnations is
    recomputed one level down, and the buckets from the cut on are summed from the level below: at
    most one bucket per level is read that way, down to the raw points from the start of the level-0
    bucket that the watermark falls in."""
    width = level_steps(level)
    cut = (mark + 1) // width
    parts: list[Buckets] = []
    if first < cut:
        r = RankRollup
        query = select(
            r.series_id, r.rank, r.bucket, r.incarnation, r.n, r.total, r.lo, r.hi, r.nonfinite
        ).where(r.series_id.in_(ids), r.level == level, r.bucket >= first, r.bucket < cut)
        if last is not None:
            query = query.where(r.bucket <= last)
        if ranks is not None:
            query = query.where(r.rank.in_(ranks))  # the primary key (series, level, rank, bucket) is sought
        cols = fetch_columns(
            conn, query.order_by(r.series_id, r.rank, r.bucket, r.incarnation), ROLLUP_INTEGERS
        )

        def exact(sid: int, bucket: int) -> Buckets:
            if level == 0:
                return from_points(conn, [sid], bucket * width, bucket * width + width - 1, False, width)
            return coarsen(_read_level(conn, [sid], level - 1, 2 * bucket, 2 * bucket + 1, mark, ranks), 2)

        parts.append(resolve(cols, exact))
    tail = max(cut, first)
    if last is None or tail <= last:
        if level == 0:
            tail_last = None if last is None else last * width + width - 1
            parts.append(from_points(conn, ids, tail * width, tail_last, False, width))
        else:
            below_last = None if last is None else 2 * last + 1
            parts.append(coarsen(_read_level(conn, ids, level - 1, 2 * tail, below_last, mark, ranks), 2))
    return merge(*parts) if parts else empty()


def coarsen(cells: Buckets, factor: int, offset: int = 0) -> Buckets:
    """Buckets summed per (series, rank, (bucket - offset) // factor): counts and sums added, the lowest
    minimum and highest maximum kept (a bucket without finite values does not count)."""
    if factor == 1 or cells.n.size == 0:
        return Buckets(
            cells.series_id,
            cells.rank,
            cells.bucket - offset,
            *(getattr(cells, f) for f in Buckets.__slots__[3:]),
        )
    group = (cells.bucket - offset) // factor
    order = np.lexsort((group, cells.rank, cells.series_id))
    sid, rank, group = cells.series_id[order], cells.rank[order], group[order]
    change = np.ones(sid.shape[0], dtype=bool)
    change[1:] = (sid[1:] != sid[:-1]) | (rank[1:] != rank[:-1]) | (group[1:] != group[:-1])
    starts = np.flatnonzero(change)
    return Buckets(
        sid[starts],
        rank[starts],
        group[starts],
        np.add.reduceat(cells.n[order], starts),
        np.add.reduceat(cells.total[order], starts),
        np.fmin.reduceat(cells.lo[order], starts),
        np.fmax.reduceat(cells.hi[order], starts),
        np.add.reduceat(cells.nonfinite[order], starts),
    )


def column_level(first_step: int, last_step: int, columns: int) -> int:
    """The finest level whose buckets cover first_step..last_step in at most `columns` buckets (the
    coarsest level where none does): one stored row per rank and column, and at least `columns / 2`
    columns wherever the range is wider than level 0 allows (a range of under 32 x `columns` steps
    gets its 64-step buckets, fewer columns than asked)."""
    for level in range(LEVELS):
        width = level_steps(level)
        if last_step // width - first_step // width + 1 <= columns:
            return level
    return LEVELS - 1


def read_columns(
    conn: Connection, sid: int, first_step: int, last_step: int, columns: int
) -> tuple[Buckets, int, int]:
    """Series `sid`'s figures per (rank, column) over first_step..last_step in at most `columns`
    columns of whole buckets of `column_level` (several buckets per column only past the coarsest
    level): (the cells, with `bucket` the column's index; the first column's first step; the
    width of a column in steps). Columns are aligned to the level's buckets, so the first and the
    last may reach past the range by up to a column's width (their `steps` say where they start)."""
    level = column_level(first_step, last_step, columns)
    width = level_steps(level)
    first, last = first_step // width, last_step // width
    per_column = -(-(last - first + 1) // columns)
    cells = read(conn, [sid], first * width, last * width + width - 1, level)
    return coarsen(cells, per_column, offset=first), first * width, per_column * width
