"""Rollups: the count, sum, min and max of a series' values, kept as the values arrive.

A run of 100,000 steps x 512 ranks holds 51 million values per metric; no page can read that in
seconds. So two tables are kept off the ingest path by the rollup worker (runs/rollup_worker.py):
after each commit ingest hands it the batch's run and step range, and about every half second it
recomputes the dirty ranges from the raw points, set-based (`roll_up`: per run one DELETE and one
INSERT ... SELECT ... GROUP BY per table and level, in one short transaction):

- `step_rollups`: per (series, step, incarnation), over every rank: what the curves (mean over
  ranks) and the amax (max over ranks) need. A view groups these rows in SQL into at most about
  `max_points / 2` groups and keeps each group's lowest and highest per-step mean (and highest
  maximum), so a one-step spike survives; 100k steps are 100k rows, read by the database, not by
  Python.
- `rank_rollups`: per (series, level, rank, bucket, incarnation), for the heatmaps (ranks x steps).
  Level 0's buckets are BUCKET_STEPS (64) steps wide, summed from the raw points; each level above
  has buckets twice as wide, summed from the two below (`_roll_levels`), up to LEVELS - 1 (262,144
  steps). A heatmap asked for C columns reads the finest level with at most C buckets in its range
  (`column_level`): one stored row per rank and column, in primary-key order, nothing grouped by
  the database. 100k steps x 512 ranks in 240 columns are 196 x 512 rows of level 3, where level 0
  alone would mean grouping 800k rows. Levels above 0 hold whole buckets only (those wholly up to
  the watermark); the part of a range past a level's last whole bucket is summed from the level
  below, down to the raw points.

`n`, `total`, `lo`, `hi` cover the finite values only; `nonfinite` counts NaN and infinities, so a
NaN is never averaged away: a step or group that holds one is shown as NaN.

Resumed runs: a step re-sent by a later incarnation replaces the earlier value in the raw series
(the latest incarnation wins). Rollup rows are kept per incarnation, so a step, bucket or group
that holds rows of more than one incarnation is recomputed on read (only those around a restart:
a level's bucket from the level below, level 0's and a step's from the raw points), and every
figure equals the aggregation of the raw series.

The rollups lag ingest by about a round. `rollup_marks` holds per run the highest step rolled up
(the watermark); every read here takes the rollups of the steps up to it (whole buckets for
`rank_rollups`) and aggregates the raw points above it (the last second or so), so a view is complete
while the worker catches up. A late batch for steps below the watermark (a slow rank) is in the raw
series at once and in these views after the worker's next round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, bindparam, func, literal, select, text

from stepwatch_server.storage.models import AgentSession, RankRollup, RollupMark, Series, StepRollup

BUCKET_STEPS = 64  # a level-0 rank rollup's bucket; level k's is BUCKET_STEPS << k steps wide
LEVELS = 13  # levels 0..12: buckets of 64 .. 262,144 steps, each twice as wide as the one below
ALL_RANKS = -1  # the rank of a step rollup (over every rank) where one key shape serves both
RAW_READ_BUDGET = 200_000  # above this many raw values, a heatmap reads the rollups instead

_NO_LIMIT = 2**62
MAX_RANK_LIST = 4096  # ranks named in a range query (so the primary key is used); above, all are read
_FINITE = f"abs(value) < {1e308}"  # false for NULL (SQLite's NaN), NaN and infinities on both backends
_STATS_SQL = (
    f"sum(CASE WHEN {_FINITE} THEN 1 ELSE 0 END), coalesce(sum(CASE WHEN {_FINITE} THEN value END), 0), "
    f"min(CASE WHEN {_FINITE} THEN value END), max(CASE WHEN {_FINITE} THEN value END), "
    f"sum(CASE WHEN {_FINITE} THEN 0 ELSE 1 END)"
)
_STAT_COLUMNS = "n, total, lo, hi, nonfinite"


def _in_range(ranked: bool) -> str:
    """The points of `:ids` in steps `:first`..`:last` (of ranks `:ranks` when `ranked`): the ranks are
    named so that PostgreSQL and SQLite seek the primary key (series, rank, step) instead of
    scanning every rank's steps."""
    return (
        "series_id IN :ids"
        + (" AND rank IN :ranks" if ranked else "")
        + " AND step >= :first AND step <= :last"
    )


def _expanding(sql: str, ranked: bool) -> Any:
    names = ["ids", "ranks"] if ranked else ["ids"]
    return text(sql).bindparams(*(bindparam(n, expanding=True) for n in names))


def _roll_statements(ranked: bool) -> list[Any]:
    where = _in_range(ranked)
    return [
        _expanding(
            f"DELETE FROM rank_rollups WHERE series_id IN :ids AND level = 0 AND bucket >= :first / {BUCKET_STEPS} "
            f"AND bucket <= :last / {BUCKET_STEPS}",
            False,
        ),
        _expanding(
            f"INSERT INTO rank_rollups (series_id, level, rank, bucket, incarnation, {_STAT_COLUMNS}) "
            f"SELECT series_id, 0, rank, step / {BUCKET_STEPS}, incarnation, {_STATS_SQL} FROM points "
            f"WHERE {where} GROUP BY series_id, rank, step / {BUCKET_STEPS}, incarnation",
            ranked,
        ),
        _expanding(
            "DELETE FROM step_rollups WHERE series_id IN :ids AND step >= :first AND step <= :last", False
        ),
        _expanding(
            f"INSERT INTO step_rollups (series_id, step, incarnation, {_STAT_COLUMNS}) "
            f"SELECT series_id, step, incarnation, {_STATS_SQL} FROM points "
            f"WHERE {where} GROUP BY series_id, step, incarnation",
            ranked,
        ),
    ]


# A level's buckets lo..hi-1, summed from the level below (two buckets each).
_LEVEL_ROLL = [
    _expanding(
        "DELETE FROM rank_rollups WHERE series_id IN :ids AND level = :level AND bucket >= :lo AND bucket < :hi",
        False,
    ),
    _expanding(
        f"INSERT INTO rank_rollups (series_id, level, rank, bucket, incarnation, {_STAT_COLUMNS}) "
        "SELECT series_id, :level, rank, bucket / 2, incarnation, sum(n), sum(total), min(lo), max(hi), "
        "sum(nonfinite) FROM rank_rollups WHERE series_id IN :ids AND level = :below "
        "AND bucket >= :lo * 2 AND bucket < :hi * 2 GROUP BY series_id, rank, bucket / 2, incarnation",
        False,
    ),
]


def level_steps(level: int) -> int:
    """The width in steps of a rank rollup bucket of `level`."""
    return BUCKET_STEPS << level


_ROLL = {ranked: _roll_statements(ranked) for ranked in (False, True)}
_MARK = text(
    "INSERT INTO rollup_marks (run_id, rolled_to) VALUES (:run, :to) ON CONFLICT (run_id) DO UPDATE SET "
    "rolled_to = CASE WHEN excluded.rolled_to > rollup_marks.rolled_to THEN excluded.rolled_to "
    "ELSE rollup_marks.rolled_to END"
)
_RANK_COUNT = text(
    "SELECT max(runs.world_size), (SELECT max(rank) + 1 FROM ranks WHERE ranks.run_id IN :runs) "
    "FROM runs WHERE runs.id IN :runs"
).bindparams(bindparam("runs", expanding=True))
_COVERAGE = text(
    "SELECT min(coalesce(rollup_marks.rolled_to, -1)) FROM series "
    "LEFT JOIN rollup_marks ON rollup_marks.run_id = series.run_id WHERE series.id IN :ids"
).bindparams(bindparam("ids", expanding=True))


def run_ranks(conn: Connection, run_ids: list[int]) -> list[int] | None:
    """Every rank number the runs may hold values for (0..world size - 1, or up to the highest rank
    seen); None when there are more than MAX_RANK_LIST (then a query reads all ranks)."""
    world, seen = conn.execute(_RANK_COUNT, {"runs": run_ids}).one()
    count = max(int(world or 0), int(seen or 0))
    return list(range(count)) if count <= MAX_RANK_LIST else None


def roll_up(
    conn: Connection, run_id: int, first_step: int, last_step: int, max_values: int = _NO_LIMIT
) -> int:
    """Recompute run `run_id`'s rollups of the whole buckets holding steps first..last from the raw
    points: a DELETE and an INSERT ... SELECT ... GROUP BY per table. Only as many whole buckets
    from the first as hold about `max_values` values (series x ranks x steps; at least one bucket)
    are done. Then raise the run's watermark to the last step done, and return it. Call inside a
    write transaction.

    The watermark only ever moves over steps that were rolled up: a range that starts above it
    starts at it instead (the steps between were never handed over, e.g. a collector stopped
    before its last round); a run without one starts at its first session's first step."""
    mark = conn.execute(select(RollupMark.rolled_to).where(RollupMark.run_id == run_id)).scalar()
    if mark is None:
        started = conn.execute(select(func.min(AgentSession.first_step)).where(AgentSession.run_id == run_id))
        mark = min(first_step, int(started.scalar() or first_step)) - 1
    first_step = min(first_step, mark + 1)
    first = first_step // BUCKET_STEPS * BUCKET_STEPS
    ids = conn.execute(select(Series.id).where(Series.run_id == run_id)).scalars().all()
    ranks = run_ranks(conn, [run_id])
    per_bucket = BUCKET_STEPS * max(1, len(ids)) * (MAX_RANK_LIST if ranks is None else max(1, len(ranks)))
    last_step = min(last_step, first + max(1, max_values // per_bucket) * BUCKET_STEPS - 1)
    if ids:
        params: dict[str, Any] = {
            "ids": list(ids),
            "first": first,
            "last": last_step // BUCKET_STEPS * BUCKET_STEPS + BUCKET_STEPS - 1,
        }
        if ranks is not None:
            params["ranks"] = ranks
        for statement in _ROLL[ranks is not None]:
            conn.execute(statement, params)
        _roll_levels(conn, list(ids), first, params["last"], max(mark, last_step))
    conn.execute(_MARK, {"run": run_id, "to": last_step})
    return last_step


def _roll_levels(conn: Connection, ids: list[int], first: int, last: int, mark: int) -> None:
    """Levels 1.. of the rank rollups: recompute each level's buckets that hold a step of first..last
    (just rolled up at level 0) and lie wholly up to the watermark `mark`, from the level below,
    finest level first. A bucket reaching above the watermark is left out until the round that
    passes its end, so every stored bucket is whole and reads take the level below past the cut."""
    for level in range(1, LEVELS):
        width = level_steps(level)
        lo, hi = first // width, min((mark + 1) // width, last // width + 1)
        if lo >= hi:
            continue  # no whole bucket of this level (nor of the coarser ones) changed
        params = {"ids": ids, "level": level, "below": level - 1, "lo": lo, "hi": hi}
        for statement in _LEVEL_ROLL:
            conn.execute(statement, params)


def rolled_to(conn: Connection, ids: list[int]) -> int:
    """The lowest watermark of the runs of series `ids`: their rollups hold every step up to it
    (-1: none yet)."""
    if not ids:
        return -1
    mark = conn.execute(_COVERAGE, {"ids": ids}).one()[0]
    return -1 if mark is None else int(mark)


def _points(conn: Connection, ids: list[int], first: int, last: int | None) -> list[Any]:
    """The raw series of `ids` in steps first..last, read along the primary key (ranks named)."""
    from stepwatch_server.runs.queries import read_points

    run_ids = _run_ids(conn, ids)
    ranks = run_ranks(conn, run_ids) if run_ids else None
    return read_points(conn, ids, None, first, last, ranks=ranks)


def _from_points(
    conn: Connection, ids: list[int], first: int, last: int | None, all_ranks: bool, width: int
) -> Buckets:
    """Buckets of `width` steps (per rank, or over all ranks) aggregated from the raw points."""
    series = _points(conn, ids, first, last) if ids else []
    series = [s for s in series if s.steps.size]
    if not series:
        return _empty()
    keys = [
        np.concatenate([np.full(s.steps.shape[0], s.series_id) for s in series]),
        np.concatenate([np.full(s.steps.shape[0], ALL_RANKS if all_ranks else s.rank) for s in series]),
        np.concatenate([s.steps // width for s in series]),
    ]
    unique, stats = aggregate(keys, np.concatenate([s.values for s in series]))
    return Buckets(*unique, *stats)


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


def read(
    conn: Connection, ids: list[int], from_step: int | None, to_step: int | None, level: int = 0
) -> Buckets:
    """Per (series, rank, bucket of `level_steps(level)` steps) covering from_step..to_step (whole
    buckets): the rank rollups of the level's buckets wholly up to the watermark, the rest summed
    from the level below (from the raw points below level 0)."""
    if not ids:
        return _empty()
    width = level_steps(level)
    first, last = (from_step or 0) // width, None if to_step is None else to_step // width
    ranks = run_ranks(conn, _run_ids(conn, ids))
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
    most one bucket per level is read that way, down to the raw points above the watermark."""
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
        rows = conn.execute(query.order_by(r.series_id, r.rank, r.bucket, r.incarnation)).all()

        def exact(sid: int, bucket: int) -> Buckets:
            if level == 0:
                return _from_points(conn, [sid], bucket * width, bucket * width + width - 1, False, width)
            return coarsen(_read_level(conn, [sid], level - 1, 2 * bucket, 2 * bucket + 1, mark, ranks), 2)

        parts.append(_resolve(rows, exact))
    tail = max(cut, first)
    if last is None or tail <= last:
        if level == 0:
            tail_last = None if last is None else last * width + width - 1
            parts.append(_from_points(conn, ids, tail * width, tail_last, False, width))
        else:
            below_last = None if last is None else 2 * last + 1
            parts.append(coarsen(_read_level(conn, ids, level - 1, 2 * tail, below_last, mark, ranks), 2))
    return _merge(*parts) if parts else _empty()


def read_steps(conn: Connection, ids: list[int], from_step: int | None, to_step: int | None) -> Buckets:
    """Per (series, step) over every rank (`bucket` holds the step): the step rollups up to the
    watermark, the raw points' aggregation above it."""
    if not ids:
        return _empty()
    cut = rolled_to(conn, ids) + 1
    r = StepRollup
    query = select(
        r.series_id, literal(ALL_RANKS), r.step, r.incarnation, r.n, r.total, r.lo, r.hi, r.nonfinite
    ).where(r.series_id.in_(ids), r.step < cut)
    if from_step is not None:
        query = query.where(r.step >= from_step)
    if to_step is not None:
        query = query.where(r.step <= to_step)
    rows = conn.execute(query.order_by(r.series_id, r.step, r.incarnation)).all()
    rolled = _resolve(rows, lambda sid, step: _from_points(conn, [sid], step, step, True, 1))
    tail_first = max(cut, from_step or 0)
    if to_step is not None and tail_first > to_step:
        return rolled
    return _merge(rolled, _from_points(conn, ids, tail_first, to_step, True, 1))


def _resolve(rows: Sequence[Any], exact: Callable[[int, int], Buckets]) -> Buckets:
    """Rows (series, rank, bucket, incarnation, n, total, lo, hi, nonfinite) ordered by that key ->
    Buckets with one incarnation per bucket: where a bucket holds rows of several incarnations (a
    restart), every rank's figures of that (series, bucket) are replaced by `exact(series, bucket)`."""
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
    pairs = sorted(set(zip(sid[1:][same].tolist(), bucket[1:][same].tolist(), strict=True)))
    key = sid * (int(bucket.max()) + 1) + bucket
    mixed = np.isin(key, [s * (int(bucket.max()) + 1) + b for s, b in pairs])
    return _merge(got.take(np.flatnonzero(~mixed)), *(exact(s, b) for s, b in pairs))


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


def _empty() -> Buckets:
    empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    return Buckets(empty_i, empty_i, empty_i, empty_i, empty_f, empty_f, empty_f, empty_i)


def _merge(*parts: Buckets) -> Buckets:
    joined = Buckets(*(np.concatenate([getattr(p, f) for p in parts]) for f in Buckets.__slots__))
    return joined.take(np.lexsort((joined.bucket, joined.rank, joined.series_id)))


def column_level(first_step: int, last_step: int, columns: int) -> int:
    """The finest level whose buckets cover first_step..last_step in at most `columns` buckets (the
    coarsest level where none does): a heatmap gets between `columns / 2` and `columns` columns, one
    stored row per rank and column."""
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
    width of a column in steps)."""
    level = column_level(first_step, last_step, columns)
    width = level_steps(level)
    first, last = first_step // width, last_step // width
    per_column = -(-(last - first + 1) // columns)
    cells = read(conn, [sid], first * width, last * width + width - 1, level)
    return coarsen(cells, per_column, offset=first), first * width, per_column * width


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
_RAW_RANGE = {
    ranked: _expanding(f"SELECT min(step), max(step), count(*) FROM points WHERE {_in_range(ranked)}", ranked)
    for ranked in (False, True)
}


def step_range(
    conn: Connection, ids: list[int], from_step: int | None, to_step: int | None
) -> tuple[int, int, int] | None:
    """(first step, last step, number of raw values) stored for `ids` in the range, None if none:
    from the step rollups up to the watermark, from the raw points above it."""
    if not ids:
        return None
    mark = rolled_to(conn, ids)
    first, last = from_step or 0, _NO_LIMIT if to_step is None else to_step
    found = [conn.execute(_RANGE_QUERY, {"ids": ids, "first": first, "last": min(last, mark)}).one()]
    if last > mark:
        ranks = run_ranks(conn, _run_ids(conn, ids))
        params: dict[str, Any] = {"ids": ids, "first": max(first, mark + 1), "last": last}
        if ranks is not None:
            params["ranks"] = ranks
        found.append(conn.execute(_RAW_RANGE[ranks is not None], params).one())
    found = [f for f in found if f[0] is not None]
    if not found:
        return None
    return min(int(f[0]) for f in found), max(int(f[1]) for f in found), sum(int(f[2]) for f in found)


def across_ranks(
    conn: Connection, ids: list[int], from_step: int | None, to_step: int | None, max_points: int
) -> Groups:
    """The step rollups of `ids` grouped in SQL into at most max_points / 2 groups per series (one
    step per group when the range has at most max_points steps). Groups that reach above the
    watermark, or hold a restart, are grouped from the exact per-step figures (`read_steps`)."""
    found = step_range(conn, ids, from_step, to_step) if ids else None
    if found is None:
        empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        return Groups(0, 1, empty_i, empty_i, empty_f, empty_f, empty_f, empty_i)
    first, last, _ = found
    span = last - first + 1
    per = 1 if span <= max_points else -(-span // max(1, max_points // 2))
    mark = rolled_to(conn, ids)
    tail_group = (mark + 1 - first) // per if mark < last else None  # the first group above the watermark
    params = {"ids": ids, "first": first, "last": min(last, mark), "per": per}
    rows = conn.execute(_GROUPS_QUERY, params).all() if mark >= first else []
    parts: list[tuple[np.ndarray, ...]] = []
    if rows:
        cols = list(zip(*rows, strict=True))
        sid, group = np.array(cols[0], dtype=np.int64), np.array(cols[1], dtype=np.int64)
        floats = [np.array(c, dtype=np.float64) for c in cols[2:5]]  # None -> nan
        nonfinite = np.array(cols[5], dtype=np.int64)
        mixed = np.array(cols[6], dtype=np.int64) != np.array(cols[7], dtype=np.int64)
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


def _run_ids(conn: Connection, ids: list[int]) -> list[int]:
    return list(conn.execute(select(Series.run_id).where(Series.id.in_(ids)).distinct()).scalars().all())
