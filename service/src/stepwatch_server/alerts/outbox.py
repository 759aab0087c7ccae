"""The durable outbox (`alert_deliveries`): claim what is due, record what each attempt did.

A delivery is claimed by pushing its `next_attempt_at` out by a lease (and counting the attempt) in
one bulk UPDATE; if the process dies while sending, the row is simply due again when the lease runs
out, and is sent again with the same idempotency key (at least once). On PostgreSQL the claim uses
`FOR UPDATE SKIP LOCKED`, so several collectors on one database never send one row at once.

Order: a channel gets its messages one at a time, in the order they were written. Only its oldest
pending message is ever claimable; while that one waits (a retry's backoff, the rate limit, a lease),
the channel waits with it, and other channels go on.

Retries: exponential backoff from `BACKOFF_BASE_S`, doubled per attempt up to `max_backoff_s`, with
jitter (a random 50-100% of it), and never earlier than the receiver's `Retry-After`. A retry that
would fall after the delivery's deadline (`deadline_s` after it was composed) is not made: the row
is `failed` with "gave up", as is a permanent error (e.g. 404) at once.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, bindparam, func, select, update

from stepwatch_server.alerts import stats
from stepwatch_server.alerts.config import AlertsConfig
from stepwatch_server.alerts.ratelimit import RateLimiter
from stepwatch_server.alerts.transport import Result
from stepwatch_server.storage.engine import write_transaction
from stepwatch_server.storage.models import AlertDelivery

BACKOFF_BASE_S = 1.0
CLAIM_BATCH = 64  # deliveries claimed per round
LEASE_MARGIN_S = 5.0  # the lease is the HTTP timeout plus this


@dataclass(frozen=True)
class Claimed:
    id: int
    channel: str
    idempotency_key: str
    payload: dict[str, Any]
    attempts: int  # including this one
    deadline_at: dt.datetime
    claimed_at: dt.datetime


def claim(
    engine: Engine,
    config: AlertsConfig,
    limiter: RateLimiter,
    now: dt.datetime,
    limit: int = CLAIM_BATCH,
    busy: Collection[str] = (),
) -> list[Claimed]:
    """Claim up to `limit` due deliveries that their channels' rate limits allow; defer the others.

    One message per channel at a time, in the order they were written: only a channel's oldest pending
    message may be claimed, and while it is not due (waiting out a retry's backoff or Retry-After, held by
    the rate limit, or leased to a send in flight) nothing behind it in that channel goes, so a resolve
    never overtakes its open. Other channels are not held back. Nothing is claimed for a channel in `busy`
    (a send to it is in flight here). The unit is the channel, not the alert: a receiver's backoff
    (Slack's 429 and Retry-After are per webhook) is about the channel, and its reader sees the story in
    order.
    """
    lease_until = now + dt.timedelta(seconds=config.timeout_s + LEASE_MARGIN_S)
    heads = (  # each channel's oldest pending message (ids grow in the order messages are written)
        select(func.min(AlertDelivery.id))
        .where(AlertDelivery.status == "pending")
        .group_by(AlertDelivery.channel)
    )
    due = (AlertDelivery.id.in_(heads), AlertDelivery.next_attempt_at <= now)
    with engine.connect() as conn:  # a read first: a collector with nothing due takes no write lock
        if conn.execute(select(AlertDelivery.id).where(*due).limit(1)).first() is None:
            return []
    with write_transaction(engine) as conn:
        rows = conn.execute(
            select(AlertDelivery.__table__)
            .where(*due)
            .order_by(AlertDelivery.next_attempt_at, AlertDelivery.id)
            .limit(CLAIM_BATCH)
            .with_for_update(skip_locked=True)
        ).all()
        claimed: list[Claimed] = []
        changes: list[dict[str, Any]] = []
        taken = set(busy)
        for row in rows:
            if len(claimed) >= limit:
                break
            if row.channel in taken:
                continue  # a send to it is in flight; stays due for a later round
            if row.channel not in config.channels:
                error = f"channel {row.channel!r} is no longer in the configuration ({config.source})"
                changes.append(
                    _change(
                        row.id, "failed", row.attempts, row.next_attempt_at, row.last_attempt_at, None, error
                    )
                )
                stats.record_delivery("failed", "unknown")
                continue
            channel_type = config.channels[row.channel].type
            if not limiter.take(row.channel, now):
                free_at = limiter.free_at(row.channel, now)
                changes.append(
                    _change(
                        row.id,
                        "pending",
                        row.attempts,
                        free_at,
                        row.last_attempt_at,
                        row.last_status_code,
                        row.last_error,
                    )
                )
                stats.record_delivery("rate_limited", channel_type)
                continue
            taken.add(row.channel)
            claimed.append(
                Claimed(
                    row.id,
                    row.channel,
                    row.idempotency_key,
                    dict(row.payload),
                    row.attempts + 1,
                    row.deadline_at,
                    now,
                )
            )
            changes.append(
                _change(
                    row.id,
                    "pending",
                    row.attempts + 1,
                    lease_until,
                    now,
                    row.last_status_code,
                    row.last_error,
                )
            )
        if changes:
            conn.execute(_UPDATE, changes)
    return claimed


def finish(
    engine: Engine, config: AlertsConfig, results: list[tuple[Claimed, Result]], now: dt.datetime
) -> None:
    """Record the outcome of each attempt in one bulk update."""
    changes = []
    for c, r in results:
        channel = config.channels.get(c.channel)
        channel_type = channel.type if channel is not None else "unknown"
        if r.ok:
            changes.append(_change(c.id, "delivered", c.attempts, now, now, r.status, None, delivered_at=now))
            stats.record_delivery("delivered", channel_type)
            continue
        error = r.error or "failed"
        retry_at = now + dt.timedelta(
            seconds=retry_delay_s(c.attempts, config.max_backoff_s, r.retry_after_s)
        )
        if r.retryable and retry_at <= c.deadline_at:
            changes.append(_change(c.id, "pending", c.attempts, retry_at, now, r.status, error))
            stats.record_delivery("retried", channel_type)
            continue
        if r.retryable:
            error = f"gave up after {c.attempts} attempts: the deadline ({config.deadline_s:g} s) passed; last error: {error}"
        changes.append(_change(c.id, "failed", c.attempts, now, now, r.status, error))
        stats.record_delivery("failed", channel_type)
    if changes:
        with write_transaction(engine) as conn:
            conn.execute(_UPDATE, changes)


def retry_delay_s(attempts: int, max_backoff_s: float, retry_after_s: float | None = None) -> float:
    """Backoff after `attempts` failed attempts: jittered exponential, at least `retry_after_s`."""
    backoff = min(max_backoff_s, BACKOFF_BASE_S * 2.0 ** max(0, attempts - 1))
    delay = backoff * random.uniform(0.5, 1.0)
    return max(delay, retry_after_s or 0.0)


_UPDATE = (
    update(AlertDelivery)
    .where(AlertDelivery.id == bindparam("row_id"))
    .values(
        status=bindparam("new_status"),
        attempts=bindparam("new_attempts"),
        next_attempt_at=bindparam("new_next"),
        last_attempt_at=bindparam("new_last"),
        last_status_code=bindparam("new_code"),
        last_error=bindparam("new_error"),
        delivered_at=bindparam("new_delivered"),
    )
)


def _change(
    row_id: int,
    status: str,
    attempts: int,
    next_at: dt.datetime,
    last_at: dt.datetime | None,
    code: int | None,
    error: str | None,
    delivered_at: dt.datetime | None = None,
) -> dict[str, Any]:
    return {
        "row_id": row_id,
        "new_status": status,
        "new_attempts": attempts,
        "new_next": next_at,
        "new_last": last_at,
        "new_code": code,
        "new_error": error,
        "new_delivered": delivered_at,
    }
