"""Who may do what, per request: the checks every route goes through, as FastAPI dependencies.

- No token configured (neither `--token` nor a tokens file): everything is open, as before.
- Writes (`POST /api/v1/ingest`): `Authorization: Bearer <token>` with a known token, else 401
  (checked before the body is read); the batch's run must be covered by a write token, else 403
  (checked in the worker thread right after parsing, before anything is stored: `check_write`).
- Reads (the JSON API, the event stream, `/metrics`): a known token, else 401, unless
  `public_read`. A token reads the runs it covers (a write token the runs it writes): lists leave the
  others out, a request naming another run (`/runs/{run}/...`, `?run=`) is 403 whether that run exists
  or not, so the answer says nothing about other teams' runs. What spans every run (`/metrics`, the
  alert log, the detection worker) needs a token for every run (`runs: ["*"]`).
- The dashboard cannot put a header on EventSource: it logs in once (`POST /api/v1/login`), which sets
  an HttpOnly, SameSite=Strict cookie holding the token. The cookie is accepted for reads only, never
  for writes, so no other site can make a browser write (no CSRF).

`/healthz`, the page's HTML and scripts (which hold no data) and the OpenAPI description stay public.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Request
from sqlalchemy import ColumnElement, or_
from starlette.responses import Response

from stepwatch_server.auth.tokens import MIN_TOKEN_CHARS, Grant, legacy_grant
from stepwatch_server.errors import BadRequest, ErrorAnswer, Forbidden, InvalidBatch, Unauthorized
from stepwatch_server.ingest.body import read_body_bounded

if TYPE_CHECKING:
    from stepwatch_server.settings import Settings

log = logging.getLogger("stepwatch_server")
COOKIE = "stepwatch_token"
MAX_LOGIN_BYTES = 4096  # a login body: {"token": ...}; read bounded, since anyone may send one


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class Policy:
    """The configured tokens, and whether reads are open to all (`--public-read`)."""

    grants: tuple[Grant, ...]
    public_read: bool = False
    # Each grant's token as a SHA-256 digest, computed once here rather than on every request.
    _digests: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_digests", tuple(_digest(g.token) for g in self.grants))

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        legacy = (legacy_grant(settings.token),) if settings.token else ()
        return cls((*legacy, *settings.tokens), settings.public_read)

    def identify(self, given: str | None) -> Grant | None:
        """The grant whose token is `given`. Every token is compared, each in constant time, as SHA-256
        digests so that not even a token's length shows in the time taken."""
        if not given:
            return None
        digest = _digest(given)
        found = None
        for grant, known in zip(self.grants, self._digests, strict=True):
            if hmac.compare_digest(digest, known):
                found = grant
        return found

    @property
    def weak(self) -> bool:
        """No token at all, or one short enough to guess (only `--token` can be: the file's are checked)."""
        return not self.grants or any(len(g.token) < MIN_TOKEN_CHARS for g in self.grants)

    def describe(self) -> str:
        """For the start-up log: names and scopes, never a token."""
        if not self.grants:
            return "no tokens: anyone who reaches the collector writes and reads every run"
        listed = "; ".join(f"{g.name} ({g.scope} {g.runs})" for g in self.grants)
        reads = "reads are public (--public-read)" if self.public_read else "reads need a token"
        short = [g.name for g in self.grants if len(g.token) < MIN_TOKEN_CHARS]
        advice = f"; {', '.join(short)}: under {MIN_TOKEN_CHARS} characters, guessable" if short else ""
        return f"{len(self.grants)} token(s): {listed}; {reads}{advice}"


@dataclass(frozen=True)
class Reader:
    """Who is reading: a grant, or everyone (`grant` None: no tokens, or public reads)."""

    grant: Grant | None

    @property
    def every_run(self) -> bool:
        return self.grant is None or self.grant.runs.every_run

    def sees(self, run: str) -> bool:
        return self.grant is None or self.grant.reads(run)

    def runs_clause(self, column: Any) -> ColumnElement[bool] | None:
        """A WHERE clause on a run-name column keeping the runs this reader sees (None: all of them)."""
        if self.every_run or self.grant is None:
            return None
        return or_(
            *(
                column.startswith(p[:-1], autoescape=True) if p.endswith("*") else column == p
                for p in self.grant.runs.patterns
            )
        )

    def check(self, run: str) -> None:
        if self.grant is not None and not self.grant.reads(run):
            raise Forbidden(
                f"this token ({self.grant.name!r}) reads runs matching {self.grant.runs}; run {run!r} needs "
                "a read token for it",
                field="run",
            )


def _bearer(request: Request) -> str | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


def _policy(request: Request) -> Policy:
    policy: Policy = request.app.state.policy
    return policy


def read_access(request: Request) -> Reader:
    """Dependency of every read route: 401 without a known token (when tokens are configured and reads
    are not public), 403 when the request names a run the token does not read."""
    policy = _policy(request)
    if not policy.grants or policy.public_read:
        return Reader(None)
    grant = policy.identify(_bearer(request) or request.cookies.get(COOKIE))
    if grant is None:
        raise Unauthorized(
            "reading needs a read token: send 'Authorization: Bearer <token>' (the dashboard asks for it "
            "once); this collector has tokens and no --public-read",
            field="Authorization",
        )
    reader = Reader(grant)
    run = request.path_params.get("run") or request.query_params.get("run")
    if run is not None:
        reader.check(run)
    return reader


ReadAccess = Annotated[Reader, Depends(read_access)]


def read_every_run(request: Request, reader: ReadAccess) -> Reader:
    """Dependency of the reads that span every run (`/metrics`, the alert log, the detection worker)."""
    if not reader.every_run:
        assert reader.grant is not None
        raise Forbidden(
            f"{request.url.path} shows every run: it needs a read token for every run (runs: ['*']); this "
            f"token ({reader.grant.name!r}) reads runs matching {reader.grant.runs}",
            field="Authorization",
        )
    return reader


def write_access(request: Request) -> Grant | None:
    """The writer's grant (None: no tokens, writes are open); 401 without a known bearer token. Only the
    header counts: the dashboard's cookie never writes."""
    policy = _policy(request)
    if not policy.grants:
        return None
    grant = policy.identify(_bearer(request))
    if grant is None:
        raise Unauthorized(
            "writing needs a write token: send 'Authorization: Bearer <token>' with a write token for the run",
            field="Authorization",
        )
    return grant


def check_write(grant: Grant | None, run: str) -> None:
    """403 unless `grant` writes `run` (called once the batch is parsed, before anything is stored)."""
    if grant is None or grant.writes(run):
        return
    if grant.scope != "write":
        raise Forbidden(
            f"this token ({grant.name!r}) only reads; run {run!r} needs a write token for it", field="run"
        )
    raise Forbidden(
        f"this token ({grant.name!r}) writes runs matching {grant.runs}; run {run!r} needs a write token "
        "for it",
        field="run",
    )


READ_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {
        "model": ErrorAnswer,
        "description": "Tokens are configured, reads are not public, and no known token was sent.",
    },
    403: {
        "model": ErrorAnswer,
        "description": "The token does not read this run (or, where every run is shown, every run).",
    },
}
router = APIRouter(prefix="/api/v1", tags=["auth"])
_RESPONSES: dict[int | str, dict[str, Any]] = {
    204: {"description": "Done; the cookie is set (login) or cleared (logout)."},
}


_LOGIN_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {"token": {"type": "string", "minLength": 1}},
                "required": ["token"],
            }
        }
    },
}


@router.post(
    "/login",
    status_code=204,
    summary="The dashboard's login: sets an HttpOnly cookie with a known token, for reads",
    openapi_extra={"requestBody": _LOGIN_BODY},
    responses={
        **_RESPONSES,
        400: {"description": "The body is not JSON."},
        401: {"description": "The token is not known to the collector."},
        413: {"description": f"The body is over {MAX_LOGIN_BYTES} bytes."},
        422: {"description": "No `token` string in the body."},
    },
)
async def login(request: Request) -> Response:
    raw = await read_body_bounded(request, MAX_LOGIN_BYTES)
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest(
            'the body is not JSON: send {"token": "..."}', field="body", code="invalid_json"
        ) from None
    token = doc.get("token") if isinstance(doc, dict) else None
    if not isinstance(token, str) or not token:
        raise InvalidBatch('token: expected a non-empty string, as in {"token": "..."}', field="token")
    grant = _policy(request).identify(token)
    if grant is None:
        raise Unauthorized("this token is not known to the collector: check it and try again", field="token")
    log.info("dashboard login with the token %r", grant.name)
    response = Response(status_code=204)
    response.set_cookie(
        COOKIE, token, httponly=True, samesite="strict", secure=request.url.scheme == "https", path="/"
    )
    return response


@router.post("/logout", status_code=204, summary="Clears the dashboard's login cookie", responses=_RESPONSES)
def logout() -> Response:
    response = Response(status_code=204)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return response
