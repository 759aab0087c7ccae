"""The detection engine: batches in, changed anomalies out. Streaming, per run, event-time driven.

One `RunDetection` per run holds the run's aligner, context and detectors. The engine is not
thread-safe: one worker owns it (detect/worker.py), which is what makes every run's state live in
exactly one place; scale-out partitions runs across workers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stepwatch_server.detect.anomalies import Anomaly
from stepwatch_server.detect.base import Detector
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.detectors._slowness import RankSlowness, run_slowness_settings
from stepwatch_server.detect.frames import Aligner, StepFrame
from stepwatch_server.detect.registry import DETECTORS
from stepwatch_server.ingest.schema import Batch

log = logging.getLogger(__name__)

ALIGN_GRACE_S = 30.0  # event-time wait for a rank's report of a step before the frame goes without it
MAX_RUNS = 1000  # runs with live detection state; the least recently active one is dropped beyond it


@dataclass(frozen=True)
class EngineSettings:
    """`overrides` maps a detector kind to {setting: value}, e.g. {"straggler": {"window_steps": 40}}."""

    align_grace_s: float = ALIGN_GRACE_S
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    kinds: tuple[str, ...] | None = None  # None: every registered detector

    def settings_for(self, cls: type[Detector]) -> Any:
        try:
            return dataclasses.replace(cls.Settings(), **self.overrides.get(cls.kind, {}))
        except TypeError as exc:
            raise ValueError(f"detection setting for {cls.kind!r}: {exc}") from None


class RunDetection:
    run_id: int | None = None  # the database's id of the run, once a batch said it (class default: a
    # snapshot pickled before the attribute existed unpickles with it)

    def __init__(
        self, run: str, world_size: int, settings: EngineSettings, ctx: RunContext | None = None
    ) -> None:
        if ctx is not None and ctx.world_size == world_size:
            self.ctx = ctx
        else:  # rows are added as ranks are heard from, never allocated for the declared world size
            self.ctx = RunContext(run, world_size, ranks=())
            if ctx is not None:  # world size changed: keep the anomalies
                self.ctx.book = ctx.book
        self.aligner = Aligner(run, world_size, settings.align_grace_s, rows=self._rows)
        classes = [c for c in DETECTORS if settings.kinds is None or c.kind in settings.kinds]
        chosen = {cls.kind: settings.settings_for(cls) for cls in classes}
        # Slowness is computed once per frame for straggler and slow_node together, with one set of
        # settings, so that the two split a slow node from its ranks the same way whatever each says.
        self.slowness: RankSlowness | None = None
        if {"straggler", "slow_node"} & set(chosen):
            shared, _ = run_slowness_settings(chosen, settings.overrides)
            self.slowness = self.ctx.slowness = RankSlowness(self.ctx, shared)
            self.slowness.node_reporting = "slow_node" in chosen
        self.detectors: list[Detector] = [cls(self.ctx, chosen[cls.kind]) for cls in classes]
        # Ticked after every batch: only the detectors that watch time passing (the others' on_tick is
        # the base class's no-op).
        self.tickers = [d for d in self.detectors if type(d).on_tick is not Detector.on_tick]
        self._broken: set[str] = set()

    def _rows(self) -> np.ndarray:
        """The run's rows (a method, not a lambda: a run's state pickles whole for the bus's snapshots)."""
        return self.ctx.ranks

    def feed(self, batch: Batch, wall_now: float) -> None:
        self.ctx.update(batch, wall_now)
        for frame in self.aligner.add(batch):
            self.on_frame(frame)
        self.tick(wall_now)

    def on_frame(self, frame: StepFrame) -> None:
        step_ms = frame.metrics.get("time.step_ms")
        if step_ms is not None and np.isfinite(step_ms).any():
            self.ctx.record_step_time(float(np.nanmedian(step_ms)))
        if self.slowness is not None:
            self.slowness.update(frame)
        for detector in self.detectors:
            self._guarded(detector, "on_frame", frame)

    def tick(self, wall_now: float) -> None:
        event_now = self.ctx.event_now()
        for detector in self.tickers:
            self._guarded(detector, "on_tick", event_now, wall_now)

    def _guarded(self, detector: Detector, method: str, *args: Any) -> None:
        if detector.kind in self._broken:
            return
        try:
            getattr(detector, method)(*args)
        except Exception:
            self._broken.add(detector.kind)
            log.exception("detector %s failed on run %r; it is off for this run", detector.kind, self.ctx.run)


class DetectionEngine:
    def __init__(self, settings: EngineSettings | None = None) -> None:
        self.settings = settings or EngineSettings()
        chosen = {}
        for cls in DETECTORS:  # fail at start on a bad override, not on the first batch
            chosen[cls.kind] = self.settings.settings_for(cls)
        _, conflicts = run_slowness_settings(chosen, self.settings.overrides)
        for line in conflicts:
            log.warning("straggler and slow_node share one slowness computation; %s", line)
        self.runs: OrderedDict[str, RunDetection] = OrderedDict()

    def feed(
        self, batch: Batch, wall_now: float | None = None, run_id: int | None = None, new_run: bool = False
    ) -> list[Anomaly]:
        """Process one stored batch; returns the anomalies it opened, updated or resolved. `run_id` is the
        database's id of the run the batch was stored in, `new_run` whether storing it created the run: a
        run known here by its name that the batch created, or that has another id now, was deleted and its
        name used again, so its detection starts afresh (SQLite may give the new run the old id)."""
        now = time.time() if wall_now is None else wall_now
        rd = self.runs.get(batch.run)
        if rd is not None and (new_run or (None not in (run_id, rd.run_id) and rd.run_id != run_id)):
            log.info("detection: run %r was deleted and sends again; its detection starts afresh", batch.run)
            rd = None
        if rd is None or rd.ctx.world_size != batch.world_size:
            rd = RunDetection(batch.run, batch.world_size, self.settings, rd.ctx if rd else None)
            self.runs[batch.run] = rd
            while len(self.runs) > MAX_RUNS:
                self.runs.popitem(last=False)
        self.runs.move_to_end(batch.run)
        if run_id is not None:
            rd.run_id = run_id
        rd.feed(batch, now)
        return rd.ctx.book.drain_changes()

    def forget(self, runs: list[str]) -> None:
        """Drop the state of `runs` (no longer in the database: deleted)."""
        for run in runs:
            self.runs.pop(run, None)

    def adopt(self, run: str, world_size: int, anomalies: list[Anomaly]) -> None:
        """Continue a run's open anomalies stored by an earlier process (see `AnomalyBook.adopt`)."""
        rd = self.runs.get(run)
        if rd is None:
            rd = self.runs[run] = RunDetection(run, world_size, self.settings)
            while len(self.runs) > MAX_RUNS:
                self.runs.popitem(last=False)
        rd.ctx.book.adopt(anomalies)

    def tick(self, wall_now: float | None = None) -> list[Anomaly]:
        """Time passing with no batch (hangs, silent runs)."""
        now = time.time() if wall_now is None else wall_now
        changed: list[Anomaly] = []
        for rd in self.runs.values():
            if not rd.ctx.seen.any():  # adopted at start, nothing received since: no clock to tick
                continue
            rd.tick(now)
            changed += rd.ctx.book.drain_changes()
        return changed

    def open_anomalies(self, run: str | None = None) -> list[Anomaly]:
        runs = [self.runs[run]] if run is not None and run in self.runs else list(self.runs.values())
        return [a for rd in runs for a in rd.ctx.book.open.values()]
