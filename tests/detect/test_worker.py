"""The detection worker: never blocks ingest, counts drops, drains at stop, and a restarted collector
continues the open anomalies it stored (SQLite and PostgreSQL)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from stepwatch_server.detect import engine as engine_module
from stepwatch_server.detect import worker as worker_module
from stepwatch_server.detect.base import Detector
from stepwatch_server.detect.frames import StepFrame
from stepwatch_server.detect.worker import DetectionWorker
from stepwatch_server.ingest.schema import Batch
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.storage import make_engine, upgrade
from tests.detect.service_helpers import batch, session, wait_detected
from tests.service.conftest import Collector


class HighLoss(Detector):
    """Test-only: open a run-level anomaly while the mean loss is above 100; resolve when below."""

    kind: ClassVar[str] = "loss_spike"

    def on_frame(self, frame: StepFrame) -> None:
        loss = float(np.nanmean(frame.metrics["loss"]))
        book = self.ctx.book
        if loss > 100:
            book.raise_("loss_spike", "run", step=frame.step, ts=frame.ts, severity="warning",
                        summary=f"loss {loss:g} at step {frame.step}", evidence={"loss": loss})  # fmt: skip
        elif book.is_open("loss_spike", "run"):
            book.resolve("loss_spike", "run", step=frame.step, ts=frame.ts)


def send(collector: Collector, sessions: list[str], seq: int, steps: list[int], loss: float) -> None:
    for rank, sid in enumerate(sessions):
        doc = batch("r", sid, seq, rank, len(sessions), steps, loss=[loss] * len(steps))
        assert collector.post(doc).status_code == 200


def test_restart_continues_and_resolves_open_anomalies(
    start_collector: Callable[..., Collector], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_module, "DETECTORS", [HighLoss])
    sessions = [session(), session()]
    first = start_collector()
    send(first, sessions, 0, list(range(10)), 1.0)
    send(first, sessions, 1, list(range(10, 15)), 1000.0)
    wait_detected(first)
    (a,) = first.get("/api/v1/runs/r/anomalies")["anomalies"]
    assert (a["status"], a["first_step"], a["last_step"]) == ("open", 10, 14)
    first.close()

    second = start_collector()  # same database: the worker adopts the open anomaly at start
    send(second, sessions, 2, list(range(15, 18)), 1000.0)
    send(second, sessions, 3, list(range(18, 21)), 1.0)
    stats = wait_detected(second)
    assert stats["adopted"] == 1
    (b,) = second.get("/api/v1/runs/r/anomalies")["anomalies"]  # still one row: continued, not duplicated
    assert (b["id"], b["status"], b["first_step"], b["last_step"], b["resolved_step"]) == (
        a["id"], "resolved", 10, 17, 18,
    )  # fmt: skip


def _batches(n: int) -> list[Batch]:
    sid = session()
    return [parse_batch(batch("q", sid, i, 0, 1, [i], loss=[1.0])) for i in range(n)]


def test_a_full_queue_drops_counts_and_never_blocks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(worker_module, "MAX_QUEUED_BATCHES", 3)
    db = make_engine(f"sqlite:///{tmp_path / 'w.db'}")
    worker = DetectionWorker(db)  # not started: nothing takes from the queue
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        accepted = [worker.submit(b) for b in _batches(10)]
    assert time.monotonic() - started < 1.0
    assert accepted == [True] * 3 + [False] * 7
    stats = worker.stats()
    assert (stats["submitted"], stats["dropped"], stats["queue_depth"]) == (10, 7, 3)
    assert len([r for r in caplog.records if "full" in r.message]) == 1  # logged once
    db.dispose()


def test_stop_drains_within_its_deadline(tmp_path: Path) -> None:
    db = make_engine(f"sqlite:///{tmp_path / 'w.db'}")
    upgrade(db)
    worker = DetectionWorker(db)
    for b in _batches(50):
        worker.submit(b)
    worker.start()
    started = time.monotonic()
    worker.stop(deadline_s=5.0)
    assert time.monotonic() - started < 5.0
    assert worker.stats()["processed"] == 50 and worker.idle()
    assert not any(t.name == "stepwatch-detection" and t.is_alive() for t in threading.enumerate())
    assert worker.submit(_batches(1)[0]) is False
    db.dispose()
