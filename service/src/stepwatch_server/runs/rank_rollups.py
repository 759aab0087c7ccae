"""Reads of the per-rank rollups (`rank_rollup_packs`, kept by runs/rollups.py): each rank's figures per
bucket of a level, a heatmap's columns from the level that fits them (`read_columns`), the figures of
an exact step range from the fewest whole buckets (`read_span`), and the per-rank curves of
`series?rank=all` over a wide range (`rank_curves`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sqlalchemy import Connection

from stepwatch_server.runs import rank_packs, step_rollups
from stepwatch_server.runs.rollups import (
    BUCKET_STEPS,
    LEVELS,
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

RAW_READ_BUDGET = 200_000  # above this many raw values, a heatmap or series?rank=all reads the rollups


def read(
    conn: Connection,
    ids: list[int],
    from_step: int | None,
    to_step: int | None,
    level: int = 0,
    figures: Sequence[str] = rank_packs.FIGURES,
) -> Buckets:
    """Per (series, rank, bucket of `level_steps(level)` steps) covering from_step..to_step (whole
    buckets): the rank rollups of the level's buckets wholly up to the watermark, the rest summed
    from the level below (from the raw points below level 0). Of the stored rollups only `figures` are
    decoded (rank_packs.decode_columns): the others may be NaN."""
    if not ids:
        return empty()
    width = level_steps(level)
    first, last = (from_step or 0) // width, None if to_step is None else to_step // width
    ranks = run_ranks(conn, run_ids_of(conn, ids))
    return _read_level(conn, ids, level, first, last, rolled_to(conn, ids), ranks, figures)


def _read_level(
    conn: Connection,
    ids: list[int],
    level: int,
    first: int,
    last: int | None,
    mark: int,
    ranks: list[int] | None,
    figures: Sequence[str] = rank_packs.FIGURES,
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
        cols = rank_packs.read(
            conn, ids, level, first, cut - 1 if last is None else min(cut - 1, last), figures
        )
        if ranks is not None:
            inside = np.isin(cols[1], ranks)
            cols = [c[inside] for c in cols]

        def exact(sid: int, bucket: int) -> Buckets:
            if level == 0:
                return from_points(conn, [sid], bucket * width, bucket * width + width - 1, False, width)
            below = _read_level(conn, [sid], level - 1, 2 * bucket, 2 * bucket + 1, mark, ranks, figures)
            return coarsen(below, 2)

        parts.append(resolve(cols, exact))
    tail = max(cut, first)
    if last is None or tail <= last:
        if level == 0:
            tail_last = None if last is None else last * width + width - 1
            parts.append(from_points(conn, ids, tail * width, tail_last, False, width))
        else:
            below_last = None if last is None else 2 * last + 1
            below = _read_level(conn, ids, level - 1, 2 * tail, below_last, mark, ranks, figures)
            parts.append(coarsen(below, 2))
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
    conn: Connection,
    sid: int,
    first_step: int,
    last_step: int,
    columns: int,
    figures: Sequence[str] = rank_packs.FIGURES,
) -> tuple[Buckets, int, int]:
    """Series `sid`'s figures per (rank, column) over first_step..last_step in at most `columns`
    columns of whole buckets of `column_level` (several buckets per column only past the coarsest
    level): (the cells, with `bucket` the column's index; the first column's first step; the
    width of a column in steps). Columns are aligned to the level's buckets, so the first and the
    last may reach past the range by up to a column's width (their `steps` say where they start).
    `figures`: as `read`'s."""
    level = column_level(first_step, last_step, columns)
    width = level_steps(level)
    first, last = first_step // width, last_step // width
    per_column = -(-(last - first + 1) // columns)
    cells = read(conn, [sid], first * width, last * width + width - 1, level, figures)
    return coarsen(cells, per_column, offset=first), first * width, per_column * width


def read_span(conn: Connection, ids: list[int], first_step: int, last_step: int) -> Buckets:
    """Per (series, rank), the figures of exactly steps first_step..last_step (`bucket` 0): the whole
    level-0 buckets inside it taken as the fewest whole buckets of any level (at most two per level,
    as in a segment tree: `_pieces`), the steps of the partial buckets at its ends from the raw points (at
    most 2 x 63 steps per rank)."""
    ranks = run_ranks(conn, run_ids_of(conn, ids))
    mark = rolled_to(conn, ids)
    lo, hi = -(-first_step // BUCKET_STEPS), (last_step + 1) // BUCKET_STEPS  # whole level-0 buckets lo..hi-1
    if lo >= hi:
        parts = [from_points(conn, ids, first_step, last_step, False, BUCKET_STEPS)]
    else:
        parts = [
            from_points(conn, ids, first_step, lo * BUCKET_STEPS - 1, False, BUCKET_STEPS),
            from_points(conn, ids, hi * BUCKET_STEPS, last_step, False, BUCKET_STEPS),
        ]
        parts += [_read_level(conn, ids, level, a, b, mark, ranks) for level, a, b in _pieces(lo, hi)]
    cells = merge(*parts)
    return coarsen(_at(cells, 0), 2)


def span_peaks(
    conn: Connection, ids: list[int], first_step: int, last_step: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the series of `ids` with values in steps first_step..last_step, sorted; each one's highest finite
    value over every rank, step and incarnation there, NaN where it has none; its non-finite values), as
    a ranking needs them: the whole level-0 buckets up to the watermark as the fewest whole buckets of any
    level (`_pieces`), of which only the highest maximum and non-finite count stored beside each pack are
    read, nothing decoded (`rank_packs.peaks`), and the steps at the range's ends, a row a step over all
    ranks where rolled up (`step_rollups.step_peaks`: at 256 ranks the raw values of a partial bucket took
    seconds). A restart's re-sent steps count with both incarnations' values, as the amax curves' peaks do
    (`step_rollups.across_ranks` without means)."""
    mark = rolled_to(conn, ids)
    lo = -(-first_step // BUCKET_STEPS)
    hi = max(lo, (min(last_step, mark) + 1) // BUCKET_STEPS)  # whole level-0 buckets lo..hi-1, rolled up
    pieces = _pieces(lo, hi)
    found = [rank_packs.peaks(conn, ids, pieces)] if pieces else []
    edges = [(first_step, lo * BUCKET_STEPS - 1), (hi * BUCKET_STEPS, last_step)] if lo < hi else []
    found += [
        step_rollups.step_peaks(conn, ids, a, b) for a, b in edges or [(first_step, last_step)] if a <= b
    ]
    sid, high, bad = (np.concatenate(c) for c in zip(*found, strict=True))
    series, at = np.unique(sid, return_inverse=True)
    highest = np.full(series.size, np.nan)
    np.fmax.at(highest, at, high)
    return series, highest, np.bincount(at, weights=bad, minlength=series.size).astype(np.int64)


def _pieces(lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Level-0 buckets lo..hi-1 as the fewest whole buckets of any level, (level, first, last) each: at
    most two a level, as in a segment tree, the top level's in one range."""
    pieces = []
    level = 0
    while lo < hi:
        if level == LEVELS - 1:
            pieces.append((level, lo, hi - 1))
            break
        if lo % 2:
            pieces.append((level, lo, lo))
            lo += 1
        if hi % 2:
            hi -= 1
            pieces.append((level, hi, hi))
        lo, hi, level = lo // 2, hi // 2, level + 1
    return pieces


def _at(cells: Buckets, bucket: int) -> Buckets:
    """`cells` with every bucket number set to `bucket`."""
    return Buckets(
        cells.series_id,
        cells.rank,
        np.full_like(cells.bucket, bucket),
        *(getattr(cells, f) for f in Buckets.__slots__[3:]),
    )


def read_range(
    conn: Connection, sid: int, first_step: int, last_step: int, columns: int
) -> tuple[Buckets, int, int]:
    """As `read_columns`, but the first and the last column hold only the steps from first_step and
    up to last_step (summed by `read_span`), not the whole buckets around them."""
    level = column_level(first_step, last_step, columns)
    width = level_steps(level)
    first, last = first_step // width, last_step // width
    per_column = -(-(last - first + 1) // columns)
    whole_lo = first if first_step == first * width else first + 1
    whole_hi = last if last_step == last * width + width - 1 else last - 1
    parts = []
    if whole_lo <= whole_hi:
        parts.append(read(conn, [sid], whole_lo * width, whole_hi * width + width - 1, level))
    if first == last and whole_lo > whole_hi:
        parts.append(_at(read_span(conn, [sid], first_step, last_step), first))
    else:
        if whole_lo > first:
            parts.append(_at(read_span(conn, [sid], first_step, first * width + width - 1), first))
        if whole_hi < last:
            parts.append(_at(read_span(conn, [sid], last * width, last_step), last))
    cells = merge(*parts) if parts else empty()
    return coarsen(cells, per_column, offset=first), first * width, per_column * width


def rank_curves(
    conn: Connection, sid: int, first_step: int, last_step: int, max_points: int
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per rank of series `sid`, (rank, steps, values) over first_step..last_step in at most
    `max_points` points, from the rank rollups (`read_range` in max_points / 2 columns): each column's
    lowest value at its first step and its highest at its middle step (one point where they are
    equal), NaN as the highest where the column holds a non-finite value, as the mean curve does.
    The extremes are exact, their steps are those of their column."""
    cells, start_step, width = read_range(conn, sid, first_step, last_step, max(1, max_points // 2))
    if cells.n.size == 0:
        return []
    start = np.maximum(first_step, start_step + cells.bucket * width)
    end = np.minimum(last_step, start_step + (cells.bucket + 1) * width - 1)
    bad = cells.nonfinite > 0
    high = np.where(bad, np.nan, cells.hi)
    single = (cells.n == 0) | (end == start) | (~bad & (cells.lo == cells.hi))
    steps = np.stack([start, start + np.maximum(1, (end - start + 1) // 2)], axis=1).reshape(-1)
    values = np.stack([np.where(single & bad, np.nan, cells.lo), high], axis=1).reshape(-1)
    keep = np.stack([np.ones_like(single), ~single], axis=1).reshape(-1)
    rank_of = np.repeat(cells.rank, 2)[keep]
    steps, values = steps[keep], values[keep]
    bounds = np.flatnonzero(rank_of[1:] != rank_of[:-1]) + 1
    return [
        (int(rank_of[a]), steps[a:b], values[a:b])
        for a, b in zip(
            np.concatenate([[0], bounds]).tolist(),
            np.concatenate([bounds, [rank_of.size]]).tolist(),
            strict=True,
        )
    ]


def rollup_range(
    conn: Connection,
    ids: list[int],
    from_step: int | None,
    to_step: int | None,
    expired_to: int | None,
    all_ranks: bool = True,
) -> tuple[int, int] | None:
    """(first, last step stored) of a range that the per-rank views (series, heatmaps) read from the rank
    rollups: one whose raw values retention deleted in part (runs/expiry.py: steps up to `expired_to`),
    or, over all ranks, one holding more than RAW_READ_BUDGET values (a bounded read: about max_points
    rows per rank, where the raw points were 51M at 100k steps x 512 ranks). None: read the raw points."""
    found = step_rollups.step_range(conn, ids, from_step, to_step, count_up_to=RAW_READ_BUDGET)
    if found is None:
        return None
    if expired_to is not None and found[0] <= expired_to:
        return found[0], found[1]
    if not all_ranks or found[2] <= RAW_READ_BUDGET:
        return None
    return found[0], found[1]
