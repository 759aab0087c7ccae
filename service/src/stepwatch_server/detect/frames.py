"""Cross-rank alignment: batches (one rank, many steps) in, step frames (one step, all ranks) out.

Detectors compare ranks with each other at the same step, so the values of step N from every rank
must be side by side. Batches of different ranks arrive at different times and cover different
step ranges; the aligner scatters each batch's columns into ring matrices (steps x ranks, one numpy
assignment per metric per batch) and emits a frame for step N, in step order, once every rank has
reported it, or once event time (the newest timestamp seen from any rank, heartbeats included) has
moved `grace_s` past the step's first report (a rank that died before sending its last steps), or
when the ring is full. Memory is bounded by what was received, never by what was declared: the ring
holds the steps in flight (it starts at `FIRST_RING_STEPS` and doubles when a rank runs further ahead
of the oldest pending step, up to `RING_STEPS`), and a rank's column is added on its first batch
(columns double as ranks arrive). A short run of 2 ranks in step with each other so holds ~16 steps x 2
columns per metric, not 512 x 8 (1.3 MiB a run, kept for every one of the engine's last 1,000 runs).
A frame lays the columns out in the run's rows (`RunContext.ranks`: the ranks heard from, in rank
order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from stepwatch_server.ingest.schema import Batch, BatchEvent

RING_STEPS = 512  # steps in flight per run at most (a batch holds at most 1,000 steps: larger ones are split)
FIRST_RING_STEPS = 16  # the ring's first size: doubled while a rank reports steps further ahead
MAX_METRICS = 64  # distinct metric names aligned per run; further names are ignored by detection
MAX_TENSOR_NAMES = 512  # distinct (stat, name) tensor series aligned per run
MAX_NAME_SETS = 64  # sets of metric names whose ring rows are remembered (a run's ranks send one or a few)


@dataclass(slots=True)
class StepFrame:
    """One step of one run, every rank side by side. The index is the run's row (`RunContext.ranks`: the
    ranks heard from, in rank order; row r is rank r when every rank 0..N-1 was heard from). NaN marks a
    value not reported."""

    run: str
    step: int
    ts: float  # event time: the latest end-of-step timestamp across the ranks that reported it
    present: np.ndarray  # bool (rows,): ranks that reported this step
    metrics: dict[str, np.ndarray]  # name -> float64 (rows,)
    tensors: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # stat -> name -> (rows,)
    fingerprints: dict[int, str] = field(default_factory=dict)  # row -> 16 hex digits
    events: list[tuple[int, BatchEvent]] = field(default_factory=list)  # (row, event) at this step

    @property
    def world_size(self) -> int:
        """The rows of the frame: the ranks heard from (not the declared world size)."""
        return int(self.present.shape[0])

    def metric(self, name: str) -> np.ndarray | None:
        return self.metrics.get(name)


class Aligner:
    """Ring matrices of one run; `add(batch)` returns the frames that became complete, in step order."""

    def __init__(
        self,
        run: str,
        world_size: int,
        grace_s: float,
        capacity: int = RING_STEPS,
        rows: Callable[[], np.ndarray] | None = None,
        first_capacity: int = FIRST_RING_STEPS,
    ) -> None:
        """`world_size` as declared says when a step is complete; `rows` gives the run's rows (sorted
        rank numbers, a superset of the ranks added) that frames are laid out in (default: the ranks
        added). The ring holds `first_capacity` steps at first and grows up to `capacity`; only a ring
        of `capacity` steps emits a step before it is complete to make room."""
        self.run, self.world_size, self.grace_s = run, world_size, grace_s
        self.max_capacity = capacity
        self.capacity = min(capacity, max(1, first_capacity))
        self._rows = rows
        # A column per rank heard from, in order of arrival; `_width` columns allocated.
        self._column: dict[int, int] = {}
        self._col_rank = np.zeros(0, dtype=np.int64)
        self._width = 0
        # Every metric's ring in one array (metric x step slot x column): one scatter per batch, one copy
        # per frame, whatever the number of metrics.
        self._metric_index: dict[str, int] = {}
        self._rows_of_names: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray | None]] = {}
        self._mring = np.full((0, self.capacity, 0), np.nan)
        self._tensors: dict[tuple[str, str], np.ndarray] = {}
        self._count = np.zeros(self.capacity, dtype=np.int32)
        self._present = np.zeros((self.capacity, 0), dtype=bool)
        self._ts = np.full(self.capacity, -np.inf)
        self._first_seen = np.full(self.capacity, np.inf)
        self._has_tensors = np.zeros(self.capacity, dtype=bool)
        self._fingerprints: dict[int, dict[int, str]] = {}
        self._events: dict[int, list[tuple[int, BatchEvent]]] = {}
        self.next_step: int | None = None  # the next step to emit
        self.event_now = -np.inf  # event-time watermark: newest timestamp seen from any rank

    # -- input ---------------------------------------------------------------------------------
    def observe_time(self, ts: float) -> None:
        self.event_now = max(self.event_now, ts)

    def add(self, batch: Batch) -> list[StepFrame]:
        if batch.heartbeat is not None:
            self.observe_time(batch.heartbeat.ts)
        steps = batch.steps
        if steps.size == 0:
            return self._drain()
        frames: list[StepFrame] = []
        if self.next_step is None:
            self.next_step = int(steps[0])
        elif steps[-1] < self.next_step:  # steps already emitted: a resumed incarnation
            frames += self._flush_all()
            self.next_step = int(steps[0])
        keep = steps >= self.next_step  # late steps of a frame already emitted partially are dropped
        if not keep.all():
            return frames + self._add_slice(batch, np.flatnonzero(keep))
        return frames + self._add_slice(batch, None)

    def _add_slice(self, batch: Batch, index: np.ndarray | None) -> list[StepFrame]:
        steps = batch.steps if index is None else batch.steps[index]
        if steps.size == 0:
            return self._drain()
        assert self.next_step is not None
        frames: list[StepFrame] = []
        # Make room: the newest step must fit in the ring behind next_step (grown first, up to its most).
        span = int(steps[-1]) - self.next_step + 1
        if span > self.capacity < self.max_capacity:
            self._grow(span)
        while int(steps[-1]) - self.next_step >= self.capacity:
            frames.append(self._emit())
        sel: np.ndarray | slice
        if index is None and steps[0] >= self.next_step:  # the common case: the whole batch is new
            steps_in, sel = steps, slice(None)
        else:
            keep = steps >= self.next_step
            steps_in, sel = steps[keep], np.flatnonzero(keep)
            if index is not None:
                sel = index[sel]
        slots = steps_in % self.capacity
        rank = self._col_of(batch.rank)
        fresh = ~self._present[slots, rank]
        self._present[slots, rank] = True
        self._count[slots[fresh]] += 1  # slots are distinct: a batch spans < capacity steps
        ts = batch.timestamps[sel]
        self._ts[slots] = np.maximum(self._ts[slots], ts)
        self._first_seen[slots] = np.minimum(self._first_seen[slots], ts)
        self.observe_time(float(ts.max()))
        if batch.metrics:
            rows, kept = self._metric_rows(tuple(batch.metrics))
            if rows.size:
                cols = list(batch.metrics.values())
                values = np.stack([col.values for col in cols])
                if any(col.present is not None for col in cols):  # JSON nulls: NaN, as not measured
                    present = [
                        np.ones(values.shape[1], bool) if c.present is None else c.present for c in cols
                    ]
                    values = np.where(np.stack(present), values, np.nan)
                block = values[:, sel] if kept is None else values[kept][:, sel]
                self._mring[rows[:, None], slots[None, :], rank] = block
        if batch.tensors and batch.tensor_steps.size:
            self._add_tensors(batch, rank)
        for step, value in zip(batch.fingerprint_steps.tolist(), batch.fingerprints, strict=True):
            if step >= self.next_step:
                self._fingerprints.setdefault(step, {})[batch.rank] = value
        for event in batch.events:
            if event.step >= self.next_step:
                self._events.setdefault(event.step, []).append((batch.rank, event))
        return frames + self._drain()

    def _add_tensors(self, batch: Batch, rank: int) -> None:
        assert self.next_step is not None
        tsteps = batch.tensor_steps
        ok = tsteps >= self.next_step
        tslots = tsteps[ok] % self.capacity
        self._has_tensors[tslots] = True
        for stat, cols in batch.tensors.items():
            for name, col in cols.items():
                ring = self._tensor_ring(stat, name)
                if ring is None:
                    continue
                values = col.values[ok]
                if col.present is not None:
                    values = np.where(col.present[ok], values, np.nan)
                ring[tslots, rank] = values

    def _grow(self, span: int) -> None:
        """Double the ring until it holds `span` steps (at most `max_capacity`), moving each pending step
        from its slot (step mod the old size) to its new one."""
        assert self.next_step is not None
        old = self.capacity
        new = old
        while new < span and new < self.max_capacity:
            new *= 2
        new = min(new, self.max_capacity)
        pending = self.next_step + np.arange(old)  # every step the old ring can hold, in its slot's order
        src, dst = pending % old, pending % new

        def moved(ring: np.ndarray, fill: float | bool, axis: int = 0) -> np.ndarray:
            shape = list(ring.shape)
            shape[axis] = new
            out = np.full(shape, fill, dtype=ring.dtype)
            index: list[slice | np.ndarray] = [slice(None)] * ring.ndim
            index[axis] = dst
            take: list[slice | np.ndarray] = [slice(None)] * ring.ndim
            take[axis] = src
            out[tuple(index)] = ring[tuple(take)]
            return out

        self._mring = moved(self._mring, np.nan, axis=1)
        self._tensors = {key: moved(ring, np.nan) for key, ring in self._tensors.items()}
        self._count = moved(self._count, 0)
        self._present = moved(self._present, False)
        self._ts = moved(self._ts, -np.inf)
        self._first_seen = moved(self._first_seen, np.inf)
        self._has_tensors = moved(self._has_tensors, False)
        self.capacity = new

    def _metric_rows(self, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray | None]:
        """The ring rows of a batch's metric names, in order, and which of the names have one (None: all);
        remembered by the names (a rank sends the same names batch after batch)."""
        found = self._rows_of_names.get(names)
        if found is None:
            rows = [self._metric_row(name) for name in names]
            kept = np.array([row >= 0 for row in rows])
            found = (np.array([row for row in rows if row >= 0], dtype=np.intp), None if kept.all() else kept)
            if len(self._rows_of_names) >= MAX_NAME_SETS:
                self._rows_of_names.clear()
            self._rows_of_names[names] = found
        return found

    def _metric_row(self, name: str) -> int:
        """The metric's row in the ring array (a new one for a new name), -1 beyond MAX_METRICS."""
        row = self._metric_index.get(name)
        if row is None:
            if len(self._metric_index) >= MAX_METRICS:
                return -1
            row = self._metric_index[name] = len(self._metric_index)
            fresh = np.full((1, self.capacity, self._width), np.nan)
            self._mring = np.concatenate([self._mring, fresh])
        return row

    def _tensor_ring(self, stat: str, name: str) -> np.ndarray | None:
        ring = self._tensors.get((stat, name))
        if ring is None and len(self._tensors) < MAX_TENSOR_NAMES:
            ring = self._tensors[(stat, name)] = np.full((self.capacity, self._width), np.nan)
        return ring

    def _col_of(self, rank: int) -> int:
        """The rank's column, added on its first batch (the allocated columns double when full)."""
        col = self._column.get(rank)
        if col is not None:
            return col
        col = self._column[rank] = len(self._column)
        if col >= self._width:
            grow = max(1, self._width)
            self._width += grow
            self._col_rank = np.concatenate([self._col_rank, np.full(grow, -1, dtype=np.int64)])
            self._mring = np.concatenate(
                [self._mring, np.full((*self._mring.shape[:2], grow), np.nan)], axis=2
            )
            self._present = np.concatenate(
                [self._present, np.zeros((self.capacity, grow), dtype=bool)], axis=1
            )
            for key, ring in self._tensors.items():
                self._tensors[key] = np.concatenate([ring, np.full((self.capacity, grow), np.nan)], axis=1)
        self._col_rank[col] = rank
        return col

    # -- output --------------------------------------------------------------------------------
    def _ready(self) -> bool:
        if self.next_step is None:
            return False
        slot = self.next_step % self.capacity
        if self._count[slot] == 0:
            return self._skip_gap()
        if self._count[slot] >= self.world_size:
            return True
        return bool(self.event_now - self._first_seen[slot] > self.grace_s)

    def _skip_gap(self) -> bool:
        """No rank reported next_step but some reported later ones: after the grace, skip the gap."""
        assert self.next_step is not None
        order = (np.arange(self.capacity) + self.next_step) % self.capacity
        pending = np.flatnonzero(self._count[order])
        if pending.size == 0:
            return False
        first = int(pending[0])
        if self.event_now - self._first_seen[order[first]] <= self.grace_s:
            return False
        self.next_step += first
        return True

    def _drain(self) -> list[StepFrame]:
        frames = []
        while self._ready():
            frames.append(self._emit())
        return frames

    def _flush_all(self) -> list[StepFrame]:
        frames = []
        while self.next_step is not None and self._count.any():
            if self._count[self.next_step % self.capacity]:
                frames.append(self._emit())
            else:
                self.next_step += 1
        return frames

    def pending_steps(self) -> int:
        return int(np.count_nonzero(self._count))

    def _emit(self) -> StepFrame:
        assert self.next_step is not None
        step = self.next_step
        slot = step % self.capacity
        n = len(self._column)
        ranks = self._col_rank[:n]
        rows = np.sort(ranks) if self._rows is None else self._rows()
        where = np.searchsorted(rows, ranks)  # each column's row

        def lay_out(cols: np.ndarray, fill: float | bool) -> np.ndarray:
            out = np.full((*cols.shape[:-1], rows.size), fill, dtype=cols.dtype)
            out[..., where] = cols[..., :n]
            return out

        def row(rank: int) -> int:
            return int(np.searchsorted(rows, rank))

        frame = StepFrame(
            run=self.run,
            step=step,
            ts=float(self._ts[slot]),
            present=lay_out(self._present[slot], False),
            metrics=dict(zip(self._metric_index, lay_out(self._mring[:, slot], np.nan), strict=True)),
            fingerprints={row(r): v for r, v in self._fingerprints.pop(step, {}).items()},
            events=[(row(r), e) for r, e in self._events.pop(step, [])],
        )
        if self._has_tensors[slot]:
            for (stat, name), ring in self._tensors.items():
                values = ring[slot]
                if not np.isnan(values).all():
                    frame.tensors.setdefault(stat, {})[name] = lay_out(values, np.nan)
                ring[slot] = np.nan
        self._mring[:, slot] = np.nan
        self._count[slot] = 0
        self._present[slot] = False
        self._ts[slot] = -np.inf
        self._first_seen[slot] = np.inf
        self._has_tensors[slot] = False
        self.next_step = step + 1
        return frame

    def frames_in(self, batches: list[Batch]) -> Iterator[StepFrame]:
        for batch in batches:
            yield from self.add(batch)
