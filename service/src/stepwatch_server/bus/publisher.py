"""Ingest's side of the bus (`serve --bus`): each stored batch is added to its run's stream before the answer.

The ingest route hands a committed batch to `BusPublisher.hand_over` and awaits it; one thread adds every
batch that waits to its stream in one pipelined round trip (`XADD`), then answers each. So an acknowledged
batch is in Redis: a replica killed after its answer loses no detection.

While Redis cannot be reached the batches are still stored and answered (`200`): they wait in this process,
in order, and are added once Redis answers again (a retry every `RETRY_S`), so detection catches up. At most
`MAX_WAITING` wait; beyond that, and while the streams hold more than `MAX_STREAM_BACKLOG` entries not yet
taken by a detection worker (none is running, or they are far behind), `reserve()` is False and ingest
answers `429 detection_behind` and stores nothing, as the single process does when its detection queue is
full. What still waits when the process stops is logged: those batches are stored but not detected.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from stepwatch_server.background import BackgroundWorker
from stepwatch_server.bus import streams
from stepwatch_server.ingest.schema import Batch

log = logging.getLogger(__name__)

MAX_WAITING = 20_000  # batches kept in this process while Redis is unreachable; beyond, 429
MAX_STREAM_BACKLOG = 200_000  # entries in all streams not yet delivered to a worker; beyond, 429
MAX_PER_ROUND = 512  # XADDs in one pipelined round trip
RETRY_S = 1.0  # after Redis failed, the next try waits this long
BACKLOG_CHECK_S = 1.0  # how often the streams' backlog is read


@dataclass(slots=True)
class _Entry:
    stream: str
    fields: dict[str, bytes]
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future[bool] | None = None


def _answer(future: asyncio.Future[bool], published: bool) -> None:
    if not future.done():
        future.set_result(published)


class BusPublisher(BackgroundWorker):
    label = "bus"
    error_pause_s = RETRY_S

    def __init__(self, client: redis.Redis) -> None:
        super().__init__()
        self.client: Any = client  # redis-py types its answers as unions of bytes, str and lists
        self._waiting: collections.deque[_Entry] = collections.deque()
        self.published = 0
        self.connected = True
        self.streams_behind = False  # the streams' backlog is over MAX_STREAM_BACKLOG
        self.stream_backlog = 0
        self.workers: list[dict[str, Any]] = []  # the detection workers' counters, as they last said
        self._checked_at = 0.0

    # -- the ingest side (the same three calls as detect/worker.py's DetectionWorker) -------------
    def reserve(self) -> bool:
        """Whether a batch about to be stored may be: False while too much waits (here or in the streams)."""
        return len(self._waiting) < MAX_WAITING and not self.streams_behind

    def release(self) -> None:
        """Nothing is held per reservation here."""

    @property
    def behind(self) -> str:
        """Why `reserve()` says no, for the 429's message."""
        if len(self._waiting) >= MAX_WAITING:
            return f"Redis does not answer and {MAX_WAITING:,} stored batches wait in this collector for it"
        return (
            f"{self.stream_backlog:,} batches wait in the bus for a detection worker (is `detect` running?)"
        )

    async def hand_over(
        self, batch: Batch, ack_monotonic: float, run_id: int | None = None, new_run: bool = False
    ) -> None:
        """Add a stored batch to its run's stream; returns once it is there or, while Redis is down, kept
        here for later."""
        entry = _Entry(
            streams.stream_key(streams.partition(batch.run)),
            streams.encode(batch, time.time(), run_id, new_run),
        )
        if not self.connected:  # kept in order behind the others; the answer need not wait for Redis
            self._waiting.append(entry)
            return
        entry.loop = asyncio.get_running_loop()
        entry.future = future = entry.loop.create_future()
        self._waiting.append(entry)
        self._wake.set()
        await future

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        self._guard("partitions", streams.check_partitions, self.client)
        stop_at: float | None = None
        while True:
            if self._stop.is_set() and stop_at is None:
                stop_at = time.monotonic() + self._deadline_s
            if stop_at is not None and (not self._waiting or time.monotonic() > stop_at):
                break
            if self.connected and time.monotonic() - self._checked_at >= BACKLOG_CHECK_S:
                self._checked_at = time.monotonic()
                self._guard("backlog", self._check_backlog)
            if not self._waiting:
                self._wake.wait(BACKLOG_CHECK_S)
                self._wake.clear()
                continue
            head = [self._waiting[i] for i in range(min(MAX_PER_ROUND, len(self._waiting)))]
            if self._publish(head):
                continue
            for entry in list(self._waiting):  # answered now (stored; detection deferred), published later
                self._release_answer(entry, published=False)
            self._stop.wait(RETRY_S)

    def _publish(self, head: list[_Entry]) -> bool:
        try:
            pipe = self.client.pipeline(transaction=False)
            for entry in head:
                pipe.xadd(entry.stream, entry.fields)
            pipe.execute()
        except redis.RedisError as exc:
            if self.connected:
                log.warning(
                    "bus: Redis does not answer (%s); batches are stored and kept here (%d now, at most %d) "
                    "until it does",
                    type(exc).__name__,
                    len(self._waiting),
                    MAX_WAITING,
                )
            self.connected = False
            return False
        if not self.connected:
            log.info("bus: Redis answers again; %d waiting batches are being added", len(self._waiting))
        self.connected = True
        for entry in head:
            self._waiting.popleft()
            self._release_answer(entry, published=True)
        with self._lock:
            self.published += len(head)
        return True

    @staticmethod
    def _release_answer(entry: _Entry, published: bool) -> None:
        if entry.future is not None and entry.loop is not None:
            entry.loop.call_soon_threadsafe(_answer, entry.future, published)
            entry.future = entry.loop = None

    def _check_backlog(self) -> None:
        """Entries of all streams not yet delivered to a worker (XINFO's `lag`; the whole stream before a
        worker created the group)."""
        pipe = self.client.pipeline(transaction=False)
        for p in range(streams.PARTITIONS):
            pipe.xlen(streams.stream_key(p))
            pipe.xinfo_groups(streams.stream_key(p))
        try:
            answers = pipe.execute(raise_on_error=False)
        except redis.RedisError:
            return
        total = 0
        for length, groups in zip(answers[0::2], answers[1::2], strict=True):
            if isinstance(length, Exception):
                return
            lag = None
            if isinstance(groups, list):
                for group in groups:
                    name = group.get("name")
                    if name in (streams.GROUP, streams.GROUP.encode()):
                        lag = group.get("lag")
            total += int(length) if lag is None else int(lag)
        self.stream_backlog = total
        alive = self.client.zrangebyscore(streams.WORKERS_KEY, time.time() - 10.0, "+inf")
        found = self.client.mget([streams.worker_stats_key(w.decode()) for w in alive]) if alive else []
        self.workers = [orjson.loads(v) for v in found if v]
        behind = total > MAX_STREAM_BACKLOG
        if behind and not self.streams_behind:
            log.warning(
                "bus: %d batches wait in the streams for a detection worker (over %d): ingest answers 429 "
                "until they are taken (is `stepwatch-server detect` running?)",
                total,
                MAX_STREAM_BACKLOG,
            )
        self.streams_behind = behind

    def _stopped(self) -> None:
        if self._waiting:
            log.warning(
                "bus: stopped with %d stored batches not added to the streams (Redis did not answer): they will "
                "not be detected",
                len(self._waiting),
            )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            published = self.published
        return {
            "enabled": True,
            "mode": "bus",
            "bus_connected": self.connected,
            "published": published,
            "waiting": len(self._waiting),
            "waiting_capacity": MAX_WAITING,
            "stream_backlog": self.stream_backlog,
            "stream_backlog_capacity": MAX_STREAM_BACKLOG,
            "errors": self.errors,
            "workers": self.workers,
        }
