"""Group commit survives `kill -9`: a real `stepwatch-server serve` takes the agent's small batches from 16
concurrent senders (so that they share transactions) and is killed with SIGKILL mid-run, on SQLite and
PostgreSQL. Every batch acknowledged before the kill must be stored, and each exactly once; after a
restart the senders send again everything not acknowledged, as the agent does from its spool, and the
run ends complete: every value of every batch, once.
"""

from __future__ import annotations

import gzip
import http.client
import json
import signal
import threading
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, func, select

from stepwatch_server.storage.engine import normalise_url
from stepwatch_server.storage.models import IngestedBatch, Point
from tests.e2e.conftest import Collector, free_port

RANKS, BATCHES, NAMES = 16, 40, 12
SENDERS = 16
KILL_AFTER_ACKS = 150  # of 640 batches
TIMEOUT_S = 10.0
RUN_WAIT_S = 120.0


def _body(run: str, session: str, rank: int, seq: int) -> bytes:
    steps = [2 * seq + 1, 2 * seq + 2]
    doc = {
        "schema": 1, "run": run, "session": session, "seq": seq, "rank": rank, "world_size": RANKS,
        "steps": steps, "timestamps": [1.7e9 + s for s in steps],
        "metrics": {f"m{i}": [float(rank * 100_000 + s * 100 + i) for s in steps] for i in range(NAMES)},
    }  # fmt: skip
    return gzip.compress(json.dumps(doc).encode())


def _send(
    url: str, work: list[tuple[tuple[int, int], bytes]], acked: set[tuple[int, int]], lock: threading.Lock
) -> None:
    """Each sender takes batches from `work` and records those acknowledged; it stops at the first
    failure (the collector died), leaving the rest to be sent again."""
    port = int(url.rsplit(":", 1)[1])

    def sender() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
        try:
            while True:
                with lock:
                    if not work:
                        return
                    key, body = work.pop(0)
                try:
                    conn.request(
                        "POST",
                        "/api/v1/ingest",
                        body=body,
                        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
                    )
                    answer = conn.getresponse()
                    ok = answer.status == 200 and json.loads(answer.read()).get("accepted") is True
                except (OSError, http.client.HTTPException):
                    ok = False
                if not ok:
                    return
                with lock:
                    acked.add(key)
        finally:
            conn.close()

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(SENDERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RUN_WAIT_S)


def test_every_acknowledged_batch_survives_kill_9_once_and_a_resend_completes_the_run(
    database_url: str, tmp_path: Path
) -> None:
    run = f"crash-{uuid.uuid4().hex[:6]}"
    sessions = [uuid.uuid4().hex for _ in range(RANKS)]
    bodies = {(r, s): _body(run, sessions[r], r, s) for s in range(BATCHES) for r in range(RANKS)}
    port = free_port()
    collector = Collector(database_url, port, tmp_path / "collector.log").start()
    acked: set[tuple[int, int]] = set()
    lock = threading.Lock()
    work = sorted(bodies.items(), key=lambda kv: (kv[0][1], kv[0][0]))  # round by round, as ranks send

    def killer() -> None:
        deadline = time.monotonic() + RUN_WAIT_S
        while time.monotonic() < deadline:
            with lock:
                if len(acked) >= KILL_AFTER_ACKS:
                    break
            time.sleep(0.001)
        assert collector.process is not None
        collector.process.send_signal(signal.SIGKILL)

    kill = threading.Thread(target=killer, daemon=True)
    kill.start()
    _send(collector.url, work, acked, lock)
    kill.join(RUN_WAIT_S)
    assert collector.process is not None and collector.process.wait(10) == -signal.SIGKILL
    before_restart = set(acked)
    assert KILL_AFTER_ACKS <= len(before_restart) < len(bodies), len(before_restart)

    engine = create_engine(normalise_url(database_url))
    try:
        with engine.connect() as conn:  # what the killed collector acknowledged is there, once
            stored = {(s, q) for s, q in conn.execute(select(IngestedBatch.session_id, IngestedBatch.seq))}
            values = conn.execute(select(func.count()).select_from(Point)).scalar_one()
        acked_keys = {(sessions[r], s) for r, s in before_restart}
        assert acked_keys <= stored
        assert values == len(stored) * 2 * NAMES  # whole batches only: none half-written
        restarted = Collector(database_url, port, tmp_path / "collector-2.log").start()
        try:
            again = [(k, b) for k, b in bodies.items() if k not in before_restart]  # the spool's resend
            _send(restarted.url, again, acked, lock)
            assert len(acked) == len(bodies)
        finally:
            restarted.stop()
        with engine.connect() as conn:
            batches = conn.execute(select(func.count()).select_from(IngestedBatch)).scalar_one()
            values = conn.execute(select(func.count()).select_from(Point)).scalar_one()
            distinct = conn.execute(
                select(func.count()).select_from(
                    select(Point.series_id, Point.rank, Point.step, Point.incarnation).distinct().subquery()
                )
            ).scalar_one()
        assert batches == len(bodies) and values == distinct == len(bodies) * 2 * NAMES
    finally:
        engine.dispose()
