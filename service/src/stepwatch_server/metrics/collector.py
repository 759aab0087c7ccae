"""The collector's own metrics: ingest, the detection worker, the rollup worker, alert deliveries.

One line at each place that does the work calls a function of this module (ingest/routes.py,
detect/worker.py, runs/rollup_worker.py, the alert sender); each is a lock and an add
(prometheus_client), never I/O.

Multi-worker safe: when `PROMETHEUS_MULTIPROC_DIR` names a writable, empty directory in the
environment of every worker process *before it starts*, prometheus_client keeps these values in
memory-mapped files there and `/metrics` sums them over the workers (gauges: over live workers);
see README, "Prometheus and Grafana". Without it, the values live in this process.

Every labelled metric has its label values created up front, so that each series exists (at 0)
from the first scrape: a rate over it returns data, and an alert rule on it never lacks a series.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable
from typing import ParamSpec, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from stepwatch_server.errors import ApiError

P = ParamSpec("P")
R = TypeVar("R")

NAMESPACE = "stepwatch"
disable_created_metrics()  # no `_created` twin of every counter: half the series, nothing lost here
REGISTRY = CollectorRegistry(auto_describe=True)

# The error codes ingest answers with (docs/ingest.md), plus `bad_request` (a Content-Length that is
# not an integer) and `internal_error` (an exception that is not an API error).
REJECT_REASONS = (
    "invalid_json",
    "invalid_encoding",
    "invalid_gzip",
    "bad_request",
    "unauthorized",
    "too_large",
    "too_many_values",
    "unsupported_media_type",
    "invalid_field",
    "unsupported_schema",
    "session_conflict",
    "too_many_series",
    "detection_behind",
    "internal_error",
)
ALERT_CHANNEL_TYPES = ("slack", "webhook")
# What became of an alert message (alerts/stats.py counts the same): `delivered` (2xx), `retried` (a
# failed attempt that will be tried again), `failed` (given up), `suppressed` (cooldown),
# `rate_limited` (held back by the channel's rate limit for now).
ALERT_OUTCOMES = ("delivered", "retried", "failed", "suppressed", "rate_limited")
_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LAG_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

INGEST_BATCHES = Counter(
    "ingest_batches",
    "Batches accepted by POST /api/v1/ingest; result=stored (new) or duplicate (sent again, nothing stored).",
    ["result"],
    namespace=NAMESPACE,
    registry=REGISTRY,
)
INGEST_VALUES = Counter(
    "ingest_values",
    "Values stored by ingest (scalars, tensor statistics, fingerprints, events).",
    namespace=NAMESPACE,
    registry=REGISTRY,
)
INGEST_BYTES = Counter(
    "ingest_received_bytes",
    "Bytes of accepted batches as received on the wire (before decompression).",
    namespace=NAMESPACE,
    registry=REGISTRY,
)
INGEST_DURATION = Histogram(
    "ingest_duration_seconds",
    "Time from receiving an accepted batch to its answer (read, parse, validate, commit).",
    namespace=NAMESPACE,
    registry=REGISTRY,
    buckets=_LATENCY_BUCKETS_S,
)
INGEST_REJECTED = Counter(
    "ingest_rejected_batches",
    "Batches refused by ingest, by reason (the error code of the answer).",
    ["reason"],
    namespace=NAMESPACE,
    registry=REGISTRY,
)
DETECTION_QUEUE_DEPTH = Gauge(
    "detection_queue_depth_batches",
    "Stored batches waiting for the detection worker.",
    namespace=NAMESPACE,
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
DETECTION_BATCHES = Counter(
    "detection_batches",
    "Batches handed to detection; outcome=processed, or dropped (queue full or stopping: stored, not detected).",
    ["outcome"],
    namespace=NAMESPACE,
    registry=REGISTRY,
)
DETECTION_LAG = Histogram(
    "detection_lag_seconds",
    "Detector lag: from a batch's ingest answer to the anomalies of its round being stored.",
    namespace=NAMESPACE,
    registry=REGISTRY,
    buckets=_LAG_BUCKETS_S,
)
ROLLUP_FAILURES = Counter(
    "rollup_failures",
    "Roll-up transactions of the rollup worker that failed (retried with backoff, then skipped).",
    namespace=NAMESPACE,
    registry=REGISTRY,
)
ROLLUP_SKIPPED = Counter(
    "rollup_skipped_ranges",
    "Step ranges the rollup worker gave up on after failing MAX_ROUND_FAILURES times (raw points kept; "
    "the views read from rollups leave their steps out).",
    namespace=NAMESPACE,
    registry=REGISTRY,
)
ALERT_DELIVERIES = Counter(
    "alert_deliveries",
    "Alert messages by channel type and outcome (delivered, retried, failed, suppressed, rate_limited).",
    ["channel_type", "outcome"],
    namespace=NAMESPACE,
    registry=REGISTRY,
)

for _result in ("stored", "duplicate"):
    INGEST_BATCHES.labels(_result)
for _reason in REJECT_REASONS:
    INGEST_REJECTED.labels(_reason)
for _outcome in ("processed", "dropped"):
    DETECTION_BATCHES.labels(_outcome)
for _channel in ALERT_CHANNEL_TYPES:
    for _outcome in ALERT_OUTCOMES:
        ALERT_DELIVERIES.labels(_channel, _outcome)


def ingest_accepted(received_bytes: int, values: int, duplicate: bool, duration_s: float) -> None:
    """One accepted batch (ingest/routes.py)."""
    INGEST_BATCHES.labels("duplicate" if duplicate else "stored").inc()
    INGEST_VALUES.inc(values)
    INGEST_BYTES.inc(received_bytes)
    INGEST_DURATION.observe(duration_s)


def ingest_rejected(reason: str) -> None:
    """One refused batch; `reason` is the answer's error code (unknown codes count as themselves)."""
    INGEST_REJECTED.labels(reason).inc()


def detection_round(lags_s: Iterable[float], queue_depth: int) -> None:
    """The detection worker finished a round: the lag of each batch in it, what is still queued."""
    n = 0
    for lag in lags_s:
        DETECTION_LAG.observe(lag)
        n += 1
    DETECTION_BATCHES.labels("processed").inc(n)
    DETECTION_QUEUE_DEPTH.set(queue_depth)


def detection_dropped() -> None:
    """A stored batch skipped detection (the worker's queue was full, or it was stopping)."""
    DETECTION_BATCHES.labels("dropped").inc()


def rollup_failed() -> None:
    """A roll-up transaction failed (runs/rollup_worker.py)."""
    ROLLUP_FAILURES.inc()


def rollup_skipped() -> None:
    """The rollup worker gave up on a step range (runs/rollup_worker.py)."""
    ROLLUP_SKIPPED.inc()


def alert_delivery(channel_type: str, outcome: str, n: int = 1) -> None:
    """Alert messages of `channel_type` (ALERT_CHANNEL_TYPES) that met `outcome` (ALERT_OUTCOMES);
    called through `stepwatch_server.alerts.stats.record_delivery`."""
    ALERT_DELIVERIES.labels(channel_type, outcome).inc(n)


def counts_rejections(handler: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Decorates the ingest route: an error it raises is counted by its code, then re-raised."""

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await handler(*args, **kwargs)
        except ApiError as exc:
            ingest_rejected(exc.code)
            raise
        except Exception:
            ingest_rejected("internal_error")
            raise

    return wrapper
