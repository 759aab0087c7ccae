"""Ranks x steps heatmaps: one value per (rank, bucket of steps), optionally relative to the
cross-rank median of the same bucket.

Synchronous training equalises step time, so a slow rank shows up in its own data or forward time,
compared with its peers at the same steps (DESIGN.md). The heatmap puts every rank on a row and the
steps in columns; each cell is the rank's mean over the bucket's steps divided by the median of all
ranks' means in that bucket, so 1.0 is "like its peers" and a straggler is a bright horizontal line
from the step it started. Absolute mode (memory) keeps each bucket's maximum instead, so a one-step
peak is not averaged away. Everything is vectorised: one bincount over all (rank, bucket) cells.
On a big run the cells come from the rank rollups (runs/rank_rollups.py) instead of the raw points: columns
of whole rollup buckets, as wide as the level that gives at most the columns asked for.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from sqlalchemy import Connection

from stepwatch_server.runs import rank_rollups
from stepwatch_server.runs.queries import RankSeries

DEFAULT_BUCKETS = 240
MAX_BUCKETS = 2000
MODES = ("median", "absolute")


def bucket_edges(first: int, last: int, buckets: int) -> tuple[np.ndarray, int]:
    """The first step of each bucket and the bucket width (steps), covering first..last."""
    span = last - first + 1
    width = max(1, -(-span // buckets))
    return np.arange(first, last + 1, width, dtype=np.int64), width


def heatmap(series: Sequence[RankSeries], buckets: int, mode: str) -> dict[str, Any]:
    """`series`: one metric's points per rank. Returns ranks, bucket start steps and the matrix."""
    if not series:
        return _empty()
    first = min(int(s.steps[0]) for s in series)
    last = max(int(s.steps[-1]) for s in series)
    starts, width = bucket_edges(first, last, buckets)
    ranks = np.array([s.rank for s in series], dtype=np.int64)
    row = np.concatenate([np.full(s.steps.shape[0], i, dtype=np.int64) for i, s in enumerate(series)])
    col = (np.concatenate([s.steps for s in series]) - first) // width
    values = np.concatenate([s.values for s in series])
    ok = np.isfinite(values)
    cells = row[ok] * starts.shape[0] + col[ok]
    size = ranks.shape[0] * starts.shape[0]
    counts = np.bincount(cells, minlength=size)
    sums = np.bincount(cells, weights=values[ok], minlength=size)
    peak = np.full(size, -np.inf)
    np.maximum.at(peak, cells, values[ok])
    return _matrix(ranks, starts, width, counts, sums, peak, mode)


def heatmap_from_rollups(
    conn: Connection, sid: int, first_step: int, last_step: int, buckets: int, mode: str
) -> dict[str, Any]:
    """The same matrix from the rank rollups of series `sid` over first_step..last_step: columns are
    whole buckets of the rollup level that fits at most `buckets` of them (runs/rank_rollups.py), so one
    stored row per rank and column is read."""
    cells, start, width = rank_rollups.read_columns(conn, sid, first_step, last_step, buckets)
    cells = cells.take(np.flatnonzero(cells.n > 0))
    if cells.n.size == 0:
        return _empty()
    starts = np.arange(start, last_step + 1, width, dtype=np.int64)
    ranks, row = np.unique(cells.rank, return_inverse=True)
    index = row * starts.shape[0] + cells.bucket
    size = ranks.shape[0] * starts.shape[0]
    counts = np.zeros(size)
    sums = np.zeros(size)
    peak = np.full(size, -np.inf)
    counts[index], sums[index], peak[index] = cells.n, cells.total, cells.hi
    return _matrix(ranks, starts, width, counts, sums, peak, mode)


def _empty() -> dict[str, Any]:
    return {"ranks": [], "steps": [], "bucket_steps": 1, "values": [], "median": []}


def _matrix(
    ranks: np.ndarray,
    starts: np.ndarray,
    width: int,
    counts: np.ndarray,
    sums: np.ndarray,
    peak: np.ndarray,
    mode: str,
) -> dict[str, Any]:
    """Cells (row-major, ranks x buckets) of finite-value counts, sums and maxima -> the answer."""
    if mode == "absolute":
        matrix = np.where(counts > 0, peak, np.nan)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            matrix = sums / counts
    matrix = matrix.reshape(ranks.shape[0], starts.shape[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an empty bucket's median is NaN, as meant
        median = np.nanmedian(matrix, axis=0)
    if mode == "median":
        with np.errstate(invalid="ignore", divide="ignore"):
            matrix = matrix / median
    rounded = np.round(matrix, 4)
    return {
        "ranks": ranks,
        "steps": starts,
        "bucket_steps": width,
        "values": [_nulls(r) for r in rounded],
        "median": _nulls(np.round(median, 4)),
    }


def _nulls(values: np.ndarray) -> list[float | None]:
    """Finite values as numbers, empty cells (and non-finite ones) as null."""
    out: list[Any] = values.tolist()
    for i in np.flatnonzero(~np.isfinite(values)).tolist():
        out[i] = None
    return out
