"""A detection worker of the bus (`stepwatch-server detect`): owns some of the streams, one worker at a time.

**Leases.** Each stream is owned under a lease (`stepwatch:lease:{p}`, `LEASE_TTL_S`, renewed every
`RENEW_S`). Every worker says it is alive in a sorted set; with N alive, each owns at most ceil(P / N)
streams: a new worker gets streams as the others hand theirs over (after a snapshot), and a dead worker's
streams are free once its lease runs out, within `LEASE_TTL_S` + `RENEW_S` (7 s).

**Processing.** The owner reads its streams through the consumer group `detect` (`XREADGROUP`), feeds each
batch to that stream's `DetectionEngine`, stores the anomalies that changed (the same transaction writes the
alert outbox), and only then acknowledges the entries (`XACK`). What a failed write leaves is kept and
retried; its entries stay pending until it succeeds. When nothing comes, time passes in the engines
(`engine.tick`: hangs).

**Snapshots and take-over.** Every `SNAPSHOT_S` (and when it hands a stream over or stops) the owner stores
each stream's engine (every run's detector state, pickled) with the id of the last entry it applied
(`stepwatch:snapshot:{p}`), then trims the stream to that id. A worker taking a stream over loads the
snapshot and replays the entries after it: those the group shows as delivered and acknowledged only
rebuild the state (their anomalies are stored); those still pending (their owner died before its `XACK`)
are processed as new (their anomalies are stored again: the same rows, by their natural key); then it reads
new entries. With no snapshot (the first start) it continues the open anomalies stored for its streams'
runs. So no anomaly is lost, duplicated or opened again by a take-over.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import pickle
import socket
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import redis
from sqlalchemy import Engine

from stepwatch_server.background import BackgroundWorker
from stepwatch_server.bus import streams
from stepwatch_server.detect.anomalies import Anomaly
from stepwatch_server.detect.engine import DetectionEngine, EngineSettings
from stepwatch_server.detect.store import StoredHook, load_open, save_anomalies
from stepwatch_server.detect.worker import SAVE_RETRY_S, TICK_INTERVAL_S, UnsavedChanges

log = logging.getLogger(__name__)

LEASE_TTL_S = 6.0
RENEW_S = 1.0
SNAPSHOT_S = 5.0
READ_COUNT = 512  # entries per stream per read
READ_BLOCK_MS = 200
REPLAY_CHUNK = 1000
LAG_WINDOW = 10_000

_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


@dataclass
class _Stream:
    """One owned stream: its engine, the last entry applied, and the entries applied but not yet acked."""

    p: int
    engine: DetectionEngine
    last_id: bytes
    unacked: list[bytes] = field(default_factory=list)
    applied_since_snapshot: int = 0
    snapshot_at: float = 0.0

    @property
    def key(self) -> str:
        return streams.stream_key(self.p)


class StreamDetection(BackgroundWorker):
    label = "detect"
    error_pause_s = 1.0
    join_slack_s = LEASE_TTL_S

    def __init__(
        self,
        db: Engine,
        client: redis.Redis,
        settings: EngineSettings | None = None,
        on_stored: StoredHook | None = None,
        worker_id: str | None = None,
    ) -> None:
        super().__init__()
        self.db = db
        self.client: Any = client  # redis-py's answers are typed as unions of bytes, str and int
        self.settings = settings or EngineSettings()
        self._on_stored = on_stored
        self.id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.owned: dict[int, _Stream] = {}
        self._unsaved = UnsavedChanges()
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._lag_s: collections.deque[float] = collections.deque(maxlen=LAG_WINDOW)
        self.processed = 0
        self.replayed = 0
        self.taken_over = 0
        self.snapshots = 0

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while self._guard("partitions", streams.check_partitions, self.client) is None:  # Redis not up yet
            if self._stop.wait(RENEW_S):
                return
        next_lease = 0.0
        last_tick = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() >= next_lease:
                self._guard("leases", self._leases)
                next_lease = time.monotonic() + RENEW_S
            if not self.owned:
                self._stop.wait(RENEW_S)
                continue
            changed: list[Anomaly] = []
            read = self._guard("read", self._read) or []
            for stream, entries in read:
                changed += self._apply(stream, entries)
            if time.monotonic() - last_tick >= TICK_INTERVAL_S:
                now = time.time()
                for stream in self.owned.values():
                    changed += self._guard("tick", stream.engine.tick, now) or []
                last_tick = time.monotonic()
            self._store_and_ack(changed)
            for stream in list(self.owned.values()):
                if stream.applied_since_snapshot and time.monotonic() - stream.snapshot_at >= SNAPSHOT_S:
                    self._guard("snapshot", self._snapshot, stream)
        for p in list(self.owned):  # hand every stream over in order: a snapshot, then the lease
            self._guard("hand over", self._hand_over, p)

    def _read(self) -> list[tuple[_Stream, list[tuple[bytes, dict[bytes, bytes]]]]]:
        keys = {s.key: ">" for s in self.owned.values()}
        try:
            answer = self.client.xreadgroup(
                streams.GROUP, self.id, keys, count=READ_COUNT, block=READ_BLOCK_MS
            )
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis lost the streams (restarted without its append-only file): take them again afresh.
            log.warning("detect: Redis no longer has the streams' group (%s); taking the streams again", exc)
            for p in list(self.owned):
                self._release(keys=[streams.lease_key(p)], args=[self.id])
                del self.owned[p]
            return []
        by_key = {s.key.encode(): s for s in self.owned.values()}
        out = []
        for key, entries in answer or []:
            stream = by_key.get(key if isinstance(key, bytes) else key.encode())
            if stream is not None and entries:
                out.append((stream, entries))
        return out

    def _apply(
        self, stream: _Stream, entries: list[tuple[bytes, dict[bytes, bytes]]], store: bool = True
    ) -> list[Anomaly]:
        """Feed the entries' batches to the stream's engine; their changes (only when `store`)."""
        changed: list[Anomaly] = []
        now = time.time()
        for entry_id, fields in entries:
            batch, ack_ts, run_id, new_run = streams.decode(fields)
            out = (
                self._guard("feed", stream.engine.feed, batch, now if store else ack_ts, run_id, new_run)
                or []
            )
            if store:
                changed += out
                stream.unacked.append(entry_id)
                self._lag_s.append(max(0.0, now - ack_ts))
            stream.last_id = entry_id
            stream.applied_since_snapshot += 1
        with self._lock:
            if store:
                self.processed += len(entries)
            else:
                self.replayed += len(entries)
        return changed

    def _store_and_ack(self, changed: list[Anomaly]) -> None:
        self._unsaved.add(changed)
        if not self._unsaved.write(self._save):  # the database failed: entries stay pending
            self._stop.wait(SAVE_RETRY_S)
            return
        pending = [s for s in self.owned.values() if s.unacked]
        if pending:
            pipe = self.client.pipeline(transaction=False)
            for stream in pending:
                pipe.xack(stream.key, streams.GROUP, *stream.unacked)
            if self._guard("ack", pipe.execute) is not None:
                for stream in pending:
                    stream.unacked.clear()

    def _save(self, anomalies: list[Anomaly]) -> int | None:
        return self._guard("store", save_anomalies, self.db, anomalies, self._on_stored, self._forget)

    def _forget(self, runs: list[str]) -> None:
        """Drop the state of runs deleted from the database (`save_anomalies` found them gone)."""
        for stream in self.owned.values():
            stream.engine.forget(runs)

    # -- leases -----------------------------------------------------------------------------------
    def _leases(self) -> None:
        now = time.time()
        ttl_ms = int(LEASE_TTL_S * 1000)
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(streams.WORKERS_KEY, {self.id: now})
        pipe.set(streams.worker_stats_key(self.id), orjson.dumps(self.stats()), px=ttl_ms)
        pipe.zremrangebyscore(streams.WORKERS_KEY, "-inf", now - LEASE_TTL_S)
        pipe.zcard(streams.WORKERS_KEY)
        alive = max(1, int(pipe.execute()[3]))
        share = math.ceil(streams.PARTITIONS / alive)
        for p in list(self.owned):
            if not self._renew(keys=[streams.lease_key(p)], args=[self.id, ttl_ms]):
                log.warning(
                    "detect: the lease of stream %d ran out (Redis was away or this worker stalled); its state "
                    "is left to whoever takes it next, from the last snapshot",
                    p,
                )
                del self.owned[p]
        while len(self.owned) > share:  # hand the extra ones over to the workers that joined
            self._hand_over(max(self.owned))
        start = zlib.crc32(self.id.encode()) % streams.PARTITIONS  # workers look from different streams
        for i in range(streams.PARTITIONS):
            if len(self.owned) >= share:
                break
            p = (start + i) % streams.PARTITIONS
            if p not in self.owned and self.client.set(streams.lease_key(p), self.id, nx=True, px=ttl_ms):
                self._take(p)

    def _take(self, p: int) -> None:
        """Own stream `p`: its engine from the snapshot (or the open anomalies stored), the entries after
        the snapshot replayed."""
        key = streams.stream_key(p)
        try:
            self.client.xgroup_create(key, streams.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        engine = DetectionEngine(self.settings)
        raw = self.client.get(streams.snapshot_key(p))
        if raw is not None:
            state = pickle.loads(raw)  # written by our detection workers only (module docstring)
            engine.runs = state["runs"]
            last_id = state["last_id"]
        else:
            last_id = b"0-0"
            for run in load_open(self.db):
                if streams.partition(run.name) == p:
                    engine.adopt(run.name, run.world_size, run.anomalies)
        stream = _Stream(p, engine, last_id, snapshot_at=time.monotonic())
        self.owned[p] = stream
        try:
            replayed = self._replay(stream)
        except BaseException:  # half a replay is a wrong state: let the stream go, to be taken again
            del self.owned[p]
            self._release(keys=[streams.lease_key(p)], args=[self.id])
            raise
        with self._lock:
            self.taken_over += 1
        log.info(
            "detect: %s owns stream %d (%d runs, %d entries replayed)", self.id, p, len(engine.runs), replayed
        )

    def _replay(self, stream: _Stream) -> int:
        """Apply the entries after the snapshot that the group already delivered: acknowledged ones rebuild
        the state only, pending ones are processed (stored, then acknowledged)."""
        delivered = b"0-0"
        for group in self.client.xinfo_groups(stream.key):
            if group.get("name") in (streams.GROUP, streams.GROUP.encode()):
                delivered = group["last-delivered-id"]
                delivered = delivered if isinstance(delivered, bytes) else str(delivered).encode()
        pending: set[bytes] = set()
        if delivered != b"0-0":
            start = b"-"
            while True:
                rows = self.client.xpending_range(
                    stream.key, streams.GROUP, min=start, max="+", count=REPLAY_CHUNK
                )
                pending.update(r["message_id"] for r in rows)
                if len(rows) < REPLAY_CHUNK:
                    break
                start = b"(" + rows[-1]["message_id"]
        count = 0
        after = stream.last_id
        while _id_key(after) < _id_key(delivered):
            rows = self.client.xrange(stream.key, min=b"(" + after, max=delivered, count=REPLAY_CHUNK)
            if not rows:
                break
            for entry_id, fields in rows:
                if entry_id in pending:
                    self._store_and_ack(self._apply(stream, [(entry_id, fields)]))
                else:
                    self._apply(stream, [(entry_id, fields)], store=False)
            count += len(rows)
            after = rows[-1][0]
        stream.last_id = max(stream.last_id, delivered, key=_id_key)
        return count

    def _snapshot(self, stream: _Stream) -> None:
        """Store the stream's engine and last applied entry, then trim what is before it; only when every
        applied entry is acknowledged (the state then matches what is stored)."""
        if stream.unacked or self._unsaved:
            return
        state = pickle.dumps(
            {"runs": stream.engine.runs, "last_id": stream.last_id}, protocol=pickle.HIGHEST_PROTOCOL
        )
        pipe = self.client.pipeline(transaction=False)
        pipe.set(streams.snapshot_key(stream.p), state)
        pipe.xtrim(stream.key, minid=stream.last_id, approximate=False)
        pipe.execute()
        stream.applied_since_snapshot = 0
        stream.snapshot_at = time.monotonic()
        with self._lock:
            self.snapshots += 1

    def _hand_over(self, p: int) -> None:
        stream = self.owned[p]
        self._store_and_ack([])
        self._snapshot(stream)
        self._release(keys=[streams.lease_key(p)], args=[self.id])
        del self.owned[p]
        log.info("detect: %s handed stream %d over", self.id, p)

    def _stopped(self) -> None:
        if self.owned:
            log.warning(
                "detect: stopped owning streams %s; their leases run out in %.0f s",
                sorted(self.owned),
                LEASE_TTL_S,
            )
        with contextlib.suppress(redis.RedisError):
            self.client.zrem(streams.WORKERS_KEY, self.id)

    # -- observation ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            lag = np.array(self._lag_s, dtype=np.float64)
            out: dict[str, Any] = {
                "worker": self.id,
                "streams": sorted(self.owned),
                "runs": sum(len(s.engine.runs) for s in self.owned.values()),
                "processed": self.processed,
                "replayed": self.replayed,
                "taken_over": self.taken_over,
                "anomalies_saved": self._unsaved.saved,
                "anomalies_unsaved": len(self._unsaved),
                "snapshots": self.snapshots,
                "errors": self.errors,
            }
        p50, p99 = (np.percentile(lag, [50, 99]) * 1000.0).tolist() if lag.size else (None, None)
        out["lag_ms"] = {"p50": p50, "p99": p99}
        return out


def _id_key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq or 0)
