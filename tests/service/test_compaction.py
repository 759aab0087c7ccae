"""Compaction (README "Disk use, retention and deleting a run": older values are stored compactly), on both
backends: a run's steps far enough behind its newest step (all of them once the run is silent for a day)
move from one row per value into one compressed block per rank and 256 steps, and every read gives back
what it gave before, bit for bit: NaN, infinities,
-0.0, subnormals, float64 values that are not float32, values not sent (null), a restart's incarnation
replacing steps, the per-rank and mean curves, the module statistics, the heatmaps and the rollups. A value
that arrives late for a compacted step is read with its block and counted in the rollups; expiry and
deleting a run remove the blocks; a database written before compaction existed is converted with every
value kept.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from alembic import command
from sqlalchemy import Engine, event, func, insert, select, text, update

from stepwatch_server.cli import build_parser
from stepwatch_server.ingest.store import insert_points
from stepwatch_server.runs import queries, rank_packs, rollups
from stepwatch_server.runs.compaction import CompactionWorker
from stepwatch_server.runs.deletion import delete_run, find
from stepwatch_server.runs.expiry import ExpiryWorker
from stepwatch_server.settings import Settings
from stepwatch_server.storage import blocks, make_engine, upgrade, write_transaction
from stepwatch_server.storage.migrate import alembic_config
from stepwatch_server.storage.models import (
    Point,
    Rank,
    Run,
    Series,
    StepRecord,
    StepRollup,
    StepRollupPack,
    ValueBlock,
)
from tests.service.conftest import Collector

STEPS = 400
AFTER = 128  # compact the steps more than this far behind the newest: the first block (steps 0..255)
COMPACTED_TO = 255
LATE = range(10, 20)  # rank 1 skips these steps and sends them after compaction
RESTART = range(300, 331)  # rank 0's second incarnation sends these again, with other values
WAIT_S = 60.0
T0 = 1_764_427_200.0
SPECIAL = {  # step: a value the codec must keep bit for bit
    5: math.nan,
    70: math.inf,
    71: -math.inf,
    72: -0.0,
    73: 5e-324,
    74: 1.7976931348623157e308,
    75: 0.1 + 0.2,
}


def _loss(rank: int, steps: range, incarnation: int = 1) -> list[Any]:
    rng = np.random.default_rng(rank * 10 + incarnation)
    out: list[Any] = (3.0 + rng.standard_normal(len(steps))).tolist()  # float64, not float32-exact
    for i, s in enumerate(steps):
        if s in SPECIAL:
            out[i] = _json(SPECIAL[s])
        elif s == 80:
            out[i] = None  # not measured at this step: absent, not NaN
    return out


def _json(x: float) -> Any:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def _value(x: Any) -> float:
    """A JSON value of a batch as the float it stands for."""
    return (
        {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(x, x) if isinstance(x, str) else x
    )


def _batch(rank: int, steps: range, session: str, seq: int, incarnation: int = 1) -> dict[str, Any]:
    tensor_steps = [s for s in steps if s % 10 == 0]
    return {
        "schema": 1,
        "run": "compact",
        "session": session,
        "seq": seq,
        "rank": rank,
        "world_size": 2,
        "steps": list(steps),
        "timestamps": [T0 + 0.4123456789 * s + rank / 7 for s in steps],  # float64, not short decimals
        "metrics": {
            "loss": _loss(rank, steps, incarnation),
            "lr": [float(np.float32(1e-4 * (1 + s % 7))) for s in steps],  # float32-exact
            "time.step_ms": [100.0 + 0.001 * s + rank for s in steps],
            "time.data_ms": [5.0 + (s % 3) + 10 * rank for s in steps],
            "time.backward_ms": [40.0 + 0.5 * (s % 5) for s in steps],
            "time.optimizer_ms": [8.0 + 0.25 * (s % 2) for s in steps],
        },
        "tensors": {
            "steps": tensor_steps,
            "stats": {"amax": {"layers.0": [float(s) / 3 + rank for s in tensor_steps]}},
        },
    }


def _feed(collector: Collector) -> None:
    parts = {0: [range(0, STEPS)], 1: [range(0, LATE.start), range(LATE.stop, STEPS)]}
    for rank, ranges in parts.items():
        for seq, steps in enumerate(ranges):
            for start in range(steps.start, steps.stop, 50):  # batches of at most 50 steps
                chunk = range(start, min(start + 50, steps.stop))
                answer = collector.post(_batch(rank, chunk, f"compact-{rank}", seq * 100 + start))
                assert answer.status_code == 200, answer.text
    answer = collector.post(_batch(0, RESTART, "compact-0-again", 0, incarnation=2))
    assert answer.status_code == 200, answer.text


def _raw(engine: Engine) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """Every (series, rank)'s raw series as the collector reads it: steps, and values as their bits."""
    with engine.connect() as conn:
        run_id = conn.execute(select(Run.id).where(Run.name == "compact")).scalar_one()
        ids = list(conn.execute(select(Series.id).where(Series.run_id == run_id)).scalars())
        series = queries.read_points(conn, ids, None, None, None)
    return {(s.series_id, s.rank): (s.steps.copy(), s.values.view(np.int64).copy()) for s in series}


def _views(collector: Collector) -> dict[str, Any]:
    """The answers of every read that shows values, over the whole run."""
    big = {"max_points": 10_000}
    out = {
        f"series {rank}": collector.get("/api/v1/runs/compact/series", metric=m, rank=rank, **big)
        for rank in ("0", "1", "all", "mean")
        for m in ("loss", "lr", "time.step_ms")
    }
    out["tensors"] = collector.get("/api/v1/runs/compact/tensors", stat="amax", **big)
    out["amax"] = collector.get("/api/v1/runs/compact/amax", **big)
    for m in ("loss", "time.step_ms"):  # groups of steps (their lowest and highest means), not one a step
        out[f"series mean {m} grouped"] = collector.get(
            "/api/v1/runs/compact/series", metric=m, rank="mean", max_points=40
        )
    out["amax grouped"] = collector.get("/api/v1/runs/compact/amax", max_points=40)
    for metric, mode in (("loss", "absolute"), ("time.step_ms", "median")):
        out[f"heatmap {metric}"] = collector.get(
            "/api/v1/runs/compact/heatmap", metric=metric, mode=mode, buckets=40
        )
        out[f"heatmap {metric} narrow"] = collector.get(
            "/api/v1/runs/compact/heatmap", metric=metric, mode=mode, buckets=40, from_step=100, to_step=140
        )
    out["late"] = collector.get("/api/v1/runs/compact/heatmap", metric="time.late_ms", buckets=20)
    out["steps"] = collector.get("/api/v1/runs/compact/steps", **big)  # the step end times
    runs = collector.get("/api/v1/dashboard/runs")["runs"]
    out["step rate"] = next(r["step_rate"] for r in runs if r["name"] == "compact")  # from the newest times
    return out


def _count(engine: Engine, table: Any) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def _same(a: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]], b: Any) -> None:
    assert a.keys() == b.keys()
    for key, (steps, bits) in a.items():
        assert np.array_equal(steps, b[key][0]), key
        assert np.array_equal(bits, b[key][1]), key  # float64 bit for bit, NaN included


def test_compacted_values_read_back_bit_for_bit_in_every_view(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    collector = start_collector(compact_after_steps=0)  # this test runs the worker itself
    _feed(collector)
    collector.wait_rolled_up()
    raw_before, views_before = _raw(engine), _views(collector)
    rows_before = _count(engine, Point)

    worker = CompactionWorker(engine, after_steps=AFTER)
    moved = worker.compact_once()
    with engine.connect() as conn:
        compacted_to = conn.execute(select(Run.compacted_to).where(Run.name == "compact")).scalar_one()
        left = conn.execute(select(func.max(Point.step)).where(Point.step <= COMPACTED_TO)).scalar()
        in_blocks = conn.execute(select(func.sum(ValueBlock.n_values))).scalar_one()
        blocks = conn.execute(select(func.count()).select_from(ValueBlock)).scalar_one()
    assert compacted_to == COMPACTED_TO and left is None  # every row up to the horizon moved
    with engine.connect() as conn:  # the step times too
        assert (
            conn.execute(select(func.max(StepRecord.step)).where(StepRecord.step <= COMPACTED_TO)).scalar()
            is None
        )
    assert moved == in_blocks == rows_before - _count(engine, Point)
    assert blocks == 2  # one block per rank and 256-step bucket (one incarnation each there)
    with engine.connect() as conn:  # the step rollups of the compacted bucket: one pack per series
        packs = conn.execute(select(StepRollupPack.series_id, StepRollupPack.bucket)).all()
        rows_left = conn.execute(select(func.count()).where(StepRollup.step <= COMPACTED_TO)).scalar_one()
        series = conn.execute(select(func.count()).select_from(Series)).scalar_one()
    assert rows_left == 0 and sorted(b for _, b in packs) == [0] * series
    assert worker.stats()["step_packs_written"] == series
    assert worker.compact_once() == 0  # nothing more is far enough behind

    _same(raw_before, _raw(engine))
    assert _views(collector) == views_before
    run = collector.get("/api/v1/runs/compact")
    assert run["compacted_to"] == COMPACTED_TO
    # And what was sent, bit for bit: rank 0's loss, its restart's values replacing steps 300..330.
    sent = [x for start in range(0, STEPS, 50) for x in _loss(0, range(start, start + 50))]  # as `_feed` sent
    sent[RESTART.start : RESTART.stop] = _loss(0, RESTART, incarnation=2)
    expected = np.array([_value(x) for x in sent if x is not None])
    if engine.dialect.name == "sqlite":  # SQLite keeps an integral REAL as an integer: -0.0 was 0 as a row
        expected[72] = 0.0
    with engine.connect() as conn:
        sid = conn.execute(select(Series.id).where(Series.name == "loss")).scalar_one()
    steps, bits = _raw(engine)[(sid, 0)]
    assert np.array_equal(steps, [s for s in range(STEPS) if s != 80])  # step 80's null was not stored
    differ = np.flatnonzero(bits != expected.view(np.int64))
    assert differ.size == 0, [
        (int(steps[i]), float(bits[i : i + 1].view(np.float64)[0]), expected[i]) for i in differ[:5]
    ]


def test_a_late_value_for_a_compacted_step_is_read_with_its_block_and_rolled_up(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    collector = start_collector(compact_after_steps=0)
    _feed(collector)
    collector.wait_rolled_up()
    CompactionWorker(engine, after_steps=AFTER).compact_once()

    late = _batch(1, LATE, "compact-1", 50)
    assert collector.post(late).status_code == 200
    collector.wait_rolled_up()  # the rollup worker takes the late steps in
    series = collector.get("/api/v1/runs/compact/series", metric="loss", rank="1", max_points=10_000)
    steps = series["series"][0]["steps"]
    assert [s for s in steps if s < 30] == [s for s in range(30) if s != 80]  # the block's and the late ones
    # Rank 1's first bucket (steps 0..63) in the rank rollups: the block's 54 steps and the 10 late ones.
    with engine.connect() as conn:
        sid = conn.execute(select(Series.id).where(Series.name == "time.step_ms")).scalar_one()
        cols = rank_packs.read(conn, [sid], 0, 0, 0)
        (row,) = np.flatnonzero(cols[1] == 1)  # rank 1's figures of bucket 0
        n, total = int(cols[4][row]), float(cols[5][row])
    assert n == 64 and total == pytest.approx(sum(100.0 + 0.001 * s + 1 for s in range(64)))
    mean = collector.get("/api/v1/runs/compact/series", metric="time.step_ms", rank="mean", max_points=10_000)
    steps = mean["series"][0]["steps"]
    assert 10 in steps  # the step rollups hold the late steps, with both ranks' values
    with engine.connect() as conn:  # bucket 0's packs turned back into rows for the late steps' round
        assert conn.execute(select(func.count()).select_from(StepRollupPack)).scalar_one() == 0
        assert conn.execute(select(func.count()).where(StepRollup.step <= COMPACTED_TO)).scalar_one() > 0
    assert mean["series"][0]["values"][steps.index(15)] == pytest.approx(100.0 + 0.015 + 0.5)

    # A second compaction leaves the late rows alone (their step is behind the horizon) and reads stay whole.
    before = _raw(engine)
    CompactionWorker(engine, after_steps=AFTER).compact_once()
    _same(before, _raw(engine))


def test_a_restart_inside_compacted_buckets_reads_the_same_from_the_packs(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    """Steps 100..130 sent again by rank 0's second incarnation, then steps 0..511 compacted: their step
    rollups are packed per incarnation, and every view (the curves' groups holding the restart are
    recomputed from the values) reads as before."""
    collector = start_collector(compact_after_steps=0)
    for rank in (0, 1):
        for start in range(0, 600, 50):
            answer = collector.post(_batch(rank, range(start, start + 50), f"packed-{rank}", start))
            assert answer.status_code == 200, answer.text
    assert collector.post(_batch(0, range(100, 131), "packed-0-again", 0, incarnation=2)).status_code == 200
    collector.wait_rolled_up()
    before = _views(collector)
    worker = CompactionWorker(engine, after_steps=0)
    worker.compact_once()
    with engine.connect() as conn:
        compacted_to = conn.execute(select(Run.compacted_to).where(Run.name == "compact")).scalar_one()
        incarnations = conn.execute(
            select(StepRollupPack.incarnation).where(StepRollupPack.bucket == 0).distinct()
        ).scalars()
        assert sorted(incarnations) == [1, 2]
        assert conn.execute(select(func.count()).where(StepRollup.step <= 511)).scalar_one() == 0
    assert compacted_to == 511 and worker.stats()["step_packs_written"] > 0
    assert _views(collector) == before


def _age(engine: Engine, days: float) -> None:
    """Make run "compact" last heard from `days` ago (the run's and its ranks' `last_seen_at`)."""
    then = dt.datetime.now(dt.UTC) - dt.timedelta(days=days)
    with write_transaction(engine) as conn:
        run_id = conn.execute(select(Run.id).where(Run.name == "compact")).scalar_one()
        conn.execute(update(Run).where(Run.id == run_id).values(last_seen_at=then))
        conn.execute(update(Rank).where(Rank.run_id == run_id).values(last_seen_at=then))


def test_a_run_silent_for_a_day_has_its_newest_steps_compacted_and_may_resume(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    """The newest steps stay rows while the run is heard from, however far behind; a day after its last
    batch (it ended, or died) they go into blocks too, the last bucket part-filled, once; a new session
    after that is read with the blocks and compacted again when the run falls silent again."""
    collector = start_collector(compact_after_steps=0)
    _feed(collector)
    collector.wait_rolled_up()
    views_before, raw_before = _views(collector), _raw(engine)
    medians = [r["median_step_ms"] for r in collector.get("/api/v1/runs/compact/ranks")["ranks"]]
    assert None not in medians
    worker = CompactionWorker(engine, after_steps=AFTER)
    worker.compact_once()
    _age(engine, 0.9)  # silent for less than a day: its newest steps stay rows
    assert worker.compact_once() == 0
    with engine.connect() as conn:
        assert conn.execute(select(Run.compacted_to)).scalar_one() == COMPACTED_TO

    _age(engine, 1.1)
    moved = worker.compact_once()
    with engine.connect() as conn:
        assert conn.execute(select(Run.compacted_to)).scalar_one() == STEPS - 1  # the last step a block holds
        assert conn.execute(select(func.count()).select_from(StepRecord)).scalar_one() == 0
        assert conn.execute(select(func.count()).select_from(StepRollup)).scalar_one() == 0
    assert moved > 0 and _count(engine, Point) == 0
    assert _count(engine, ValueBlock) == 5  # 2 ranks x 2 buckets, and rank 0's restart in bucket 1
    _same(raw_before, _raw(engine))
    assert _views(collector) == views_before
    # The rank table's median step time reads the blocks when the recent steps are in them.
    assert [r["median_step_ms"] for r in collector.get("/api/v1/runs/compact/ranks")["ranks"]] == medians
    statements: list[str] = []

    def listen(conn: Any, cursor: Any, statement: str, *rest: Any) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", listen)
    try:
        assert worker.compact_once() == 0
        moved_again = list(statements)
        statements.clear()
        with (
            engine.connect() as conn
        ):  # the steps after the last one (the views' newest, above the watermark)
            ids = list(conn.execute(select(Series.id)).scalars())
            assert queries.read_values(conn, ids, None, STEPS, None)[0].size == 0
    finally:
        event.remove(engine, "before_cursor_execute", listen)
    assert moved_again and not [s for s in moved_again if "points" in s]  # moved once: not looked at again
    assert not [s for s in statements if "FROM blocks" in s]  # past the last step a block holds: none read

    # The run resumes: rank 1's new session sends steps 400..449 into the compacted, part-filled bucket.
    resumed = _batch(1, range(STEPS, STEPS + 50), "compact-1-resumed", 0, incarnation=2)
    assert collector.post(resumed).status_code == 200
    collector.wait_rolled_up()
    assert worker.compact_once() == 0  # heard from again: nothing is far enough behind
    loss = collector.get("/api/v1/runs/compact/series", metric="loss", rank="1", max_points=10_000)
    assert loss["series"][0]["steps"][-50:] == list(range(STEPS, STEPS + 50))
    views_resumed, raw_resumed = _views(collector), _raw(engine)
    _age(engine, 2.0)
    assert worker.compact_once() == 50 * 6 + 5  # the new steps' six metrics and five amax values
    assert _count(engine, Point) == 0
    with engine.connect() as conn:
        assert conn.execute(select(Run.compacted_to)).scalar_one() == STEPS + 49
    _same(raw_resumed, _raw(engine))
    assert _views(collector) == views_resumed


def test_the_runs_overview_keeps_each_runs_step_rate_once_compacted_to_its_end(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    """The runs list's step rate comes from the newest step end times of each run's lowest rank: from the
    blocks once a run is compacted to its end, run by run (two runs, two paces)."""
    collector = start_collector(compact_after_steps=0)
    _feed(collector)  # "compact": a step every 0.4123456789 s
    for start in range(0, 300, 50):
        other = _batch(0, range(start, start + 50), "other-rank-0", start)
        other["run"], other["timestamps"] = "other", [T0 + 0.25 * s for s in range(start, start + 50)]
        answer = collector.post(other)
        assert answer.status_code == 200, answer.text
    collector.wait_rolled_up()

    def rates() -> dict[str, float]:
        return {r["name"]: r["step_rate"] for r in collector.get("/api/v1/dashboard/runs")["runs"]}

    assert rates() == {"compact": pytest.approx(1 / 0.4123456789), "other": pytest.approx(4.0)}
    then = dt.datetime.now(dt.UTC) - dt.timedelta(days=2)
    with write_transaction(engine) as conn:  # both silent for two days
        conn.execute(update(Run).values(last_seen_at=then))
        conn.execute(update(Rank).values(last_seen_at=then))
    CompactionWorker(engine, after_steps=AFTER).compact_once()
    assert _count(engine, StepRecord) == 0 and _count(engine, Point) == 0
    assert rates() == {"compact": pytest.approx(1 / 0.4123456789), "other": pytest.approx(4.0)}


def test_the_median_step_time_from_the_step_end_times_reads_the_blocks_too(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    """A run that sends no `time.step_ms`: the rank table's median step time is the spacing of its step end
    times (0.4123456789 s here), from the rows, and from the blocks once the run is compacted to its end;
    rank 1 stopped 200 steps before rank 0 (its recent steps are read over its own range)."""
    collector = start_collector(compact_after_steps=0)
    for rank, end in ((0, 300), (1, 100)):
        for start in range(0, end, 50):
            batch = _batch(rank, range(start, start + 50), f"times-only-{rank}", start)
            batch["metrics"] = {"loss": batch["metrics"]["loss"]}
            assert collector.post(batch).status_code == 200
    collector.wait_rolled_up()

    def medians() -> list[float]:
        return [r["median_step_ms"] for r in collector.get("/api/v1/runs/compact/ranks")["ranks"]]

    assert medians() == [pytest.approx(412.3456789)] * 2
    _age(engine, 2.0)
    CompactionWorker(engine, after_steps=AFTER).compact_once()
    assert _count(engine, StepRecord) == 0 and _count(engine, Point) == 0
    assert medians() == [pytest.approx(412.3456789)] * 2


def test_expiry_and_deletion_remove_the_blocks(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    collector = start_collector(compact_after_steps=0)
    now = time.time()
    for rank in range(2):  # steps 0..299 finished 10 days ago, 300..399 within the hour
        for start in range(0, STEPS, 100):
            batch = _batch(rank, range(start, start + 100), f"old-rank-{rank}", start)
            batch["timestamps"] = [
                (now - 10 * 86_400.0 if s < 300 else now - 600.0) + s for s in batch["steps"]
            ]
            answer = collector.post(batch)
            assert answer.status_code == 200, answer.text
    collector.wait_rolled_up()
    CompactionWorker(engine, after_steps=AFTER).compact_once()
    stored = collector.get("/api/v1/runs/compact")["stored_values"]
    assert _count(engine, ValueBlock) == 2

    removed = ExpiryWorker(engine, raw_retention_days=5.0, run_retention_days=None).expire_once(time.time())
    with engine.connect() as conn:
        kept = conn.execute(select(func.min(ValueBlock.bucket))).scalar()
    # Expired up to step 299: the blocks (steps 0..255) wholly, so both go; rows 256..299 too.
    assert kept is None
    run = collector.get("/api/v1/runs/compact")
    assert run["raw_from_step"] == 300 and run["stored_values"] == stored - removed["raw_values"]
    assert run["stored_values"] == 2 * 100 * 6 + 2 * 10  # steps 300..399: 6 metrics, amax every 10th

    CompactionWorker(engine, after_steps=AFTER).compact_once()  # nothing left behind the horizon to move
    with engine.connect() as conn:
        delete_run(engine, find(conn, "compact"))
    assert _count(engine, ValueBlock) == 0 and _count(engine, Point) == 0


def test_expiry_finds_its_horizon_in_the_step_times_of_the_blocks(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    """Steps 0..255 finished 10 days ago and are compacted (their times are in the blocks, no `steps` row
    is left of them); 256.. within the hour: 5 days' retention expires exactly the blocks."""
    collector = start_collector(compact_after_steps=0)
    now = time.time()
    for rank in range(2):
        for start in range(0, STEPS, 100):
            batch = _batch(rank, range(start, start + 100), f"old-rank-{rank}", start)
            batch["timestamps"] = [
                (now - 10 * 86_400.0 if s <= COMPACTED_TO else now - 600.0) + s for s in batch["steps"]
            ]
            assert collector.post(batch).status_code == 200
    collector.wait_rolled_up()
    CompactionWorker(engine, after_steps=AFTER).compact_once()
    assert _count(engine, ValueBlock) == 2
    steps = collector.get("/api/v1/runs/compact/steps", rank="1", max_points=10_000)["series"][0]
    assert steps["steps"] == list(range(STEPS)) and steps["timestamps"][300] == now - 600.0 + 300

    ExpiryWorker(engine, raw_retention_days=5.0, run_retention_days=None).expire_once(time.time())
    run = collector.get("/api/v1/runs/compact")
    assert run["raw_from_step"] == COMPACTED_TO + 1 and _count(engine, ValueBlock) == 0
    steps = collector.get("/api/v1/runs/compact/steps", rank="1", max_points=10_000)["series"][0]
    assert steps["steps"] == list(range(COMPACTED_TO + 1, STEPS))


def test_values_written_before_compaction_existed_are_converted_with_every_value_kept(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    """An upgraded database: the run's rows were written with compaction off (as every earlier version
    did); turning it on moves them in the background, a window at a time, and reads stay the same."""
    collector = start_collector(compact_after_steps=0)
    _feed(collector)
    collector.wait_rolled_up()
    before, views = _raw(engine), _views(collector)
    worker = CompactionWorker(
        engine, after_steps=AFTER, max_values=500
    )  # the smallest: one rank's block each
    rounds = 0
    while worker.compact_once(max_transactions=1):
        rounds += 1
        _same(before, _raw(engine))  # whole after every transaction
    assert rounds == 2  # one per rank
    assert _views(collector) == views


def test_the_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().compact_after_steps == 3600
    assert Settings(compact_after_steps=0).compact_after_steps == 0
    with pytest.raises(ValueError, match=r"compact_after_steps.*at least 128"):
        Settings(compact_after_steps=10)
    monkeypatch.setenv("STEPWATCH_COMPACT_AFTER_STEPS", "500")
    assert Settings().compact_after_steps == 500
    monkeypatch.setenv("STEPWATCH_COMPACT_AFTER_STEPS", "soon")
    with pytest.raises(ValueError, match="STEPWATCH_COMPACT_AFTER_STEPS"):
        Settings()
    monkeypatch.delenv("STEPWATCH_COMPACT_AFTER_STEPS")
    args = build_parser().parse_args(["serve", "--compact-after-steps", "1000"])
    assert args.compact_after_steps == 1000


def test_the_collector_compacts_by_itself(start_collector: Callable[..., Collector], engine: Engine) -> None:
    collector = start_collector(compact_after_steps=AFTER)
    _feed(collector)
    deadline = time.monotonic() + WAIT_S
    while collector.get("/api/v1/runs/compact")["compacted_to"] != COMPACTED_TO:
        assert time.monotonic() < deadline, "the collector's compaction worker did not compact the run"
        time.sleep(0.5)
    assert _count(engine, ValueBlock) == 2


def test_a_database_of_the_previous_schema_keeps_every_value_through_upgrade_and_compaction(
    database_url: str,
) -> None:
    """Rows written under revision 0007 (before blocks existed): the upgrade adds the table and the column,
    and the worker then moves the rows, every value read back bit for bit."""
    engine = make_engine(database_url)
    try:
        upgrade(engine, "0007")
        now = dt.datetime.now(dt.UTC)
        steps = np.arange(1000, dtype=np.int64)
        with engine.begin() as conn:
            run_id = conn.execute(
                insert(Run)
                .values(name="compact", world_size=2, created_at=now, last_seen_at=now)
                .returning(Run.id)
            ).scalar_one()
            for rank in range(2):
                conn.execute(
                    insert(Rank).values(
                        run_id=run_id, rank=rank, world_size=2, replica_group=rank, shard=0, num_shards=1,
                        incarnation=1, last_step=999, last_seen_at=now,
                    )
                )  # fmt: skip
            rows = []
            for name in ("loss", "lr"):
                sid = conn.execute(
                    insert(Series).values(run_id=run_id, stat="", name=name).returning(Series.id)
                ).scalar_one()
                for rank in range(2):
                    values = np.random.default_rng(rank).standard_normal(steps.shape[0])
                    for step, special in SPECIAL.items():
                        values[step] = special
                    rows += [(sid, rank, int(s), 1, float(v)) for s, v in zip(steps, values, strict=True)]
            insert_points(conn, rows)
        upgrade(engine)
        with write_transaction(engine) as conn:
            rollups.roll_up(conn, run_id, 0, 999)
        before = _raw(engine)
        assert sum(s.shape[0] for s, _ in before.values()) == 4 * 1000
        assert CompactionWorker(engine, after_steps=AFTER).compact_once() == 4 * 768  # steps 0..767
        _same(before, _raw(engine))
        with engine.connect() as conn:
            assert conn.execute(select(Run.compacted_to)).scalar_one() == 767
    finally:
        engine.dispose()


def test_blocks_of_every_size_read_back_whole_and_postgresql_keeps_their_whole_toast_chunks_apart(
    engine: Engine,
) -> None:
    """Blocks from a few bytes to ~16 KB (random float64 values, which zstd cannot shrink), written by
    `blocks.insert_rows` and read back through `blocks.DATA`: the same bytes, and decoded the same values.
    On PostgreSQL a block's whole TOAST chunks go to `tail`, stored out of line and uncompressed, and the
    rest (under one chunk) stays in the row; SQLite keeps each block whole in `data`."""
    now = dt.datetime.now(dt.UTC)
    rng = np.random.default_rng(7)
    sizes = [1, 3, 200, 249, 250, 251, 499, 500, 760, 1000, 2000]  # values in each block: ~8 bytes each
    parts = []
    for bucket, n in enumerate(sizes):  # bucket `bucket`, series 1, 2, ... of 256 steps each
        at = np.arange(n, dtype=np.int64)
        ones = np.ones(n, dtype=np.int64)
        step = at % blocks.BLOCK_STEPS + bucket * blocks.BLOCK_STEPS
        parts.append([at // blocks.BLOCK_STEPS + 1, 0 * ones, step, ones, rng.standard_normal(n)])
    made = blocks.join(parts)
    rows = blocks.encode_rows(made)
    sent = {row["bucket"]: row["data"] for row in rows}
    assert max(len(d) for d in sent.values()) > 4 * blocks.TOAST_CHUNK  # sizes across several chunks
    with write_transaction(engine) as conn:
        run_id = conn.execute(
            insert(Run).values(name="sizes", world_size=1, created_at=now, last_seen_at=now).returning(Run.id)
        ).scalar_one()
        blocks.insert_rows(conn, run_id, rows)
    with engine.connect() as conn:
        stored = conn.execute(
            select(ValueBlock.bucket, ValueBlock.data, ValueBlock.tail, blocks.DATA).order_by(
                ValueBlock.bucket
            )
        ).all()
    assert {b: bytes(whole) for b, _, _, whole in stored} == sent
    back = blocks.decode_rows([(0, 1, bytes(whole)) for *_, whole in stored])
    order, again = np.lexsort((made[2], made[0])), np.lexsort((back[2], back[0]))
    for got, want in zip(back, made, strict=True):
        assert np.array_equal(got[again], want[order])
    postgres = engine.dialect.name == "postgresql"
    for bucket, data, tail, _ in stored:
        whole = len(sent[bucket])
        if postgres and whole >= blocks.TOAST_CHUNK:
            assert len(tail) % blocks.TOAST_CHUNK == 0 and len(data) == whole % blocks.TOAST_CHUNK
        else:
            assert tail is None and len(data) == whole
    if postgres:
        with engine.connect() as conn:
            storage = dict(
                conn.execute(
                    text(
                        "SELECT attname, attstorage FROM pg_attribute "
                        "WHERE attrelid = 'blocks'::regclass AND attname IN ('data', 'tail')"
                    )
                ).all()
            )
        assert storage == {"data": "m", "tail": "e"}  # MAIN: kept in the row; EXTERNAL: out of line, as is


def _disk_bytes(conn: Any, table: str) -> int:
    """Bytes the database holds in use for `table` with its indexes (SQLite: the file's pages in use, as
    only this table grows between two readings)."""
    if conn.dialect.name == "postgresql":
        return int(conn.execute(text(f"SELECT pg_total_relation_size('{table}')")).scalar_one())
    pages = (
        conn.execute(text("PRAGMA page_count")).scalar_one()
        - conn.execute(text("PRAGMA freelist_count")).scalar_one()
    )
    return int(pages) * int(conn.execute(text("PRAGMA page_size")).scalar_one())


def test_blocks_take_little_more_disk_than_their_bytes(engine: Engine) -> None:
    """Blocks of 4-6 KB (a run of ~10 values a rank and step: 256 steps at ~2 bytes a value), incompressible,
    inserted as compaction does (a bucket at a time, every rank's): the table and its key take at most 1.15
    times their bytes. On SQLite a WITHOUT ROWID row keeps ~490 bytes in the b-tree and the rest on overflow
    pages of its own, the last part-filled (1.34 times here, 1.54 at 5-6 KB); with rowids a row's overflow
    pages are whole. On PostgreSQL the whole TOAST chunks are stored apart (`blocks.tail`)."""
    rng = np.random.default_rng(11)
    rows = [
        {"rank": rank, "bucket": bucket, "incarnation": 1, "n_values": 1,
         "data": rng.integers(0, 256, int(rng.integers(4000, 6000)), dtype=np.uint8).tobytes()}
        for bucket in range(40) for rank in range(16)
    ]  # fmt: skip
    now = dt.datetime.now(dt.UTC)
    with write_transaction(engine) as conn:
        run_id = conn.execute(
            insert(Run).values(name="disk", world_size=16, created_at=now, last_seen_at=now).returning(Run.id)
        ).scalar_one()
    with engine.connect() as conn:
        before = _disk_bytes(conn, "blocks")
    for bucket in range(40):
        with write_transaction(engine) as conn:
            blocks.insert_rows(conn, run_id, rows[bucket * 16 : bucket * 16 + 16])
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(
                text("ANALYZE blocks")
            )  # the visibility and free space maps, as autovacuum leaves them
        used = _disk_bytes(conn, "blocks") - before
        assert conn.execute(select(func.count()).select_from(ValueBlock)).scalar_one() == len(rows)
    sent = sum(len(r["data"]) for r in rows)
    assert used <= 1.15 * sent, (
        f"{used:,} bytes on disk for {sent:,} bytes of blocks ({used / sent:.3f} times)"
    )


def test_the_migration_moves_sqlite_blocks_into_a_table_with_rowids_and_back(database_url: str) -> None:
    """Blocks written under 0015 (SQLite: WITHOUT ROWID, ~1.3 times their bytes) are all there after 0016,
    byte for byte, and then take at most 1.15 times their bytes (the old table's pages freed); a downgrade
    copies them back. PostgreSQL: the same rows through both, nothing else to do."""
    engine = make_engine(database_url)
    key = ValueBlock.run_id, ValueBlock.rank, ValueBlock.bucket, ValueBlock.incarnation
    rng = np.random.default_rng(12)
    try:
        upgrade(engine, "0015")
        now = dt.datetime.now(dt.UTC)
        with write_transaction(engine) as conn:
            run_id = conn.execute(
                insert(Run)
                .values(name="old", world_size=8, created_at=now, last_seen_at=now)
                .returning(Run.id)
            ).scalar_one()
            empty = _disk_bytes(conn, "blocks")
        rows = [
            {"rank": rank, "bucket": bucket, "incarnation": 1, "n_values": 3,
             "data": rng.integers(0, 256, int(rng.integers(4000, 6000)), dtype=np.uint8).tobytes()}
            for bucket in range(30) for rank in range(8)
        ]  # fmt: skip
        for bucket in range(30):
            with write_transaction(engine) as conn:
                blocks.insert_rows(conn, run_id, rows[bucket * 8 : bucket * 8 + 8])
        sent = sum(len(r["data"]) for r in rows)
        want = sorted((run_id, r["rank"], r["bucket"], 1, r["data"]) for r in rows)
        with engine.connect() as conn:
            old = _disk_bytes(conn, "blocks") - empty
        upgrade(engine)
        with engine.connect() as conn:
            got = conn.execute(select(*key, blocks.DATA)).all()
            assert sorted((*r[:4], bytes(r[4])) for r in got) == want
            new = _disk_bytes(conn, "blocks") - empty
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0015")
            conn.commit()
            back = conn.execute(select(*key, blocks.DATA)).all()
            assert sorted((*r[:4], bytes(r[4])) for r in back) == want
        if engine.dialect.name == "sqlite":
            assert old > 1.25 * sent, f"{old / sent:.3f}"  # what 0015's table took
            assert new <= 1.15 * sent, f"{new / sent:.3f}"
    finally:
        engine.dispose()


def test_a_value_given_twice_keeps_its_first_copy_in_the_block() -> None:
    """`encode_rows` keeps the first of two values of one (series, rank, step, incarnation), as `points`
    does (ON CONFLICT DO NOTHING): a block's value ahead of a late row re-sent for it. Other incarnations,
    ranks and buckets of the same step and series are other values."""
    ones = np.ones(6, dtype=np.int64)
    sid = np.array([1, 2, 1, 1, 1, 1])
    rank = np.array([0, 0, 0, 0, 1, 0])
    step = np.array([5, 5, 5, 5, 5, 300])
    inc = np.array([1, 1, 1, 2, 1, 1])
    value = np.array([1.5, 2.5, -9.0, 3.5, 4.5, 5.5])  # -9.0: a second copy of the first value
    rows = blocks.encode_rows([sid, rank, step * ones, inc, value])
    assert sorted((r["rank"], r["bucket"], r["incarnation"], r["n_values"]) for r in rows) == [
        (0, 0, 1, 2), (0, 0, 2, 1), (0, 1, 1, 1), (1, 0, 1, 1),
    ]  # fmt: skip
    back = blocks.decode_rows([(r["rank"], r["incarnation"], r["data"]) for r in rows])
    got = sorted(zip(*(c.tolist() for c in back), strict=True))
    assert got == [
        (1, 0, 5, 1, 1.5),
        (1, 0, 5, 2, 3.5),
        (1, 0, 300, 1, 5.5),
        (1, 1, 5, 1, 4.5),
        (2, 0, 5, 1, 2.5),
    ]


def test_integer_columns_are_read_exactly_at_any_size(engine: Engine) -> None:
    """`queries.fetch_columns` casts integer columns back from float64 when every value is below 2**53, and
    reads them one by one where one is not: a step near 2**62 comes back to the last bit, and a NULL in a
    float column as NaN."""
    big = 2**62 + 1  # not a float64: 2**62 + 1 rounds to 2**62
    with engine.connect() as conn:
        for steps in ([3, 7, 2**53 - 1], [3, big]):
            union = " UNION ALL ".join(
                f"SELECT {s} AS step, {'NULL' if i == 0 else i / 4} AS value" for i, s in enumerate(steps)
            )
            step, value = queries.fetch_columns(conn, text(f"SELECT step, value FROM ({union}) AS t"), [0])
            assert step.dtype == np.int64 and step.tolist() == steps
            assert math.isnan(value[0]) and value[1:].tolist() == [i / 4 for i in range(1, len(steps))]
