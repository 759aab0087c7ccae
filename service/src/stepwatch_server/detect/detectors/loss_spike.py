"""`loss_spike`: the global loss jumps far above its recent level, then (usually) comes back.

Why it matters: a loss spike is the visible end of an unstable update (a too-large step through a
sharp region, an outlier batch, attention logits blowing up). One spike that recovers costs
compute; repeated spikes precede divergence, and the remedies (skip the batch, lower the LR, roll
back to a checkpoint) are cheaper the sooner someone knows.

Signal: the global loss of a step (mean over the ranks' finite losses) against a robust rolling
baseline of the `window_frames` steps before it (median and MAD: one earlier spike does not move
them). It is a spike when all three hold:
- it is `min_rel_jump` (15%) above the median: the smooth real runs in ../shared/real-logs never
  exceed 1.10x their median (GPT-2 124M, llm.c) while the smallest spike worth a person's time in
  the simulator is 1.25x;
- it is `min_z` (10) robust standard deviations (1.4826 MAD) above the median: a run whose loss is
  noisy needs a bigger jump than a smooth one. Real losses are heavy-tailed, so this is far above
  Gaussian odds: the 1.5B run in real-logs (a rank-0 micro-batch loss, ~6% noise) makes 55 one-step
  jumps of 8 SDs in 20k steps, 23 of 10 (each >= 1.5x), and its named spike at 14738 is 14; the
  smallest simulated spike (1.23x among 128 ranks) is 31;
- at least `sudden_fraction` of the jump happened against the median of the last `sudden_frames`
  steps: a spike is sudden, a loss creeping up is a trend (the `divergence` detector's business).
Nothing is judged before `warmup_frames` steps with a loss (the early loss falls fast and bumps).
While a spike is open the baseline is frozen, so the spike cannot raise its own reference.

Corroboration: a grad-norm spike in the `grad_lookback_frames` steps up to the spike (the update
that caused it) is reported as evidence (`grad_norm_ratio` against the grad norm's own median); it
is not required, as not every framework logs the grad norm, and grad-norm spikes alone (clipped)
are normal: llm.c's GPT-2 has a 7.5x one with no loss spike.

Severity: a spike corroborated by a grad-norm spike, or still up `sustained_frames` (3) steps after
onset, is a warning (an unstable update); a one-step jump without one is info (an outlier batch).
Lifecycle: one anomaly per run ("run"). Resolved when the loss is back within half the
thresholds (under 7.5% above, or under 5 robust SDs) for `recover_frames` steps. A spike that does not
come back is a divergence: when the `divergence` detector opens one, this spike resolves with a note
saying so, and no new spike opens while the run is diverging. If the loss settles at a new level
without any divergence, the spike resolves after `max_open_frames` and the baseline is relearned.

Evidence: loss, baseline_median, baseline_mad, ratio, z, sudden_ratio, peak_ratio, peak_step,
up_steps, grad_norm_ratio, grad_norm_step (null without a grad norm), corroborated, window_frames.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from stepwatch_server.detect.base import Detector, DetectorSettings
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.frames import StepFrame

KIND = "loss_spike"
REWIND_KEEP = 1024  # losses kept beyond the window, for a run resumed up to this many steps back
KEY = "run"
MAD_TO_SD = 1.4826  # MAD of a normal distribution x this = its standard deviation
MAD_FLOOR_REL = 1e-3  # a (near) constant loss still has this much relative spread


def global_loss(frame: StepFrame) -> float:
    """Mean over ranks of their finite losses (NaN when no rank has one)."""
    loss = frame.metrics.get("loss")
    if loss is None:
        return float("nan")
    ok = np.isfinite(loss)
    return float(loss[ok].mean()) if ok.any() else float("nan")


def global_grad_norm(frame: StepFrame, num_shards: int = 1) -> float:
    """The model's gradient norm at this step: from the shards' sums of squares (`grad_sumsq`: a
    replica's total is the sum over its shards, so over the reporting ranks it is num_shards x their
    mean), else the median over ranks of their grad norms (equal on every DDP rank)."""
    sumsq = frame.metrics.get("grad_sumsq")
    if sumsq is not None:
        ok = np.isfinite(sumsq)
        if ok.any():
            return float(np.sqrt(num_shards * sumsq[ok].mean()))
    g = frame.metrics.get("grad_norm")
    if g is None:
        return float("nan")
    ok = np.isfinite(g)
    return float(np.median(g[ok])) if ok.any() else float("nan")


class RobustWindow:
    """A ring of the last `size` values with their median and robust spread (bounded state). With
    `keep` > 0 it also holds the `keep` values before those, with their steps, so that a run resumed
    from an earlier checkpoint can `rewind` to the window it had at that step. The ring is allocated
    as values arrive (doubling up to `size + keep`), so that a short run holds what it sent, not the
    1,024 values kept for a rewind (the engine keeps the state of up to 1,000 runs)."""

    FIRST = 64  # values allocated at first

    def __init__(self, size: int, keep: int = 0) -> None:
        self.size = size
        self.capacity = size + keep
        first = min(self.capacity, self.FIRST)
        self.buf = np.full(first, np.nan)
        self.steps = np.full(first, -1, dtype=np.int64)
        self.n = 0  # values pushed in total

    def push(self, value: float, step: int = -1) -> None:
        if self.n == self.buf.size < self.capacity:  # never wrapped yet: the values lie in order
            grown = min(self.capacity, 2 * self.buf.size)
            self.buf = np.concatenate([self.buf, np.full(grown - self.buf.size, np.nan)])
            self.steps = np.concatenate([self.steps, np.full(grown - self.steps.size, -1, dtype=np.int64)])
        i = self.n % self.buf.size
        self.buf[i] = value
        self.steps[i] = step
        self.n += 1

    def clear(self) -> None:
        self.buf[:] = np.nan
        self.n = 0

    def rewind(self, step: int) -> None:
        """Keep only the values of steps up to `step`, in order (the steps after it run again)."""
        m = min(self.n, self.buf.size)
        idx = (self.n - m + np.arange(m)) % self.buf.size
        idx = idx[self.steps[idx] <= step]
        values, steps = self.buf[idx].copy(), self.steps[idx].copy()
        self.clear()
        self.buf[: values.size], self.steps[: values.size] = values, steps
        self.n = int(values.size)

    @property
    def full(self) -> bool:
        return self.n >= self.size

    def values(self) -> np.ndarray:
        """The last `size` values (oldest first once the ring holds more than them)."""
        cap = self.buf.size
        if self.n <= self.size or cap == self.size:
            return self.buf[: min(self.n, self.size)]
        return self.buf[(self.n - self.size + np.arange(self.size)) % cap]

    def median(self) -> float:
        v = self.values()
        return _median(v) if v.size else float("nan")

    def median_sd(self) -> tuple[float, float]:
        """(median, robust standard deviation = 1.4826 MAD, floored at a tiny share of the median)."""
        v = self.values()
        med = _median(v)
        mad = _median(np.abs(v - med))
        return med, max(MAD_TO_SD * mad, MAD_FLOOR_REL * abs(med))

    def ordered(self) -> np.ndarray:
        """The values, oldest first."""
        v = self.values()
        if self.buf.size != self.size:
            return v  # already in order
        return np.roll(v, -(self.n % v.size)) if self.full else v

    def trend_next(self) -> tuple[float, float]:
        """(the value the window's robust line predicts for the next one, the robust standard
        deviation of the values around that line). The line runs through the window's median with
        the slope between the medians of its two halves, so a loss still falling fast (just after
        warm-up) is judged against where it is going, not against the level it fell from, and one
        earlier spike moves neither."""
        v = self.ordered()
        n = v.size
        half = n // 2
        if half < 2:
            med, sd = self.median_sd()
            return med, sd
        slope = (_median(v[n - half :]) - _median(v[:half])) / (n - half)  # per value
        x = np.arange(n) - (n - 1) / 2.0
        med = _median(v - slope * x)
        resid = v - (med + slope * x)
        sd = MAD_TO_SD * _median(np.abs(resid - _median(resid)))
        pred = med + slope * (n + 1) / 2.0
        return pred, max(sd, MAD_FLOOR_REL * abs(pred))


def _median(v: np.ndarray) -> float:
    """np.median without its generality (no NaN handling, 1-D): the hot path of both loss detectors."""
    n = v.size
    k = n // 2
    if n % 2:
        return float(np.partition(v, k)[k])
    part = np.partition(v, (k - 1, k))
    return float(0.5 * (part[k - 1] + part[k]))


@dataclass(frozen=True)
class LossSpikeSettings(DetectorSettings):
    window_frames: int = 100  # baseline length: enough for a stable median, short next to the schedule
    warmup_frames: int = 100  # steps with a loss before anything is judged
    min_rel_jump: float = 0.15  # loss >= 1.15x the baseline, with a grad-norm spike to corroborate it
    min_rel_jump_alone: float = 0.25  # ... and >= 1.25x without one: bumps up to ~1.2x are the data's
    min_z: float = 10.0  # and >= 10 robust SDs above it (real micro-batch losses are heavy-tailed)
    sudden_frames: int = 5  # the jump is also measured against the median of these last steps
    sudden_fraction: float = 0.5  # ... and at least this share of it must be sudden
    recover_frames: int = 3  # steps back near the baseline before the spike resolves
    sustained_frames: int = 3  # up this many steps (or corroborated): a warning, else info
    grad_lookback_frames: int = 3  # steps up to the spike searched for the grad-norm spike
    grad_spike_ratio: float = 2.0  # grad norm >= 2x its median counts as corroboration
    max_open_frames: int = 500  # an open spike this old resolves and the baseline is relearned


class LossSpikeDetector(Detector):
    kind: ClassVar[str] = KIND
    Settings: ClassVar[type[DetectorSettings]] = LossSpikeSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        super().__init__(ctx, settings)
        self.s: LossSpikeSettings = settings  # type: ignore[assignment]
        self.base = RobustWindow(self.s.window_frames, keep=REWIND_KEEP)
        self.grads = RobustWindow(self.s.window_frames, keep=REWIND_KEEP)
        self.recent = RobustWindow(self.s.sudden_frames)  # raw global losses, spikes included
        self._last_step = -1
        self.recent_grads = np.full(self.s.grad_lookback_frames, np.nan)
        self.recent_grad_steps = np.full(self.s.grad_lookback_frames, -1, dtype=np.int64)
        self.seen = 0  # frames with a finite global loss
        self._open_frames = 0
        self._up_frames = 0  # steps of the open spike with the loss not yet back near the baseline
        self._recovered = 0
        self._peak: tuple[float, int] = (0.0, -1)  # (ratio, step)
        self._first: dict[str, Any] = {}  # evidence at onset
        self._frozen = (
            float("nan"),
            float("nan"),
        )  # the baseline (prediction, sd) an open spike is judged by

    def on_frame(self, frame: StepFrame) -> None:
        if frame.step <= self._last_step:  # resumed from an earlier checkpoint: these steps run again
            self._rewind(frame)
        self._last_step = frame.step
        gn = global_grad_norm(frame, int(self.ctx.num_shards.max()))
        i = self.seen % self.recent_grads.size
        self.recent_grads[i], self.recent_grad_steps[i] = gn, frame.step
        gl = global_loss(frame)
        if not np.isfinite(gl):
            return
        self.seen += 1
        book = self.ctx.book
        if book.is_open("divergence", "run"):  # the loss is already known to be leaving: no spikes
            if book.is_open(KIND, KEY):
                book.resolve(KIND, KEY, step=frame.step, ts=frame.ts,
                             note="did not recover: reported as a divergence")  # fmt: skip
            self._learn(gl, gn, frame.step)
            return
        if self.seen <= self.s.warmup_frames or self.base.n < self.s.window_frames // 2:
            self._learn(gl, gn, frame.step)
            return
        if book.is_open(KIND, KEY):
            med, sd = self._frozen
            self._follow(frame, gl, gn, med, gl / med, (gl - med) / sd)
            return
        med, sd = self.base.trend_next()
        if not med > 0:
            self._learn(gl, gn, frame.step)
            return
        ratio, z = gl / med, (gl - med) / sd
        short = self.recent.median()
        sudden = gl / short if short > 0 else ratio
        jump = ratio - 1.0
        if (
            jump >= self.s.min_rel_jump
            and z >= self.s.min_z
            and sudden - 1.0 >= self.s.sudden_fraction * jump
        ):
            g_ratio, _ = self._grad_spike()
            corroborated = g_ratio is not None and g_ratio >= self.s.grad_spike_ratio
            if corroborated or jump >= self.s.min_rel_jump_alone:
                self._frozen = (med, sd)
                self._open(frame, gl, med, sd, ratio, z, sudden)
                self.recent.push(gl)
                return
        self._learn(gl, gn, frame.step)

    def _rewind(self, frame: StepFrame) -> None:
        """The baseline as it was before `frame.step` (the losses of the steps that run again are the
        old session's); a spike open on those steps is moot."""
        for window in (self.base, self.grads):
            window.rewind(frame.step - 1)
        self.recent.clear()
        self.recent_grads[:] = np.nan
        self.seen = self.base.n
        if self.ctx.book.is_open(KIND, KEY):
            self.ctx.book.resolve(
                KIND,
                KEY,
                step=frame.step,
                ts=frame.ts,
                note=f"the run resumed from before it (step {frame.step})",
            )

    def _learn(self, gl: float, gn: float, step: int = -1) -> None:
        self.base.push(gl, step)
        self.recent.push(gl)
        if np.isfinite(gn):
            self.grads.push(gn, step)

    # -- an open spike -----------------------------------------------------------------------------
    def _open(
        self, frame: StepFrame, gl: float, med: float, sd: float, ratio: float, z: float, sudden: float
    ) -> None:
        self._open_frames, self._up_frames, self._recovered = 0, 1, 0
        self._peak = (ratio, frame.step)
        g_ratio, g_step = self._grad_spike()
        self._first = {
            "loss": round(gl, 6),
            "baseline": round(med, 6),
            "baseline_sd": round(sd, 6),
            "ratio": round(ratio, 4),
            "z": round(z, 2),
            "sudden_ratio": round(sudden, 4),
            "grad_norm_ratio": None if g_ratio is None else round(g_ratio, 3),
            "grad_norm_step": g_step,
            "corroborated": g_ratio is not None and g_ratio >= self.s.grad_spike_ratio,
            "window_frames": self.s.window_frames,
        }
        self._raise(frame)

    def _follow(self, frame: StepFrame, gl: float, gn: float, med: float, ratio: float, z: float) -> None:
        self._open_frames += 1
        self.recent.push(gl)
        if ratio > self._peak[0]:
            self._peak = (ratio, frame.step)
        near = ratio - 1.0 < self.s.min_rel_jump / 2 or z < self.s.min_z / 2
        self._recovered = self._recovered + 1 if near else 0
        self._up_frames += 0 if near else 1
        if self._recovered >= self.s.recover_frames:
            self.ctx.book.resolve(
                KIND, KEY, step=frame.step, ts=frame.ts,
                note=f"recovered: loss {gl:.4g} is {ratio:.2f}x the baseline median {med:.4g}",
            )  # fmt: skip
            self._learn(gl, gn, frame.step)
        elif self._open_frames >= self.s.max_open_frames:
            self.ctx.book.resolve(
                KIND, KEY, step=frame.step, ts=frame.ts,
                note=f"loss settled at {ratio:.2f}x the old baseline; baseline relearned",
            )  # fmt: skip
            self.base.clear()
            self._learn(gl, gn, frame.step)
        elif not near:  # still up: extend it (recovering steps do not)
            self._raise(frame)

    def _raise(self, frame: StepFrame) -> None:
        e = self._first
        peak, peak_step = self._peak
        if e["grad_norm_ratio"] is None:
            grad = "no grad norm logged"
        elif e["corroborated"]:
            lead = frame_lead(self._first_step(), e["grad_norm_step"])
            grad = f"grad norm {e['grad_norm_ratio']:.1f}x its median {lead}"
        else:
            grad = f"no grad-norm spike (max {e['grad_norm_ratio']:.1f}x its median)"
        summary = (
            f"loss spike at step {self._first_step()}: global loss {e['loss']:.4g} is {e['ratio']:.2f}x "
            f"its rolling baseline {e['baseline']:.4g} ({e['z']:.0f} robust SDs); {grad}"
        )
        if peak_step != self._first_step():
            summary += f"; peak {peak:.2f}x at step {peak_step}"
        serious = e["corroborated"] or self._up_frames >= self.s.sustained_frames
        self.ctx.book.raise_(
            KIND, KEY, step=frame.step, ts=frame.ts, severity="warning" if serious else "info",
            summary=summary,
            evidence={**e, "peak_ratio": round(peak, 4), "peak_step": peak_step, "up_steps": self._up_frames},
            first_step=self._first_step(),
        )  # fmt: skip

    def _first_step(self) -> int:
        anomaly = self.ctx.book.get(KIND, KEY)
        return anomaly.first_step if anomaly is not None else self._peak[1]

    def _grad_spike(self) -> tuple[float | None, int | None]:
        """The largest grad norm of the last few steps (spike included) over the grad norm's median."""
        ok = np.isfinite(self.recent_grads)
        med = self.grads.median()
        if not ok.any() or not med > 0:
            return None, None
        i = int(np.nanargmax(self.recent_grads))
        return float(self.recent_grads[i] / med), int(self.recent_grad_steps[i])


def frame_lead(spike_step: int, grad_step: int | None) -> str:
    if grad_step is None or grad_step == spike_step:
        return "on the same step"
    k = spike_step - grad_step
    return f"{k} step{'s' if k != 1 else ''} before"
