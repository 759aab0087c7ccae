"""Runs a dashboard's SQL the way Grafana's PostgreSQL datasource would, for the tests.

Only what the dashboards use is expanded (dashboards/README.md lists it): `$__unixEpochFilter(col)`
-> `col >= FROM AND col <= TO`, `$__unixEpochGroupAlias(col, $__interval)` -> `floor(col/S)*S AS "time"`,
`$__unixEpochFrom()` / `$__unixEpochTo()`, `$__interval` -> S seconds, `$run` -> the run name, and
`$rank` -> every rank as Grafana writes a multi-value variable ('0','1'). Anything else left starting
with `$` fails the test, so a panel cannot use a macro this does not know.
"""

from __future__ import annotations

import re

INTERVAL_S = 1


def expand(sql: str, *, run: str, ranks: list[int], t_from: float, t_to: float) -> str:
    sql = re.sub(
        r"\$__unixEpochGroupAlias\(([^,()]+),\s*\$__interval\)",
        lambda m: f'floor({m.group(1)}/{INTERVAL_S})*{INTERVAL_S} AS "time"',
        sql,
    )
    sql = re.sub(
        r"\$__unixEpochFilter\(([^()]+)\)",
        lambda m: f"{m.group(1)} >= {t_from} AND {m.group(1)} <= {t_to}",
        sql,
    )
    sql = sql.replace("$__unixEpochFrom()", str(t_from)).replace("$__unixEpochTo()", str(t_to))
    sql = sql.replace("$run", run).replace("$rank", ",".join(f"'{r}'" for r in ranks))
    leftover = re.findall(r"\$\w+", sql)
    assert not leftover, f"a macro or variable the tests do not expand: {leftover} in {sql}"
    return sql


def expand_promql(expr: str, run: str) -> str:
    expr = expr.replace("$__rate_interval", "1m").replace("$run", run)
    leftover = re.findall(r"\$\w+", expr)
    assert not leftover, f"a variable the tests do not expand: {leftover} in {expr}"
    return expr
