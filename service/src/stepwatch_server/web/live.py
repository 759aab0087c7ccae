"""`GET /api/v1/stream`: server-sent events that keep the dashboard live.

One poller serves every open stream: while at least one browser listens, it reads the runs overview
(dashboard/summary.py: three bulk queries) in a worker thread every POLL_INTERVAL_S, so the event
loop never waits on the database, and publishes the snapshot. Each stream sends the rows of the runs
that changed since it last sent them (the first event: all of them) as `event: runs`; the page then
fetches what it needs (new steps, anomalies) from the read API. Polling the database rather than
hooking ingest keeps it right with several ingest replicas in front of one database.

A stream ends when the browser goes away or when the server begins to shut down
(`app.state.stopping`, set by serving.py): uvicorn waits for open responses before it stops, so an
endless stream must end by itself. EventSource reconnects on its own (`retry:`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from sqlalchemy import Engine
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from stepwatch_server.auth import ReadAccess, Reader
from stepwatch_server.dashboard.summary import runs_overview

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5  # how often the runs overview is read while anyone listens
SEND_INTERVAL_S = 0.1  # how often a stream looks at the latest snapshot
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing an idle stream
RETRY_MS = 1000  # EventSource's reconnection delay after a stream ends

router = APIRouter(prefix="/api/v1", tags=["dashboard"])


class LiveFeed:
    """The shared poller and the latest snapshot of the runs overview (name -> row)."""

    def __init__(self, engine: Engine, stopping: threading.Event) -> None:
        self._engine = engine
        self.stopping = stopping
        self.snapshot: dict[str, dict[str, Any]] = {}
        self.version = 0  # bumped with every new snapshot
        self._listeners = 0
        self._task: asyncio.Task[None] | None = None

    def _read(self) -> dict[str, dict[str, Any]]:
        with self._engine.connect() as conn:
            return {row["name"]: row for row in runs_overview(conn)}

    async def _poll(self) -> None:
        while self._listeners > 0 and not self.stopping.is_set():
            try:
                self.snapshot = await run_in_threadpool(self._read)
                self.version += 1
            except Exception:  # a database hiccup: keep the last snapshot, try again
                log.exception("dashboard live feed: reading the runs overview failed")
            await asyncio.sleep(POLL_INTERVAL_S)

    @contextlib.asynccontextmanager
    async def listening(self) -> AsyncIterator[None]:
        self._listeners += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll(), name="stepwatch-live-feed")
        try:
            yield
        finally:
            self._listeners -= 1

    async def close(self) -> None:
        self.stopping.set()
        if self._task is not None:
            await self._task
            self._task = None


def _event(name: str, data: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def _stream(feed: LiveFeed, run: str | None, reader: Reader, request: Request) -> AsyncIterator[bytes]:
    yield f"retry: {RETRY_MS}\n\n".encode()
    async with feed.listening():
        sent: dict[str, dict[str, Any]] = {}
        seen_version = -1
        idle_s = 0.0
        while not feed.stopping.is_set() and not await request.is_disconnected():
            if feed.version > 0 and feed.version != seen_version:
                first = seen_version < 0
                seen_version = feed.version
                rows = [
                    r
                    for name, r in feed.snapshot.items()
                    if (run is None or name == run) and reader.sees(name)
                ]
                changed = [r for r in rows if sent.get(r["name"]) != r]
                if changed or first:
                    sent.update((r["name"], r) for r in changed)
                    yield _event("runs", {"runs": changed})
                    idle_s = 0.0
            if idle_s >= KEEPALIVE_S:
                yield b": keepalive\n\n"
                idle_s = 0.0
            await asyncio.sleep(SEND_INTERVAL_S)
            idle_s += SEND_INTERVAL_S


@router.get(
    "/stream",
    summary="Server-sent events: `runs` with the overview rows of the runs that changed",
    response_class=StreamingResponse,
    responses={200: {"description": "An endless event stream.", "content": {"text/event-stream": {}}}},
)
async def stream(
    request: Request,
    reader: ReadAccess,
    run: Annotated[str | None, Query(max_length=200, description="only this run")] = None,
) -> StreamingResponse:
    feed: LiveFeed = request.app.state.live
    return StreamingResponse(
        _stream(feed, run, reader, request),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
