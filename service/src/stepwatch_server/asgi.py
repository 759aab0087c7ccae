"""The collector's ASGI application: FastAPI, with its hot route taken straight to its handler.

At the agents' cadence nearly every request is `POST /api/v1/ingest` (a 1,000-rank run sends ~500 a
second), and the layers every FastAPI request passes through (its native OpenTelemetry check, five
middlewares, the router's matching of every route, the dependency solver) took about a third of the event
loop's time per batch (py-spy on a collector under bench/batch_rate.py). `CollectorApp` sends that one
method and path to the same handler (ingest/routes.py) with what those layers would have done for it: the
app-wide parameter check (params.py) and the app's own exception handlers (errors.py), looked up as
Starlette looks them up. Every other request, and the OpenAPI description of ingest, are FastAPI's.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from stepwatch_server.ingest.routes import INGEST_PATH, ingest
from stepwatch_server.params import no_nul_in_parameters


class CollectorApp(FastAPI):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # (mounted under a root path, the path differs: FastAPI's routing then takes it, as any route)
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == INGEST_PATH:
            await self._ingest(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def _ingest(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self  # as Starlette sets it: `request.app.state` is the app's
        request = Request(scope, receive, send)
        try:
            await no_nul_in_parameters(request)
            response = await ingest(request)
        except Exception as exc:  # the answer FastAPI's stack would give: the app's handler for it
            response = await self._handler(exc)(request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Any:
        for cls in type(exc).__mro__:  # the most specific registered class first, as Starlette does
            if cls in self.exception_handlers:
                return self.exception_handlers[cls]
        raise exc  # unreachable: errors.py registers one for Exception
