"""Rollups: the count, sum, min and max of a series' values, kept as the values arrive.

A run of 100,000 steps x 512 ranks holds 51 million values per metric; no page can read that in
seconds. So two tables are kept off the ingest path by the rollup worker (runs/rollup_worker.py):
after each commit ingest hands it the batch's run and step range, and about every half second it
recomputes the dirty ranges from the raw points, in one short transaction per group of series
(`roll_up`):

- `step_rollups`: per (series, step, incarnation), over every rank: what the curves (mean over
  ranks) and the amax (max over ranks) need, one DELETE and one INSERT ... SELECT ... GROUP BY. A
  view groups these rows in SQL into at most about `max_points / 2` groups and keeps each group's
  lowest and highest per-step mean (and highest maximum), so a one-step spike survives; 100k steps
  are 100k rows, read by the database, not by Python. Compaction moves the rows of compacted steps
  into one pack per series and 256 steps (runs/step_packs.py), which reads group with numpy.
- the rank rollups, per (series, level, rank, bucket, incarnation), for the heatmaps (ranks x steps),
  stored as one row per (series, level, bucket, incarnation) holding every rank's figures
  (`rank_rollup_packs`, runs/rank_packs.py: a row per rank took more room than the compacted values).
  Level 0's buckets are BUCKET_STEPS (64) steps wide, grouped from the raw points by the database
  (`_LEVEL0`) and packed here; each level above has buckets twice as wide, summed with numpy from
  the two below (`_roll_levels`), up to LEVELS - 1 (262,144 steps). A heatmap asked for C columns
  reads the finest level with at most C buckets in its range (`column_level`): one pack per column,
  nothing grouped by the database. 100k steps x 512 ranks in 240 columns are 196 packs of level 3,
  where level 0 alone would mean grouping 800k figures. Levels above 0 hold whole buckets only (those
  wholly up to the watermark); the part of a range past a level's last whole bucket is summed from
  the level below, down to the raw points.

What a round reads: the step rollups of the steps handed over (from the watermark + 1, or lower for a
late batch) and no others, and level 0 of the buckets among them that are whole up to the new
watermark (`Round.level0`): the bucket the watermark ends in is read by the round that passes its end,
so while a bucket fills each round reads only its new steps, not the whole bucket again (with ranks
sending a step a second, a round every few seconds read the current bucket's ~32 steps for its ~3 new
ones). Reads never take that bucket from level 0 anyway: it is above the level's cut (the part past
its last whole bucket, from the raw points).

`n`, `total`, `lo`, `hi` cover the finite values only; `nonfinite` counts NaN and infinities, so a
NaN is never averaged away: a step or group that holds one is shown as NaN.

Resumed runs: a step re-sent by a later incarnation replaces the earlier value in the raw series
(the latest incarnation wins). Rollup rows are kept per incarnation, so a step, bucket or group
that holds rows of more than one incarnation is recomputed on read (only those around a restart:
a level's bucket from the level below, level 0's and a step's from the raw points), and every
figure equals the aggregation of the raw series.

The rollups lag ingest by about a round. `rollup_marks` holds per run the highest step rolled up
(the watermark); every read takes the rollups of the steps up to it (whole buckets for the
rank rollups) and aggregates the raw points above it (the last second or so), so a view is
complete while the worker catches up. A late batch for steps below the watermark (a slow rank) is in the raw
series at once and in these views after the worker's next round.

Compacted values (runs/compaction.py) live in `blocks`, which SQL cannot read. Compaction only takes
steps the rollups already hold, so a round reaches them only for a value that arrived late for a
compacted step: such a round (`apply_part`, which looks at the run's `compacted_to` under the lock
compaction takes) aggregates the bucket's rows and blocks with numpy (`_insert_from_values`) instead,
after turning the step rollup packs of its steps back into rows (`step_packs.unpack`).

Every statement that names a run's series takes them in chunks (storage/chunks.py), so that no
statement binds more parameters than a driver allows (psycopg: 65,535), however many series a run has.

This module writes both tables and holds what their reads share; the reads are in
runs/rank_rollups.py (the heatmaps) and runs/step_rollups.py (the curves and the amax).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, bindparam, func, select, text

from stepwatch_server.runs import rank_packs, step_packs
from stepwatch_server.runs.queries import fetch_columns, read_points, read_values
from stepwatch_server.runs.step_packs import ALL_RANKS
from stepwatch_server.storage import blocks
from stepwatch_server.storage.chunks import chunk_size, chunks
from stepwatch_server.storage.models import AgentSession, RollupMark, Run, Series

BUCKET_STEPS = 64  # a level-0 rank rollup's bucket; level k's is BUCKET_STEPS << k steps wide
LEVELS = 13  # levels 0..12: buckets of 64 .. 262,144 steps, each twice as wide as the one below

NO_LIMIT = 2**62
MAX_RANK_LIST = 4096  # ranks named in a range query (so the primary key is used); above, all are read
FINITE_BELOW = 1e308  # a value counts as finite below this magnitude (NULL, NaN and infinities never do)
_FINITE = f"abs(value) < {FINITE_BELOW}"  # false for NULL (SQLite's NaN), NaN and infinities on both backends
_STATS_SQL = (
    f"sum(CASE WHEN {_FINITE} THEN 1 ELSE 0 END), coalesce(sum(CASE WHEN {_FINITE} THEN value END), 0), "
    f"min(CASE WHEN {_FINITE} THEN value END), max(CASE WHEN {_FINITE} THEN value END), "
    f"sum(CASE WHEN {_FINITE} THEN 0 ELSE 1 END)"
)
_STAT_COLUMNS = "n, total, lo, hi, nonfinite"


def in_range(ranked: bool, first: str = "first", last: str = "last") -> str:
    """The points of `:ids` in steps `:first`..`:last` (of ranks `:ranks` when `ranked`): the ranks are
    named so that PostgreSQL and SQLite seek the primary key (series, rank, step) instead of
    scanning every rank's steps."""
    return (
        "series_id IN :ids"
        + (" AND rank IN :ranks" if ranked else "")
        + f" AND step >= :{first} AND step <= :{last}"
    )


def expanding(sql: str, ranked: bool) -> Any:
    names = ["ids", "ranks"] if ranked else ["ids"]
    return text(sql).bindparams(*(bindparam(n, expanding=True) for n in names))


_LEVEL0 = {
    ranked: expanding(
        f"SELECT series_id, rank, step / {BUCKET_STEPS}, incarnation, {_STATS_SQL} FROM points "
        f"WHERE {in_range(ranked, 'bfirst', 'blast')} GROUP BY series_id, rank, step / {BUCKET_STEPS}, incarnation",
        ranked,
    )
    for ranked in (False, True)
}  # level 0 of the rank rollups per (series, rank, bucket, incarnation): whole buckets, steps :bfirst..:blast
_STEP_DELETE = expanding(
    "DELETE FROM step_rollups WHERE series_id IN :ids AND step >= :first AND step <= :last", False
)
_STEP_INSERT = {
    ranked: expanding(
        f"INSERT INTO step_rollups (series_id, step, incarnation, {_STAT_COLUMNS}) "
        f"SELECT series_id, step, incarnation, {_STATS_SQL} FROM points "
        f"WHERE {in_range(ranked)} GROUP BY series_id, step, incarnation",
        ranked,
    )
    for ranked in (False, True)
}  # the step rollups of steps :first..:last


def level_steps(level: int) -> int:
    """The width in steps of a rank rollup bucket of `level`."""
    return BUCKET_STEPS << level


_SCALAR_PARAMS = 8  # the most parameters of a roll-up statement besides its ids and ranks
_MARK = text(
    "INSERT INTO rollup_marks (run_id, rolled_to) VALUES (:run, :to) ON CONFLICT (run_id) DO UPDATE SET "
    "rolled_to = CASE WHEN excluded.rolled_to > rollup_marks.rolled_to THEN excluded.rolled_to "
    "ELSE rollup_marks.rolled_to END"
)
_RANK_COUNT = text(
    "SELECT max(runs.world_size), (SELECT max(rank) + 1 FROM ranks WHERE ranks.run_id IN :runs) "
    "FROM runs WHERE runs.id IN :runs"
).bindparams(bindparam("runs", expanding=True))
_STORED_TO = text(
    "SELECT count(*), max(CASE WHEN stored_to IS NULL THEN 1 ELSE 0 END), max(stored_to) FROM ranks "
    "WHERE run_id IN :runs"
).bindparams(bindparam("runs", expanding=True))
_COVERAGE = expanding(
    "SELECT min(coalesce(rollup_marks.rolled_to, -1)) FROM series "
    "LEFT JOIN rollup_marks ON rollup_marks.run_id = series.run_id WHERE series.id IN :ids",
    False,
)


def ranked_params(params: dict[str, Any], ranks: list[int] | None) -> tuple[bool, dict[str, Any]]:
    """(whether to run a statement's variant that names the ranks, its parameters): the ranks are
    named when known (`run_ranks`), so the primary key is sought rank by rank."""
    return (True, {**params, "ranks": ranks}) if ranks is not None else (False, params)


def run_ranks(conn: Connection, run_ids: list[int]) -> list[int] | None:
    """Every rank number the runs may hold values for (0..world size - 1, or up to the highest rank
    seen); None when there are more than MAX_RANK_LIST (then a query reads all ranks)."""
    count = _rank_count(conn, run_ids)
    return list(range(count)) if count <= MAX_RANK_LIST else None


def _rank_count(conn: Connection, run_ids: list[int]) -> int:
    """The ranks the runs may hold values for: their world size, or the highest rank seen + 1."""
    world, seen = conn.execute(_RANK_COUNT, {"runs": run_ids}).one()
    return max(int(world or 0), int(seen or 0))


@dataclass(frozen=True, slots=True)
class Round:
    """What one roll-up of a run covers (`plan`): the step rollups of steps `from_step`..`last_step`,
    level 0 of the rank rollups of the buckets from `first` that are whole up to the watermark after it
    (`level0`), the watermark raised to `last_step`; `ids` are the run's series, `ranks` its ranks
    (None: more than MAX_RANK_LIST)."""

    run_id: int
    first: int  # the first step of the first bucket
    last_step: int  # the last step rolled up (the watermark after it, where higher)
    mark: int  # the watermark before it
    ids: list[int]
    ranks: list[int] | None
    from_step: int  # the first step rolled up: the lowest step handed over, at most mark + 1

    @property
    def level0(self) -> tuple[int, int]:
        """The level-0 buckets lo..hi-1 to roll up: those from `first`'s that end at or below the watermark
        after the round. The bucket the watermark ends in waits for the round that passes its end (reads
        take it from the raw points), so a bucket's steps are read once when it is whole, not again
        every round while it fills."""
        return self.first // BUCKET_STEPS, min(self.last // BUCKET_STEPS + 1, (self.top + 1) // BUCKET_STEPS)

    @property
    def top(self) -> int:
        """The watermark after the round."""
        return max(self.mark, self.last_step)

    @property
    def last(self) -> int:
        """The last step of the last (whole) bucket."""
        return self.last_step // BUCKET_STEPS * BUCKET_STEPS + BUCKET_STEPS - 1

    def extent(self) -> str:
        ranks = f"over {MAX_RANK_LIST:,}" if self.ranks is None else f"{len(self.ranks):,}"
        return f"steps {self.first}..{self.last_step} ({len(self.ids):,} series x {ranks} ranks)"


def roll_up(
    conn: Connection, run_id: int, first_step: int, last_step: int, max_values: int = NO_LIMIT
) -> int:
    """Recompute run `run_id`'s rollups of the whole buckets holding steps first..last from the raw
    points (`plan`, then `apply`), raise the run's watermark to the last step done, and return it.
    Call inside a write transaction. A run deleted meanwhile has nothing to roll up: `last_step`."""
    planned = plan(conn, run_id, first_step, last_step, max_values)
    if planned is None:
        return last_step
    apply(conn, planned)
    return planned.last_step


def plan(
    conn: Connection, run_id: int, first_step: int, last_step: int, max_values: int = NO_LIMIT
) -> Round | None:
    """The round that rolls up steps first..last of run `run_id`: only as many whole buckets from the
    first as hold about `max_values` values (series x ranks x steps; at least one bucket). None when the
    run is no longer in the database (deleted: runs/deletion.py).

    The watermark only ever moves over steps that were rolled up: a range that starts above it
    starts at it instead (the steps between were never handed over, e.g. a collector stopped
    before its last round); a run without one starts at its first session's first step."""
    if conn.execute(select(Run.id).where(Run.id == run_id)).scalar() is None:
        return None
    mark = conn.execute(select(RollupMark.rolled_to).where(RollupMark.run_id == run_id)).scalar()
    if mark is None:
        started = conn.execute(select(func.min(AgentSession.first_step)).where(AgentSession.run_id == run_id))
        mark = min(first_step, int(started.scalar() or first_step)) - 1
    first_step = min(first_step, mark + 1)
    first = first_step // BUCKET_STEPS * BUCKET_STEPS
    ids = list(conn.execute(select(Series.id).where(Series.run_id == run_id)).scalars().all())
    ranks = run_ranks(conn, [run_id])
    per_bucket = BUCKET_STEPS * max(1, len(ids)) * (MAX_RANK_LIST if ranks is None else max(1, len(ranks)))
    last_step = min(last_step, first + max(1, max_values // per_bucket) * BUCKET_STEPS - 1)
    return Round(run_id, first, last_step, int(mark), ids, ranks, first_step)


def apply(conn: Connection, r: Round) -> None:
    """Round `r` in one transaction: each group of its series (`parts`), then the watermark."""
    for ids in parts(conn, r):
        apply_part(conn, r, ids)
    finish(conn, r)


def parts(conn: Connection, r: Round, max_values: int = NO_LIMIT) -> list[list[int]]:
    """Round `r`'s series in groups within every driver's limit on bind parameters (`chunk_size`) and
    of about `max_values` values each (series x ranks x steps, at least one series): the rollup worker
    writes each group in a transaction of its own, so that a wide run's bucket (20,000 names: 1.28M
    values) does not hold SQLite's write lock for seconds."""
    per_series = (r.last - r.first + 1) * (MAX_RANK_LIST if r.ranks is None else max(1, len(r.ranks)))
    size = min(chunk_size(conn, fixed=len(r.ranks or ()) + _SCALAR_PARAMS), max(1, max_values // per_series))
    return [list(part) for part in chunks(r.ids, size)]


def apply_part(conn: Connection, r: Round, ids: list[int], skip: bool = False) -> None:
    """Round `r` for series `ids`: the step rollups (a DELETE and an INSERT ... SELECT ... GROUP BY) and
    level 0 of the rank rollups (their figures per rank grouped by the database, packed here:
    runs/rank_packs.py) of the round's ranges, aggregated with numpy where the range holds compacted
    values (module docstring), then the coarser levels' whole buckets from the level below
    (`_roll_levels`). Packed step rollups of compacted steps in the round's range become rows again first
    (runs/step_packs.py). `skip`: delete the round's step rollups and level-0 packs and write none. Each
    series' rollups change in one transaction: a reader sees a series' old rollups or its new ones."""
    lo, hi = r.level0
    bfirst, blast = lo * BUCKET_STEPS, hi * BUCKET_STEPS - 1
    ranked, params = ranked_params(
        {"ids": ids, "first": r.from_step, "last": r.last_step, "bfirst": bfirst, "blast": blast}, r.ranks
    )
    blocks.lock_run(conn, r.run_id)
    compacted = blocks.compacted_to(conn, r.run_id)
    if compacted is not None and r.from_step <= compacted:  # compacted steps' rollups may be packed
        step_packs.unpack(conn, ids, r.from_step, r.last_step)
    conn.execute(_STEP_DELETE, params)
    if lo < hi:  # none without a whole bucket
        rank_packs.remove(conn, ids, 0, lo, hi)
    in_blocks = compacted is not None and min(r.from_step, bfirst) <= compacted  # values SQL cannot read
    level0 = rank_packs.empty()  # level 0's buckets lo..hi-1 as written (none where skipped)
    if not skip and in_blocks:
        first, last = min(r.from_step, bfirst), max(r.last_step, blast)
        cols = read_values(conn, ids, None, first, last, ranks=r.ranks)
        level0 = _insert_from_values(conn, cols, (bfirst, blast), (r.from_step, r.last_step))
    elif not skip:
        conn.execute(_STEP_INSERT[ranked], params)
        if lo < hi:
            level0 = fetch_columns(conn, _LEVEL0[ranked], ROLLUP_INTEGERS, params)
            rank_packs.write(conn, 0, level0)
    _roll_levels(conn, ids, r.first, r.last, r.top, (lo, hi, level0) if lo < hi else None)


def _insert_from_values(
    conn: Connection, cols: list[np.ndarray], buckets: tuple[int, int], steps: tuple[int, int]
) -> list[np.ndarray]:
    """Level 0 of the rank rollups of the values `cols` in steps `buckets` (first, last) and the step
    rollups of those in steps `steps` (every incarnation: each row keeps its own), as `_LEVEL0` and
    `_STEP_INSERT` compute them from `points`; the level-0 columns written."""

    def within(first: int, last: int) -> list[np.ndarray]:
        inside = (cols[2] >= first) & (cols[2] <= last)
        return [c[inside] for c in cols]

    level0 = rank_packs.empty()
    sid, rank, step, inc, value = within(*buckets)
    if sid.size:
        unique, stats = aggregate([sid, rank, step // BUCKET_STEPS, inc], value)
        level0 = [*unique, *stats]
        rank_packs.write(conn, 0, level0)
    sid, _, step, inc, value = within(*steps)
    if sid.size:
        unique, stats = aggregate([sid, step, inc], value)
        step_packs.insert_rows(conn, [*unique, *stats])
    return level0


def finish(conn: Connection, r: Round) -> None:
    """Raise the run's watermark past round `r` (once every group of its series is written)."""
    conn.execute(_MARK, {"run": r.run_id, "to": r.last_step})


def skip(conn: Connection, r: Round) -> None:
    """Give up on round `r` (its roll-up keeps failing): delete the step rollups and the level-0 rank
    rollups of its buckets, so that the views read from rollups leave those steps out rather than
    show an older state of them, sum the coarser levels over them again from what is left, and raise
    the watermark past them so that the run's later steps are rolled up. The raw points are kept."""
    for ids in parts(conn, r):
        apply_part(conn, r, ids, skip=True)
    finish(conn, r)


_Written = tuple[int, int, list[np.ndarray]]  # buckets lo..hi-1 of a level as written: their columns


def _roll_levels(
    conn: Connection, ids: list[int], first: int, last: int, mark: int, written: _Written | None = None
) -> None:
    """Levels 1.. of the rank rollups: recompute each level's buckets that hold a step of first..last
    (just rolled up at level 0) and lie wholly up to the watermark `mark`, from the level below,
    finest level first. A bucket reaching above the watermark is left out until the round that
    passes its end, so every stored bucket is whole and reads take the level below past the cut.
    `written`: level 0's buckets lo..hi-1 as this round wrote them, so that only the level below's
    buckets outside what the round wrote are read back (a round of 30 buckets of 500 series decoded
    ~30,000 packs it had just encoded: bench/README.md)."""
    for level in range(1, LEVELS):
        width = level_steps(level)
        lo, hi = first // width, min((mark + 1) // width, last // width + 1)
        if lo >= hi:
            written = None
            continue  # no whole bucket of this level (nor of the coarser ones) changed
        below = _level_below(conn, ids, level - 1, 2 * lo, 2 * hi - 1, written)
        rank_packs.remove(conn, ids, level, lo, hi)
        made = rank_packs.combine(below, 2)
        rank_packs.write(conn, level, made)
        written = (lo, hi, made)


def _level_below(
    conn: Connection, ids: list[int], level: int, first: int, last: int, written: _Written | None
) -> list[np.ndarray]:
    """The rows of `level` in buckets first..last that `rank_packs.read` gives (in another order, which
    `rank_packs.combine` sorts; it adds two buckets a sum, the same bits in either order): those `written`
    from their columns, the rest read from the table."""
    if written is None:
        return rank_packs.read(conn, ids, level, first, last)
    lo, hi, cols = written
    inside = (cols[2] >= first) & (cols[2] <= last)
    parts = [[c[inside].astype(e.dtype) for c, e in zip(cols, rank_packs.empty(), strict=True)]]
    if first < lo:
        parts.append(rank_packs.read(conn, ids, level, first, min(last, lo - 1)))
    if last >= hi:
        parts.append(rank_packs.read(conn, ids, level, max(first, hi), last))
    return [np.concatenate(c) for c in zip(*parts, strict=True)]


def rolled_to(conn: Connection, ids: list[int]) -> int:
    """The lowest watermark of the runs of series `ids`: their rollups hold every step up to it
    (-1: none yet)."""
    marks = [conn.execute(_COVERAGE, {"ids": part}).one()[0] for part in chunks(ids, chunk_size(conn))]
    marks = [m for m in marks if m is not None]
    return int(min(marks)) if marks else -1


def stored_above(conn: Connection, ids: list[int], mark: int) -> bool:
    """Whether the runs of series `ids` may hold raw values above step `mark` (their rollup watermark): some
    rank's highest stored step (`ranks.stored_to`, kept by ingest in the transaction that stores the batch) is
    above it, or is not known (NULL, or a rank without a row: values written other than by ingest). A read
    above the watermark asks the raw values only then: once a run is rolled up that is one query where it
    sought every series and rank (a ranking of 500 modules x 256 ranks: 128,000 seeks, ~1 s on PostgreSQL)."""
    run_ids = run_ids_of(conn, ids)
    if not run_ids:
        return False
    rows, unknown, top = conn.execute(_STORED_TO, {"runs": run_ids}).one()
    known = not unknown and int(rows) >= _rank_count(conn, run_ids)
    return not known or (top is not None and int(top) > mark)


def raw_points(conn: Connection, ids: list[int], first: int, last: int | None) -> list[Any]:
    """The raw series of `ids` in steps first..last, read along the primary key (ranks named)."""
    run_ids = run_ids_of(conn, ids)
    ranks = run_ranks(conn, run_ids) if run_ids else None
    return read_points(conn, ids, None, first, last, ranks=ranks)


def from_points(
    conn: Connection, ids: list[int], first: int, last: int | None, all_ranks: bool, width: int
) -> Buckets:
    """Buckets of `width` steps (per rank, or over all ranks) aggregated from the raw points."""
    series = raw_points(conn, ids, first, last) if ids else []
    series = [s for s in series if s.steps.size]
    if not series:
        return empty()
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
    starts = rank_packs.group_starts(sorted_keys)
    with np.errstate(invalid="ignore"):
        finite = np.abs(v) < FINITE_BELOW  # as `_FINITE` in SQL
    n = np.add.reduceat(finite.astype(np.int64), starts)
    total = np.add.reduceat(np.where(finite, v, 0.0), starts)
    lo = np.minimum.reduceat(np.where(finite, v, np.inf), starts)
    hi = np.maximum.reduceat(np.where(finite, v, -np.inf), starts)
    lo[n == 0] = np.nan
    hi[n == 0] = np.nan
    nonfinite = np.add.reduceat((~finite).astype(np.int64), starts)
    return [k[starts] for k in sorted_keys], [n, total, lo, hi, nonfinite]


ROLLUP_INTEGERS = rank_packs.INTEGERS  # the integer columns of a rollup read (`fetch_columns`)


def resolve(cols: list[np.ndarray], exact: Callable[[int, int], Buckets]) -> Buckets:
    """Columns (series, rank, bucket, incarnation, n, total, lo, hi, nonfinite) ordered by that key
    (`fetch_columns` with ROLLUP_INTEGERS) -> Buckets with one incarnation per bucket: where a bucket
    holds rows of several incarnations (a restart), every rank's figures of that (series, bucket)
    are replaced by `exact(series, bucket)`."""
    if cols[0].size == 0:
        return empty()
    sid, rank, bucket = cols[0], cols[1], cols[2]
    got = Buckets(sid, rank, bucket, cols[4], cols[5], cols[6], cols[7], cols[8])
    same = (sid[1:] == sid[:-1]) & (rank[1:] == rank[:-1]) & (bucket[1:] == bucket[:-1])
    if not same.any():
        return got
    pairs, pair_of_row = np.unique(np.stack([sid, bucket], axis=1), axis=0, return_inverse=True)
    several = np.zeros(pairs.shape[0], dtype=bool)
    several[pair_of_row.reshape(-1)[1:][same]] = True  # (series, bucket) pairs holding a restart
    mixed = several[pair_of_row.reshape(-1)]
    return merge(got.take(np.flatnonzero(~mixed)), *(exact(int(s), int(b)) for s, b in pairs[several]))


def empty() -> Buckets:
    empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    return Buckets(empty_i, empty_i, empty_i, empty_i, empty_f, empty_f, empty_f, empty_i)


def merge(*parts: Buckets) -> Buckets:
    joined = Buckets(*(np.concatenate([getattr(p, f) for p in parts]) for f in Buckets.__slots__))
    return joined.take(np.lexsort((joined.bucket, joined.rank, joined.series_id)))


def run_ids_of(conn: Connection, ids: list[int]) -> list[int]:
    found: set[int] = set()
    for part in chunks(ids, chunk_size(conn)):
        found.update(conn.execute(select(Series.run_id).where(Series.id.in_(part)).distinct()).scalars())
    return sorted(found)
