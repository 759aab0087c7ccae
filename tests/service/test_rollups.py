"""Rollups kept by the rollup worker equal the aggregation of the raw series, on both backends:
spikes and NaN survive, a resumed run's re-sent steps (a late batch for old steps, inside a bucket)
replace the earlier incarnation's values, the grouped curves hold each group's extremes of the
per-step mean over ranks, and the heatmap read from rollups is the one read from the raw points.
Reads are the same while the worker has not caught up (the raw points above its watermark), and
the worker rolls up what is left when it stops."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import orjson
import pytest
from sqlalchemy import Connection, Engine, event, insert, select, text

from stepwatch_server.dashboard.heatmap import heatmap, heatmap_from_rollups
from stepwatch_server.ingest.store import POINT_COLUMNS, PointRow, insert_points
from stepwatch_server.runs import queries, rank_packs, rank_rollups, rollups, step_rollups
from stepwatch_server.runs.rollup_worker import RollupWorker
from stepwatch_server.storage import make_engine, upgrade
from stepwatch_server.storage.engine import write_transaction
from stepwatch_server.storage.models import Point, RankRollupPack, Run, Series, StepRollup
from tests.service.conftest import Collector, steps_batch

RANKS = 3
STEPS = 1024  # steps 0..1023 of incarnation 1 (rank 1 stops at 700), rank 1 resumes at 630
CATCH_UP_S = 60.0  # the bound on waiting for the worker (it needs well under a second here)


@pytest.fixture
def worker(engine: Engine) -> Iterator[RollupWorker]:
    worker = RollupWorker(engine).start()
    yield worker
    worker.stop()


def _assert_rollups_equal_raw(conn: Connection, ids: dict[str, int], all_ranks: bool, level: int = 0) -> None:
    for sid in ids.values():
        raw = _raw_buckets(conn, sid, all_ranks, rollups.level_steps(level))
        if all_ranks:
            got = _rolled(step_rollups.read_steps(conn, [sid], None, None))
        else:
            got = _rolled(rank_rollups.read(conn, [sid], None, None, level))
        assert got.keys() == raw.keys()
        for key, expected in raw.items():
            n, total, lo, hi, bad = got[key]
            assert (n, bad) == (expected[0], expected[4]), key
            assert total == pytest.approx(expected[1]), key
            if n:
                assert (lo, hi) == (expected[2], expected[3]), key


def _write(
    engine: Engine,
    worker: RollupWorker | None,
    store: Callable[[Connection, list[PointRow]], None] = insert_points,
    hand_over_below: int = STEPS,
) -> dict[str, int]:
    """One run: loss on 3 ranks with a one-step spike and a NaN, amax every 10th step; rank 1
    restarts at step 630 (incarnation 2) after reaching 700, its re-sent steps higher by 100.
    Each batch's step range goes to `worker` as ingest hands it over (those starting below
    `hand_over_below` only); the restart's batches are written once the worker caught up, so
    they are late batches for steps already rolled up."""
    now = dt.datetime.now(dt.UTC)
    with engine.begin() as conn:
        run_id = conn.execute(
            insert(Run).values(name="r", world_size=RANKS, created_at=now, last_seen_at=now).returning(Run.id)
        ).scalar_one()
        ids = {
            name: conn.execute(
                insert(Series).values(run_id=run_id, stat=stat, name=name).returning(Series.id)
            ).scalar_one()
            for stat, name in (("", "loss"), ("amax", "fc1"))
        }
    rng = np.random.default_rng(1)
    for rank in range(RANKS):
        last = 700 if rank == 1 else STEPS
        for lo in range(0, last, 50):  # one transaction per batch of 50 steps, as ingest does
            steps = np.arange(lo, min(lo + 50, last))
            loss = 2.0 + rng.normal(0, 0.01, steps.shape[0])
            loss[steps == 333] = 90.0 if rank == 2 else loss[steps == 333]
            rows = [(ids["loss"], rank, int(s), 1, float(v)) for s, v in zip(steps, loss, strict=True)]
            rows = [(a, b, c, d, float("nan") if (b, c) == (0, 900) else v) for a, b, c, d, v in rows]
            rows += [(ids["fc1"], rank, int(s), 1, 10.0 + rank) for s in steps if s % 10 == 0]
            with engine.begin() as conn:
                store(conn, rows)
            if worker is not None and lo < hand_over_below:
                worker.submit(run_id, lo, int(steps[-1]))
    if worker is not None:
        assert worker.wait_idle(CATCH_UP_S)
    for lo in range(630, STEPS, 50):
        steps = np.arange(lo, min(lo + 50, STEPS))
        rows = [(ids["loss"], 1, int(s), 2, 102.0) for s in steps]
        with engine.begin() as conn:
            store(conn, rows)
        if worker is not None and lo < hand_over_below:
            worker.submit(run_id, lo, int(steps[-1]))
    if worker is not None:
        assert worker.wait_idle(CATCH_UP_S)
    return ids


def _raw_buckets(
    conn: Connection, sid: int, all_ranks: bool, width: int = rollups.BUCKET_STEPS
) -> dict[tuple[int, int], tuple[float, ...]]:
    """(rank, bucket of `width` steps) or (ALL_RANKS, step) -> (n, total, lo, hi, nonfinite), from the
    raw series."""
    out: dict[tuple[int, int], list[float]] = {}
    for s in queries.read_points(conn, [sid], None, None, None):
        for step, value in zip(s.steps.tolist(), s.values.tolist(), strict=True):
            key = (rollups.ALL_RANKS, step) if all_ranks else (s.rank, step // width)
            n, total, lo, hi, bad = out.setdefault(key, [0, 0.0, np.inf, -np.inf, 0])
            if np.isfinite(value):
                out[key] = [n + 1, total + value, min(lo, value), max(hi, value), bad]
            else:
                out[key][4] += 1
    return {k: tuple(v) for k, v in out.items()}


def _rolled(got: rollups.Buckets, by: str = "bucket") -> dict[tuple[int, int], tuple[float, ...]]:
    """(rank, bucket) -> (n, total, lo, hi, nonfinite); `by="series"`: keyed (series, rank), of a read with
    one bucket a series and rank."""
    keys = list(zip(got.rank.tolist(), got.bucket.tolist(), strict=True))
    if by == "series":
        keys = list(zip(got.series_id.tolist(), got.rank.tolist(), strict=True))
        assert len(set(keys)) == len(keys)
    figures = (got.n, got.total, got.lo, got.hi, got.nonfinite)
    return dict(zip(keys, zip(*(f.tolist() for f in figures), strict=True), strict=True))


@pytest.mark.parametrize("hand_over_below", [STEPS, 500], ids=["rolled-up", "rolled-up-to-499"])
def test_span_reads_from_the_rollup_levels_equal_the_raw_figures_of_their_steps(
    engine: Engine, worker: RollupWorker, hand_over_below: int
) -> None:
    """`read_span` (a range's figures per rank from the fewest whole buckets of any level, the raw steps at its
    ends and above the watermark) equals the raw figures of exactly those steps, the latest incarnation of
    each, and `span_peaks` (the amax ranking's read, the same buckets) each series' highest value and
    non-finite count there: ranges aligned and not to buckets, one step, the spike, the NaN, the restart (its
    buckets of two incarnations), the whole run."""
    ids = _write(engine, worker, hand_over_below=hand_over_below)
    rng = np.random.default_rng(7)
    ranges = [(0, STEPS - 1), (64, 1023), (333, 333), (1, 1022), (128, 895), (600, 700), (0, 63), (64, 127)]
    ranges += [tuple(sorted(rng.integers(0, STEPS, 2).tolist())) for _ in range(12)]
    with engine.connect() as conn:
        raw = {
            (s.series_id, s.rank): (s.steps, s.values)
            for s in queries.read_points(conn, list(ids.values()), None, None, None)
        }
        for first, last in ranges:
            got = _rolled(rank_rollups.read_span(conn, list(ids.values()), first, last), by="series")
            expected = {}
            for key, (steps, values) in raw.items():
                inside = values[(steps >= first) & (steps <= last)]
                finite = inside[np.isfinite(inside)]
                if inside.size:
                    expected[key] = (
                        finite.size,
                        finite.sum(),
                        finite.min(initial=np.inf),
                        finite.max(initial=-np.inf),
                    )
                    expected[key] += (inside.size - finite.size,)
            assert got.keys() == expected.keys(), (first, last)
            for key, (n, total, lo, hi, bad) in expected.items():
                assert got[key][0] == n and got[key][4] == bad, (first, last, key)
                assert got[key][1] == pytest.approx(total), (first, last, key)
                if n:
                    assert got[key][2:4] == (lo, hi), (first, last, key)
            # The ranking's read: each series' highest value and non-finite count over every rank and
            # incarnation (a restart's re-sent steps count both), exact.
            series, highest, nonfinite = rank_rollups.span_peaks(conn, list(ids.values()), first, last)
            sid, *_, value = queries.read_values(conn, list(ids.values()), None, first, last)
            assert series.tolist() == sorted(set(sid.tolist())), (first, last)
            for s, peak, bad in zip(series.tolist(), highest.tolist(), nonfinite.tolist(), strict=True):
                mine = value[sid == s]
                assert bad == int((~np.isfinite(mine)).sum()), (first, last, s)
                finite = mine[np.isfinite(mine)]
                assert peak == finite.max() if finite.size else np.isnan(peak), (first, last, s)


def _raw_means(conn: Connection, sid: int) -> dict[int, float]:
    """Per step, the mean over ranks of the raw series (latest incarnation); NaN if a rank has NaN."""
    per_step: dict[int, list[float]] = {}
    for s in queries.read_points(conn, [sid], None, None, None):
        for step, value in zip(s.steps.tolist(), s.values.tolist(), strict=True):
            per_step.setdefault(step, []).append(value)
    return {step: float(np.mean(v)) for step, v in per_step.items()}


@pytest.mark.parametrize("max_points", [2048, 64], ids=["per-step", "grouped"])
def test_mean_curve_is_the_raw_mean_over_ranks_with_extremes_kept(
    engine: Engine, worker: RollupWorker, max_points: int
) -> None:
    ids = _write(engine, worker)
    with engine.connect() as conn:
        raw = _raw_means(conn, ids["loss"])
        steps, values = step_rollups.across_ranks(conn, [ids["loss"]], None, None, max_points).mean_curve()
    assert len(steps) <= max_points and np.all(np.diff(steps) > 0)
    if max_points >= STEPS:  # one point per step: exactly the raw mean (NaN at step 900)
        assert steps.tolist() == sorted(raw)
        assert np.allclose(values, [raw[s] for s in steps.tolist()], equal_nan=True)
        return
    per = -(-STEPS // (max_points // 2))
    for g, (low, high) in enumerate(values.reshape(-1, 2).tolist()):
        means = np.array([raw[s] for s in range(g * per, (g + 1) * per)])
        if np.isnan(means).any():
            assert np.isnan(high)  # the NaN survives as the group's maximum
            means = means[~np.isnan(means)]
        else:
            assert high == pytest.approx(means.max())
        assert low == pytest.approx(means.min())
    assert pytest.approx((2.0 + 2.0 + 90.0) / 3, abs=0.05) in values.tolist()  # one rank's one-step spike
    assert pytest.approx((2.0 + 102.0 + 2.0) / 3, abs=0.05) in values.tolist()  # incarnation 2 from 630


def test_groups_read_a_seek_a_group_equal_the_group_by_bit_for_bit(
    engine: Engine, worker: RollupWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups read a seek a group (on SQLite sent back as text) hold the same figures, bit for bit, as
    the one GROUP BY gives, for values of every magnitude (subnormals, up
    to 1e307), a NaN, a gap, a restart and ranges that start and end inside a group; and the peaks read
    alone (the amax's) are the same peaks and non-finite counts."""
    ids = _write(engine, worker)
    rng = np.random.default_rng(7)
    steps = np.array([s for s in range(STEPS) if not 200 <= s < 420])  # a gap of whole groups
    with engine.begin() as conn:
        run_id = conn.execute(select(Series.run_id).where(Series.id == ids["loss"])).scalar_one()
        wild = conn.execute(
            insert(Series).values(run_id=run_id, stat="", name="wild").returning(Series.id)
        ).scalar_one()
        values = rng.standard_normal((RANKS, steps.size)) * 10.0 ** rng.integers(
            -310, 307, (RANKS, steps.size)
        )
        values[1, 280] = float("nan")  # step 500, in every range below
        values[2, 60] = 5e-324
        insert_points(
            conn,
            [
                (wild, r, int(s), 1, float(v))
                for r in range(RANKS)
                for s, v in zip(steps, values[r], strict=True)
            ],
        )
    worker.submit(run_id, 0, STEPS - 1)
    assert worker.wait_idle(CATCH_UP_S)
    every = [*ids.values(), wild]
    with engine.connect() as conn:
        for first, last, max_points in ((None, None, 64), (None, None, 16), (37, 999, 20), (100, 1023, 8)):
            found = []
            for rows_a_group in (1, 2**40):  # every range by seeks, then every one by the GROUP BY
                with monkeypatch.context() as m:
                    m.setattr(
                        step_rollups, "_SEEK_ROWS", dict.fromkeys(("sqlite", "postgresql"), rows_a_group)
                    )
                    groups = step_rollups.across_ranks(conn, every, first, last, max_points)
                    peaks = step_rollups.across_ranks(conn, every, first, last, max_points, means=False)
                    for field in ("series_id", "group", "peak", "nonfinite"):  # the restart's group as it is
                        assert getattr(peaks, field).tobytes() == getattr(groups, field).tobytes(), field
                    assert np.isnan(peaks.low_mean).all() and np.isnan(peaks.high_mean).all()
                    end = STEPS - 1 if last is None else last
                    params = {"ids": every, "first": groups.first, "last": end, "per": groups.per}
                    assert step_rollups._by_seeks(conn, params) == (rows_a_group == 1)
                    found.append(
                        (groups, sorted(step_rollups._grouped_rows(conn, params), key=lambda r: r[:2]))
                    )
            (seeks, rows), (grouped, by_group) = found
            assert (seeks.first, seeks.per) == (grouped.first, grouped.per)
            assert len(rows) == len(by_group) > 0
            for a, b in zip(rows, by_group, strict=True):
                assert a[:2] == b[:2] and a[5:] == b[5:]  # series, group, non-finite count, incarnations
                assert (
                    np.array(a[2:5], dtype=np.float64).tobytes()
                    == np.array(b[2:5], dtype=np.float64).tobytes()
                )
            for field in ("series_id", "group", "low_mean", "high_mean", "peak", "nonfinite"):
                assert getattr(seeks, field).tobytes() == getattr(grouped, field).tobytes(), field
            assert seeks.of(wild).nonfinite.sum() == 1  # the NaN
            assert np.nanmax(np.abs(seeks.of(wild).peak)) > 1e300  # magnitudes near the top kept


def test_groups_are_read_by_seeks_only_where_they_hold_enough_rows(
    engine: Engine, worker: RollupWorker
) -> None:
    """A seek a group pays where a group holds _SEEK_ROWS rows or more on average: a series with a row a
    step in groups of that many steps, not in smaller ones; a module's amax (a row every 10th step) not in
    groups of five times that many steps, in one group of the whole run."""
    ids = _write(engine, worker)
    with engine.connect() as conn:
        need = step_rollups._SEEK_ROWS[conn.dialect.name]

        def by_seeks(sid: int, per: int) -> bool:
            return step_rollups._by_seeks(conn, {"ids": [sid], "first": 0, "last": STEPS - 1, "per": per})

        assert by_seeks(ids["loss"], need) and not by_seeks(ids["loss"], need - 1)
        assert not by_seeks(ids["fc1"], 5 * need) and by_seeks(ids["fc1"], STEPS)
        assert by_seeks(ids["loss"], 5 * need)  # the same groups, a row a step


def test_amax_curve_is_the_max_over_ranks(engine: Engine, worker: RollupWorker) -> None:
    ids = _write(engine, worker)
    with engine.connect() as conn:
        groups = step_rollups.across_ranks(conn, list(ids.values()), 0, 499, 40)
    steps, values = groups.of(ids["fc1"]).peak_curve()
    assert groups.per == 25 and steps.tolist() == list(range(0, 500, 25))
    assert values.tolist() == [12.0] * 20  # rank 2's 12.0, every 10th step
    steps, values = groups.of(ids["loss"]).peak_curve()
    assert values.max() == 90.0 and steps[values.argmax()] == 325


def _assert_heatmap_equals_raw(conn: Connection, sid: int, mode: str, columns: int) -> None:
    """`columns` of 1024 steps: 16 -> level 0 (64-step columns), 8 -> level 1, ... 1 -> level 4."""
    raw = heatmap(queries.read_points(conn, [sid], None, None, None), columns, mode)
    rolled = heatmap_from_rollups(conn, sid, 0, STEPS - 1, columns, mode)
    assert raw["bucket_steps"] == rolled["bucket_steps"] == STEPS // columns
    assert np.array_equal(raw["steps"], rolled["steps"]) and np.array_equal(raw["ranks"], rolled["ranks"])
    matrix = np.array(rolled["values"], dtype=np.float64)  # None (an empty cell) -> nan
    assert np.allclose(matrix, np.array(raw["values"], dtype=np.float64), atol=2e-4, equal_nan=True)
    assert np.allclose(np.array(rolled["median"], float), np.array(raw["median"], float), equal_nan=True)
    assert matrix[1][-1] > 10  # rank 1's incarnation 2 (102.0 against ~2.0 from step 630) in a mixed cell


@pytest.mark.parametrize("mode", ["median", "absolute"])
@pytest.mark.parametrize("columns", [16, 8, 4, 2, 1])
def test_heatmap_from_rollups_equals_the_raw_heatmap(
    engine: Engine, worker: RollupWorker, mode: str, columns: int
) -> None:
    """Columns of each level's buckets (64 to 1024 steps), the restart's mixed cells included."""
    ids = _write(engine, worker)
    with engine.connect() as conn:
        _assert_heatmap_equals_raw(conn, ids["loss"], mode, columns)


def test_a_long_run_heatmap_reads_one_row_per_cell_of_a_coarse_level(
    engine: Engine, worker: RollupWorker
) -> None:
    """2 ranks, a value every 1000th step up to step 999,000: 240 columns come from level 7 (4,096-step
    buckets would be 244 columns, 8,192-step ones are 122), and past the coarsest
    level (262,144 steps) two buckets are summed per column. Only whole buckets are stored at
    levels above 0 (the last step, 999,000, ends none of them)."""
    now = dt.datetime.now(dt.UTC)
    with engine.begin() as conn:
        run_id = conn.execute(
            insert(Run).values(name="long", world_size=2, created_at=now, last_seen_at=now).returning(Run.id)
        ).scalar_one()
        sid = conn.execute(
            insert(Series).values(run_id=run_id, stat="", name="time.forward_ms").returning(Series.id)
        ).scalar_one()
        steps = np.arange(0, 1_000_000, 1000)
        rows = [(sid, rank, int(s), 1, float(s % 7000 + rank)) for rank in (0, 1) for s in steps]
        insert_points(conn, rows)
    worker.submit(run_id, 0, int(steps[-1]))
    assert worker.wait_idle(CATCH_UP_S)
    with engine.connect() as conn:
        for columns, level, steps_per_column in ((240, 7, 8192), (4, 12, 262_144), (2, 12, 524_288)):
            assert rank_rollups.column_level(0, 999_000, columns) == level
            cells, start, width = rank_rollups.read_columns(conn, sid, 0, 999_000, columns)
            assert (start, width) == (0, steps_per_column)
            expected = _raw_buckets(conn, sid, False, width)
            assert _rolled(cells).keys() == expected.keys()
            for key, (n, total, lo, hi, bad) in _rolled(cells).items():
                assert (n, bad, lo, hi) == (
                    expected[key][0],
                    expected[key][4],
                    expected[key][2],
                    expected[key][3],
                )
                assert total == pytest.approx(expected[key][1])
        top = rank_packs.read(conn, [sid], 12, 0, None)[2]
        assert sorted(set(top.tolist())) == [
            0,
            1,
            2,
        ]  # steps 0..786,431 whole; bucket 3 (786,432..) ends past 999,000


def _loss_run(engine: Engine, name: str, world_size: int) -> tuple[int, int]:
    """A run with one series, `loss`: (run id, series id)."""
    now = dt.datetime.now(dt.UTC)
    with engine.begin() as conn:
        run_id = conn.execute(
            insert(Run)
            .values(name=name, world_size=world_size, created_at=now, last_seen_at=now)
            .returning(Run.id)
        ).scalar_one()
        sid = conn.execute(
            insert(Series).values(run_id=run_id, stat="", name="loss").returning(Series.id)
        ).scalar_one()
    return int(run_id), int(sid)


def test_steps_beyond_float_precision_are_read_exactly(engine: Engine, worker: RollupWorker) -> None:
    """Steps near 2**60 (a token counter as the step): ten neighbouring steps stay ten steps in the raw
    read, the per-step rollups and the rank rollups (float64 would merge them into one or two)."""
    base = 2**60
    run_id, sid = _loss_run(engine, "big-steps", 2)
    with engine.begin() as conn:
        insert_points(conn, [(sid, rank, base + i, 1, float(i + rank)) for rank in (0, 1) for i in range(10)])
    worker.submit(run_id, base, base + 9)
    assert worker.wait_idle(CATCH_UP_S)
    with engine.connect() as conn:
        raw = queries.read_points(conn, [sid], None, None, None)
        assert [s.steps.tolist() for s in raw] == [[base + i for i in range(10)]] * 2
        per_step = step_rollups.read_steps(conn, [sid], None, None)
        assert per_step.bucket.tolist() == [base + i for i in range(10)]
        assert per_step.total.tolist() == [2 * i + 1.0 for i in range(10)]
        assert rollups.rolled_to(conn, [sid]) == base + 9
        _assert_rollups_equal_raw(conn, {"loss": sid}, False)


def test_a_round_reads_each_step_once_and_a_bucket_once_it_is_whole(engine: Engine) -> None:
    """Rounds over a filling bucket: each round writes the step rollups of its new steps only (a step
    rolled up before is not read again: its row, altered here, stays as it was) and no level-0 rank
    rollup until the bucket is whole up to the watermark; a late value for a step rolled up before
    has that step and its bucket rolled up again, and every read equals the raw aggregation."""
    run_id, sid = _loss_run(engine, "filling", 3)

    def write_and_roll(first: int, last: int, ranks: tuple[int, ...] = (0, 1)) -> None:
        with engine.begin() as conn:
            insert_points(conn, [(sid, r, s, 1, float(s + r)) for s in range(first, last + 1) for r in ranks])
        with write_transaction(engine) as conn:
            assert rollups.roll_up(conn, run_id, first, last) == last

    def level0() -> dict[int, tuple[int, float]]:
        with engine.connect() as conn:
            cols = rank_packs.read(conn, [sid], 0, 0, None)
            out: dict[int, tuple[int, float]] = {}
            for bucket, n, total in zip(cols[2].tolist(), cols[4].tolist(), cols[5].tolist(), strict=True):
                before = out.get(bucket, (0, 0.0))
                out[bucket] = (before[0] + n, before[1] + total)
            return out

    def step_total(step: int) -> float:
        with engine.connect() as conn:
            return float(
                conn.execute(
                    select(StepRollup.total).where(StepRollup.series_id == sid, StepRollup.step == step)
                ).scalar_one()
            )

    write_and_roll(0, 9)
    assert level0() == {}  # bucket 0 (steps 0..63) is not whole: reads take it from the raw points
    assert step_total(5) == 5.0 + 6.0
    with engine.begin() as conn:  # altered: a round that read step 5 again would write it back
        conn.execute(text("UPDATE step_rollups SET total = -1 WHERE series_id = :s AND step = 5"), {"s": sid})
    write_and_roll(10, 70)
    assert step_total(5) == -1.0 and step_total(70) == 70.0 + 71.0
    assert level0() == {0: (128, float(sum(2 * s + 1 for s in range(64))))}  # whole now; bucket 1 is not
    write_and_roll(5, 5, ranks=(2,))  # a late value (rank 2's only) for a step and a bucket rolled up
    assert step_total(5) == 5.0 + 6.0 + 7.0
    assert level0() == {0: (129, float(sum(2 * s + 1 for s in range(64)) + 7.0))}
    with engine.connect() as conn:
        for all_ranks in (False, True):
            _assert_rollups_equal_raw(conn, {"loss": sid}, all_ranks)


def test_rollups_equal_the_raw_aggregation_whatever_order_batches_arrive_in(engine: Engine) -> None:
    """Batches of 1..40 steps per rank, in roughly step order with some a few hundred steps late, a
    restart (incarnation 2 sending rank 1's steps 300..420 again), NaN and infinities among the values,
    handed over five at a time as the worker takes them (a round cut short by `max_values` leaves the
    rest dirty, at times for the next hand-over): whenever all that was handed over is rolled up, every
    level of the rank rollups and the step rollups read equal the raw aggregation."""
    run_id, sid = _loss_run(engine, "shuffled", 3)
    rng = np.random.default_rng(7)
    batches: list[tuple[int, int, int, int]] = []  # (rank, first step, last step, incarnation)
    for rank in range(3):
        step = 0
        while step < 600:
            size = int(rng.integers(1, 41))
            batches.append((rank, step, min(step + size, 600) - 1, 1))
            step += size
    batches.append((1, 300, 420, 2))
    arrival = [b[1] + (float(rng.normal(0, 20)) if rng.random() > 0.1 else 300.0) for b in batches]
    dirty: tuple[int, int] | None = None
    checked = 0
    for i, k in enumerate(np.argsort(arrival).tolist()):
        rank, first, last, inc = batches[k]
        values = rng.normal(2.0, 0.5, last - first + 1)
        values[rng.random(values.shape[0]) < 0.02] = np.nan
        values[rng.random(values.shape[0]) < 0.01] = np.inf
        with engine.begin() as conn:
            insert_points(conn, [(sid, rank, first + j, inc, float(v)) for j, v in enumerate(values)])
        dirty = (first, last) if dirty is None else (min(dirty[0], first), max(dirty[1], last))
        if i % 5 == 4 or i == len(batches) - 1:
            while dirty is not None:
                max_values = int(rng.choice([rollups.NO_LIMIT, 3 * 64 * 2]))  # 2 buckets of 3 ranks
                with write_transaction(engine) as conn:
                    done = rollups.roll_up(conn, run_id, *dirty, max_values=max_values)
                dirty = (done + 1, dirty[1]) if done < dirty[1] else None
                if rng.random() < 0.5:
                    break  # the rest waits for the next round
            if dirty is not None:
                continue  # a late batch's steps below the watermark show after the round that takes them
            with engine.connect() as conn:
                _assert_rollups_equal_raw(conn, {"loss": sid}, True)
                for level in range(4):
                    _assert_rollups_equal_raw(conn, {"loss": sid}, False, level)
            checked += 1
    with engine.connect() as conn:
        assert rollups.rolled_to(conn, [sid]) == 599
    assert checked >= 5, checked
    # Each round took the level below from what it had just written (and read only the buckets outside it):
    # the packs are those that reading every level back from the table gives, byte for byte.
    p = RankRollupPack
    packs = select(p.series_id, p.level, p.bucket, p.incarnation, p.part, p.ranks, p.data)
    packs = packs.order_by(p.series_id, p.level, p.bucket, p.incarnation, p.part)
    with engine.connect() as conn:
        written = [(*row[:-1], bytes(row[-1])) for row in conn.execute(packs).all()]
    with write_transaction(engine) as conn:
        rollups._roll_levels(conn, [sid], 0, 599, 599)  # every level 1.. from the table's level below
        again = [(*row[:-1], bytes(row[-1])) for row in conn.execute(packs).all()]
    assert again == written and len({row[1] for row in written}) >= 3


@pytest.mark.parametrize("hand_over_below", [0, 500], ids=["nothing-rolled-up", "rolled-up-to-499"])
def test_reads_are_complete_before_the_worker_caught_up(
    engine: Engine, worker: RollupWorker, hand_over_below: int
) -> None:
    """The worker got only the batches below `hand_over_below`: every view adds the raw points
    above its watermark (mid-bucket at 499) and equals the raw aggregation all the same."""
    ids = _write(engine, worker, hand_over_below=hand_over_below)
    with engine.connect() as conn:
        assert rollups.rolled_to(conn, list(ids.values())) == hand_over_below - 1
        _assert_rollups_equal_raw(conn, ids, False)
        _assert_rollups_equal_raw(conn, ids, True)
        raw = _raw_means(conn, ids["loss"])
        steps, values = step_rollups.across_ranks(conn, [ids["loss"]], None, None, 2048).mean_curve()
        assert steps.tolist() == sorted(raw)
        assert np.allclose(values, [raw[s] for s in steps.tolist()], equal_nan=True)
        steps, values = step_rollups.across_ranks(conn, [ids["loss"]], None, None, 64).mean_curve()
        assert pytest.approx((2.0 + 102.0 + 2.0) / 3, abs=0.05) in values.tolist()  # the raw tail's restart
        for columns in (16, 2):  # level 4's bucket reaches past the watermark: summed from the levels below
            _assert_heatmap_equals_raw(conn, ids["loss"], "median", columns)
        for level in range(1, 5):
            _assert_rollups_equal_raw(conn, ids, False, level)
        assert step_rollups.step_range(conn, [ids["loss"]], None, None) == (
            0,
            STEPS - 1,
            3 * STEPS - 324 + 394,
        )


@pytest.mark.parametrize("probe_rows", [5, 4096])
def test_a_bounded_count_is_exact_up_to_its_bound_and_larger_above_it(
    engine: Engine, worker: RollupWorker, probe_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`step_range(count_up_to=k)` (what the views ask before choosing the raw points or the rollups): the
    same first and last step as the full count, the number of values exact when it is at most k and only
    above k otherwise, whether the first rows read (`_PROBE_ROWS`) settle it or not; over the rows, the
    raw tail above the watermark and both series at once."""
    monkeypatch.setattr(step_rollups, "_PROBE_ROWS", probe_rows)
    ids = _write(engine, worker, hand_over_below=500)
    with engine.connect() as conn:
        for chosen in ([ids["loss"]], [ids["fc1"]], list(ids.values())):
            first, last, total = step_rollups.step_range(conn, chosen, None, None) or (0, 0, 0)
            assert total > 100
            for bound in (0, 1, 10, total // 2, total - 1, total, total + 1, 10 * total):
                found = step_rollups.step_range(conn, chosen, None, None, count_up_to=bound)
                assert found is not None and found[:2] == (first, last), (chosen, bound)
                assert found[2] == total if total <= bound else found[2] > bound, (chosen, bound, found)
            narrow = step_rollups.step_range(conn, chosen, 100, 199, count_up_to=0)
            assert narrow is not None and narrow[:2] == step_rollups.step_range(conn, chosen, 100, 199)[:2]


def test_the_worker_rolls_up_what_is_left_when_it_stops(engine: Engine) -> None:
    """In slices: 6 values per step (2 series x 3 ranks), at most 768 per transaction = 2 buckets."""
    ids = _write(engine, None)
    worker = RollupWorker(engine, max_values_per_round=6 * 2 * rollups.BUCKET_STEPS)
    with engine.connect() as conn:
        run_id = conn.execute(select(Series.run_id).where(Series.id == ids["loss"])).scalar_one()
    worker.submit(run_id, 0, STEPS - 1)  # handed over before the thread runs its first round
    worker.start()
    worker.stop()
    assert not worker.running and worker.stats()["dirty_runs"] == 0
    assert worker.stats()["rolled_ranges"] == STEPS // (2 * rollups.BUCKET_STEPS)
    with engine.connect() as conn:
        assert rollups.rolled_to(conn, list(ids.values())) == STEPS - 1
        _assert_rollups_equal_raw(conn, ids, False)
        _assert_rollups_equal_raw(conn, ids, True)


def test_a_round_is_written_in_transactions_of_at_most_so_many_values(engine: Engine) -> None:
    """A bucket of a wide run (20,000 names: 1.28M values) held SQLite's write lock 3-4 s in one
    transaction, starving ingest; a round's series now go in groups of about `max_values_per_transaction`
    values, each its own transaction, the watermark raised with the last."""
    ids = _write(engine, None)
    per_series = STEPS * RANKS  # one round holds the whole range here
    worker = RollupWorker(engine, max_values_per_transaction=per_series)  # one series a transaction
    with engine.connect() as conn:
        run_id = conn.execute(select(Series.run_id).where(Series.id == ids["loss"])).scalar_one()
    rolled: list[int] = [0]  # rollup INSERTs per transaction, the open one last

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT INTO STEP_ROLLUPS"):
            rolled[-1] += 1

    def committed(conn: Any) -> None:
        rolled.append(0)

    event.listen(engine, "before_cursor_execute", count)
    event.listen(engine, "commit", committed)
    try:
        worker.submit(run_id, 0, STEPS - 1)
        worker.start()
        worker.stop()
    finally:
        event.remove(engine, "before_cursor_execute", count)
        event.remove(engine, "commit", committed)
    assert [n for n in rolled if n] == [1] * len(ids), rolled  # one transaction per series
    with engine.connect() as conn:
        assert rollups.rolled_to(conn, list(ids.values())) == STEPS - 1
        _assert_rollups_equal_raw(conn, ids, False)
        _assert_rollups_equal_raw(conn, ids, True)


def test_the_migration_rolls_up_the_values_already_stored(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        upgrade(engine, "0002")  # before the rollups: values stored without them
        ids = _write(
            engine,
            None,
            lambda conn, rows: conn.execute(
                insert(Point), [dict(zip(POINT_COLUMNS, r, strict=True)) for r in rows]
            ),
        )
        upgrade(engine)  # 0004 rolls them up at 64 steps, 0005 sums the coarser levels from those
        with engine.connect() as conn:
            for level in range(5):
                _assert_rollups_equal_raw(conn, ids, False, level)
            _assert_rollups_equal_raw(conn, ids, True)
    finally:
        engine.dispose()


def test_the_migration_gives_each_rank_its_highest_stored_step(database_url: str) -> None:
    """0015 sets `ranks.stored_to` from the values above the run's rollup watermark (the watermark where a
    rank has none there, NULL where a run without one has no values of the rank)."""
    engine = make_engine(database_url)
    try:
        upgrade(engine, "0014")
        now = dt.datetime.now(dt.UTC)
        tops = {}
        with engine.begin() as conn:
            for name, mark, last in (
                ("marked", 59, {0: 99, 1: 49, 2: None}),
                ("unmarked", None, {0: 9, 1: None}),
            ):
                run_id = conn.execute(
                    insert(Run)
                    .values(name=name, world_size=3, created_at=now, last_seen_at=now)
                    .returning(Run.id)
                ).scalar_one()
                sids = [
                    conn.execute(
                        insert(Series).values(run_id=run_id, stat="", name=metric).returning(Series.id)
                    ).scalar_one()
                    for metric in ("loss", "lr")
                ]
                for rank, top in last.items():
                    conn.execute(
                        text(
                            "INSERT INTO ranks (run_id, rank, world_size, replica_group, shard, num_shards, "
                            "incarnation, last_seen_at) VALUES (:run, :rank, 3, :rank, 0, 1, 1, :now)"
                        ),
                        {"run": run_id, "rank": rank, "now": now},
                    )
                    if top is not None:  # loss to `top`, lr to 10 steps less
                        rows = [(sids[0], rank, s, 1, 1.0) for s in range(top + 1)]
                        insert_points(conn, rows + [(sids[1], rank, s, 1, 1.0) for s in range(top - 9)])
                if mark is not None:
                    conn.execute(
                        text("INSERT INTO rollup_marks (run_id, rolled_to) VALUES (:r, :m)"),
                        {"r": run_id, "m": mark},
                    )
                tops[name] = run_id
        upgrade(engine)
        with engine.connect() as conn:
            got = conn.execute(text("SELECT run_id, rank, stored_to FROM ranks ORDER BY run_id, rank")).all()
        assert got == [
            (tops["marked"], 0, 99),
            (tops["marked"], 1, 59),
            (tops["marked"], 2, 59),
            (tops["unmarked"], 0, 9),
            (tops["unmarked"], 1, None),
        ]
    finally:
        engine.dispose()


def test_the_collector_rolls_up_what_ingest_stored(database_url: str) -> None:
    """Through HTTP: ingest hands each committed batch's steps to the collector's own worker, which
    rolls them up (two ranks' batches of the same steps: each step's rollup holds both), and keeps each
    rank's highest stored step, which tells reads whether raw values lie above the watermark."""
    collector = Collector(database_url)
    engine = make_engine(database_url)
    try:
        session = [uuid.uuid4().hex, uuid.uuid4().hex]
        for rank, value in ((0, 1.0), (1, 3.0)):
            batch = steps_batch("http", session[rank], 0, [0, 1, 2], rank, 2, loss=[value] * 3)
            assert collector.post(orjson.dumps(batch)).status_code == 200
        deadline = time.monotonic() + CATCH_UP_S
        with engine.connect() as conn:
            sid = conn.execute(select(Series.id).where(Series.name == "loss")).scalar_one()
        while time.monotonic() < deadline:  # the rows, then the watermark raised after them (its own write)
            with engine.connect() as conn:
                got = conn.execute(select(StepRollup.step, StepRollup.n, StepRollup.total)).all()
                mark = rollups.rolled_to(conn, [sid])
            if len(got) == 3 and all(n == 2 for _, n, _ in got) and mark == 2:
                break
            time.sleep(0.05)
        assert sorted(got) == [(0, 2, 4.0), (1, 2, 4.0), (2, 2, 4.0)]
        assert mark == 2
        # Each rank's highest stored step, kept by ingest: nothing above the watermark, so reads above it ask
        # no raw values; below it they would, and where a rank's is not known they do.
        with engine.begin() as conn:
            assert conn.execute(text("SELECT rank, stored_to FROM ranks ORDER BY rank")).all() == [
                (0, 2),
                (1, 2),
            ]
            assert not rollups.stored_above(conn, [sid], 2) and rollups.stored_above(conn, [sid], 1)
            assert step_rollups.step_range(conn, [sid], None, None) == (0, 2, 6)
            conn.execute(text("UPDATE ranks SET stored_to = NULL WHERE rank = 1"))
            assert rollups.stored_above(conn, [sid], 2)
            conn.execute(
                text("DELETE FROM ranks WHERE rank = 1")
            )  # a rank without a row: values written by hand
            assert rollups.stored_above(conn, [sid], 2)
    finally:
        engine.dispose()
        collector.close()
