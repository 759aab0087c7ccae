"""What every route's parameters share: the database connection dependency (`Conn`), the step range and
point budget of the read endpoints, and the checks on every request's query and path parameters, run
before any route reads them.

PostgreSQL cannot store or compare a string holding NUL (U+0000): a parameter with one would reach the
database as an error (500). Ingest refuses NUL in a batch (ingest/validate.py); this refuses it in the
parameters of every route, in one place (an app-wide dependency).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Query, Request
from sqlalchemy import Connection

from stepwatch_server.errors import InvalidParameter
from stepwatch_server.ingest.schema import MAX_STEP
from stepwatch_server.runs.downsample import MAX_POINTS_CAP


def connection(request: Request) -> Iterator[Connection]:
    """A read connection from the app's engine, for the request's lifetime."""
    with request.app.state.engine.connect() as conn:
        yield conn


Conn = Annotated[Connection, Depends(connection)]
FromStep = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="first step (inclusive)")]
ToStep = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="last step (inclusive)")]
MaxPoints = Annotated[int, Query(ge=2, le=MAX_POINTS_CAP, description="per series; min-max downsampling")]


async def no_nul_in_parameters(request: Request) -> None:
    """Async, so that FastAPI runs it on the event loop: a sync dependency costs every request (each
    ingest batch too) a hand-over to the thread pool and back, for a check of a few microseconds."""
    for name, value in (*request.query_params.multi_items(), *request.path_params.items()):
        if "\x00" in str(value):
            raise InvalidParameter(
                f"{name}: holds a NUL character (U+0000), which no name or value may", field=name
            )
