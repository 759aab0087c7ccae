"""The detection bus: stored batches in, anomalies stored, on one background thread.

Ingest takes a slot (`reserve()`) before it writes a batch, and hands the stored batch to
`DetectionWorker.submit()` right after its commit (the ingest route's `_after_commit`); the thread frees
the slot when it takes the batch off the queue. `MAX_QUEUED_BATCHES` slots bound the queue: with none
free, ingest answers 429 and stores nothing (the agent spools and retries), so no batch is stored without
being detected and the ingest handler never waits on the detectors. A batch submitted without a slot
(none free, or the worker stopping) is dropped for detection (it is stored all the same), counted, and
logged once. One thread owns the engine (which is
not thread-safe): it takes what is queued (up to `MAX_BATCHES_PER_ROUND`), feeds the engine, and
writes the anomalies that changed in one transaction; when nothing arrives for `TICK_INTERVAL_S` it
lets time pass in the engine (`engine.tick`), which is how a run that went silent becomes a hang.

Per batch it records the latency from the ingest acknowledgement (a monotonic timestamp taken
when the batch was submitted, just before the answer is sent) to the anomalies of that round being
stored, in a window of the most recent `LAG_WINDOW` batches; `stats()` gives its p50 and p99.

At start the thread first adopts the open anomalies stored by an earlier process (so that a
restarted collector updates and resolves them instead of opening duplicates); at stop it drains
what is queued for at most `STOP_DEADLINE_S` and says how much was left.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from sqlalchemy import Engine

from stepwatch_server.background import BackgroundWorker
from stepwatch_server.detect.anomalies import Anomaly
from stepwatch_server.detect.engine import DetectionEngine, EngineSettings
from stepwatch_server.detect.store import StoredHook, load_open, save_anomalies
from stepwatch_server.ingest.schema import Batch
from stepwatch_server.metrics import detection_dropped, detection_round

log = logging.getLogger(__name__)

MAX_QUEUED_BATCHES = 20_000  # ~40 batches from each of 512 ranks; beyond it ingest answers 429
MAX_BATCHES_PER_ROUND = 512  # batches fed between two writes (one transaction per round)
TICK_INTERVAL_S = 1.0  # engine.tick when idle this long
LAG_WINDOW = 10_000  # recent per-batch latencies kept for the percentiles
MAX_UNSAVED_ANOMALIES = 10_000  # changes kept for the next round while the database is failing
SAVE_RETRY_S = 1.0  # after a failed write, the next attempt waits this long


_Queued = tuple[Batch, float, int | None, bool]  # a stored batch, its ack time, its run's id, created it


class UnsavedChanges:
    """The anomaly changes a detection loop has not written yet, by anomaly (the last change wins); while
    the database fails they are kept for the next round, the most recent `limit` of them (the older ones
    counted in `dropped`). Shared by this worker and the bus's (bus/worker.py)."""

    def __init__(self, limit: int = MAX_UNSAVED_ANOMALIES) -> None:
        self._changes: dict[int, Anomaly] = {}
        self.limit = limit
        self.dropped = 0
        self.saved = 0

    def __len__(self) -> int:
        return len(self._changes)

    def add(self, changed: list[Anomaly]) -> None:
        for anomaly in changed:
            self._changes[anomaly.local_id] = anomaly

    def write(self, save: Callable[[list[Anomaly]], int | None]) -> bool:
        """`save` what is unsaved (it returns the rows written, None when it failed); True when nothing
        is left unsaved."""
        if not self._changes:
            return True
        written = save(list(self._changes.values()))
        if written is None:
            for local_id in list(self._changes)[: max(0, len(self._changes) - self.limit)]:
                del self._changes[local_id]
                self.dropped += 1
            return False
        self._changes.clear()
        self.saved += written
        return True


class DetectionWorker(BackgroundWorker):
    """One engine, one bounded queue, one thread. `submit` is safe from any thread and never blocks."""

    label = "detection"
    join_slack_s = TICK_INTERVAL_S + 1.0  # beyond the deadline: the wait in progress, the last write

    def __init__(
        self, engine: Engine, settings: EngineSettings | None = None, on_stored: StoredHook | None = None
    ) -> None:
        super().__init__()
        self.db = engine
        self._on_stored = on_stored  # called in each write's transaction (detect/store.py)
        self.engine = DetectionEngine(settings)
        self._queue: queue.Queue[_Queued] = queue.Queue()  # bounded by the slots
        self._slots = threading.Semaphore(MAX_QUEUED_BATCHES)
        self._lag_s: collections.deque[float] = collections.deque(maxlen=LAG_WINDOW)
        self._unsaved = UnsavedChanges()
        self.submitted = 0
        self.processed = 0
        self.dropped = 0
        self.adopted = 0
        self._warned_full = False

    # -- life cycle -----------------------------------------------------------------------------
    def _stopped(self) -> None:
        """What was queued is processed within the deadline; say what was not."""
        if self._thread is not None and self._thread.is_alive():
            log.warning(
                "detection: stopped with %d batches not processed after %.1f s",
                self._queue.qsize(),
                self._deadline_s,
            )

    # -- the ingest side ------------------------------------------------------------------------
    def reserve(self) -> bool:
        """Take a slot for a batch about to be stored (never waits); False when every slot is taken."""
        return self._slots.acquire(blocking=False)

    def release(self) -> None:
        """Give back a slot whose batch will not be submitted (a duplicate, a refused or failed write)."""
        self._slots.release()

    def submit(
        self,
        batch: Batch,
        ack_monotonic: float | None = None,
        reserved: bool = False,
        run_id: int | None = None,
        new_run: bool = False,
    ) -> bool:
        """Queue a stored batch (stored in run `run_id`, which it created when `new_run`:
        `DetectionEngine.feed`) for detection, in the slot taken by `reserve()` when `reserved`; False when
        it was dropped (no slot free, or stopping)."""
        ack = time.monotonic() if ack_monotonic is None else ack_monotonic
        with self._lock:
            self.submitted += 1
        if self._stop.is_set():
            if reserved:
                self.release()
            return self._drop("the detection worker is stopping")
        if not reserved and not self.reserve():
            return self._drop(f"the detection queue is full ({MAX_QUEUED_BATCHES} batches)")
        self._queue.put_nowait((batch, ack, run_id, new_run))
        return True

    def _drop(self, why: str) -> bool:
        detection_dropped()
        with self._lock:
            self.dropped += 1
            warn, self._warned_full = not self._warned_full, True
        if warn:
            log.warning("detection: %s; batches are stored but skip detection (counted as dropped)", why)
        return False

    @property
    def behind(self) -> str:
        """Why `reserve()` says no, for the 429's message."""
        return f"{MAX_QUEUED_BATCHES:,} batches wait for the detection worker"

    async def hand_over(
        self, batch: Batch, ack_monotonic: float, run_id: int | None = None, new_run: bool = False
    ) -> None:
        """Queue a stored batch in the slot its request reserved (the ingest route's call, which the bus's
        publisher answers too: bus/publisher.py)."""
        self.submit(batch, ack_monotonic, reserved=True, run_id=run_id, new_run=new_run)

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        self._adopt()
        last_tick = time.monotonic()
        stop_at: float | None = None
        while True:
            if self._stop.is_set() and stop_at is None:
                stop_at = time.monotonic() + self._deadline_s
            if stop_at is not None and (self._queue.empty() or time.monotonic() > stop_at):
                break
            items = self._take(timeout_s=max(0.0, TICK_INTERVAL_S - (time.monotonic() - last_tick)))
            changed: list[Anomaly] = []
            for batch, _, run_id, new_run in items:
                changed += self._guard("feed", self.engine.feed, batch, time.time(), run_id, new_run) or []
            if time.monotonic() - last_tick >= TICK_INTERVAL_S:
                changed += self._guard("tick", self.engine.tick, time.time()) or []
                last_tick = time.monotonic()
            self._store(changed)
            if items:
                done = time.monotonic()
                lags = [done - item[1] for item in items]
                with self._lock:
                    self._lag_s.extend(lags)
                    self.processed += len(items)
                detection_round(lags, self._queue.qsize())
        self._store([])  # a last attempt for what a failed write left
        if not self._queue.empty():
            log.warning("detection: %d queued batches left unprocessed at stop", self._queue.qsize())

    def _take(self, timeout_s: float) -> list[_Queued]:
        try:
            items = [self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()]
        except queue.Empty:
            return []
        while len(items) < MAX_BATCHES_PER_ROUND:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for _ in items:  # off the queue: their slots are free for ingest again
            self._slots.release()
        return items

    def _store(self, changed: list[Anomaly]) -> None:
        self._unsaved.add(changed)
        if not self._unsaved.write(self._save):  # the database failed: kept (bounded) for the next round
            self._stop.wait(SAVE_RETRY_S)

    def _save(self, anomalies: list[Anomaly]) -> int | None:
        return self._guard("store", save_anomalies, self.db, anomalies, self._on_stored, self.engine.forget)

    def _adopt(self) -> None:
        runs = self._guard("adopt", load_open, self.db) or []
        for run in runs:
            self.engine.adopt(run.name, run.world_size, run.anomalies)
            self.adopted += len(run.anomalies)
        if self.adopted:
            log.info("detection: continuing %d open anomalies of %d runs", self.adopted, len(runs))

    # -- observation ----------------------------------------------------------------------------
    def idle(self) -> bool:
        """Nothing queued and every submitted batch processed or dropped."""
        with self._lock:
            return self._queue.empty() and self.processed + self.dropped >= self.submitted

    def stats(self) -> dict[str, Any]:
        with self._lock:
            lag = np.array(self._lag_s, dtype=np.float64)
            out: dict[str, Any] = {
                "enabled": True,
                "queue_depth": self._queue.qsize(),
                "queue_capacity": MAX_QUEUED_BATCHES,
                "submitted": self.submitted,
                "processed": self.processed,
                "dropped": self.dropped,
                "errors": self.errors,
                "anomalies_saved": self._unsaved.saved,
                "anomalies_unsaved": len(self._unsaved),
                "adopted": self.adopted,
                "runs": len(self.engine.runs),
            }
        p50, p99 = (np.percentile(lag, [50, 99]) * 1000.0).tolist() if lag.size else (None, None)
        out["lag_ms"] = {"p50": p50, "p99": p99, "max": float(lag.max() * 1000.0) if lag.size else None}
        out["lag_samples"] = int(lag.size)
        return out
