"""`throughput_drop`: the whole run's step time rising well above its own baseline.

Why it means trouble: when every rank slows down together (power or thermal capping across the
cluster, a slow shared filesystem, a congested network fabric, a co-scheduled job, a config change
after a resume) no rank stands out, so `straggler` and `slow_node` stay silent, yet the run burns
GPU-hours at a lower rate and may miss its deadline.

The signal: per step, the run's pace: the median over ranks of `time.step_ms` (synchronous ranks
share it) less the slowest rank's excess of data + forward time over the median rank's, i.e. the step
as if no single rank had held the others up. A GC pause on one rank (at 512 ranks, some rank pauses on
half of the steps, which makes the raw step time bimodal) or a straggler is not a drop of the run
(`straggler` reports it); a slowdown of every rank is. Without data/forward times the median step time
is used as it is. The recent level is the median
of the last `recent_steps` (20) judged steps, so single slow steps (GC, a storage hiccup) cannot move
it; the baseline is the median of the `baseline_steps` (512) judged steps before those, fed only while
the run is not in a drop (so a long drop is not learnt as normal) and needed for at least
`min_baseline_steps` (100) steps before anything is judged. A drop opens when recent / baseline >=
`min_ratio` (1.2) for `confirm_steps` (5) judged steps in a row and resolves after `clear_steps` (20)
in a row below `clear_ratio` (1.1). It must also have lasted `min_duration_s` (60 s) of event time:
with short steps (a 10 ms CPU step, a 100 ms GPU step) 5 steps are a fraction of a second, and a few
seconds of contention (a co-scheduled process's burst, a GC storm, checkpoint I/O of another job)
slow a run by 1.2-3x and pass; the causes worth an alarm (power or thermal capping, a slow shared
filesystem, a co-scheduled job, a changed config) last minutes to hours. Steps inside marked pauses (eval, checkpoint: their time sits in
the next step's data time) and the `skip_after_pause_steps` after them are not judged, nor the first
`warmup_steps` (compilation, autotuning).

Why 1.2: GPU clocks, input pipelines and collectives vary a few percent over hours; a fifth more time
per step is a cost anyone would want to know about; the pace of the suite's clean runs stays within
2% of its baseline, and logs that report only the step time (no per-phase times) are noisier. The open
straggler/slow_node anomalies are named in the evidence, so that a cause is one click away.

Evidence: recent and baseline step time (ms), the ratio (and its peak so far), the phase whose median grew the most (data,
forward, backward incl. the collective wait, optimizer) with its before/after, the steps it has lasted,
and the open straggler/slow_node keys. Severity: warning; critical from `critical_ratio` (1.5x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

from stepwatch_server.detect.anomalies import Severity
from stepwatch_server.detect.base import Detector, DetectorSettings
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.detectors._slowness import PauseGate
from stepwatch_server.detect.frames import StepFrame

STEP_METRIC = "time.step_ms"
PHASES = ("data", "forward", "backward", "optimizer")
PHASE_METRICS = tuple(f"time.{p}_ms" for p in PHASES)
CAUSE_KINDS = ("straggler", "slow_node")


@dataclass(frozen=True)
class ThroughputDropSettings(DetectorSettings):
    recent_steps: int = 20  # median of these: half of them must be slow, so GC/storage blips cannot
    baseline_steps: int = 512  # the run's normal pace: a few minutes to an hour of steps
    min_baseline_steps: int = 100  # judge nothing before the baseline has this many steps
    min_ratio: float = 1.2  # a fifth more time per step: real money, above the level noise of busy runs
    clear_ratio: float = 1.1  # hysteresis: back within 10% of the baseline
    confirm_steps: int = 5  # judged steps in a row at/over min_ratio -> open ...
    min_duration_s: float = 60.0  # ... lasting this long in event time: shorter slowdowns are blips
    clear_steps: int = 20  # judged steps in a row under clear_ratio -> resolve
    critical_ratio: float = 1.5  # the run takes half again as long per step
    warmup_steps: int = 20  # compilation, autotuning and the first slow steps are not judged
    skip_after_pause_steps: int = 5  # steps after a marked pause (eval, checkpoint) not judged


class ThroughputDropDetector(Detector):
    kind = "throughput_drop"
    Settings = ThroughputDropSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        super().__init__(ctx, settings)
        s = self.s = cast(ThroughputDropSettings, settings)
        self.gate = PauseGate(s.skip_after_pause_steps)
        P = len(PHASES) + 1  # column 0: step time; then the phases
        self._recent = np.full((s.recent_steps, P), np.nan)
        self._base = np.full((s.baseline_steps, P), np.nan)
        self._steps = np.zeros(s.recent_steps, dtype=np.int64)  # step and event time of each recent row
        self._ts = np.zeros(s.recent_steps)
        self._n_recent = 0
        self._n_base = 0
        self._base_med = np.full(P, np.nan)  # median of the baseline ring, as of _base_at entries
        self._base_at = 0
        self.hot = 0  # judged steps in a row at/over min_ratio
        self.hot_since_ts = float("nan")  # event time of the first of them
        self._onset = (-1, float("nan"))  # (step, ts) where that streak's slow steps began
        self.cool = 0  # judged steps in a row under clear_ratio
        self.since_step = -1
        self.since_ts = float("nan")
        self.peak = float("nan")  # the largest ratio of the open drop

    def on_frame(self, frame: StepFrame) -> None:
        s = self.s
        if frame.step <= s.warmup_steps or self.gate.skip(frame, self.ctx):
            return
        col = frame.metrics.get(STEP_METRIC)
        if col is None or not np.isfinite(col).any():
            return
        nan = np.full(col.shape, np.nan)
        table = np.stack([col] + [frame.metrics.get(name, nan) for name in PHASE_METRICS])
        row = self._median(table.T)  # step time and each phase, median over ranks
        row[0] = self._pace(frame, float(row[0]))
        is_open = self.ctx.book.is_open(self.kind, "run")
        # The value leaving the recent window joins the baseline, unless the run is (or may be) slow.
        slot = self._n_recent % s.recent_steps
        leaving = self._recent[slot].copy()
        self._recent[slot] = row
        self._steps[slot], self._ts[slot] = frame.step, frame.ts
        self._n_recent += 1
        if self._n_recent > s.recent_steps and not is_open and self.hot == 0:
            self._base[self._n_base % s.baseline_steps] = leaving
            self._n_base += 1
        if self._n_base < s.min_baseline_steps or self._n_recent < s.recent_steps:
            return
        recent = self._median(self._recent)
        # The baseline moves by one step in 512: its median is refreshed every 8 new steps once full.
        moved = self._n_base - self._base_at
        if moved >= 8 or (moved > 0 and self._n_base < s.baseline_steps):
            self._base_med, self._base_at = self._median(self._base), self._n_base
        base = self._base_med
        if not (base[0] > 0 and np.isfinite(recent[0])):
            return
        ratio = float(recent[0] / base[0])
        if ratio >= s.min_ratio and self.hot == 0 and not is_open:
            # The median crossed when half of the recent window was slow: a drop is dated from there.
            back = (self._n_recent - 1 - s.recent_steps // 2) % s.recent_steps
            self.hot_since_ts = frame.ts
            self._onset = (int(self._steps[back]), float(self._ts[back]))
        self.hot = self.hot + 1 if ratio >= s.min_ratio else 0
        self.cool = self.cool + 1 if ratio < s.clear_ratio else 0
        if is_open:
            if self.cool >= s.clear_steps:
                self.ctx.book.resolve(self.kind, "run", step=frame.step, ts=frame.ts)
                self.hot = 0
            elif self.hot:  # updated while slow; left alone while it clears
                self._raise(frame, ratio, recent, base)
        elif self.hot >= s.confirm_steps and frame.ts - self.hot_since_ts >= s.min_duration_s:
            self.since_step, self.since_ts = self._onset
            self._raise(frame, ratio, recent, base)

    @staticmethod
    def _pace(frame: StepFrame, step_ms: float) -> float:
        """The step time as if the slowest rank had been a median one before the collective.

        Step end = max over ranks of (data + forward + ...) + the collective: one rank's GC pause or a
        straggler lengthens everyone's step. Taking off the slowest rank's excess of data + forward
        over the median rank's leaves the pace of the run as a whole, which is what this detector
        judges (a straggler is `straggler`'s; at 512 ranks some rank pauses for GC on half the steps).
        """
        data, fwd = frame.metrics.get("time.data_ms"), frame.metrics.get("time.forward_ms")
        if data is None or fwd is None:
            return step_ms
        pre = (data + fwd)[np.isfinite(data + fwd)]
        if pre.size < 2:
            return step_ms
        pace = step_ms - float(pre.max() - np.median(pre))
        return pace if pace > 0.1 * step_ms else step_ms  # else the phase times make no sense

    @staticmethod
    def _median(ring: np.ndarray) -> np.ndarray:
        if np.isfinite(ring).all():
            return np.asarray(np.median(ring, axis=0))
        out = np.full(ring.shape[1], np.nan)
        for i in range(ring.shape[1]):
            ok = ring[:, i][np.isfinite(ring[:, i])]
            if ok.size:
                out[i] = np.median(ok)
        return out

    def _raise(self, frame: StepFrame, ratio: float, recent: np.ndarray, base: np.ndarray) -> None:
        grew = recent[1:] - base[1:]
        p = int(np.nanargmax(grew)) if np.isfinite(grew).any() else -1
        steps = frame.step - self.since_step + 1
        is_new = not self.ctx.book.is_open(self.kind, "run")
        self.peak = ratio if is_new else max(self.peak, ratio)
        causes = [a.key for k in CAUSE_KINDS for a in self.ctx.book.open_of(k)]
        summary = (
            f"run step time {ratio:.2f}x its baseline ({recent[0]:.0f} ms vs {base[0]:.0f} ms) "
            f"for {steps} steps"
        )
        if p >= 0:
            summary += f"; most of it in {PHASES[p]} (+{grew[p]:.0f} ms)"
        if causes:
            summary += f"; open: {', '.join(causes[:3])}"

        def ms(x: float) -> float | None:
            return round(float(x), 3) if np.isfinite(x) else None

        evidence = {
            "measure": "step time less the slowest rank's data+forward excess over the median rank",
            "ratio": round(ratio, 4),
            "peak_ratio": round(self.peak, 4),
            "recent_step_ms": ms(recent[0]),  # the pace (see `measure`)
            "baseline_step_ms": ms(base[0]),
            "phase": PHASES[p] if p >= 0 else None,
            "phase_recent_ms": {name: ms(recent[i + 1]) for i, name in enumerate(PHASES)},
            "phase_baseline_ms": {name: ms(base[i + 1]) for i, name in enumerate(PHASES)},
            "slow_steps": steps,
            "recent_steps": self.s.recent_steps,
            "open_causes": causes,
        }
        severity: Severity = "critical" if ratio >= self.s.critical_ratio else "warning"
        self.ctx.book.raise_(
            self.kind,
            "run",
            step=frame.step,
            ts=frame.ts,
            severity=severity,
            summary=summary,
            evidence=evidence,
            first_step=self.since_step,
            first_ts=self.since_ts,
        )
