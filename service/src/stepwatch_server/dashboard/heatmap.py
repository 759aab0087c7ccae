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

Relative phase times blame a straggler's victims where they wait inside a collective (a forward that holds
DDP's buffer broadcast), so the default view is derived instead: `LATE`, how late each rank reached its
step's sync points (stepwatch_server.timeline), from the bucket means of the four `TIMELINE` metrics on
one grid.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection

from stepwatch_server.runs import rank_rollups
from stepwatch_server.runs.queries import RankSeries
from stepwatch_server.timeline import holding_up

DEFAULT_BUCKETS = 240
MAX_BUCKETS = 2000
MODES = ("median", "absolute")
MODE_FIGURES = {
    "median": ("n", "total"),
    "absolute": ("n", "hi"),
}  # the rank rollups' figures each mode shows
LATE = "time.late_ms"  # derived: who holds the run up (stepwatch_server.timeline), answered as mode "late"
TIMELINE = ("time.data_ms", "time.backward_ms", "time.optimizer_ms", "time.step_ms")  # what LATE reads
LATE_MIN_STEPS = 8  # LATE's columns hold at least this many steps: who holds the run up is judged over a few


def bucket_edges(first: int, last: int, buckets: int, min_width: int = 1) -> tuple[np.ndarray, int]:
    """The first step of each bucket and the bucket width (steps, at least `min_width`), covering
    first..last."""
    span = last - first + 1
    width = max(min_width, -(-span // buckets))
    return np.arange(first, last + 1, width, dtype=np.int64), width


@dataclass(frozen=True, slots=True)
class Cells:
    """One metric's figures per (rank, column of steps): finite-value counts, sums and maxima, row-major
    (ranks x columns), columns starting at `starts`, each `width` steps wide."""

    ranks: np.ndarray
    starts: np.ndarray
    width: int
    counts: np.ndarray
    sums: np.ndarray
    peak: np.ndarray

    def means(self, ranks: np.ndarray) -> np.ndarray:
        """(len(ranks), columns) of each cell's mean, NaN where a rank has no value (or is not here)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            mine = (self.sums / self.counts).reshape(self.ranks.shape[0], self.starts.shape[0])
        out = np.full((ranks.shape[0], self.starts.shape[0]), np.nan)
        out[np.searchsorted(ranks, self.ranks)] = mine
        return out


def raw_cells(series: Sequence[RankSeries], first: int, last: int, buckets: int) -> Cells:
    """`series` (one metric's points per rank) in `buckets` columns covering first..last."""
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
    return Cells(ranks, starts, width, counts, sums, peak)


def rollup_cells(
    conn: Connection, sid: int, first_step: int, last_step: int, buckets: int, mode: str
) -> Cells | None:
    """The same cells from the rank rollups of series `sid` over first_step..last_step: columns are
    whole buckets of the rollup level that fits at most `buckets` of them (runs/rank_rollups.py), so one
    stored row per rank and column is read, and of it only the figures `mode` shows (`MODE_FIGURES`:
    the sums of a mean, or the maxima; the other is NaN). None when nothing is stored there."""
    figures = MODE_FIGURES[mode]
    cells, start, width = rank_rollups.read_columns(conn, sid, first_step, last_step, buckets, figures)
    cells = cells.take(np.flatnonzero(cells.n > 0))
    if cells.n.size == 0:
        return None
    starts = np.arange(start, last_step + 1, width, dtype=np.int64)
    ranks, row = np.unique(cells.rank, return_inverse=True)
    index = row * starts.shape[0] + cells.bucket
    size = ranks.shape[0] * starts.shape[0]
    counts = np.zeros(size)
    sums = np.zeros(size)
    peak = np.full(size, -np.inf)
    counts[index], sums[index], peak[index] = cells.n, cells.total, cells.hi
    return Cells(ranks, starts, width, counts, sums, peak)


def heatmap(series: Sequence[RankSeries], buckets: int, mode: str) -> dict[str, Any]:
    """`series`: one metric's points per rank. Returns ranks, bucket start steps and the matrix."""
    if not series:
        return _empty()
    first = min(int(s.steps[0]) for s in series)
    last = max(int(s.steps[-1]) for s in series)
    return _matrix(raw_cells(series, first, last, buckets), mode)


def heatmap_from_rollups(
    conn: Connection, sid: int, first_step: int, last_step: int, buckets: int, mode: str
) -> dict[str, Any]:
    """The same matrix from the rank rollups of series `sid` over first_step..last_step."""
    cells = rollup_cells(conn, sid, first_step, last_step, buckets, mode)
    return _empty() if cells is None else _matrix(cells, mode)


def late_heatmap(parts: Sequence[Cells | None]) -> dict[str, Any]:
    """Who holds the run up (stepwatch_server.timeline), from the rank rollups' cells of `TIMELINE`'s
    metrics on one grid (columns of 64 steps or more): each cell 1 + the rank's lateness / the column's
    median step time; `median` the latter (ms). No `noise`: a column's mean over 64+ steps is steady."""
    present = [c for c in parts if c is not None and c.ranks.size]
    if len(present) < len(parts) or not present:
        return _empty()
    grid = present[-1]  # the step time's
    ranks = np.unique(np.concatenate([c.ranks for c in present]))
    data, backward, optimizer, step = (c.means(ranks) for c in present)
    ratio, median_step = holding_up(data, backward, optimizer, step)
    return _answer(ranks, grid.starts, grid.width, ratio, median_step)


def late_heatmap_from_points(
    parts: Sequence[Sequence[RankSeries]], first: int, last: int, buckets: int
) -> dict[str, Any]:
    """The `LATE` view from the raw points of `TIMELINE`'s metrics (one list of series per metric) over
    first..last: each cell is the lateness of the rank's mean phase times over its steps (the mean, not a
    mean of per-step maxima, which noise would bias upwards), in columns of at least `LATE_MIN_STEPS`
    steps, and `noise` the standard error of the rank's per-step lateness in the cell (the same unit), so
    that a one-step hiccup (the OS, a GC pause) in a cell reads as the noise it is, and a rank late step
    after step does not."""
    if not all(parts):
        return _empty()
    ranks = np.unique(np.concatenate([[s.rank for s in part] for part in parts]))
    starts, width = bucket_edges(first, last, buckets, LATE_MIN_STEPS)
    cols, span = starts.shape[0], last - first + 1
    dense = []
    for part in parts:  # (ranks, steps padded to whole columns), NaN where nothing was stored
        m = np.full((ranks.shape[0], cols * width), np.nan)
        for s in part:
            m[np.searchsorted(ranks, s.rank), s.steps - first] = s.values
        dense.append(np.where(np.isfinite(m), m, np.nan))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # empty cells: NaN, as meant
        per_step = holding_up(*(m[:, :span] for m in dense))[0] - 1.0
        shaped = np.full((ranks.shape[0], cols * width), np.nan)
        shaped[:, :span] = per_step
        shaped = shaped.reshape(ranks.shape[0], cols, width)
        n = np.isfinite(shaped).sum(axis=2)
        noise = np.nanstd(shaped, axis=2, ddof=1) / np.sqrt(np.maximum(n, 1))
        noise[n < 2] = np.nan
        means = [np.nanmean(m.reshape(ranks.shape[0], cols, width), axis=2) for m in dense]
    ratio, median_step = holding_up(*means)
    return {
        **_answer(ranks, starts, width, ratio, median_step),
        "noise": [_nulls(r) for r in np.round(noise, 4)],
    }


def _empty() -> dict[str, Any]:
    return {"ranks": [], "steps": [], "bucket_steps": 1, "values": [], "median": []}


def _matrix(c: Cells, mode: str) -> dict[str, Any]:
    """Cells -> the answer: each cell's mean (absolute: its maximum), relative to the column's median."""
    if mode == "absolute":
        matrix = np.where(c.counts > 0, c.peak, np.nan)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            matrix = c.sums / c.counts
    matrix = matrix.reshape(c.ranks.shape[0], c.starts.shape[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an empty bucket's median is NaN, as meant
        median = np.nanmedian(matrix, axis=0)
    if mode == "median":
        with np.errstate(invalid="ignore", divide="ignore"):
            matrix = matrix / median
    return _answer(c.ranks, c.starts, c.width, matrix, median)


def _answer(
    ranks: np.ndarray, starts: np.ndarray, width: int, matrix: np.ndarray, median: np.ndarray
) -> dict[str, Any]:
    return {
        "ranks": ranks,
        "steps": starts,
        "bucket_steps": width,
        "values": [_nulls(r) for r in _rounded(matrix)],
        "median": _nulls(_rounded(median)),
    }


def _rounded(values: np.ndarray) -> np.ndarray:
    """To 4 decimals; a value too large to round that way (over ~1e304) as it is, not infinity."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.round(values, 4)
    return np.where(np.isinf(out) & np.isfinite(values), values, out)


def _nulls(values: np.ndarray) -> list[float | None]:
    """Finite values as numbers, empty cells (and non-finite ones) as null."""
    out: list[Any] = values.tolist()
    for i in np.flatnonzero(~np.isfinite(values)).tolist():
        out[i] = None
    return out
