"""Migrations, storage rules and the bulk writer, on both backends."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import event, inspect, select, text
from sqlalchemy.exc import DBAPIError

from stepwatch_server.ingest import BatchWriter, parse_batch
from stepwatch_server.storage import make_engine, upgrade, write_transaction
from stepwatch_server.storage.engine import database_busy
from stepwatch_server.storage.migrate import alembic_config, migrations_dir
from stepwatch_server.storage.models import ALL_TABLES, Base, Point
from tests.service.conftest import ASYNC_TABLES, Collector, make_batch, steps_batch, table_counts


def test_migrations_create_the_schema_and_match_the_models(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        upgrade(engine)
        head = ScriptDirectory.from_config(alembic_config()).get_current_head()
        with engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == head
            assert set(inspect(conn).get_table_names()) >= {t.name for t in ALL_TABLES}
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        upgrade(engine)  # idempotent
        counts = table_counts(database_url)
        assert counts == {t.name: 0 for t in ALL_TABLES if t.name in counts}
        assert set(counts) >= {t.name for t in ALL_TABLES} - set(ASYNC_TABLES)
    finally:
        engine.dispose()


def test_restart_keeps_data_and_migrations_are_idempotent(database_url: str) -> None:
    first = Collector(database_url)
    try:
        assert first.post(make_batch()).status_code == 200
    finally:
        first.close()
    counts = table_counts(database_url)
    second = Collector(database_url)
    try:
        assert second.get("/healthz")["status"] == "ok"
        assert table_counts(database_url) == counts
        assert second.post(make_batch()).json()["incarnation"] == 2  # same run and rank, new session
    finally:
        second.close()


def test_sqlite_runs_in_wal_mode_with_foreign_keys(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'sub' / 'db.sqlite'}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
    finally:
        engine.dispose()


def test_migration_scripts_have_dated_names() -> None:
    names = [p.name for p in (migrations_dir() / "versions").glob("*.py")]
    assert names and all(n[:4].isdigit() and n[4] == "_" and n[7] == "_" and n[10] == "_" for n in names)


def test_writer_stores_nan_as_the_backend_can(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        upgrade(engine)
        writer = BatchWriter(engine)
        batch = parse_batch(
            steps_batch("w", uuid.uuid4().hex, 0, [1, 2, 3, 4], x=["NaN", "Infinity", "-Infinity", 2.5])
        )
        assert writer.write(batch).rows == 4
        assert writer.write(batch).duplicates == 4
        with engine.connect() as conn:
            values = conn.execute(select(Point.value).order_by(Point.step)).scalars().all()
        first = values[0]
        if engine.dialect.name == "sqlite":
            assert first is None  # SQLite turns NaN into NULL: NULL means NaN
        else:
            assert first is not None and np.isnan(first)
        assert values[1:] == [np.inf, -np.inf, 2.5]
    finally:
        engine.dispose()


def test_concurrent_new_sessions_of_one_rank_get_distinct_incarnations(database_url: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    engine = make_engine(database_url)
    try:
        upgrade(engine)
        writer = BatchWriter(engine)
        batches = [parse_batch(steps_batch("race", uuid.uuid4().hex, 0, [i], x=[1.0])) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(writer.write, batches))
        assert sorted(r.incarnation for r in results) == list(range(1, 9))
    finally:
        engine.dispose()


def test_large_batches_of_known_names_store_the_same_rows_built_before_the_transaction(
    database_url: str,
) -> None:
    """A large batch whose run, incarnation and names are known has its rows built before the write
    transaction (from the cache, or read from the database by a writer that has no cache); what is stored
    is the same: each value under its own series, step and incarnation, a new session's included."""
    from stepwatch_server.ingest.store import PREBUILD_MIN_ROWS
    from stepwatch_server.storage.models import Series

    names = [f"layers.{i}.x" for i in range(PREBUILD_MIN_ROWS // 5)]
    rng = np.random.default_rng(3)

    def wide(
        session: str, seq: int, steps: list[int]
    ) -> tuple[dict[str, object], dict[tuple[str, int], float]]:
        values = {n: rng.uniform(0, 9, len(steps)).tolist() for n in names}
        expected = {(n, s): v for n, col in values.items() for s, v in zip(steps, col, strict=True)}
        return steps_batch("wide", session, seq, steps, **values), expected

    engine = make_engine(database_url)
    try:
        upgrade(engine)
        writer = BatchWriter(engine)
        first, second = uuid.uuid4().hex, uuid.uuid4().hex
        stored: dict[tuple[str, int, int], float] = {}
        plan = [(writer, first, 0, 1, False), (writer, first, 1, 6, True), (writer, second, 0, 1, True)]
        plan.append((BatchWriter(engine), first, 2, 11, True))  # a writer with an empty cache
        for w, session, seq, step0, known in plan:
            doc, expected = wide(session, seq, list(range(step0, step0 + 5)))
            batch = parse_batch(doc)
            assert (w.prebuild(batch) is not None) == known
            result = w.write(batch)
            assert result.rows == len(expected) >= PREBUILD_MIN_ROWS
            stored.update({(n, s, result.incarnation): v for (n, s), v in expected.items()})
        with engine.connect() as conn:
            rows = conn.execute(
                select(Series.name, Point.step, Point.incarnation, Point.value).join(
                    Series, Series.id == Point.series_id
                )
            ).all()
        assert {(n, s, i): v for n, s, i, v in rows} == stored
        assert {i for _, _, i in stored} == {1, 2}
    finally:
        engine.dispose()


def test_concurrent_batches_adding_names_to_one_run_never_pass_the_limit_together(database_url: str) -> None:
    """Two collectors (writers with their own caches) add 10,000 new names each to a run that has one,
    at the same moment: one of them fits and the other is refused, whichever comes first (on
    PostgreSQL both read the run's names before either commits unless they take turns)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from stepwatch_server.errors import InvalidBatch
    from stepwatch_server.ingest.schema import MAX_SERIES_PER_RUN

    engine = make_engine(database_url)
    try:
        upgrade(engine)
        first = steps_batch("crowd", uuid.uuid4().hex, 0, [1], world_size=3, first=[1.0])
        BatchWriter(engine).write(parse_batch(first))
        half = MAX_SERIES_PER_RUN // 2
        batches = [  # ranks 1 and 2: their new sessions do not take turns for another reason
            parse_batch(
                steps_batch(
                    "crowd",
                    uuid.uuid4().hex,
                    0,
                    [1],
                    rank=k,
                    world_size=3,
                    **{f"w{k}.{i}": [1.0] for i in range(half)},
                )
            )
            for k in (1, 2)
        ]
        start = threading.Barrier(2)

        def write(batch: object) -> str:
            writer = BatchWriter(engine)
            start.wait()
            try:
                writer.write(batch)  # type: ignore[arg-type]
            except InvalidBatch as exc:
                assert exc.code == "too_many_series"
                return "refused"
            return "stored"

        with ThreadPoolExecutor(2) as pool:
            outcomes = sorted(pool.map(write, batches))
        assert outcomes == ["refused", "stored"]
        assert table_counts(database_url)["series"] == 1 + half
    finally:
        engine.dispose()


@pytest.mark.parametrize("table", [t.name for t in ALL_TABLES])
def test_constraint_names_follow_the_convention(table: str) -> None:
    t = Base.metadata.tables[table]
    assert t.primary_key.name == f"pk_{table}"
    assert all(fk.name and fk.name.startswith(f"fk_{table}_") for fk in t.foreign_key_constraints)


def test_two_thousand_short_runs_keep_the_per_run_caches_bounded(tmp_path: Path) -> None:
    """The writer's series ids grew with every run ever written (issue 14: memory never dropped); it
    keeps the MAX_CACHED_RUNS most recently written runs, and the detection engine its MAX_RUNS, and a
    run evicted from the cache still writes to its own series when it comes back."""
    from stepwatch_server.detect.engine import MAX_RUNS, DetectionEngine
    from stepwatch_server.ingest.store import MAX_CACHED_RUNS

    engine = make_engine(f"sqlite:///{tmp_path / 'runs.db'}")
    try:
        upgrade(engine)
        writer, detection = BatchWriter(engine), DetectionEngine()
        for i in range(2_000):
            batch = parse_batch(steps_batch(f"short-{i}", uuid.uuid4().hex, 0, [1, 2], loss=[1.0, 0.9]))
            writer.write(batch)
            detection.feed(batch)
        assert len(writer.series_ids) == MAX_CACHED_RUNS < 2_000
        assert len(detection.runs) == MAX_RUNS < 2_000
        again = parse_batch(steps_batch("short-0", uuid.uuid4().hex, 0, [3], loss=[0.8]))
        assert writer.write(again).rows == 1
        with engine.connect() as conn:
            from stepwatch_server.storage.models import Run, Series

            series = (
                conn.execute(
                    select(Series.id).join(Run, Run.id == Series.run_id).where(Run.name == "short-0")
                )
                .scalars()
                .all()
            )
        assert len(series) == 1  # the same series, found again in the database, not a second one
    finally:
        engine.dispose()


def test_a_group_of_known_batches_stores_every_value_under_its_own_series_rank_step_and_incarnation(
    database_url: str,
) -> None:
    """The steady state's group transaction (`write_group`) builds its rows as numpy columns for the whole
    group: each value must land under its own name, rank, step and incarnation, bit for bit (signed zero,
    subnormals, extremes, NaN and Inf), with JSON nulls left out and amax only at its own steps."""
    from stepwatch_server.ingest.store import Pending
    from stepwatch_server.storage.models import Series, StepRecord

    specials = [-0.0, 5e-324, 1.7976931348623157e308, -1e-300, 0.1, 3.0]
    engine = make_engine(database_url)
    try:
        upgrade(engine)
        writer = BatchWriter(engine)
        expected: dict[tuple[str, int, int, int], float] = {}
        timestamps: dict[tuple[int, int, int], float] = {}
        sessions = {(rank, inc): uuid.uuid4().hex for rank in (0, 1, 2) for inc in (1, 2)}

        def doc(rank: int, inc: int, seq: int, step0: int) -> dict[str, object]:
            steps = [step0, step0 + 1, step0 + 2]
            a = [specials[(rank + seq + i) % len(specials)] * (inc + 1) for i in range(3)]
            b: list[object] = [float(rank * 1000 + seq * 10 + i) for i in range(3)]
            b[seq % 3] = None  # not measured: not stored
            d = steps_batch("grp", sessions[(rank, inc)], seq, steps, rank=rank, world_size=3, a=a, b=b)
            d["timestamps"] = [1_764_427_200.25 + s + rank / 8 for s in steps]
            d["tensors"] = {
                "steps": [steps[1]],
                "stats": {"amax": {"m.0": [rank + 0.5], "m.1": ["Infinity"]}},
            }
            for name, col in (("a", a), ("b", b)):
                for s, v in zip(steps, col, strict=True):
                    if v is not None:
                        expected[(f":{name}", rank, s, inc)] = float(v)  # type: ignore[arg-type]
            expected[("amax:m.0", rank, steps[1], inc)] = rank + 0.5
            expected[("amax:m.1", rank, steps[1], inc)] = np.inf
            for s, t in zip(steps, d["timestamps"], strict=True):  # type: ignore[call-overload]
                timestamps[(rank, s, inc)] = t
            return d

        for inc in (1, 2):  # each session's first batch alone: it creates the rows the group then knows
            for rank in (0, 1, 2):
                assert writer.write(parse_batch(doc(rank, inc, 0, 1 + 100 * inc))).rows > 0
        group = [
            Pending(parse_batch(doc(rank, inc, seq, 1 + 100 * inc + 3 * seq)), None)
            for seq in (1, 2)
            for inc in (1, 2)
            for rank in (0, 1, 2)
        ]
        writer.write_group(group)
        assert all(p.error is None and p.result is not None and not p.result.duplicate for p in group)
        with engine.connect() as conn:
            rows = conn.execute(
                select(Series.stat, Series.name, Point.rank, Point.step, Point.incarnation, Point.value).join(
                    Series, Series.id == Point.series_id
                )
            ).all()
            stored_ts = conn.execute(
                select(StepRecord.rank, StepRecord.step, StepRecord.incarnation, StepRecord.ts)
            ).all()
        got = {(f"{stat}:{name}", r, s, i): v for stat, name, r, s, i, v in rows}
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            if engine.dialect.name == "sqlite":  # SQLite's REAL keeps -0.0 as 0 (and NaN as NULL)
                assert got[key] == value, key
            else:
                assert np.float64(got[key]).tobytes() == np.float64(value).tobytes(), key
        assert {(r, s, i): t for r, s, i, t in stored_ts} == timestamps
    finally:
        engine.dispose()


def test_bulk_columns_refuse_what_their_column_types_cannot_hold() -> None:
    from stepwatch_server.storage.bulk import BulkInsert

    insert = BulkInsert("t", {"a": "integer", "b": "bigint", "c": "float8"})
    a, b, c = insert.typed([[1, 2], np.array([2**62, -(2**62)]), [0.5, None]])
    assert (a.dtype, b.dtype, c.dtype) == (np.int32, np.int64, np.float64)
    assert b.tolist() == [2**62, -(2**62)]
    with pytest.raises(ValueError, match=r"t\.a: a value does not fit PostgreSQL integer"):
        insert.typed([[2**31], [1], [1.0]])
    with pytest.raises(ValueError, match="different lengths"):
        insert.typed([[1], [1, 2], [1.0]])
    with pytest.raises(ValueError, match="2 columns given, 3 expected"):
        insert.typed([[1], [1]])


def test_database_busy_tells_another_writers_lock_from_a_failing_statement(database_url: str) -> None:
    """A statement that waited for another connection's lock longer than it may (SQLite's busy timeout,
    PostgreSQL's lock_timeout) is contention (`database_busy`); a statement that fails by itself is not."""
    engine = make_engine(database_url)
    holder = make_engine(database_url)
    sqlite = engine.dialect.name == "sqlite"

    @event.listens_for(engine, "connect")
    def _wait_50_ms(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("PRAGMA busy_timeout = 50" if sqlite else "SET lock_timeout = '50ms'")

    try:
        upgrade(engine)
        engine.dispose()
        with holder.connect() as held:
            if sqlite:
                held.exec_driver_sql("COMMIT")  # leave the autobegun transaction, to take the write lock
                held.exec_driver_sql("BEGIN IMMEDIATE")
            else:
                held.execute(text("LOCK TABLE runs IN EXCLUSIVE MODE"))
            with pytest.raises(DBAPIError) as busy, write_transaction(engine) as conn:
                conn.execute(text("DELETE FROM runs"))
            held.rollback()
        assert database_busy(busy.value)
        with pytest.raises(DBAPIError) as broken, write_transaction(engine) as conn:
            conn.execute(text("SELECT no_such_column FROM runs"))
        assert not database_busy(broken.value)
    finally:
        holder.dispose()
        engine.dispose()
