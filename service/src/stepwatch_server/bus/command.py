"""`stepwatch-server detect`: one detection worker of the bus, until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from sqlalchemy import Connection

from stepwatch_server.bus import streams
from stepwatch_server.bus.worker import StreamDetection
from stepwatch_server.detect.engine import EngineSettings
from stepwatch_server.detect.store import Stored, StoredHook
from stepwatch_server.settings import DEFAULT_DATABASE_URL, Settings

log = logging.getLogger(__name__)

STATS_EVERY_S = 60.0  # the worker's counters in the log this often
STOP_DEADLINE_S = 10.0


def run_detect(args: argparse.Namespace) -> int:
    url = args.bus or os.environ.get("STEPWATCH_BUS", "").strip()
    if not url:
        print(
            "stepwatch-server detect: --bus (or STEPWATCH_BUS) is required: the Redis the collectors use",
            file=sys.stderr,
        )
        return 2
    database_url = args.database_url or os.environ.get("STEPWATCH_DATABASE_URL") or DEFAULT_DATABASE_URL
    try:
        client = streams.connect(url)
        extra: dict[str, object] = {}
        if args.alerts:
            from stepwatch_server.alerts.config import load_config

            extra["alerts"] = load_config(args.alerts)
        settings = Settings(database_url=database_url, **extra)  # type: ignore[arg-type]
    except ValueError as exc:
        print(f"stepwatch-server detect: {exc}", file=sys.stderr)
        return 2
    from stepwatch_server.storage import make_engine

    db = make_engine(database_url)
    on_stored: StoredHook | None = None
    alerts = settings.alerts
    if alerts is not None:  # the alert outbox is written with the anomalies; `serve --alerts` delivers it
        from stepwatch_server.alerts.events import record_events

        def on_stored(conn: Connection, stored: list[Stored]) -> None:
            assert alerts is not None
            record_events(alerts, conn, stored)

    worker = StreamDetection(
        db, client, EngineSettings(overrides=settings.detection_overrides), on_stored=on_stored
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    log.info(
        "detect: worker %s on %s, database %s",
        worker.id,
        url.split("@")[-1],
        db.url.render_as_string(hide_password=True),
    )
    if args.metrics_port is not None:
        from prometheus_client import CollectorRegistry, start_http_server

        from stepwatch_server.bus.metrics import WorkerMetrics

        registry = CollectorRegistry(auto_describe=False)
        registry.register(WorkerMetrics(worker.stats))
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=registry)
        log.info("detect: metrics on http://%s:%d/metrics", args.metrics_host, args.metrics_port)
    worker.start()
    while not done.wait(STATS_EVERY_S):
        log.info("detect: %s", worker.stats())
    log.info("detect: stopping (at most %.0f s)", STOP_DEADLINE_S)
    worker.stop(STOP_DEADLINE_S)
    db.dispose()
    return 0
