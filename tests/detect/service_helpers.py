"""Shared by the detection service tests: a collector on a fresh database, batches, waiting for detection.

The collector is a real uvicorn on 127.0.0.1 (tests.service.conftest.Collector); every storage-facing
test runs on SQLite and on PostgreSQL (a fresh schema per test, skipped outside CI when absent).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from sqlalchemy import Engine, create_engine, func, select

from stepwatch_server.storage.models import Anomaly as AnomalyRow
from tests.service.conftest import Collector

DETECTION_WAIT_S = 30.0
T0 = 1_764_427_200.0


def batch(
    run: str,
    session: str,
    seq: int,
    rank: int,
    world_size: int,
    steps: list[int],
    *,
    node: str | None = None,
    **metrics: list[Any],
) -> dict[str, Any]:
    """A schema-1 batch: one step per second of event time, the given metrics."""
    doc: dict[str, Any] = {
        "schema": 1,
        "run": run,
        "session": session,
        "seq": seq,
        "rank": rank,
        "world_size": world_size,
        "steps": steps,
        "timestamps": [T0 + s for s in steps],
        "metrics": metrics,
    }
    if node is not None:
        doc["node"] = node
    return doc


def session() -> str:
    return uuid.uuid4().hex


def wait_detected(collector: Collector, timeout_s: float = DETECTION_WAIT_S) -> dict[str, Any]:
    """Wait until the detection worker has processed (and stored the anomalies of) every batch."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats: dict[str, Any] = collector.get("/api/v1/detection")
        done = stats["processed"] + stats["dropped"] >= stats["submitted"] and stats["queue_depth"] == 0
        if done and stats["anomalies_unsaved"] == 0:
            return stats
        assert time.monotonic() < deadline, f"detection did not catch up: {stats}"
        time.sleep(0.02)


def anomaly_rows(url: str) -> int:
    engine: Engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(AnomalyRow)).scalar_one())
    finally:
        engine.dispose()
