"""The shape of `GET /api/v1/alerts`, for the OpenAPI document (as runs/answers.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel


class Channel(BaseModel):
    name: str
    type: str


class Delivery(BaseModel):
    id: int
    idempotency_key: str
    channel: str
    event: str
    run: str | None
    kind: str | None
    severity: str | None
    title: str | None
    anomaly_ids: list[int] | None
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status_code: int | None
    last_error: str | None  # the HTTP status and its standard reason only, never the receiver's body
    created_at: dt.datetime
    next_attempt_at: dt.datetime | None
    last_attempt_at: dt.datetime | None
    delivered_at: dt.datetime | None
    deadline_at: dt.datetime | None


class AlertsAnswer(BaseModel):
    worker: dict[str, Any]  # the worker's counters; {"enabled": false} without an alerts configuration
    pending_events: int
    channels: list[Channel]
    deliveries: list[Delivery]
