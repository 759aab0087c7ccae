"""The five stepwatch dashboards, as code. `generate.py` writes them to dashboards/*.json.

Live aggregates come from Prometheus (the run-health gauges and self-metrics of /metrics, with the
cardinality budget of metrics/run_health.py); per-step, per-rank history comes from PostgreSQL
through the SQL of panels.py. Each dashboard has a stable uid, a Prometheus and a PostgreSQL
datasource variable, and (except Collector and Scale) a `run` variable read from PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Callable

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, VariableRefresh, VariableSort

from stepwatch_server.grafana.panels import (
    POSTGRES,
    POSTGRES_TYPE,
    PROMETHEUS_TYPE,
    RUN_ID,
    Sql,
    prom_stat,
    prom_table,
    prom_timeseries,
    promql,
    sql_table,
    sql_timeseries,
    step_metric_sql,
)

TAGS = ["stepwatch"]
RUN = 'run="$run"'
RATE = "$__rate_interval"
PHASES = ("data", "forward", "backward", "optimizer")
ANOMALIES_SQL = f"""
    SELECT a.first_ts AS time, coalesce(a.resolved_ts, a.last_ts) AS timeend,
           a.kind || ' (' || a.severity || '): ' || a.summary AS text, a.kind AS tags
    FROM anomalies a
    WHERE a.run_id = {RUN_ID} AND a.first_ts <= $__unixEpochTo() AND a.last_ts >= $__unixEpochFrom()
    ORDER BY a.first_ts
"""


def _base(uid: str, title: str, description: str, run_variable: bool = True) -> dashboard.Dashboard:
    board = (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type(PROMETHEUS_TYPE))
        .with_variable(dashboard.DatasourceVariable("postgres").label("PostgreSQL").type(POSTGRES_TYPE))
    )
    if run_variable:
        board = board.with_variable(
            dashboard.QueryVariable("run")
            .label("Run")
            .datasource(POSTGRES)
            .query("SELECT name FROM runs ORDER BY last_seen_at DESC")
            .refresh(VariableRefresh.ON_DASHBOARD_LOAD)
        )
    return board


def run_overview() -> dashboard.Dashboard:
    anomalies = (
        dashboard.AnnotationQuery()
        .name("Anomalies")
        .datasource(POSTGRES)
        .enable(True)
        .icon_color("red")
        .target(Sql(ANOMALIES_SQL, "table", "Anomalies"))  # type: ignore[arg-type]
    )
    return (
        _base(
            "stepwatch-run-overview", "stepwatch / Run overview", "One run: loss, gradients, pace, anomalies."
        )
        .annotation(anomalies)
        .with_row(dashboard.Row("Now (Prometheus)"))
        .with_panel(prom_stat("Last step", "none", f"stepwatch_run_last_step{{{RUN}}}"))
        .with_panel(prom_stat("Steps / s", "none", f"stepwatch_run_steps_per_second{{{RUN}}}"))
        .with_panel(prom_stat("Step time", "s", f"stepwatch_run_step_time_seconds{{{RUN}}}"))
        .with_panel(prom_stat("Loss", "none", f"stepwatch_run_loss{{{RUN}}}"))
        .with_panel(prom_stat("Ranks reporting", "none", f"stepwatch_run_ranks_reporting{{{RUN}}}", width=2))
        .with_panel(prom_stat("World size", "none", f"stepwatch_run_world_size{{{RUN}}}", width=2))
        .with_panel(
            prom_stat("Open anomalies", "none", f"sum(stepwatch_run_anomalies_open{{{RUN}}})", width=4)
        )
        .with_row(dashboard.Row("Per step (PostgreSQL)"))
        .with_panel(sql_timeseries("Loss (mean over ranks)", "none", step_metric_sql(("loss",))))
        .with_panel(
            sql_timeseries(
                "Gradient norm (the model's)",
                "none",
                step_metric_sql(("grad_sumsq",), "sqrt(max(r.num_shards) * avg(p.value)) AS value"),
                description=(
                    "The model's gradient norm at optimizer.step(): each rank's sum of squares of its "
                    "shard's gradients, combined over the shards of a replica (FSDP, TP); on DDP, every "
                    "rank's own norm."
                ),
            )
        )
        .with_panel(sql_timeseries("Learning rate", "none", step_metric_sql(("lr",))))
        .with_panel(
            sql_timeseries(
                "Step time (mean and slowest rank)",
                "ms",
                step_metric_sql(("time.step_ms",), "avg(p.value) AS mean, max(p.value) AS slowest"),
            )
        )
        .with_row(dashboard.Row("Pace (Prometheus)"))
        .with_panel(
            prom_timeseries(
                "Throughput",
                "none",
                promql(f"stepwatch_run_steps_per_second{{{RUN}}}", "steps / s"),
                promql(f"deriv(stepwatch_run_last_step{{{RUN}}}[5m])", "steps / s (5 min)", "B"),
            )
        )
        .with_panel(
            prom_timeseries(
                "Loss and gradient norm (live)",
                "none",
                promql(f"stepwatch_run_loss{{{RUN}}}", "loss"),
                promql(f"stepwatch_run_grad_norm{{{RUN}}}", "grad norm", "B"),
            )
        )
        .with_panel(
            sql_table(
                "Anomalies",
                f"""
                SELECT a.status, a.severity, a.kind, a.rank, a.node, a.first_step, a.last_step, a.summary
                FROM anomalies a WHERE a.run_id = {RUN_ID}
                ORDER BY a.status DESC, a.last_ts DESC LIMIT 200
                """,
            )
        )
    )


def ranks() -> dashboard.Dashboard:
    per_rank = "'rank ' || p.rank"
    return (
        _base("stepwatch-ranks", "stepwatch / Ranks", "Phase times per rank and node, stragglers, memory.")
        .with_variable(
            dashboard.QueryVariable("rank")
            .label("Ranks")
            .datasource(POSTGRES)
            .query(f"SELECT rank FROM ranks WHERE run_id = {RUN_ID} ORDER BY rank")
            .multi(True)
            .include_all(True)
            .sort(VariableSort.NUMERICAL_ASC)
            .refresh(VariableRefresh.ON_DASHBOARD_LOAD)
        )
        .with_row(dashboard.Row("Slowest ranks and nodes (Prometheus, within the cardinality budget)"))
        .with_panel(
            prom_timeseries(
                "Slowest ranks: data + forward vs the median rank",
                "x",
                promql(f"stepwatch_rank_slowness_ratio{{{RUN}}}", "rank {{rank}} ({{node}})"),
                description="A straggler is slower in data or forward; its peers wait for it in backward.",
            )
        )
        .with_panel(
            prom_table(
                "Slowest ranks: phase times",
                f"stepwatch_rank_phase_seconds{{{RUN}}}",
                description="The slowest ranks' mean phase times over their last steps.",
            )
        )
        .with_panel(
            prom_timeseries(
                "Nodes: data + forward time",
                "s",
                promql(
                    f'sum by (node) (stepwatch_node_phase_seconds{{{RUN}, phase=~"data|forward"}})',
                    "{{node}}",
                ),
            )
        )
        .with_panel(
            prom_timeseries(
                "Nodes: largest memory",
                "bytes",
                promql(f"stepwatch_node_memory_max_bytes{{{RUN}}}", "{{node}} {{memory}}"),
            )
        )
        .with_panel(
            prom_timeseries(
                "Ranks using the most memory",
                "bytes",
                promql(f"stepwatch_rank_memory_bytes{{{RUN}}}", "rank {{rank}} {{memory}}"),
            )
        )
        .with_row(dashboard.Row("Per step, chosen ranks (PostgreSQL)"))
        .with_panel(
            sql_timeseries(
                "Data + forward time per rank",
                "ms",
                step_metric_sql(
                    ("time.data_ms", "time.forward_ms"),
                    "sum(p.value) / count(DISTINCT p.step) AS value",
                    per_rank,
                    chosen_ranks=True,
                ),
            )
        )
        .with_panel(
            sql_timeseries(
                "Phase times (mean over chosen ranks)",
                "ms",
                step_metric_sql(tuple(f"time.{p}_ms" for p in PHASES), series="s.name", chosen_ranks=True),
            )
        )
        .with_panel(
            sql_timeseries(
                "Forward time per node",
                "ms",
                step_metric_sql(("time.forward_ms",), series="coalesce(r.node, 'unknown')"),
            )
        )
        .with_panel(
            sql_timeseries(
                "Memory per rank (host RSS, CUDA allocated)",
                "decmbytes",
                step_metric_sql(
                    ("mem.rss_mb", "mem.allocated_mb"),
                    "max(p.value) AS value",
                    f"{per_rank} || ' ' || s.name",
                    chosen_ranks=True,
                ),
            )
        )
        .with_panel(
            sql_table(
                "Ranks",
                f"""
                SELECT r.rank, r.node, r.last_step, r.phase, r.incarnation, r.last_heartbeat_at, r.last_seen_at
                FROM ranks r WHERE r.run_id = {RUN_ID} ORDER BY r.rank
                """,
            )
        )
    )


def numerics() -> dashboard.Dashboard:
    amax_sql = f"""
        SELECT $__unixEpochGroupAlias(st.ts, $__interval), s.name AS metric, {{value}} AS value
        FROM points p
        JOIN series s ON s.id = p.series_id
        JOIN steps st ON st.run_id = s.run_id AND st.rank = p.rank AND st.step = p.step
             AND st.incarnation = p.incarnation
        WHERE s.run_id = {RUN_ID} AND s.stat = 'amax' AND $__unixEpochFilter(st.ts)
          AND p.value > 0 AND p.value < 'Infinity'::float8
        GROUP BY 1, 2 ORDER BY 1
    """
    return (
        _base("stepwatch-numerics", "stepwatch / Numerics", "Activation amax, FP8 headroom, NaN/Inf.")
        .with_row(dashboard.Row("Now (Prometheus)"))
        .with_panel(
            prom_timeseries(
                "Largest activation amax (top modules)",
                "none",
                promql(f"stepwatch_module_amax{{{RUN}}}", "{{module}}"),
            )
        )
        .with_panel(
            prom_timeseries(
                "FP8 E4M3 headroom (bits)",
                "none",
                promql(f"log2(448 / stepwatch_module_amax{{{RUN}}})", "{{module}}"),
                description="log2(448 / amax): how many doublings each module's amax can take before "
                "it overflows FP8 E4M3 at a scale of 1.",
            )
        )
        .with_panel(
            prom_stat("Non-finite events", "none", f"stepwatch_run_nonfinite_events_total{{{RUN}}}", width=6)
        )
        .with_panel(
            prom_stat(
                "Open non-finite / FP8 anomalies",
                "none",
                f'sum(stepwatch_run_anomalies_open{{{RUN}, kind=~"nonfinite|fp8_overflow_risk|divergence"}})',
                width=6,
            )
        )
        .with_row(dashboard.Row("Per step (PostgreSQL)"))
        .with_panel(
            sql_timeseries(
                "Activation amax per module (max over ranks)", "none", amax_sql.format(value="max(p.value)")
            )
        )
        .with_panel(
            sql_timeseries(
                "FP8 E4M3 headroom per module (bits)",
                "none",
                amax_sql.format(value="log(448 / max(p.value)) / log(2)"),
            )
        )
        .with_panel(
            sql_timeseries(
                "Non-finite flags (rank-steps flagged)",
                "none",
                step_metric_sql(
                    ("nonfinite.loss", "nonfinite.grads", "nonfinite.activations"),
                    "sum(p.value) AS value",
                    "s.name",
                ),
            )
        )
        .with_panel(
            sql_table(
                "Non-finite events",
                f"""
                SELECT to_timestamp(e.ts) AS time, e.step, e.rank, e.data->>'module' AS module,
                       e.data->>'where' AS "where"
                FROM events e WHERE e.run_id = {RUN_ID} AND e.kind = 'nonfinite'
                ORDER BY e.step, e.rank LIMIT 500
                """,
            )
        )
    )


def collector() -> dashboard.Dashboard:
    return (
        _base(
            "stepwatch-collector",
            "stepwatch / Collector",
            "The collector itself: ingest, detection, alert deliveries.",
            run_variable=False,
        )
        .with_panel(prom_stat("Collectors up", "none", 'sum(up{job=~"stepwatch.*"})'))
        .with_panel(prom_stat("Detection queue", "none", "sum(stepwatch_detection_queue_depth_batches)"))
        .with_panel(prom_stat("Scrape time", "s", 'max(scrape_duration_seconds{job=~"stepwatch.*"})'))
        .with_panel(
            prom_timeseries(
                "Batches ingested / s",
                "none",
                promql(f"sum by (result) (rate(stepwatch_ingest_batches_total[{RATE}]))", "{{result}}"),
            )
        )
        .with_panel(
            prom_timeseries(
                "Values / s and bytes / s",
                "none",
                promql(f"sum(rate(stepwatch_ingest_values_total[{RATE}]))", "values / s"),
                promql(f"sum(rate(stepwatch_ingest_received_bytes_total[{RATE}]))", "bytes / s", "B"),
            )
        )
        .with_panel(
            prom_timeseries(
                "Ingest latency",
                "s",
                *(
                    promql(
                        f"histogram_quantile({p}, sum by (le) (rate(stepwatch_ingest_duration_seconds_bucket[{RATE}])))",
                        f"p{round(p * 100)}",
                        ref,
                    )
                    for p, ref in ((0.5, "A"), (0.99, "B"))
                ),
            )
        )
        .with_panel(
            prom_timeseries(
                "Rejected batches / s by reason",
                "none",
                promql(
                    f"sum by (reason) (rate(stepwatch_ingest_rejected_batches_total[{RATE}]))", "{{reason}}"
                ),
            )
        )
        .with_panel(
            prom_timeseries(
                "Detection: batches / s and queue",
                "none",
                promql(f"sum by (outcome) (rate(stepwatch_detection_batches_total[{RATE}]))", "{{outcome}}"),
                promql("sum(stepwatch_detection_queue_depth_batches)", "queued", "B"),
            )
        )
        .with_panel(
            prom_timeseries(
                "Detector lag (ingest answer to anomalies stored)",
                "s",
                *(
                    promql(
                        f"histogram_quantile({p}, sum by (le) (rate(stepwatch_detection_lag_seconds_bucket[{RATE}])))",
                        f"p{round(p * 100)}",
                        ref,
                    )
                    for p, ref in ((0.5, "A"), (0.99, "B"))
                ),
            )
        )
        .with_panel(
            prom_timeseries(
                "Rollups: failed transactions and skipped ranges / s",
                "none",
                promql(f"sum(rate(stepwatch_rollup_failures_total[{RATE}]))", "failed"),
                promql(f"sum(rate(stepwatch_rollup_skipped_ranges_total[{RATE}]))", "skipped", "B"),
            )
        )
        .with_panel(
            prom_timeseries(
                "Alert deliveries / s",
                "none",
                promql(
                    f"sum by (channel_type, outcome) (rate(stepwatch_alert_deliveries_total[{RATE}]))",
                    "{{channel_type}} {{outcome}}",
                ),
            )
        )
    )


def scale() -> dashboard.Dashboard:
    """A deployment on the bus: the replicas' side (what they published, what waits for Redis, the streams'
    backlog) and each detection worker's (streams, batches, lag, take-overs, errors), by instance."""
    return (
        _base(
            "stepwatch-scale",
            "stepwatch / Scale",
            "Ingest replicas on the bus (serve --bus) and the detection workers (detect): README, Running at scale.",
            run_variable=False,
        )
        .with_panel(prom_stat("Bus connected (all replicas)", "none", "min(stepwatch_bus_connected)"))
        .with_panel(prom_stat("Stream backlog", "none", "max(stepwatch_bus_stream_backlog_entries)"))
        .with_panel(prom_stat("Detection workers", "none", "count(stepwatch_detect_streams_owned)"))
        .with_panel(
            prom_timeseries(
                "Batches published to the bus / s, per replica",
                "none",
                promql(
                    f"sum by (instance) (rate(stepwatch_bus_published_batches_total[{RATE}]))", "{{instance}}"
                ),
            )
        )
        .with_panel(
            prom_timeseries(
                "Backlog, and batches kept for Redis per replica",
                "none",
                promql("max(stepwatch_bus_stream_backlog_entries)", "stream backlog"),
                promql("sum by (instance) (stepwatch_bus_waiting_batches)", "kept by {{instance}}", "B"),
                description="The backlog: entries no worker has taken yet (429 beyond 200,000). Kept: stored "
                "batches a replica holds while Redis does not answer (429 beyond 20,000).",
            )
        )
        .with_panel(
            prom_timeseries(
                "Worker: batches / s by outcome",
                "none",
                promql(
                    f"sum by (instance, outcome) (rate(stepwatch_detect_batches_total[{RATE}]))",
                    "{{instance}} {{outcome}}",
                ),
            )
        )
        .with_panel(
            prom_timeseries(
                "Worker: streams owned and runs held",
                "none",
                promql("sum by (instance) (stepwatch_detect_streams_owned)", "streams {{instance}}"),
                promql("sum by (instance) (stepwatch_detect_runs)", "runs {{instance}}", "B"),
                description="16 streams in all; a dead worker's streams move to the others within 10 s.",
            )
        )
        .with_panel(
            prom_timeseries(
                "Worker: detection lag (ingest answer to anomalies stored)",
                "s",
                promql(
                    "max by (instance, quantile) (stepwatch_detect_lag_seconds)", "p{{quantile}} {{instance}}"
                ),
            )
        )
        .with_panel(
            prom_timeseries(
                "Worker: take-overs, snapshots and errors / s",
                "none",
                promql(f"sum(rate(stepwatch_detect_takeovers_total[{RATE}]))", "take-overs"),
                promql(f"sum(rate(stepwatch_detect_snapshots_total[{RATE}]))", "snapshots", "B"),
                promql(f"sum(rate(stepwatch_detect_errors_total[{RATE}]))", "errors", "C"),
            )
        )
    )


DASHBOARDS: dict[str, Callable[[], dashboard.Dashboard]] = {
    "run-overview": run_overview,
    "ranks": ranks,
    "numerics": numerics,
    "collector": collector,
    "scale": scale,
}
# The dashboards whose metrics only a deployment on the bus serves (a single collector has none of them).
ON_THE_BUS = frozenset({"scale"})
