"""Counters and the guard that keeps every internal error away from the training loop."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("stepwatch")

COUNTER_NAMES = (
    "sent_batches",  # data batches the collector acknowledged (direct or replayed)
    "sent_steps",  # step records in those batches
    "heartbeats",  # heartbeat-only batches acknowledged
    "heartbeat_failures",  # heartbeat-only batches that could not be sent (never spooled)
    "spooled_batches",  # batches written to the local spool
    "replayed_batches",  # spooled batches later acknowledged
    "retries",  # HTTP attempts repeated after 429/502/503/504, a timeout or a connection error
    "failovers",  # switches to the next collector URL (url lists several) after such a failure
    "send_failures",  # batches given up on by the deadline (then spooled)
    "rejected_batches",  # batches the collector refused with a 4xx (never retried; quarantined)
    "quarantined_batches",  # batches set aside on disk so that the ones behind them go on (_spool.py)
    "dropped_buffer_full",  # step records dropped because the host buffer was full
    "dropped_spool_full",  # spooled batches deleted (oldest first) to keep the spool bounded
    "dropped_unsent",  # batches lost: could be neither sent nor spooled
    "rejected_log_values",  # watch.log() values ignored: bad name, not a number, several elements
    "internal_errors",  # errors inside stepwatch; the feature concerned was switched off
)


class Counters:
    """Monotonic counters, shipped in every batch (`agent.counters`) and returned by `watch.stats()`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTER_NAMES, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class Guard:
    """Switches a feature off at its first internal error, logs it once and counts it.

    Hooks test `feature in guard.off` (a set that stays empty while all is well, so that the hot path
    reads it without a call; `guard.on(feature)` elsewhere) and wrap their body in try/except calling
    `guard.fail(feature, exc)`. Features: "steps" (everything per step), "loss", "grads", "amax",
    "timing", "fingerprint", "log", "memory", "sender", "spool", "stack" (the heartbeat's stack).
    """

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self.off: set[str] = set()
        self._logged: set[str] = set()

    def on(self, feature: str) -> bool:
        return feature not in self.off

    def fail(self, feature: str, exc: BaseException, disable: bool = True) -> None:
        try:
            self.counters.add("internal_errors")
            if disable:
                self.off.add(feature)
            if feature not in self._logged:
                self._logged.add(feature)
                logger.error(
                    "stepwatch: internal error in %s; %s (training continues)",
                    feature,
                    "this feature is now off" if disable else "the job was skipped",
                    exc_info=(type(exc), exc, exc.__traceback__),
                    extra={"stepwatch_internal": True},
                )
        except Exception:  # logging itself failed (interpreter shutdown): stay silent
            pass

    def disable_all(self) -> None:
        self.off.add("steps")
