"""Prometheus metrics of the bus, read from the counters at scrape time: a replica's publisher (on the
collector's `/metrics`) and a detection worker's (on `detect --metrics-port`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

NAMESPACE = "stepwatch"


class PublisherMetrics(Collector):
    """`serve --bus`: what this replica added to the bus, what waits in it for Redis, the streams' backlog."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield CounterMetricFamily(
            f"{NAMESPACE}_bus_published_batches",
            "Stored batches this replica added to the bus.",
            s["published"],
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_bus_connected",
            "1 while Redis answers this replica, else 0.",
            float(s["bus_connected"]),
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_bus_waiting_batches",
            "Stored batches this replica keeps until Redis answers (429 at the capacity).",
            s["waiting"],
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_bus_stream_backlog_entries",
            "Entries of all streams not yet taken by a detection worker (429 over the capacity).",
            s["stream_backlog"],
        )


class WorkerMetrics(Collector):
    """`detect`: the streams it owns, the batches it processed and replayed, its lag and take-overs."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            f"{NAMESPACE}_detect_streams_owned", "Bus streams this worker owns.", len(s["streams"])
        )
        yield GaugeMetricFamily(
            f"{NAMESPACE}_detect_runs", "Runs whose detector state this worker holds.", s["runs"]
        )
        batches = CounterMetricFamily(
            f"{NAMESPACE}_detect_batches",
            "Batches fed to the detectors: processed (anomalies stored, then acknowledged) or replayed after a "
            "take-over (state only).",
            labels=["outcome"],
        )
        batches.add_metric(["processed"], s["processed"])
        batches.add_metric(["replayed"], s["replayed"])
        yield batches
        yield CounterMetricFamily(
            f"{NAMESPACE}_detect_takeovers",
            "Streams this worker took (from a snapshot or afresh).",
            s["taken_over"],
        )
        yield CounterMetricFamily(
            f"{NAMESPACE}_detect_anomalies_saved", "Anomaly rows written.", s["anomalies_saved"]
        )
        yield CounterMetricFamily(
            f"{NAMESPACE}_detect_snapshots", "Snapshots of a stream's state stored.", s["snapshots"]
        )
        yield CounterMetricFamily(
            f"{NAMESPACE}_detect_errors", "Steps of the worker's loop that failed.", s["errors"]
        )
        lag = GaugeMetricFamily(
            f"{NAMESPACE}_detect_lag_seconds",
            "From the ingest answer to the anomalies stored, over the last 10,000 batches.",
            labels=["quantile"],
        )
        for q in ("p50", "p99"):
            value = s["lag_ms"][q]
            lag.add_metric([q[1:]], float("nan") if value is None else value / 1000.0)
        yield lag
