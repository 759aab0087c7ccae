"""Process-wide alert counters, for GET /api/v1/alerts and for /metrics.

`record_delivery(outcome, channel_type)` is the one call site: it adds to this process's counts and to
`stepwatch_alert_deliveries_total{channel_type,outcome}`. The outcomes are those of
`stepwatch_server.metrics.collector.ALERT_OUTCOMES`.
"""

from __future__ import annotations

import threading

from stepwatch_server.metrics.collector import ALERT_OUTCOMES, alert_delivery

OUTCOMES = ALERT_OUTCOMES

_lock = threading.Lock()
_counts = dict.fromkeys(OUTCOMES, 0)


def record_delivery(outcome: str, channel_type: str, n: int = 1) -> None:
    with _lock:
        _counts[outcome] = _counts.get(outcome, 0) + n
    alert_delivery(channel_type, outcome, n)


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(_counts)
