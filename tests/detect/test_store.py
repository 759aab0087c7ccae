"""Anomalies in the database: the bulk upsert keeps one row per anomaly through its lifecycle, and a
new engine adopts the open ones (SQLite and PostgreSQL)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, insert, select

from stepwatch_server.detect import AnomalyBook, DetectionEngine
from stepwatch_server.detect.store import load_open, plain_json, save_anomalies
from stepwatch_server.storage import make_engine, upgrade
from stepwatch_server.storage.models import Anomaly as AnomalyRow
from stepwatch_server.storage.models import Run
from tests.service.conftest import BACKENDS, fresh_database


@pytest.fixture(params=BACKENDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    with fresh_database(str(request.param), tmp_path) as url:
        engine = make_engine(url)
        upgrade(engine)
        now = dt.datetime.now(dt.UTC)
        with engine.begin() as conn:
            for name, world in (("run-a", 8), ("run-b", 4)):
                conn.execute(
                    insert(Run).values(name=name, world_size=world, created_at=now, last_seen_at=now)
                )
        yield engine
        engine.dispose()


def rows(engine: Engine) -> list[AnomalyRow]:
    with engine.connect() as conn:
        return list(conn.execute(select(*AnomalyRow.__table__.c).order_by(AnomalyRow.id)).all())


def test_open_update_resolve_is_one_row(db: Engine) -> None:
    book = AnomalyBook("run-a")
    book.raise_(
        "straggler", "rank:3", step=100, ts=1000.0, severity="warning", summary="rank 3 slow",
        evidence={"ratio": 1.12, "bad": float("nan"), "up": float("inf")}, rank=3, node="gpu-0",
    )  # fmt: skip
    assert save_anomalies(db, book.drain_changes()) == 1
    (row,) = rows(db)
    assert (row.status, row.severity, row.first_step, row.last_step, row.rank) == (
        "open",
        "warning",
        100,
        100,
        3,
    )
    assert row.evidence == {"ratio": 1.12, "bad": "NaN", "up": "Infinity"}  # JSONB refuses bare NaN
    created = row.created_at
    assert created.tzinfo is not None

    book.raise_("straggler", "rank:3", step=180, ts=1080.0, severity="critical", summary="rank 3 slower",
                evidence={"ratio": 1.3}, rank=3, node="gpu-0")  # fmt: skip
    save_anomalies(db, book.drain_changes())
    (row,) = rows(db)
    assert (row.status, row.severity, row.last_step, row.last_ts, row.summary) == (
        "open", "critical", 180, 1080.0, "rank 3 slower",
    )  # fmt: skip
    assert row.created_at == created and row.updated_at >= created

    book.resolve("straggler", "rank:3", step=200, ts=1100.0, note="caught up")
    save_anomalies(db, book.drain_changes())
    (row,) = rows(db)
    assert (row.status, row.resolved_step, row.resolved_ts, row.first_step) == ("resolved", 200, 1100.0, 100)
    assert row.evidence["resolution"] == "caught up"

    # The same condition coming back later is a new anomaly (a new first step), in its own row.
    book.raise_("straggler", "rank:3", step=500, ts=1400.0, severity="warning", summary="again", evidence={})
    save_anomalies(db, book.drain_changes())
    assert [(r.first_step, r.status) for r in rows(db)] == [(100, "resolved"), (500, "open")]


def test_many_runs_in_one_call_and_unknown_runs_skipped(db: Engine) -> None:
    changed = []
    for run in ("run-a", "run-b", "no-such-run"):
        book = AnomalyBook(run)
        for rank in range(3):
            book.raise_(
                "hang", f"rank:{rank}", step=10, ts=1.0, severity="critical", summary="s", evidence={}
            )
        changed += book.drain_changes()
    changed += changed[:2]  # the same anomaly twice in one round: the last one wins, no conflict error
    assert save_anomalies(db, changed) == 6
    assert len(rows(db)) == 6
    assert save_anomalies(db, []) == 0


def test_a_new_engine_adopts_open_anomalies_and_resolves_them(db: Engine) -> None:
    book = AnomalyBook("run-a")
    book.raise_(
        "hang", "run", step=50, ts=500.0, severity="critical", summary="stuck", evidence={"n": 1}, rank=2
    )
    book.raise_("nonfinite", "rank:1", step=40, ts=400.0, severity="critical", summary="nan", evidence={})
    book.resolve("nonfinite", "rank:1", step=41, ts=401.0)
    save_anomalies(db, book.drain_changes())

    (entry,) = load_open(db)
    assert (entry.name, entry.world_size) == ("run-a", 8)
    assert [(a.kind, a.key, a.first_step, a.detected_ts, a.evidence) for a in entry.anomalies] == [
        ("hang", "run", 50, 500.0, {"n": 1})
    ]
    engine = DetectionEngine()
    engine.adopt(entry.name, entry.world_size, entry.anomalies)
    assert engine.tick(wall_now=10_000.0) == []  # an adopted run with no data yet is not ticked
    adopted = engine.runs["run-a"].ctx.book
    assert adopted.is_open("hang", "run")
    adopted.raise_("hang", "run", step=60, ts=600.0, severity="critical", summary="still stuck", evidence={})
    adopted.resolve("hang", "run", step=61, ts=610.0)
    save_anomalies(db, adopted.drain_changes())
    hang = [r for r in rows(db) if r.kind == "hang"]
    assert [(r.first_step, r.last_step, r.status, r.resolved_step, r.summary) for r in hang] == [
        (50, 60, "resolved", 61, "still stuck")
    ]
    assert load_open(db) == []


def test_plain_json() -> None:
    import numpy as np

    value = {"a": np.float32(1.5), "b": np.array([1.0, np.nan]), "c": (np.int64(3), -np.inf), 4: None}
    assert plain_json(value) == {"a": 1.5, "b": [1.0, "NaN"], "c": [3, "-Infinity"], "4": None}
