"""Anomalies to and from the database: one upsert per round of the detection worker.

The natural key of a stored anomaly is (run, kind, key, first step): the book keeps one open anomaly
per (kind, key), and a condition that clears and comes back later is a new anomaly with a new first
step. `save_anomalies` writes every changed anomaly of a round in one transaction, as one bulk
`INSERT ... ON CONFLICT (run_id, kind, key, first_step) DO UPDATE` (the same statement on PostgreSQL
and SQLite), after resolving the runs' ids in one query. `load_open` reads the open ones back for
`DetectionEngine.adopt` when the collector starts.

`on_stored`, when given, is called inside that same transaction with each written anomaly's
`Stored` (its row id and its status and severity before the write), so that whatever it writes
(the alert outbox) commits or rolls back together with the anomalies.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from sqlalchemy import Connection, Engine, Table, select, tuple_
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from stepwatch_server.commands.at_verdicts import ask_at_verdicts
from stepwatch_server.detect.anomalies import Anomaly
from stepwatch_server.responses import nonfinite_name
from stepwatch_server.storage.engine import write_transaction
from stepwatch_server.storage.models import Anomaly as AnomalyRow
from stepwatch_server.storage.models import Run

log = logging.getLogger(__name__)

MAX_ADOPTED_RUNS = 1000  # runs whose open anomalies are handed back at start (the engine's MAX_RUNS)
_KEY = ("run_id", "kind", "key", "first_step")
_UPDATED = (
    "status",
    "severity",
    "rank",
    "node",
    "last_step",
    "detected_step",
    "detected_ts",
    "first_ts",
    "last_ts",
    "resolved_step",
    "resolved_ts",
    "summary",
    "evidence",
    "updated_at",
)


def plain_json(value: Any) -> Any:
    """`value` as plain JSON types: numpy scalars and arrays unwrapped, non-finite floats as the
    strings "NaN" / "Infinity" / "-Infinity" (PostgreSQL's JSONB refuses bare NaN)."""
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_json(v) for v in value]
    if isinstance(value, np.ndarray):
        return [plain_json(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return nonfinite_name(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def _row(anomaly: Anomaly, run_id: int, now: dt.datetime) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "kind": anomaly.kind,
        "key": anomaly.key,
        "status": anomaly.status,
        "severity": anomaly.severity,
        "rank": None if anomaly.rank is None else int(anomaly.rank),
        "node": anomaly.node,
        "first_step": int(anomaly.first_step),
        "last_step": int(anomaly.last_step),
        "detected_step": int(anomaly.detected_step),
        "detected_ts": float(anomaly.detected_ts),
        "first_ts": float(anomaly.first_ts),
        "last_ts": float(anomaly.last_ts),
        "resolved_step": None if anomaly.resolved_step is None else int(anomaly.resolved_step),
        "resolved_ts": None if anomaly.resolved_ts is None else float(anomaly.resolved_ts),
        "summary": anomaly.summary,
        "evidence": plain_json(anomaly.evidence),
        "created_at": now,
        "updated_at": now,
    }


@dataclass(frozen=True, slots=True)
class Stored:
    """One anomaly as just written: its row id, run id, and its status/severity before (None: new)."""

    anomaly: Anomaly
    id: int
    run_id: int
    before_status: str | None
    before_severity: str | None


StoredHook = Callable[[Connection, list[Stored]], None]


def save_anomalies(
    engine: Engine,
    anomalies: Iterable[Anomaly],
    on_stored: StoredHook | None = None,
    on_missing: Callable[[list[str]], None] | None = None,
) -> int:
    """Insert or update `anomalies` in one transaction; returns the rows written.

    Anomalies of runs not in the database (deleted since their batches were stored) are skipped, and
    their names given to `on_missing` (the detection loop then drops those runs' state). When the same
    anomaly appears twice, the last one wins. `on_stored` runs in the transaction with what was written
    (module docstring).
    """
    latest: dict[tuple[str, str, str, int], Anomaly] = {}
    for a in anomalies:
        latest[(a.run, a.kind, a.key, a.first_step)] = a
    if not latest:
        return 0
    now = dt.datetime.now(dt.UTC)
    with write_transaction(engine) as conn:
        names = sorted({run for run, _, _, _ in latest})
        ids = {r.name: r.id for r in conn.execute(select(Run.name, Run.id).where(Run.name.in_(names)))}
        kept = [a for a in latest.values() if a.run in ids]
        rows = [_row(a, ids[a.run], now) for a in kept]
        missing = sorted(set(names) - set(ids))
        if missing:
            log.info("anomalies of deleted runs not stored: %s", ", ".join(map(repr, missing[:5])))
            if on_missing is not None:
                on_missing(missing)
        if rows:
            keys = [tuple(row[k] for k in _KEY) for row in rows]
            before = _states(conn, keys)
            conn.execute(_upsert(conn), rows)
            after = _states(conn, keys)
            stored = [
                Stored(a, after[key][0], key[0], *before.get(key, (0, None, None))[1:])
                for a, key in zip(kept, keys, strict=True)
            ]
            ask_at_verdicts(conn, stored)  # evidence (every rank's stacks at a hang) while it is there
            if on_stored is not None:
                on_stored(conn, stored)
    return len(rows)


def _states(conn: Connection, keys: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], tuple[int, str, str]]:
    """{(run_id, kind, key, first_step): (id, status, severity)} of the stored rows among `keys`."""
    table = AnomalyRow.__table__.c
    cols = [table[k] for k in _KEY]
    found = conn.execute(
        select(*cols, table.id, table.status, table.severity).where(tuple_(*cols).in_(keys))
    ).all()
    return {tuple(r[:4]): (r.id, r.status, r.severity) for r in found}


def _upsert(conn: Connection) -> Any:
    factory = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    stmt = factory(cast("Table", AnomalyRow.__table__))
    return stmt.on_conflict_do_update(
        index_elements=list(_KEY), set_={name: stmt.excluded[name] for name in _UPDATED}
    )


@dataclass(frozen=True, slots=True)
class OpenRun:
    """A run with open anomalies, as the engine needs it to adopt them."""

    name: str
    world_size: int
    anomalies: list[Anomaly]


def load_open(engine: Engine, max_runs: int = MAX_ADOPTED_RUNS) -> list[OpenRun]:
    """The open anomalies of the most recently seen `max_runs` runs that have any."""
    with engine.connect() as conn:
        runs = conn.execute(
            select(Run.id, Run.name, Run.world_size)
            .where(Run.id.in_(select(AnomalyRow.run_id).where(AnomalyRow.status == "open")))
            .order_by(Run.last_seen_at.desc())
            .limit(max_runs)
        ).all()
        if not runs:
            return []
        by_id = {r.id: OpenRun(r.name, r.world_size, []) for r in runs}
        rows = conn.execute(
            select(*AnomalyRow.__table__.c)
            .where(AnomalyRow.status == "open", AnomalyRow.run_id.in_(list(by_id)))
            .order_by(AnomalyRow.id)
        ).all()
    for row in rows:
        entry = by_id[row.run_id]
        entry.anomalies.append(_anomaly(entry.name, row))
    return list(by_id.values())


def _anomaly(run: str, row: Any) -> Anomaly:
    return Anomaly(
        run=run,
        kind=row.kind,
        key=row.key,
        severity=row.severity,
        summary=row.summary,
        rank=row.rank,
        node=row.node,
        first_step=int(row.first_step),
        last_step=int(row.last_step),
        first_ts=float(row.first_ts),
        last_ts=float(row.last_ts),
        detected_step=int(row.detected_step),
        detected_ts=float(row.detected_ts),
        evidence=dict(row.evidence or {}),
    )
