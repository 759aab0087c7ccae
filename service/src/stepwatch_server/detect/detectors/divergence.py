"""`divergence`: the loss leaves its curve and does not come back.

Why it matters: a diverging run burns every GPU-hour from here on. Unlike a spike it does not heal
itself; the fix is to stop, roll back to a checkpoint from before the onset and change something (LR,
warm-up, clipping, the bad data shard). The earlier someone knows, the less compute is lost.

Three signals on the global loss (mean over the ranks' finite losses), any of which opens it:
- no recovery: the loss rises `min_rel_rise` (15%) and `min_z` (6 robust SDs) above the median of
  the `window_frames` steps before and has not come back within half of either for
  `no_recover_frames` (50) steps (so a `loss_spike` that stays is this), unless it is coming back: its
  rise has decayed to `decayed_share` (a quarter) of the peak's (a 2.5-3x spike that takes 50-60 steps
  to come down), for up to twice `no_recover_frames`. The z is lower than
  loss_spike's 10 because 50 steps of persistence, not one value, carry the evidence. A simulated spike of
  1.6x is back under 1.075x within ~20 steps; real one-step spikes recover on the next step. The
  baseline is frozen while the loss is up, so a climbing loss cannot drag its reference along.
- trend: over the last `trend_frames` (400) steps the medians of the four quarters never fall and
  the last quarter's is `trend_min_rise` (15%) above the first's. Healthy loss falls or is flat; the
  slow wander of the data mixture stays within a few percent over 400 steps. Quarter medians
  ignore spikes that recover. This catches slow climbs that the rolling baseline would absorb.
- non-finite: the loss is NaN/Inf (the `nonfinite.loss` flag or an Inf value) on more than
  `nonfinite_rank_fraction` (half) of the reporting ranks (1 of 2 is a bad sample's) for `nonfinite_frames` (3) steps in a row:
  the parameters are gone. One rank's bad sample, or one skipped step, is `nonfinite`'s, not this.

One anomaly per run ("run"), critical, first_step = when the loss started leaving (the onset of
the rise, the start of the trend window, or the first non-finite step). Resolved when none of the
three holds and the loss is back near its pre-divergence baseline for `recover_frames` steps.
Relation to `loss_spike`: the spike that started it is resolved by `loss_spike` with the note "did
not recover: reported as a divergence", so the run shows a warning that became a critical.

Evidence: modes (which signals hold), loss, baseline_median, ratio, elevated_steps, trend_rise,
quarter_medians, nonfinite_ranks, nonfinite_steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from stepwatch_server.detect.base import Detector, DetectorSettings
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.detectors.loss_spike import REWIND_KEEP, RobustWindow, global_loss
from stepwatch_server.detect.frames import StepFrame

KIND = "divergence"
KEY = "run"


@dataclass(frozen=True)
class DivergenceSettings(DetectorSettings):
    window_frames: int = 100  # baseline length (as loss_spike)
    warmup_frames: int = 100  # steps with a loss before the baseline is judged
    min_rel_rise: float = 0.15  # "up": >= 1.15x the baseline median ...
    min_z: float = 6.0  # ... and >= 6 robust SDs above it
    no_recover_frames: int = 50  # up this long without coming back: divergence
    decayed_share: float = 0.25  # ... unless the rise has decayed to this share of its peak (coming back)
    recover_frames: int = 3  # steps back within half the thresholds before "back"
    trend_frames: int = 400  # the trend window (4 quarters of 100)
    trend_min_rise: float = 0.15  # last quarter's median over the first's
    trend_check_every: int = 10  # steps between trend checks (a slow trend is not in a hurry)
    nonfinite_rank_fraction: float = 0.5  # more than this share of reporting ranks with a non-finite loss
    nonfinite_frames: int = 3  # consecutive steps of that


class DivergenceDetector(Detector):
    kind: ClassVar[str] = KIND
    Settings: ClassVar[type[DetectorSettings]] = DivergenceSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        super().__init__(ctx, settings)
        self.s: DivergenceSettings = settings  # type: ignore[assignment]
        self.base = RobustWindow(self.s.window_frames, keep=REWIND_KEEP)
        self.trend = RobustWindow(self.s.trend_frames)  # every finite global loss, in order
        self._last_step = -1
        self.seen = 0
        self.up: dict[str, Any] | None = None  # the current rise: start step/ts, frames, baseline
        self._back = 0  # consecutive steps back near the baseline
        self.nf_run = 0  # consecutive steps with the loss non-finite on most ranks
        self.nf_first: tuple[int, float] = (-1, 0.0)
        self.nf_ranks = 0
        self._clear = 0  # consecutive steps with no signal (for resolving)
        self._trending: tuple[float, list[float]] | None = None  # the last trend check's finding

    def on_frame(self, frame: StepFrame) -> None:
        if frame.step <= self._last_step:  # resumed from an earlier checkpoint: these steps run again
            self._rewind(frame.step)
        self._last_step = frame.step
        self._nonfinite(frame)
        gl = global_loss(frame)
        if np.isfinite(gl):
            self.seen += 1
            self._rise(frame, gl)
            if gl > 0:  # the trend is judged on log loss (a loss <= 0 has no trend to judge here)
                self.trend.push(float(np.log(gl)), frame.step)
                if self.trend.n % self.s.trend_check_every == 0:
                    self._trending = self._trend()
        elif self.up is not None:
            self.up["frames"] += 1  # no loss at all while up: still not back
        self._judge(frame, gl)

    def _rewind(self, step: int) -> None:
        """The windows as they were before `step` (the losses of the steps that run again are the old
        session's): a rise seen on those steps is moot, and an open divergence resolves once the resumed
        loss is back near its baseline (the roll-back the summary asked for)."""
        self.base.rewind(step - 1)
        self.trend.rewind(step - 1)
        self.seen = self.base.n
        self.up = None
        self._trending = None
        self.nf_run = 0

    # -- signals -----------------------------------------------------------------------------------
    def _nonfinite(self, frame: StepFrame) -> None:
        loss = frame.metrics.get("loss")
        flag = frame.metrics.get("nonfinite.loss")
        bad = np.zeros(frame.world_size, dtype=bool)
        if flag is not None:
            bad |= np.nan_to_num(flag, nan=0.0) != 0
        if loss is not None:
            bad |= np.isinf(loss)
        reporting = max(1, int(frame.present.sum()))
        if bad.sum() > self.s.nonfinite_rank_fraction * reporting:
            if self.nf_run == 0:
                self.nf_first = (frame.step, frame.ts)
            self.nf_run += 1
            self.nf_ranks = int(bad.sum())
        else:
            self.nf_run = 0

    def _rise(self, frame: StepFrame, gl: float) -> None:
        if self.seen <= self.s.warmup_frames or self.base.n < self.s.window_frames // 2:
            self.base.push(gl, frame.step)
            return
        if self.up is None:
            med, sd = self.base.median_sd()
            if gl / med - 1.0 >= self.s.min_rel_rise and (gl - med) / sd >= self.s.min_z:
                self.up = {
                    "step": frame.step,
                    "ts": frame.ts,
                    "frames": 1,
                    "median": med,
                    "sd": sd,
                    "peak": gl,
                }
                self._back = 0
            else:
                self.base.push(gl, frame.step)
            return
        med, sd = self.up["median"], self.up["sd"]  # frozen at the onset
        self.up["frames"] += 1
        self.up["peak"] = max(self.up["peak"], gl)
        self.up["loss"] = gl
        near = gl / med - 1.0 < self.s.min_rel_rise / 2 or (gl - med) / sd < self.s.min_z / 2
        self._back = self._back + 1 if near else 0
        if self._back >= self.s.recover_frames:
            self.up = None
            self.base.push(gl, frame.step)

    def _trend(self) -> tuple[float, list[float]] | None:
        """(rise of the last quarter's median over the first's, the quarter medians) when rising."""
        if not self.trend.full:
            return None
        n = self.trend.buf.size
        start = self.trend.n % n
        ordered = np.roll(self.trend.buf, -start)
        q = np.median(ordered[: n - n % 4].reshape(4, n // 4), axis=1)
        if (np.diff(q) < 0).any():
            return None
        rise = float(np.exp(q[-1] - q[0]) - 1.0)
        return (rise, [round(float(np.exp(x)), 5) for x in q]) if rise >= self.s.trend_min_rise else None

    def _coming_back(self, up: dict[str, Any], gl: float) -> bool:
        """A large spike that decays slowly is still a spike: its rise has fallen to `decayed_share` of
        the peak's (for up to twice `no_recover_frames`)."""
        if not np.isfinite(gl) or up["frames"] >= 2 * self.s.no_recover_frames:
            return False
        return bool(gl - up["median"] <= self.s.decayed_share * (up["peak"] - up["median"]))

    # -- the anomaly -------------------------------------------------------------------------------
    def _judge(self, frame: StepFrame, gl: float) -> None:
        modes: list[str] = []
        first: list[tuple[int, float]] = []
        ev: dict[str, Any] = {"loss": None if not np.isfinite(gl) else round(gl, 6)}
        parts: list[str] = []
        up = self.up
        if up is not None and up["frames"] >= self.s.no_recover_frames and not self._coming_back(up, gl):
            modes.append("no_recovery")
            first.append((up["step"], up["ts"]))
            ratio = (gl if np.isfinite(gl) else up["peak"]) / up["median"]
            ev.update(
                baseline_median=round(up["median"], 6), ratio=round(ratio, 4), elevated_steps=up["frames"]
            )
            parts.append(
                f"loss {ratio:.2f}x its pre-rise median {up['median']:.4g} and not back after "
                f"{up['frames']} steps (since step {up['step']})"
            )
        trend = self._trending
        if trend is not None:
            modes.append("trend")
            start = int(self.trend.steps[self.trend.n % self.trend.steps.size])
            first.append((start, frame.ts))
            ev.update(trend_rise=round(trend[0], 4), quarter_medians=trend[1])
            parts.append(
                f"loss rising steadily: +{trend[0]:.0%} over {self.s.trend_frames} steps since {start}"
            )
        if self.nf_run >= self.s.nonfinite_frames:
            modes.append("nonfinite")
            first.append(self.nf_first)
            ev.update(nonfinite_ranks=self.nf_ranks, nonfinite_steps=self.nf_run)
            parts.append(
                f"loss NaN/Inf on {self.nf_ranks} of {frame.world_size} ranks for {self.nf_run} steps "
                f"(since step {self.nf_first[0]})"
            )
        book = self.ctx.book
        if modes:
            if up is not None:  # whatever opened it, the loss started leaving when it rose
                first.append((up["step"], up["ts"]))
            self._clear = 0
            step0, ts0 = min(first)
            ev["modes"] = modes
            book.raise_(
                KIND, KEY, step=frame.step, ts=frame.ts, severity="critical",
                summary="run diverging: " + "; ".join(parts) + " - roll back to a checkpoint before step "
                f"{step0}", evidence=ev, first_step=step0, first_ts=ts0,
            )  # fmt: skip
            return
        if not book.is_open(KIND, KEY):
            return
        self._clear = self._clear + 1 if self.up is None and self.nf_run == 0 else 0
        if self._clear >= self.s.recover_frames:
            book.resolve(
                KIND, KEY, step=frame.step, ts=frame.ts, note="loss back near its pre-divergence level"
            )
