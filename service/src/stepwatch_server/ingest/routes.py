"""`POST /api/v1/ingest` (docs/ingest.md).

The event loop only checks the token (auth/access.py: 401 before the body is read) and streams the
body in under the size limit; decompression, parsing, validation, the check that the token writes the
batch's run (403) and the database transaction run on ingest's writing thread (ingest/pipeline.py),
with the other bodies that wait; a body over PIPELINE_MAX_BYTES on a thread of the pool of its own. The answer is sent after
the commit; `_after_commit()` is the single point where stored batches leave ingest: to the detection
worker in this process, or with `--bus` to the bus's streams (bus/publisher.py).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from stepwatch_server.auth import Grant, check_write, write_access
from stepwatch_server.errors import DetectionBehind, ErrorAnswer
from stepwatch_server.ingest.body import decode_body, read_body_bounded
from stepwatch_server.ingest.example import EXAMPLE_BATCH
from stepwatch_server.ingest.schema import (
    MAX_NODE_CHARS,
    MAX_STEP,
    MAX_WORLD_SIZE,
    RUN_RE,
    SCHEMA_VERSIONS,
    SESSION_RE,
    Batch,
)
from stepwatch_server.ingest.store import BatchWriter, IngestResult
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.metrics import counts_rejections, ingest_accepted
from stepwatch_server.responses import json_response
from stepwatch_server.settings import Settings

router = APIRouter(prefix="/api/v1", tags=["ingest"])
INGEST_PATH = "/api/v1/ingest"  # also taken straight to `ingest` by asgi.CollectorApp
# Bodies up to this size (on the wire) go to ingest's writing thread (ingest/pipeline.py); bigger ones
# (wide batches: thousands of names) are decoded, validated and written on a thread of their own, as a
# group of one, so that the small batches of other runs never wait for their decoding.
PIPELINE_MAX_BYTES = 64 * 1024


class IngestAnswer(BaseModel):
    """The acknowledgement: the only answer an agent counts as delivered."""

    accepted: Literal[True]
    rows: int  # values stored; 0 for a batch sent again
    duplicates: int  # values already stored from an earlier copy of the batch
    incarnation: int | None
    commands: list[dict[str, Any]] | None = None  # evidence asked of this rank (commands/), when any


_STEP = {"type": "integer", "minimum": 0, "maximum": MAX_STEP}
_INDEX = {"type": "integer", "minimum": 0}
_VALUE = {"anyOf": [{"type": "number"}, {"enum": ["NaN", "Infinity", "-Infinity"]}, {"type": "null"}]}
_COLUMNS = {"type": "object", "additionalProperties": {"type": "array", "items": _VALUE}}
# The batch's fields and their types (docs/ingest.md). Rules across fields are not expressible here and are
# checked by the collector (422): every column as long as its steps, steps strictly increasing, rank <
# world_size, the limits of README "Security and limits".
_BATCH_SCHEMA = {
    "type": "object",
    "required": ["schema", "run", "session", "seq", "rank", "world_size", "steps", "timestamps"],
    "properties": {
        "schema": {"enum": list(SCHEMA_VERSIONS)},
        "run": {"type": "string", "pattern": f"^{RUN_RE.pattern}$"},
        "session": {"type": "string", "pattern": f"^{SESSION_RE.pattern}$"},
        "seq": _STEP,
        "rank": _INDEX,
        "local_rank": _INDEX,
        "world_size": {"type": "integer", "minimum": 1, "maximum": MAX_WORLD_SIZE},
        "node": {"type": "string", "maxLength": MAX_NODE_CHARS},
        "replica_group": _INDEX,
        "shard": _INDEX,
        "num_shards": {"type": "integer", "minimum": 1},
        "agent": {"type": "object"},
        "steps": {"type": "array", "items": _STEP},
        "timestamps": {"type": "array", "items": {"type": "number"}},
        "metrics": _COLUMNS,
        "tensors": {"type": "object", "properties": {"steps": {"type": "array", "items": _STEP}}},
        "fingerprints": {"type": "object"},
        "events": {"type": "array", "items": {"type": "object"}},
        "heartbeat": {"type": "object"},
    },
}
_OPENAPI = {
    "requestBody": {
        "required": True,
        "description": "One batch: the records of one rank for some steps, as columns (docs/ingest.md). "
        "`Content-Encoding: gzip` accepted; at most 16 MiB on the wire and after decompression.",
        "content": {"application/json": {"schema": _BATCH_SCHEMA, "example": EXAMPLE_BATCH}},
    },
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorAnswer, "description": what}
    for code, what in (
        (400, "Not gzip, not UTF-8 or not JSON."),
        (401, "Token missing or unknown."),
        (403, "The token does not write this run (a read token, or another run prefix)."),
        (413, "Over the size limit."),
        (415, "Unsupported Content-Encoding."),
        (422, "A field is invalid; `field` and `message` say which and why."),
        (429, "Detection is too far behind (`detection_behind`): nothing stored; retry after `Retry-After`."),
    )
}


async def _after_commit(request: Request, batch: Batch, result: IngestResult) -> None:
    """Stored batches leave ingest here: to detection, in the slot the request took before writing (the
    detection worker's queue: never blocks; or the bus's stream, awaited: an acknowledged batch is on the
    bus), and their run and step range to the rollup worker. A duplicate is not re-fed (its slot is
    freed); a batch with only steps or a heartbeat is, because that is how hangs are told apart."""
    worker = request.app.state.detection
    stored = result.rows > 0 or batch.steps.size > 0 or batch.heartbeat is not None
    if worker is not None:
        if not result.duplicate and stored:
            await worker.hand_over(batch, time.monotonic(), result.run_id, result.new_run)
        else:
            worker.release()
    if request.app.state.rollups is not None and result.steps is not None:  # runs/rollup_worker.py
        request.app.state.rollups.submit(result.run_id, *result.steps)


def _ingest_sync(
    writer: BatchWriter, grant: Grant | None, raw: bytes, encoding: str | None, limit: int
) -> tuple[Batch, IngestResult]:
    batch = parse_batch(decode_body(raw, encoding, limit))
    check_write(grant, batch.run)  # the run is known only now; nothing is stored yet
    return batch, writer.write(batch)


@router.post(
    INGEST_PATH.removeprefix(router.prefix),
    summary="Ingest one batch (one rank, many steps)",
    responses={
        200: {"model": IngestAnswer, "description": "Committed (or recognised as a duplicate)."},
        **_ERRORS,
    },
    openapi_extra=_OPENAPI,
)
@counts_rejections
async def ingest(request: Request) -> Response:
    started = time.perf_counter()
    settings: Settings = request.app.state.settings
    grant = write_access(request)
    raw = await read_body_bounded(request, settings.max_batch_bytes)
    worker = request.app.state.detection
    if worker is not None and not worker.reserve():  # stored now, this batch would never be detected
        raise DetectionBehind(
            f"detection is behind ({worker.behind}): nothing was stored; send this batch again "
            f"after {DetectionBehind.retry_after_s} s (the agent backs off and spools it)"
        )
    encoding = request.headers.get("content-encoding")
    try:
        # the agent's batches: with the others waiting, to a writing thread
        if len(raw) <= PIPELINE_MAX_BYTES:
            batch, result = await request.app.state.ingest.ingest(
                raw, encoding, settings.max_batch_bytes, grant
            )
        else:  # a wide body decodes and validates on its own thread: small ones never queue behind that
            batch, result = await run_in_threadpool(
                _ingest_sync, request.app.state.writer, grant, raw, encoding, settings.max_batch_bytes
            )
    except BaseException:
        if worker is not None:
            worker.release()
        raise
    await _after_commit(request, batch, result)
    ingest_accepted(len(raw), result.rows, result.duplicate, time.perf_counter() - started)
    answer = result.answer()
    commands = request.app.state.commands
    if commands is not None and (asked := commands.for_rank(batch.run, batch.rank)):
        answer["commands"] = asked  # the command channel (commands/): no inbound connection to a rank
    return json_response(answer)
