"""What the detectors of one run know beyond a step frame: who the ranks are, what they last said."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from stepwatch_server.detect.activity import CHECKPOINT, stack_activity
from stepwatch_server.detect.anomalies import AnomalyBook
from stepwatch_server.ingest.schema import Batch, Heartbeat

if TYPE_CHECKING:
    from stepwatch_server.detect.detectors._slowness import RankSlowness

MAX_MISSING_RANGES = 16  # ranges of never-heard-from ranks listed (the count is always exact)
STEP_TIME_WINDOW = 256  # recent steps whose median step time is "the run's typical step time"
RECENT_SESSIONS = 4  # per rank: a late batch of one of these (a replayed spool) is not a restart
# Per-rank arrays (fill for a new row, dtype) and lists (fill), one entry per row.
_ARRAYS: dict[str, tuple[Any, Any]] = {
    "replica_group": (0, np.int64),
    "shard": (0, np.int64),
    "num_shards": (1, np.int64),
    "seen": (False, bool),
    "last_step": (-1, np.int64),
    "last_step_ts": (np.nan, np.float64),
    "heartbeat_ts": (np.nan, np.float64),
    "heartbeat_step": (-1, np.int64),
    "ended": (False, bool),
    "forwards": (-1, np.int64),
    "nograd_forwards": (-1, np.int64),
    "nograd_at_step": (-1, np.int64),
    "nograd_moved_ts": (np.nan, np.float64),
    "checkpoint_seen_ts": (np.nan, np.float64),
    "_counted_step": (-2, np.int64),
    "stack_activity": (0, np.int8),
}
_LISTS: dict[str, Any] = {
    "node": None,
    "heartbeat_phase": None,
    "paused": None,
    "session": None,
    "_sessions": (),
    "stack": (),
}


class RunContext:
    """Per-run state shared by its detectors: one row per rank heard from, in rank order.

    Rows are sized by the ranks that sent something, never by the declared world size (a batch may
    declare 131,072 ranks and come from one): `ranks` holds the rank numbers of the rows, sorted, and a
    rank's first message inserts its row (`seat`). Step frames use the same rows; a detector that keeps
    per-rank state moves it to the new rows with `carry` (rows are only ever added). With every rank
    0..N-1 heard from, row r is rank r. `ranks=None` seats every rank of `world_size` at once (tests
    that build frames by hand).
    """

    # Per rank (one entry per row), allocated from _ARRAYS / _LISTS:
    node: list[str | None]
    replica_group: np.ndarray
    shard: np.ndarray
    num_shards: np.ndarray  # shards per replica, as each rank says
    seen: np.ndarray  # the rank has sent anything at all
    last_step: np.ndarray  # last completed step reported
    last_step_ts: np.ndarray  # its end timestamp (event time)
    heartbeat_ts: np.ndarray  # event time of the latest heartbeat
    heartbeat_phase: list[str | None]
    heartbeat_step: np.ndarray  # its last completed step (or -1)
    paused: list[str | None]  # inside watch.phase(...) since phase_start
    ended: np.ndarray  # the rank's agent closed its session (session_end)
    # Agent sessions: a rank whose session changes to one not seen before restarted (a resumed run).
    session: list[str | None]  # the rank's current session
    _sessions: list[tuple[str, ...]]  # its recent ones, newest last
    # What the training thread does (heartbeat fields, -1 / () when not reported), for detect/activity.py:
    # the latest heartbeat's counters, the no-grad count at the rank's last completed step (the first
    # heartbeat that reported that step), when the no-grad count last advanced, the stack, and when
    # it last showed a save call.
    forwards: np.ndarray
    nograd_forwards: np.ndarray
    nograd_at_step: np.ndarray
    nograd_moved_ts: np.ndarray  # event time of a heartbeat whose count rose
    checkpoint_seen_ts: np.ndarray  # ... of the latest with a save on its stack
    _counted_step: np.ndarray  # the step nograd_at_step belongs to
    stack: list[tuple[str, ...]]
    stack_activity: np.ndarray  # activity.stack_activity(stack)

    def __init__(self, run: str, world_size: int, ranks: Iterable[int] | None = None) -> None:
        self.run = run
        self.world_size = world_size  # as declared: a number, never a size
        self.book = AnomalyBook(run)
        seated = np.arange(world_size) if ranks is None else np.unique(np.fromiter(ranks, dtype=np.int64))
        self.ranks = seated.astype(np.int64)  # row -> rank number, sorted
        self.version = 0  # bumped whenever a row is inserted
        self._row_cache: dict[int, tuple[int, int]] = {}  # rank -> (row, the version it is valid for)
        n = self.ranks.size
        for name, (fill, dtype) in _ARRAYS.items():
            setattr(self, name, np.full(n, fill, dtype=dtype))
        for name, fill in _LISTS.items():
            setattr(self, name, [fill] * n)
        self.replica_group[:] = self.ranks  # until the rank says: every rank its own replica
        self.n_paused = 0  # ranks with a phase in `paused` (checked per batch: no scan of the list)
        self.restart_ts = np.nan  # event time of the latest restarted session's first message (any rank)
        # Which ranks and nodes are slow: computed once per frame for `straggler` and `slow_node` (set by
        # the detection engine, or by the first of them built by hand; detectors/_slowness.py).
        self.slowness: RankSlowness | None = None
        self.last_arrival_wall = np.nan  # wall-clock time the run last sent anything
        self._event_now = -np.inf  # the newest step end or heartbeat seen from any rank
        self._step_ms = np.full(STEP_TIME_WINDOW, np.nan)
        self._step_ms_n = 0

    # -- rows ------------------------------------------------------------------------------------
    @property
    def n_ranks(self) -> int:
        """Rows: the ranks heard from (or seated by hand)."""
        return int(self.ranks.size)

    def row_of(self, rank: int) -> int | None:
        """The row of rank number `rank`, None when it never sent anything."""
        row = int(np.searchsorted(self.ranks, rank))
        return row if row < self.ranks.size and self.ranks[row] == rank else None

    def rank_of(self, row: int) -> int:
        return int(self.ranks[row])

    def rows_of(self, ranks: Iterable[int]) -> np.ndarray:
        """The rows of those rank numbers that were heard from."""
        want = np.fromiter(ranks, dtype=np.int64)
        rows = np.minimum(np.searchsorted(self.ranks, want), max(self.ranks.size - 1, 0))
        return rows[self.ranks[rows] == want] if self.ranks.size else rows[:0]

    def carry(self, owner: object, fills: Mapping[str, Any], since: np.ndarray) -> np.ndarray:
        """Move `owner`'s per-rank arrays named in `fills` (rows on their last axis) from the rows of
        rank numbers `since` to the current rows, new rows filled; return the current rank numbers, to
        pass as `since` next time. Rows are only ever added, so the same count means nothing changed."""
        if since.size != self.ranks.size:
            for name, fill in fills.items():
                setattr(owner, name, carry_rows(getattr(owner, name), since, self.ranks, fill))
        return self.ranks

    def seat(self, rank: int) -> int:
        """The row of `rank`, inserted (in rank order) on its first message."""
        cached = self._row_cache.get(rank)
        if cached is not None and cached[1] == self.version:  # the hot path: no row inserted since
            return cached[0]
        row = int(np.searchsorted(self.ranks, rank))
        if row < self.ranks.size and self.ranks[row] == rank:
            self._row_cache[rank] = (row, self.version)
            return row
        self.ranks = _inserted(self.ranks, row, rank)
        for name, (fill, _) in _ARRAYS.items():
            setattr(self, name, _inserted(getattr(self, name), row, fill))
        for name, fill in _LISTS.items():
            getattr(self, name).insert(row, fill)
        self.replica_group[row] = rank
        self.version += 1
        self._row_cache[rank] = (row, self.version)
        return row

    def missing(self) -> tuple[int, list[tuple[int, int]]]:
        """Declared ranks never heard from: their count and the first `MAX_MISSING_RANGES` ranges of
        them (first, last), computed from the rows (never one entry per declared rank)."""
        return missing_ranks(self.ranks, self.world_size)

    # -- updates ---------------------------------------------------------------------------------
    def update(self, batch: Batch, wall_now: float) -> None:
        r = self.seat(batch.rank)
        current = self._session(r, batch)
        self.seen[r] = True
        self.last_arrival_wall = wall_now
        self.node[r] = batch.node
        self.replica_group[r] = batch.replica_group
        self.shard[r] = batch.shard
        self.num_shards[r] = batch.num_shards
        if batch.steps.size:
            self.ended[r] = False  # steps after a session_end: a new session of this rank
        if batch.steps.size:  # the latest batch is the truth, also when a resumed incarnation went back
            self.last_step[r] = int(batch.steps[-1])
            self.last_step_ts[r] = float(batch.timestamps[-1])
            self._event_now = max(self._event_now, self.last_step_ts[r])
        hb = batch.heartbeat
        if hb is not None and not hb.ts <= self.heartbeat_ts[r]:
            self.heartbeat_ts[r] = hb.ts
            self._event_now = max(self._event_now, hb.ts)
            self.heartbeat_phase[r] = hb.phase
            if hb.last_step is not None:
                self.heartbeat_step[r] = hb.last_step
            if current:
                self._activity(r, hb)
        for event in batch.events:
            phase = event.data.get("phase") if isinstance(event.data, dict) else None
            if event.kind == "phase_start":
                self.n_paused += self.paused[r] is None
                self.paused[r] = str(phase or "pause")
            elif event.kind == "phase_end":
                self.n_paused -= self.paused[r] is not None
                self.paused[r] = None
            elif event.kind == "session_end":
                self.ended[r] = True

    def _session(self, r: int, batch: Batch) -> bool:
        """Follow the rank's agent session; False for a late batch of one of its earlier sessions."""
        current = self.session[r]
        if batch.session == current:
            return True
        recent = self._sessions[r]
        if batch.session in recent:  # an earlier session's spooled batch, replayed by the new one
            return False
        if current is not None:  # a new session of a rank that had one: the rank restarted
            starts = [float(batch.timestamps[0])] if batch.steps.size else []
            starts += [batch.heartbeat.ts] if batch.heartbeat is not None else []
            starts += [e.ts for e in batch.events]
            if starts:
                self.restart_ts = float(np.fmax(self.restart_ts, min(starts)))
        self.session[r] = batch.session
        self._sessions[r] = (*recent[-(RECENT_SESSIONS - 1) :], batch.session)
        for counter in (self.forwards, self.nograd_forwards, self.nograd_at_step):
            counter[r] = -1  # the agent's counters start again with each session
        self.nograd_moved_ts[r] = self.checkpoint_seen_ts[r] = np.nan
        self.heartbeat_step[r] = -1  # the old session's steps say nothing about the new one's progress
        self._counted_step[r] = -2
        self.stack[r], self.stack_activity[r] = (), 0
        return True

    def _activity(self, r: int, hb: Heartbeat) -> None:
        if hb.forwards is not None and hb.nograd_forwards is not None:
            if 0 <= self.nograd_forwards[r] < hb.nograd_forwards:
                self.nograd_moved_ts[r] = hb.ts
            self.forwards[r], self.nograd_forwards[r] = hb.forwards, hb.nograd_forwards
            step = -1 if hb.last_step is None else hb.last_step
            if step != self._counted_step[r]:
                self._counted_step[r] = step
                self.nograd_at_step[r] = hb.nograd_forwards
        if hb.stack != self.stack[r]:
            self.stack[r], self.stack_activity[r] = hb.stack, stack_activity(hb.stack)
        if self.stack_activity[r] == CHECKPOINT:
            self.checkpoint_seen_ts[r] = hb.ts

    def completed(self) -> tuple[np.ndarray, np.ndarray]:
        """Per rank the last step it completed and when it was known: its latest step record, or its
        heartbeat when that says a later step (the record is on its way: the agent sends records at its
        flush cadence, heartbeats on their own), with the heartbeat's time."""
        ahead = self.heartbeat_step > self.last_step
        step = np.where(ahead, self.heartbeat_step, self.last_step)
        return step, np.where(ahead, self.heartbeat_ts, self.last_step_ts)

    def finished(self) -> bool:
        """Every rank that reported anything has closed its session: the run ended on purpose."""
        return bool(self.ended.any() and self.ended[self.seen].all())

    def record_step_time(self, step_ms: float) -> None:
        if np.isfinite(step_ms):
            self._step_ms[self._step_ms_n % STEP_TIME_WINDOW] = step_ms
            self._step_ms_n += 1

    # -- questions -------------------------------------------------------------------------------
    def typical_step_ms(self) -> float:
        """Median step time over recent steps (NaN before any)."""
        if self._step_ms_n == 0:
            return float("nan")
        return float(np.nanmedian(self._step_ms[: min(self._step_ms_n, STEP_TIME_WINDOW)]))

    def event_now(self) -> float:
        """The newest event time seen from any rank: step ends and heartbeats."""
        return float(self._event_now) if np.isfinite(self._event_now) else float("nan")

    def where(self, row: int) -> str:
        """'rank 37 on node gpu-12' (or 'rank 37' when the node is unknown), for the rank of `row`."""
        node, rank = self.node[row], self.rank_of(row)
        return f"rank {rank} on node {node}" if node else f"rank {rank}"

    def ranks_of_node(self, node: str) -> np.ndarray:
        """The rows of the ranks on `node`."""
        return np.array([r for r, n in enumerate(self.node) if n == node], dtype=np.int64)


def _inserted(a: np.ndarray, row: int, value: Any) -> np.ndarray:
    """`a` with `value` inserted at `row` (np.insert without its generality, ~10x cheaper)."""
    out = np.empty(a.size + 1, dtype=a.dtype)
    out[:row], out[row], out[row + 1 :] = a[:row], value, a[row:]
    return out


def missing_ranks(ranks: np.ndarray, world_size: int) -> tuple[int, list[tuple[int, int]]]:
    """Of 0..world_size-1, those not in `ranks` (sorted, unique): their count and the first
    `MAX_MISSING_RANGES` runs of them as (first, last); O(len(ranks)) whatever the world size."""
    inside = ranks[(ranks >= 0) & (ranks < world_size)]
    count = world_size - int(inside.size)
    bounds = np.concatenate([[-1], inside, [world_size]])
    gaps = np.flatnonzero(np.diff(bounds) > 1)[:MAX_MISSING_RANGES]
    return count, [(int(bounds[g]) + 1, int(bounds[g + 1]) - 1) for g in gaps.tolist()]


def carry_rows(arr: np.ndarray, old: np.ndarray, new: np.ndarray, fill: Any) -> np.ndarray:
    """`arr` (last axis: the rows of rank numbers `old`) moved to the rows of `new` (a superset, both
    sorted); the rows of ranks new to it get `fill`."""
    out = np.full((*arr.shape[:-1], new.size), fill, dtype=arr.dtype)
    out[..., np.searchsorted(new, old)] = arr
    return out
