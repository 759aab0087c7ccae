"""The commands API (docs/api.md, "Commands"): ask a run's ranks for evidence, read their answers, and the
agents' endpoint for those answers.

`write_router` (a write token for the run): `POST /api/v1/runs/{run}/commands` asks, `POST
/api/v1/commands/{id}/results` is where an agent answers. `read_router` (behind the read check): the run's
recent commands, and one command with each rank's status and the stacks grouped (stacks.py). The
collector never connects to a rank: ingest puts the pending commands on its answers (pending.py).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from stepwatch_server.auth import Grant, check_write, write_access
from stepwatch_server.commands import profiles, stacks, store
from stepwatch_server.errors import RUN_NOT_FOUND, ErrorAnswer, InvalidBatch, NotFound
from stepwatch_server.ingest.body import decode_body, read_body_bounded
from stepwatch_server.ingest.schema import MAX_WORLD_SIZE
from stepwatch_server.params import Conn
from stepwatch_server.responses import json_response
from stepwatch_server.runs import queries
from stepwatch_server.storage import write_transaction
from stepwatch_server.storage.models import Anomaly

log = logging.getLogger(__name__)
write_router = APIRouter(prefix="/api/v1", tags=["commands"])
read_router = APIRouter(prefix="/api/v1", tags=["commands"])
MAX_PROFILED_RANKS = 8
DEFAULT_PROFILE_STEPS = 5
MAX_PROFILE_STEPS = 50
MAX_COMMAND_ID = 2**31 - 1
RankNumber = Annotated[int, Field(ge=0, lt=MAX_WORLD_SIZE)]
CommandId = Annotated[int, PathParam(ge=1, le=MAX_COMMAND_ID, description="the command's id")]
AnswerWithin = Annotated[
    float, Field(ge=1, le=3600, description="a rank without an answer by then reads `no answer`")
]


AnomalyId = Annotated[
    int | None,
    Field(ge=1, le=MAX_COMMAND_ID, description="an anomaly of the run the evidence is for: it lists it"),
]


class AskStacks(BaseModel):
    kind: Literal["stacks"] = Field(description="every thread's Python stack on each rank asked")
    ranks: list[RankNumber] | None = Field(
        None, max_length=MAX_WORLD_SIZE, description="the ranks asked; omitted: every rank of the run"
    )
    answer_within_s: AnswerWithin = store.ANSWER_WITHIN_S
    anomaly_id: AnomalyId = None

    def asked(self) -> tuple[list[int] | None, dict[str, Any]]:
        return self.ranks, {}


class AskProfile(BaseModel):
    kind: Literal["profile"] = Field(description="a torch.profiler trace of `steps` whole steps on each rank")
    ranks: list[RankNumber] = Field(
        min_length=1, max_length=MAX_PROFILED_RANKS, description="e.g. [37, 12]: a straggler and a peer"
    )
    steps: int = Field(DEFAULT_PROFILE_STEPS, ge=1, le=MAX_PROFILE_STEPS, description="steps traced")
    answer_within_s: AnswerWithin = store.ANSWER_WITHIN_S
    anomaly_id: AnomalyId = None

    def asked(self) -> tuple[list[int] | None, dict[str, Any]]:
        return self.ranks, {"steps": self.steps}


Ask = Annotated[AskStacks | AskProfile, Field(discriminator="kind")]


class Outcome(BaseModel):
    """An agent's answer to one command (docs/ingest.md, "Commands"); gzip JSON like a batch."""

    run: str = Field(min_length=1, max_length=200, description="the command's run")
    rank: RankNumber = Field(description="the answering rank")
    session: str = Field("", max_length=64, description="the agent's session")
    kind: str | None = Field(None, max_length=32, description="the command's kind, as the agent took it")
    status: Literal["done", "refused", "failed"]
    message: str = Field("", max_length=2000, description="why, for `refused` and `failed`")
    result: dict[str, Any] | None = Field(None, description="what `done` found (at most 2 MiB as JSON)")


_BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorAnswer, "description": "Not gzip, not UTF-8 or not JSON."},
    404: {"model": ErrorAnswer, "description": "No such command of that run (`not_found`)."},
    413: {"model": ErrorAnswer, "description": "Over the size limit."},
    415: {"model": ErrorAnswer, "description": "Unsupported Content-Encoding."},
}
_OUTCOME_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": Outcome.model_json_schema()}},
    }
}
_TRACE_BODY = {
    "requestBody": {
        "required": True,
        "description": "The trace (Chrome trace JSON), gzip-compressed, stored and served as it is.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


def _requester(grant: Grant | None) -> str:
    return f"token {grant.name}" if grant is not None else "anonymous (no tokens configured)"


def ask_sync(
    request: Request, run: str, ask: AskStacks | AskProfile, requested_by: str, reason: str
) -> dict[str, Any]:
    with write_transaction(request.app.state.engine) as conn:
        found = queries.find_run(conn, run)
        if ask.anomaly_id is not None and not store.anomaly_of(conn, found.id, ask.anomaly_id):
            raise NotFound(f"anomaly {ask.anomaly_id} of run {run!r} not found", field="anomaly_id")
        targets, args = ask.asked()
        cid = store.ask(
            conn, found.id, ask.kind, targets, args, requested_by, reason, ask.anomaly_id, ask.answer_within_s
        )
        row = store.find(conn, cid, run)
    pending = request.app.state.commands
    if pending is not None:
        pending.asked(store.asked(row, run))
    who = "every rank" if targets is None else f"ranks {targets}"
    log.info("command %d (%s) asked of run %r, %s, by %s", cid, ask.kind, run, who, requested_by)
    return _command(row)


def _command(row: Any) -> dict[str, Any]:
    return {
        "id": row.id, "kind": row.kind, "targets": row.targets, "ranks": row.ranks, "args": row.args,
        "requested_by": row.requested_by,
        "reason": row.reason, "anomaly_id": row.anomaly_id, "created_at": row.created_at.isoformat(),
        "expires_at": row.expires_at.isoformat(),
    }  # fmt: skip


@write_router.post(
    "/runs/{run:path}/commands",
    summary="Ask a run's ranks for evidence (every thread's stack); answered through their agents",
    status_code=202,
    responses={**RUN_NOT_FOUND},
)
async def ask_command(
    run: str, ask: Ask, request: Request, grant: Annotated[Grant | None, Depends(write_access)]
) -> Response:
    """Stored at once; each rank's agent gets it on the answer to its next batch or heartbeat (within its
    heartbeat interval) and posts its result; `GET .../commands/{id}` reads them. A rank that has not
    answered within `answer_within_s` (default 60 s) reads "no answer"."""
    check_write(grant, run)
    answer = await run_in_threadpool(ask_sync, request, run, ask, _requester(grant), "asked through the API")
    return json_response(answer, status=202)


def _answer_sync(
    request: Request, grant: Grant | None, command_id: int, raw: bytes, encoding: str | None, limit: int
) -> tuple[Outcome, bool]:
    """Decode, check and store one agent's answer: (the answer, whether it was this rank's first)."""
    try:
        outcome = Outcome.model_validate(decode_body(raw, encoding, limit))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "body"
        raise InvalidBatch(f"{where}: {error['msg']}", field=where) from None
    check_write(grant, outcome.run)
    if outcome.result is not None and len(json.dumps(outcome.result)) > store.MAX_RESULT_BYTES:
        raise InvalidBatch(f"result: more than {store.MAX_RESULT_BYTES} bytes as JSON", field="result")
    with write_transaction(request.app.state.engine) as conn:
        command = store.find(conn, command_id, outcome.run)
        o = outcome
        first = store.answer(conn, command, o.rank, o.session, o.status, o.message, o.result)
    return outcome, first


@write_router.post(
    "/commands/{command_id}/results",
    summary="An agent's answer to a command (the agent sends it)",
    responses={**_BODY_ERRORS},
    openapi_extra=_OUTCOME_BODY,
)
async def post_result(
    command_id: CommandId, request: Request, grant: Annotated[Grant | None, Depends(write_access)]
) -> Response:
    """The first answer of a rank counts (`first` false for a later one); the answer may carry the commands
    this rank still owes, as ingest's does. Decoded, checked and stored on a thread of the pool."""
    settings = request.app.state.settings
    raw = await read_body_bounded(request, settings.max_batch_bytes)
    encoding = request.headers.get("content-encoding")
    outcome, first = await run_in_threadpool(
        _answer_sync, request, grant, command_id, raw, encoding, settings.max_batch_bytes
    )
    run, rank = outcome.run, outcome.rank
    pending = request.app.state.commands
    if pending is not None:
        pending.answered(run, command_id, rank)
    answer: dict[str, Any] = {"accepted": True, "first": first}
    if pending is not None and (more := pending.for_rank(run, rank)):
        answer["commands"] = more
    return json_response(answer)


@read_router.get(
    "/runs/{run:path}/commands/{command_id}",
    summary="One command: each rank's answer, stacks grouped",
    responses={**RUN_NOT_FOUND},
)
def read_command(run: str, command_id: CommandId, conn: Conn) -> Response:
    """Per rank: `done`, `refused` or `failed` (with its message), `waiting` (not answered yet) or `no answer`
    (none within the command's time); the `done` stacks grouped by the training thread's frames, smallest
    group first, the blamed rank's (a command asked at a verdict) before all."""
    row = store.find(conn, command_id, run)
    answers = {r.rank: r for r in store.results(conn, command_id)}
    asked = list(row.targets) if row.targets is not None else store.run_ranks(conn, row.run_id)
    expired = row.expires_at <= store.now()
    ranks = []
    for rank in sorted(set(asked) | set(answers)):
        got = answers.get(rank)
        if got is None:
            ranks.append({"rank": rank, "status": "no answer" if expired else "waiting"})
        else:
            ranks.append({"rank": rank, "status": got.status, "message": got.message or None,
                          "received_at": got.received_at.isoformat()})  # fmt: skip
    done = [(r, answers[r].result) for r in sorted(answers) if answers[r].status == "done"]
    blamed = _blamed(conn, row.anomaly_id)
    answer: dict[str, Any] = {**_command(row), "blamed_rank": blamed, "ranks": ranks}
    if row.kind == "stacks":
        answer["groups"] = stacks.group(done, blamed)
    else:
        sizes = store.artifact_sizes(conn, command_id)
        base = f"/api/v1/runs/{quote(run, safe='/')}/commands/{command_id}/traces"
        answer["traces"] = [{"rank": r, "bytes": n, "url": f"{base}/{r}"} for r, n in sorted(sizes.items())]
        answer["comparison"] = profiles.compare(done, blamed)
    answer["results"] = {str(r): result for r, result in done}
    return json_response(answer)


@read_router.get(
    "/runs/{run:path}/commands/{command_id}/traces/{rank}",
    summary="One rank's profiler trace of a `profile` command (Chrome trace JSON, gzip; opens in Perfetto)",
    responses={
        **RUN_NOT_FOUND,
        200: {
            "description": "The trace, gzip",
            "content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}},
        },
    },
)
def read_trace(
    run: str,
    command_id: CommandId,
    rank: Annotated[int, PathParam(ge=0, lt=MAX_WORLD_SIZE, description="the rank")],
    conn: Conn,
) -> Response:
    data = store.artifact(conn, store.find(conn, command_id, run).id, rank)
    if data is None:
        raise NotFound(f"no trace of rank {rank} for command {command_id} of run {run!r}", field="rank")
    name = f"stepwatch-{command_id}-rank{rank}.json.gz"
    headers = {"Content-Disposition": f'attachment; filename="{name}"'}
    return Response(data, media_type="application/gzip", headers=headers)


@write_router.post(
    "/commands/{command_id}/artifacts",
    summary="A rank's file for a command: its profiler trace (the agent sends it)",
    responses={**_BODY_ERRORS},
    openapi_extra=_TRACE_BODY,
)
async def post_artifact(
    command_id: CommandId,
    request: Request,
    grant: Annotated[Grant | None, Depends(write_access)],
    run: Annotated[str, Query(min_length=1, max_length=200, description="the command's run")],
    rank: Annotated[int, Query(ge=0, lt=MAX_WORLD_SIZE, description="the uploading rank")],
) -> Response:
    """The body is the file, gzip-compressed, as it is stored and served (at most 32 MiB)."""
    check_write(grant, run)
    data = await read_body_bounded(request, store.MAX_ARTIFACT_BYTES)
    if data[:2] != b"\x1f\x8b":
        raise InvalidBatch("body: expected a gzip file (the trace, compressed)", field="body")

    def write() -> bool:
        with write_transaction(request.app.state.engine) as conn:
            return store.store_artifact(conn, store.find(conn, command_id, run), rank, data)

    first = await run_in_threadpool(write)
    return json_response({"accepted": True, "first": first, "bytes": len(data)})


def _blamed(conn: Conn, anomaly_id: int | None) -> int | None:
    if anomaly_id is None:
        return None
    rank = conn.execute(select(Anomaly.rank).where(Anomaly.id == anomaly_id)).scalar()
    return None if rank is None else int(rank)


@read_router.get(
    "/runs/{run:path}/commands",
    summary="The run's recent commands (newest first)",
    responses={**RUN_NOT_FOUND},
)
def list_commands(run: str, conn: Conn) -> Response:
    found = queries.find_run(conn, run)
    return json_response({"commands": [_command(r) for r in store.listed(conn, found.id)]})
