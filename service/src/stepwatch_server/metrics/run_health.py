"""Run health for Prometheus, computed from the database at scrape time.

A custom collector: every scrape runs a fixed handful of bulk, aggregated queries (the runs seen
recently, their ranks, windowed per-rank aggregates of the step metrics, the latest loss / grad
norm / lr, step rates, open anomalies, non-finite events, module amax) and turns them into gauges.
The windowed ones read only each rank's last steps through the primary keys (`_window`), so their
cost grows with ranks x metrics, never with the length of the run. Nothing is kept in memory between scrapes, so any number of collector processes answer the
same numbers (multi-worker safe by construction) and a restarted collector answers at once.

"Recent" is each rank's last `WINDOW_STEPS` steps of its current incarnation (`AMAX_WINDOW_STEPS`
for the sampled amax). A run is exported while it was seen in the last `ACTIVE_RUN_S`.

Cardinality budget (README, "Prometheus and Grafana"): at most `MAX_RUNS` runs, and per run at most
`PER_RUN_SERIES_BUDGET` series whatever the number of ranks, nodes or modules:

| metric | series per run |
|---|---|
| the run-level gauges (`RUN_GAUGES`) | 9 |
| `stepwatch_run_anomalies_open{kind,severity}` | 10 kinds x 3 severities = 30 |
| `stepwatch_run_nonfinite_events_total` | 1 |
| `stepwatch_node_phase_seconds{node,phase}`, `stepwatch_node_memory_max_bytes{node,memory}` | the `MAX_NODES` slowest nodes x (4 phases + 2 memory kinds) = 192 |
| `stepwatch_rank_slowness_ratio`, `stepwatch_rank_phase_seconds{phase}` | the `TOP_RANKS` slowest ranks x (1 + 4) = 40 |
| `stepwatch_rank_memory_bytes{memory}` | the `TOP_RANKS` ranks using the most memory x 2 = 16 |
| `stepwatch_module_amax{module}` | the `TOP_MODULES` largest = 10 |

Per-step, per-rank history is not for Prometheus: the Grafana dashboards read it from PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import Connection, Engine, and_, func, select

from stepwatch_server.detect.anomalies import KINDS, SEVERITIES
from stepwatch_server.storage.disk import database_bytes
from stepwatch_server.storage.models import METRIC_STAT, Anomaly, Event, Point, Rank, Run, Series, StepRecord
from stepwatch_server.timeline import holding_up

MAX_RUNS = 10
ACTIVE_RUN_S = 3600.0
REPORTING_S = 60.0  # a rank seen within this long counts as reporting
WINDOW_STEPS = 16
LATEST_WINDOW_STEPS = 4  # the latest loss / grad norm / lr is looked for in this many last steps
AMAX_WINDOW_STEPS = 50  # amax is sampled (every 10 steps by default)
TOP_RANKS = 8
MAX_NODES = 32
TOP_MODULES = 10
FP8_E4M3_MAX = 448.0

PHASES = ("data", "forward", "backward", "optimizer")  # time.<phase>_ms
MEMORY = {"allocated": "mem.allocated_mb", "rss": "mem.rss_mb"}
LATEST = ("loss", "grad_norm", "grad_sumsq", "lr")
WINDOWED = tuple(f"time.{p}_ms" for p in (*PHASES, "step")) + tuple(MEMORY.values())
RUN_GAUGES = (
    "world_size",
    "ranks_reporting",
    "last_step",
    "last_seen_timestamp_seconds",
    "loss",
    "grad_norm",
    "learning_rate",
    "steps_per_second",
    "step_time_seconds",
)
PER_RUN_SERIES_BUDGET = (
    len(RUN_GAUGES)
    + len(KINDS) * len(SEVERITIES)
    + 1
    + MAX_NODES * (len(PHASES) + len(MEMORY))
    + TOP_RANKS * (1 + len(PHASES))
    + TOP_RANKS * len(MEMORY)
    + TOP_MODULES
)
_MB = 1024.0 * 1024.0


@dataclass
class _Run:
    id: int
    name: str
    world_size: int
    last_seen: float
    ranks: dict[int, tuple[str, int | None, float, int]] = field(
        default_factory=dict
    )  # node, step, seen, replica
    windowed: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    latest: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    rates: list[float] = field(default_factory=list)
    anomalies: dict[tuple[str, str], int] = field(default_factory=dict)
    nonfinite_events: int = 0
    amax: dict[str, float] = field(default_factory=dict)


def _ts(value: dt.datetime | None) -> float:
    return value.timestamp() if value is not None else float("nan")


def _window(value: Any, window: int, latest: bool = False) -> Any:
    """`value` over one (series, rank)'s last `window` steps of the rank's current incarnation (the
    value at the latest of them when `latest`), as a subquery correlated with `series` and `ranks`.

    Correlated on purpose: each (series, rank) pair is one range scan of the points' primary key
    (series_id, rank, step, incarnation), so a scrape costs the same at step 100 and step 1,000,000;
    a plain join makes PostgreSQL hash-join every point the run ever stored.
    """
    query = select(value).where(
        Point.series_id == Series.id,
        Point.rank == Rank.rank,
        Point.incarnation == Rank.incarnation,
        Point.step > Rank.last_step - window,
    )
    if latest:
        query = query.order_by(Point.step.desc()).limit(1)
    return query.correlate(Series, Rank).scalar_subquery()


def _step_window(value: Any) -> Any:
    """`value` over a rank's last `WINDOW_STEPS` step records (correlated with `ranks`, as `_window`)."""
    return (
        select(value)
        .where(
            StepRecord.run_id == Rank.run_id,
            StepRecord.rank == Rank.rank,
            StepRecord.incarnation == Rank.incarnation,
            StepRecord.step > Rank.last_step - WINDOW_STEPS,
        )
        .correlate(Rank)
        .scalar_subquery()
    )


class RunHealthCollector(Collector):
    """Registered on the /metrics registry; `collect()` reads the database (one connection)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # generated at scrape time: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        with self.engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                # The planner prices the correlated subqueries by their loop count and would spend
                # ~0.4 s JIT-compiling a query that runs in a few ms.
                conn.exec_driver_sql("SET LOCAL jit = off")
            runs = _read(conn)
            size = database_bytes(conn)
        yield GaugeMetricFamily(
            "stepwatch_database_bytes",
            "The database's size on disk (SQLite: the file and its WAL)",
            value=size,
        )
        yield from _families(runs)


def _rows(conn: Connection, statement: Any) -> list[Any]:
    return list(conn.execute(statement))


def _read(conn: Connection) -> list[_Run]:
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=ACTIVE_RUN_S)
    rows = conn.execute(
        select(Run.id, Run.name, Run.world_size, Run.last_seen_at)
        .where(Run.last_seen_at >= since)
        .order_by(Run.last_seen_at.desc(), Run.id.desc())
        .limit(MAX_RUNS)
    ).all()
    runs = {r.id: _Run(r.id, r.name, r.world_size, _ts(r.last_seen_at)) for r in rows}
    if not runs:
        return []
    ids = list(runs)
    for r in _rows(
        conn,
        select(
            Rank.run_id, Rank.rank, Rank.node, Rank.last_step, Rank.last_seen_at, Rank.replica_group
        ).where(Rank.run_id.in_(ids)),
    ):
        run = runs[r.run_id]
        run.ranks[r.rank] = (r.node or "unknown", r.last_step, _ts(r.last_seen_at), r.replica_group)
        run.last_seen = max(run.last_seen, _ts(r.last_seen_at))
    per_rank = and_(Series.run_id.in_(ids), Rank.run_id == Series.run_id)
    metric = and_(per_rank, Series.stat == METRIC_STAT)
    for r in _rows(
        conn,
        select(Series.run_id, Series.name, Rank.rank, _window(func.avg(Point.value), WINDOW_STEPS)).where(
            metric, Series.name.in_(WINDOWED)
        ),
    ):
        if r[3] is not None:
            runs[r.run_id].windowed[r.name][r.rank] = float(r[3])
    for r in _rows(
        conn,
        select(
            Series.run_id, Series.name, Rank.rank, _window(Point.value, LATEST_WINDOW_STEPS, latest=True)
        ).where(metric, Series.name.in_(LATEST)),
    ):
        if r[3] is not None:  # no value in the window (on SQLite, also a NaN: it stores NaN as NULL)
            runs[r.run_id].latest[r.name][r.rank] = float(r[3])
    for r in _rows(
        conn,
        select(
            Rank.run_id,
            _step_window(func.max(StepRecord.step) - func.min(StepRecord.step)),
            _step_window(func.max(StepRecord.ts) - func.min(StepRecord.ts)),
        ).where(Rank.run_id.in_(ids)),
    ):
        if r[1] and r[2] and r[2] > 0:
            runs[r.run_id].rates.append(float(r[1]) / float(r[2]))
    for r in _rows(
        conn,
        select(Anomaly.run_id, Anomaly.kind, Anomaly.severity, func.count())
        .where(Anomaly.run_id.in_(ids), Anomaly.status == "open")
        .group_by(Anomaly.run_id, Anomaly.kind, Anomaly.severity),
    ):
        runs[r.run_id].anomalies[(r.kind, r.severity)] = int(r[3])
    for r in _rows(
        conn,
        select(Event.run_id, func.count())
        .where(Event.run_id.in_(ids), Event.kind == "nonfinite")
        .group_by(Event.run_id),
    ):
        runs[r.run_id].nonfinite_events = int(r[1])
    for r in _rows(
        conn,
        select(Series.run_id, Series.name, func.max(_window(func.max(Point.value), AMAX_WINDOW_STEPS)))
        .where(per_rank, Series.stat == "amax")
        .group_by(Series.run_id, Series.name),
    ):
        runs[r.run_id].amax[r.name] = float("nan") if r[2] is None else float(r[2])
    return list(runs.values())


def _median(values: Any) -> float:
    arr = np.asarray(list(values), dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    return float(np.median(arr)) if arr.size else float("nan")


def _mean(values: Any) -> float:
    arr = np.asarray(list(values), dtype=np.float64)
    return float(arr.mean()) if arr.size else float("nan")


def _nanmean(values: np.ndarray) -> float:
    finite = values[~np.isnan(values)]
    return float(finite.mean()) if finite.size else float("nan")


def _grad_norm(run: _Run) -> float:
    """The model's gradient norm: the square root of the shards' summed squares within a replica
    (DESIGN.md: the agent reports its shard's sum of squares), averaged over replicas; the ranks'
    mean `grad_norm` when no rank sent `grad_sumsq`."""
    sumsq = run.latest.get("grad_sumsq")
    if not sumsq:
        return _mean(run.latest.get("grad_norm", {}).values())
    per_replica: dict[int, float] = defaultdict(float)
    for rank, value in sumsq.items():
        per_replica[run.ranks[rank][3] if rank in run.ranks else rank] += value
    return float(np.sqrt(_mean(per_replica.values())))


class _Families:
    def __init__(self) -> None:
        self.run = {
            name: GaugeMetricFamily(f"stepwatch_run_{name}", doc, labels=["run"])
            for name, doc in (
                ("world_size", "Ranks in the run."),
                ("ranks_reporting", f"Ranks that sent anything in the last {REPORTING_S:.0f} s."),
                ("last_step", "The highest step any rank completed."),
                ("last_seen_timestamp_seconds", "When the collector last heard from the run (Unix time)."),
                ("loss", "The global loss: the mean over ranks of each rank's latest loss."),
                ("grad_norm", "The global gradient norm at the latest step (shards combined)."),
                ("learning_rate", "The learning rate of param group 0 at the latest step (mean over ranks)."),
                ("steps_per_second", f"Steps per second over the last {WINDOW_STEPS} steps (median rank)."),
                (
                    "step_time_seconds",
                    f"Step time: the median over ranks of their mean over the last {WINDOW_STEPS} steps.",
                ),
            )
        }
        self.anomalies = GaugeMetricFamily(
            "stepwatch_run_anomalies_open",
            "Open anomalies of the run by kind and severity.",
            labels=["run", "kind", "severity"],
        )
        self.nonfinite = CounterMetricFamily(
            "stepwatch_run_nonfinite_events",
            "Non-finite events (NaN/Inf seen by an agent) stored for the run.",
            labels=["run"],
        )
        self.node_phase = GaugeMetricFamily(
            "stepwatch_node_phase_seconds",
            f"Per node (the {MAX_NODES} slowest), the mean over its ranks of each phase's time over "
            f"the last {WINDOW_STEPS} steps.",
            labels=["run", "node", "phase"],
        )
        self.node_memory = GaugeMetricFamily(
            "stepwatch_node_memory_max_bytes",
            f"Per node (the {MAX_NODES} slowest), the largest memory use of its ranks (allocated: CUDA, "
            "rss: host).",
            labels=["run", "node", "memory"],
        )
        self.rank_ratio = GaugeMetricFamily(
            "stepwatch_rank_slowness_ratio",
            f"The {TOP_RANKS} ranks that hold the run up most: 1 + how late the rank reaches its step's "
            "sync points (end of data wait, of forward, start of optimizer) after its peers' median / the "
            f"median step time, over the last {WINDOW_STEPS} steps (1.0: on time).",
            labels=["run", "rank", "node"],
        )
        self.rank_phase = GaugeMetricFamily(
            "stepwatch_rank_phase_seconds",
            f"The {TOP_RANKS} slowest ranks: each phase's mean time over the last {WINDOW_STEPS} steps.",
            labels=["run", "rank", "node", "phase"],
        )
        self.rank_memory = GaugeMetricFamily(
            "stepwatch_rank_memory_bytes",
            f"The {TOP_RANKS} ranks using the most memory: their mean over the last {WINDOW_STEPS} steps.",
            labels=["run", "rank", "node", "memory"],
        )
        self.amax = GaugeMetricFamily(
            "stepwatch_module_amax",
            f"The {TOP_MODULES} largest activation amax of tracked modules, max over ranks and the last "
            f"{AMAX_WINDOW_STEPS} steps (FP8 E4M3 headroom in bits: log2({FP8_E4M3_MAX:g} / amax)).",
            labels=["run", "module"],
        )

    def all(self) -> Iterator[Metric]:
        yield from self.run.values()
        yield from (
            self.anomalies,
            self.nonfinite,
            self.node_phase,
            self.node_memory,
            self.rank_ratio,
            self.rank_phase,
            self.rank_memory,
            self.amax,
        )


def _families(runs: list[_Run]) -> Iterator[Metric]:
    f = _Families()
    for run in runs:
        _add_run(f, run)
    yield from f.all()


def _add_run(f: _Families, run: _Run) -> None:
    name = run.name
    now = dt.datetime.now(dt.UTC).timestamp()
    steps = [s for _, s, _, _ in run.ranks.values() if s is not None]
    values = {
        "world_size": float(max(run.world_size, len(run.ranks))),
        "ranks_reporting": float(sum(now - seen <= REPORTING_S for _, _, seen, _ in run.ranks.values())),
        "last_step": float(max(steps)) if steps else float("nan"),
        "last_seen_timestamp_seconds": run.last_seen,
        "loss": _mean(run.latest.get("loss", {}).values()),
        "grad_norm": _grad_norm(run),
        "learning_rate": _mean(run.latest.get("lr", {}).values()),
        "steps_per_second": _median(run.rates),
        "step_time_seconds": _median(run.windowed.get("time.step_ms", {}).values()) / 1000.0,
    }
    for key, value in values.items():
        f.run[key].add_metric([name], value)
    for kind in KINDS:
        for severity in SEVERITIES:
            f.anomalies.add_metric([name, kind, severity], float(run.anomalies.get((kind, severity), 0)))
    f.nonfinite.add_metric([name], float(run.nonfinite_events))
    _add_ranks_and_nodes(f, run)
    top = sorted(run.amax.items(), key=lambda kv: -kv[1] if np.isfinite(kv[1]) else -np.inf)
    for module, amax in top[:TOP_MODULES]:
        f.amax.add_metric([name, module], amax)


def _add_ranks_and_nodes(f: _Families, run: _Run) -> None:
    ranks = sorted(run.ranks)
    if not ranks:
        return
    phase_s = {
        p: np.array([run.windowed[f"time.{p}_ms"].get(r, np.nan) for r in ranks]) / 1000.0 for p in PHASES
    }
    memory_b = {m: np.array([run.windowed[k].get(r, np.nan) for r in ranks]) * _MB for m, k in MEMORY.items()}
    step_s = np.array([run.windowed["time.step_ms"].get(r, np.nan) for r in ranks]) / 1000.0
    # Who holds the run up over the window (stepwatch_server.timeline), not data + forward: a victim of a
    # slow loader waits for it inside DDP's forward, and its forward is the longer one.
    timeline = (phase_s["data"], phase_s["backward"], phase_s["optimizer"], step_s)
    ratio = holding_up(*(t[:, None] for t in timeline))[0][:, 0]
    known = np.isfinite(ratio)
    node_of = [run.ranks[r][0] for r in ranks]
    name = run.name
    slowest = [i for i in np.argsort(-np.nan_to_num(ratio, nan=-np.inf), kind="stable") if known[i]]
    for i in slowest[:TOP_RANKS]:
        labels = [name, str(ranks[i]), node_of[i]]
        f.rank_ratio.add_metric(labels, float(ratio[i]))
        for p in PHASES:
            f.rank_phase.add_metric([*labels, p], float(phase_s[p][i]))
    for m, values in memory_b.items():
        present = np.flatnonzero(~np.isnan(values))
        for i in present[np.argsort(-values[present], kind="stable")][:TOP_RANKS]:
            f.rank_memory.add_metric([name, str(ranks[i]), node_of[i], m], float(values[i]))
    members: dict[str, list[int]] = defaultdict(list)
    for i, node in enumerate(node_of):
        members[node].append(i)
    node_ratio = {node: _nanmean(ratio[idx]) for node, idx in members.items() if known[idx].any()}
    for node in sorted(node_ratio, key=lambda n: -node_ratio[n])[:MAX_NODES]:
        idx = members[node]
        for p in PHASES:
            f.node_phase.add_metric([name, node, p], _nanmean(phase_s[p][idx]))
        for m, values in memory_b.items():
            measured = values[idx][~np.isnan(values[idx])]
            if measured.size:
                f.node_memory.add_metric([name, node, m], float(measured.max()))
