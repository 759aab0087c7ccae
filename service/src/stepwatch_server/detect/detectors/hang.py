"""`hang`: the run stopped completing steps outside a pause; blames the rank that is behind.

Why it matters: synchronous training waits for every rank in each collective. One rank stuck in its
data loader, deadlocked, or dead leaves every other rank blocked in the all-reduce: GPUs at 100%
"utilisation" doing nothing, until the NCCL watchdog kills the job (default 10-30 min) or forever.
The sooner someone looks at the one rank that did not arrive, the less of the allocation is lost.

Signal (event time only): the run's progress is the highest last completed step any rank reported,
in a step record or in a heartbeat (`ctx.completed()`: a heartbeat can say a step completed before its
record arrives, as at the end of a pause). The stall is the event time (`ctx.event_now()`: heartbeats keep arriving from the
waiting ranks' sender threads, so event time moves on while the steps do not) since the latest of: that
progress; the first message of a restarted agent session (`ctx.restart_ts`: a resumed run's ranks were
silent before their new sessions, and that gap is not a stall); and the last time a pause was seen. A
pause is marked (any rank inside `watch.phase(...)`) or recognised (rule 3 below); one that lasts longer
than `max_pause_s` stops excusing the stall. A stall beyond max(`floor_s`, `step_factor` x the run's
typical step time) is judged. Before the run has a typical step time (the first steps compile and
autotune), and after a restart until a step completes (loading the checkpoint, compiling again), the
threshold is max(`floor_s`, `startup_s`).

Judging a stall, in this order:
1. Blame (the physics of a collective): the waiters completed the previous step and sit in the
   collective; the culprit is a rank whose heartbeats stopped while the others' still arrive (dead),
   else the rank(s) whose last completed step is lowest when not all are equal, else the rank(s) whose
   heartbeat phase differs from the majority's (stuck in `data` or `forward` while the others wait in
   `backward`), else the rank(s) not in a collective while the others wait in one (their heartbeat
   stacks, detect/activity.py). More culprits than `max_culprit_fraction` of the ranks blame nobody.
2. A dead culprit (its last contact lags the others' by more than `dead_after_s`) is a hang.
3. A recognised unmarked pause is not a hang: the culprits, or when there are none every alive rank
   that is not waiting in a collective (and no rank is dead), are all busy in `eval` (no-grad forwards
   advancing) or `checkpoint` (a save call on the stack), within `busy_recent_s`, and their heartbeats
   arrive. Like a marked
   pause, the stall clock restarts from the moment it was recognised, for up to `max_pause_s` since the
   stall began; beyond that it is a hang again (evidence `unmarked_pause_s`). Rank 0 saving a
   checkpoint while the others wait for it in `barrier` (or in the next step's all-reduce) is such a
   pause: the ranks the others wait for are busy in a checkpoint.
4. Every rank stalled together (no culprit, none dead, all with the same last step and phase, nothing
   recognised: an unmarked pause the agent cannot see, such as a CPU-side evaluation that does not call
   the watched model, or a run restarted without new sessions) is at most a warning, never critical,
   with mode `together`. When such a stall between steps ends, the ranks whose last heartbeat came
   before its end still say `data` while those that went on say `forward`: for one threshold after the
   last look that saw them together, nothing else is judged (a rank still behind then is a hang).
5. Anything else is a hang: warning when raised; critical once the stall reaches `critical_factor` x the
   threshold or the culprit is dead. A culprit whose heartbeats still arrive is "stuck".
One anomaly per run (key `run`), resolved as soon as any rank completes a new step, or when a later look
recognises the stall as an unmarked pause.

Evidence: `stalled_s`, `threshold_s`, `last_step` (the run's), `culprits` (up to 16), `n_culprits`,
`blamed_by` (dead / behind / phase / collective / none), `mode` (stuck / dead / together / unknown),
`culprit_phase`, `majority_phase`, `culprit_last_step`, `heartbeat_lag_s` (how far the culprit's last
contact is behind the newest event time), `culprit_activity`, `culprit_stack` (its innermost frames),
`activity` (ranks per activity), `unmarked_pause_s` (a recognised pause beyond `max_pause_s`),
`typical_step_ms`.

Defaults: the issue asks for detection within max(30 s, 5x the median step time) of the last
progress, and one rank waiting that long for a slow shard read is not yet a hang: a stalled step of
up to ~27 s (a data stall of the deadline less a few steps) must not be one. Event time moves with
the waiting ranks' heartbeats (every 5 s each, staggered across ranks: ~1 s apart with 4 ranks), so
`floor_s` 28 s is passed, and the report sent, by ~29-30 s; `step_factor` 4 leaves one step time below
the 5x deadline. 4x is still above the benign slow steps of a healthy run (GC and storage blips of 1.5-4
step times; larger one-off slow iterations, such as the 8x ones in the Megatron DeepSeek-V3 log,
open a `together` warning that resolves on the next completed step). `dead_after_s` 15 s is three
heartbeat intervals; `busy_recent_s` too: no-grad forwards that last advanced, or a save call last seen,
longer ago than that are a pause that ended (and a few seconds after its end, before the next steps'
records arrive, still excuse the stall).

"Nothing has arrived at all" (no batch from any rank for `silent_after_s` of wall-clock time) is the
one wall-clock condition: event time cannot move when nobody sends. It is a run-level warning naming
when the last data came; the next batch resolves it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from stepwatch_server.detect import activity
from stepwatch_server.detect.base import Detector, DetectorSettings
from stepwatch_server.detect.context import RunContext

KIND = "hang"
STEP_ORDER = {"data": 0, "forward": 1, "backward": 2, "optimizer": 3}  # a step's phases, in order
RUN_KEY = "run"
SILENT_KEY = "silent"
MAX_LISTED = 16  # culprit ranks listed in evidence
MAX_STACK_LISTED = 4  # innermost frames of the culprit's stack in evidence
UPDATE_EVERY_S = 10.0  # event-time spacing of evidence updates while a hang stays open


@dataclass(frozen=True)
class HangSettings(DetectorSettings):
    floor_s: float = 28.0  # smallest stall that is a hang (event seconds since the last progress)
    step_factor: float = 4.0  # ... or this many typical step times, whichever is longer
    startup_s: float = 300.0  # threshold before the run has a typical step time, and after a restart
    dead_after_s: float = 15.0  # a rank whose last contact lags the others' by this much is dead
    max_pause_s: float = 3600.0  # a marked or recognised pause longer than this no longer excuses a stall
    critical_factor: float = 3.0  # stall >= this x threshold: critical (never for mode "together")
    max_culprit_fraction: float = 0.5  # more culprits than this share: blame nobody
    busy_recent_s: float = 15.0  # no-grad forwards advanced, or a save call seen, this recently: busy
    # Every rank stalled together BETWEEN steps (phase data, nobody in a collective), with nothing that
    # says why (an agent that does not report its activity): an unmarked eval or checkpoint is by far the
    # likeliest cause, and they rarely last longer than this. Inside a step (all in backward) the
    # threshold is the usual one.
    together_idle_s: float = 600.0
    silent_after_s: float = 300.0  # wall-clock seconds with no batch at all: the run went silent


@dataclass(frozen=True)
class Look:
    """One look at a stall: whom to blame and what every rank is doing (detect/activity.py codes)."""

    culprits: np.ndarray
    reason: str  # dead / behind / phase / collective / none
    majority_phase: str | None
    dead: np.ndarray  # per rank
    alive: np.ndarray  # seen and not dead
    activity: np.ndarray  # per rank: activity.EVAL, CHECKPOINT, COLLECTIVE or NONE
    together: bool  # no culprit, none dead, one last step for every rank


class HangDetector(Detector):
    kind: ClassVar[str] = KIND
    Settings: ClassVar[type[DetectorSettings]] = HangSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        super().__init__(ctx, settings)
        assert isinstance(settings, HangSettings)
        self.s: HangSettings = settings
        self._progress_step = -1  # the run's highest completed step
        self._progress_ts = float("nan")  # its event time
        self._pause_seen_ts = float("nan")  # newest event time at which a rank was inside a marked pause
        self._pause_since_ts = float("nan")  # start of the current (continuous) marked pause
        self._busy_seen_ts = float("nan")  # newest event time a stall was recognised as an unmarked pause
        self._busy_since_ts = float("nan")  # start of the stall that is recognised as one
        self._together_seen_ts = float("nan")  # newest look at every rank between steps, together
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
        completed, completed_ts = ctx.completed()
        top = int(completed.max())
        if top != self._progress_step:  # any change is progress (a resumed run goes back)
            self._progress_step = top
            ts = float(np.nanmax(completed_ts)) if np.isfinite(completed_ts).any() else event_now
            self._progress_ts = min(ts, event_now)
            self._busy_since_ts = float("nan")
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
        stalled_s = event_now - _later(self._stall_start(), self._busy_seen_ts)
        if stalled_s <= self.s.floor_s:  # the common case: no need for the typical step time
            return
        threshold_s = self.threshold_s()
        if stalled_s > threshold_s:
            self._judge(event_now, stalled_s, threshold_s)

    def _stall_start(self) -> float:
        """The latest of the progress, a restart and a marked pause seen (NaN-safe)."""
        return _later(_later(self._progress_ts, self.ctx.restart_ts), self._pause_seen_ts)

    def threshold_s(self) -> float:
        typical_ms = self.ctx.typical_step_ms()
        restarted = bool(self.ctx.restart_ts > self._progress_ts)  # no step since the restart yet
        if not np.isfinite(typical_ms) or restarted:
            return max(self.s.floor_s, self.s.startup_s)
        return max(self.s.floor_s, self.s.step_factor * typical_ms / 1000.0)

    # -- judging a stall ---------------------------------------------------------------------------
    def _judge(self, event_now: float, stalled_s: float, threshold_s: float) -> None:
        book = self.ctx.book
        existing = book.get(KIND, RUN_KEY)
        if existing is not None and event_now - self._last_update_ts < UPDATE_EVERY_S:
            return
        look = self.look(event_now)
        if look.together and self._between_steps(look):
            self._together_seen_ts = event_now
            if stalled_s < self.s.together_idle_s:
                return
        elif event_now - self._together_seen_ts < threshold_s:
            # Every rank was just paused together between steps: the pause is ending, and the ranks whose
            # last heartbeat came before its end still say `data` while those that went on say `forward`.
            # A rank that is still behind one threshold after the others went on is judged then.
            return
        busy = None if look.reason == "dead" else self._busy(look)
        pause_s: float | None = None
        if busy is not None:
            start = self._stall_start()
            if not self._busy_since_ts >= start:  # NaN, or an earlier stall's
                self._busy_since_ts = start
            pause_s = event_now - self._busy_since_ts
            if pause_s <= self.s.max_pause_s:
                self._busy_seen_ts = event_now  # like a marked pause: the stall clock restarts
                if existing is not None:
                    kinds = sorted({activity.NAMES[int(c)] or "?" for c in look.activity[busy]})
                    note = f"recognised as an unmarked {' and '.join(kinds)} ({_ranks(self.ctx.ranks[busy])})"
                    book.resolve(KIND, RUN_KEY, step=self._progress_step, ts=event_now, note=note)
                return
        self._last_update_ts = event_now
        self._raise(event_now, stalled_s, threshold_s, look, busy, pause_s)

    def _between_steps(self, look: Look) -> bool:
        """Every alive rank is between two steps (phase `data`, or none reported) and none waits in a
        collective: nobody is inside a step's collectives waiting for somebody."""
        return look.majority_phase in ("data", None) and not bool(
            (look.activity[look.alive] == activity.COLLECTIVE).any()
        )

    def look(self, event_now: float) -> Look:
        """Blame (dead, behind, odd phase, outside the collective) and every rank's activity."""
        ctx, s = self.ctx, self.s
        seen = ctx.seen
        contact = np.fmax(ctx.heartbeat_ts, ctx.last_step_ts)
        fresh = float(np.nanmedian(contact[seen])) if np.isfinite(contact[seen]).any() else event_now
        lag = fresh - contact
        dead = seen & (np.nan_to_num(lag, nan=np.inf) > s.dead_after_s)
        alive = seen & ~dead
        progress = ctx.completed()[0]
        behind = seen & (progress < progress[seen].max())
        phases = [ctx.heartbeat_phase[r] if seen[r] else None for r in range(ctx.n_ranks)]
        counts = Counter(p for p in phases if p is not None)
        majority = counts.most_common(1)[0][0] if counts else None
        # A rank in another phase than the majority is behind them, unless its phase comes LATER in the
        # step (it went on into forward or backward and waits there for the others, who are still
        # between steps): being ahead blames nobody.
        at = STEP_ORDER.get(majority, -1) if majority is not None else -1
        odd = np.array(
            [
                p is not None and p != majority and not (at >= 0 and STEP_ORDER.get(p, -1) > at)
                for p in phases
            ],
            dtype=bool,
        )
        doing = activity.rank_activity(
            ctx.nograd_forwards,
            ctx.nograd_at_step,
            ctx.nograd_moved_ts,
            ctx.checkpoint_seen_ts,
            ctx.stack_activity,
            event_now,
            s.busy_recent_s,
        )
        waiting = alive & (doing == activity.COLLECTIVE)
        outside = alive & ~waiting if waiting.any() else np.zeros_like(alive)
        limit = s.max_culprit_fraction * int(seen.sum())
        for reason, mask in (("dead", dead), ("behind", behind), ("phase", odd), ("collective", outside)):
            n = int(mask.sum())
            if 0 < n <= limit:
                return Look(np.flatnonzero(mask), reason, majority, dead, alive, doing, False)
        together = not dead.any() and bool((progress[seen] == progress[seen].max()).all())
        return Look(np.zeros(0, dtype=np.int64), "none", majority, dead, alive, doing, together)

    def _busy(self, look: Look) -> np.ndarray | None:
        """The ranks whose eval or checkpoint excuses the stall (rule 3), or None."""
        busy = np.isin(look.activity, activity.BUSY) & look.alive
        if look.culprits.size:
            return look.culprits if bool(busy[look.culprits].all()) else None
        if look.dead.any():
            return None
        candidates = look.alive & (look.activity != activity.COLLECTIVE)
        return np.flatnonzero(candidates) if candidates.any() and bool(busy[candidates].all()) else None

    def _raise(
        self,
        event_now: float,
        stalled_s: float,
        threshold_s: float,
        look: Look,
        busy: np.ndarray | None,
        pause_s: float | None,
    ) -> None:
        ctx, book, s = self.ctx, self.ctx.book, self.s
        culprits = look.culprits
        contact = np.fmax(ctx.heartbeat_ts, ctx.last_step_ts)
        newest = float(np.nanmax(contact)) if np.isfinite(contact).any() else event_now
        doing = Counter(activity.NAMES[int(c)] for c in look.activity[ctx.seen])
        evidence: dict[str, Any] = {
            "stalled_s": round(float(stalled_s), 1),
            "threshold_s": round(float(threshold_s), 1),
            "last_step": self._progress_step,
            "typical_step_ms": _num(ctx.typical_step_ms()),
            "culprits": ctx.ranks[culprits[:MAX_LISTED]].tolist(),
            "n_culprits": int(culprits.size),
            "blamed_by": look.reason,
            "majority_phase": look.majority_phase,
            "activity": {name: n for name, n in sorted(doing.items(), key=str) if name is not None},
        }
        exceeded = ""
        if busy is not None and pause_s is not None:
            evidence["unmarked_pause_s"] = round(pause_s, 1)
            kinds = " and ".join(sorted({activity.NAMES[int(c)] or "?" for c in look.activity[busy]}))
            exceeded = (
                f"busy in an unmarked {kinds} for {pause_s:.0f} s, longer than max_pause_s "
                f"({s.max_pause_s:.0f} s)"
            )
        waiting_in = self._waiting_in(look)
        rank: int | None = None
        node: str | None = None
        mode = "unknown"
        if culprits.size:
            rank = int(culprits[0])
            nodes = {ctx.node[int(r)] for r in culprits}
            node = ctx.node[rank] if len(nodes) == 1 else None
            lag_s = newest - float(contact[rank]) if np.isfinite(contact[rank]) else float("inf")
            mode = "dead" if lag_s > s.dead_after_s else "stuck"
            stack = ctx.stack[rank]
            evidence.update(
                culprit_phase=ctx.heartbeat_phase[rank],
                culprit_last_step=int(ctx.completed()[0][rank]),
                heartbeat_lag_s=_num(lag_s),
                culprit_activity=activity.NAMES[int(look.activity[rank])],
                culprit_stack=list(stack[:MAX_STACK_LISTED]),
            )
            more = f" (+{culprits.size - 1} more)" if culprits.size > 1 else ""
            if mode == "dead":
                what = f"heartbeats stopped {lag_s:.0f} s before the others'"
            elif exceeded:
                what = f"still sending heartbeats, {exceeded}"
            else:
                where = f" at {stack[0]}" if stack else ""
                what = f"still sending heartbeats, stuck in {ctx.heartbeat_phase[rank] or 'an unknown phase'}{where}"
            summary = (
                f"{ctx.where(rank)}{more} {mode}: no step completed for {stalled_s:.0f} s after step "
                f"{self._progress_step} (threshold {threshold_s:.0f} s); {what}; the other ranks wait "
                f"in {waiting_in or look.majority_phase or 'the collective'}"
            )
        elif busy is not None and exceeded:
            summary = (
                f"run stalled: no step completed for {stalled_s:.0f} s after step {self._progress_step} "
                f"(threshold {threshold_s:.0f} s); {_ranks(ctx.ranks[busy])} {exceeded}"
            )
        elif look.together:
            mode = "together"
            n = int(ctx.seen.sum())
            all_in = (
                f"; all wait in {waiting_in}"
                if waiting_in and doing[activity.NAMES[activity.COLLECTIVE]] == n
                else ""
            )
            summary = (
                f"every rank ({n}) stalled together after step {self._progress_step} for {stalled_s:.0f} s "
                f"in {look.majority_phase or 'an unknown phase'}; none is behind or dead, heartbeats arrive "
                f"(an unmarked pause?){all_in}"
            )
        else:
            summary = (
                f"run hung: no step completed for {stalled_s:.0f} s after step {self._progress_step} "
                f"(threshold {threshold_s:.0f} s); no single rank is behind, all wait in "
                f"{waiting_in or look.majority_phase or 'an unknown phase'}"
            )
        evidence["mode"] = mode
        never, ranges = ctx.missing()
        if never:  # declared ranks that never sent anything: a count and a few ranges, whatever the size
            evidence.update(ranks_never_heard=never, never_heard_ranges=[list(r) for r in ranges])
        critical = mode == "dead" or (mode != "together" and stalled_s >= s.critical_factor * threshold_s)
        book.raise_(
            KIND,
            RUN_KEY,
            step=self._progress_step,
            ts=event_now,
            severity="critical" if critical else "warning",
            summary=summary,
            evidence=evidence,
            rank=None if rank is None else ctx.rank_of(rank),
            node=node,
            first_step=self._progress_step + 1,
            first_ts=self._progress_ts,
        )

    def _waiting_in(self, look: Look) -> str | None:
        """The innermost collective frame of the first rank waiting in one ("...distributed_c10d:barrier")."""
        waiting = np.flatnonzero(look.alive & (look.activity == activity.COLLECTIVE))
        if not waiting.size:
            return None
        return activity.first_frame(self.ctx.stack[int(waiting[0])], activity.COLLECTIVE)

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


def _later(a: float, b: float) -> float:
    """max(a, b) where NaN means "none" (plain floats: this runs on every tick)."""
    return b if b > a or a != a else a


def _num(x: float) -> float | None:
    return round(float(x), 3) if np.isfinite(x) else None


def _ranks(ranks: np.ndarray) -> str:
    """'rank 3' / 'ranks 0, 1, 2' / 'ranks 0, 1, 2, 3 (+60 more)'."""
    listed = ", ".join(str(int(r)) for r in ranks[:4])
    more = f" (+{ranks.size - 4} more)" if ranks.size > 4 else ""
    return f"rank {listed}" if ranks.size == 1 else f"ranks {listed}{more}"
