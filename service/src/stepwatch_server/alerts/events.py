"""From stored anomaly transitions to routed alert events, inside the anomalies' own transaction.

`record_events` is the detection store's `on_stored` hook (detect/store.py): it runs in the
transaction that writes the anomalies, so an anomaly is never stored without its alert events (nor
the reverse), whatever happens to the process right after.

Transitions: a new row is an `open` (and also a `resolve` when it was opened and resolved within one
round); open -> resolved is a `resolve`; a severity that went up is an `escalate`. Each open or
escalation goes to the channels its routes name; an escalation also to the channels already told.
A resolve goes exactly to the channels that were told of the open (whatever the routes say now).

Cooldown: an `open` for the same (channel, run, kind, blamed entity) as an open sent less than
`cooldown_s` ago is recorded as `suppressed` (reason `cooldown`), and so is its later resolve, so a
flapping straggler is one message, not one per flap.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from typing import Any

from sqlalchemy import Connection, insert, select

from stepwatch_server.alerts import stats
from stepwatch_server.alerts.config import AlertsConfig
from stepwatch_server.detect.anomalies import SEVERITIES
from stepwatch_server.detect.store import Stored
from stepwatch_server.storage.models import AlertEvent

TOLD = ("open", "escalate")


def transitions(stored: list[Stored]) -> list[tuple[Stored, str]]:
    """(anomaly, event) for every change worth a message, in order."""
    out: list[tuple[Stored, str]] = []
    for s in stored:
        status, severity = s.anomaly.status, s.anomaly.severity
        if s.before_status is None:
            out.append((s, "open"))
            if status == "resolved":
                out.append((s, "resolve"))
        elif s.before_status == "open" and status == "resolved":
            out.append((s, "resolve"))
        elif s.before_status == "open" and SEVERITIES.index(severity) > SEVERITIES.index(
            s.before_severity or "info"
        ):
            out.append((s, "escalate"))
    return out


def record_events(
    config: AlertsConfig, conn: Connection, stored: list[Stored], now: dt.datetime | None = None
) -> int:
    """Insert the alert events for `stored` (the hook); returns how many (suppressed ones included)."""
    changes = transitions(stored)
    if not changes:
        return 0
    now = now or dt.datetime.now(dt.UTC)
    told = _told(conn, {s.id for s, _ in changes})
    recent = _recent_opens(conn, config, changes, now)
    rows: list[dict[str, Any]] = []
    for s, event in changes:
        a = s.anomaly
        if event == "resolve":
            rows += [_row(s, ch, "resolve", "pending", now) for ch in sorted(told[s.id])]
            continue
        targets = config.route(a.kind, a.severity, a.run)
        if event == "escalate":
            targets = (*targets, *sorted(told[s.id] - set(targets)))
        for ch in targets:
            if ch in told[s.id]:
                if event == "escalate":
                    rows.append(_row(s, ch, "escalate", "pending", now))
                continue
            subject = (ch, s.run_id, a.kind, a.key)
            if subject in recent:
                rows.append(
                    _row(
                        s,
                        ch,
                        "open",
                        "suppressed",
                        now,
                        f"cooldown: alerted less than {config.cooldown_s:g} s ago",
                    )
                )
                stats.record_delivery("suppressed", config.channels[ch].type)
                continue
            recent.add(subject)
            told[s.id].add(ch)
            rows.append(_row(s, ch, "open", "pending", now))
    if rows:
        conn.execute(insert(AlertEvent), rows)
    return len(rows)


def _row(
    s: Stored, channel: str, event: str, status: str, now: dt.datetime, reason: str | None = None
) -> dict[str, Any]:
    return {
        "anomaly_id": s.id,
        "run_id": s.run_id,
        "channel": channel,
        "event": event,
        "kind": s.anomaly.kind,
        "key": s.anomaly.key,
        "severity": s.anomaly.severity,
        "status": status,
        "reason": reason,
        "delivery_id": None,
        "created_at": now,
    }


def _told(conn: Connection, anomaly_ids: set[int]) -> defaultdict[int, set[str]]:
    """{anomaly id: channels that were (or are about to be) told it is open}."""
    told: defaultdict[int, set[str]] = defaultdict(set)
    rows = conn.execute(
        select(AlertEvent.anomaly_id, AlertEvent.channel).where(
            AlertEvent.anomaly_id.in_(anomaly_ids),
            AlertEvent.event.in_(TOLD),
            AlertEvent.status != "suppressed",
        )
    )
    for anomaly_id, channel in rows:
        told[anomaly_id].add(channel)
    return told


def _recent_opens(
    conn: Connection, config: AlertsConfig, changes: list[tuple[Stored, str]], now: dt.datetime
) -> set[tuple[str, int, str, str]]:
    """(channel, run id, kind, key) of the opens sent within the cooldown."""
    if config.cooldown_s <= 0:
        return set()
    runs = {s.run_id for s, _ in changes}
    kinds = {s.anomaly.kind for s, _ in changes}
    rows = conn.execute(
        select(AlertEvent.channel, AlertEvent.run_id, AlertEvent.kind, AlertEvent.key).where(
            AlertEvent.run_id.in_(runs),
            AlertEvent.kind.in_(kinds),
            AlertEvent.event == "open",
            AlertEvent.status != "suppressed",
            AlertEvent.created_at > now - dt.timedelta(seconds=config.cooldown_s),
        )
    )
    return {(r.channel, r.run_id, r.kind, r.key) for r in rows}
