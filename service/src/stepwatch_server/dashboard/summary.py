"""The runs overview: every run with its health verdict, size, progress, pace and open anomalies.

Five bulk queries for all runs together (no query per run): the run and rank summary of the read
API (`runs.queries.run_summaries`), the anomalies grouped by run, status and severity, the
recent step timestamps of each run's lowest rank, from which the step rate is taken (its rows, and the
blocks of a run whose newest steps are compacted, decoded together), and the ranks
whose agent closed its session after its last step (a run all of whose ranks did is finished). The verdict
follows the health rule of detect/routes.py: the worst severity among the open anomalies.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np
from sqlalchemy import Connection, and_, func, select

from stepwatch_server.detect.verdict import verdict as verdict_of
from stepwatch_server.runs import queries
from stepwatch_server.storage import blocks
from stepwatch_server.storage.blocks import BLOCK_STEPS
from stepwatch_server.storage.models import Anomaly, Event, Rank, Run, StepRecord, ValueBlock

RATE_WINDOW_STEPS = 100  # the step rate is measured over at most this many recent steps
LIVE_WINDOW_S = 30.0  # a run heard from within this many seconds is shown as live
_TIMES = np.array([blocks.STEP_TIMES], dtype=np.int64)


def _anomaly_counts(conn: Connection) -> dict[int, dict[str, Any]]:
    rows = conn.execute(
        select(
            Anomaly.run_id,
            Anomaly.status,
            Anomaly.severity,
            func.count().label("n"),
            func.max(Anomaly.updated_at).label("updated_at"),
        ).group_by(Anomaly.run_id, Anomaly.status, Anomaly.severity)
    )
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        entry = out.setdefault(r.run_id, {"open": 0, "total": 0, "severities": [], "updated_at": None})
        entry["total"] += r.n
        if r.status == "open":
            entry["open"] += r.n
            entry["severities"].append(r.severity)
        if entry["updated_at"] is None or (r.updated_at is not None and r.updated_at > entry["updated_at"]):
            entry["updated_at"] = r.updated_at
    return out


def _step_rates(conn: Connection) -> dict[int, float]:
    """Steps per second over each run's last RATE_WINDOW_STEPS steps, on its lowest rank, from its step end
    times: the `steps` rows, and the blocks where the run's newest steps are compacted (a run silent for a
    day: runs/compaction.py)."""
    lowest = select(Rank.run_id, func.min(Rank.rank).label("rank")).group_by(Rank.run_id).subquery()
    window = and_(
        lowest.c.run_id == Rank.run_id, lowest.c.rank == Rank.rank, Rank.last_step.is_not(None)
    )  # the lowest rank of each run, its current incarnation and newest step
    rows = conn.execute(
        select(
            StepRecord.run_id,
            func.min(StepRecord.step),
            func.max(StepRecord.step),
            func.min(StepRecord.ts),
            func.max(StepRecord.ts),
        )
        .join(Rank, and_(Rank.run_id == StepRecord.run_id, Rank.rank == StepRecord.rank))
        .join(lowest, window)
        .where(
            StepRecord.incarnation == Rank.incarnation, StepRecord.step > Rank.last_step - RATE_WINDOW_STEPS
        )
        .group_by(StepRecord.run_id)
    ).all()
    found = {int(run_id): (int(a), int(b), float(ta), float(tb)) for run_id, a, b, ta, tb in rows}
    for run_id, span in _compacted_spans(conn, lowest, window).items():
        found[run_id] = _merge([span, found[run_id]]) if run_id in found else span
    return {
        run_id: (last - first) / (last_ts - first_ts)
        for run_id, (first, last, first_ts, last_ts) in found.items()
        if last > first and last_ts > first_ts
    }


def _compacted_spans(conn: Connection, lowest: Any, window: Any) -> dict[int, tuple[int, int, float, float]]:
    """Per run whose newest steps reach into its blocks, (first step, last step, first time, last time) of
    the step end times its blocks hold in the window: one query and one decode for every run."""
    found = conn.execute(
        select(ValueBlock.run_id, Rank.last_step, ValueBlock.incarnation, blocks.DATA)
        .join(Rank, and_(Rank.run_id == ValueBlock.run_id, Rank.rank == ValueBlock.rank))
        .join(lowest, window)
        .join(Run, Run.id == ValueBlock.run_id)
        .where(
            ValueBlock.incarnation == Rank.incarnation,
            Run.compacted_to > Rank.last_step - RATE_WINDOW_STEPS,
            ValueBlock.bucket >= (Rank.last_step - RATE_WINDOW_STEPS + 1) // BLOCK_STEPS,
        )
    ).all()
    if not found:
        return {}
    # The blocks' step end times, each tagged with its block's index (in the column decode_rows gives the rank).
    _, owner, step, _, ts = blocks.decode_rows(
        [(i, inc, data) for i, (_, _, inc, data) in enumerate(found)], _TIMES
    )
    last = np.array([int(row[1] or 0) for row in found], dtype=np.int64)[owner]  # not NULL: `window`
    keep = (step > last - RATE_WINDOW_STEPS) & (step <= last)
    run_of = np.array([int(row[0]) for row in found], dtype=np.int64)[owner][keep]
    runs, which = np.unique(run_of, return_inverse=True)
    step, ts = step[keep], ts[keep]
    spans = [np.full(runs.size, np.iinfo(np.int64).max), np.full(runs.size, np.iinfo(np.int64).min)]
    times = [np.full(runs.size, np.inf), np.full(runs.size, -np.inf)]
    np.minimum.at(spans[0], which, step)
    np.maximum.at(spans[1], which, step)
    np.minimum.at(times[0], which, ts)
    np.maximum.at(times[1], which, ts)
    return {
        int(r): (int(spans[0][i]), int(spans[1][i]), float(times[0][i]), float(times[1][i]))
        for i, r in enumerate(runs.tolist())
    }


def _merge(spans: list[tuple[int, int, float, float]]) -> tuple[int, int, float, float]:
    return (
        min(s[0] for s in spans),
        max(s[1] for s in spans),
        min(s[2] for s in spans),
        max(s[3] for s in spans),
    )


def _ended(conn: Connection) -> dict[int, int]:
    """Per run, how many ranks' agents closed their session (session_end) at or after the rank's last step,
    in its current incarnation: a run whose every rank did is finished, not silent."""
    rows = conn.execute(
        select(Event.run_id, func.count(func.distinct(Event.rank)).label("n"))
        .join(
            Rank,
            and_(Rank.run_id == Event.run_id, Rank.rank == Event.rank, Rank.incarnation == Event.incarnation),
        )
        .where(Event.kind == "session_end", Event.step >= func.coalesce(Rank.last_step, 0))
        .group_by(Event.run_id)
    )
    return {r.run_id: int(r.n) for r in rows}


def runs_overview(conn: Connection, name: str | None = None) -> list[dict[str, Any]]:
    """One row per run (or only run `name`), most recently seen first."""
    run_id = None if name is None else queries.find_run(conn, name).id
    ids = {n: i for n, i in conn.execute(select(Run.name, Run.id))} if run_id is None else {name: run_id}
    anomalies = _anomaly_counts(conn)
    rates = _step_rates(conn)
    ended = _ended(conn)
    now = dt.datetime.now(dt.UTC)
    out = []
    for run in queries.run_summaries(conn, run_id):
        rid = ids[run["name"]]
        counts = anomalies.get(rid, {"open": 0, "total": 0, "severities": [], "updated_at": None})
        seen = run["last_seen_at"]
        finished = run["ranks"] > 0 and ended.get(rid, 0) >= run["ranks"]
        out.append(
            {
                **run,
                "verdict": verdict_of(counts["severities"]),
                "open_anomalies": counts["open"],
                "anomalies": counts["total"],
                "anomalies_updated_at": counts["updated_at"],
                "step_rate": rates.get(rid),
                "live": not finished and seen is not None and (now - seen).total_seconds() < LIVE_WINDOW_S,
                "finished": finished,
                # How long it ran, from its first batch to its last (the collector's clock): finished runs.
                "duration_s": (seen - run["created_at"]).total_seconds() if finished and seen else None,
            }
        )
    return out
