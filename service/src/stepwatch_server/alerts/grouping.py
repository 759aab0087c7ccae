"""Grouping: pending alert events become deliveries once their group's window has passed.

A group is (channel, run, kind, event). When its oldest pending event is `group_window_s` old, every
pending event of the group becomes one delivery (one message: "8 ranks on node gpu-012: straggler"),
rendered for the channel's type and written to the outbox in the same transaction that marks the
events grouped. The state is all in the database, so grouping continues unchanged after a restart,
and the idempotency key is derived from the events, so it is the same whoever composes it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections import defaultdict
from typing import Any

from sqlalchemy import Engine, bindparam, insert, select, update

from stepwatch_server.alerts.config import AlertsConfig
from stepwatch_server.alerts.render import ANOMALY_FIELDS, Message, render
from stepwatch_server.storage.engine import write_transaction
from stepwatch_server.storage.models import AlertDelivery, AlertEvent, Command, Run
from stepwatch_server.storage.models import Anomaly as AnomalyRow

MAX_EVENTS_PER_ROUND = 5000  # pending events read per composition round (the rest wait for the next)
Group = tuple[str, int, str, str]  # channel, run id, kind, event


def idempotency_key(channel: str, event_ids: list[int]) -> str:
    digest = hashlib.sha256(f"{channel}\0{','.join(map(str, sorted(event_ids)))}".encode()).hexdigest()
    return f"swa_{digest[:40]}"


def compose(engine: Engine, config: AlertsConfig, now: dt.datetime | None = None) -> int:
    """Turn the ready groups of pending events into deliveries; returns how many were written."""
    now = now or dt.datetime.now(dt.UTC)
    ready_before = now - dt.timedelta(seconds=config.group_window_s)
    with engine.connect() as conn:  # a read first: an idle collector takes no write lock
        waiting = conn.execute(
            select(AlertEvent.id)
            .where(AlertEvent.status == "pending", AlertEvent.created_at <= ready_before)
            .limit(1)
        ).first()
    if waiting is None:
        return 0
    with write_transaction(engine) as conn:
        events = conn.execute(
            select(AlertEvent.__table__)
            .where(AlertEvent.status == "pending")
            .order_by(AlertEvent.id)
            .limit(MAX_EVENTS_PER_ROUND)
            .with_for_update(skip_locked=True)  # PostgreSQL: two collectors never group one event twice
        ).all()
        groups: defaultdict[Group, list[Any]] = defaultdict(list)
        for e in events:
            groups[(e.channel, e.run_id, e.kind, e.event)].append(e)
        ready = {g: evs for g, evs in groups.items() if min(e.created_at for e in evs) <= ready_before}
        if not ready:
            return 0
        anomaly_ids = {e.anomaly_id for evs in ready.values() for e in evs}
        anomalies = {
            row.id: row
            for row in conn.execute(
                select(*AnomalyRow.__table__.c, Run.name.label("run_name"))
                .join(Run, Run.id == AnomalyRow.run_id)
                .where(AnomalyRow.id.in_(anomaly_ids))
            )
        }
        asked: dict[int, list[dict[str, Any]]] = defaultdict(list)  # the evidence asked at each anomaly
        for row in conn.execute(
            select(Command.anomaly_id, Command.id, Command.kind, Command.targets)
            .where(Command.anomaly_id.in_(anomaly_ids))
            .order_by(Command.id)
        ):
            asked[int(row.anomaly_id)].append({"id": row.id, "kind": row.kind, "ranks": row.targets})
        deliveries, links = [], []
        for (channel, _, kind, event), evs in ready.items():
            rows = [
                {**_anomaly(anomalies[i]), "commands": asked.get(i, [])}
                for i in dict.fromkeys(e.anomaly_id for e in evs)
                if i in anomalies
            ]
            key = idempotency_key(channel, [e.id for e in evs])
            links += [{"event_id": e.id, "key": key} for e in evs]
            if not rows:
                continue  # the anomalies are gone (run deleted): nothing to say
            msg = Message(channel, event, rows[0]["run"], kind, rows, key, now, config.dashboard_url)
            deliveries.append(_delivery(config, msg, now))
        if deliveries:
            conn.execute(insert(AlertDelivery), deliveries)
        keys = {link["key"] for link in links}
        ids = {
            key: row_id
            for key, row_id in conn.execute(
                select(AlertDelivery.idempotency_key, AlertDelivery.id).where(
                    AlertDelivery.idempotency_key.in_(keys)
                )
            )
        }
        conn.execute(
            update(AlertEvent)
            .where(AlertEvent.id == bindparam("event_id"))
            .values(status="grouped", delivery_id=bindparam("delivery_id")),
            [{"event_id": link["event_id"], "delivery_id": ids.get(link["key"])} for link in links],
        )
    return len(deliveries)


def _delivery(config: AlertsConfig, msg: Message, now: dt.datetime) -> dict[str, Any]:
    channel = config.channels.get(msg.channel)
    return {
        "idempotency_key": msg.idempotency_key,
        "channel": msg.channel,
        "event": msg.event,
        "run": msg.run,
        "kind": msg.kind,
        "severity": msg.severity,
        "title": msg.title,
        "anomaly_ids": [a["id"] for a in msg.anomalies],
        "payload": render(channel.type if channel else "webhook", msg),
        "status": "pending",
        "attempts": 0,
        "created_at": now,
        "next_attempt_at": now,
        "deadline_at": now + dt.timedelta(seconds=config.deadline_s),
        "last_attempt_at": None,
        "delivered_at": None,
        "last_status_code": None,
        "last_error": None,
    }


def _anomaly(row: Any) -> dict[str, Any]:
    return {"run": row.run_name, **{name: row._mapping[name] for name in ANOMALY_FIELDS}}
