"""The one life cycle of the collector's background workers (detection, rollups, alerts, ingest's writing
threads): daemon threads started once, stopped by a deadline, and an error guard for each step of a loop.

A worker subclasses `BackgroundWorker`, names itself (`label`: its thread is `stepwatch-<label>`, its logs
start with it) and writes `_run`, which loops until `_stop` is set and may wait on `_wake` (set by `stop()`
too, so that a sleeping loop notices at once); `threads` runs `_run` on that many threads (the others are
`stepwatch-<label>-2`, ...). `stop(deadline_s)` records the deadline for `_run` to honour (a last round of
work within it), sets both events, waits for the threads for the deadline plus `join_slack_s`, then calls
`_stopped()` for what the worker has to say about work left undone. `_guard` runs one step: an exception
is counted in `errors`, logged in full the first time only, and the loop goes on (after `error_pause_s`,
waited on `_stop`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

STOP_DEADLINE_S = 5.0
Self = TypeVar("Self", bound="BackgroundWorker")


class BackgroundWorker:
    label = "worker"
    threads = 1  # threads running `_run` (the first is `stepwatch-<label>`, the others `-2`, `-3`, ...)
    join_slack_s = 2.0  # beyond the deadline: the wait in progress, the last write
    error_pause_s = 0.0  # after a step failed, the loop waits this long (on `_stop`) before going on

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None  # the first of `_threads`
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._deadline_s = STOP_DEADLINE_S
        self.errors = 0
        self._warned_error = False

    def start(self: Self) -> Self:
        self._threads = [
            threading.Thread(
                target=self._run, name=f"stepwatch-{self.label}" + (f"-{i + 1}" if i else ""), daemon=True
            )
            for i in range(self.threads)
        ]
        self._thread = self._threads[0]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> None:
        """Finish within `deadline_s` (what `_run` still does then), stop the thread, say what is left."""
        self._deadline_s = deadline_s
        self._stop.set()
        self._wake.set()
        end = time.monotonic() + deadline_s + self.join_slack_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        self._stopped()

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def _run(self) -> None:  # pragma: no cover - every worker has its own
        raise NotImplementedError

    def _stopped(self) -> None:
        """After the thread ended or the wait for it ran out: log what was left undone."""

    def _guard(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, or None after an exception: counted, logged in full the first time only, and the
        loop paused for `error_pause_s`."""
        try:
            return fn(*args)
        except Exception:
            with self._lock:
                self.errors += 1
                first, self._warned_error = not self._warned_error, True
            if first:
                logging.getLogger(type(self).__module__).exception(
                    "%s: %s failed (further failures are counted, not logged)", self.label, what
                )
            if self.error_pause_s:
                self._stop.wait(self.error_pause_s)
            return None
