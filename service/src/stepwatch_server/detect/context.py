"""What the detectors of one run know beyond a step frame: who the ranks are, what they last said."""

from __future__ import annotations

import numpy as np

from stepwatch_server.detect.activity import CHECKPOINT, stack_activity
from stepwatch_server.detect.anomalies import AnomalyBook
from stepwatch_server.ingest.schema import Batch, Heartbeat

STEP_TIME_WINDOW = 256  # recent steps whose median step time is "the run's typical step time"
RECENT_SESSIONS = 4  # per rank: a late batch of one of these (a replayed spool) is not a restart


class RunContext:
    """Per-run state shared by its detectors, indexed by rank (numpy arrays of length world_size)."""

    def __init__(self, run: str, world_size: int) -> None:
        self.run = run
        self.world_size = world_size
        self.book = AnomalyBook(run)
        self.node: list[str | None] = [None] * world_size
        self.replica_group = np.arange(world_size)
        self.shard = np.zeros(world_size, dtype=np.int64)
        self.num_shards = np.ones(world_size, dtype=np.int64)  # shards per replica, as each rank says
        self.seen = np.zeros(world_size, dtype=bool)  # the rank has sent anything at all
        self.last_step = np.full(world_size, -1, dtype=np.int64)  # last completed step reported
        self.last_step_ts = np.full(world_size, np.nan)  # its end timestamp (event time)
        self.heartbeat_ts = np.full(world_size, np.nan)  # event time of the latest heartbeat
        self.heartbeat_phase: list[str | None] = [None] * world_size
        self.heartbeat_step = np.full(world_size, -1, dtype=np.int64)  # its last completed step (or -1)
        self.paused: list[str | None] = [None] * world_size  # inside watch.phase(...) since phase_start
        self.n_paused = 0  # ranks with a phase in `paused` (checked per batch: no scan of the list)
        self.ended = np.zeros(world_size, dtype=bool)  # the rank's agent closed its session (session_end)
        # Agent sessions: a rank whose session changes to one not seen before restarted (a resumed run).
        self.session: list[str | None] = [None] * world_size  # the rank's current session
        self._sessions: list[tuple[str, ...]] = [()] * world_size  # its recent ones, newest last
        self.restart_ts = np.nan  # event time of the latest restarted session's first message (any rank)
        # What the training thread does (heartbeat fields, -1 / () when not reported), for detect/activity.py:
        # the latest heartbeat's counters, the no-grad count at the rank's last completed step (the first
        # heartbeat that reported that step), when the no-grad count last advanced, the stack, and when
        # it last showed a save call.
        self.forwards = np.full(world_size, -1, dtype=np.int64)
        self.nograd_forwards = np.full(world_size, -1, dtype=np.int64)
        self.nograd_at_step = np.full(world_size, -1, dtype=np.int64)
        self.nograd_moved_ts = np.full(world_size, np.nan)  # event time of a heartbeat whose count rose
        self.checkpoint_seen_ts = np.full(world_size, np.nan)  # ... of the latest with a save on its stack
        self._counted_step = np.full(world_size, -2, dtype=np.int64)  # the step nograd_at_step belongs to
        self.stack: list[tuple[str, ...]] = [()] * world_size
        self.stack_activity = np.zeros(world_size, dtype=np.int8)  # activity.stack_activity(stack)
        self.last_arrival_wall = np.nan  # wall-clock time the run last sent anything
        self._event_now = -np.inf  # the newest step end or heartbeat seen from any rank
        self._step_ms = np.full(STEP_TIME_WINDOW, np.nan)
        self._step_ms_n = 0

    # -- updates ---------------------------------------------------------------------------------
    def update(self, batch: Batch, wall_now: float) -> None:
        r = batch.rank
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

    def where(self, rank: int) -> str:
        """'rank 37 on node gpu-12' (or 'rank 37' when the node is unknown)."""
        node = self.node[rank]
        return f"rank {rank} on node {node}" if node else f"rank {rank}"

    def ranks_of_node(self, node: str) -> np.ndarray:
        return np.array([r for r, n in enumerate(self.node) if n == node], dtype=np.int64)
