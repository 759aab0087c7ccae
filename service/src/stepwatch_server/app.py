"""`create_app()`: the collector as an ASGI application.

The lifespan owns the database engine and the workers: it creates the engine, applies the
migrations, builds the batch writer, starts the rollup worker (runs/rollup_worker.py) and the
detection worker (detect/worker.py) unless `settings.detection` is off, the retention worker
(runs/expiry.py) when a retention is set, the compaction worker (runs/compaction.py) unless it is off, and at shutdown stops the
workers (draining them within their deadlines) before disposing of the engine.

With `settings.alerts`, it also starts the alert worker (alerts/worker.py) before the detection
worker, whose store then records alert events in each anomaly transaction; at shutdown the alert
worker stops after the detection worker, so the last anomalies' alerts are in the outbox.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from pydantic import BaseModel
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from stepwatch_server import auth
from stepwatch_server.alerts.routes import router as alerts_router
from stepwatch_server.alerts.worker import AlertWorker
from stepwatch_server.asgi import CollectorApp
from stepwatch_server.background import BackgroundWorker
from stepwatch_server.commands.pending import PendingCommands
from stepwatch_server.commands.routes import read_router as commands_router
from stepwatch_server.commands.routes import write_router as commands_write_router
from stepwatch_server.dashboard.routes import router as dashboard_router
from stepwatch_server.detect.engine import EngineSettings
from stepwatch_server.detect.routes import router as detect_router
from stepwatch_server.detect.worker import DetectionWorker
from stepwatch_server.errors import COMMON_ERRORS, ServiceUnavailable, install_error_handlers
from stepwatch_server.ingest.pipeline import IngestPipeline
from stepwatch_server.ingest.routes import router as ingest_router
from stepwatch_server.ingest.store import BatchWriter
from stepwatch_server.metrics import router as metrics_router
from stepwatch_server.params import no_nul_in_parameters
from stepwatch_server.responses import json_response
from stepwatch_server.runs.compaction import CompactionWorker
from stepwatch_server.runs.expiry import ExpiryWorker
from stepwatch_server.runs.rollup_worker import RollupWorker
from stepwatch_server.runs.routes import router as runs_router
from stepwatch_server.runs.routes import write_router as runs_write_router
from stepwatch_server.settings import Settings
from stepwatch_server.storage import make_engine, upgrade
from stepwatch_server.web import live, pages

log = logging.getLogger(__name__)
VERSION = "0.1.0"


class HealthzAnswer(BaseModel):
    status: Literal["ok"]
    database: str  # the dialect: sqlite or postgresql


def create_app(settings: Settings | None = None) -> FastAPI:
    """The collector for `settings` (default: `Settings()`, i.e. from the environment)."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(settings.database_url)
        started: list[BackgroundWorker] = []  # stopped in the reverse order, each by its deadline
        try:
            if settings.run_migrations:
                await run_in_threadpool(upgrade, engine)
            app.state.engine = engine
            app.state.writer = BatchWriter(engine)
            app.state.ingest = IngestPipeline(app.state.writer).start()
            if settings.alerts is not None:
                app.state.alerts = AlertWorker(engine, settings.alerts).start()
                started.append(app.state.alerts)
                if not settings.detection:
                    log.warning("alerts are configured but detection is off: nothing will be alerted")
            app.state.live = live.LiveFeed(engine, app.state.stopping)
            app.state.commands = PendingCommands(engine).start()
            started.append(app.state.commands)
            app.state.rollups = RollupWorker(engine).start()
            started.append(app.state.rollups)
            if settings.raw_retention_days is not None or settings.run_retention_days is not None:
                writer = app.state.writer
                app.state.expiry = ExpiryWorker(
                    engine,
                    settings.raw_retention_days,
                    settings.run_retention_days,
                    on_deleted=lambda run: writer.forget_run(run.name, run.id),
                ).start()
                started.append(app.state.expiry)
            if settings.compact_after_steps:
                app.state.compaction = CompactionWorker(engine, settings.compact_after_steps).start()
                started.append(app.state.compaction)
            if settings.detection and settings.bus is not None:  # detect workers take it from there
                from stepwatch_server.bus.metrics import PublisherMetrics
                from stepwatch_server.bus.publisher import BusPublisher
                from stepwatch_server.bus.streams import connect

                app.state.detection = BusPublisher(connect(settings.bus)).start()
                started.append(app.state.detection)
                app.state.metric_collectors = [PublisherMetrics(app.state.detection.stats)]
            elif settings.detection:
                overrides = settings.detection_overrides
                on_stored = app.state.alerts.on_stored if app.state.alerts is not None else None
                app.state.detection = DetectionWorker(
                    engine, EngineSettings(overrides=overrides), on_stored=on_stored
                ).start()
                started.append(app.state.detection)
            log.info(
                "stepwatch collector ready (database %s, detection %s)",
                engine.url.render_as_string(hide_password=True),
                ("by detect workers on the bus" if settings.bus else "on") if settings.detection else "off",
            )
            policy: auth.Policy = app.state.policy
            (log.warning if policy.weak else log.info)("access: %s", policy.describe())
            yield
        finally:
            if app.state.live is not None:
                await app.state.live.close()
            if app.state.ingest is not None:  # no request left (uvicorn waited for them): nothing queued
                await run_in_threadpool(app.state.ingest.stop)
            app.state.detection = app.state.alerts = app.state.rollups = None  # ingest hands nothing on now
            for worker in reversed(started):
                await run_in_threadpool(worker.stop)
            engine.dispose()

    app = CollectorApp(
        title="stepwatch collector",
        version=VERSION,
        summary="Ingest, storage and read API for training-run health.",
        lifespan=lifespan,
        docs_url=None,  # /docs is web/pages.py's: Swagger UI from the package, not from a CDN
        redoc_url=None,  # (FastAPI's ReDoc page also loads from a CDN)
        responses=COMMON_ERRORS,
        dependencies=[Depends(no_nul_in_parameters)],
        # FastAPI's OpenTelemetry instrumentation checks for a configured provider on every request (~20 us,
        # os.environ included); the collector has its own /metrics and configures no provider.
        telemetry={"tracing": False, "metrics": False, "logs": False},
        openapi_tags=[
            {"name": "ingest", "description": "Batches from agents (docs/ingest.md)."},
            {"name": "runs", "description": "Reading runs, ranks and series back."},
            {
                "name": "detection",
                "description": "Anomalies, run health, the detection worker (docs/detection.md).",
            },
            {"name": "alerts", "description": "Alert deliveries to Slack and webhooks (docs/alerts.md)."},
            {"name": "health", "description": "Liveness and database reachability."},
            {
                "name": "dashboard",
                "description": "What the built-in web dashboard reads (also live, as events).",
            },
        ],
    )
    app.state.settings = settings
    app.state.detection = None
    app.state.alerts = None
    app.state.rollups = None
    app.state.expiry = None
    app.state.compaction = None
    app.state.live = None
    app.state.metric_collectors = []  # more Prometheus collectors for /metrics (the bus's, with --bus)
    app.state.ingest = None
    app.state.commands = None
    app.state.stopping = threading.Event()  # set by serving.py as shutdown begins: endless responses end
    app.state.policy = auth.Policy.from_settings(settings)
    install_error_handlers(app)

    # Who may do what (auth/access.py): ingest checks its write token itself, before reading the body
    # and again on the parsed batch's run; every read router reads through `read_access`, and what
    # spans every run through `read_every_run`. Public: /healthz, the page and its assets, /docs.
    def reads(router: APIRouter, *, every_run: bool = False) -> None:
        check = auth.read_every_run if every_run else auth.read_access
        app.include_router(router, dependencies=[Depends(check)], responses=auth.READ_RESPONSES)

    app.include_router(ingest_router)
    app.include_router(commands_write_router)  # before runs: `/runs/{run:path}` would take `.../commands`
    app.include_router(runs_write_router)  # DELETE /api/v1/runs/{run}: checks its write token itself
    app.include_router(auth.router)  # the dashboard's login: a cookie for reads
    reads(detect_router)  # before runs: `/runs/{run:path}` would take `/runs/x/anomalies`
    reads(dashboard_router)  # before runs, for the same reason
    reads(commands_router)  # before runs, for the same reason
    reads(live.router)
    app.include_router(pages.router)
    pages.mount_static(app)
    reads(runs_router)
    reads(metrics_router, every_run=True)  # GET /metrics (Prometheus)
    reads(alerts_router, every_run=True)

    @app.get(
        "/healthz",
        tags=["health"],
        summary="The collector is up, its database answers and took the last write",
        responses={200: {"model": HealthzAnswer}},
    )
    def healthz(request: Request) -> Response:
        try:
            with request.app.state.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:
            raise ServiceUnavailable(f"database unreachable: {type(exc).__name__}", field=None) from exc
        problem = request.app.state.writer.health.problem()
        if problem is not None:  # reads work on a full disk; the last write told us
            raise ServiceUnavailable(problem, field=None)
        return json_response({"status": "ok", "database": request.app.state.engine.dialect.name})

    return app
