"""Reads of the per-step rollups (`step_rollups`, kept by runs/rollups.py, and the packs compaction moves
the rows of compacted steps into, runs/step_packs.py): each step's figures over every rank, and the curves
grouped into at most `max_points / 2` groups that keep their extremes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, literal, select

from stepwatch_server.runs import rank_packs, step_packs
from stepwatch_server.runs.queries import fetch_chunked, read_values
from stepwatch_server.runs.rollups import (
    ALL_RANKS,
    NO_LIMIT,
    ROLLUP_INTEGERS,
    Buckets,
    aggregate,
    empty,
    expanding,
    from_points,
    in_range,
    merge,
    ranked_params,
    resolve,
    rolled_to,
    run_ids_of,
    run_ranks,
    stored_above,
)
from stepwatch_server.storage.chunks import chunk_size, chunks
from stepwatch_server.storage.models import StepRollup


def step_peaks(
    conn: Connection, ids: list[int], first: int, last: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step of series `ids` in first..last and incarnation: (the series, the highest finite value over
    every rank, NaN where none; the non-finite values), unsorted: the step rollups up to the watermark (rows
    and the packs of compacted steps: a row a step, whatever the ranks), the raw values above it. What a
    ranking takes from the steps at a range's ends (rank_rollups.span_peaks)."""
    mark = rolled_to(conn, ids)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    top = min(last, mark)
    if first <= top:
        r = StepRollup

        def query(part: Sequence[int]) -> Any:
            return select(r.series_id, r.hi, r.nonfinite).where(
                r.series_id.in_(part), r.step >= first, r.step <= top
            )

        sid, high, bad = fetch_chunked(conn, ids, query, (0, 2), fixed=3)
        found.append((sid, high, bad))
        packed = step_packs.read(conn, ids, first, top)
        found.append((packed[0], packed[7], packed[8].astype(np.int64)))
    if last > mark and stored_above(conn, ids, mark):
        ranks = run_ranks(conn, run_ids_of(conn, ids))
        sid, *_, value = read_values(conn, ids, None, max(first, mark + 1), last, ranks=ranks)
        finite = np.isfinite(value)
        found.append((sid, np.where(finite, value, np.nan), (~finite).astype(np.int64)))
    if not found:  # all of the range above the watermark, where nothing is stored
        none = np.zeros(0, dtype=np.int64)
        return none, np.zeros(0, dtype=np.float64), none
    sid, high, bad = (np.concatenate(c) for c in zip(*found, strict=True))
    return sid, high, bad


def read_steps(conn: Connection, ids: list[int], from_step: int | None, to_step: int | None) -> Buckets:
    """Per (series, step) over every rank (`bucket` holds the step): the step rollups up to the
    watermark (rows, and the packs of compacted steps), the raw points' aggregation above it."""
    if not ids:
        return empty()
    cut = rolled_to(conn, ids) + 1
    r = StepRollup

    def query(part: Sequence[int]) -> Any:
        q = select(
            r.series_id, literal(ALL_RANKS), r.step, r.incarnation, r.n, r.total, r.lo, r.hi, r.nonfinite
        ).where(r.series_id.in_(part), r.step < cut)
        if from_step is not None:
            q = q.where(r.step >= from_step)
        if to_step is not None:
            q = q.where(r.step <= to_step)
        return q.order_by(r.series_id, r.step, r.incarnation)

    cols = fetch_chunked(conn, ids, query, ROLLUP_INTEGERS, fixed=4)
    packed = step_packs.read(
        conn, ids, from_step or 0, min(NO_LIMIT if to_step is None else to_step, cut - 1)
    )
    if packed[0].size:  # compacted steps: a step is in a row or in a pack
        joined = [np.concatenate([a, b]) for a, b in zip(cols, packed, strict=True)]
        cols = [c[np.lexsort((joined[3], joined[2], joined[0]))] for c in joined]
    rolled = resolve(cols, lambda sid, step: from_points(conn, [sid], step, step, True, 1))
    tail_first = max(cut, from_step or 0)
    if to_step is not None and tail_first > to_step:
        return rolled
    return merge(rolled, from_points(conn, ids, tail_first, to_step, True, 1))


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
_PEAKS = "max(hi), sum(nonfinite), min(incarnation), max(incarnation)"
# Where a range's groups hold enough rows, each group is aggregated over its own range of the primary key,
# one seek a group, instead of by the GROUP BY, which sorts every row of the range by its group first
# on SQLite (a temporary B-tree) and hashes them on PostgreSQL. 100k steps of one series in 800 groups took
# 168 ms on SQLite and 83 ms on PostgreSQL by the GROUP BY, 94 and 41 ms by seeks; a seek costs about what
# the GROUP BY spends on _SEEK_ROWS rows (SQLite ~9 us against ~0.8 us a row, PostgreSQL ~15 against ~0.4),
# so sparse series (a module's amax every 10th step, 2.5x slower by seeks on PostgreSQL) keep the GROUP BY.
# Whether they do is counted (`_by_seeks`), up to that many rows a group (bench/README.md, 2026-12-07,
# fourth stop).
_SEEK_ROWS = {"sqlite": 12, "postgresql": 40}
_PROBE_QUERY = expanding(
    "SELECT count(*) FROM (SELECT 1 FROM step_rollups WHERE series_id IN :ids AND step >= :first "
    "AND step <= :last LIMIT :enough) p",
    False,
)
_IN_GROUP = (  # group g's rows of series s.id
    "r.series_id = s.id AND r.step >= :first + g * :per AND r.step < :first + (g + 1) * :per AND r.step <= :last"
)
_GROUPS = "(:last - :first) / :per"  # the last group's number
_ReadRows = Callable[[Sequence[Any]], list[Any]]  # a query's rows as the GROUP BY's


def _group_queries(means: bool) -> tuple[Any, dict[str, tuple[Any, _ReadRows]]]:
    """The GROUP BY, and per dialect the query by seeks with how its rows are read, giving (series, group,
    lowest mean, highest mean, highest value, non-finite count, lowest and highest incarnation); without
    `means` the two means are NULL and not computed (the amax reads the peaks alone: half the work a row)."""
    low, high = (f"min({_MEAN})", f"max({_MEAN})") if means else ("NULL", "NULL")
    figures = f"{low}, {high}, {_PEAKS}"
    by_group = expanding(
        f"SELECT series_id, (step - :first) / :per AS g, {figures} FROM step_rollups "
        "WHERE series_id IN :ids AND step >= :first AND step <= :last GROUP BY series_id, g",
        False,
    )
    # PostgreSQL: a LATERAL subquery per (series, group)
    lateral = expanding(
        f"SELECT s.id, g, a.low, a.high, a.peak, a.bad, a.inc_lo, a.inc_hi FROM series s "
        f"CROSS JOIN generate_series(0, {_GROUPS}) g CROSS JOIN LATERAL (SELECT count(*) AS k, "
        f"{figures} FROM step_rollups r WHERE {_IN_GROUP}) "
        "AS a (k, low, high, peak, bad, inc_lo, inc_hi) WHERE s.id IN :ids AND a.k > 0",
        False,
    )
    # SQLite has no LATERAL and a scalar subquery gives one column, so the group's figures come back as one
    # text (`_parse_text`): floats as printf's %!.20e, which reads back bit for bit (checked on 300k random
    # doubles; %.17g is off by an ulp above ~1e190 in SQLite 3.40), NaN for none (NULL); NULL for a group
    # without rows, left out in Python (a filter on it in SQL would run the subquery twice).
    text = " || ' ' || ".join(
        f"CASE WHEN {e} IS NULL THEN 'nan' ELSE printf('%!.20e', {e}) END" for e in (low, high, "max(hi)")
    )
    scalar = expanding(
        f"WITH RECURSIVE gs (g) AS (SELECT 0 UNION ALL SELECT g + 1 FROM gs WHERE g < {_GROUPS}) "
        "SELECT s.id, g, (SELECT CASE WHEN count(*) > 0 THEN "
        f"printf('%d %d %d ', sum(nonfinite), min(incarnation), max(incarnation)) || {text} "
        f"END FROM step_rollups r WHERE {_IN_GROUP}) FROM series s, gs WHERE s.id IN :ids",
        False,
    )
    return by_group, {
        "postgresql": (lateral, list),
        "sqlite": (scalar, lambda rows: [_parse_text(r) for r in rows if r[2] is not None]),
    }


_QUERIES = {means: _group_queries(means) for means in (True, False)}
_GROUP_PARAMS = 12  # the most scalar parameters of a groups query (a name is bound once per use on SQLite)
# A range's first and last step: per series the primary key's first and last entry in the range (a seek each,
# on both databases), not an aggregate over every row: 100k steps took ~0.04-0.1 s a series on SQLite.
_EXTENT_QUERY = expanding(
    "SELECT min(lo), max(hi) FROM (SELECT "
    + ", ".join(
        f"(SELECT {f}(step) FROM step_rollups r WHERE r.series_id = s.id AND r.step >= :first AND r.step <= :last)"
        f" AS {name}"
        for f, name in (("min", "lo"), ("max", "hi"))
    )
    + " FROM series s WHERE s.id IN :ids) e",
    False,
)
_COUNT_QUERY = expanding(
    "SELECT sum(n + nonfinite) FROM step_rollups WHERE series_id IN :ids AND step >= :first AND step <= :last",
    False,
)
_COUNT_SOME_QUERY = expanding(
    "SELECT count(*), sum(k) FROM (SELECT n + nonfinite AS k FROM step_rollups "
    "WHERE series_id IN :ids AND step >= :first AND step <= :last LIMIT :rows) c",
    False,
)
_PROBE_ROWS = 4096  # rows a bounded count reads first: enough where each holds the values of 49+ ranks
_RAW_RANGE = {
    ranked: expanding(f"SELECT min(step), max(step), count(*) FROM points WHERE {in_range(ranked)}", ranked)
    for ranked in (False, True)
}


def step_range(
    conn: Connection,
    ids: list[int],
    from_step: int | None,
    to_step: int | None,
    count_up_to: int | None = None,
) -> tuple[int, int, int] | None:
    """(first step, last step, number of raw values) stored for `ids` in the range, None if none:
    from the step rollups up to the watermark (rows and packs), from the raw points above it (where a rank
    has any there: `rollups.stored_above`).
    `count_up_to`: the number of values is exact up to it, and above it only known to be larger (the
    rows are counted until they hold more; None: all counted); 0: not counted (a range's extent)."""
    if not ids:
        return None
    mark = rolled_to(conn, ids)
    first, last = from_step or 0, NO_LIMIT if to_step is None else to_step
    raw = last > mark and stored_above(conn, ids, mark)
    ranks = run_ranks(conn, run_ids_of(conn, ids)) if raw else None
    found: list[Any] = []
    counted = 0
    for part in chunks(ids, chunk_size(conn, fixed=len(ranks or ()) + 4)):
        params = {"ids": list(part), "first": first, "last": min(last, mark)}
        lo, hi = conn.execute(_EXTENT_QUERY, params).one()
        if lo is not None:
            left = None if count_up_to is None else count_up_to - counted
            n = _count_rows(conn, params, left) if left is None or left >= 0 else 0
            counted += n
            found.append((lo, hi, n))
        if raw:
            ranked, params = ranked_params({**params, "first": max(first, mark + 1), "last": last}, ranks)
            found.append(conn.execute(_RAW_RANGE[ranked], params).one())
    found = [f for f in found if f[0] is not None]
    packed = step_packs.extent(conn, ids, first, min(last, mark)) if mark >= first else None
    if packed is not None:
        found.append(packed)
    if not found:
        return None
    return min(int(f[0]) for f in found), max(int(f[1]) for f in found), sum(int(f[2]) for f in found)


def _count_rows(conn: Connection, params: dict[str, Any], up_to: int | None) -> int:
    """The values the step rollup rows of `params` hold: all counted (`up_to` None), or up to `up_to` and
    then a number above it. Every row holds at least one value, so `up_to` + 1 rows settle it; the first
    _PROBE_ROWS rows settle it on a run of many ranks."""
    if up_to is None:
        return int(conn.execute(_COUNT_QUERY, params).scalar() or 0)
    rows = min(_PROBE_ROWS, up_to + 1)
    n_rows, total = conn.execute(_COUNT_SOME_QUERY, {**params, "rows": rows}).one()
    if int(total or 0) > up_to or n_rows < rows:  # more than asked, or every row was read
        return int(total or 0)
    return int(conn.execute(_COUNT_SOME_QUERY, {**params, "rows": up_to + 1}).one()[1] or 0)


def across_ranks(
    conn: Connection,
    ids: list[int],
    from_step: int | None,
    to_step: int | None,
    max_points: int,
    means: bool = True,
) -> Groups:
    """The step rollups of `ids` grouped into at most max_points / 2 groups per series (one step per
    group when the range has at most max_points steps): the rows in SQL, the packed steps with numpy.
    Groups that reach above the watermark, or hold a restart, are grouped from the exact per-step figures
    (`read_steps`). Without `means` only the peaks and non-finite counts are read (the means NaN), and a
    restart inside a group is read as it is: a peak is the highest of both incarnations either way."""
    found = step_range(conn, ids, from_step, to_step, count_up_to=0) if ids else None
    if found is None:
        empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        return Groups(0, 1, empty_i, empty_i, empty_f, empty_f, empty_f, empty_i)
    first, last, _ = found
    span = last - first + 1
    per = 1 if span <= max_points else -(-span // max(1, max_points // 2))
    mark = rolled_to(conn, ids)
    tail_group = (mark + 1 - first) // per if mark < last else None  # the first group above the watermark
    rows: list[Any] = []
    for part in chunks(ids, chunk_size(conn, fixed=_GROUP_PARAMS)) if mark >= first else ():
        params = {"ids": list(part), "first": first, "last": min(last, mark), "per": per}
        rows += _grouped_rows(conn, params, means)
    grouped: list[tuple[np.ndarray, ...]] = []
    if rows:
        cols = list(zip(*rows, strict=True))
        grouped.append(
            tuple(np.array(c, dtype=np.float64 if 2 <= i <= 4 else np.int64) for i, c in enumerate(cols))
        )  # float columns: None -> nan
    packed = step_packs.read(conn, ids, first, min(last, mark)) if mark >= first else rank_packs.empty()
    if packed[0].size:  # compacted steps, grouped here as the query groups the rows
        step_means = np.full(packed[0].size, np.nan)
        if means:
            with np.errstate(invalid="ignore", divide="ignore"):
                step_means = np.where(packed[4] > 0, packed[5] / np.maximum(packed[4], 1), np.nan)
        group = (packed[2] - first) // per
        grouped.append((packed[0], group, step_means, step_means, packed[7], packed[8], packed[3], packed[3]))
    parts: list[tuple[np.ndarray, ...]] = []
    if grouped:
        sid, group, low, high, peak, nonfinite, inc_lo, inc_hi = _regroup(grouped)
        floats = [low, high, peak]
        mixed = inc_lo != inc_hi if means else np.zeros(sid.size, dtype=bool)
        if tail_group is not None:
            mixed |= group >= tail_group
        keep = np.flatnonzero(~mixed)
        parts.append((sid[keep], group[keep], *(f[keep] for f in floats), nonfinite[keep]))
        for i in np.flatnonzero(mixed & ((group < tail_group) if tail_group is not None else True)).tolist():
            lo_step = first + int(group[i]) * per  # a restart inside the group: from the exact steps
            parts.append(
                _group_steps(
                    read_steps(conn, [int(sid[i])], lo_step, min(last, lo_step + per - 1)), first, per
                )
            )
    if tail_group is not None:
        parts.append(_group_steps(read_steps(conn, ids, first + tail_group * per, last), first, per))
    if not parts:
        empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        return Groups(first, per, empty_i, empty_i, empty_f, empty_f, empty_f, empty_i)
    joined = [np.concatenate([p[i] for p in parts]) for i in range(6)]
    order = np.lexsort((joined[1], joined[0]))
    return Groups(first, per, *(c[order] for c in joined))


def _grouped_rows(conn: Connection, params: dict[str, Any], means: bool = True) -> list[Any]:
    """The step rollup rows of `params` (ids, first, last, per) as (series, group, lowest mean, highest
    mean, highest value, non-finite count, lowest and highest incarnation), one row a group that holds any,
    in no order: by one GROUP BY, or by a seek a group where the groups hold enough rows (`_by_seeks`).
    Without `means` the means are NaN."""
    by_group, by_seeks = _QUERIES[means]
    if not _by_seeks(conn, params):
        return list(conn.execute(by_group, params).all())
    query, read = by_seeks[conn.dialect.name]
    return read(conn.execute(query, params).all())


def _by_seeks(conn: Connection, params: dict[str, Any]) -> bool:
    """Whether the groups of `params` hold _SEEK_ROWS rows on average or more (counted up to that many:
    ~1 ms a series on SQLite where the aggregation takes ~100)."""
    rows_a_group = _SEEK_ROWS[conn.dialect.name]
    if params["per"] < rows_a_group:  # fewer steps a group than that: fewer rows, but for a restart's
        return False
    groups = (params["last"] - params["first"]) // params["per"] + 1
    enough = rows_a_group * groups * len(params["ids"])
    return int(conn.execute(_PROBE_QUERY, {**params, "enough": enough}).scalar_one()) >= enough


def _parse_text(row: Any) -> tuple[Any, ...]:
    """A row of SQLite's query by seeks (series, group, "bad inc_lo inc_hi low high peak") as the other
    queries give it."""
    sid, g, text = row
    bad, inc_lo, inc_hi, low, high, peak = text.split(" ")
    return sid, g, float(low), float(high), float(peak), int(bad), int(inc_lo), int(inc_hi)


def _regroup(parts: list[tuple[np.ndarray, ...]]) -> list[np.ndarray]:
    """Groups (series, group, lowest mean, highest mean, highest value, non-finite count, lowest and
    highest incarnation), some given more than once (from rows and from packs, or per step), as one row per
    (series, group): the lowest of the lowest, the highest of the highest, counts added (NaN: none)."""
    cols = [np.concatenate([p[i] for p in parts]) for i in range(8)]
    order = np.lexsort((cols[1], cols[0]))
    cols = [c[order] for c in cols]
    starts = rank_packs.group_starts(cols[:2])
    return [
        cols[0][starts],
        cols[1][starts],
        np.fmin.reduceat(cols[2], starts),
        np.fmax.reduceat(cols[3], starts),
        np.fmax.reduceat(cols[4], starts),
        np.add.reduceat(cols[5], starts),
        np.minimum.reduceat(cols[6], starts),
        np.maximum.reduceat(cols[7], starts),
    ]


def _group_steps(exact: Buckets, first: int, per: int) -> tuple[np.ndarray, ...]:
    """Per-step figures over ranks -> per (series, group of `per` steps from `first`): (series, group,
    lowest mean, highest mean, highest value, non-finite count)."""
    if exact.n.size == 0:
        empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        return empty_i, empty_i, empty_f, empty_f, empty_f, empty_i
    keys = [exact.series_id, (exact.bucket - first) // per]
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(exact.n > 0, exact.total / np.maximum(exact.n, 1), np.nan)
    unique, (_, _, low, high, _) = aggregate(keys, means)
    _, (_, _, _, peak, _) = aggregate(keys, exact.hi)
    _, (_, bad, _, _, _) = aggregate(keys, exact.nonfinite.astype(np.float64))
    return unique[0], unique[1], low, high, peak, bad.astype(np.int64)
