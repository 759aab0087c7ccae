"""`GET /metrics`: the Prometheus text exposition format.

One registry per application, built on the first scrape: the collector's own metrics
(metrics/collector.py; summed over the worker processes in prometheus_client's multiprocess mode
when PROMETHEUS_MULTIPROC_DIR is set) and the run-health gauges computed from the database
(metrics/run_health.py). The handler is synchronous, so FastAPI runs it in the thread pool: the
database queries never block the event loop.
"""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.responses import Response

from stepwatch_server.metrics.collector import REGISTRY as SELF_REGISTRY
from stepwatch_server.metrics.run_health import RunHealthCollector

router = APIRouter(tags=["health"])


def multiprocess_dir() -> str | None:
    """The multiprocess directory, when prometheus_client's multiprocess mode is on."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def build_registry(request: Request) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    directory = multiprocess_dir()
    if directory is not None:
        MultiProcessCollector(registry, path=directory)
    else:
        registry.register(SELF_REGISTRY)
    registry.register(RunHealthCollector(request.app.state.engine))
    for extra in getattr(request.app.state, "metric_collectors", ()):  # e.g. the bus's (app.py)
        registry.register(extra)
    return registry


@router.get(
    "/metrics",
    summary="Prometheus metrics: the collector's own and each recent run's health",
    response_class=Response,
    responses={
        200: {
            "description": "The Prometheus text exposition format (version 0.0.4).",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
def metrics(request: Request) -> Response:
    registry = getattr(request.app.state, "metrics_registry", None)
    if registry is None:
        registry = request.app.state.metrics_registry = build_registry(request)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
