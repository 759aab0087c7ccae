"""The detection read API: a run's anomalies, open anomalies across runs, run health, worker stats.

An anomaly is answered as stored (detect/store.py): `id`, `run`, `kind`, `key`, `status`,
`severity`, `rank`, `node`, `first_step`, `last_step`, `detected_step`, `first_ts`, `last_ts`,
`detected_ts` (event time, Unix seconds), `resolved_step`, `resolved_ts`, `summary`, `evidence`, `created_at`,
`updated_at`. Non-finite numbers are written "NaN" / "Infinity" / "-Infinity" as everywhere else.

Health: each open anomaly applies to what it blames: a rank-level one (rank set) to that rank, a
node-level one (node set, no rank) to every rank of that node, a run-level one (neither) to the
run only. The run's verdict is the worst over all open anomalies; a rank's over those that apply to
it. Severity `critical` makes the verdict critical, `warning` warning; `info` is listed among the
reasons but leaves the verdict ok.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy import Connection, select
from starlette.responses import Response

from stepwatch_server.auth import ReadAccess, read_every_run
from stepwatch_server.detect import answers
from stepwatch_server.detect.anomalies import KINDS
from stepwatch_server.detect.context import missing_ranks
from stepwatch_server.detect.verdict import verdict
from stepwatch_server.errors import RUN_NOT_FOUND, InvalidParameter
from stepwatch_server.params import Conn
from stepwatch_server.responses import json_response, nonfinite_name
from stepwatch_server.runs import queries
from stepwatch_server.storage.models import Anomaly as AnomalyRow
from stepwatch_server.storage.models import Command, Rank, Run

router = APIRouter(prefix="/api/v1", tags=["detection"])

STATUSES = ("open", "resolved")
MAX_ANOMALIES = 10_000
DEFAULT_ANOMALIES = 1000

StatusParam = Annotated[
    str | None,
    Query(description="open or resolved (default: both)", json_schema_extra={"enum": list(STATUSES)}),
]
KindParam = Annotated[
    str | None, Query(description=", ".join(KINDS), json_schema_extra={"enum": list(KINDS)})
]
Limit = Annotated[int, Query(ge=1, le=MAX_ANOMALIES, description="most recent first")]


def _choice(name: str, value: str | None, allowed: tuple[str, ...]) -> str | None:
    if value is None or value in allowed:
        return value
    raise InvalidParameter(f"{name}: expected one of {', '.join(allowed)}, got {value!r}", field=name)


def _num(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return nonfinite_name(value)


def _shape(row: Any, run: str) -> dict[str, Any]:
    return {
        "id": row.id,
        "run": run,
        "kind": row.kind,
        "key": row.key,
        "status": row.status,
        "severity": row.severity,
        "rank": row.rank,
        "node": row.node,
        "first_step": row.first_step,
        "last_step": row.last_step,
        "detected_step": row.detected_step,
        "detected_ts": _num(row.detected_ts),
        "first_ts": _num(row.first_ts),
        "last_ts": _num(row.last_ts),
        "resolved_step": row.resolved_step,
        "resolved_ts": _num(row.resolved_ts),
        "summary": row.summary,
        "evidence": row.evidence,
        "created_at": row.created_at,
        "updated_at": row.updated_at,
    }


def _shaped(conn: Connection, rows: Sequence[Any]) -> list[dict[str, Any]]:
    """The rows as answered, each with the commands asked at it (`commands`: evidence, commands/)."""
    asked: dict[int | None, list[dict[str, Any]]] = {}
    if rows:
        found = conn.execute(
            select(Command.anomaly_id, Command.id, Command.kind, Command.requested_by, Command.created_at)
            .where(Command.anomaly_id.in_([r.id for r in rows]))
            .order_by(Command.id)
        )
        for row in found:
            asked.setdefault(row.anomaly_id, []).append(
                {
                    "id": row.id,
                    "kind": row.kind,
                    "requested_by": row.requested_by,
                    "created_at": row.created_at,
                }
            )
    return [{**_shape(r, r.run_name), "commands": asked.get(r.id, [])} for r in rows]


def _select(run_id: int | None, status: str | None, kind: str | None, limit: int, runs: Any = None) -> Any:
    """`runs`: a WHERE clause on the run's name (a reader's scope), or None for every run."""
    stmt = select(*AnomalyRow.__table__.c, Run.name.label("run_name")).join(Run, Run.id == AnomalyRow.run_id)
    if runs is not None:
        stmt = stmt.where(runs)
    if run_id is not None:
        stmt = stmt.where(AnomalyRow.run_id == run_id)
    if status is not None:
        stmt = stmt.where(AnomalyRow.status == status)
    if kind is not None:
        stmt = stmt.where(AnomalyRow.kind == kind)
    return stmt.order_by(AnomalyRow.last_ts.desc(), AnomalyRow.id.desc()).limit(limit)


@router.get(
    "/runs/{run:path}/anomalies",
    summary="A run's anomalies, most recent first",
    responses={**RUN_NOT_FOUND, 200: {"model": answers.RunAnomaliesAnswer}},
)
def run_anomalies(
    run: str,
    conn: Conn,
    status: StatusParam = None,
    kind: KindParam = None,
    limit: Limit = DEFAULT_ANOMALIES,
) -> Response:
    status, kind = _choice("status", status, STATUSES), _choice("kind", kind, KINDS)
    found = queries.find_run(conn, run)
    rows = conn.execute(_select(found.id, status, kind, limit)).all()
    return json_response({"run": found.name, "anomalies": _shaped(conn, rows)})


@router.get(
    "/anomalies",
    summary="Anomalies across runs (e.g. ?status=open), most recent first",
    responses={200: {"model": answers.AnomaliesAnswer}},
)
def all_anomalies(
    conn: Conn,
    reader: ReadAccess,
    status: StatusParam = None,
    kind: KindParam = None,
    limit: Limit = DEFAULT_ANOMALIES,
) -> Response:
    status, kind = _choice("status", status, STATUSES), _choice("kind", kind, KINDS)
    rows = conn.execute(_select(None, status, kind, limit, reader.runs_clause(Run.name))).all()
    return json_response({"anomalies": _shaped(conn, rows)})


def _reason(row: Any) -> dict[str, Any]:
    return {
        "id": row.id,
        "kind": row.kind,
        "severity": row.severity,
        "summary": row.summary,
        "first_step": row.first_step,
    }


def health(conn: Connection, run: str) -> dict[str, Any]:
    """One verdict for the run and one per rank heard from, with the open anomalies that make them.

    The ranks listed are those that sent something (and any an open anomaly names), never one entry
    per declared rank: the declared ranks never heard from are a count and a few ranges of them."""
    found = queries.find_run(conn, run)
    rows = conn.execute(_select(found.id, "open", None, MAX_ANOMALIES)).all()
    nodes: dict[int, str | None] = {
        r.rank: r.node for r in conn.execute(select(Rank.rank, Rank.node).where(Rank.run_id == found.id))
    }
    by_rank: dict[int, list[Any]] = {r: [] for r in nodes}
    ranks_of: dict[str, list[int]] = {}
    for r, node in nodes.items():
        if node is not None:
            ranks_of.setdefault(node, []).append(r)
    for row in rows:
        if row.rank is not None:
            by_rank.setdefault(row.rank, []).append(row)
        elif row.node is not None:
            for r in ranks_of.get(row.node, []):
                by_rank[r].append(row)
    heard = np.array(sorted(nodes), dtype=np.int64)
    missing, ranges = missing_ranks(heard, found.world_size)
    ranks = [
        {
            "rank": r,
            "node": nodes.get(r),
            "verdict": verdict([a.severity for a in by_rank[r]]),
            "reasons": [_reason(a) for a in by_rank[r]],
        }
        for r in sorted(by_rank)
    ]
    return {
        "run": found.name,
        "verdict": verdict([a.severity for a in rows]),
        "reasons": [_reason(a) for a in rows],
        "open": len(rows),
        "ranks": ranks,
        "ranks_missing": missing,
        "missing_ranges": [list(x) for x in ranges],
    }


@router.get(
    "/runs/{run:path}/health",
    summary="Verdict (ok / warning / critical) per run and per rank",
    responses={**RUN_NOT_FOUND, 200: {"model": answers.HealthAnswer}},
)
def run_health(run: str, conn: Conn) -> Response:
    return json_response(health(conn, run))


@router.get(
    "/detection",
    summary="The detection worker: queue, throughput, drops, latency",
    responses={200: {"model": answers.DetectionAnswer}},
    dependencies=[Depends(read_every_run)],
)
def detection_stats(request: Request) -> Response:
    worker = request.app.state.detection
    return json_response(worker.stats() if worker is not None else {"enabled": False})
