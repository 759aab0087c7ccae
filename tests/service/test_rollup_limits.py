"""The rollup worker at the drivers' limits and on input that breaks it, on both backends: a round over
more series than one statement may bind (psycopg: 65,535 parameters; SQLite: 32,766 on some builds)
completes, and a range whose roll-up keeps failing (here: a trigger that refuses its rows, a real
database error) is retried with backoff, then skipped and reported, while the worker goes on rolling
up the run's newer steps and other runs."""

from __future__ import annotations

import datetime as dt
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event, func, insert, select, text

from stepwatch_server.ingest.store import insert_points
from stepwatch_server.metrics.collector import REGISTRY
from stepwatch_server.runs import queries, rank_rollups, rollup_worker, rollups, step_rollups
from stepwatch_server.runs.rollup_worker import RollupWorker
from stepwatch_server.storage import make_engine, upgrade, write_transaction
from stepwatch_server.storage.models import Point, RankRollupPack, Run, Series, StepRollup

OLD_SQLITE_VARIABLES = 32_766  # SQLITE_MAX_VARIABLE_NUMBER of some builds (250,000 on modern ones)
SERIES = 70_000  # more than psycopg's 65,535 parameters per statement, more than OLD_SQLITE_VARIABLES
CATCH_UP_S = 60.0


def _old_sqlite_limit(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, OLD_SQLITE_VARIABLES)


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """A migrated database; SQLite connections get the lower variable limit of older builds."""
    engine = make_engine(database_url)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _old_sqlite_limit)
    upgrade(engine)
    yield engine
    engine.dispose()


def _run(engine: Engine, name: str, series: int, world_size: int) -> tuple[int, list[int]]:
    """A run with `series` metrics (bulk-inserted): (run id, series ids in id order)."""
    now = dt.datetime.now(dt.UTC)
    with engine.begin() as conn:
        run_id = conn.execute(
            insert(Run)
            .values(name=name, world_size=world_size, created_at=now, last_seen_at=now)
            .returning(Run.id)
        ).scalar_one()
        conn.execute(insert(Series), [{"run_id": run_id, "stat": "", "name": f"m{i}"} for i in range(series)])
        ids = conn.execute(select(Series.id).where(Series.run_id == run_id).order_by(Series.id)).scalars()
        return run_id, list(ids)


def test_a_round_over_more_series_than_one_statement_may_bind_completes(engine: Engine) -> None:
    run_id, ids = _run(engine, "wide", SERIES, world_size=2)
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":  # the limit is in force on the pool's connections
            limit = conn.connection.driver_connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
            assert limit == OLD_SQLITE_VARIABLES
        insert_points(conn, [(sid, rank, 0, 1, float(rank + 1)) for sid in ids for rank in (0, 1)])
    with write_transaction(engine) as conn:  # a whole bucket (steps 0..63): its level 0 is written too
        assert rollups.roll_up(conn, run_id, 0, rollups.BUCKET_STEPS - 1) == rollups.BUCKET_STEPS - 1
    with engine.connect() as conn:
        assert rollups.rolled_to(conn, ids) == rollups.BUCKET_STEPS - 1
        step_rows = conn.execute(select(func.count(), func.sum(StepRollup.total), func.min(StepRollup.n)))
        assert tuple(step_rows.one()) == (SERIES, 3.0 * SERIES, 2)
        packs = conn.execute(
            select(func.count(), func.sum(RankRollupPack.ranks)).where(RankRollupPack.level == 0)
        )
        assert tuple(packs.one()) == (SERIES, 2 * SERIES)  # a pack per series, holding both ranks
        # the reads of every series at once (as the amax view reads every module's)
        read = queries.read_points(conn, ids, None, 0, 0, ranks=[0, 1])
        assert len(read) == 2 * SERIES and {s.series_id for s in read} == set(ids)
        assert step_rollups.step_range(conn, ids, None, None) == (0, 0, 2 * SERIES)
        per_step = step_rollups.read_steps(conn, ids, None, None)
        assert per_step.series_id.tolist() == ids and set(per_step.total.tolist()) == {3.0}
        groups = step_rollups.across_ranks(conn, ids, None, None, 100)
        assert groups.series_id.tolist() == ids and set(groups.peak.tolist()) == {2.0}
        cells = rank_rollups.read(conn, ids, None, None)
        assert cells.n.size == 2 * SERIES and set(cells.hi.tolist()) == {1.0, 2.0}


def _poison(engine: Engine, sid: int, first: int, last: int) -> None:
    """A trigger that refuses the step rollups of series `sid`'s steps first..last: a roll-up of a range
    holding them fails in the database, every time."""
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            conn.execute(
                text(
                    f"CREATE TRIGGER poison BEFORE INSERT ON step_rollups WHEN NEW.series_id = {sid} "
                    f"AND NEW.step BETWEEN {first} AND {last} BEGIN SELECT RAISE(ABORT, 'poisoned step'); END"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE FUNCTION poison() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    f"IF NEW.series_id = {sid} AND NEW.step BETWEEN {first} AND {last} THEN "
                    "RAISE EXCEPTION 'poisoned step %', NEW.step; END IF; RETURN NEW; END $$"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER poison BEFORE INSERT ON step_rollups FOR EACH ROW EXECUTE FUNCTION poison()"
                )
            )


def _points(engine: Engine, sid: int, first: int, last: int) -> None:
    with engine.begin() as conn:
        insert_points(
            conn, [(sid, rank, s, 1, 1.0 + rank) for s in range(first, last + 1) for rank in (0, 1)]
        )


def _mark(engine: Engine, sid: int) -> int:
    with engine.connect() as conn:
        return rollups.rolled_to(conn, [sid])


def _skipped() -> float:
    return REGISTRY.get_sample_value("stepwatch_rollup_skipped_ranges_total") or 0.0


def test_a_range_that_keeps_failing_is_retried_with_backoff_then_skipped_and_reported(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Steps 0..255 of a 2-rank run, steps 64..127 refused by the database: buckets 0, 2 and 3 are
    rolled up, bucket 1 fails rollup_worker.MAX_ROUND_FAILURES times with a doubling pause between tries (not every
    round), is then skipped (logged once with the error and its extent, counted on /metrics), and the
    steps sent after it, and another run meanwhile, are rolled up."""
    run_id, (sid,) = _run(engine, "poisoned", 1, world_size=2)
    other_run, (other_sid,) = _run(engine, "healthy", 1, world_size=2)
    _points(engine, sid, 0, 255)
    _poison(engine, sid, 64, 127)
    retry_first_s = 0.2
    worker = RollupWorker(engine, retry_first_s=retry_first_s).start()
    skipped_before = _skipped()
    try:
        with caplog.at_level(logging.WARNING, logger="stepwatch_server"):
            started = time.monotonic()
            worker.submit(run_id, 0, 255)
            deadline = started + CATCH_UP_S
            while worker.stats()["errors"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert worker.stats()["errors"] >= 1 and worker.stats()["skipped_ranges"] == 0
            _points(engine, other_sid, 0, 99)  # another run while the first one backs off
            worker.submit(other_run, 0, 99)
            while _mark(engine, other_sid) < 99 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _mark(engine, other_sid) == 99 and worker.stats()["skipped_ranges"] == 0
            while worker.stats()["skipped_ranges"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            gave_up_after_s = time.monotonic() - started
            assert worker.wait_idle(CATCH_UP_S)
        stats = worker.stats()
        # the whole range failed once, then bucket 1 alone rollup_worker.MAX_ROUND_FAILURES times: not once a round
        assert stats["skipped_ranges"] == 1 and stats["errors"] == 1 + rollup_worker.MAX_ROUND_FAILURES
        assert stats["backing_off_runs"] == 0 and stats["dirty_runs"] == 0
        backoff_s = sum(retry_first_s * 2**i for i in range(rollup_worker.MAX_ROUND_FAILURES - 1))
        assert gave_up_after_s >= backoff_s
        assert _skipped() == skipped_before + 1
        reports = [r.getMessage() for r in caplog.records if "gave up" in r.getMessage()]
        assert len(reports) == 1, reports
        assert "'poisoned'" in reports[0] and "steps 64..127" in reports[0] and "poisoned step" in reports[0]
        with engine.connect() as conn:
            assert _mark(engine, sid) == 255
            rolled = set(conn.execute(select(StepRollup.step).where(StepRollup.series_id == sid)).scalars())
            assert rolled == set(range(256)) - set(range(64, 128))  # the skipped range is a gap ...
            raw = conn.execute(
                select(func.count()).where(Point.series_id == sid, Point.step.between(64, 127))
            )
            assert raw.scalar_one() == 128  # ... over raw points that are kept
        _points(engine, sid, 256, 319)  # newer steps of the same run
        worker.submit(run_id, 256, 319)
        assert worker.wait_idle(CATCH_UP_S)
        assert _mark(engine, sid) == 319 and worker.stats()["errors"] == 1 + rollup_worker.MAX_ROUND_FAILURES
        with engine.connect() as conn:
            newer = conn.execute(
                select(func.count()).where(StepRollup.series_id == sid, StepRollup.step >= 256)
            )
            assert newer.scalar_one() == 64
    finally:
        worker.stop()


def test_stop_does_not_spend_its_deadline_retrying_a_failing_range(engine: Engine) -> None:
    """A run waiting out its backoff is left dirty at stop (its raw points are read above the watermark)
    instead of being retried hot until the stop deadline."""
    run_id, (sid,) = _run(engine, "poisoned", 1, world_size=2)
    _points(engine, sid, 0, 63)
    _poison(engine, sid, 0, 63)
    worker = RollupWorker(engine).start()
    worker.submit(run_id, 0, 63)
    deadline = time.monotonic() + CATCH_UP_S
    while worker.stats()["errors"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    worker.stop(deadline_s=5.0)
    assert time.monotonic() - started < 2.0 and not worker.running
    assert worker.stats()["errors"] == 1 and worker.stats()["dirty_runs"] == 1


def _hold_the_write_lock(database_url: str) -> Callable[[], None]:
    """Another writer that holds the database: SQLite's write lock (BEGIN IMMEDIATE on a connection of its
    own), or PostgreSQL's EXCLUSIVE lock on `step_rollups` (reads go on, writes wait). The release."""
    holder = make_engine(database_url)
    if holder.dialect.name == "sqlite":
        raw = sqlite3.connect(str(holder.url.database), isolation_level=None)
        raw.execute("BEGIN IMMEDIATE")
        holder.dispose()

        def release_sqlite() -> None:
            raw.rollback()
            raw.close()

        return release_sqlite
    conn = holder.connect()
    conn.begin()
    conn.execute(text("LOCK TABLE step_rollups IN EXCLUSIVE MODE"))

    def release() -> None:
        conn.rollback()
        conn.close()
        holder.dispose()

    return release


def _short_lock_waits(dbapi_connection: Any, _record: Any) -> None:
    """The worker gives up waiting for a lock after 50 ms (SQLite's busy timeout, PostgreSQL's lock_timeout)
    instead of 30 s (SQLite) or never (PostgreSQL)."""
    cursor = dbapi_connection.cursor()
    if isinstance(dbapi_connection, sqlite3.Connection):
        cursor.execute("PRAGMA busy_timeout = 50")
    else:
        cursor.execute("SET lock_timeout = '50ms'")
    cursor.close()


def test_a_database_held_by_another_writer_is_waited_out_never_skipped_past(
    engine: Engine, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process holds the database for longer than the worker waits for a lock, over more than
    rollup_worker.MAX_ROUND_FAILURES tries: the worker backs off and retries, never gives the range up (a
    gap in the rollups of steps whose values are all there), and rolls all of it up once the lock is
    released. (On PostgreSQL the worker's plan reads and its writes wait, the way a round meets a writer
    that takes the lock between the two; on SQLite the round's first BEGIN IMMEDIATE waits.)"""
    event.listen(engine, "connect", _short_lock_waits)
    engine.dispose()  # connections opened from now on wait 50 ms for a lock
    run_id, (sid,) = _run(engine, "contended", 1, world_size=2)
    _points(engine, sid, 0, 255)
    release = _hold_the_write_lock(database_url)
    worker = RollupWorker(engine, retry_first_s=0.05).start()
    skipped_before = _skipped()
    try:
        with caplog.at_level(logging.WARNING, logger="stepwatch_server"):
            worker.submit(run_id, 0, 255)
            deadline = time.monotonic() + CATCH_UP_S
            tries = rollup_worker.MAX_ROUND_FAILURES + 2
            while worker.stats()["errors"] < tries and time.monotonic() < deadline:
                time.sleep(0.01)
            assert worker.stats()["errors"] >= tries
            assert worker.stats()["skipped_ranges"] == 0 and worker.stats()["backing_off_runs"] == 1
            release()
            release = lambda: None  # noqa: E731 (released once)
            while _mark(engine, sid) < 255 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert _mark(engine, sid) == 255 and worker.stats()["skipped_ranges"] == 0
        assert _skipped() == skipped_before
        messages = [r.getMessage() for r in caplog.records]
        assert not [m for m in messages if "gave up on" in m or "could not skip" in m], messages
        with engine.connect() as conn:
            rolled = set(conn.execute(select(StepRollup.step).where(StepRollup.series_id == sid)).scalars())
        assert rolled == set(range(256))
    finally:
        release()
        worker.stop()
