"""Rollups: the count, sum, min and max of a series' values, kept as the values arrive.

A run of 100,000 steps x 512 ranks holds 51 million values per metric; no page can read that in
seconds. So ingest keeps, in the same transaction as the values (`ingest.store.insert_points`, one
bulk upsert per table and batch):

- `step_rollups`: per (series, step, incarnation), over every rank: what the curves (mean over
  ranks) and the amax (max over ranks) need. A view groups these rows in SQL into at most about
  `max_points / 2` groups and keeps each group's lowest and highest per-step mean (and highest
  maximum), so a one-step spike survives; 100k steps are 100k rows, read by the database, not by
  Python.
- `rollups`: per (series, rank, bucket of BUCKET_STEPS steps, incarnation): the heatmaps (ranks x
  steps). A wide heatmap sums these in SQL into its columns; 100k steps x 512 ranks are 800k rows.

`n`, `total`, `lo`, `hi` cover the finite values only; `nonfinite` counts NaN and infinities, so a
NaN is never averaged away: a step or group that holds one is shown as NaN.

Resumed runs: a step re-sent by a later incarnation replaces the earlier value in the raw series
(the latest incarnation wins). Rollup rows are kept per incarnation, so a step, bucket or group
that holds rows of more than one incarnation is recomputed from the raw points on read (only
those around a restart), and every figure equals the aggregation of the raw series.

A value row stored again (the same series, rank, step and incarnation, which ingest's idempotency
record normally prevents) is skipped by the raw insert but would be counted twice here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, bindparam, literal, select, text

from stepwatch_server.storage.models import Rollup, StepRollup

BUCKET_STEPS = 64
ALL_RANKS = -1  # the rank of a step rollup (over every rank) where one key shape serves both
RAW_READ_BUDGET = 200_000  # above this many raw values, a heatmap reads the rollups instead

_ROLLUP_COLUMNS = ("series_id", "rank", "bucket", "incarnation")
_STEP_COLUMNS = ("series_id", "step", "incarnation")
_STATS = ("n", "total", "lo", "hi", "nonfinite")
_STAT_TYPES = ("integer", "float8", "float8", "float8", "integer")
_KEY_TYPES = {
    "series_id": "integer",
    "rank": "integer",
    "bucket": "bigint",
    "step": "bigint",
    "incarnation": "integer",
}


def _upsert_sql(table: str, keys: tuple[str, ...], postgres: bool) -> str:
    """One bulk upsert: a key already there gets its counts and sums added, its min/max widened."""
    least, greatest = ("least", "greatest") if postgres else ("min", "max")
    columns = ", ".join(keys + _STATS)
    if postgres:
        arrays = ", ".join(f"%s::{t}[]" for t in [_KEY_TYPES[k] for k in keys] + list(_STAT_TYPES))
        source = f"SELECT * FROM unnest({arrays})"
    else:
        source = f"VALUES ({', '.join('?' for _ in keys + _STATS)})"
    t = table
    return (
        f"INSERT INTO {t} ({columns}) {source} ON CONFLICT ({', '.join(keys)}) DO UPDATE SET "
        f"n = {t}.n + excluded.n, total = {t}.total + excluded.total, "
        f"lo = {least}(coalesce({t}.lo, excluded.lo), coalesce(excluded.lo, {t}.lo)), "
        f"hi = {greatest}(coalesce({t}.hi, excluded.hi), coalesce(excluded.hi, {t}.hi)), "
        f"nonfinite = {t}.nonfinite + excluded.nonfinite"
    )


@dataclass(frozen=True, slots=True)
class Buckets:
    """Aggregates keyed by (series_id, rank, bucket), sorted by that key; one incarnation each."""

    series_id: np.ndarray
    rank: np.ndarray
    bucket: np.ndarray
    n: np.ndarray
    total: np.ndarray
    lo: np.ndarray  # NaN where the bucket has no finite value
    hi: np.ndarray
    nonfinite: np.ndarray

    @property
    def mean(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.nonfinite > 0, np.nan, self.total / self.n)

    @property
    def peak(self) -> np.ndarray:
        """The maximum, NaN where a bucket holds a non-finite value (so it shows, as in the raw series)."""
        return np.where(self.nonfinite > 0, np.nan, self.hi)

    @property
    def trough(self) -> np.ndarray:
        return np.where(self.nonfinite > 0, np.nan, self.lo)

    def take(self, index: np.ndarray) -> Buckets:
        return Buckets(*(getattr(self, f)[index] for f in Buckets.__slots__))


def aggregate(keys: Sequence[np.ndarray], values: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Group `values` by the key columns: (the unique keys, [n, total, lo, hi, nonfinite])."""
    order = np.lexsort(tuple(reversed(keys)))
    sorted_keys = [k[order] for k in keys]
    v = values[order]
    change = np.zeros(v.shape[0], dtype=bool)
    change[0] = True
    for k in sorted_keys:
        change[1:] |= k[1:] != k[:-1]
    starts = np.flatnonzero(change)
    finite = np.isfinite(v)
    n = np.add.reduceat(finite.astype(np.int64), starts)
    total = np.add.reduceat(np.where(finite, v, 0.0), starts)
    lo = np.minimum.reduceat(np.where(finite, v, np.inf), starts)
    hi = np.maximum.reduceat(np.where(finite, v, -np.inf), starts)
    lo[n == 0] = np.nan
    hi[n == 0] = np.nan
    nonfinite = np.add.reduceat((~finite).astype(np.int64), starts)
    return [k[starts] for k in sorted_keys], [n, total, lo, hi, nonfinite]


def upsert(conn: Connection, rows: Sequence[tuple[int, int, int, int, float | None]]) -> None:
    """Add value rows `(series_id, rank, step, incarnation, value)` to both rollup tables: one
    statement each. Keys come sorted, so concurrent batches lock shared rows in the same order."""
    if not rows:
        return
    sid, rank, step, inc, value = (np.asarray(c) for c in zip(*rows, strict=True))
    sid, rank, step, inc = (a.astype(np.int64) for a in (sid, rank, step, inc))
    values = np.asarray(value, dtype=np.float64)  # None (NaN through SQLite) -> nan
    postgres = conn.dialect.name == "postgresql"
    for table, keys, key_columns in (
        ("rollups", _ROLLUP_COLUMNS, [sid, rank, step // BUCKET_STEPS, inc]),
        ("step_rollups", _STEP_COLUMNS, [sid, step, inc]),
    ):
        unique, stats = aggregate(key_columns, values)
        out: list[list[Any]] = [c.tolist() for c in unique + stats]
        for i in (len(keys) + 2, len(keys) + 3):  # lo, hi: NaN (no finite value) -> NULL
            out[i] = [None if x != x else x for x in out[i]]
        sql = _upsert_sql(table, keys, postgres)
        if postgres:
            conn.exec_driver_sql(sql, tuple(out))
        else:
            conn.exec_driver_sql(sql, list(zip(*out, strict=True)))


def bucket_range(from_step: int | None, to_step: int | None) -> tuple[int | None, int | None]:
    return (
        None if from_step is None else from_step // BUCKET_STEPS,
        None if to_step is None else to_step // BUCKET_STEPS,
    )


def read(conn: Connection, ids: list[int], from_step: int | None, to_step: int | None) -> Buckets:
    """The per-(series, rank, bucket) rollups covering from_step..to_step (whole buckets)."""
    r = Rollup
    query = select(r.series_id, r.rank, r.bucket, r.incarnation, r.n, r.total, r.lo, r.hi, r.nonfinite).where(
        r.series_id.in_(ids)
    )
    first, last = bucket_range(from_step, to_step)
    if first is not None:
        query = query.where(r.bucket >= first)
    if last is not None:
        query = query.where(r.bucket <= last)
    rows = conn.execute(query.order_by(r.series_id, r.rank, r.bucket, r.incarnation)).all() if ids else []
    return _resolve(conn, rows, False, BUCKET_STEPS)


def read_steps(conn: Connection, ids: list[int], from_step: int | None, to_step: int | None) -> Buckets:
    """Per (series, step) over every rank, from the step rollups (`bucket` holds the step)."""
    r = StepRollup
    query = select(
        r.series_id, literal(ALL_RANKS), r.step, r.incarnation, r.n, r.total, r.lo, r.hi, r.nonfinite
    ).where(r.series_id.in_(ids))
    if from_step is not None:
        query = query.where(r.step >= from_step)
    if to_step is not None:
        query = query.where(r.step <= to_step)
    rows = conn.execute(query.order_by(r.series_id, r.step, r.incarnation)).all() if ids else []
    return _resolve(conn, rows, True, 1)


def _resolve(conn: Connection, rows: Sequence[Any], all_ranks: bool, width: int) -> Buckets:
    """Rows (series, rank, bucket, incarnation, n, total, lo, hi, nonfinite) ordered by that key ->
    Buckets with one incarnation per bucket: a bucket of several is recomputed from the raw points."""
    if not rows:
        return _empty()
    cols = list(zip(*rows, strict=True))
    sid, rank, bucket = (np.array(c, dtype=np.int64) for c in cols[:3])
    got = Buckets(
        sid,
        rank,
        bucket,
        np.array(cols[4], dtype=np.int64),
        np.array(cols[5], dtype=np.float64),
        np.array(cols[6], dtype=np.float64),
        np.array(cols[7], dtype=np.float64),
        np.array(cols[8], dtype=np.int64),
    )
    same = (sid[1:] == sid[:-1]) & (rank[1:] == rank[:-1]) & (bucket[1:] == bucket[:-1])
    if not same.any():
        return got
    mixed = np.zeros(sid.shape[0], dtype=bool)
    mixed[1:] |= same
    mixed[:-1] |= same
    exact = _recompute(conn, sid[mixed], bucket[mixed], all_ranks, width)
    return _merge(got.take(np.flatnonzero(~mixed)), exact)


def _recompute(
    conn: Connection, sids: np.ndarray, buckets: np.ndarray, all_ranks: bool, width: int
) -> Buckets:
    """The buckets of more than one incarnation, from the raw points (the latest incarnation wins)."""
    from stepwatch_server.runs.queries import read_points

    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    pairs = sorted(set(zip(sids.tolist(), buckets.tolist(), strict=True)))
    for sid, bucket in pairs:
        first = bucket * width
        for s in read_points(conn, [sid], None, first, first + width - 1):
            rank = ALL_RANKS if all_ranks else s.rank
            k = s.steps.shape[0]
            parts.append((np.full(k, sid), np.full(k, rank), s.steps // width, s.values))
    if not parts:
        return _empty()
    keys, stats = aggregate(
        [np.concatenate([p[i] for p in parts]) for i in range(3)], np.concatenate([p[3] for p in parts])
    )
    return Buckets(*keys, *stats)


def _empty() -> Buckets:
    empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    return Buckets(empty_i, empty_i, empty_i, empty_i, empty_f, empty_f, empty_f, empty_i)


def _merge(*parts: Buckets) -> Buckets:
    joined = Buckets(*(np.concatenate([getattr(p, f) for p in parts]) for f in Buckets.__slots__))
    return joined.take(np.lexsort((joined.bucket, joined.rank, joined.series_id)))


_COLUMNS_QUERY = text(
    "SELECT rank, (bucket - :first) / :per AS col, sum(n), sum(total), max(hi), sum(nonfinite), "
    "min(incarnation), max(incarnation) FROM rollups "
    "WHERE series_id = :sid AND rank >= 0 AND bucket >= :first AND bucket <= :last "
    "GROUP BY rank, col ORDER BY rank, col"
)


def read_columns(conn: Connection, sid: int, first: int, last: int, per_column: int) -> Buckets:
    """Per (rank, column of `per_column` buckets from bucket `first`): the rollups summed in SQL (one
    row per cell comes back, not one per bucket). `bucket` holds each column's index. A cell that
    spans more than one incarnation is summed from the exact per-bucket read instead."""
    rows = conn.execute(_COLUMNS_QUERY, {"sid": sid, "first": first, "last": last, "per": per_column}).all()
    if not rows:
        return _empty()
    cols = list(zip(*rows, strict=True))
    rank, col = np.array(cols[0], dtype=np.int64), np.array(cols[1], dtype=np.int64)
    hi = np.array([np.nan if x is None else x for x in cols[4]], dtype=np.float64)
    got = Buckets(
        np.full_like(rank, sid),
        rank,
        col,
        np.array(cols[2], dtype=np.int64),
        np.array(cols[3], dtype=np.float64),
        np.full(rank.shape[0], np.nan),  # the heatmap needs no minimum
        hi,
        np.array(cols[5], dtype=np.int64),
    )
    mixed = np.array(cols[6], dtype=np.int64) != np.array(cols[7], dtype=np.int64)
    if not mixed.any():
        return got
    parts = [got.take(np.flatnonzero(~mixed))]
    for c in np.unique(col[mixed]).tolist():
        lo_bucket = first + c * per_column
        hi_bucket = min(last, lo_bucket + per_column - 1)
        exact = read(conn, [sid], lo_bucket * BUCKET_STEPS, hi_bucket * BUCKET_STEPS + BUCKET_STEPS - 1)
        exact = exact.take(np.flatnonzero(np.isin(exact.rank, rank[mixed & (col == c)])))
        ranks, inverse = np.unique(exact.rank, return_inverse=True)
        peak = np.full(ranks.shape[0], -np.inf)
        np.maximum.at(peak, inverse, np.nan_to_num(exact.hi, nan=-np.inf))
        n = np.bincount(inverse, weights=exact.n).astype(np.int64)
        parts.append(
            Buckets(
                np.full_like(ranks, sid),
                ranks,
                np.full_like(ranks, c),
                n,
                np.bincount(inverse, weights=exact.total),
                np.full(ranks.shape[0], np.nan),
                np.where(n > 0, peak, np.nan),
                np.bincount(inverse, weights=exact.nonfinite).astype(np.int64),
            )
        )
    return _merge(*parts)


@dataclass(frozen=True, slots=True)
class Groups:
    """Per (series, group of `per` steps from step `first`): the lowest and highest per-step mean
    over ranks, the highest value, and the count of non-finite values."""

    first: int
    per: int
    series_id: np.ndarray
    group: np.ndarray
    low_mean: np.ndarray
    high_mean: np.ndarray
    peak: np.ndarray
    nonfinite: np.ndarray

    def of(self, sid: int) -> Groups:
        keep = self.series_id == sid
        return Groups(self.first, self.per, *(getattr(self, f)[keep] for f in Groups.__slots__[2:]))

    def last_group_start(self) -> int:
        return self.first + (int(self.group.max()) if self.group.size else 0) * self.per

    def mean_curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values): per step the mean; per group its lowest then highest mean (at its first and
        middle step), NaN where a group holds a non-finite value."""
        start = self.first + self.group * self.per
        bad = self.nonfinite > 0
        if self.per == 1:
            return start, np.where(bad, np.nan, self.low_mean)
        steps = np.stack([start, start + self.per // 2], axis=1).reshape(-1)
        values = np.stack([self.low_mean, np.where(bad, np.nan, self.high_mean)], axis=1).reshape(-1)
        return steps, values

    def peak_curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(each group's first step, its maximum over ranks and steps), NaN where non-finite."""
        return self.first + self.group * self.per, np.where(self.nonfinite > 0, np.nan, self.peak)


_MEAN = "CASE WHEN n > 0 THEN total / n END"
_GROUPS_QUERY = text(
    f"SELECT series_id, (step - :first) / :per AS g, min({_MEAN}), max({_MEAN}), max(hi), sum(nonfinite), "
    "min(incarnation), max(incarnation) FROM step_rollups "
    "WHERE series_id IN :ids AND step >= :first AND step <= :last GROUP BY series_id, g ORDER BY series_id, g"
).bindparams(bindparam("ids", expanding=True))
_RANGE_QUERY = text(
    "SELECT min(step), max(step), sum(n + nonfinite) FROM step_rollups "
    "WHERE series_id IN :ids AND step >= :first AND step <= :last"
).bindparams(bindparam("ids", expanding=True))
_NO_LIMIT = 2**62


def step_range(
    conn: Connection, ids: list[int], from_step: int | None, to_step: int | None
) -> tuple[int, int, int] | None:
    """(first step, last step, number of raw values) stored for `ids` in the range, None if none."""
    first, last, values = conn.execute(
        _RANGE_QUERY,
        {"ids": ids, "first": from_step or 0, "last": _NO_LIMIT if to_step is None else to_step},
    ).one()
    return None if first is None else (int(first), int(last), int(values))


def across_ranks(
    conn: Connection, ids: list[int], from_step: int | None, to_step: int | None, max_points: int
) -> Groups:
    """The step rollups of `ids` grouped in SQL into at most max_points / 2 groups per series (one
    step per group when the range has at most max_points steps)."""
    found = step_range(conn, ids, from_step, to_step) if ids else None
    if found is None:
        empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        return Groups(0, 1, empty_i, empty_i, empty_f, empty_f, empty_f, empty_i)
    first, last, _ = found
    span = last - first + 1
    per = 1 if span <= max_points else -(-span // max(1, max_points // 2))
    rows = conn.execute(_GROUPS_QUERY, {"ids": ids, "first": first, "last": last, "per": per}).all()
    cols = list(zip(*rows, strict=True))
    sid, group = np.array(cols[0], dtype=np.int64), np.array(cols[1], dtype=np.int64)
    floats = [np.array(c, dtype=np.float64) for c in cols[2:5]]  # None -> nan
    nonfinite = np.array(cols[5], dtype=np.int64)
    mixed = np.array(cols[6], dtype=np.int64) != np.array(cols[7], dtype=np.int64)
    for i in np.flatnonzero(mixed).tolist():  # a restart inside the group: from the exact steps
        lo_step = first + int(group[i]) * per
        exact = read_steps(conn, [int(sid[i])], lo_step, min(last, lo_step + per - 1))
        some = exact.n > 0
        means, peaks = exact.total[some] / exact.n[some], exact.hi[some]
        floats[0][i], floats[1][i], floats[2][i] = (
            (means.min(), means.max(), peaks.max()) if some.any() else (np.nan, np.nan, np.nan)
        )
        nonfinite[i] = int(exact.nonfinite.sum())
    return Groups(first, per, sid, group, floats[0], floats[1], floats[2], nonfinite)
