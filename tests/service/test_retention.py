"""Retention (README "Disk use, retention and deleting a run"), on both backends: raw per-rank data older than
`raw_retention_days` leaves once rolled up and nothing newer does, the curves still show the old steps
from the rollups, and runs not heard from for `run_retention_days` go whole.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, update

from stepwatch_server.cli import build_parser
from stepwatch_server.runs.expiry import ExpiryWorker
from stepwatch_server.settings import Settings
from stepwatch_server.storage.models import Fingerprint, Point, Rank, Run, Series, StepRecord
from tests.service.conftest import Collector

DAY_S = 86_400.0
OLD_STEPS = range(0, 200)  # finished 10 days ago
NEW_STEPS = range(200, 300)  # finished within the last hour
WAIT_S = 60.0


def _batch(run: str, rank: int, steps: range, t0: float) -> dict[str, Any]:
    return {
        "schema": 1,
        "run": run,
        "session": f"{run}-rank-{rank}-session",
        "seq": steps.start,
        "rank": rank,
        "world_size": 2,
        "steps": list(steps),
        "timestamps": [t0 + i for i in range(len(steps))],
        "metrics": {"loss": [3.0 - 0.001 * s + rank for s in steps], "lr": [0.1] * len(steps)},
        "fingerprints": {"steps": [steps.start], "values": ["9c1f00d2aa13e4b7"]},
    }


def _feed(collector: Collector, run: str) -> None:
    now = time.time()
    for rank in range(2):
        for steps, t0 in ((OLD_STEPS, now - 10 * DAY_S), (NEW_STEPS, now - 3_600.0)):
            answer = collector.post(_batch(run, rank, steps, t0))
            assert answer.status_code == 200, answer.text


def _count(engine: Engine, table: Any, run_id: int, where: Any = None) -> int:
    column = (
        Point.series_id.in_(select(Series.id).where(Series.run_id == run_id))
        if table is Point
        else (table.run_id == run_id)
    )
    query = select(func.count()).select_from(table).where(column)
    if where is not None:
        query = query.where(where)
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def test_raw_data_older_than_the_setting_leaves_once_rolled_up_and_the_curves_keep_it(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    collector = start_collector()
    _feed(collector, "long")
    collector.wait_rolled_up()
    with engine.connect() as conn:
        run_id = conn.execute(select(Run.id).where(Run.name == "long")).scalar_one()
    before = collector.get("/api/v1/runs/long")
    assert (
        before["raw_from_step"] is None and before["stored_values"] == 2 * 300 * 2 + 2 * 2
    )  # values + fingerprints
    per_rank_before = collector.get("/api/v1/runs/long/series", metric="loss", rank="1")["series"][0]

    worker = ExpiryWorker(engine, raw_retention_days=5.0, run_retention_days=None)
    done = worker.expire_once(time.time())
    assert (
        done["raw_values"] == 2 * 200 * 2 + 2
    )  # 200 old steps x 2 metrics x 2 ranks, each rank's fingerprint
    old = Point.step < NEW_STEPS.start
    assert _count(engine, Point, run_id, old) == 0
    assert _count(engine, Point, run_id, ~old) == 2 * 100 * 2  # every newer value kept
    assert _count(engine, StepRecord, run_id, StepRecord.step < NEW_STEPS.start) == 0
    assert _count(engine, StepRecord, run_id) == 2 * 100
    assert _count(engine, Fingerprint, run_id) == 2  # the fingerprints at step 200
    after = collector.get("/api/v1/runs/long")
    assert after["raw_from_step"] == NEW_STEPS.start
    assert after["stored_values"] == 2 * 100 * 2 + 2
    with engine.connect() as conn:
        assert conn.execute(select(func.sum(Rank.stored_values)).where(Rank.run_id == run_id)).scalar() == 402

    mean = collector.get("/api/v1/runs/long/series", metric="loss", rank="mean")["series"][0]
    assert mean["steps"][0] == 0 and mean["steps"][-1] == NEW_STEPS[-1]  # the step rollups stay
    one = collector.get("/api/v1/runs/long/series", metric="loss", rank="1")["series"][0]
    assert one["steps"][0] == 0 and one["steps"][-1] >= NEW_STEPS.start  # a column's point: its middle step
    # Each column's lowest and highest value of rank 1, as read from its raw values before the expiry.
    assert min(one["values"]) == min(per_rank_before["values"]) and max(one["values"]) == max(
        per_rank_before["values"]
    )
    heat = collector.get("/api/v1/runs/long/heatmap", metric="loss", buckets=30)
    assert heat["steps"][0] == 0 and heat["ranks"] == [0, 1]  # its columns from the rank rollups too
    assert worker.expire_once(time.time())["raw_values"] == 0  # nothing more is old enough


def test_expiry_waits_for_the_rollups_and_removes_whole_runs_not_heard_from(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    collector = start_collector(detection=False)
    _feed(collector, "quiet")
    _feed(collector, "busy")
    collector.wait_rolled_up()
    month_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=31)
    with engine.begin() as conn:
        quiet = conn.execute(select(Run.id).where(Run.name == "quiet")).scalar_one()
        conn.execute(update(Run).where(Run.id == quiet).values(last_seen_at=month_ago))
        conn.execute(update(Rank).where(Rank.run_id == quiet).values(last_seen_at=month_ago))
        # busy's rollups stop at step 99: its old steps above that wait for them
        conn.exec_driver_sql(f"UPDATE rollup_marks SET rolled_to = 99 WHERE run_id != {quiet}")

    done = ExpiryWorker(engine, raw_retention_days=5.0, run_retention_days=30.0).expire_once(time.time())
    assert done["runs"] == ["quiet"]
    assert [r["name"] for r in collector.get("/api/v1/runs")["runs"]] == ["busy"]
    busy = collector.get("/api/v1/runs/busy")
    assert busy["raw_from_step"] == 100
    with engine.connect() as conn:
        busy_id = conn.execute(select(Run.id).where(Run.name == "busy")).scalar_one()
    assert _count(engine, Point, busy_id, Point.step < 100) == 0
    assert _count(engine, Point, busy_id, Point.step >= 100) == 2 * 200 * 2


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--raw-retention-days", "0"], {}, "--raw-retention-days"),
        (["--run-retention-days", "-1"], {}, "--run-retention-days"),
        ([], {"STEPWATCH_RAW_RETENTION_DAYS": "a week"}, "STEPWATCH_RAW_RETENTION_DAYS"),
    ],
)
def test_a_bad_retention_names_its_setting(
    args: list[str],
    env: dict[str, str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from stepwatch_server.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", *args]) == 2
    assert message in capsys.readouterr().err


def test_retention_settings_come_from_flags_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().raw_retention_days is None and Settings().run_retention_days is None
    monkeypatch.setenv("STEPWATCH_RAW_RETENTION_DAYS", "7")
    monkeypatch.setenv("STEPWATCH_RUN_RETENTION_DAYS", "365")
    assert (Settings().raw_retention_days, Settings().run_retention_days) == (7.0, 365.0)
    parsed = build_parser().parse_args(["serve", "--raw-retention-days", "1.5"])
    assert parsed.raw_retention_days == 1.5


def test_a_collector_started_with_a_retention_applies_it_at_once(
    start_collector: Callable[..., Collector], engine: Engine
) -> None:
    first = start_collector(detection=False)
    _feed(first, "stale")
    first.close()
    with engine.begin() as conn:
        month_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=31)
        conn.execute(update(Run).values(last_seen_at=month_ago))
        conn.execute(update(Rank).values(last_seen_at=month_ago))
    second = start_collector(detection=False, run_retention_days=30.0)
    deadline = time.monotonic() + WAIT_S
    while second.get("/api/v1/runs")["runs"]:
        assert time.monotonic() < deadline, "the retention worker did not delete the stale run"
        time.sleep(0.2)
