"""`POST /api/v1/ingest` (docs/ingest.md).

The event loop only checks the token (auth/access.py: 401 before the body is read) and streams the
body in under the size limit; decompression, parsing, validation, the check that the token writes the
batch's run (403) and the database transaction run in the thread pool. The answer is sent after
the commit; `_after_commit()` is the single point where stored batches leave ingest (the bus that
feeds the detectors hooks in there).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from stepwatch_server.auth import Grant, check_write, write_access
from stepwatch_server.ingest.body import decode_body, read_body_bounded
from stepwatch_server.ingest.example import EXAMPLE_BATCH
from stepwatch_server.ingest.schema import Batch
from stepwatch_server.ingest.store import BatchWriter, IngestResult
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.metrics import counts_rejections, ingest_accepted
from stepwatch_server.responses import json_response
from stepwatch_server.settings import Settings

router = APIRouter(prefix="/api/v1", tags=["ingest"])

_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "field": {"type": ["string", "null"]},
                "message": {"type": "string"},
            },
        }
    },
}
_OPENAPI = {
    "requestBody": {
        "required": True,
        "description": "One batch: the records of one rank for some steps, as columns (docs/ingest.md). "
        "`Content-Encoding: gzip` accepted; at most 16 MiB on the wire and after decompression.",
        "content": {"application/json": {"schema": {"type": "object"}, "example": EXAMPLE_BATCH}},
    },
    "responses": {
        "200": {
            "description": "Committed (or recognised as a duplicate).",
            "content": {
                "application/json": {
                    "example": {"accepted": True, "rows": 20, "duplicates": 0, "incarnation": 1}
                }
            },
        },
        **{
            code: {"description": what, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
            for code, what in (
                ("400", "Not gzip, not UTF-8 or not JSON."),
                ("401", "Token missing or unknown."),
                ("403", "The token does not write this run (a read token, or another run prefix)."),
                ("413", "Over the size limit."),
                ("415", "Unsupported Content-Encoding."),
                ("422", "A field is invalid; `field` and `message` say which and why."),
            )
        },
    },
}


def _after_commit(request: Request, batch: Batch, result: IngestResult) -> None:
    """Stored batches leave ingest here: to the detection worker's queue (never blocks; a full queue
    drops the batch for detection only), and their run and step range to the rollup worker. A duplicate is not re-fed; a batch with only steps or a
    heartbeat is, because that is how hangs are told apart."""
    worker = request.app.state.detection
    stored = result.rows > 0 or batch.steps.size > 0 or batch.heartbeat is not None
    if worker is not None and not result.duplicate and stored:
        worker.submit(batch, time.monotonic())
    if request.app.state.rollups is not None and result.steps is not None:  # runs/rollup_worker.py
        request.app.state.rollups.submit(result.run_id, *result.steps)


def _ingest_sync(
    writer: BatchWriter, grant: Grant | None, raw: bytes, encoding: str | None, limit: int
) -> tuple[Batch, IngestResult]:
    batch = parse_batch(decode_body(raw, encoding, limit))
    check_write(grant, batch.run)  # the run is known only now; nothing is stored yet
    return batch, writer.write(batch)


@router.post("/ingest", summary="Ingest one batch (one rank, many steps)", openapi_extra=_OPENAPI)
@counts_rejections
async def ingest(request: Request) -> Response:
    started = time.perf_counter()
    settings: Settings = request.app.state.settings
    grant = write_access(request)
    raw = await read_body_bounded(request, settings.max_batch_bytes)
    batch, result = await run_in_threadpool(
        _ingest_sync,
        request.app.state.writer,
        grant,
        raw,
        request.headers.get("content-encoding"),
        settings.max_batch_bytes,
    )
    _after_commit(request, batch, result)
    ingest_accepted(len(raw), result.rows, result.duplicate, time.perf_counter() - started)
    return json_response(result.answer())
