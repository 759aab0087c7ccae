"""Which ranks, and which nodes, are slower than their peers: one computation shared by the `straggler`
and `slow_node` detectors, so that the two always agree on who is slow.

Physics (DESIGN.md): synchronous training equalises step time, so a slow rank is visible only in the
phases it spends alone, before the collective: data wait (`time.data_ms`) and forward
(`time.forward_ms`). Its peers then wait for it inside the collective (in DDP, inside
`time.backward_ms`), so backward and step time are never judged here: they would blame the healthy.

Per step and phase, each rank's time is divided by the median of its peers at the same step (the
other ranks: with few ranks the rank itself must not pull the median). The log of that ratio, clipped
to +-log(`clip_ratio`) around the rank's own normal and its peers' level (whichever bound is wider) so
that one GC pause moves a window by little, goes into a ring of the last
`window_steps` judged steps; its window mean m is the rank's current slowness in that phase. Healthy
GPUs and loaders differ by a few percent for good, so each rank also has a baseline b, a slow average
of m learnt only while the rank looks normal (never during a slowdown) and counted only up to
`min_ratio` (a rank cannot learn that being 20% slow is its normal). A rank is slow-now in a phase
when all of these hold:
  - exp(m) >= `min_ratio` and exp(m - b) >= `min_ratio`: persistently slower than its peers, and
    slower than it normally is;
  - m - b is `min_z` units above the ranks' median, the unit being the larger of what chance gives a
    window mean (the phase's per-step noise: the median over ranks of each rank's standard deviation
    over its window, so that with few ranks a straggler does not set it / sqrt(window)) and the
    ranks' actual spread (1.4826 x MAD), and at least `min_scale`: noisy phases (data loading) and
    noisy runs raise the bar by themselves;
  - (exp(m) - 1) x the phase's share of the step >= `min_excess_frac`: the time the run loses to the
    rank is not negligible, so a tiny phase's noise (a 0.1 ms data wait doubling) cannot trigger it;
    where this bar alone holds a rank back, the cost comes from the window's median unclipped ratio
    (the clip bounds how slow a rank looks, not how much time a 1,000x slower loader costs);
A rank is slow when it has been slow-now for `confirm_steps` judged steps in a row spanning at least
`min_duration_s` of event time (with 10-30 ms CPU steps, four steps are a scheduler hiccup); it stops
being slow after `clear_steps` judged steps in a row below half of each bar (hysteresis).

A node is slow-now when at least `node_fraction` of its ranks (and at least 2) are slow-now, slow after
`confirm_steps` in a row, and clear after `clear_steps` in a row with fewer than half of its ranks still
slow. A rank whose node has half or more of its ranks slow-now waits another `confirm_steps` before it
counts as slow on its own, so that the ranks of a slow node, which cross the bar a few steps apart, are
reported once for the node rather than first one by one. `straggler` reports slow ranks except those
of a slow node (when `slow_node` runs), `slow_node` reports slow nodes: both read the one
`RankSlowness` of the run (`ctx.slowness`: the detection engine creates it with one set of settings and
folds in each frame once, before the detectors), so the split between a slow node and slow ranks is
decided once, whatever settings each of the two detectors was given (`run_slowness_settings`).

A node's data hiccup is not any rank's pace: at a step where a node of >= 3 ranks (at most half the
run) waits `clip_ratio` x longer for data as a whole (its ranks' median ratio), its ranks' data values
are left out of their windows, for up to `window_steps` judged steps in a row; a node slow for longer is
slow for good, and its steps count again (so a node slow in data is found after ~`window_steps` steps).

Steps inside a marked pause (`ctx.paused`, or a phase_start/phase_end event in the frame) and the
`skip_after_pause_steps` after it are not judged (the pause sits in the next step's data time), nor
are the first `warmup_steps` of a run (compilation, autotuning).

Over the first `learn_steps` judged steps each rank's own offsets are learnt as the mean of the
window's median ratio over those steps (data up to `max_normal_data_ratio`, forward up to `min_ratio`):
a GPU 5% slower from the first step is its normal, not a straggler at step 40; and the mean over the
learning steps, not the last window's median alone, keeps a lucky window from becoming a normal that
the rank's usual pace then exceeds.

Known limit: a 10% data-loader straggler among ranks whose data time varies 10% per step is near
what any test can see in 50 steps without false alarms (a sequential test needs ~35-40 steps on
average); it is found in 21-75 steps (median 42) depending on the noise draw. A rank that is slow in
data from the very first steps by less than ~15%, or in forward by less than ~10%, may be learnt as
its normal.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stepwatch_server.detect.base import DetectorSettings
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.frames import StepFrame
from stepwatch_server.timeline import peer_median

PHASES = ("data", "forward")  # judged phases; backward and step time hold the peers' wait
PHASE_METRICS = ("time.data_ms", "time.forward_ms")
STEP_METRIC = "time.step_ms"
PAUSE_EVENTS = ("phase_start", "phase_end")
MAD_TO_SIGMA = 1.4826
RESUM_EVERY = 4096  # pushes between exact recomputations of the running sums (float drift)


@dataclass(frozen=True)
class SlownessSettings(DetectorSettings):
    """What makes a rank or a node slow. One set per run for `straggler` and `slow_node` together: a
    field overridden for either applies to both (`straggler`'s value where both differ)."""

    window_steps: int = 40  # judged steps averaged: beats 10% per-step noise, finds 10% in < 50 steps
    min_ratio: float = 1.05  # persistent slowdown below 5% is within GPU-to-GPU spread
    min_z: float = 5.0  # in units of chance: healthy ranks of the suite's clean runs peak below 4.9
    min_scale: float = 0.01  # floor of that spread (log units): few ranks give a noisy MAD
    min_excess_frac: float = 0.002  # the rank costs the run >= 0.2% of its step time
    baseline_steps: int = 256  # a rank's own normal offset is learnt over this many judged steps
    clip_ratio: float = 1.25  # per-step ratios clipped to [1/1.25, 1.25]: a GC pause moves m by < 1%
    confirm_steps: int = 4  # slow-now this many judged steps in a row -> slow (a lucky window is not)
    min_duration_s: float = 1.0  # ... and for this long in event time: with 10-30 ms steps 4 steps are
    # a scheduler hiccup (the clean CPU demo on a busy machine had slow-now runs of up to 6 steps, 0.1 s)
    clear_steps: int = 40  # below half of the bars this many judged steps in a row -> clear
    node_fraction: float = 0.75  # share of a node's ranks slow together that makes it a slow node
    warmup_steps: int = 10  # first steps of a run: compilation and autotuning, not judged
    skip_after_pause_steps: int = 5  # steps after a marked pause (eval, checkpoint) not judged
    learn_steps: int = 100  # first judged steps: each rank's own data and forward offsets are learnt
    max_normal_data_ratio: float = 2.0  # ... up to this (local rank 0 decoding or logging for its node)
    min_spread_ranks: int = 4  # fewer ranks: their spread is the straggler itself, chance is the unit


def slowness_settings(settings: DetectorSettings) -> SlownessSettings:
    """The shared fields of a detector's settings (a subclass of SlownessSettings)."""
    names = [f.name for f in dataclasses.fields(SlownessSettings)]
    return SlownessSettings(**{n: getattr(settings, n) for n in names})


class PauseGate:
    """Says which steps to leave out of timing statistics: inside a marked pause and shortly after."""

    def __init__(self, after_steps: int) -> None:
        self.after_steps = after_steps
        self.until_step = -1  # steps <= this are skipped

    def skip(self, frame: StepFrame, ctx: RunContext) -> bool:
        for _, event in frame.events:
            if event.kind in PAUSE_EVENTS:
                self.until_step = max(self.until_step, event.step + 1 + self.after_steps)
        if ctx.n_paused:  # some rank is inside watch.phase(...)
            self.until_step = max(self.until_step, frame.step + self.after_steps)
            return True
        return frame.step <= self.until_step


class RankSlowness:
    """Rolling per-rank, per-phase slowness of one run and the slow ranks/nodes it implies."""

    def __init__(self, ctx: RunContext, s: SlownessSettings) -> None:
        self.ctx, self.s = ctx, s
        R, P, W = ctx.n_ranks, len(PHASES), s.window_steps
        self._rows = ctx.ranks  # the rank numbers of the per-rank arrays' rows (see RunContext.carry)
        self.gate = PauseGate(s.skip_after_pause_steps)
        self.node_reporting = False  # slow_node runs: straggler leaves slow nodes to it
        self._last_frame: StepFrame | None = None
        self._last_judged = False
        self._clip = math.log(s.clip_ratio)
        self._lo = math.log(s.min_ratio)
        self.noise = np.full(len(PHASES), np.nan)  # per-step sd of the clipped log ratio, per phase
        # Rings over judged steps: clipped log ratios (for the running mean) and raw ratios (evidence).
        self._log = np.zeros((W, P, R))
        self._raw = np.full((W, P, R), np.nan)
        self._valid = np.zeros((W, P, R), dtype=bool)
        self._sum = np.zeros((P, R))
        self._sumsq = np.zeros((P, R))
        self._count = np.zeros((P, R), dtype=np.int64)
        self._pushes = 0
        self.share = np.full(P, np.nan)  # each phase's median time / the median step time (EWMA)
        # Per rank and node: judged steps in a row slow-now / below the clear bars; current verdicts.
        self.judged_steps = 0
        self.mean = np.zeros((P, R))  # window mean of the clipped log ratio
        self.base = np.zeros((P, R))  # the rank's own normal log ratio (slow EWMA of `mean`)
        # While it is learnt (the first learn_steps judged steps): the sum and count of the window's median
        # log ratio at each of those steps, whose mean is the base.
        self._learn_sum = np.zeros((P, R))
        self._learn_n = np.zeros((P, R))
        # How far a rank's own normal may sit from its peers', per phase: GPUs differ by a few percent,
        # data work by design (see learn_steps).
        self._cap = np.array([math.log(s.max_normal_data_ratio), math.log(s.min_ratio)])[:, None]
        self.z = np.zeros((P, R))  # robust z of mean - base across ranks
        self.slow_now = np.zeros(R, dtype=bool)
        self.phase = np.zeros(R, dtype=np.int64)  # the phase that makes the rank slow (largest excess)
        self.run = np.zeros(R, dtype=np.int64)
        self.quiet = np.zeros(R, dtype=np.int64)
        self.slow = np.zeros(R, dtype=bool)
        self.slow_since = np.full(R, -1, dtype=np.int64)  # first step of the current slow stretch
        self.slow_since_ts = np.full(R, np.nan)
        self._run_step = np.full(R, -1, dtype=np.int64)  # first step of the current slow-now run
        self._run_ts = np.full(R, np.nan)
        self._node_names: list[str | None] = []
        self.node_of = np.full(R, -1, dtype=np.int64)  # rank -> index into node_names, -1 unknown
        self.node_names: list[str] = []
        self.node_size = np.zeros(0, dtype=np.int64)
        self._node_table = np.full((0, 1), -1, dtype=np.int64)  # node -> its ranks, -1 padded
        self.node_hiccup = np.zeros(0, dtype=np.int64)  # judged steps in a row the node was slow in data
        self.node_run = np.zeros(0, dtype=np.int64)
        self.node_quiet = np.zeros(0, dtype=np.int64)
        self.node_slow = np.zeros(0, dtype=bool)
        self.node_slow_now = np.zeros(0, dtype=bool)
        self.node_slow_count = np.zeros(0, dtype=np.int64)
        self.node_since = np.zeros(0, dtype=np.int64)
        self.node_since_ts = np.zeros(0)
        self._node_run_step = np.zeros(0, dtype=np.int64)
        self._node_run_ts = np.zeros(0)

    # -- per frame ---------------------------------------------------------------------------------
    def update(self, frame: StepFrame) -> bool:
        """Fold in one frame (once, however many detectors call it); True when the step was judged."""
        if frame is self._last_frame:
            return self._last_judged
        self._last_frame = frame
        self._rows = self.ctx.carry(self, PER_RANK, self._rows)
        self._refresh_nodes()
        self._last_judged = judged = self._judge(frame)
        return judged

    def _judge(self, frame: StepFrame) -> bool:
        s = self.s
        if frame.step <= s.warmup_steps or self.gate.skip(frame, self.ctx):
            return False
        cols = [frame.metrics.get(name) for name in PHASE_METRICS]
        if all(c is None for c in cols):
            return False
        R = self.ctx.n_ranks
        raw = np.full((len(PHASES), R), np.nan)
        for p, col in enumerate(cols):
            if col is not None:
                with np.errstate(divide="ignore", invalid="ignore"):
                    raw[p] = col / peer_median(col)
        raw[~(raw > 0) | ~np.isfinite(raw)] = np.nan
        step_col = frame.metrics.get(STEP_METRIC)
        if step_col is not None and np.isfinite(step_col).any():
            step_ms = float(np.nanmedian(step_col))
            for p, col in enumerate(cols):
                if col is not None and np.isfinite(col).any() and step_ms > 0:
                    x = float(np.nanmedian(col)) / step_ms
                    self.share[p] = x if not np.isfinite(self.share[p]) else 0.95 * self.share[p] + 0.05 * x
        data = PHASES.index("data")
        raw[data, self._node_hiccup(raw[data])] = np.nan
        self._push(raw)
        self._verdicts(frame)
        return True

    def _node_hiccup(self, ratio: np.ndarray) -> np.ndarray:
        """Per rank: its node is in a data hiccup at this step, so the step says nothing about the rank's
        own pace. A node is in one while, as a whole (the median of its ranks' ratios), it waits
        `clip_ratio` x longer for data than the run, for at most `window_steps` judged steps in a row (its
        disk, its page cache, a filesystem stall seen from one host), in a node of >= 3 ranks that is at
        most half the run. A node slow for longer is slow for good: its steps count again (`slow_node`).
        """
        out = np.zeros(ratio.shape, dtype=bool)
        table = self._node_table
        if table.shape[1] < 3:
            return out
        vals = np.where(table >= 0, ratio[np.maximum(table, 0)], np.nan)
        big = (self.node_size >= 3) & (2 * self.node_size <= self.ctx.n_ranks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a node with no data value at this step
            slow = big & (np.nanmedian(vals, axis=1) >= self.s.clip_ratio)
        self.node_hiccup = np.where(slow, self.node_hiccup + 1, 0)
        hiccup = slow & (self.node_hiccup <= self.s.window_steps)
        known = self.node_of >= 0
        out[known] = hiccup[self.node_of[known]]
        return out

    def _push(self, raw: np.ndarray) -> None:
        slot = self._pushes % self.s.window_steps
        valid = np.isfinite(raw)
        # Clipped around the rank's own normal, so a rank whose normal is slower than its peers (more
        # data work by design) still shows a slowdown on top of it; and around its peers' level (0),
        # whichever bound is wider, so a rank whose normal is far FASTER (its peer does the extra work)
        # can still be seen slower than its peers when it slows down.
        own = np.clip(self.base, -self._cap, self._cap)
        x = np.log(np.where(valid, raw, 1.0))
        logs = np.where(
            valid, np.clip(x, np.minimum(own, 0.0) - self._clip, np.maximum(own, 0.0) + self._clip), 0.0
        )
        old = self._log[slot]
        self._sum -= old
        self._sumsq -= old * old
        self._count -= self._valid[slot]
        self._log[slot], self._raw[slot], self._valid[slot] = logs, raw, valid
        self._sum += logs
        self._sumsq += logs * logs
        self._count += valid
        self._pushes += 1
        if self._pushes % RESUM_EVERY == 0:
            self._sum = self._log.sum(axis=0)
            self._sumsq = (self._log * self._log).sum(axis=0)

    def _verdicts(self, frame: StepFrame) -> None:
        s = self.s
        self.judged_steps += 1
        enough = self._count >= max(2, s.window_steps // 2)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(enough, self._sum / np.maximum(self._count, 1), np.nan)
        self.mean = mean
        if not np.isfinite(mean).any():
            return
        # Per-step noise of each phase: each rank's standard deviation over the window around its own
        # mean (the clip bounds every value, so one GC pause adds little), the median over the ranks
        # (a straggler's steady slowness is neither noise nor, with few ranks, allowed to set it).
        with np.errstate(invalid="ignore", divide="ignore"):
            sd = np.sqrt(np.maximum(self._sumsq / np.maximum(self._count, 1) - mean * mean, 0.0))
        self.noise = _row_median(np.where(enough, sd, np.nan))[:, 0]
        lo = math.log(s.min_ratio)
        learning = self.judged_steps <= s.learn_steps
        change = mean - np.clip(self.base, -self._cap, self._cap)  # against the rank's own normal offset
        dev = change - _row_median(change)
        # The bar's unit: the larger of what chance gives a window mean (per-step noise / sqrt(n))
        # and the ranks' actual spread (offsets not yet learnt), never below min_scale. With fewer than
        # min_spread_ranks ranks the "spread" is the straggler itself: chance alone is the unit.
        with np.errstate(invalid="ignore", divide="ignore"):
            chance = np.nan_to_num(self.noise)[:, None] / np.sqrt(np.maximum(self._count, 1))
        enough_ranks = np.isfinite(dev).sum(axis=1, keepdims=True) >= s.min_spread_ranks
        spread = np.where(enough_ranks, MAD_TO_SIGMA * _row_median(np.abs(dev)), 0.0)
        scale = np.maximum(np.maximum(chance, spread), s.min_scale)
        self.z = dev / scale
        share = np.nan_to_num(self.share, nan=1.0)[:, None]  # unknown step time: no floor
        excess = np.expm1(mean) * share  # time lost, as a fraction of the step
        with np.errstate(invalid="ignore"):
            # The clipped mean says "slower", not how much: a loader 1,000x slower in a phase of 0.02%
            # of the step (0.5 ms of a 2.4 s step) costs the run 20%, not 0.25 x 0.02%. Where that is
            # all that holds a rank back, the time lost comes from the window's median unclipped ratio.
            short = (
                (mean >= lo / 2)
                & (change >= lo / 2)
                & (self.z >= s.min_z / 2)
                & ~(excess >= s.min_excess_frac)
            )
            for p in np.flatnonzero(short.any(axis=1)).tolist():
                ranks = np.flatnonzero(short[p])
                excess[p, ranks] = np.maximum(
                    excess[p, ranks], np.expm1(self._median_log(p, ranks)) * share[p, 0]
                )
            hot = (mean >= lo) & (change >= lo) & (self.z >= s.min_z) & (excess >= s.min_excess_frac)
            warm = (
                (mean >= lo / 2)
                & (change >= lo / 2)
                & (self.z >= s.min_z / 2)
                & (excess >= s.min_excess_frac / 2)
            )
        hot &= self._persistent(hot, lo)
        if learning:
            # A rank's own data work is learnt as its normal over the first judged steps (local rank 0
            # often decodes or logs for its node), unless it is slower than any normal can be.
            # The window's median of the unclipped ratio is the offset (the clipped mean would be bounded
            # by the clip around a normal not yet learnt).
            # The offset is the mean of the window's median over every learning step, not the last
            # window's alone: one 40-step median of a 15%-noisy data wait is off by ~3%, so among 128
            # ranks one is off by ~10%, and a rank that learnt 0.90x as its normal reads as a 1.1x
            # straggler at its usual pace for hundreds of steps (final4-007, rank 103).
            own = self._median_log(0)
            too_slow = own > math.log(s.max_normal_data_ratio)
            hot[0] &= too_slow
            learn0 = np.isfinite(mean[0]) & np.isfinite(own) & ~too_slow
            self.base[0, learn0] = self._learnt(0, learn0, own)
            # A GPU's own compute speed likewise, up to the forward cap (min_ratio): one 5% slower than
            # its peers from the first step is its normal, learnt before it is judged against it, so its
            # first window is not a straggler; one slower than that by min_ratio still is.
            fwd = PHASES.index("forward")
            own_fwd = self._median_log(fwd)
            ok = np.isfinite(own_fwd)
            self.base[fwd, ok] = np.clip(
                self._learnt(fwd, ok, own_fwd), -self._cap[fwd, 0], self._cap[fwd, 0]
            )
        # Forward holds a wait (DDP's buffer broadcast, FSDP's all-gathers) when a rank slow in data
        # is FASTER than its peers in forward: it is the one they wait for there, so their long
        # forwards are theirs to wait, not to blame.
        with np.errstate(invalid="ignore"):
            waits_in_forward = bool(np.any((mean[0] >= lo) & (mean[1] <= -lo)))
        if waits_in_forward:
            hot[1] &= mean[0] >= lo
            warm[1] &= mean[0] >= lo
        learn = np.isfinite(mean) & ~warm & ~self.slow[None, :]  # never learn a slowdown as normal
        if learning:
            learn[:] = False  # set directly above
        self.base[learn] += (mean[learn] - self.base[learn]) / s.baseline_steps
        self.slow_now = hot.any(axis=0)
        still = warm.any(axis=0)
        lead = np.argmax(np.where(hot, np.nan_to_num(excess, nan=-1.0), -1.0), axis=0)
        self.phase = np.where(self.slow_now, lead, self.phase)  # keep the last phase while it clears
        began = self.slow_now & (self.run == 0)
        self.run = np.where(self.slow_now, self.run + 1, 0)
        self._run_step[began], self._run_ts[began] = frame.step, frame.ts
        self.quiet = np.where(still, 0, self.quiet + 1)
        self._node_verdicts(frame, still)
        # Ranks of a node that looks slow as a whole wait longer to count alone (see module docstring).
        crowd = np.zeros(self.ctx.n_ranks, dtype=bool)
        known = self.node_of >= 0
        if self.node_size.size:
            frac = self.node_slow_count / np.maximum(self.node_size, 1)
            crowd[known] = frac[self.node_of[known]] >= 0.5
        need = np.where(crowd, 2 * s.confirm_steps, s.confirm_steps)
        lasted = frame.ts - self._run_ts >= s.min_duration_s
        start = ~self.slow & (self.run >= need) & lasted
        stop = self.slow & (self.quiet >= s.clear_steps)
        self.slow_since[start] = self._run_step[start]  # the step its window first crossed the bar
        self.slow_since_ts[start] = self._run_ts[start]
        self.slow = (self.slow | start) & ~stop

    def _learnt(self, phase: int, ranks: np.ndarray, own: np.ndarray) -> np.ndarray:
        """Add this step's window medians `own` of the `ranks` (a mask) to what is being learnt; return
        their mean over the learning steps so far."""
        self._learn_sum[phase, ranks] += own[ranks]
        self._learn_n[phase, ranks] += 1
        return np.asarray(self._learn_sum[phase, ranks] / self._learn_n[phase, ranks])

    def _median_log(self, phase: int, ranks: np.ndarray | None = None) -> np.ndarray:
        """Median over the window of each rank's unclipped log ratio in `phase` (NaN: no values)."""
        raw = self._raw[:, phase, :] if ranks is None else self._raw[:, phase, ranks]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a rank with no value yet: NaN is the answer
            return np.asarray(np.log(np.nanmedian(raw, axis=0)))

    def _persistent(self, hot: np.ndarray, lo: float) -> np.ndarray:
        """Of the hot (phase, rank) pairs, those whose slowness holds for most of the window: in data,
        the median of the unclipped per-step ratio is slow too. A rank's hiccup (its data wait several
        times longer for up to a quarter of the window: a slow shard, a loader worker restarted) moves
        the clipped mean, not the median (a node's hiccup is not in the window: `_node_hiccup`).
        Forward is left as it is: compute slows for good or for one step (a GC pause, which the clip
        bounds), so a forward straggler is found as soon as the mean says so."""
        out = hot.copy()  # forward: compute has no hiccups of many steps (a GC pause is one, clipped)
        for p in (PHASES.index("data"),):
            ranks = np.flatnonzero(hot[p])
            if ranks.size:
                base = np.clip(self.base[p, ranks], -self._cap[p, 0], self._cap[p, 0])
                with np.errstate(invalid="ignore"):
                    out[p, ranks] = self._median_log(p, ranks) - base >= lo
        return out

    def _node_verdicts(self, frame: StepFrame, still: np.ndarray) -> None:
        s = self.s
        if not self.node_names:
            return
        known = self.node_of >= 0
        n = len(self.node_names)
        count = np.bincount(self.node_of[known], weights=self.slow_now[known], minlength=n).astype(np.int64)
        still_count = np.bincount(self.node_of[known], weights=still[known], minlength=n)
        need = np.maximum(2, np.ceil(s.node_fraction * self.node_size - 1e-9))
        self.node_slow_count = count
        self.node_slow_now = (count >= need) & (self.node_size >= 2)
        began = self.node_slow_now & (self.node_run == 0)
        self.node_run = np.where(self.node_slow_now, self.node_run + 1, 0)
        self._node_run_step[began], self._node_run_ts[began] = frame.step, frame.ts
        self.node_quiet = np.where(still_count >= self.node_size / 2, 0, self.node_quiet + 1)
        lasted = frame.ts - self._node_run_ts >= s.min_duration_s
        start = ~self.node_slow & (self.node_run >= s.confirm_steps) & lasted
        stop = self.node_slow & (self.node_quiet >= s.clear_steps)
        self.node_since[start] = self._node_run_step[start]
        self.node_since_ts[start] = self._node_run_ts[start]
        self.node_slow = (self.node_slow | start) & ~stop

    def _refresh_nodes(self) -> None:
        """Follow ctx.node (names arrive with batches); keep node state for names already known."""
        if self._node_names == self.ctx.node:
            return
        self._node_names = list(self.ctx.node)
        names = sorted({n for n in self._node_names if n})
        old = {name: i for i, name in enumerate(self.node_names)}
        keep = np.array([old.get(name, -1) for name in names], dtype=np.int64)

        def carry(arr: np.ndarray, fill: float | int | bool) -> np.ndarray:
            out = np.full(len(names), fill, dtype=arr.dtype)
            hit = keep >= 0
            out[hit] = arr[keep[hit]]
            return out

        self.node_run, self.node_quiet = carry(self.node_run, 0), carry(self.node_quiet, 0)
        self.node_hiccup = carry(self.node_hiccup, 0)
        self.node_slow, self.node_slow_now = carry(self.node_slow, False), carry(self.node_slow_now, False)
        self.node_slow_count = carry(self.node_slow_count, 0)
        self.node_since, self.node_since_ts = carry(self.node_since, -1), carry(self.node_since_ts, np.nan)
        self._node_run_step = carry(self._node_run_step, -1)
        self._node_run_ts = carry(self._node_run_ts, np.nan)
        self.node_names = names
        index = {name: i for i, name in enumerate(names)}
        self.node_of = np.array([index.get(n, -1) if n else -1 for n in self._node_names], dtype=np.int64)
        known = self.node_of >= 0
        self.node_size = np.bincount(self.node_of[known], minlength=len(names)).astype(np.int64)
        table = np.full((len(names), max(1, int(self.node_size.max(initial=0)))), -1, dtype=np.int64)
        for n in range(len(names)):
            members = np.flatnonzero(self.node_of == n)
            table[n, : members.size] = members
        self._node_table = table

    # -- questions ---------------------------------------------------------------------------------
    def node_slow_of(self, rank: int) -> bool:
        n = int(self.node_of[rank])
        return n >= 0 and bool(self.node_slow[n])

    def window_ratio(self, phase: int, ranks: np.ndarray | int) -> np.ndarray:
        """Median over the window of the unclipped per-step ratio to the peers' median."""
        cols = np.atleast_2d(self._raw[:, phase, ranks].T)  # (ranks, window)
        return _row_median(cols)[:, 0]

    def excess_frac(self, phase: int, ranks: np.ndarray | int) -> np.ndarray:
        """The share of each step the run loses to the ranks (evidence): the window's median unclipped
        ratio - 1, times the phase's share of the step (the clipped mean that judges them says at most
        25%, which would report a rank at 40x its peers as costing a few tenths of a percent)."""
        share = float(self.share[phase]) if np.isfinite(self.share[phase]) else float("nan")
        return np.asarray((self.window_ratio(phase, ranks) - 1.0) * share)


def _row_median(a: np.ndarray) -> np.ndarray:
    """Median of each row's finite values, as a column (0 for a row with none)."""
    if np.isfinite(a).all():
        return np.median(a, axis=1, keepdims=True)
    out = np.zeros((a.shape[0], 1))
    for i, row in enumerate(a):
        ok = row[np.isfinite(row)]
        if ok.size:
            out[i, 0] = np.median(ok)
    return out


def run_slowness_settings(
    defaults: Mapping[str, DetectorSettings], overrides: Mapping[str, Mapping[str, Any]]
) -> tuple[SlownessSettings, list[str]]:
    """The one set of slowness settings of a run: each shared field as `straggler` or `slow_node`
    overrides it (`straggler` wins where both do, differently), else the default. `defaults` maps the
    kinds that run to their settings. Returns the settings and the conflicts, one line each."""
    names = [f.name for f in dataclasses.fields(SlownessSettings)]
    values: dict[str, Any] = {}
    conflicts = []
    for kind in ("slow_node", "straggler"):  # straggler last: it wins a conflict
        if kind not in defaults:
            continue
        for name in names:
            if name in overrides.get(kind, {}):
                value = getattr(defaults[kind], name)
                if name in values and values[name] != value:
                    conflicts.append(f"{name}: slow_node {values[name]!r}, straggler {value!r} (used)")
                values[name] = value
    return SlownessSettings(**values), conflicts


PER_RANK = {  # RankSlowness's per-rank state (rows on the last axis): the fill of a rank heard from later
    "_log": 0.0,
    "_raw": np.nan,
    "_valid": False,
    "_sum": 0.0,
    "_sumsq": 0.0,
    "_count": 0,
    "mean": 0.0,
    "base": 0.0,
    "_learn_sum": 0.0,
    "_learn_n": 0.0,
    "z": 0.0,
    "slow_now": False,
    "phase": 0,
    "run": 0,
    "quiet": 0,
    "slow": False,
    "slow_since": -1,
    "slow_since_ts": np.nan,
    "_run_step": -1,
    "_run_ts": np.nan,
    "node_of": -1,
}


def run_slowness(ctx: RunContext, settings: DetectorSettings, node_reporting: bool = False) -> RankSlowness:
    """The run's one RankSlowness (`ctx.slowness`). The detection engine creates it with the run's
    settings before the detectors; a detector built by hand on a bare context creates it on first
    use, with its own settings."""
    if ctx.slowness is None:
        ctx.slowness = RankSlowness(ctx, slowness_settings(settings))
    tracker: RankSlowness = ctx.slowness
    tracker.node_reporting |= node_reporting
    return tracker
