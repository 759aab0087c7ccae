"""The runs API: reading runs, ranks, series, tensor statistics, step times, fingerprints and events
(`router`, behind the read check), and deleting a run (`write_router`: a write token for the run).

Endpoints are sync functions, so FastAPI runs them (and their queries) in the thread pool. Run
names may contain '/', so `{run:path}` is used and the sub-resources are declared first.
Non-finite values are written as "NaN", "Infinity" and "-Infinity", as in the ingest format.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy import Connection
from starlette.responses import Response

from stepwatch_server.auth import Grant, ReadAccess, check_write, write_access
from stepwatch_server.errors import RUN_NOT_FOUND, ApiError, ErrorAnswer, InvalidParameter, NotFound
from stepwatch_server.ingest.schema import EVENT_KINDS, MAX_WORLD_SIZE
from stepwatch_server.params import Conn, FromStep, MaxPoints, ToStep
from stepwatch_server.responses import float_list, json_response
from stepwatch_server.runs import answers, deletion, queries, rank_rollups, step_rollups
from stepwatch_server.runs.downsample import DEFAULT_MAX_POINTS, downsample
from stepwatch_server.storage.models import METRIC_STAT

router = APIRouter(prefix="/api/v1", tags=["runs"])
write_router = APIRouter(prefix="/api/v1", tags=["runs"])
log = logging.getLogger(__name__)

MAX_EVENTS = 10_000


RankNumber = Annotated[int | None, Query(ge=0, lt=MAX_WORLD_SIZE, description="one rank")]
_RANK_DIGITS = "[0-9]{1,6}"  # a rank is below MAX_WORLD_SIZE (131,072)
RankParam = Annotated[
    str,
    Query(
        description="a rank number, `all` (each rank), `mean` (over ranks per step), or `global` (metric "
        "grad_norm only: the model's norm, the shards' `grad_sumsq` combined per step)",
        pattern=f"^(all|mean|global|{_RANK_DIGITS})$",
    ),
]
RankOrAll = Annotated[
    str, Query(description="a rank number or `all` (each rank)", pattern=f"^(all|{_RANK_DIGITS})$")
]
GLOBAL_METRICS = ("grad_norm",)


def _rank_filter(rank: str, allow_mean: bool = True) -> tuple[int | None, bool]:
    """(rank to filter on or None for all, whether to average over ranks)."""
    if rank == "all":
        return None, False
    if rank == "mean" and allow_mean:
        return None, True
    if rank.isdigit() and len(rank) <= 6:  # a rank the run does not have reads nothing
        return int(rank), False
    choices = "a rank number, 'all' or 'mean'" if allow_mean else "a rank number or 'all'"
    raise InvalidParameter(f"rank: expected {choices}, got {rank!r}", field="rank")


def _shape(
    series: list[queries.RankSeries], max_points: int, names: dict[int, str] | None = None
) -> list[dict[str, Any]]:
    out = []
    for s in series:
        steps, values = downsample(s.steps, s.values, max_points)
        entry: dict[str, Any] = {"rank": s.rank, "steps": steps, "values": float_list(values)}
        if names is not None:
            entry = {"name": names[s.series_id], **entry}
        out.append(entry)
    return out


@router.get(
    "/runs", summary="All runs, most recently seen first", responses={200: {"model": answers.RunsAnswer}}
)
def list_runs(conn: Conn, reader: ReadAccess) -> Response:
    return json_response({"runs": [r for r in queries.run_summaries(conn) if reader.sees(r["name"])]})


@router.get(
    "/runs/{run:path}/ranks",
    summary="Per-rank state: node, progress, heartbeat, step time",
    responses={**RUN_NOT_FOUND, 200: {"model": answers.RanksAnswer}},
)
def list_ranks(run: str, conn: Conn) -> Response:
    found = queries.find_run(conn, run)
    return json_response(
        {"run": found.name, "world_size": found.world_size, "ranks": queries.rank_states(conn, found.id)}
    )


@router.get(
    "/runs/{run:path}/series",
    summary="A metric per rank (downsampled, extremes kept)",
    responses={**RUN_NOT_FOUND, 200: {"model": answers.SeriesAnswer}},
)
def get_series(
    run: str,
    conn: Conn,
    metric: Annotated[str, Query(min_length=1, max_length=200, description="metric name, e.g. loss")],
    rank: RankParam = "all",
    from_step: FromStep = None,
    to_step: ToStep = None,
    max_points: MaxPoints = DEFAULT_MAX_POINTS,
) -> Response:
    """At most `max_points` points per series, each bucket of steps keeping its minimum and maximum.
    With `rank=all`, a range holding more than 200,000 values over all ranks is read from the per-rank
    rollups: each of `max_points / 2` columns gives its exact lowest value at its first step and its
    highest at its middle step (NaN there when it holds a non-finite value)."""
    found = queries.find_run(conn, run)
    if rank == "global":
        return _global_norm(conn, found, metric, from_step, to_step, max_points)
    rank_id, mean = _rank_filter(rank)
    ids = queries.series_ids(conn, found.id, METRIC_STAT, metric)
    if not ids:
        available, _ = queries.series_names(conn, found.id)
        shown = ", ".join(available[:30]) or "none yet"
        raise NotFound(f"metric {metric!r} not found in run {run!r}; available: {shown}", field="metric")
    if mean:  # from the step rollups, grouped in the database (runs/step_rollups.py)
        steps, values = step_rollups.across_ranks(
            conn, list(ids), from_step, to_step, max_points
        ).mean_curve()
        shaped = [{"rank": "mean", "steps": steps, "values": float_list(values)}]
        return json_response({"metric": metric, "series": shaped})
    wide = rank_rollups.rollup_range(
        conn, list(ids), from_step, to_step, found.raw_expired_to, rank_id is None
    )
    if wide is not None:
        curves = rank_rollups.rank_curves(conn, next(iter(ids)), *wide, max_points)
        wide_shaped: list[dict[str, Any]] = [
            {"rank": r, "steps": steps, "values": float_list(values)}
            for r, steps, values in curves
            if rank_id is None or r == rank_id
        ]
        return json_response({"metric": metric, "series": wide_shaped})
    series = queries.read_points(conn, list(ids), rank_id, from_step, to_step)
    return json_response({"metric": metric, "series": _shape(series, max_points)})


def _global_norm(
    conn: Connection, found: Any, metric: str, from_step: int | None, to_step: int | None, max_points: int
) -> Response:
    """The model's gradient norm per step: every rank sends its shard's sum of squares (`grad_sumsq`,
    replicated parameters counted once per replica), so a replica's total is the sum over its shards,
    and over all reporting ranks it is num_shards x their mean (every replica holds the same gradients)."""
    if metric not in GLOBAL_METRICS:
        raise InvalidParameter(
            f"rank=global combines shards of a gradient norm: metric must be one of {list(GLOBAL_METRICS)}, "
            f"got {metric!r} (use rank=mean for an average over ranks)",
            field="rank",
        )
    shards = queries.num_shards(conn, found.id)
    ids = queries.series_ids(conn, found.id, METRIC_STAT, "grad_sumsq")
    if ids:
        steps, means = step_rollups.across_ranks(conn, list(ids), from_step, to_step, max_points).mean_curve()
        with np.errstate(invalid="ignore"):
            values = np.sqrt(shards * np.asarray(means, dtype=np.float64))
    elif shards == 1 and (ids := queries.series_ids(conn, found.id, METRIC_STAT, metric)):
        # No sums of squares (a sender other than the agent): unsharded ranks all hold the model's norm.
        steps, values = step_rollups.across_ranks(
            conn, list(ids), from_step, to_step, max_points
        ).mean_curve()
    else:
        raise NotFound(
            f"run {found.name!r} has no grad_sumsq (each shard's sum of squares, sent by the agent with "
            f"grad_norm): its {shards} shards cannot be combined",
            field="metric",
        )
    shaped = [{"rank": "global", "num_shards": shards, "steps": steps, "values": float_list(values)}]
    return json_response({"metric": metric, "series": shaped})


@router.get(
    "/runs/{run:path}/tensors",
    summary="Per-module statistics (amax, grad_norm) per rank",
    responses={**RUN_NOT_FOUND, 200: {"model": answers.TensorsAnswer}},
)
def get_tensors(
    run: str,
    conn: Conn,
    stat: Annotated[str, Query(min_length=1, max_length=64, description="amax or grad_norm")] = "amax",
    name: Annotated[str | None, Query(max_length=200, description="module/parameter; omitted: all")] = None,
    rank: RankOrAll = "all",
    from_step: FromStep = None,
    to_step: ToStep = None,
    max_points: MaxPoints = DEFAULT_MAX_POINTS,
) -> Response:
    found = queries.find_run(conn, run)
    rank_id, _ = _rank_filter(rank, allow_mean=False)
    ids = queries.series_ids(conn, found.id, stat, name)
    if name is not None and not ids:
        raise NotFound(f"no {stat!r} statistics for {name!r} in run {run!r}", field="name")
    series = queries.read_points(conn, list(ids), rank_id, from_step, to_step)
    return json_response({"stat": stat, "series": _shape(series, max_points, names=ids)})


@router.get(
    "/runs/{run:path}/steps",
    summary="When each rank finished each step (Unix seconds)",
    responses={**RUN_NOT_FOUND, 200: {"model": answers.StepsAnswer}},
)
def get_steps(
    run: str,
    conn: Conn,
    rank: RankOrAll = "all",
    from_step: FromStep = None,
    to_step: ToStep = None,
    max_points: MaxPoints = DEFAULT_MAX_POINTS,
) -> Response:
    found = queries.find_run(conn, run)
    rank_id, _ = _rank_filter(rank, allow_mean=False)
    out = []
    for s in queries.read_steps(conn, found.id, rank_id, from_step, to_step):
        keep = np.unique(
            np.linspace(0, s.steps.shape[0] - 1, min(max_points, s.steps.shape[0])).astype(np.int64)
        )
        out.append({"rank": s.rank, "steps": s.steps[keep], "timestamps": s.values[keep]})
    return json_response({"series": out})


@router.get(
    "/runs/{run:path}/fingerprints",
    summary="Parameter fingerprints per rank",
    responses={**RUN_NOT_FOUND, 200: {"model": answers.FingerprintsAnswer}},
)
def get_fingerprints(run: str, conn: Conn, from_step: FromStep = None, to_step: ToStep = None) -> Response:
    found = queries.find_run(conn, run)
    return json_response({"series": queries.read_fingerprints(conn, found.id, from_step, to_step)})


@router.get(
    "/runs/{run:path}/events",
    summary="Events (nonfinite, phase_start, phase_end, note, session_end)",
    responses={**RUN_NOT_FOUND, 200: {"model": answers.EventsAnswer}},
)
def get_events(
    run: str,
    conn: Conn,
    kind: Annotated[str | None, Query(description=", ".join(sorted(EVENT_KINDS)))] = None,
    rank: RankNumber = None,
    from_step: FromStep = None,
    to_step: ToStep = None,
    limit: Annotated[int, Query(ge=1, le=MAX_EVENTS)] = 1000,
) -> Response:
    found = queries.find_run(conn, run)
    return json_response(
        {"events": queries.read_events(conn, found.id, kind, rank, from_step, to_step, limit)}
    )


@write_router.delete(
    "/runs/{run:path}",
    summary="Delete a run and every row of it (write scope)",
    responses={
        **RUN_NOT_FOUND,
        200: {"model": answers.RunDeleted},
        409: {"model": ErrorAnswer, "description": "The run is live (`run_live`); `force=true` deletes it."},
    },
)
def delete_run(
    run: str,
    request: Request,
    grant: Annotated[Grant | None, Depends(write_access)],
    force: Annotated[bool, Query(description="delete a run heard from within the last 30 s too")] = False,
) -> Response:
    """Removes the run in short transactions (runs/deletion.py) and answers once it is gone, with the rows
    removed per table. A live run is refused unless `force`: its next batch would create it again."""
    check_write(grant, run)
    engine = request.app.state.engine
    with engine.connect() as conn:
        found = deletion.find(conn, run)
        ago = None if found is None else deletion.live_for(conn, found)
    if found is None:
        raise NotFound(f"run {run!r} not found; GET /api/v1/runs lists the runs", field="run")
    if ago is not None and not force:
        raise ApiError(
            f"run {run!r} is live (its last batch {ago:.0f} s ago): stop its training first, or add "
            "force=true (its next batch would create it again, as a new run of the same name)",
            field="force",
            code="run_live",
            status=409,
        )
    started = time.monotonic()
    deleted = deletion.delete_run(engine, found)
    request.app.state.writer.forget_run(found.name, found.id)
    log.info("deleted run %r (id %d): %s rows", found.name, found.id, f"{sum(deleted.values()):,}")
    return json_response(
        {"run": found.name, "deleted": deleted, "seconds": round(time.monotonic() - started, 3)}
    )


@router.get(
    "/runs/{run:path}",
    summary="One run: summary, metric and tensor names, restarts",
    responses={**RUN_NOT_FOUND, 200: {"model": answers.RunAnswer}},
)
def get_run(run: str, conn: Conn) -> Response:
    found = queries.find_run(conn, run)
    summary = queries.run_summaries(conn, found.id)[0]
    metrics, tensors = queries.series_names(conn, found.id)
    expired = found.raw_expired_to
    return json_response(
        {
            **summary,
            "metrics": metrics,
            "tensors": tensors,
            "restarts": queries.restarts(conn, found.id),
            "raw_from_step": None if expired is None else int(expired) + 1,
            "compacted_to": found.compacted_to,
        }
    )
