"""Process-wide alert counters: one lock and an add per outcome (for GET /api/v1/alerts and /metrics).

Outcomes: `delivered`, `retried` (a failed attempt that will be tried again), `failed` (given up: a
permanent error or the deadline), `suppressed` (cooldown), `rate_limited` (held back by a channel's
rate limit). `record_delivery(outcome)` is the one call site an exporter needs.
"""

from __future__ import annotations

import threading

OUTCOMES = ("delivered", "retried", "failed", "suppressed", "rate_limited")

_lock = threading.Lock()
_counts = dict.fromkeys(OUTCOMES, 0)


def record_delivery(outcome: str, n: int = 1) -> None:
    with _lock:
        _counts[outcome] = _counts.get(outcome, 0) + n


def snapshot() -> dict[str, int]:
    with _lock:
        return dict(_counts)
