"""Ingest's writing threads: requests hand them their bodies and await the answer; a thread decodes,
validates and writes everything that waits as one group.

An ingest request on the event loop reads its body (under the size limit), queues it here with an asyncio
future, and awaits that. A writing thread (WRITING_THREADS on PostgreSQL, one on SQLite) takes every body
that waits (up to `store.MAX_GROUP_BATCHES`), decodes and validates each (a bad one gets its error at once),
checks the token may write its run, and writes the valid ones with `BatchWriter.write_group` (one
transaction for the steady state's batches: ingest/store.py); then it answers each future on its loop. The
batches that arrive together share a transaction without a request thread each waiting for it: one
hand-over to a thread and one back per request, instead of a thread-pool round trip and a wake-up per
batch. A round that fails as a whole (a bug of ours) answers each of its requests with that error.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass
from typing import Any

from stepwatch_server.auth import Grant, check_write
from stepwatch_server.background import BackgroundWorker
from stepwatch_server.ingest.body import decode_body
from stepwatch_server.ingest.schema import Batch
from stepwatch_server.ingest.store import MAX_GROUP_BATCHES, BatchWriter, IngestResult, Pending
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.storage.engine import is_sqlite

IDLE_WAIT_S = 0.5  # a thread's wait when nothing comes (it is woken by each request)
# On PostgreSQL two writing threads: while one waits on the database's round trips (the GIL released), the
# other decodes, validates and writes the next group. One thread was the ceiling of a process at the agent's
# cadence: busy all the time, 40% of it waiting on PostgreSQL, the process at ~0.6 cores (bench/README.md,
# "Capacity"). SQLite has one writer at a time (storage/engine.py's write lock): a second thread only waited
# for it, with smaller groups (0.79x the batches/s in bench/batch_rate.py), so there one.
WRITING_THREADS = 2


@dataclass(slots=True)
class _Request:
    raw: bytes
    encoding: str | None
    limit: int
    grant: Grant | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[tuple[Batch, IngestResult]]


def _answer(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():  # the client went away and the request was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class IngestPipeline(BackgroundWorker):
    label = "ingest"

    def __init__(self, writer: BatchWriter) -> None:
        super().__init__()
        self.writer = writer
        self.threads = 1 if is_sqlite(writer.engine) else WRITING_THREADS
        self._waiting: collections.deque[_Request] = collections.deque()
        self._taking = threading.Lock()  # one thread at a time takes a group

    async def ingest(
        self, raw: bytes, encoding: str | None, limit: int, grant: Grant | None
    ) -> tuple[Batch, IngestResult]:
        """Decode, validate and store one body; the batch and its result once committed (or the error)."""
        loop = asyncio.get_running_loop()
        request = _Request(raw, encoding, limit, grant, loop, loop.create_future())
        self._waiting.append(request)  # deque appends and pops are atomic
        self._wake.set()
        return await request.future

    def _run(self) -> None:
        while not self._stop.is_set() or self._waiting:
            if not self._waiting:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            group = self._take()
            if not group:  # the other thread took them
                continue
            if self._guard("round", self._round, group) is None:  # a bug of ours (logged): a 500 for each
                failed = RuntimeError("ingest failed on this batch's round; the collector's log says why")
                for request in group:  # an answer already on its way is sent first; this one is then dropped
                    request.loop.call_soon_threadsafe(_answer, request.future, None, failed)

    def _take(self) -> list[_Request]:
        group: list[_Request] = []
        with self._taking:
            while self._waiting and len(group) < MAX_GROUP_BATCHES:
                group.append(self._waiting.popleft())
        return group

    def _round(self, group: list[_Request]) -> bool:
        parsed: list[tuple[_Request, Pending]] = []
        for request in group:
            try:
                batch = parse_batch(decode_body(request.raw, request.encoding, request.limit))
                check_write(request.grant, batch.run)  # the run is known only now; nothing is stored yet
                parsed.append((request, Pending(batch, self.writer.prebuild(batch))))
            except Exception as exc:
                request.loop.call_soon_threadsafe(_answer, request.future, None, exc)
        if parsed:
            self.writer.write_group([pending for _, pending in parsed])
        for request, pending in parsed:
            value = (pending.batch, pending.result)
            request.loop.call_soon_threadsafe(_answer, request.future, value, pending.error)
        return True
