"""Prometheus: the collector's own metrics, run health computed at scrape time, and `GET /metrics`.

The one-line calls that the rest of the collector makes are re-exported here.
"""

from stepwatch_server.metrics.collector import (
    alert_delivery,
    counts_rejections,
    detection_dropped,
    detection_round,
    ingest_accepted,
    ingest_rejected,
    rollup_failed,
    rollup_skipped,
)
from stepwatch_server.metrics.routes import router

__all__ = [
    "alert_delivery",
    "counts_rejections",
    "detection_dropped",
    "detection_round",
    "ingest_accepted",
    "ingest_rejected",
    "rollup_failed",
    "rollup_skipped",
    "router",
]
