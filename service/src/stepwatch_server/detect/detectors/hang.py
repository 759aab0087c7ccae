"""`hang`: the run stopped completing steps, outside a known pause; blames the rank that is behind.

Why it matters: synchronous training waits for every rank in each collective. One rank stuck in its
data loader, deadlocked, or dead leaves every other rank blocked in the all-reduce: GPUs at 100%
"utilisation" doing nothing, until the NCCL watchdog kills the job (default 10-30 min) or forever.
The sooner someone looks at the one rank that did not arrive, the less of the allocation is lost.

Signal (event time only): the run's progress is the highest last completed step any rank reported
(`ctx.last_step`). The stall is the event time (`ctx.event_now()`: heartbeats keep arriving from the
waiting ranks' sender threads, so event time moves on while the steps do not) since that progress
was made, or since a known pause was last seen (any rank inside `watch.phase(...)`: eval and
checkpoints are not hangs; a pause that lasts longer than `max_pause_s` stops excusing the stall).
A stall beyond max(`floor_s`, `step_factor` x the run's typical step time) is a hang. Before the
run has a typical step time (the first steps compile and autotune) the threshold is `startup_s`.

Blame (the physics of a collective): the waiters completed the previous step and sit in the
collective (phase `backward` in DDP); the culprit is, in this order, a rank whose heartbeats stopped
while the others' still arrive (dead), the rank(s) whose last completed step is lowest when not all
are equal, or the rank(s) whose heartbeat phase differs from the majority's (stuck in `data` or
`forward`). A culprit whose heartbeats still arrive is "stuck"; one whose last contact lags the
others' by more than `dead_after_s` is "dead". Many culprits (more than `max_culprit_fraction` of
the ranks) blame nobody: the whole run is waiting.

Evidence: `stalled_s`, `threshold_s`, `last_step` (the run's), `culprits` (up to 16), `mode`
(stuck / dead / unknown), `culprit_phase`, `majority_phase`, `culprit_last_step`,
`heartbeat_lag_s` (how far the culprit's last contact is behind the newest event time),
`typical_step_ms`.

Defaults: the issue asks for detection within max(30 s, 5x the median step time) of the last
progress. Reports travel at the agent's flush/heartbeat cadence (2 s / 5 s), so the threshold sits
below that deadline: `floor_s` 25 s and `step_factor` 4 leave 5 s (or one step time) for the report
to arrive. 4x is still above the benign slow steps of a healthy run (GC and storage blips of 1.5-4
step times; larger one-off slow iterations, such as the 8x ones in the Megatron DeepSeek-V3 log,
open a warning that resolves on the next completed step). `dead_after_s` 15 s is three heartbeat
intervals. Warning when raised; critical once the stall reaches `critical_factor` x the threshold
or the culprit is dead. Resolved as soon as any rank completes a new step.

"Nothing has arrived at all" (no batch from any rank for `silent_after_s` of wall-clock time) is the
one wall-clock condition: event time cannot move when nobody sends. It is a run-level warning naming
when the last data came; the next batch resolves it. Known blind spot: a run that finished without
a pause marker looks the same (the agent sends no end-of-run marker).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from stepwatch_server.detect.base import Detector, DetectorSettings
from stepwatch_server.detect.context import RunContext

KIND = "hang"
RUN_KEY = "run"
SILENT_KEY = "silent"
MAX_LISTED = 16  # culprit ranks listed in evidence
UPDATE_EVERY_S = 10.0  # event-time spacing of evidence updates while a hang stays open


@dataclass(frozen=True)
class HangSettings(DetectorSettings):
    floor_s: float = 25.0  # smallest stall that is a hang (event seconds since the last progress)
    step_factor: float = 4.0  # ... or this many typical step times, whichever is longer
    startup_s: float = 300.0  # threshold before the run has a typical step time (compile, autotune)
    dead_after_s: float = 15.0  # a rank whose last contact lags the others' by this much is dead
    max_pause_s: float = 3600.0  # a marked pause longer than this no longer excuses a stall
    critical_factor: float = 3.0  # stall >= this x threshold: critical
    max_culprit_fraction: float = 0.5  # more culprits than this share: blame nobody
    silent_after_s: float = 300.0  # wall-clock seconds with no batch at all: the run went silent


class HangDetector(Detector):
    kind: ClassVar[str] = KIND
    Settings: ClassVar[type[DetectorSettings]] = HangSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        super().__init__(ctx, settings)
        assert isinstance(settings, HangSettings)
        self.s: HangSettings = settings
        self._progress_step = -1  # the run's highest completed step
        self._progress_ts = float("nan")  # its event time
        self._pause_seen_ts = float("nan")  # newest event time at which a rank was inside a pause
        self._pause_since_ts = float("nan")  # start of the current (continuous) pause
        self._last_update_ts = float("nan")

    def on_tick(self, event_now: float, wall_now: float) -> None:
        ctx = self.ctx
        if ctx.finished():  # every rank closed its session (watch.close / exit): nothing is stuck
            step = int(ctx.last_step.max())
            for key in (RUN_KEY, SILENT_KEY):
                if ctx.book.is_open(KIND, key):
                    ctx.book.resolve(KIND, key, step=step, ts=event_now, note="the run finished")
            return
        self._check_silent(wall_now)
        if not np.isfinite(event_now) or not ctx.seen.any():
            return
        top = int(ctx.last_step.max())
        if top != self._progress_step:  # any change is progress (a resumed run goes back)
            self._progress_step = top
            ts = float(np.nanmax(ctx.last_step_ts)) if np.isfinite(ctx.last_step_ts).any() else event_now
            self._progress_ts = min(ts, event_now)
            if ctx.book.is_open(KIND, RUN_KEY):
                ctx.book.resolve(KIND, RUN_KEY, step=top, ts=event_now, note="steps advance again")
        if top < 0:
            return
        if ctx.n_paused:
            if not np.isfinite(self._pause_since_ts):
                self._pause_since_ts = event_now
            if event_now - self._pause_since_ts <= self.s.max_pause_s:
                self._pause_seen_ts = event_now
        else:
            self._pause_since_ts = float("nan")
        since = self._progress_ts  # the later of the progress and the last pause seen (NaN: none)
        if self._pause_seen_ts > since or since != since:
            since = self._pause_seen_ts
        stalled_s = event_now - since
        if stalled_s <= self.s.floor_s:  # the common case: no need for the typical step time
            return
        threshold_s = self.threshold_s()
        if stalled_s > threshold_s:
            self._raise(event_now, stalled_s, threshold_s)

    def threshold_s(self) -> float:
        typical_ms = self.ctx.typical_step_ms()
        if not np.isfinite(typical_ms):
            return max(self.s.floor_s, self.s.startup_s)
        return max(self.s.floor_s, self.s.step_factor * typical_ms / 1000.0)

    # -- blame ---------------------------------------------------------------------------------------
    def _blame(self, event_now: float) -> tuple[np.ndarray, str, dict[str, Any]]:
        """The culprit ranks, why, and the numbers behind it."""
        ctx = self.ctx
        seen = ctx.seen
        contact = np.fmax(ctx.heartbeat_ts, ctx.last_step_ts)
        fresh = float(np.nanmedian(contact[seen])) if np.isfinite(contact[seen]).any() else event_now
        lag = fresh - contact
        dead = seen & (np.nan_to_num(lag, nan=np.inf) > self.s.dead_after_s)
        progress = np.maximum(ctx.last_step, ctx.heartbeat_step)
        behind = seen & (progress < progress[seen].max())
        phases = [ctx.heartbeat_phase[r] if seen[r] else None for r in range(ctx.world_size)]
        counts = Counter(p for p in phases if p is not None)
        majority = counts.most_common(1)[0][0] if counts else None
        odd = np.array([p is not None and p != majority for p in phases], dtype=bool)
        info: dict[str, Any] = {"majority_phase": majority}
        limit = self.s.max_culprit_fraction * int(seen.sum())
        for reason, mask in (("dead", dead), ("behind", behind), ("phase", odd)):
            n = int(mask.sum())
            if 0 < n <= limit:
                return np.flatnonzero(mask), reason, info
        return np.zeros(0, dtype=np.int64), "none", info

    def _raise(self, event_now: float, stalled_s: float, threshold_s: float) -> None:
        ctx, book = self.ctx, self.ctx.book
        existing = book.get(KIND, RUN_KEY)
        if existing is not None and event_now - self._last_update_ts < UPDATE_EVERY_S:
            return
        self._last_update_ts = event_now
        culprits, reason, info = self._blame(event_now)
        contact = np.fmax(ctx.heartbeat_ts, ctx.last_step_ts)
        newest = float(np.nanmax(contact)) if np.isfinite(contact).any() else event_now
        evidence: dict[str, Any] = {
            "stalled_s": round(float(stalled_s), 1),
            "threshold_s": round(float(threshold_s), 1),
            "last_step": self._progress_step,
            "typical_step_ms": _num(ctx.typical_step_ms()),
            "culprits": [int(r) for r in culprits[:MAX_LISTED]],
            "n_culprits": int(culprits.size),
            "blamed_by": reason,
            **info,
        }
        rank: int | None = None
        node: str | None = None
        mode = "unknown"
        if culprits.size:
            rank = int(culprits[0])
            nodes = {ctx.node[int(r)] for r in culprits}
            node = ctx.node[rank] if len(nodes) == 1 else None
            lag_s = newest - float(contact[rank]) if np.isfinite(contact[rank]) else float("inf")
            mode = "dead" if lag_s > self.s.dead_after_s else "stuck"
            evidence.update(
                culprit_phase=ctx.heartbeat_phase[rank],
                culprit_last_step=int(max(ctx.last_step[rank], ctx.heartbeat_step[rank])),
                heartbeat_lag_s=_num(lag_s),
            )
            more = f" (+{culprits.size - 1} more)" if culprits.size > 1 else ""
            if mode == "dead":
                what = f"heartbeats stopped {lag_s:.0f} s before the others'"
            else:
                what = f"still sending heartbeats, stuck in {ctx.heartbeat_phase[rank] or 'an unknown phase'}"
            summary = (
                f"{ctx.where(rank)}{more} {mode}: no step completed for {stalled_s:.0f} s after step "
                f"{self._progress_step} (threshold {threshold_s:.0f} s); {what}; the other ranks wait "
                f"in {info['majority_phase'] or 'the collective'}"
            )
        else:
            summary = (
                f"run hung: no step completed for {stalled_s:.0f} s after step {self._progress_step} "
                f"(threshold {threshold_s:.0f} s); no single rank is behind, all wait in "
                f"{info['majority_phase'] or 'an unknown phase'}"
            )
        evidence["mode"] = mode
        critical = mode == "dead" or stalled_s >= self.s.critical_factor * threshold_s
        book.raise_(
            KIND,
            RUN_KEY,
            step=self._progress_step,
            ts=event_now,
            severity="critical" if critical else "warning",
            summary=summary,
            evidence=evidence,
            rank=rank,
            node=node,
            first_step=self._progress_step + 1,
            first_ts=self._progress_ts,
        )

    # -- wall clock: nothing arrives at all -----------------------------------------------------------
    def _check_silent(self, wall_now: float) -> None:
        ctx, book = self.ctx, self.ctx.book
        last = ctx.last_arrival_wall
        if not np.isfinite(last):
            return
        silent_s = wall_now - last
        step = max(self._progress_step, 0)
        if silent_s > self.s.silent_after_s:
            if not book.is_open(KIND, SILENT_KEY):
                when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(last))
                book.raise_(
                    KIND,
                    SILENT_KEY,
                    step=step,
                    ts=float(np.nanmax([ctx.event_now(), 0.0])),
                    severity="warning",
                    summary=(
                        f"run silent: nothing from any of its {ctx.world_size} ranks since {when} "
                        f"({silent_s:.0f} s), last step {self._progress_step}"
                    ),
                    evidence={"silent_s": round(silent_s, 1), "last_arrival_wall": last, "last_step": step},
                )
        elif book.is_open(KIND, SILENT_KEY):
            book.resolve(KIND, SILENT_KEY, step=step, ts=ctx.event_now(), note="data arrives again")


def _num(x: float) -> float | None:
    return round(float(x), 3) if np.isfinite(x) else None
