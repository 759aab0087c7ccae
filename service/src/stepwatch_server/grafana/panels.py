"""Panel and query helpers shared by the dashboards: a Prometheus panel, a PostgreSQL panel.

Every panel names its datasource through a dashboard variable (`${datasource}` for Prometheus,
`${postgres}` for PostgreSQL), so one dashboard works against any Grafana's datasources.

SQL panels use Grafana's PostgreSQL datasource with raw SQL and only these macros and variables:
`$__unixEpochFilter(col)` (the time range on a Unix-seconds column), `$__unixEpochGroupAlias(col,
$__interval)` (bucketed time, aliased "time"), `$run` (quoted by the query: run names cannot hold a
quote) and `$rank` (multi-value: Grafana writes it as a quoted list). dashboards/README.md lists them.
"""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.models.dashboard import DataSourceRef
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

PROMETHEUS_TYPE = "prometheus"
POSTGRES_TYPE = "grafana-postgresql-datasource"
PROMETHEUS = DataSourceRef(type_val=PROMETHEUS_TYPE, uid="${datasource}")
POSTGRES = DataSourceRef(type_val=POSTGRES_TYPE, uid="${postgres}")
RUN_ID = "(SELECT id FROM runs WHERE name = '$run')"


class SqlQuery(cogvariants.Dataquery):
    """A raw-SQL query of Grafana's PostgreSQL datasource (the SDK has no builder for it)."""

    def __init__(self, sql: str, fmt: str, ref_id: str = "A") -> None:
        self.sql = " ".join(sql.split())
        self.fmt = fmt
        self.ref_id = ref_id

    def to_json(self) -> dict[str, object]:
        return {
            "datasource": {"type": POSTGRES.type_val, "uid": POSTGRES.uid},
            "editorMode": "code",
            "format": self.fmt,
            "rawQuery": True,
            "rawSql": self.sql,
            "refId": self.ref_id,
        }


class Sql(cogbuilder.Builder[SqlQuery]):
    def __init__(self, sql: str, fmt: str = "time_series", ref_id: str = "A") -> None:
        self._internal = SqlQuery(sql, fmt, ref_id)

    def build(self) -> SqlQuery:
        return self._internal


def promql(expr: str, legend: str = "", ref_id: str = "A", instant: bool = False) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).ref_id(ref_id).legend_format(legend or "__auto")
    return query.instant() if instant else query.range()


def prom_timeseries(
    title: str, unit: str, *queries: prometheus.Dataquery, description: str = "", width: int = 12
) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).datasource(PROMETHEUS).unit(unit).span(width).height(8)
    for q in queries:
        panel = panel.with_target(q)
    return panel.description(description) if description else panel


def prom_stat(title: str, unit: str, expr: str, width: int = 4) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .datasource(PROMETHEUS)
        .unit(unit)
        .span(width)
        .height(4)
        .with_target(promql(expr, instant=True))
    )


def prom_table(title: str, expr: str, width: int = 12, description: str = "") -> table.Panel:
    target = promql(expr, instant=True).format(PromQueryFormat.TABLE)
    panel = table.Panel().title(title).datasource(PROMETHEUS).span(width).height(8).with_target(target)
    return panel.description(description) if description else panel


def sql_timeseries(
    title: str, unit: str, sql: str, description: str = "", width: int = 12
) -> timeseries.Panel:
    panel = timeseries.Panel().title(title).datasource(POSTGRES).unit(unit).span(width).height(8)
    panel = panel.with_target(Sql(sql))
    return panel.description(description) if description else panel


def sql_table(title: str, sql: str, width: int = 24, description: str = "") -> table.Panel:
    panel = (
        table.Panel().title(title).datasource(POSTGRES).span(width).height(8).with_target(Sql(sql, "table"))
    )
    return panel.description(description) if description else panel


def step_metric_sql(
    names: tuple[str, ...],
    value: str = "avg(p.value) AS value",
    series: str | None = None,
    chosen_ranks: bool = False,
) -> str:
    """Per-step values of metrics `names` of the run, bucketed in time (the steps' own end times).

    `value` aggregates the rows of a bucket (ranks and steps) into one or more named columns;
    `series` is the SQL expression that names each line (`metric` column), or None; `chosen_ranks` keeps the
    ranks chosen in the `$rank` variable only.
    """
    quoted = ", ".join(f"'{n}'" for n in names)
    metric = f", {series} AS metric" if series else ""
    ranks = " AND p.rank IN ($rank)" if chosen_ranks else ""
    return f"""
        SELECT $__unixEpochGroupAlias(st.ts, $__interval){metric}, {value}
        FROM points p
        JOIN series s ON s.id = p.series_id
        JOIN steps st ON st.run_id = s.run_id AND st.rank = p.rank AND st.step = p.step
             AND st.incarnation = p.incarnation
        JOIN ranks r ON r.run_id = s.run_id AND r.rank = p.rank
        WHERE s.run_id = {RUN_ID} AND s.stat = '' AND s.name IN ({quoted})
          AND $__unixEpochFilter(st.ts){ranks}
        GROUP BY 1{", 2" if series else ""} ORDER BY 1
    """


def panel_queries(dashboard_json: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, datasource type, query) of every panel target, annotation and variable query of
    a generated dashboard: what the tests run against Prometheus and PostgreSQL."""
    out: list[tuple[str, str, str]] = []
    for panel in dashboard_json.get("panels", []):
        for target in panel.get("targets", []):
            kind = target.get("datasource", panel.get("datasource", {})).get("type")
            out.append((panel["title"], kind, target.get("expr") or target.get("rawSql")))
    for annotation in dashboard_json.get("annotations", {}).get("list", []):
        target = annotation.get("target") or {}
        if "rawSql" in target:
            out.append((f"annotation {annotation['name']}", POSTGRES_TYPE, target["rawSql"]))
    for variable in dashboard_json.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            out.append((f"variable {variable['name']}", variable["datasource"]["type"], variable["query"]))
    return out
