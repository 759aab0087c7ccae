"""Run a scenario: clean physics + faults per chunk, synchronised, batched, and merged across ranks
into the order a collector would receive the batches.

Memory stays bounded by one chunk (a few MB even at 512 ranks) plus the batches not yet released:
a batch is released once no later chunk can produce an earlier one (every later batch is sent after
the earliest rank's last step end of the current chunk).

A resumed run is generated session by session (`Scenario.segments`): the last chunk of a killed
session carries the kill time (during the step after the last one completed), the first chunk of
the next one the time its processes start again (`Resume.gap_s` later).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterator
from typing import Any

import numpy as np

from stepwatch_server.simulate import benign as benign_effects
from stepwatch_server.simulate import faults as fault_effects
from stepwatch_server.simulate.batches import Batcher
from stepwatch_server.simulate.physics import Chunk, CleanPhysics
from stepwatch_server.simulate.scenario import Label, Scenario

STREAM_RESUME = 6


class Simulation:
    """One pass over a scenario. Iterate it for the batches; afterwards `labels` carry onset times and
    `step_ts` maps each step to its (median over ranks) end time."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.step_ts = np.full(scenario.last_step + 1, np.nan)  # index = step
        self._onsets: dict[int, float] = {}
        self.batches_sent = 0
        self.max_pending = 0  # most batches held back across a chunk boundary (about one per rank)

    @property
    def labels(self) -> tuple[Label, ...]:
        """Ground truth with `first_ts` where the onset has been generated."""
        out = []
        for lab in self.scenario.labels:
            ts = self._onsets.get(-1 if lab.kind == "hang" else lab.first_step)
            out.append(dataclasses.replace(lab, first_ts=ts))
        return tuple(out)

    def ts_of_step(self, step: int) -> float | None:
        """The median end time of `step` (None when it was never completed or not yet generated)."""
        if not 0 <= step < self.step_ts.shape[0]:
            return None
        v = float(self.step_ts[step])
        return None if v != v else v

    def chunks(self) -> Iterator[Chunk]:
        """The synchronised chunks, benign behaviours and faults applied (what `__iter__` batches)."""
        scn = self.scenario
        physics = CleanPhysics(scn)
        wanted = {lab.first_step for lab in scn.labels}
        index = 0
        for seg in scn.segments:
            ranges = physics.chunk_ranges(seg.first, seg.last)
            for j, (first, last) in enumerate(ranges):
                ch = physics.draw(index, first, last, seg.first, seg.incarnation)
                index += 1
                if j == 0 and seg.incarnation > 0:
                    ch.session_start_ts = scn.start_ts + physics.t_ms / 1000.0
                for f in scn.faults:
                    fault_effects.apply(f, ch, scn)
                for b in scn.benign:  # after the faults: a stall on a slow loader's rank adds, not multiplies
                    benign_effects.apply(b, ch, scn)
                physics.finish_memory(ch)
                physics.sync(ch)
                assert ch.end_ts is not None
                med = np.median(ch.end_ts, axis=1)
                self.step_ts[ch.steps] = med
                for s in wanted:
                    if first <= s <= last:
                        self._onsets[s] = float(med[s - first])
                if last == scn.last_step and scn.hang is not None:
                    self._onsets[-1] = float(ch.end_ts[-1].max())  # the last progress anyone made
                if j == len(ranges) - 1 and seg.kill is not None:
                    # Killed during the next step; the new processes start gap_s later.
                    rng = np.random.default_rng([scn.seed, STREAM_RESUME, seg.incarnation])
                    ch.kill_ts = (
                        float(ch.end_ts[-1].max()) + float(rng.uniform(0.1, 0.9)) * scn.step_ms / 1000.0
                    )
                    physics.restart((ch.kill_ts + seg.kill.gap_s - scn.start_ts) * 1000.0)
                yield ch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        scn = self.scenario
        batcher = Batcher(scn)
        heap: list[tuple[float, int, int, dict[str, Any]]] = []
        tie = 0
        last_incarnation = len(scn.segments) - 1
        for ch in self.chunks():
            final = int(ch.steps[-1]) == scn.last_step and ch.incarnation == last_incarnation
            for ts, rank, batch in batcher.emit(ch, final=final):
                heapq.heappush(heap, (ts, rank, tie, batch))
                tie += 1
            assert ch.end_ts is not None
            # After a kill nothing is sent until the new sessions start: release everything.
            watermark = float("inf") if final or ch.kill_ts is not None else float(ch.end_ts[-1].min())
            while heap and heap[0][0] <= watermark:
                self.batches_sent += 1
                yield heapq.heappop(heap)[3]
            self.max_pending = max(self.max_pending, len(heap))


def generate(scenario: Scenario) -> Iterator[dict[str, Any]]:
    """Schema-1 batch dicts of every rank, in the order a collector would receive them."""
    return iter(Simulation(scenario))
