"""Whether the database took the collector's last write of a batch.

`SELECT 1` answers while a disk is full or a database read-only, so /healthz cannot learn it by reading:
the batch writer tells this object how each write ended, and /healthz reports the last failure until a
write succeeds again (the agents retry a 503 within seconds, so a recovered database is seen as soon as
a batch arrives).
"""

from __future__ import annotations

import threading
import time


class WriteHealth:
    """The outcome of the last write. Thread-safe; one per batch writer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failure: tuple[float, str] | None = None  # (unix time, reason) of the last write, if it failed

    def stored(self) -> None:
        if self._failure is not None:
            with self._lock:
                self._failure = None

    def failed(self, exc: BaseException) -> None:
        reason = str(getattr(exc, "orig", None) or exc).splitlines()[0][:200]
        with self._lock:
            self._failure = (time.time(), reason)

    def problem(self) -> str | None:
        """What is wrong, in words, while the last write failed; else None."""
        with self._lock:
            failure = self._failure
        if failure is None:
            return None
        at, reason = failure
        return f"the database is not writable: the last batch, {time.time() - at:.0f} s ago, failed: {reason}"
