"""The dashboard's endpoints: the runs overview, ranks x steps heatmaps, amax per module.

Sync endpoints (FastAPI runs them in the thread pool), on the read API's connection dependency and
queries. Mounted before the read API's router, whose `/runs/{run:path}` would take these paths.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, Query
from sqlalchemy import Connection
from starlette.responses import Response

from stepwatch_server.auth import ReadAccess
from stepwatch_server.dashboard import answers
from stepwatch_server.dashboard.heatmap import (
    DEFAULT_BUCKETS,
    LATE,
    MAX_BUCKETS,
    MODES,
    TIMELINE,
    heatmap,
    heatmap_from_rollups,
    late_heatmap,
    late_heatmap_from_points,
    rollup_cells,
)
from stepwatch_server.dashboard.summary import runs_overview
from stepwatch_server.detect.detectors.fp8_overflow import E4M3_MAX, E5M2_MAX
from stepwatch_server.errors import RUN_NOT_FOUND, InvalidBatch, NotFound
from stepwatch_server.params import Conn, FromStep, MaxPoints, ToStep
from stepwatch_server.responses import float_list, json_response
from stepwatch_server.runs import queries, rank_rollups, step_rollups
from stepwatch_server.runs.downsample import DEFAULT_MAX_POINTS, downsample
from stepwatch_server.storage.models import METRIC_STAT

router = APIRouter(prefix="/api/v1", tags=["dashboard"])
MAX_TOP = 1_000  # modules a `top` may ask for


@router.get(
    "/dashboard/runs",
    summary="Every run with its verdict, progress, step rate, open anomalies",
    responses={200: {"model": answers.DashboardRunsAnswer}},
)
def dashboard_runs(conn: Conn, reader: ReadAccess) -> Response:
    return json_response({"runs": [r for r in runs_overview(conn) if reader.sees(r["name"])]})


@router.get(
    "/runs/{run:path}/heatmap",
    summary="A metric as ranks x step buckets, relative to the cross-rank median (or absolute)",
    responses={**RUN_NOT_FOUND, 200: {"model": answers.HeatmapAnswer}},
)
def get_heatmap(
    run: str,
    conn: Conn,
    metric: Annotated[str, Query(min_length=1, max_length=200, description="e.g. time.forward_ms; "
                                  f"{LATE}: how late each rank reached its step's sync points (derived)")],
    mode: Annotated[str, Query(description="median: each cell / the bucket's cross-rank median; "
                               "absolute: each cell's maximum", json_schema_extra={"enum": list(MODES)})] = "median",
    buckets: Annotated[int, Query(ge=1, le=MAX_BUCKETS, description="step buckets (columns)")] = DEFAULT_BUCKETS,
    from_step: FromStep = None,
    to_step: ToStep = None,
) -> Response:  # fmt: skip
    if mode not in MODES:
        raise InvalidBatch(
            f"mode: expected one of {', '.join(MODES)}, got {mode!r}", field="mode", code="invalid_parameter"
        )
    found = queries.find_run(conn, run)
    if metric == LATE:
        return json_response(
            {"metric": metric, "mode": "late", **_late(conn, found, buckets, from_step, to_step)}
        )
    ids = queries.series_ids(conn, found.id, METRIC_STAT, metric)
    if not ids:
        raise NotFound(
            f"metric {metric!r} not found in run {run!r}; GET /api/v1/runs/{run} lists them", field="metric"
        )
    wide = rank_rollups.rollup_range(conn, list(ids), from_step, to_step, found.raw_expired_to)
    if wide is not None:  # one rollup row per cell
        cells = heatmap_from_rollups(conn, next(iter(ids)), wide[0], wide[1], buckets, mode)
        return json_response({"metric": metric, "mode": mode, **cells})
    series = queries.read_points(conn, list(ids), None, from_step, to_step)
    return json_response({"metric": metric, "mode": mode, **heatmap(series, buckets, mode)})


def _late(
    conn: Connection, found: Any, buckets: int, from_step: int | None, to_step: int | None
) -> dict[str, Any]:
    """The `LATE` view: the four `TIMELINE` metrics' cells on one grid (from the rank rollups past the
    raw read budget), combined per cell."""
    sids = [next(iter(queries.series_ids(conn, found.id, METRIC_STAT, name)), None) for name in TIMELINE]
    if None in sids:
        missing = [name for name, sid in zip(TIMELINE, sids, strict=True) if sid is None]
        raise NotFound(
            f"{LATE} is derived from {', '.join(TIMELINE)}; run {found.name!r} has no {', '.join(missing)} "
            "(the agent sends them with every step)",
            field="metric",
        )
    ids = [sid for sid in sids if sid is not None]
    found_steps = step_rollups.step_range(conn, ids, from_step, to_step, count_up_to=0)
    if found_steps is None:
        return late_heatmap([])
    first, last, _ = found_steps
    if rank_rollups.rollup_range(conn, ids, from_step, to_step, found.raw_expired_to) is not None:
        return late_heatmap([rollup_cells(conn, sid, first, last, buckets, "median") for sid in ids])  # means
    points = queries.read_points(conn, ids, None, first, last)
    return late_heatmap_from_points(
        [[s for s in points if s.series_id == sid] for sid in ids], first, last, buckets
    )


@router.get(
    "/runs/{run:path}/amax",
    summary="Each tracked module's amax, max over ranks, with the FP8 limits",
    responses={**RUN_NOT_FOUND, 200: {"model": answers.AmaxAnswer}},
)
def get_amax(
    run: str,
    conn: Conn,
    from_step: FromStep = None,
    to_step: ToStep = None,
    max_points: MaxPoints = DEFAULT_MAX_POINTS,
    top: Annotated[
        int | None,
        Query(
            ge=1,
            le=MAX_TOP,
            description="only the `top` modules with the highest amax in the range (max over ranks and steps; "
            "a module with a non-finite one first), in that order where the run has more than `top` "
            "(else every module, by name); absent: every module",
        ),
    ] = None,
) -> Response:
    found = queries.find_run(conn, run)
    ids = queries.series_ids(conn, found.id, "amax", None)
    tracked = len(ids)
    if top is not None and top < tracked:
        ids = _highest(conn, ids, from_step, to_step, top)
    groups = step_rollups.across_ranks(conn, list(ids), from_step, to_step, max_points, means=False)
    tail = step_rollups.read_steps(conn, list(ids), groups.last_group_start(), to_step)  # the latest steps
    modules = []
    for sid, name in ids.items():  # per step (or group of steps): the maximum over ranks
        steps, values = groups.of(sid).peak_curve()
        latest_peak = tail.peak[tail.series_id == sid]
        latest = float_list(latest_peak[-1:])[0] if latest_peak.size else None  # NaN as "NaN", not null
        steps, values = downsample(steps, values, max_points)
        modules.append({"name": name, "steps": steps, "values": float_list(values), "latest": latest})
    return json_response({"e4m3_max": E4M3_MAX, "e5m2_max": E5M2_MAX, "tracked": tracked, "modules": modules})


def _highest(
    conn: Connection, ids: dict[int, str], from_step: int | None, to_step: int | None, top: int
) -> dict[int, str]:
    """The `top` of `ids` (series id -> module) with the highest amax in the range, highest first: a module
    with a non-finite amax before all, then by the highest over ranks and steps, ties by name, then the
    modules with nothing in the range. Each module's peak over exactly the range comes from the fewest
    whole buckets of the rank rollup levels and the step rollups of the steps at its ends (a row a step over
    all ranks; raw values only above the watermark: `rank_rollups.span_peaks`), so a spike of one step on
    one rank counts and a long range reads a few packs a module, not its every step (a model tracking 500
    Linear modules: bench/README.md)."""
    found = step_rollups.step_range(conn, list(ids), from_step, to_step, count_up_to=0)
    key = {sid: (2, 0.0, name) for sid, name in ids.items()}  # nothing in the range
    if found is not None:
        series, highest, nonfinite = rank_rollups.span_peaks(conn, list(ids), found[0], found[1])
        for sid, peak, bad in zip(series.tolist(), highest.tolist(), nonfinite.tolist(), strict=True):
            if bad or not math.isnan(peak):
                key[sid] = (0, 0.0, ids[sid]) if bad else (1, -peak, ids[sid])
    return {sid: ids[sid] for sid in sorted(ids, key=key.__getitem__)[:top]}
