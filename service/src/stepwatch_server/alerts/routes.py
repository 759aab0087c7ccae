"""`GET /api/v1/alerts`: the delivery log (most recent first), the worker's counters, and how many
routed events wait for their group window (`pending_events`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from sqlalchemy import func, select
from starlette.responses import Response

from stepwatch_server.alerts.answers import AlertsAnswer
from stepwatch_server.errors import InvalidParameter
from stepwatch_server.params import Conn
from stepwatch_server.responses import json_response
from stepwatch_server.storage.models import AlertDelivery, AlertEvent

router = APIRouter(prefix="/api/v1", tags=["alerts"])

STATUSES = ("pending", "delivered", "failed")
MAX_DELIVERIES = 1000


@router.get(
    "/alerts",
    summary="Alert deliveries, most recent first: status, attempts, last error",
    responses={200: {"model": AlertsAnswer}},
)
def alert_log(
    request: Request,
    conn: Conn,
    status: Annotated[
        str | None, Query(description=", ".join(STATUSES), json_schema_extra={"enum": list(STATUSES)})
    ] = None,
    channel: Annotated[str | None, Query(description="a channel name of the configuration")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_DELIVERIES)] = 100,
) -> Response:
    if status is not None and status not in STATUSES:
        raise InvalidParameter(
            f"status: expected one of {', '.join(STATUSES)}, got {status!r}",
            field="status",
        )
    stmt = select(AlertDelivery.__table__).order_by(AlertDelivery.id.desc()).limit(limit)
    if status is not None:
        stmt = stmt.where(AlertDelivery.status == status)
    if channel is not None:
        stmt = stmt.where(AlertDelivery.channel == channel)
    worker = request.app.state.alerts
    config = worker.config if worker is not None else None
    return json_response(
        {
            "worker": worker.stats() if worker is not None else {"enabled": False},
            "pending_events": conn.execute(
                select(func.count()).select_from(AlertEvent).where(AlertEvent.status == "pending")
            ).scalar_one(),
            "channels": [{"name": c.name, "type": c.type} for c in config.channels.values()]
            if config
            else [],
            "deliveries": [_shape(row) for row in conn.execute(stmt)],
        }
    )


_FIELDS = (
    "id", "idempotency_key", "channel", "event", "run", "kind", "severity", "title", "anomaly_ids", "status",
    "attempts", "last_status_code", "last_error", "created_at", "next_attempt_at", "last_attempt_at",
    "delivered_at", "deadline_at",
)  # fmt: skip


def _shape(row: Any) -> dict[str, Any]:
    out = {name: row._mapping[name] for name in _FIELDS}
    if row.status != "pending":
        out["next_attempt_at"] = None  # only a pending delivery has a next attempt
    return out
