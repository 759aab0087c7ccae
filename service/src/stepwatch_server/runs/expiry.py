"""Retention: a background worker that deletes what is older than the settings (README "Disk use,
retention and deleting a run").

- `run_retention_days`: a run whose last write (its row's or any rank's `last_seen_at`, the collector's
  clock) is older goes whole (runs/deletion.py).
- `raw_retention_days`: per run, the last step that one of its ranks (the lowest) finished before the
  cutoff, by the ranks' own timestamps (`steps` rows, and the times compacted into blocks: read upwards
  from the last horizon until one is not older), and that the rollups hold (`rollup_marks.rolled_to`), is the
  run's new `raw_expired_to`; each rank's values (rows, and the compacted blocks wholly up to it), step
  times and fingerprints up to it are deleted in
  windows of steps of at most DELETE_CHUNK_ROWS values, each window with its rank's `stored_values`
  lowered by what it removed, in one short transaction. The raw horizon is written last, so an
  interrupted pass is finished by the next.

Reads of the steps up to `raw_expired_to` come from the rollups (runs/routes.py). A pass runs every
`EXPIRY_INTERVAL_S`; its cost is one scan of the lowest rank's step times above the last horizon per run.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, Table, and_, delete, func, select, update

from stepwatch_server.background import BackgroundWorker
from stepwatch_server.runs import queries
from stepwatch_server.runs.deletion import DELETE_CHUNK_ROWS, RunRow, delete_run
from stepwatch_server.storage import blocks
from stepwatch_server.storage.blocks import BLOCK_STEPS
from stepwatch_server.storage.engine import write_transaction
from stepwatch_server.storage.models import (
    Fingerprint,
    Point,
    Rank,
    RollupMark,
    Run,
    Series,
    StepRecord,
    ValueBlock,
)

log = logging.getLogger(__name__)

EXPIRY_INTERVAL_S = 300.0
DAY_S = 86_400.0
_POINTS: Table = Point.__table__  # type: ignore[assignment]


class ExpiryWorker(BackgroundWorker):
    label = "expiry"
    error_pause_s = 1.0

    def __init__(
        self,
        engine: Engine,
        raw_retention_days: float | None,
        run_retention_days: float | None,
        on_deleted: Callable[[RunRow], None] | None = None,
        interval_s: float = EXPIRY_INTERVAL_S,
    ) -> None:
        super().__init__()
        self.db = engine
        self.raw_days = raw_retention_days
        self.run_days = run_retention_days
        self.on_deleted = on_deleted  # a run deleted: the caches of this process forget it (app.py)
        self.interval_s = interval_s
        self.runs_deleted = 0
        self.raw_values_deleted = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self._guard("expiry", self.expire_once, time.time())
            self._stop.wait(self.interval_s)

    def expire_once(self, now: float) -> dict[str, Any]:
        """One pass at Unix time `now`: {"runs": names deleted, "raw_values": values and fingerprints deleted}."""
        gone: list[str] = []
        if self.run_days is not None:
            for run in self._silent_runs(now - self.run_days * DAY_S):
                if self._stop.is_set():
                    break
                delete_run(self.db, run)
                gone.append(run.name)
                log.info("expiry: deleted run %r (not heard from for %g days)", run.name, self.run_days)
                if self.on_deleted is not None:
                    self.on_deleted(run)
        raw = 0
        if self.raw_days is not None:
            cutoff = now - self.raw_days * DAY_S
            with self.db.connect() as conn:
                runs = conn.execute(
                    select(Run.id, Run.raw_expired_to, RollupMark.rolled_to).join(
                        RollupMark, RollupMark.run_id == Run.id
                    )
                ).all()
            for run_id, expired_to, rolled_to in runs:
                if self._stop.is_set():
                    break
                raw += self._expire_raw(int(run_id), expired_to, int(rolled_to), cutoff)
        with self._lock:
            self.runs_deleted += len(gone)
            self.raw_values_deleted += raw
        return {"runs": gone, "raw_values": raw}

    def _silent_runs(self, before: float) -> list[RunRow]:
        """The runs last seen (the later of the run's and its ranks' writes: `queries.run_summaries`)
        before Unix time `before`."""
        cutoff = dt.datetime.fromtimestamp(before, dt.UTC)
        with self.db.connect() as conn:
            ids = {str(name): int(run_id) for name, run_id in conn.execute(select(Run.name, Run.id))}
            summaries = queries.run_summaries(conn)
        return [
            RunRow(ids[r["name"]], r["name"])
            for r in summaries
            if r["last_seen_at"] is not None and r["last_seen_at"] < cutoff and r["name"] in ids
        ]

    def _expire_raw(self, run_id: int, expired_to: int | None, rolled_to: int, cutoff: float) -> int:
        """Delete run `run_id`'s raw per-rank data up to its new horizon (module docstring); the values and
        fingerprints deleted."""
        low = -1 if expired_to is None else int(expired_to)
        with self.db.connect() as conn:
            ranks = [
                int(r)
                for r in conn.execute(
                    select(Rank.rank).where(Rank.run_id == run_id).order_by(Rank.rank)
                ).scalars()
            ]
            if not ranks:
                return 0
            cut = conn.execute(
                select(func.max(StepRecord.step)).where(
                    StepRecord.run_id == run_id,
                    StepRecord.rank == ranks[0],
                    StepRecord.step > low,
                    StepRecord.step <= rolled_to,
                    StepRecord.ts < cutoff,
                )
            ).scalar()
            held = blocks.last_step_before(conn, run_id, ranks[0], low, rolled_to, cutoff)  # compacted times
            if held is not None:
                cut = held if cut is None else max(int(cut), held)
            if cut is None:
                return 0
            series = int(conn.execute(select(func.count()).where(Series.run_id == run_id)).scalar_one())
        window = max(1, DELETE_CHUNK_ROWS // max(1, series))  # steps per transaction
        ids = select(Series.id).where(Series.run_id == run_id).scalar_subquery()
        removed = 0
        for rank in ranks:
            with self.db.connect() as conn:
                first = conn.execute(
                    select(func.min(StepRecord.step)).where(
                        StepRecord.run_id == run_id, StepRecord.rank == rank, StepRecord.step > low
                    )
                ).scalar()
                bucket = conn.execute(  # the rank's first block still holding a step above `low`
                    select(func.min(ValueBlock.bucket)).where(
                        ValueBlock.run_id == run_id,
                        ValueBlock.rank == rank,
                        ValueBlock.bucket >= (low + 1) // BLOCK_STEPS,
                    )
                ).scalar()
                if bucket is not None:
                    held_from = int(bucket) * BLOCK_STEPS
                    first = held_from if first is None else min(int(first), held_from)
            start = low if first is None else max(low, int(first) - 1)
            while start < cut and not self._stop.is_set():
                end = min(int(cut), start + window)
                with write_transaction(self.db) as conn:
                    n = conn.execute(
                        delete(_POINTS).where(
                            _POINTS.c.series_id.in_(ids),
                            _POINTS.c.rank == rank,
                            _POINTS.c.step > start,
                            _POINTS.c.step <= end,
                        )
                    ).rowcount
                    n += conn.execute(
                        delete(Fingerprint).where(
                            Fingerprint.run_id == run_id,
                            Fingerprint.rank == rank,
                            Fingerprint.step > start,
                            Fingerprint.step <= end,
                        )
                    ).rowcount
                    whole = ValueBlock.bucket <= (end + 1) // BLOCK_STEPS - 1  # blocks wholly up to `end`
                    mine = and_(ValueBlock.run_id == run_id, ValueBlock.rank == rank, whole)
                    n += int(
                        conn.execute(
                            select(func.coalesce(func.sum(ValueBlock.n_values), 0)).where(mine)
                        ).scalar_one()
                    )
                    conn.execute(delete(ValueBlock).where(mine))
                    conn.execute(
                        delete(StepRecord).where(
                            StepRecord.run_id == run_id,
                            StepRecord.rank == rank,
                            StepRecord.step > start,
                            StepRecord.step <= end,
                        )
                    )
                    if n:
                        conn.execute(
                            update(Rank)
                            .where(Rank.run_id == run_id, Rank.rank == rank)
                            .values(stored_values=Rank.stored_values - n)
                        )
                removed += n
                start = end
        if not self._stop.is_set():
            with write_transaction(self.db) as conn:
                conn.execute(update(Run).where(Run.id == run_id).values(raw_expired_to=int(cut)))
        return removed

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "runs_deleted": self.runs_deleted,
                "raw_values_deleted": self.raw_values_deleted,
                "errors": self.errors,
            }
