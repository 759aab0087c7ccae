"""`GET /api/v1/runs/{run}/series?rank=all` reads a bounded number of raw points on a long run (it read
every one before downsampling: 51M rows at 100k steps x 512 ranks), on both backends, and its answer
keeps its meaning: at most `max_points` points per rank, a one-step spike and a NaN survive, values
outside from_step..to_step stay out, and a narrow range is still the exact raw series."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import numpy as np
import orjson
import pytest
from sqlalchemy import Connection, Engine, event, insert, select

from stepwatch_server.ingest.store import insert_points
from stepwatch_server.runs import queries, rank_rollups, rollups, routes
from stepwatch_server.storage import write_transaction
from stepwatch_server.storage.models import Run, Series

RANKS = 4
STEPS = 60_000  # x 4 ranks = 240,000 values: above rank_rollups.RAW_READ_BUDGET
SPIKE = (2, 33_333, 1000.0)  # rank 2's one-step spike
NAN = (1, 44_444)  # rank 1's NaN
EDGE = (0, 1_000, -500.0)  # rank 0's dip at the first step of the range read below
OUTSIDE = (3, 999, 5000.0)  # rank 3's spike one step before it: never in the answer
MAX_POINTS = 200


def _long_run(engine: Engine, rolled_to: int = STEPS - 1) -> int:
    """The run's values, rolled up to step `rolled_to`; its run id."""
    now = dt.datetime.now(dt.UTC)
    with engine.begin() as conn:
        run_id = conn.execute(
            insert(Run)
            .values(name="long", world_size=RANKS, created_at=now, last_seen_at=now)
            .returning(Run.id)
        ).scalar_one()
        sid = conn.execute(
            insert(Series).values(run_id=run_id, stat="", name="loss").returning(Series.id)
        ).scalar_one()
        values = 2.0 + 0.001 * (np.arange(STEPS) % 100)
        rows = []
        for rank in range(RANKS):
            v = values.copy()
            for r, step, value in (SPIKE, EDGE, OUTSIDE):
                if r == rank:
                    v[step] = value
            if rank == NAN[0]:
                v[NAN[1]] = np.nan
            rows += [(sid, rank, s, 1, x) for s, x in enumerate(v.tolist())]
        insert_points(conn, rows)
    with write_transaction(engine) as conn:
        assert rollups.roll_up(conn, run_id, 0, rolled_to) == rolled_to
    return int(run_id)


class PointReads:
    """The statements a request runs on table `points`, and how many rows they read there: on PostgreSQL
    from EXPLAIN ANALYZE (the rows its scans of `points` produced or filtered out), on SQLite the rows
    each statement returns (an aggregate counts as its one row there; PostgreSQL counts what it read)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.statements: list[tuple[str, Any]] = []
        event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if " points" in statement and not statement.lstrip().upper().startswith(
            ("EXPLAIN", "SELECT COUNT(*) FROM (")
        ):
            self.statements.append((statement, parameters))

    def close(self) -> None:
        event.remove(self.engine, "before_cursor_execute", self._seen)

    def rows(self, conn: Connection) -> int:
        total = 0
        for statement, parameters in self.statements:
            if conn.dialect.name == "postgresql":
                plan = conn.exec_driver_sql(
                    f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", parameters
                ).scalar()
                total += _scanned(plan if isinstance(plan, list) else json.loads(plan), "points")
            else:
                total += conn.exec_driver_sql(f"SELECT count(*) FROM ({statement}) AS q", parameters).scalar()
        return total


def _scanned(plan: Any, table: str) -> int:
    if isinstance(plan, list):
        return sum(_scanned(p, table) for p in plan)
    if not isinstance(plan, dict):
        return 0
    rows = 0
    if plan.get("Relation Name") == table:
        per_loop = plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)
        rows += int(per_loop * plan.get("Actual Loops", 1))
    return rows + sum(_scanned(v, table) for k, v in plan.items() if k in ("Plan", "Plans"))


def _series(engine: Engine, **params: Any) -> tuple[dict[int, tuple[list[int], list[Any]]], int]:
    """The route's answer per rank (steps, values), and the rows it read from `points`."""
    reads = PointReads(engine)
    try:
        with engine.connect() as conn:
            args = {"from_step": None, "to_step": None, "max_points": MAX_POINTS, **params}
            response = routes.get_series("long", conn, metric="loss", rank="all", **args)
    finally:
        reads.close()
    with engine.connect() as conn:
        read = reads.rows(conn)
    body = orjson.loads(response.body)
    assert body["metric"] == "loss"
    return {s["rank"]: (s["steps"], s["values"]) for s in body["series"]}, read


def test_rank_all_over_a_long_run_reads_a_bounded_number_of_points_and_keeps_its_extremes(
    engine: Engine,
) -> None:
    _long_run(engine)
    got, read = _series(engine, from_step=EDGE[1], to_step=STEPS - 1)
    assert read <= 2 * rollups.BUCKET_STEPS * RANKS, read  # the range's partial buckets at most, not 236,000
    assert sorted(got) == list(range(RANKS))
    for rank, (steps, values) in got.items():
        assert 0 < len(steps) == len(values) <= MAX_POINTS
        assert steps == sorted(steps) and steps[0] >= EDGE[1] and steps[-1] <= STEPS - 1
        finite = [v for v in values if not isinstance(v, str)]
        assert min(finite) >= (EDGE[2] if rank == EDGE[0] else 2.0)
        assert max(finite) <= (SPIKE[2] if rank == SPIKE[0] else 2.099)
    assert SPIKE[2] in got[SPIKE[0]][1]  # the one-step spike survives
    assert "NaN" in got[NAN[0]][1]  # so does the NaN
    assert EDGE[2] in got[EDGE[0]][1]  # and the dip at the range's first step
    assert OUTSIDE[2] not in got[OUTSIDE[0]][1]  # a step before the range stays out
    spike_steps, spike_values = got[SPIKE[0]]
    at = spike_steps[spike_values.index(SPIKE[2])]
    assert abs(at - SPIKE[1]) <= 2 * (STEPS - EDGE[1]) // MAX_POINTS + rollups.BUCKET_STEPS  # in its column


def test_rank_all_over_a_narrow_range_is_the_exact_raw_series(engine: Engine) -> None:
    _long_run(engine)
    got, read = _series(engine, from_step=SPIKE[1] - 50, to_step=SPIKE[1] + 49, max_points=1000)
    assert (
        100 * RANKS <= read <= 100 * RANKS + 1
    )  # (+ SQLite's one-row count of the points above the watermark)
    for rank, (steps, values) in got.items():
        assert steps == list(range(SPIKE[1] - 50, SPIKE[1] + 50))
        expected = [2.0 + 0.001 * (s % 100) for s in steps]
        if rank == SPIKE[0]:
            expected[50] = SPIKE[2]
        assert values == pytest.approx(expected)


def test_rank_all_is_the_same_while_the_rollups_lag(engine: Engine) -> None:
    """Rolled up to the middle of a bucket of every level: the steps above are summed from the levels
    below and the raw points, and the answer is the one read once everything is rolled up."""
    run_id = _long_run(engine, rolled_to=37_000)
    lagging, _ = _series(engine, from_step=EDGE[1], to_step=STEPS - 1)
    with write_transaction(engine) as conn:
        rollups.roll_up(conn, run_id, 37_001, STEPS - 1)
    caught_up, _ = _series(engine, from_step=EDGE[1], to_step=STEPS - 1)
    assert lagging == caught_up


RANGES = [
    (1_000, 59_999, 100),
    (777, 41_234, 25),
    (5, 5, 3),
    (63, 64, 1),
    (0, 59_999, 7),
    (12_345, 12_645, 10_000),
]


def test_the_columns_of_a_range_equal_the_raw_aggregation(engine: Engine) -> None:
    """Per rank and column, what `rank_curves` is drawn from (`read_range`) is the raw aggregation of
    exactly the column's steps inside the range: whole buckets of the level, and the end columns from
    the fewest whole buckets plus raw steps (ranges of one step to the whole run, aligned or not)."""
    _long_run(engine)
    with engine.connect() as conn:
        (sid,) = conn.execute(select(Series.id)).scalars()
        for first, last, columns in RANGES:
            cells, start, width = rank_rollups.read_range(conn, sid, first, last, columns)
            raw = queries.read_points(conn, [sid], None, first, last)
            assert start <= first and width >= rollups.BUCKET_STEPS and int(cells.bucket.max()) < columns
            got, expected = _columns(cells), _raw_columns(raw, start, width)
            assert got.keys() == expected.keys(), (first, last, columns)
            for key, figures in expected.items():
                assert got[key] == pytest.approx(figures, rel=1e-12), (first, last, columns, key)


def _columns(cells: rollups.Buckets) -> dict[tuple[int, int], list[float]]:
    fields = ("rank", "bucket", "n", "total", "lo", "hi", "nonfinite")
    return {
        (r, c): [n, t, lo, hi, bad]
        for r, c, n, t, lo, hi, bad in zip(*(getattr(cells, f).tolist() for f in fields), strict=True)
    }


def _raw_columns(raw: list[queries.RankSeries], start: int, width: int) -> dict[tuple[int, int], list[float]]:
    """(rank, column) -> [n, total, lo, hi, nonfinite] of the raw values in columns of `width` steps."""
    expected = {}
    for s in raw:
        column = (s.steps - start) // width
        for c in np.unique(column).tolist():
            v = s.values[column == c]
            finite = v[np.isfinite(v)]
            expected[(s.rank, c)] = [
                finite.size,
                finite.sum(),
                finite.min(),
                finite.max(),
                v.size - finite.size,
            ]
    return expected
