"""`fp8_overflow_risk`: a tracked tensor's amax outgrows what FP8 delayed scaling represents, or grows
exponentially (attention or output logits on their way to an instability).

Why it matters: FP8 holds at most 448 (E4M3, forward tensors) or 57344 (E5M2, gradients). Under
delayed scaling (Transformer Engine's `DelayedScaling`) a tensor is multiplied by
scale = FP8_MAX / (2^margin x H) before the cast, where H is the largest amax in the tensor's
amax history (the last `amax_history_len` steps, TE default 1024, `amax_compute_algo="max"`), taken
from the steps BEFORE the current one. The current tensor overflows (saturates, or turns NaN with a
non-saturating cast) when amax x scale > FP8_MAX, that is when amax > 2^margin x H. So

    headroom_bits = log2(FP8_MAX / (amax x scale)) = margin + log2(H / amax)

FP8_MAX cancels: under delayed scaling the format's maximum never binds by itself; what binds is how
far the current amax has moved above the history max. A jump (a tensor suddenly 2-4x larger than
anything in its history) overflows on that step; steady exponential growth at g bits/step overshoots
by g bits per scale update (the history lags one step) and predicts the instability itself: growing
attention-logit or output-logit amax precedes loss spikes and divergence. Without per-tensor
rescaling (a fixed or stale scale, unscaled FP8 attention inputs) the raw amax meets 448/57344 in
log2(FP8_MAX / amax) / g steps; that projection is reported as the trend's horizon.

Signal (per module, on sampled steps, `frame.tensors["amax"]`, max over ranks):
- jump: headroom_bits < -`jump_bits`, with H the max of the module's sampled amax over the last
  `history_steps` steps (sampled history: between samples the true history has also grown, so this
  errs towards overflow by at most growth x sample interval);
- growth: the Theil-Sen slope of log2(amax) per step over the last `window_samples` samples (at most
  one kept per `sample_gap_steps`, so the window spans >= 480 steps however often the agent samples) is at
  least `min_growth_bits_per_step`, and so is the slope of the latest half of the window (the growth
  is still going on, not an old step-up).
A run resumed from a checkpoint (steps go back) starts the history again. Resolves after
`clear_samples` samples with neither (growth below half the threshold, headroom
above -jump_bits / 2).

Evidence: `module`, `amax`, `rank` (the rank with the max), `history_max`, `history_steps`,
`headroom_bits`, `growth_bits_per_step`, `doubling_steps`, `window_steps`, `e4m3_headroom_bits`,
`e5m2_headroom_bits` (log2(FP8_MAX / amax)), `steps_to_e4m3`, `steps_to_e5m2` (at the current
growth, 0 when already past), `jump`.

Defaults: `history_steps` 1024 (TE's default history), `margin_bits` 0 (TE's default margin).
`window_samples` 48 (480 steps at the agent's default of one amax sample every 10 steps).
`min_growth_bits_per_step` 0.004 (amax doubling every 250 steps): a healthy run's amax wanders by
~0.1-0.3 bits over hundreds of steps (slopes of ~0.001 bits/step) and grows early in training by at
most ~0.002-0.003 bits/step, fading; logit blow-ups grow 0.005-0.01 bits/step. The bar sits between the
two (it was 0.003, the top of the healthy early growth: noisy early windows crossed it, 2-3 false
alarms on every split of the world). `jump_bits` 1: an
amax twice its whole history max clips the top half of the range. Critical on a jump or when the
raw amax meets E4M3's 448 within `critical_steps` (1000) steps; warning otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from stepwatch_server.detect.base import Detector, DetectorSettings
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.frames import StepFrame

KIND = "fp8_overflow_risk"
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
MAX_MODULES = 512  # tracked tensors followed per run (the aligner keeps at most as many)
RING_SAMPLES = 128  # sampled amax kept per module: enough for the history and the growth window


@dataclass(frozen=True)
class Fp8OverflowSettings(DetectorSettings):
    history_steps: int = 1024  # delayed-scaling amax history (TE amax_history_len)
    margin_bits: float = 0.0  # delayed-scaling margin (TE margin)
    window_samples: int = 48  # samples in the growth window
    sample_gap_steps: int = 10  # at most one sample per this many steps is kept (amax_every=1 or 10 alike)
    min_growth_bits_per_step: float = 0.004  # sustained growth that is a risk (x2 per 250 steps)
    jump_bits: float = 1.0  # amax this many bits above its history max: overflow now
    # Jumps are judged once a module has this many earlier samples: in the first steps of training
    # activations move from their initial scale to their trained one, which is not a risk signal.
    min_history_samples: int = 10
    critical_steps: int = 1000  # raw amax reaching 448 within this many steps: critical
    clear_samples: int = 10  # samples without risk before an open anomaly resolves


class Fp8OverflowDetector(Detector):
    kind: ClassVar[str] = KIND
    Settings: ClassVar[type[DetectorSettings]] = Fp8OverflowSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        super().__init__(ctx, settings)
        assert isinstance(settings, Fp8OverflowSettings)
        self.s: Fp8OverflowSettings = settings
        self._index: dict[str, int] = {}
        self._names: list[str] = []
        self._steps = np.zeros((0, RING_SAMPLES))  # per module: sampled steps (NaN: empty)
        self._log2 = np.zeros((0, RING_SAMPLES))  # per module: log2(amax)
        self._n = np.zeros(0, dtype=np.int64)  # samples written per module
        self._clear = np.zeros(0, dtype=np.int64)  # consecutive samples without risk
        self._last_step = -1

    def _rows(self, names: list[str]) -> np.ndarray:
        for name in names:
            if name not in self._index and len(self._names) < MAX_MODULES:
                self._index[name] = len(self._names)
                self._names.append(name)
        grow = len(self._names) - self._n.shape[0]
        if grow > 0:
            self._steps = np.vstack([self._steps, np.full((grow, RING_SAMPLES), np.nan)])
            self._log2 = np.vstack([self._log2, np.full((grow, RING_SAMPLES), np.nan)])
            self._n = np.concatenate([self._n, np.zeros(grow, dtype=np.int64)])
            self._clear = np.concatenate([self._clear, np.zeros(grow, dtype=np.int64)])
        return np.array([self._index.get(n, -1) for n in names], dtype=np.int64)

    def on_frame(self, frame: StepFrame) -> None:
        amax_by_name = frame.tensors.get("amax")
        if not amax_by_name:
            return
        if frame.step < self._last_step:  # a run resumed from a checkpoint: its history starts again
            self._steps[:] = np.nan
            self._log2[:] = np.nan
            self._n[:] = 0
        self._last_step = frame.step
        names = list(amax_by_name)
        values = np.abs(np.stack([amax_by_name[n] for n in names]))  # (m, R)
        ok = (np.isfinite(values) & (values > 0)).any(axis=1)  # non-finite amax is `nonfinite`'s job
        if not ok.any():
            return
        names = [n for n, good in zip(names, ok.tolist(), strict=True) if good]
        values = np.where(np.isfinite(values[ok]) & (values[ok] > 0), values[ok], np.nan)
        rows = self._rows(names)
        keep = rows >= 0
        rows, values = rows[keep], values[keep]
        names = [n for n, k in zip(names, keep.tolist(), strict=True) if k]
        amax = np.nanmax(values, axis=1)
        argmax = np.nanargmax(values, axis=1)
        log2 = np.log2(amax)
        # Delayed scaling: the history before this step.
        steps_hist = self._steps[rows]
        in_hist = steps_hist > frame.step - self.s.history_steps
        hist_max = np.nanmax(np.where(in_hist, self._log2[rows], -np.inf), axis=1)
        headroom = self.s.margin_bits + hist_max - log2  # -inf history: no headroom known yet
        settled = self._n[rows] >= self.s.min_history_samples
        # Keep one sample per sample_gap_steps: the growth window spans the same steps however often
        # the agent samples (every step, a 48-sample window would be 48 steps of amax wander).
        last = self._steps[rows, (self._n[rows] - 1) % RING_SAMPLES]
        take = (self._n[rows] == 0) | ~(frame.step - last < self.s.sample_gap_steps)
        kept = rows[take]
        slot = self._n[kept] % RING_SAMPLES
        self._steps[kept, slot] = frame.step
        self._log2[kept, slot] = log2[take]
        self._n[kept] += 1
        slope, recent, window_steps = self._growth(rows)
        s = self.s
        jump = settled & np.isfinite(headroom) & (headroom < -s.jump_bits)
        growing = (slope >= s.min_growth_bits_per_step) & (recent >= s.min_growth_bits_per_step)
        quiet = ~(slope >= s.min_growth_bits_per_step / 2) & ~(
            np.isfinite(headroom) & (headroom < -s.jump_bits / 2)
        )
        self._clear[rows] = np.where(quiet, self._clear[rows] + 1, 0)
        for i in np.flatnonzero(jump | growing).tolist():
            self._raise(frame, names[i], float(amax[i]), self.ctx.rank_of(int(argmax[i])), float(hist_max[i]),
                        float(headroom[i]), float(slope[i]), int(window_steps[i]), bool(jump[i]))  # fmt: skip
        for i in np.flatnonzero(self._clear[rows] >= s.clear_samples).tolist():
            if self.ctx.book.is_open(KIND, f"module:{names[i]}"):
                self.ctx.book.resolve(
                    KIND, f"module:{names[i]}", step=frame.step, ts=frame.ts, note="amax stopped growing"
                )

    def _growth(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Theil-Sen slope (log2 per step) over the window and over its latest half, per row."""
        w = self.s.window_samples
        n = self._n[rows]
        full = n >= w
        out = np.full(rows.shape[0], np.nan)
        recent = np.full(rows.shape[0], np.nan)
        span = np.zeros(rows.shape[0])
        if not full.any():
            return out, recent, span
        r = rows[full]
        # The last w samples of each row, oldest first.
        idx = (n[full, None] - w + np.arange(w)[None, :]) % RING_SAMPLES
        x = np.take_along_axis(self._steps[r], idx, axis=1)
        y = np.take_along_axis(self._log2[r], idx, axis=1)
        out[full] = _theil_sen(x, y)
        recent[full] = _theil_sen(x[:, w // 2 :], y[:, w // 2 :])
        span[full] = x[:, -1] - x[:, 0]
        return out, recent, span

    def _raise(
        self, frame: StepFrame, name: str, amax: float, rank: int, hist_max_log2: float,
        headroom: float, slope: float, window_steps: int, jump: bool,
    ) -> None:  # fmt: skip
        s = self.s
        hist_max = 2.0**hist_max_log2 if math.isfinite(hist_max_log2) else None
        e4m3 = math.log2(E4M3_MAX / amax)
        e5m2 = math.log2(E5M2_MAX / amax)
        growth = slope if math.isfinite(slope) and slope > 0 else 0.0

        def steps_to(bits: float) -> int | None:
            if bits <= 0:
                return 0
            return int(bits / growth) if growth > 0 else None

        to_e4m3, to_e5m2 = steps_to(e4m3), steps_to(e5m2)
        evidence: dict[str, Any] = {
            "module": name,
            "amax": round(amax, 4),
            "rank": rank,
            "history_max": None if hist_max is None else round(hist_max, 4),
            "history_steps": s.history_steps,
            "headroom_bits": round(headroom, 3) if math.isfinite(headroom) else None,
            "growth_bits_per_step": round(growth, 5),
            "doubling_steps": int(1 / growth) if growth > 0 else None,
            "window_steps": window_steps,
            "e4m3_headroom_bits": round(e4m3, 3),
            "e5m2_headroom_bits": round(e5m2, 3),
            "steps_to_e4m3": to_e4m3,
            "steps_to_e5m2": to_e5m2,
            "jump": jump,
        }
        parts = [f"module {name}: amax {amax:.4g} (max over ranks, rank {rank})"]
        if jump:
            parts.append(
                f"jumped {-headroom:.1f} bits above its {s.history_steps}-step history max {hist_max:.4g}: "
                "overflows FP8 under delayed scaling"
            )
        if growth >= s.min_growth_bits_per_step:
            horizon = (
                "already past E4M3's 448" if to_e4m3 == 0 else f"reaches E4M3's 448 in ~{to_e4m3:,} steps"
            )
            e5 = "" if to_e5m2 is None else f", E5M2's 57344 in ~{to_e5m2:,}"
            parts.append(
                f"growing {growth:.4f} bits/step (x2 every {int(1 / growth):,} steps) for {window_steps} "
                f"steps; unscaled it {horizon}{e5}"
            )
            if not jump and math.isfinite(headroom):
                parts.append(f"delayed-scaling headroom {headroom:+.2f} bits")
        critical = jump or (to_e4m3 is not None and to_e4m3 <= s.critical_steps)
        self.ctx.book.raise_(
            KIND,
            f"module:{name}",
            step=frame.step,
            ts=frame.ts,
            severity="critical" if critical else "warning",
            summary="; ".join(parts),
            evidence=evidence,
            first_step=frame.step - window_steps if not jump else frame.step,
        )


def _theil_sen(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Median of pairwise slopes per row of (rows, n) arrays (NaN-tolerant)."""
    i, j = np.triu_indices(x.shape[1], k=1)
    dx = x[:, j] - x[:, i]
    with np.errstate(divide="ignore", invalid="ignore"):
        slopes = np.where(dx > 0, (y[:, j] - y[:, i]) / dx, np.nan)
        return np.nanmedian(slopes, axis=1)
