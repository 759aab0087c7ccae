"""A 64-rank node failure (the simulator's node_failure_64, shortened: the 8 ranks of node gpu-002 50%
slower from step 250, then rank 50 dies at 650 and the run hangs) through the real detection worker
and its store hook into the alert worker: a handful of messages, not dozens."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from sqlalchemy import Engine, func, select

from stepwatch_server.alerts import AlertWorker, load_config
from stepwatch_server.detect.worker import DetectionWorker
from stepwatch_server.ingest.store import BatchWriter
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.simulate import SCENARIOS, Hang, Simulation, SlowNode
from stepwatch_server.storage import make_engine, upgrade
from stepwatch_server.storage.models import AlertDelivery, AlertEvent
from tests.alerts.conftest import write_config
from tests.alerts.helpers import DELIVERY_WAIT_S, config_text
from tests.alerts.receiver import Receiver

MAX_QUEUED = 4000  # the feeder waits for the detection worker beyond this


def test_node_failure_is_a_handful_of_messages(
    receiver: Receiver, secrets: dict[str, str], tmp_path: Path
) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'stepwatch.db'}")
    upgrade(engine)
    alerts = AlertWorker(
        engine, load_config(write_config(tmp_path, config_text(receiver, window_s=1.0)))
    ).start()
    detection = DetectionWorker(engine, on_stored=alerts.on_stored).start()
    writer = BatchWriter(engine)
    scenario = dataclasses.replace(
        SCENARIOS["node_failure_64"],
        steps=800,
        faults=(SlowNode(2, 250, factor=1.5), Hang(50, 650, mode="dead")),
        flush_interval_s=20.0,  # 40 steps per batch: 2,000 batches instead of 40,000, the same detections
    )
    ranks_seen: set[int] = set()
    try:
        for i, doc in enumerate(Simulation(scenario)):
            batch = parse_batch(doc)
            if batch.rank not in ranks_seen:  # store each rank's first batch: the run and its ranks exist
                writer.write(batch)
                ranks_seen.add(batch.rank)
            assert detection.submit(batch)
            while i % 500 == 0 and detection.stats()["queue_depth"] > MAX_QUEUED:
                time.sleep(0.05)
        deadline = time.monotonic() + DELIVERY_WAIT_S
        while not detection.idle() or detection.stats()["anomalies_unsaved"] or _pending(engine):
            assert time.monotonic() < deadline, (detection.stats(), alerts.stats())
            time.sleep(0.1)
    finally:
        detection.stop()
        alerts.stop()
    assert detection.errors == 0 and alerts.errors == 0

    messages = receiver.received
    titles = sorted(
        r.json["blocks"][0]["text"]["text"] if r.path == "/slack" else r.json["title"] for r in messages
    )
    assert 2 <= len(messages) <= 5, titles  # not one per rank: the node and the hang
    assert any("slow_node: node gpu-002" in t for t in titles), titles
    assert any(t.startswith("CRITICAL hang: rank 50") for t in titles), titles
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(AlertDelivery)).scalar_one() == len(messages)
    engine.dispose()


def _pending(engine: Engine) -> int:
    with engine.connect() as conn:
        events = conn.execute(select(func.count()).where(AlertEvent.status == "pending")).scalar_one()
        sends = conn.execute(select(func.count()).where(AlertDelivery.status == "pending")).scalar_one()
    return int(events + sends)
