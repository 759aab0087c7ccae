"""The store hook and grouping on a real database: events are written with the anomalies (and rolled
back with them), a flapping anomaly is announced once per cooldown, an escalation reaches a channel
whose route needs the higher severity, resolves go where the open went, groups become one delivery;
claims lease a delivery, and a retry past the deadline is given up and recorded."""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, insert, select

from stepwatch_server.alerts import load_config
from stepwatch_server.alerts.config import AlertsConfig
from stepwatch_server.alerts.events import record_events
from stepwatch_server.alerts.grouping import compose
from stepwatch_server.alerts.outbox import claim, finish
from stepwatch_server.alerts.ratelimit import RateLimiter
from stepwatch_server.alerts.transport import Result
from stepwatch_server.detect import AnomalyBook
from stepwatch_server.detect.store import Stored, save_anomalies
from stepwatch_server.storage import make_engine, upgrade
from stepwatch_server.storage.models import AlertDelivery, AlertEvent, Anomaly, Run
from tests.alerts.conftest import write_config
from tests.alerts.helpers import config_text
from tests.alerts.receiver import Receiver


@pytest.fixture
def db(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url)
    upgrade(engine)
    now = dt.datetime.now(dt.UTC)
    with engine.begin() as conn:
        conn.execute(insert(Run).values(name="r", world_size=16, created_at=now, last_seen_at=now))
    yield engine
    engine.dispose()


@pytest.fixture
def config(tmp_path: Path, receiver: Receiver, secrets: dict[str, str]) -> AlertsConfig:
    return load_config(write_config(tmp_path, config_text(receiver, window_s=0, cooldown_s=600)))


def events(engine: Engine) -> list[tuple[str, str, str, str]]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(AlertEvent.channel, AlertEvent.event, AlertEvent.key, AlertEvent.status).order_by(
                AlertEvent.id
            )
        )
        return [tuple(r) for r in rows]


def test_flapping_cooldown_escalation_resolve_and_grouping(db: Engine, config: AlertsConfig) -> None:
    book = AnomalyBook("r")
    save = functools.partial(save_anomalies, db, on_stored=functools.partial(record_events, config))
    book.raise_(
        "straggler",
        "rank:3",
        step=10,
        ts=10.0,
        severity="warning",
        summary="s",
        evidence={},
        rank=3,
        node="gpu-000",
    )
    save(book.drain_changes())
    book.resolve("straggler", "rank:3", step=20, ts=20.0)
    save(book.drain_changes())
    book.raise_(
        "straggler",
        "rank:3",
        step=30,
        ts=30.0,
        severity="warning",
        summary="s",
        evidence={},
        rank=3,
        node="gpu-000",
    )
    save(book.drain_changes())  # the same rank again within the cooldown: suppressed
    book.resolve("straggler", "rank:3", step=40, ts=40.0)
    save(book.drain_changes())  # its resolve: nobody was told, nothing to say
    assert events(db) == [
        ("team", "open", "rank:3", "pending"),
        ("team", "resolve", "rank:3", "pending"),
        ("team", "open", "rank:3", "suppressed"),
    ]

    book.raise_("nonfinite", "rank:5", step=50, ts=50.0, severity="warning", summary="n", evidence={}, rank=5)
    save(book.drain_changes())  # warning: only the team channel's route matches
    book.raise_(
        "nonfinite", "rank:5", step=51, ts=51.0, severity="critical", summary="n", evidence={}, rank=5
    )
    save(book.drain_changes())  # critical: the team hears of the escalation, the pager of an open
    book.resolve("nonfinite", "rank:5", step=60, ts=60.0)
    save(book.drain_changes())
    assert events(db)[3:] == [
        ("team", "open", "rank:5", "pending"),
        ("team", "escalate", "rank:5", "pending"),
        ("pager", "open", "rank:5", "pending"),
        ("pager", "resolve", "rank:5", "pending"),
        ("team", "resolve", "rank:5", "pending"),
    ]
    assert compose(db, config) == 7  # one delivery per (channel, kind, event) so far

    for rank in range(8, 16):  # one node's ranks in one round: one message per channel
        book.raise_("nonfinite", f"rank:{rank}", step=70, ts=70.0, severity="critical", summary="n", evidence={}, rank=rank, node="gpu-001")  # fmt: skip
    save(book.drain_changes())
    assert compose(db, config) == 2
    with db.connect() as conn:
        deliveries = conn.execute(
            select(AlertDelivery.channel, AlertDelivery.event, AlertDelivery.title, AlertDelivery.anomaly_ids)
        ).all()
        assert conn.execute(select(AlertEvent).where(AlertEvent.status == "pending")).first() is None
    grouped = [d for d in deliveries if len(d.anomaly_ids) == 8]
    assert sorted(d.channel for d in grouped) == ["pager", "team"]
    assert all(d.title == "CRITICAL nonfinite: 8 ranks on node gpu-001 in run r" for d in grouped)
    assert compose(db, config) == 0  # nothing twice


def test_events_roll_back_with_the_anomalies(db: Engine, config: AlertsConfig) -> None:
    book = AnomalyBook("r")
    book.raise_("hang", "run", step=5, ts=5.0, severity="critical", summary="h", evidence={}, rank=1)
    changes = book.drain_changes()

    def fail_after_recording(conn: object, stored: list[Stored]) -> None:
        assert record_events(config, conn, stored) == 2  # type: ignore[arg-type]
        raise RuntimeError("the process dies before the commit")

    with pytest.raises(RuntimeError):
        save_anomalies(db, changes, on_stored=fail_after_recording)
    with db.connect() as conn:
        assert conn.execute(select(Anomaly)).first() is None and not events(db)
    assert save_anomalies(db, changes, on_stored=functools.partial(record_events, config)) == 1
    assert [e[:2] for e in events(db)] == [("team", "open"), ("pager", "open")]


def test_a_retry_past_the_deadline_is_given_up_and_recorded(db: Engine, config: AlertsConfig) -> None:
    book = AnomalyBook("r")
    book.raise_("hang", "run", step=5, ts=5.0, severity="critical", summary="h", evidence={}, rank=1)
    save_anomalies(db, book.drain_changes(), on_stored=functools.partial(record_events, config))
    assert compose(db, config) == 2
    limiter = RateLimiter({name: 20 for name in config.channels})
    now = dt.datetime.now(dt.UTC)
    claimed = claim(db, config, limiter, now)
    assert len(claimed) == 2 and claim(db, config, limiter, now) == []  # leased: not claimed twice
    late = dataclasses.replace(claimed[0], deadline_at=now + dt.timedelta(seconds=0.1))
    busy = Result(ok=False, status=503, error="HTTP 503", retryable=True, retry_after_s=30.0)
    finish(db, config, [(late, busy), (claimed[1], busy)], now)
    with db.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(AlertDelivery.__table__))}
    given_up, waiting = rows[late.id], rows[claimed[1].id]
    assert given_up.status == "failed" and given_up.last_status_code == 503
    assert given_up.last_error.startswith(
        "gave up after 1 attempts: the deadline (300 s) passed; last error: HTTP 503"
    )
    assert waiting.status == "pending" and waiting.attempts == 1
    assert waiting.next_attempt_at >= now + dt.timedelta(seconds=30)  # Retry-After over the 2 s backoff cap


def test_a_channel_gets_its_messages_one_at_a_time_in_order(db: Engine, config: AlertsConfig) -> None:
    """An open and its resolve due together must not race: one message per channel is claimed, the
    oldest first, and none while a send to that channel is in flight."""
    book = AnomalyBook("r")
    book.raise_("hang", "run", step=5, ts=5.0, severity="critical", summary="h", evidence={}, rank=1)
    save_anomalies(db, book.drain_changes(), on_stored=functools.partial(record_events, config))
    assert compose(db, config) == 2
    book.resolve("hang", "run", step=9, ts=9.0)
    save_anomalies(db, book.drain_changes(), on_stored=functools.partial(record_events, config))
    assert compose(db, config) == 2
    limiter = RateLimiter({name: 20 for name in config.channels})
    now = dt.datetime.now(dt.UTC)
    assert claim(db, config, limiter, now, busy={"team", "pager"}) == []
    first = claim(db, config, limiter, now)
    assert sorted(c.channel for c in first) == ["pager", "team"]
    with db.connect() as conn:
        events = dict(conn.execute(select(AlertDelivery.id, AlertDelivery.event)).all())
    assert {events[c.id] for c in first} == {"open"}  # the resolves wait for their opens
    assert claim(db, config, limiter, now, busy={c.channel for c in first}) == []
