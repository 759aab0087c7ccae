"""The rollup worker: keeps the rollup tables (runs/rollups.py) off the ingest path, on one thread.

Ingest hands it `(run_id, first step, last step)` of every stored batch right after the commit
(the ingest route's `_after_commit`); `submit` only widens that run's dirty range under a lock and
returns, so ingest never waits and never touches a shared rollup row. Every `ROUND_INTERVAL_S` the
thread takes the dirty ranges that are due (no new batch for `QUIET_S`, or dirty for `MAX_LAG_S`:
while every rank keeps sending the same steps, re-reading them each round would cost more than
ingest itself) and recomputes each from the raw points
(`rollups.roll_up`: a DELETE and an INSERT ... SELECT ... GROUP BY per table, level and run, then the run's
watermark), one short write transaction per run. A range of more than about `MAX_VALUES_PER_ROUND`
values (series x ranks x steps) is done in slices of whole 64-step buckets, one transaction each
(the rest stays dirty, due at once), so a backlog never holds the write lock long.
Reads take the raw points above the watermark, so a view is complete while the worker lags.

A run whose rollups fail to write stays dirty and is retried the next round (logged once, counted).
At stop the thread rolls up what is dirty for at most `STOP_DEADLINE_S`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

from sqlalchemy import Engine

from stepwatch_server.runs.rollups import roll_up
from stepwatch_server.storage.engine import write_transaction

log = logging.getLogger(__name__)

ROUND_INTERVAL_S = 0.5
QUIET_S = 0.5  # a run's range is rolled up once no batch widened it for this long ...
MAX_LAG_S = 3.0  # ... or once it has been dirty this long
MAX_VALUES_PER_ROUND = 2_000_000  # per run and transaction: about the most values one roll-up reads
STOP_DEADLINE_S = 5.0
BACKLOG_PAUSE_S = 0.02  # between the slices of a long range, so ingest's writes get the lock


@dataclass(slots=True)
class _Dirty:
    first: int
    last: int
    since: float  # monotonic time it became dirty (-inf: due at once)
    touched: float  # monotonic time of the last hand-over


class RollupWorker:
    """Dirty step ranges per run in, rollups recomputed on one thread. `submit` never blocks."""

    def __init__(self, engine: Engine, max_values_per_round: int = MAX_VALUES_PER_ROUND) -> None:
        self.db = engine
        self.max_values_per_round = max_values_per_round
        self._dirty: dict[int, _Dirty] = {}  # run id -> its steps not rolled up yet
        self._force = False  # the next round takes every dirty range (wait_idle, stop)
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a round is due now (stop, flush)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rounds_done = 0
        self._busy = False
        self._deadline_s = STOP_DEADLINE_S
        self.rolled_ranges = 0
        self.errors = 0
        self._warned = False

    # -- life cycle -----------------------------------------------------------------------------
    def start(self) -> RollupWorker:
        self._thread = threading.Thread(target=self._run, name="stepwatch-rollups", daemon=True)
        self._thread.start()
        return self

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> None:
        """Roll up what is dirty for at most `deadline_s`, then stop the thread."""
        self._deadline_s = deadline_s
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(deadline_s + ROUND_INTERVAL_S + 1.0)
            if self._thread.is_alive() or self._dirty:
                log.warning(
                    "rollups: stopped with %d runs not rolled up (reads use their raw points)",
                    len(self._dirty),
                )

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the ingest side ------------------------------------------------------------------------
    def submit(self, run_id: int, first_step: int, last_step: int) -> None:
        """Mark steps first..last of run `run_id` as changed (stored and committed)."""
        self._widen(run_id, first_step, last_step, time.monotonic())

    def _widen(self, run_id: int, first_step: int, last_step: int, since: float) -> None:
        now = time.monotonic()
        with self._lock:
            known = self._dirty.get(run_id)
            if known is None:
                self._dirty[run_id] = _Dirty(first_step, last_step, since, now)
            else:
                known.first, known.last = min(known.first, first_step), max(known.last, last_step)
                known.since, known.touched = min(known.since, since), now

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until everything submitted so far is rolled up; True if it is."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._dirty and not self._busy:
                    return True
                self._force = True
            self._wake.set()
            time.sleep(0.01)
        with self._lock:
            return not self._dirty and not self._busy

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        stop_at: float | None = None
        while True:
            if self._stop.is_set() and stop_at is None:
                stop_at = time.monotonic() + self._deadline_s
            if stop_at is not None and (not self._dirty or time.monotonic() > stop_at):
                break
            if stop_at is None:
                self._wake.wait(ROUND_INTERVAL_S)
                self._wake.clear()
            self._round()

    def _round(self) -> None:
        now = time.monotonic()
        with self._lock:
            force, self._force = self._force or self._stop.is_set(), False
            due = [
                run_id
                for run_id, d in self._dirty.items()
                if force or now - d.touched >= QUIET_S or now - d.since >= MAX_LAG_S
            ]
            todo = {run_id: (self._dirty[run_id].first, self._dirty[run_id].last) for run_id in due}
            for run_id in due:
                del self._dirty[run_id]
            self._busy = bool(todo)
        failed = backlog = False
        for run_id, (first, last) in sorted(todo.items()):
            try:
                with write_transaction(self.db) as conn:
                    upto = roll_up(conn, run_id, first, last, self.max_values_per_round)
            except Exception:
                self._failed(run_id)
                upto, failed = first - 1, True  # the whole range stays dirty
            else:
                self.rolled_ranges += 1
            if upto < last:
                self._widen(run_id, upto + 1, last, -math.inf)  # due again at once
                backlog = True
        with self._lock:
            self._busy = False
        if failed:
            time.sleep(ROUND_INTERVAL_S)  # the database failed: do not spin on it
        elif backlog:
            self._wake.set()  # the rest of a long range: the next round at once (after a breath)
            time.sleep(BACKLOG_PAUSE_S)

    def _failed(self, run_id: int) -> None:
        self.errors += 1
        if not self._warned:
            self._warned = True
            log.exception(
                "rollups: run %d failed to roll up; retried next round (further failures counted)", run_id
            )

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "dirty_runs": len(self._dirty),
                "rolled_ranges": self.rolled_ranges,
                "errors": self.errors,
            }
