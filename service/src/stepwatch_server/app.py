"""`create_app()`: the collector as an ASGI application.

The lifespan owns the database engine: it creates it, applies the migrations, builds the batch
writer, and disposes of the engine at shutdown.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from stepwatch_server.errors import ServiceUnavailable, install_error_handlers
from stepwatch_server.ingest.routes import router as ingest_router
from stepwatch_server.ingest.store import BatchWriter
from stepwatch_server.responses import json_response
from stepwatch_server.runs.routes import router as runs_router
from stepwatch_server.settings import Settings
from stepwatch_server.storage import make_engine, upgrade

log = logging.getLogger(__name__)
VERSION = "0.1.0"


def create_app(settings: Settings | None = None) -> FastAPI:
    """The collector for `settings` (default: `Settings()`, i.e. from the environment)."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(settings.database_url)
        try:
            if settings.run_migrations:
                await run_in_threadpool(upgrade, engine)
            app.state.engine = engine
            app.state.writer = BatchWriter(engine)
            log.info(
                "stepwatch collector ready (database %s)", engine.url.render_as_string(hide_password=True)
            )
            yield
        finally:
            engine.dispose()

    app = FastAPI(
        title="stepwatch collector",
        version=VERSION,
        summary="Ingest, storage and read API for training-run health.",
        lifespan=lifespan,
        openapi_tags=[
            {"name": "ingest", "description": "Batches from agents (docs/ingest.md)."},
            {"name": "runs", "description": "Reading runs, ranks and series back."},
            {"name": "health", "description": "Liveness and database reachability."},
        ],
    )
    app.state.settings = settings
    install_error_handlers(app)
    app.include_router(ingest_router)
    app.include_router(runs_router)

    @app.get("/healthz", tags=["health"], summary="The collector is up and its database answers")
    def healthz(request: Request) -> Response:
        try:
            with request.app.state.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:
            raise ServiceUnavailable(f"database unreachable: {type(exc).__name__}", field=None) from exc
        return json_response({"status": "ok", "database": request.app.state.engine.dialect.name})

    return app
