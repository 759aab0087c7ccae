"""Compaction: a background worker that moves a run's older values from `points` (one row each), and
their steps' end times from `steps`, into `blocks` (one compressed row per rank, incarnation and 256-step
bucket: storage/blocks.py), README "Disk use, retention and deleting a run".

A run's steps are compacted once the rollups hold them (`rollup_marks.rolled_to`) and they are more
than `after_steps` behind its newest step (the highest `last_step` of its ranks), whole buckets only,
so the views that read the newest steps (`/metrics`, the step rollups above the watermark) and Grafana's
PostgreSQL panels keep reading rows. A run not heard from for `idle_s` (a
day: it ended, or died) has its newest steps compacted too, its last bucket however full; should it
resume, its new steps are rows in a compacted bucket (as a late value is, below) until it is silent again,
or moves on past the bucket, and the bucket is written again with them. Each transaction moves at most
`max_values` values (a window of buckets, or of ranks within one bucket; one rank's block at least):
it reads the rows, writes their blocks (merged with a block already there: a late value re-sent after
an interrupted pass), deletes the rows and raises the run's `compacted_to` to the highest step a block
holds (what reads and roll-ups look at before reading blocks: a read of the steps above it reads none);
the transaction that finishes a bucket for every rank also moves its step rollups into packs
(runs/step_packs.py). Reads are whole between any two
transactions, and ingest's writes get SQLite's lock between them (BACKLOG_PAUSE_S). A worker that
starts (or did not finish a bucket for every rank) begins again at the bucket holding `compacted_to`,
whose rows some ranks may still hold.

A value that arrives later for a compacted step stays a row (reads take rows and blocks together:
runs/queries.read_values; the rollup worker recomputes such a bucket from both: runs/rollups.py).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, bindparam, delete, func, select, text, update
from sqlalchemy.sql.elements import ColumnElement

from stepwatch_server.background import BackgroundWorker
from stepwatch_server.runs import step_packs
from stepwatch_server.runs.deletion import DELETE_CHUNK_ROWS
from stepwatch_server.runs.queries import STEP_INTEGERS, fetch_chunked, fetch_columns
from stepwatch_server.runs.rollup_worker import BACKLOG_PAUSE_S
from stepwatch_server.settings import DEFAULT_COMPACT_AFTER_STEPS
from stepwatch_server.storage import blocks
from stepwatch_server.storage.chunks import chunk_size, chunks
from stepwatch_server.storage.engine import write_transaction
from stepwatch_server.storage.models import (
    AgentSession,
    Point,
    Rank,
    RollupMark,
    Run,
    Series,
    StepRecord,
    ValueBlock,
)

log = logging.getLogger(__name__)

COMPACTION_INTERVAL_S = 10.0
# A run not heard from for this long (nothing stored for it: the run's and its ranks' `last_seen_at`) has
# its newest steps compacted too: it ended, or died; Grafana's panels, which read rows, then show it no more.
IDLE_S = 86_400.0
BLOCK_STEPS = blocks.BLOCK_STEPS

_DELETE_POINTS = text(
    "DELETE FROM points WHERE series_id IN :ids AND rank IN :ranks AND step >= :first AND step <= :last"
).bindparams(bindparam("ids", expanding=True), bindparam("ranks", expanding=True))


@dataclass(frozen=True, slots=True)
class _Due:
    """A run's buckets first..last (inclusive) are due, for its `ranks` and its series `ids`."""

    run_id: int
    first: int
    last: int
    ranks: list[int]
    ids: list[int]
    top: int  # the run's newest step


class CompactionWorker(BackgroundWorker):
    label = "compaction"
    error_pause_s = 1.0

    def __init__(
        self,
        engine: Engine,
        after_steps: int = DEFAULT_COMPACT_AFTER_STEPS,
        interval_s: float = COMPACTION_INTERVAL_S,
        max_values: int = DELETE_CHUNK_ROWS,
        idle_s: float = IDLE_S,
    ) -> None:
        super().__init__()
        self.db = engine
        self.after_steps = after_steps
        self.idle_s = idle_s
        self.interval_s = interval_s
        self.max_values = max_values
        self.values_moved = 0
        self.blocks_written = 0
        self.step_packs_written = 0
        self._finished: dict[int, int] = {}  # run id -> the last bucket moved for every rank by this worker
        # idle run id -> its newest step when this worker moved its last bucket
        self._tails: dict[int, int] = {}

    def _run(self) -> None:
        while not self._stop.is_set():
            self._guard("compaction", self.compact_once)
            self._stop.wait(self.interval_s)

    def compact_once(self, max_transactions: int | None = None) -> int:
        """Compact what is due in every run, in transactions of at most `max_values` values (stopping after
        `max_transactions` of them that moved any); the values moved."""
        moved, done = 0, 0
        for due in self._due():
            for window in self._windows(due):
                if self._stop.is_set() or (max_transactions is not None and done >= max_transactions):
                    return moved
                if done:
                    self._stop.wait(BACKLOG_PAUSE_S)  # ingest's writes get SQLite's lock between two
                n = self._move(due, *window)
                moved += n
                done += 1 if n else 0
        return moved

    def _due(self) -> list[_Due]:
        newest = (
            select(
                Rank.run_id,
                func.max(Rank.last_step).label("newest"),
                func.max(Rank.last_seen_at).label("seen"),
            )
            .group_by(Rank.run_id)
            .subquery()
        )
        idle_since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=self.idle_s)
        with self.db.connect() as conn:
            rows = conn.execute(
                select(
                    Run.id,
                    Run.compacted_to,
                    RollupMark.rolled_to,
                    newest.c.newest,
                    Run.last_seen_at,
                    newest.c.seen,
                )
                .join(RollupMark, RollupMark.run_id == Run.id)
                .join(newest, newest.c.run_id == Run.id)
                .order_by(Run.id)
            ).all()
            out = []
            for run_id, compacted_to, rolled_to, top, run_seen, ranks_seen in rows:
                if top is None:
                    continue
                seen = max(t for t in (run_seen, ranks_seen) if t is not None)
                idle = seen < idle_since and int(rolled_to) >= int(top)
                if idle and self._tails.get(int(run_id)) == int(top):
                    continue  # its last bucket is moved and nothing came since
                horizon = min(int(rolled_to), int(top) - self.after_steps)
                # The last bucket wholly up to the horizon; an idle run's last bucket, however full.
                last = int(top) // BLOCK_STEPS if idle else (horizon + 1) // BLOCK_STEPS - 1
                if compacted_to is None:
                    start = conn.execute(
                        select(func.min(AgentSession.first_step)).where(AgentSession.run_id == run_id)
                    ).scalar()
                    first = max(0, int(start or 0)) // BLOCK_STEPS
                else:  # the last bucket written may be unfinished (some ranks' rows left), unless known done
                    first = max(int(compacted_to) // BLOCK_STEPS, self._finished.get(int(run_id), -1) + 1)
                if first > last:
                    continue
                ranks = list(
                    conn.execute(select(Rank.rank).where(Rank.run_id == run_id).order_by(Rank.rank)).scalars()
                )
                ids = list(
                    conn.execute(
                        select(Series.id).where(Series.run_id == run_id).order_by(Series.id)
                    ).scalars()
                )
                out.append(
                    _Due(int(run_id), first, last, [int(r) for r in ranks], [int(i) for i in ids], int(top))
                )
        return out

    def _windows(self, due: _Due) -> list[tuple[int, int, list[int], bool]]:
        """(first bucket, last bucket, ranks, whether it finishes its buckets) of each transaction: whole
        buckets for every rank while a bucket's values fit `max_values`, else one bucket, ranks in groups."""
        per_rank_bucket = max(1, len(due.ids)) * BLOCK_STEPS
        per_bucket = per_rank_bucket * max(1, len(due.ranks))
        if per_bucket <= self.max_values:
            width = self.max_values // per_bucket
            return [
                (b, min(b + width - 1, due.last), due.ranks, True)
                for b in range(due.first, due.last + 1, width)
            ]
        size = max(1, self.max_values // per_rank_bucket)
        groups = [list(g) for g in chunks(due.ranks, size)]
        return [
            (b, b, group, i == len(groups) - 1)
            for b in range(due.first, due.last + 1)
            for i, group in enumerate(groups)
        ]

    def _move(self, due: _Due, first: int, last: int, ranks: list[int], finishes: bool) -> int:
        lo, hi = first * BLOCK_STEPS, last * BLOCK_STEPS + BLOCK_STEPS - 1
        with write_transaction(self.db) as conn:
            blocks.lock_run(conn, due.run_id)
            rows = _read_rows(conn, due.ids, ranks, lo, hi)
            times = _read_step_times(conn, due.run_id, ranks, lo, hi)
            moved = int(rows[0].shape[0])
            if moved or times[0].size:
                held = _held(conn, due.run_id, ranks, first, last)
                # A block already there: its values first (a row re-sent later does not replace them).
                values = blocks.join([held, rows, times])
                new = blocks.encode_rows(values)
                conn.execute(
                    delete(ValueBlock).where(
                        ValueBlock.run_id == due.run_id,
                        ValueBlock.rank.in_(ranks),
                        ValueBlock.bucket >= first,
                        ValueBlock.bucket <= last,
                    )
                )
                blocks.insert_rows(conn, due.run_id, new)
                for part in chunks(due.ids, chunk_size(conn, fixed=len(ranks) + 2)):
                    conn.execute(_DELETE_POINTS, {"ids": list(part), "ranks": ranks, "first": lo, "last": hi})
                conn.execute(delete(StepRecord).where(*_step_window(due.run_id, ranks, lo, hi)))
                with self._lock:
                    self.values_moved += moved
                    self.blocks_written += len(new)
                # Reads look for blocks up to here: the highest step a block holds, not the window's end (an
                # idle run's last bucket ends past its last step; a read of the steps after it reads no block).
                held_to = int(values[2].max())
                if (blocks.compacted_to(conn, due.run_id) or -1) < held_to:
                    conn.execute(update(Run).where(Run.id == due.run_id).values(compacted_to=held_to))
            if finishes:  # every rank's values of these buckets are in blocks: their step rollups go to packs
                packed = step_packs.pack(conn, due.ids, lo, hi)
                with self._lock:
                    self.step_packs_written += packed
        if finishes:
            with self._lock:
                if hi <= due.top:
                    self._finished[due.run_id] = last
                else:  # an idle run's last bucket: done until the run sends more
                    self._finished[due.run_id] = last - 1
                    self._tails[due.run_id] = due.top
        if moved:
            log.debug("compaction: run %d buckets %d..%d: %d values", due.run_id, first, last, moved)
        return moved

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "values_moved": self.values_moved,
                "blocks_written": self.blocks_written,
                "step_packs_written": self.step_packs_written,
                "errors": self.errors,
            }


def _read_rows(conn: Connection, ids: Sequence[int], ranks: list[int], lo: int, hi: int) -> blocks.Columns:
    def query(part: Sequence[int]) -> object:
        return select(Point.series_id, Point.rank, Point.step, Point.incarnation, Point.value).where(
            Point.series_id.in_(part), Point.rank.in_(ranks), Point.step >= lo, Point.step <= hi
        )

    return fetch_chunked(conn, ids, query, (0, 1, 2, 3), fixed=len(ranks) + 2)


def _read_step_times(conn: Connection, run_id: int, ranks: list[int], lo: int, hi: int) -> blocks.Columns:
    """The ranks' step end times in steps lo..hi, as columns of series id STEP_TIMES."""
    q = select(StepRecord.rank, StepRecord.step, StepRecord.incarnation, StepRecord.ts)
    return blocks.step_time_columns(
        fetch_columns(conn, q.where(*_step_window(run_id, ranks, lo, hi)), STEP_INTEGERS)
    )


def _step_window(run_id: int, ranks: list[int], lo: int, hi: int) -> tuple[ColumnElement[bool], ...]:
    """The `steps` rows of the ranks in steps lo..hi (read, then deleted, by one move)."""
    return (
        StepRecord.run_id == run_id,
        StepRecord.rank.in_(ranks),
        StepRecord.step >= lo,
        StepRecord.step <= hi,
    )


def _held(conn: Connection, run_id: int, ranks: list[int], first: int, last: int) -> blocks.Columns:
    """The values of the blocks already in the window (none, but after an interrupted pass and a late value)."""
    found = conn.execute(
        select(ValueBlock.rank, ValueBlock.incarnation, blocks.DATA).where(
            ValueBlock.run_id == run_id,
            ValueBlock.rank.in_(ranks),
            ValueBlock.bucket >= first,
            ValueBlock.bucket <= last,
        )
    ).all()
    return blocks.decode_rows(found)
