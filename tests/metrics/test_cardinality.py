"""The series on /metrics stay within the documented budget for a 512-rank run (64 nodes, 6 tracked
modules): run health keeps the slowest ranks and nodes only (metrics/run_health.py)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event

from stepwatch_server.ingest.store import BatchWriter
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.metrics import collector as self_metrics
from stepwatch_server.metrics import run_health
from stepwatch_server.serving import BackgroundServer
from stepwatch_server.settings import Settings
from stepwatch_server.simulate import SCENARIOS, Simulation
from stepwatch_server.storage import make_engine, upgrade

WORLD = 512


def _unsynchronised(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.execute("PRAGMA synchronous = OFF")


def _series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_a_512_rank_run_stays_within_the_series_budget(tmp_path: Path) -> None:
    scenario = dataclasses.replace(
        SCENARIOS["clean_wide_512"],
        world_size=WORLD,
        steps=20,
        chunk_steps=20,
        compile_s=0.0,
        flush_interval_s=60.0,  # one batch per rank
        heartbeat_interval_s=60.0,
    )
    url = f"sqlite:///{tmp_path / 'wide.db'}"
    engine = make_engine(url)
    event.listen(engine, "connect", _unsynchronised)  # 512 commits: no fsync each (test data only)
    upgrade(engine)
    writer = BatchWriter(engine)
    runs = set()
    for doc in Simulation(scenario):
        runs.add(doc["run"])
        writer.write(parse_batch(doc))
    (run,) = runs
    engine.dispose()

    server = BackgroundServer(Settings(database_url=url, detection=False)).start()
    try:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
    finally:
        server.stop()

    series = _series(text)
    self_series = sum(len(m.samples) for m in self_metrics.REGISTRY.collect())
    run_series = [s for s in series if f'run="{run}"' in s]
    database = [s for s in series if s.startswith("stepwatch_database_bytes ")]
    assert len(database) == 1, series  # the database's size: one series, whatever the runs
    assert len(series) == self_series + len(run_series) + 1, (
        "a series that is neither self-metric nor the run's"
    )
    assert len(run_series) <= run_health.PER_RUN_SERIES_BUDGET
    families = Counter(s.split("{", 1)[0] for s in run_series)
    assert families["stepwatch_rank_slowness_ratio"] == run_health.TOP_RANKS  # truncated, not missing
    nodes = {
        s.split('node="', 1)[1].split('"', 1)[0] for s in run_series if s.startswith("stepwatch_node_phase")
    }
    assert len(nodes) == run_health.MAX_NODES < WORLD // scenario.ranks_per_node
    assert families["stepwatch_node_phase_seconds"] == run_health.MAX_NODES * len(run_health.PHASES)
    assert families["stepwatch_module_amax"] == len(scenario.modules)
    assert families["stepwatch_run_world_size"] == 1
    assert f'stepwatch_run_world_size{{run="{run}"}} {float(WORLD)}' in series
    print(f"512 ranks: {len(series)} series ({self_series} self-metrics, {len(run_series)} run health)")
