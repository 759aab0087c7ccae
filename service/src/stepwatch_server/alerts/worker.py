"""The alert delivery worker: one background thread that groups, claims and sends.

Each round it composes the groups whose window has passed (grouping.py), claims as many due
deliveries as it has free senders (outbox.py; the rate limits decide per channel), hands each to a
small pool of sender threads (the POST blocks; nothing here runs on the event loop), and records
every finished attempt. It wakes every `POLL_INTERVAL_S`, or at once when the detection store has
written new alert events (`on_stored`, the hook given to the detection worker).

At stop it waits for the sends in flight for at most the deadline and records them; a send cut off
there (or by a crash) is retried after its lease, with the same idempotency key.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime as dt
import logging
from typing import Any

from sqlalchemy import Connection, Engine

from stepwatch_server.alerts import stats
from stepwatch_server.alerts.config import AlertsConfig
from stepwatch_server.alerts.events import record_events
from stepwatch_server.alerts.grouping import compose
from stepwatch_server.alerts.outbox import Claimed, claim, finish
from stepwatch_server.alerts.ratelimit import RateLimiter
from stepwatch_server.alerts.transport import Result, post
from stepwatch_server.background import BackgroundWorker
from stepwatch_server.detect.store import Stored

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
MAX_PARALLEL_SENDS = 8


class AlertWorker(BackgroundWorker):
    label = "alerts"
    error_pause_s = 1.0  # the outbox keeps what was not done; the round is tried again after this

    def __init__(self, engine: Engine, config: AlertsConfig) -> None:
        super().__init__()
        self.db = engine
        self.config = config
        self.limiter = RateLimiter({name: ch.max_per_minute for name, ch in config.channels.items()})
        self._pool = cf.ThreadPoolExecutor(MAX_PARALLEL_SENDS, thread_name_prefix="stepwatch-alert-send")
        self._in_flight: dict[cf.Future[Result], Claimed] = {}

    # -- the detection side: runs in the anomalies' transaction ------------------------------------
    def on_stored(self, conn: Connection, stored: list[Stored]) -> None:
        if record_events(self.config, conn, stored):
            self._wake.set()  # possibly before the commit: the next round finds them either way

    # -- life cycle -----------------------------------------------------------------------------
    def start(self) -> AlertWorker:
        log.info(
            "alerts: %d channels (%s), %d routes, from %s",
            len(self.config.channels),
            ", ".join(f"{c.name}: {c.type}" for c in self.config.channels.values()),
            len(self.config.routes),
            self.config.source,
        )
        return super().start()

    def _stopped(self) -> None:
        """Claiming stopped and the sends in flight were waited for (the deadline) and recorded."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._in_flight:
            log.warning(
                "alerts: %d sends in flight at stop; they are retried after the restart", len(self._in_flight)
            )

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._guard("compose", compose, self.db, self.config)
            free = MAX_PARALLEL_SENDS - len(self._in_flight)
            claimed = (
                self._guard(
                    "claim", claim, self.db, self.config, self.limiter, _now(), free, self._busy_channels()
                )
                if free
                else None
            )
            for c in claimed or []:
                future = self._pool.submit(
                    post, self.config.channels[c.channel], c.payload, c.idempotency_key, self.config.timeout_s
                )
                self._in_flight[future] = c
            self._collect(POLL_INTERVAL_S)
            if not claimed and not self._in_flight:
                self._wake.wait(POLL_INTERVAL_S)
                self._wake.clear()
        self._collect(self._deadline_s, every=True)

    def _busy_channels(self) -> set[str]:
        return {c.channel for c in self._in_flight.values()}

    def _collect(self, wait_s: float, every: bool = False) -> None:
        """Record the sends that finish within `wait_s`: the first ones, or `every` one (at stop)."""
        if not self._in_flight:
            return
        until = cf.ALL_COMPLETED if every else cf.FIRST_COMPLETED
        done, _ = cf.wait(list(self._in_flight), timeout=wait_s, return_when=until)
        results = [(self._in_flight.pop(f), _result(f)) for f in done]
        for c, r in results:
            if not r.ok:
                self.limiter.refund(c.channel, c.claimed_at)  # it never reached the channel
        if results:
            self._guard("record", finish, self.db, self.config, results, _now())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "enabled": True,
                "in_flight": len(self._in_flight),
                "errors": self.errors,
                **stats.snapshot(),
            }


def _result(future: cf.Future[Result]) -> Result:
    try:
        return future.result()
    except Exception as exc:  # post() does not raise for network trouble; anything else is a bug
        return Result(ok=False, error=f"internal error: {type(exc).__name__}: {exc}", retryable=True)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
