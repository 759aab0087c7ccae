"""The rollup worker: keeps the rollup tables (runs/rollups.py) off the ingest path, on one thread.

Ingest hands it `(run_id, first step, last step)` of every stored batch right after the commit
(the ingest route's `_after_commit`); `submit` only widens that run's dirty range under a lock and
returns, so ingest never waits and never touches a shared rollup row. Every `ROUND_INTERVAL_S` the
thread takes the dirty ranges that are due (no new batch for `QUIET_S`, or dirty for `MAX_LAG_S`:
while every rank keeps sending the same steps, re-reading them each round would cost more than
ingest itself) and recomputes each from the raw points (each step once while its bucket fills:
runs/rollups.py, "What a round reads")
(`rollups.plan`, then per group of its series `rollups.apply_part`: a DELETE and an INSERT ... SELECT ...
GROUP BY per table and level; then the run's watermark). A range of more than about `MAX_VALUES_PER_ROUND`
values (series x ranks x steps) is done in slices of whole 64-step buckets (the rest stays dirty, due at
once), and a slice's series in groups of about `MAX_VALUES_PER_TRANSACTION` values, one short write
transaction each, the watermark raised after the last: neither a backlog nor a wide run (20,000 names)
holds the write lock long, and each series' rollups are old or new, never half.
Reads take the raw points above the watermark, so a view is complete while the worker lags.

A roll-up that fails (a database error, a value that breaks a statement, a bug of ours) is not
retried every round: the run waits `RETRY_FIRST_S`, doubled per failure up to `RETRY_MAX_S`, and is
then rolled up one bucket (64 steps) per transaction up to the end of the range that failed, so
that what fails is narrowed to its buckets and the rest is rolled up. A bucket that fails
`MAX_ROUND_FAILURES` times in a row is given up (`rollups.skip`): reported once in the log with its
error and extent and counted (`stepwatch_rollup_skipped_ranges_total`); its rollup rows are deleted,
the watermark passes it and the run's later steps are rolled up. The views read from rollups (the
mean curve, the amax, a long run's heatmap, `rank=all` over a wide range) leave the skipped steps
out (a gap where a point or column holds nothing else); their raw points are kept, and a later
batch for those steps has them rolled up again.
A lost connection, or a lock held by another writer for longer than the worker waits for it (SQLite's
busy timeout, PostgreSQL's lock_timeout where one is set: `storage.engine.database_busy`), counts toward
the backoff only, and a range is skipped only when the skip itself commits: a database that cannot be
written is waited out, not skipped past.
At stop the thread rolls up what is dirty for at most `STOP_DEADLINE_S` (not the runs backing off).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from sqlalchemy import Engine, select
from sqlalchemy.exc import DBAPIError

from stepwatch_server.background import BackgroundWorker
from stepwatch_server.metrics import rollup_failed, rollup_skipped
from stepwatch_server.runs import rollups
from stepwatch_server.storage.engine import database_busy, write_transaction
from stepwatch_server.storage.models import Run

log = logging.getLogger(__name__)

ROUND_INTERVAL_S = 0.5
QUIET_S = 0.5  # a run's range is rolled up once no batch widened it for this long ...
MAX_LAG_S = 3.0  # ... or once it has been dirty this long
MAX_VALUES_PER_ROUND = 2_000_000  # per run and round: about the most values one roll-up reads ...
MAX_VALUES_PER_TRANSACTION = 200_000  # ... in transactions of about this many (groups of its series)
BACKLOG_PAUSE_S = 0.02  # between the slices of a long range, so ingest's writes get the lock
RETRY_FIRST_S = 1.0  # a run whose roll-up failed waits this long, doubled per failure ...
RETRY_MAX_S = 60.0  # ... up to this
MAX_ROUND_FAILURES = 5  # failures in a row of the same bucket before it is skipped
MAX_ERROR_CHARS = 300  # of a database error in the log (its statement can name 70,000 ids)


@dataclass(slots=True)
class _Dirty:
    first: int
    last: int
    since: float  # monotonic time it became dirty (-inf: due at once)
    touched: float  # monotonic time of the last hand-over


@dataclass(slots=True)
class _Trouble:
    """A run whose roll-up failed: rolled up one bucket per transaction up to `until`."""

    until: int  # the last step of the range that failed first
    first: int  # the first step of the last failed round
    failures: int  # failures in a row of the round starting at `first`
    retry_at: float  # monotonic time of the next try


class RollupWorker(BackgroundWorker):
    """Dirty step ranges per run in, rollups recomputed on one thread. `submit` never blocks."""

    label = "rollups"
    join_slack_s = ROUND_INTERVAL_S + 1.0  # beyond the deadline: the round in progress

    def __init__(
        self,
        engine: Engine,
        max_values_per_round: int = MAX_VALUES_PER_ROUND,
        max_values_per_transaction: int = MAX_VALUES_PER_TRANSACTION,
        retry_first_s: float = RETRY_FIRST_S,
    ) -> None:
        super().__init__()
        self.db = engine
        self.max_values_per_round = max_values_per_round
        self.max_values_per_transaction = max_values_per_transaction
        self.retry_first_s = retry_first_s
        self._dirty: dict[int, _Dirty] = {}  # run id -> its steps not rolled up yet
        self._trouble: dict[int, _Trouble] = {}  # run id -> its failing range (the thread's own)
        self._force = False  # the next round takes every dirty range (wait_idle, stop)
        self._rounds_done = 0
        self._busy = False
        self.rolled_ranges = 0
        self.skipped_ranges = 0

    # -- life cycle -----------------------------------------------------------------------------
    def _stopped(self) -> None:
        """What was dirty is rolled up within the deadline (the last round); say what was not."""
        if self._thread is not None and (self._thread.is_alive() or self._dirty):
            log.warning(
                "rollups: stopped with %d runs not rolled up (reads use their raw points)", len(self._dirty)
            )

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
            if stop_at is not None and (not self._due_any() or time.monotonic() > stop_at):
                break
            if stop_at is None:
                self._wake.wait(ROUND_INTERVAL_S)
                self._wake.clear()
            self._round()

    def _due_any(self) -> bool:
        """Whether a dirty run is not waiting out a failure's backoff."""
        now = time.monotonic()
        with self._lock:
            return any(not self._backing_off(run_id, now) for run_id in self._dirty)

    def _backing_off(self, run_id: int, now: float) -> bool:
        trouble = self._trouble.get(run_id)
        return trouble is not None and trouble.retry_at > now

    def _round(self) -> None:
        now = time.monotonic()
        with self._lock:
            force, self._force = self._force or self._stop.is_set(), False
            due = [
                run_id
                for run_id, d in self._dirty.items()
                if (force or now - d.touched >= QUIET_S or now - d.since >= MAX_LAG_S)
                and not self._backing_off(run_id, now)
            ]
            todo = {run_id: (self._dirty[run_id].first, self._dirty[run_id].last) for run_id in due}
            for run_id in due:
                del self._dirty[run_id]
            self._busy = bool(todo)
        backlog = False
        for run_id, (first, last) in sorted(todo.items()):
            upto = self._roll_up(run_id, first, last)
            if upto < last:
                self._widen(run_id, upto + 1, last, -math.inf)  # due again at once (or after its backoff)
                backlog = True
        with self._lock:
            self._busy = False
        if backlog:
            self._wake.set()  # the rest of a long range: the next round at once (after a breath)
            time.sleep(BACKLOG_PAUSE_S)

    def _roll_up(self, run_id: int, first: int, last: int) -> int:
        """Roll up steps first..last of run `run_id` (as much as one round takes); the last step done,
        first - 1 if none. A run in trouble goes one bucket per round until past its failed range."""
        trouble = self._trouble.get(run_id)
        max_values = self.max_values_per_round if trouble is None else 0  # 0: one bucket
        planned: rollups.Round | None = None
        try:
            with write_transaction(self.db) as conn:
                planned = rollups.plan(conn, run_id, first, last, max_values)
                if planned is None:  # the run was deleted: nothing of it is left to roll up
                    self._trouble.pop(run_id, None)
                    return last
                groups = rollups.parts(conn, planned, self.max_values_per_transaction)
            for i, ids in enumerate(groups):  # short transactions: ingest's writes get the lock between
                if i:
                    time.sleep(BACKLOG_PAUSE_S)
                with write_transaction(self.db) as conn:
                    rollups.apply_part(conn, planned, ids)
            with write_transaction(self.db) as conn:
                rollups.finish(conn, planned)
        except Exception as exc:
            return self._failed(run_id, first, planned, exc)
        self.rolled_ranges += 1
        if trouble is not None:
            if planned.last_step >= trouble.until:
                del self._trouble[run_id]  # past the range that failed: whole rounds again
            elif planned.first <= trouble.first <= planned.last_step:
                trouble.failures = 0  # what failed went through (another bucket's success does not count)
        return planned.last_step

    def _failed(self, run_id: int, first: int, planned: rollups.Round | None, exc: Exception) -> int:
        """Count a failed round, back off, and after MAX_ROUND_FAILURES of the same one skip it: the
        last step given up, or first - 1 (still dirty)."""
        self.errors += 1
        rollup_failed()
        if not self._warned_error:
            self._warned_error = True
            log.warning(
                "rollups: run %d failed to roll up (%s); retried with backoff, skipped after %d failures "
                "in a row (further failures counted)",
                run_id,
                _error(exc),
                MAX_ROUND_FAILURES,
            )
        start = first if planned is None else planned.first
        trouble = self._trouble.get(run_id)
        if trouble is None:
            until = first if planned is None else planned.last_step
            trouble = self._trouble[run_id] = _Trouble(until, start, 0, 0.0)
        elif trouble.first != start:
            trouble.first, trouble.failures = start, 0
        lost_connection = isinstance(exc, DBAPIError) and exc.connection_invalidated
        if not (lost_connection or database_busy(exc)):  # an outage or another writer is waited out
            trouble.failures += 1
        if planned is not None and trouble.failures >= MAX_ROUND_FAILURES and self._skip(planned, exc):
            if planned.last_step >= trouble.until:
                del self._trouble[run_id]
            else:
                trouble.failures, trouble.retry_at = 0, 0.0
            return planned.last_step
        backoff_s = self.retry_first_s * 2 ** max(0, trouble.failures - 1)
        trouble.retry_at = time.monotonic() + min(RETRY_MAX_S, backoff_s)
        return first - 1

    def _skip(self, planned: rollups.Round, exc: Exception) -> bool:
        """Give up on `planned` (`rollups.skip`) and report it; False when that failed too."""
        try:
            with write_transaction(self.db) as conn:
                name = conn.execute(select(Run.name).where(Run.id == planned.run_id)).scalar()
                rollups.skip(conn, planned)
        except Exception as skip_exc:
            log.warning(
                "rollups: run %d: could not skip %s: %s", planned.run_id, planned.extent(), _error(skip_exc)
            )
            return False
        self.skipped_ranges += 1
        rollup_skipped()
        log.error(
            "rollups: gave up on run %r (id %d), %s, after %d failures in a row: %s. Its raw points are "
            "kept; the views read from rollups leave these steps out until a batch for them arrives.",
            name,
            planned.run_id,
            planned.extent(),
            MAX_ROUND_FAILURES,
            _error(exc),
        )
        return True

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "dirty_runs": len(self._dirty),
                "rolled_ranges": self.rolled_ranges,
                "errors": self.errors,
                "skipped_ranges": self.skipped_ranges,
                "backing_off_runs": sum(t.retry_at > time.monotonic() for t in list(self._trouble.values())),
            }


def _error(exc: Exception) -> str:
    """The database's own message (not the statement with its parameters), cut to MAX_ERROR_CHARS."""
    cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    message = " ".join(str(cause).split()) or type(cause).__name__
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."
