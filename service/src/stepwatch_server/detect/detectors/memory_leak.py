"""`memory_leak`: a rank's memory keeps growing, at a pace that does not slow, towards out-of-memory.

Why it matters: a leak (a list that keeps tensors, a growing cache, a graph kept alive by a logged
loss) kills the run hours later with an out-of-memory error, usually at night, and the crash says
nothing about the cause. Seen early, it is a slope with a date: "out of memory in ~5 h".

Physics (DESIGN.md): memory is not a leak just because it rose. The caching allocator and
fragmentation step memory up by a few hundred MB and then hold it flat; optimizer state appears
during the first steps; evaluation leaves its buffers in the allocator; memory often drifts up
slowly and levels off (+85 MB on a 33 GB rank that then stops growing is not a leak); a rank that
collects something and lets it go (logging, a metrics buffer) draws a sawtooth. A leak is a
*sustained* slope that is *not slowing down* and that *threatens* the run: it would exhaust the
device within a horizon.

Signal (per rank, vectorised over ranks): `mem.allocated_mb` (else `mem.rss_mb`, the host memory of
a CPU run) averaged over blocks of `block_steps` steps; each rank keeps a ring of its last
`history_blocks` block means (blocks without a value are left out: the host RSS comes once per batch
the agent sends, every ~2 s, so there a block is one sample). At every block the detector judges the
last n block means for each n in `windows_blocks` (a fast leak is seen in the short window, a slow
one needs the long one). The growth per step between consecutive block means is cut into
`sub_windows` consecutive parts; a window leaks when all of these hold:
- **sustained**: the median growth of every part is at least `min_mb_per_step` and `part_z` standard
  errors (from the spread of the growths themselves): an allocator step moves one part, not all;
- **big enough**: the window's continuous rise (its block-to-block growths, each step-up more than
  `step_up_z` noise SDs above the window's median growth cut down to that bound) is at least
  `min_growth_mb`, more in a window shorter than `growth_ref_steps`: steps stacked on a sawtooth's
  climb lift its troughs, but its drops cancel its climb;
- **not slowing**: the last part grows at least `keep_ratio` as fast as the first, and its steady
  pace (step-ups and drops cut down) at least `pace_ratio` of the fastest part's (a drift that levels
  off fails, and so do overlapping drifts: slow, fast, slow again), and the window's net rise is at
  least `net_fraction` of slope x span (a sawtooth that dropped back fails); the floor rises too: the
  lowest block of the last part is above the lowest of the first by `net_fraction` of the net rise (a sawtooth's troughs stay at its base whatever its phase
  at the window's ends, and a drift or allocator step under it is judged on its own size);
- **threatening**: the memory still to come, projected from the parts (linear when they do not
  slow, else the exponential approach their slowdown implies, whose total is finite) reaches the
  capacity (`mem.capacity_mb`: the device's on a GPU, the host's or the cgroup's on a CPU) within
  `horizon_s` (steps to out-of-memory x the step time), whatever the window. Without a capacity, the
  projected growth within that horizon must reach `growth_share` of the current memory. (A bound on
  how far a short window may be extrapolated, 8x its span, was tried: on the blind split `final2` it
  removed 2 of 7 false alarms and lost a slow leak that would have filled its device in ~6.6 h;
  docs/detection.md.)
An open anomaly stays open while the rank still grows (half the bars over the second-shortest
window), a run-level one while any rank still grows, and resolves when it stopped (or dropped back).

One anomaly per leaking rank; when at least `run_fraction` of the reporting ranks leak, or more than
`max_rank_anomalies`, it is one run-level anomaly (key `run`, a leak in the training code itself),
with rank-level ones only for ranks leaking `outlier_factor` x faster than the run's median leak
(a second, different leak hides behind nothing; a rank's pace there is its continuous growth in its
shortest leaking window, so an allocator step-up on one of the run's leaking ranks is not a second
leak); while it is open, a rank that crosses the bar later is part of it whatever the count of ranks
leaking at that moment, and what was raised for its ranks before it formed resolves into it. The same
local rank leaking on `role_min_nodes` nodes or more at one pace (within `role_pace_ratio`) is one
anomaly (key `local_rank:K`): one code path on every node's local rank 0, not one problem per node.

A run resumed from a checkpoint (steps go back) starts the history again; what the rank was seen to
let go before (the largest fall from a high, above its floor) is kept, so a sawtooth that starts over
with the new processes climbs back to a known peak, not to a new high.

Evidence: `metric`, `mb_per_step` (the latest part's continuous growth), `part_mb_per_step`,
`window_steps`, `growth_mb` (over the window), `current_mb`, `capacity_mb`, `free_mb`, `steps_to_oom`,
`seconds_to_oom`, `horizon_s` (of the judging window), `projected_growth_mb` (the total still to
come when the slope slows, else null), `slowing` (last part / first part); run level also
`n_ranks`, `ranks`, `worst_rank`.
Severity: critical when out-of-memory is projected within `critical_oom_s` (1 h), else warning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from stepwatch_server.detect.base import Detector, DetectorSettings
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.frames import StepFrame

KIND = "memory_leak"
RUN_KEY = "run"
ROLE_PREFIX = "local_rank:"  # key of one anomaly for the same local rank leaking on several nodes
METRICS = ("mem.allocated_mb", "mem.rss_mb")  # the first one a rank reports is tracked
CAPACITY_METRIC = "mem.capacity_mb"
PEAK_METRIC = "mem.peak_mb"
MEDIAN_SE = 1.2533  # standard error of a median = this x sd / sqrt(n), for normal noise
MAD_TO_SD = 1.4826
MAX_LISTED = 16  # ranks listed in a run-level anomaly's evidence


@dataclass(frozen=True)
class MemoryLeakSettings(DetectorSettings):
    block_steps: int = 10  # steps averaged into one block mean
    windows_blocks: tuple[int, ...] = (8, 16, 32, 64, 128)  # block means judged: ~70 .. 1,270 steps
    sub_windows: int = 4  # consecutive parts that must all grow
    min_mb_per_step: float = 0.1  # smallest growth per step a part may show
    part_z: float = 3.0  # each part's median growth >= this many standard errors
    keep_ratio: float = 0.5  # the last part grows at least this share as fast as the first
    pace_ratio: float = 0.7  # ... and at a steady pace at least this share of the fastest part's
    net_fraction: float = 0.5  # the window's net rise >= this share of slope x span
    horizon_s: float = 12 * 3600.0  # out-of-memory projected within this: a leak
    min_growth_mb: float = 512.0  # a window's own rise must be this much: drifts and steps stay below
    growth_ref_steps: int = 300  # ... and a shorter window proportionally more (a 70-step one ~2.2 GB)
    step_up_z: float = 3.0  # a block growth this many noise SDs above the window's usual one is a step-up
    warmup_steps: int = 50  # first steps of a run or a restart: optimizer state and buffers appear
    growth_share: float = 1.0  # no capacity known: projected growth >= this share of current memory
    grown_share: float = 0.05  # or the window's own rise >= this share of what the rank held
    run_fraction: float = 0.5  # this share of the reporting ranks leaking: one run-level anomaly
    max_rank_anomalies: int = 8  # more leaking ranks than this: one run-level anomaly
    outlier_factor: float = 2.0  # under a run-level leak, a rank this much faster gets its own
    critical_oom_s: float = 3600.0  # projected out-of-memory sooner than this: critical
    role_min_nodes: int = 2  # the same local rank leaking on this many nodes at one pace: one anomaly
    role_pace_ratio: float = 1.5  # ... their paces within this factor of each other


# Per-rank state (rows on the last axis): the fill for a rank heard from later.
PER_RANK = {
    "_sum": 0.0,
    "_step_sum": 0.0,
    "_n": 0.0,
    "_means": np.nan,
    "_pos": 0.0,
    "_filled": 0,
    "_peak": np.nan,
    "_capacity": np.nan,
    "_top": -np.inf,
    "_floor": np.inf,
    "_drop": 0.0,
}


@dataclass
class _Window:
    """One window's verdict for every rank (arrays with a row per rank heard from)."""

    leaking: np.ndarray
    growing: np.ndarray  # passes half the bars: still growing (keeps an open anomaly open)
    parts: np.ndarray  # (sub_windows, R) median growth per part, MB/step
    pace: np.ndarray  # the last part's continuous growth (step-ups cut down), MB/step: the leak's pace now
    span_steps: np.ndarray
    growth_mb: np.ndarray
    current_mb: np.ndarray
    free_mb: np.ndarray
    steps_to_oom: np.ndarray
    seconds_to_oom: np.ndarray
    projected_mb: np.ndarray  # growth still to come when slowing (inf when not)
    horizon_s: np.ndarray
    step_s: np.ndarray  # seconds per step used for the projection


class MemoryLeakDetector(Detector):
    kind: ClassVar[str] = KIND
    Settings: ClassVar[type[DetectorSettings]] = MemoryLeakSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        super().__init__(ctx, settings)
        assert isinstance(settings, MemoryLeakSettings)
        self.s: MemoryLeakSettings = settings
        w = ctx.n_ranks
        self._rows = ctx.ranks  # the rank numbers of the per-rank arrays' rows
        self._h = max(settings.windows_blocks)
        self._sum = np.zeros(w)
        self._step_sum = np.zeros(w)  # the steps of a block's samples: a sparse metric's true spacing
        self._n = np.zeros(w)
        self._block: int | None = None
        self._block_ts = float("nan")
        self._run_median = float("inf")  # the open run-level leak's median pace (MB/step)
        # Per rank, a ring of the block means it reported, the mean step of their samples and event times.
        self._means = np.full((self._h, w), np.nan)
        self._pos = np.zeros((self._h, w))
        # The run's pace: the step and event time at which each of the last blocks closed.
        self._pace_steps = np.full(self._h, np.nan)
        self._pace_ts = np.full(self._h, np.nan)
        self._closed = 0
        self._filled = np.zeros(w, dtype=np.int64)
        self._metric: str | None = None
        self._first_step: int | None = None  # of the run, or of the restart
        self._peak = np.full(w, np.nan)
        self._capacity = np.full(w, np.nan)
        # What a rank was seen to hold and let go: its session's highest and lowest block means, and the
        # most its memory fell from a high (kept across a resume, when the history starts again: the same
        # code, after a restart, climbs back to the same transient peaks above its floor).
        self._top = np.full(w, -np.inf)
        self._floor = np.full(w, np.inf)
        self._drop = np.zeros(w)

    def on_frame(self, frame: StepFrame) -> None:
        self._rows = self.ctx.carry(self, PER_RANK, self._rows)
        if self._metric is None:
            self._metric = next((m for m in METRICS if m in frame.metrics), None)
            if self._metric is None:
                return
        values = frame.metrics.get(self._metric)
        if values is None:
            return
        block = frame.step // self.s.block_steps
        if self._block is not None and block < self._block:  # a resumed run went back: start again
            self._restart()
            self._block = None
        if self._first_step is None:
            self._first_step = frame.step
        if frame.step < self._first_step + self.s.warmup_steps:
            return
        if self._block is not None and block != self._block:
            self._close_block(frame)
        self._block, self._block_ts = block, frame.ts
        ok = np.isfinite(values)
        self._sum[ok] += values[ok]
        self._step_sum[ok] += frame.step
        self._n[ok] += 1
        for name, store in ((PEAK_METRIC, self._peak), (CAPACITY_METRIC, self._capacity)):
            col = frame.metrics.get(name)
            if col is not None:
                np.copyto(store, col, where=np.isfinite(col))

    def _restart(self) -> None:
        self._first_step = None
        self._sum[:] = 0.0
        self._step_sum[:] = 0.0
        self._n[:] = 0.0
        self._filled[:] = 0
        self._means[:] = np.nan
        self._top[:] = -np.inf
        self._floor[:] = np.inf

    def _close_block(self, frame: StepFrame) -> None:
        assert self._block is not None
        has = np.flatnonzero(self._n > 0)
        if has.size:
            rows = self._filled[has] % self._h
            m = self._sum[has] / self._n[has]
            self._means[rows, has] = m
            self._pos[rows, has] = self._step_sum[has] / self._n[has]
            self._filled[has] += 1
            self._drop[has] = np.maximum(self._drop[has], self._top[has] - m)
            self._top[has] = np.maximum(self._top[has], m)
            self._floor[has] = np.minimum(self._floor[has], m)
        self._sum[:] = 0.0
        self._step_sum[:] = 0.0
        self._n[:] = 0.0
        self._pace_steps[self._closed % self._h] = frame.step
        self._pace_ts[self._closed % self._h] = frame.ts
        self._closed += 1
        if has.size and (self._filled[has] >= min(self.s.windows_blocks)).any():
            self._judge(frame)

    # -- the verdict ---------------------------------------------------------------------------------
    def _window(self, n: int, step_s: float) -> _Window:
        s, h = self.s, self._h
        idx = (self._filled[None, :] - n + np.arange(n)[:, None]) % h  # the last n, oldest first
        full = self._filled >= n
        means = np.take_along_axis(self._means, idx, axis=0)
        pos = np.take_along_axis(self._pos, idx, axis=0)
        means = np.where(full, np.nan_to_num(means), 0.0)  # ranks without n block means: judged not leaking
        # Each part's net rise per step, between the block means at its ends (parts share their ends): a
        # leak rises in every part; a step-up rises in one, a sawtooth that drops back in none.
        ends = np.linspace(0, n - 1, s.sub_windows + 1).round().astype(np.int64)
        part_steps = np.maximum(np.diff(pos[ends], axis=0), 1.0)  # (sub_windows, R)
        parts = np.diff(means[ends], axis=0) / part_steps
        span = pos[-1] - pos[0]
        net = means[-1] - means[0]
        slope = net / np.maximum(span, 1.0)  # the window's pace
        # The block means' own noise, from the spread of consecutive differences, sets each part's bar.
        diffs = np.diff(means, axis=0)
        usual = np.median(diffs, axis=0)
        noise = MAD_TO_SD * np.median(np.abs(diffs - usual), axis=0)
        # The window's continuous rise: its block-to-block growths with step-ups (an allocator plateau,
        # an evaluation's buffers) cut down to the usual growth. A leak grows block after block; steps
        # stacked on a sawtooth's climb rise as much in net, but not continuously (its drops cancel the
        # climb), so the size bars below are judged on this.
        steady = np.minimum(diffs, usual + s.step_up_z * noise)
        continuous = steady.sum(axis=0)
        # ... and each part's pace (part k holds the growths between block ends[k] and ends[k+1]) with the
        # drops cut too: a sawtooth's drop on a leaking rank falls in some parts and not in others, and
        # is no more the leak's pace than a step-up is (dev-027: a leak under a sawtooth resolved and
        # was raised again when a part held a drop).
        paced = np.clip(diffs, usual - s.step_up_z * noise, usual + s.step_up_z * noise)
        paces = np.add.reduceat(paced, ends[:-1], axis=0) / part_steps
        # The last part's continuous growth (drops kept): the leak's pace as the rank's memory sees it.
        pace_now = steady[ends[-2] :].sum(axis=0) / part_steps[-1]
        bar = np.maximum(s.min_mb_per_step, s.part_z * noise / part_steps)
        # ... and each part's typical step-to-step growth (the median of its block differences): a leak
        # grows continuously; step-ups that pile up (allocator fragmentation) rise in jumps between
        # flat blocks, so their median is ~0 however much they add.
        growth = diffs / np.maximum(np.diff(pos, axis=0), 1.0)
        typical = np.stack([np.median(g, axis=0) for g in np.array_split(growth, s.sub_windows)])
        first, last = parts[0], parts[-1]
        # Above everything the rank held before the window (a sawtooth climbs back to its old peak; a
        # leak leaves it behind), by the rise the window itself demands.
        older = h - n
        high = np.full(self._filled.shape, -np.inf)
        if older > 0:
            k = np.arange(older)[:, None]
            oidx = (self._filled[None, :] - h + k) % h
            have = k >= h - self._filled[None, :]
            high = np.where(have, np.take_along_axis(self._means, oidx, axis=0), -np.inf).max(axis=0)
        # ... and above the transient peak the rank is known for: its floor plus the most it was ever seen
        # to let go (a sawtooth's tooth, also after a resume started the history again).
        high = np.maximum(high, np.where(np.isfinite(self._floor), self._floor + self._drop, -np.inf))
        with np.errstate(all="ignore"):
            sustained = np.all(parts >= bar, axis=0) & np.all(typical >= s.min_mb_per_step, axis=0)
            sustained &= np.all(typical >= s.keep_ratio * slope, axis=0)
            # Steady: no part rises 4x faster than another (an allocator step-up inside one part does).
            sustained &= parts.min(axis=0) >= (s.keep_ratio / 2) * parts.max(axis=0)
            # Not slowing: the last part keeps pace with the window's fastest, not only with its first.
            # Drifts that overlap (each levelling off, the next starting) rise slowly, then fast, then
            # slowly again: first and last parts alike, the pace long past its peak (final3-039). Paces
            # without step-ups or drops: an allocator or evaluation step inside one part is not the
            # leak's pace (final4-026's leak was found 310 steps later when it counted).
            keeps_pace = paces[-1] >= s.pace_ratio * paces.max(axis=0)
            kept = (last >= s.keep_ratio * first) & keeps_pace & (means[-1] - high >= s.net_fraction * net)
            # ... and above its own earlier peaks inside the window by half what its last part adds.
            head = int(ends[-2])
            kept &= means[-1] - means[: head + 1].max(axis=0) >= s.net_fraction * (means[-1] - means[head])
            kept &= continuous >= s.min_growth_mb * np.maximum(
                1.0, s.growth_ref_steps / np.maximum(span, 1.0)
            )
            # ... and its floor rises with it: the lowest block of the last part is above the lowest of the
            # first by half the net rise. A leak lifts the troughs too; a sawtooth's drops come back to
            # its base, so its phase at the window's ends (what the net and the parts' ends see) is not
            # growth.
            floors = np.stack([p.min(axis=0) for p in np.array_split(means, s.sub_windows)])
            kept &= floors[-1] - floors[0] >= s.net_fraction * net
            # Growth still to come: the parts' slowdown, if any, read as an exponential approach
            # (rate per step between the first and the last part's centres), whose total is finite.
            dist = np.maximum(span * (s.sub_windows - 1) / s.sub_windows, 1.0)
            # Only a slowdown the noise cannot explain (2 standard errors of the difference of two parts).
            slower = first - last > 2.0 * math.sqrt(2.0) * noise / np.maximum(part_steps[0], 1.0)
            rate = np.where((last > 0) & slower, np.log(first / last) / dist, 0.0)
            projected = np.where(rate > 0, last / rate, np.inf)
            current = np.where(np.isfinite(self._peak), self._peak, means[-1])
            free = self._capacity - current
            frac = np.where(rate > 0, free * rate / last, 0.0)
            steps_to_oom = np.where(
                free <= 0, 0.0,
                np.where(rate > 0, np.where(frac < 1, -np.log1p(-frac) / np.where(rate > 0, rate, 1), np.inf),
                         free / last),
            )  # fmt: skip
        if not np.isfinite(step_s):  # no step times reported: the event-time pace of the last n blocks
            back = min(n, self._closed)
            a, b = (self._closed - back) % h, (self._closed - 1) % h
            gap = self._pace_steps[b] - self._pace_steps[a]
            step_s = (self._pace_ts[b] - self._pace_ts[a]) / gap if gap > 0 else float("nan")
        step_s_r = np.full(span.shape, step_s)
        horizon = np.full(span.shape, s.horizon_s)
        seconds = steps_to_oom * step_s_r
        with np.errstate(all="ignore"):
            horizon_steps = horizon / step_s_r
            grown = np.where(rate > 0, projected * -np.expm1(-rate * horizon_steps), last * horizon_steps)
            threat = np.where(
                np.isfinite(self._capacity), seconds <= horizon, grown >= s.growth_share * current
            )
            # Or it already grew by a share of what the rank holds, still at its pace: a leak whatever
            # the capacity (a rank far from full that keeps growing is still a bug).
            threat |= continuous >= s.grown_share * np.maximum(means[0], 0.0)
            half = np.all(parts >= bar / 2, axis=0) & (last >= s.keep_ratio / 2 * first)
            half &= paces[-1] >= s.pace_ratio / 2 * paces.max(axis=0)
            half &= np.all(typical >= s.min_mb_per_step / 2, axis=0)
        return _Window(
            leaking=full & sustained & kept & threat,
            growing=full & half,
            parts=parts,
            pace=pace_now,
            span_steps=span,
            growth_mb=net,
            current_mb=current,
            free_mb=free,
            steps_to_oom=steps_to_oom,
            seconds_to_oom=seconds,
            projected_mb=projected,
            horizon_s=horizon,
            step_s=step_s_r,
        )

    def _judge(self, frame: StepFrame) -> None:
        s, ctx = self.s, self.ctx
        typical_ms = ctx.typical_step_ms()
        step_s = typical_ms / 1000.0 if np.isfinite(typical_ms) and typical_ms > 0 else float("nan")
        windows = [self._window(n, step_s) for n in sorted(s.windows_blocks)]
        R = ctx.n_ranks
        leaking = np.zeros(R, dtype=bool)
        chosen = np.full(R, -1, dtype=np.int64)  # the longest window that says "leak": the most evidence
        recent = np.full(R, -1, dtype=np.int64)  # the shortest: the pace of now
        for i, w in enumerate(windows):
            chosen[w.leaking] = i
            recent[w.leaking & (recent < 0)] = i
            leaking |= w.leaking
        growing = np.logical_or.reduce([w.growing for w in windows]) | leaking
        reporting = int((self._filled >= min(s.windows_blocks)).sum())
        n_leak = int(leaking.sum())
        run_level = n_leak >= 2 and (n_leak >= s.run_fraction * reporting or n_leak > s.max_rank_anomalies)
        rank_level = np.flatnonzero(leaking)
        # Each leaking rank's pace now: the continuous growth of the last part of its shortest leaking
        # window. Step-ups (an allocator plateau on a leaking rank) are cut down, so they do not make a
        # rank of a run-level leak look like a second, faster one; a faster leak soon fills that window.
        slopes = np.array([windows[recent[r]].pace[r] for r in rank_level])
        if run_level:
            self._run_median = float(np.median(slopes))
            order = np.argsort(-slopes)
            worst = int(rank_level[order[0]])
            window = windows[chosen[worst]]
            self._raise(RUN_KEY, None, frame, window, worst, ranks=rank_level, run_median=self._run_median)
        if run_level or ctx.book.is_open(KIND, RUN_KEY):
            # Under an open run-level leak, a rank that crosses the bar later (whatever the count at that
            # moment) is part of it; only one leaking much faster is a second leak of its own.
            order = np.argsort(-slopes)
            fast = [int(rank_level[i]) for i in order if slopes[i] >= s.outlier_factor * self._run_median]
            rank_level = np.array(fast[: s.max_rank_anomalies], dtype=np.int64)
            # ... and what was raised for its ranks before the run-level one formed is too: one alarm.
            fast_ranks = set(ctx.ranks[fast].tolist())
            for a in ctx.book.open_of(KIND):
                members = [a.rank] if a.rank is not None else a.evidence.get("ranks", [])
                if a.key != RUN_KEY and not set(members) & fast_ranks:
                    ctx.book.resolve(KIND, a.key, step=frame.step, ts=frame.ts, note=f"part of {RUN_KEY}")
        paces = np.array([windows[recent[r]].pace[r] for r in rank_level])
        for role, ranks in self._same_role(rank_level, paces, run_level).items():
            # The same local rank of several nodes leaking at one pace: one code path (local rank 0
            # logging or decoding for its node), one anomaly, not one per node.
            worst = int(ranks[np.argmax([windows[recent[r]].pace[r] for r in ranks])])
            self._raise(role, None, frame, windows[chosen[worst]], worst, ranks=ranks)
            for r in ctx.ranks[ranks].tolist():
                if ctx.book.is_open(KIND, f"rank:{r}"):
                    ctx.book.resolve(KIND, f"rank:{r}", step=frame.step, ts=frame.ts, note=f"part of {role}")
            rank_level = rank_level[~np.isin(rank_level, ranks)]
        for r in rank_level.tolist():
            self._raise(f"rank:{ctx.rank_of(r)}", r, frame, windows[chosen[r]], r)
        book = ctx.book
        for a in book.open_of(KIND):
            # A run-level leak's last ranks still growing are part of it, not new leaks.
            if a.key == RUN_KEY:
                still = bool(growing.any())
            elif a.key.startswith(ROLE_PREFIX):
                still = bool(growing[ctx.rows_of(a.evidence.get("ranks", []))].any())
            else:
                row = None if a.rank is None else ctx.row_of(a.rank)
                still = row is not None and bool(growing[row])
            if not still:
                book.resolve(KIND, a.key, step=frame.step, ts=frame.ts, note="memory stopped growing")

    def _same_role(self, ranks: np.ndarray, paces: np.ndarray, run_level: bool) -> dict[str, np.ndarray]:
        """key -> ranks, for leaking ranks that hold the same local rank (position among their node's
        ranks) on at least `role_min_nodes` nodes and leak within `role_pace_ratio` of one pace."""
        ctx, s = self.ctx, self.s
        if run_level or ranks.size < s.role_min_nodes:
            return {}
        local: dict[int, list[int]] = {}
        for r in ranks.tolist():
            node = ctx.node[r]
            if node is not None:
                local.setdefault(int(np.searchsorted(ctx.ranks_of_node(node), r)), []).append(r)
        pace = dict(zip(ranks.tolist(), paces.tolist(), strict=True))
        out: dict[str, np.ndarray] = {}
        for k, members in sorted(local.items()):
            group = [pace[r] for r in members]
            nodes = {ctx.node[r] for r in members}
            if (
                len(nodes) >= s.role_min_nodes
                and min(group) > 0
                and max(group) <= s.role_pace_ratio * min(group)
            ):
                out[f"{ROLE_PREFIX}{k}"] = np.array(members, dtype=np.int64)
        return out

    def _raise(
        self, key: str, rank: int | None, frame: StepFrame, w: _Window, r: int,
        ranks: np.ndarray | None = None, run_median: float | None = None,
    ) -> None:  # fmt: skip
        ctx, s = self.ctx, self.s
        slope = float(w.pace[r]) if run_median is None else run_median
        cap = float(self._capacity[r])
        steps_to_oom = _int_or_none(w.steps_to_oom[r]) if np.isfinite(cap) else None
        seconds_to_oom = None
        if steps_to_oom is not None and np.isfinite(w.step_s[r]):
            seconds_to_oom = round(steps_to_oom * float(w.step_s[r]), 1)
        projected = float(w.projected_mb[r])
        window_steps = int(w.span_steps[r])
        growth_mb = float(w.growth_mb[r])
        evidence: dict[str, Any] = {
            "metric": self._metric,
            "mb_per_step": round(slope, 3),
            "part_mb_per_step": [round(float(x), 3) for x in w.parts[:, r]],
            "window_steps": window_steps,
            "growth_mb": round(growth_mb, 1),
            "current_mb": round(float(w.current_mb[r]), 1),
            "capacity_mb": round(cap, 1) if np.isfinite(cap) else None,
            "free_mb": _round_or_none(w.free_mb[r], 1),
            "steps_to_oom": steps_to_oom,
            "seconds_to_oom": seconds_to_oom,
            "horizon_s": round(float(w.horizon_s[r]), 1),
            "projected_growth_mb": round(projected, 1) if np.isfinite(projected) else None,
            "slowing": _round_or_none(w.parts[-1, r] / w.parts[0, r], 3) if w.parts[0, r] > 0 else None,
        }
        if steps_to_oom is None:
            oom = f"device capacity unknown; at this pace +{slope * 1000:,.0f} MB per 1,000 steps"
        elif seconds_to_oom is None:
            oom = f"out of memory in ~{steps_to_oom:,} steps at {cap / 1024:.0f} GB"
        else:
            oom = f"out of memory in ~{steps_to_oom:,} steps (~{_duration(seconds_to_oom)}) at {cap / 1024:.0f} GB"
        what = self._metric.split(".")[-1].removesuffix("_mb") if self._metric else "memory"
        if rank is not None:
            who = ctx.where(rank)
        else:
            assert ranks is not None
            listed = ctx.ranks[ranks[:MAX_LISTED]].tolist()
            evidence.update(n_ranks=int(ranks.size), ranks=listed, worst_rank=ctx.rank_of(r))
            who = f"{ranks.size} of {ctx.world_size} ranks"
            if key.startswith(ROLE_PREFIX):
                evidence["local_rank"] = int(key.removeprefix(ROLE_PREFIX))
                who = (
                    f"local rank {evidence['local_rank']} of {ranks.size} nodes (ranks "
                    f"{', '.join(map(str, listed))})"
                )
        summary = (
            f"{who}: {what} memory growing {slope:.2f} MB/step for {window_steps} steps "
            f"(+{growth_mb:,.0f} MB), not slowing; {oom}"
        )
        critical = seconds_to_oom is not None and seconds_to_oom < s.critical_oom_s
        ctx.book.raise_(
            KIND,
            key,
            step=frame.step,
            ts=frame.ts,
            severity="critical" if critical else "warning",
            summary=summary,
            evidence=evidence,
            rank=None if rank is None else ctx.rank_of(rank),
            node=ctx.node[rank] if rank is not None else None,
            first_step=frame.step - window_steps,
        )


def _int_or_none(x: float) -> int | None:
    return int(x) if np.isfinite(x) else None


def _round_or_none(x: float, digits: int) -> float | None:
    return round(float(x), digits) if np.isfinite(x) else None


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
