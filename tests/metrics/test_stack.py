"""The whole observability path with real parts: a real 2-rank training run feeds a `stepwatch-server
serve` on PostgreSQL (prometheus_client in multiprocess mode); a real Prometheus scrapes its /metrics
every second and evaluates dashboards/prometheus/rules.yml. Then every PromQL expression of every
dashboard must return data from that Prometheus, every SQL query (panels, annotations, variables) must
return rows from that PostgreSQL, promtool must accept the exposition, and the rules must evaluate."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwatch_server.grafana.dashboards import ON_THE_BUS
from stepwatch_server.grafana.generate import REPO
from stepwatch_server.grafana.panels import POSTGRES_TYPE, PROMETHEUS_TYPE, panel_queries
from tests.conftest import POSTGRES_URL, port_open, require, require_module
from tests.e2e.conftest import Collector, free_port, get_json
from tests.metrics.prometheus import Prometheus, require_prometheus
from tests.metrics.sql import expand, expand_promql

torch = require_module("torch")
require_module("stepwatch")
psycopg = require_module("psycopg")

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

RUN = "metrics-e2e"
RANKS = 2
STEPS = 120
# A single collector serves the metrics of all but the dashboards of a deployment on the bus (test_bus.py).
DASHBOARDS = sorted(p for p in (REPO / "dashboards").glob("*.json") if p.stem not in ON_THE_BUS)
RULES = REPO / "dashboards" / "prometheus" / "rules.yml"
WAIT_S = 60.0


class Stack:
    def __init__(self, collector: Collector, prometheus: Prometheus, database_url: str, t0: float) -> None:
        self.collector = collector
        self.prometheus = prometheus
        self.database_url = database_url
        self.t0 = t0


def _wait(condition: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def _detection_done(collector: Collector) -> bool:
    stats = collector.get("/api/v1/detection")
    return bool(stats["processed"] + stats["dropped"] >= stats["submitted"] and stats["queue_depth"] == 0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require(port_open("127.0.0.1", 5432), "PostgreSQL is not running on 127.0.0.1:5432")
    require_prometheus()
    import os

    import torch.multiprocessing as mp

    from tests.metrics.training import train_rank

    tmp = tmp_path_factory.mktemp("stack")
    admin = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
    name = f"stepwatch_metrics_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    database_url = POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}"
    multiproc = tmp / "multiproc"
    multiproc.mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc)  # inherited by the collector process only
    collector = Collector(database_url, free_port(), tmp / "collector.log")
    prometheus: Prometheus | None = None
    try:
        collector.start()
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        prometheus = Prometheus(tmp, f"127.0.0.1:{collector.port}", RULES).start()
        t0 = time.time()
        args = (RANKS, free_port(), collector.url, RUN, STEPS, str(tmp / "spool"))
        mp.spawn(train_rank, args=args, nprocs=RANKS, join=True)
        _wait(lambda: _detection_done(collector), "detection")
        rejected = urllib.request.Request(f"{collector.url}/api/v1/ingest", data=b"not json", method="POST")
        try:
            urllib.request.urlopen(rejected, timeout=10)
        except urllib.error.HTTPError as exc:
            assert exc.code == 400
        prom = prometheus
        prom.wait_for(f'stepwatch_run_last_step{{run="{RUN}"}} == {STEPS}', WAIT_S)
        prom.wait_for('stepwatch_ingest_rejected_batches_total{reason="invalid_json"} > 0', WAIT_S)
        time.sleep(2.5)  # a few more scrapes and rule evaluations
        yield Stack(collector, prom, database_url, t0)
    finally:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        if prometheus is not None:
            prometheus.stop()
        collector.stop()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_promtool_accepts_the_exposition(stack: Stack) -> None:
    _, promtool = require_prometheus()
    with urllib.request.urlopen(f"{stack.collector.url}/metrics", timeout=10) as r:
        body = r.read()
        assert r.headers["Content-Type"].startswith("text/plain; version=")
    checked = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
    text = body.decode()
    assert f'stepwatch_run_last_step{{run="{RUN}"}} {float(STEPS)}' in text
    assert 'stepwatch_alert_deliveries_total{channel_type="slack",outcome="failed"} 0.0' in text


def test_prometheus_scrapes_run_health_of_the_real_run(stack: Stack) -> None:
    prom = stack.prometheus
    (world,) = prom.query(f'stepwatch_run_world_size{{run="{RUN}"}}')
    assert float(world["value"][1]) == RANKS
    (loss,) = prom.query(f'stepwatch_run_loss{{run="{RUN}"}}')
    assert 0 < float(loss["value"][1]) < 10
    (events,) = prom.query(f'stepwatch_run_nonfinite_events_total{{run="{RUN}"}}')
    assert float(events["value"][1]) >= 1
    open_nonfinite = prom.query(f'sum(stepwatch_run_anomalies_open{{run="{RUN}", kind="nonfinite"}})')
    resolved = get_json(f"{stack.collector.url}/api/v1/runs/{RUN}/anomalies?kind=nonfinite")["anomalies"]
    assert resolved, "the NaN loss on rank 1 was not detected"
    open_now = sum(a["status"] == "open" for a in resolved)
    assert float(open_nonfinite[0]["value"][1]) == open_now
    slow = prom.query(f'stepwatch_rank_slowness_ratio{{run="{RUN}"}}')
    assert sorted(int(s["metric"]["rank"]) for s in slow) == list(range(RANKS))
    batches = prom.query('sum(stepwatch_ingest_batches_total{result="stored"})')
    assert float(batches[0]["value"][1]) >= RANKS * 2
    detected = prom.query('stepwatch_detection_batches_total{outcome="processed"}')
    lags = prom.query("stepwatch_detection_lag_seconds_count")
    assert float(detected[0]["value"][1]) == float(lags[0]["value"][1]) >= RANKS * 2


def test_rules_load_and_evaluate(stack: Stack) -> None:
    _, promtool = require_prometheus()
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, timeout=30)
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
    groups = stack.prometheus.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) >= 10
    bad = [(rule["name"], rule.get("lastError")) for rule in rules if rule["health"] != "ok"]
    assert not bad, bad


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_every_promql_expression_returns_data(stack: Stack, path: Path) -> None:
    queries = [
        (t, q) for t, kind, q in panel_queries(json.loads(path.read_text())) if kind == PROMETHEUS_TYPE
    ]
    empty = [(title, expr) for title, expr in queries if not stack.prometheus.query(expand_promql(expr, RUN))]
    assert not empty, f"{path.name}: queries that returned nothing: {empty}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_every_sql_query_returns_rows(stack: Stack, path: Path) -> None:
    queries = [(t, q) for t, kind, q in panel_queries(json.loads(path.read_text())) if kind == POSTGRES_TYPE]
    url = stack.database_url.replace("postgresql+psycopg://", "postgresql://")
    empty = []
    with psycopg.connect(url) as conn:
        for title, sql in queries:
            expanded = expand(
                sql, run=RUN, ranks=list(range(RANKS)), t_from=stack.t0 - 60, t_to=time.time() + 60
            )
            rows = conn.execute(expanded).fetchall()  # a query PostgreSQL refuses raises here
            if not rows:
                empty.append(title)
    assert not empty, f"{path.name}: queries that returned no rows: {empty}"
