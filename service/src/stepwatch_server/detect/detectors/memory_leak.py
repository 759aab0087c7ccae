"""`memory_leak`: a rank's allocated memory keeps growing, step after step, towards out-of-memory.

Why it matters: a leak (a list that keeps tensors, a growing cache, a graph kept alive by a logged
loss) kills the run hours later with a CUDA OOM, usually at night, and the crash says nothing about
the cause. Seen early, it is a slope with a date: "out of memory in ~5 h".

Physics: memory is not a leak just because it rose. The caching allocator and fragmentation step
memory up by a few hundred MB and then hold it flat (a plateau); optimizer state appears during the
first steps. A leak is a *sustained* positive slope.

Signal (per rank, vectorised): `mem.allocated_mb` (else `mem.rss_mb` for CPU runs) averaged over
blocks of `block_steps` steps; each rank keeps a bounded ring of its last `window_blocks` block means
that hold a value. Device memory comes with every step, so a block is 10 steps; the host RSS comes
once per batch the agent sends (every ~2 s), so on a CPU run a block is one sample and the window is
33 samples, however many steps lie between them. The growth between consecutive block means is
divided by the steps between them; the window is cut into `sub_windows`
consecutive parts and the leak condition is that the MEDIAN growth of EVERY part is at least
`min_mb_per_step` per step. A plateau's ramp (1-40 steps) touches a few block differences of one
part, and a median ignores them; a leak moves every difference of every part. Resolves when the
median growth of the latest two parts is below half the threshold (hysteresis).

Many ranks leaking together (at least `run_fraction` of them, e.g. a leak in the training code
itself) is one run-level anomaly, not one per rank.

Projection: with a device capacity known (metric `mem.capacity_mb`), steps to out-of-memory =
(capacity - current peak (`mem.peak_mb`, else the tracked value)) / slope, and time = steps x the
run's typical step time. Without it the summary says the capacity is unknown.

Evidence: `metric`, `mb_per_step` (median over the window), `part_mb_per_step` (each part's
median), `window_steps`, `growth_mb` (over the window), `current_mb`, `capacity_mb`,
`steps_to_oom`, `seconds_to_oom`.

Defaults: blocks of 10 steps, 32 blocks (320 steps) in 4 parts of 8 differences. Allocator noise
of a few MB per step averages out in a block (the median of 8 block differences has a spread of
~0.05 MB/step); `min_mb_per_step` 0.25 is 5x that, and still a leak that eats 1 GB per 4k steps.
Critical when out-of-memory is projected within `critical_oom_s` (1 h), else warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from stepwatch_server.detect.base import Detector, DetectorSettings
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.frames import StepFrame

KIND = "memory_leak"
RUN_KEY = "run"
METRICS = ("mem.allocated_mb", "mem.rss_mb")  # the first one a rank reports is tracked
CAPACITY_METRIC = "mem.capacity_mb"
PEAK_METRIC = "mem.peak_mb"


@dataclass(frozen=True)
class MemoryLeakSettings(DetectorSettings):
    block_steps: int = 10  # steps averaged into one block mean
    window_blocks: int = 33  # block means kept per rank (32 differences)
    sub_windows: int = 4  # consecutive parts whose median growth must all be positive
    min_mb_per_step: float = 0.25  # smallest sustained growth that is a leak
    run_fraction: float = 0.5  # this share of ranks leaking: one run-level anomaly
    critical_oom_s: float = 3600.0  # projected out-of-memory sooner than this: critical


class MemoryLeakDetector(Detector):
    kind: ClassVar[str] = KIND
    Settings: ClassVar[type[DetectorSettings]] = MemoryLeakSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        super().__init__(ctx, settings)
        assert isinstance(settings, MemoryLeakSettings)
        self.s: MemoryLeakSettings = settings
        w = ctx.world_size
        self._sum = np.zeros(w)
        self._n = np.zeros(w)
        self._block: int | None = None
        # Per rank, a ring of the block means it reported (blocks without a value are left out) and
        # their block indices: dense metrics fill every block, a CPU run's host RSS (one value per
        # batch the agent sends) a block every few seconds.
        self._means = np.full((settings.window_blocks, w), np.nan)
        self._blocks = np.full((settings.window_blocks, w), -1, dtype=np.int64)
        self._filled = np.zeros(w, dtype=np.int64)
        self._metric: str | None = None
        self._peak = np.full(w, np.nan)
        self._capacity = np.full(w, np.nan)

    def on_frame(self, frame: StepFrame) -> None:
        if self._metric is None:
            self._metric = next((m for m in METRICS if m in frame.metrics), None)
            if self._metric is None:
                return
        values = frame.metrics.get(self._metric)
        if values is None:
            return
        block = frame.step // self.s.block_steps
        if self._block is not None and block != self._block:
            self._close_block(frame)
        self._block = block
        ok = np.isfinite(values)
        self._sum[ok] += values[ok]
        self._n[ok] += 1
        for name, store in ((PEAK_METRIC, self._peak), (CAPACITY_METRIC, self._capacity)):
            col = frame.metrics.get(name)
            if col is not None:
                np.copyto(store, col, where=np.isfinite(col))

    def _close_block(self, frame: StepFrame) -> None:
        assert self._block is not None
        has = np.flatnonzero(self._n > 0)
        if has.size:
            rows = self._filled[has] % self.s.window_blocks
            self._means[rows, has] = self._sum[has] / self._n[has]
            self._blocks[rows, has] = self._block
            self._filled[has] += 1
        self._sum[:] = 0.0
        self._n[:] = 0.0
        if has.size and (self._filled[has] >= self.s.window_blocks).any():
            self._judge(frame)

    def _judge(self, frame: StepFrame) -> None:
        s, ctx = self.s, self.ctx
        W = s.window_blocks
        order = (np.arange(W)[:, None] + self._filled[None, :]) % W  # oldest first, per rank
        means = np.take_along_axis(self._means, order, axis=0)
        blocks = np.take_along_axis(self._blocks, order, axis=0)
        full = self._filled >= W
        gaps = np.where(full, np.diff(blocks, axis=0), 1).astype(np.float64) * s.block_steps
        growth = np.where(full, np.diff(means, axis=0) / gaps, np.nan)  # MB/step, (W - 1, R)
        parts = np.array_split(growth, s.sub_windows, axis=0)
        with np.errstate(all="ignore"):
            part_med = np.stack([np.nanmedian(p, axis=0) for p in parts])  # (sub_windows, R)
            slope = np.nanmedian(growth, axis=0)
        leaking = full & np.all(part_med >= s.min_mb_per_step, axis=0)
        cleared = np.all(np.nan_to_num(part_med[-2:], nan=0.0) < s.min_mb_per_step / 2, axis=0)
        window_steps = np.where(full, (blocks[-1] - blocks[0]) * s.block_steps, 0)
        current = np.where(np.isfinite(self._peak), self._peak, means[-1])
        n_leak = int(leaking.sum())
        run_level = n_leak >= max(2, s.run_fraction * ctx.world_size)
        for rank in np.flatnonzero(leaking).tolist() if not run_level else []:
            self._raise(
                f"rank:{rank}", rank, frame, float(slope[rank]), part_med[:, rank], means[:, rank],
                float(current[rank]), int(window_steps[rank]),
            )  # fmt: skip
        if run_level:
            worst = int(np.nanargmax(np.where(leaking, slope, -np.inf)))
            self._raise(
                RUN_KEY, None, frame, float(np.nanmedian(slope[leaking])), part_med[:, worst],
                means[:, worst], float(current[worst]), int(window_steps[worst]), n_ranks=n_leak,
                worst_rank=worst,
            )  # fmt: skip
        for a in ctx.book.open_of(KIND):
            r: int | None = a.rank if a.key != RUN_KEY else a.evidence.get("worst_rank")
            still = run_level if a.key == RUN_KEY else (r is not None and leaking[r] and not run_level)
            done = cleared[r] if r is not None else True
            if not still and done:
                ctx.book.resolve(KIND, a.key, step=frame.step, ts=frame.ts, note="memory stopped growing")

    def _raise(
        self, key: str, rank: int | None, frame: StepFrame, slope: float, parts: np.ndarray,
        means: np.ndarray, current: float, window_steps: int, n_ranks: int = 1, worst_rank: int | None = None,
    ) -> None:  # fmt: skip
        ctx, s = self.ctx, self.s
        cap_r = rank if rank is not None else worst_rank
        cap = float(self._capacity[cap_r]) if cap_r is not None else float("nan")
        steps_to_oom = seconds_to_oom = None
        typical_ms = ctx.typical_step_ms()
        if np.isfinite(cap) and slope > 0:
            steps_to_oom = max(0, int((cap - current) / slope))
            if np.isfinite(typical_ms):
                seconds_to_oom = round(steps_to_oom * typical_ms / 1000.0, 1)
        growth_mb = float(np.nanmax(means) - np.nanmin(means))
        evidence: dict[str, Any] = {
            "metric": self._metric,
            "mb_per_step": round(float(slope), 3),
            "part_mb_per_step": [round(float(x), 3) for x in parts],
            "window_steps": window_steps,
            "growth_mb": round(growth_mb, 1),
            "current_mb": round(float(current), 1),
            "capacity_mb": round(cap, 1) if np.isfinite(cap) else None,
            "steps_to_oom": steps_to_oom,
            "seconds_to_oom": seconds_to_oom,
        }
        if steps_to_oom is None:
            oom = "device capacity unknown, no out-of-memory projection"
        elif seconds_to_oom is None:
            oom = f"out of memory in ~{steps_to_oom:,} steps at {cap / 1024:.0f} GB"
        else:
            oom = f"out of memory in ~{steps_to_oom:,} steps (~{_duration(seconds_to_oom)}) at {cap / 1024:.0f} GB"
        what = self._metric.split(".")[-1].removesuffix("_mb") if self._metric else "memory"
        if rank is not None:
            who = ctx.where(rank)
        else:
            evidence.update(n_ranks=n_ranks, worst_rank=worst_rank)
            who = f"{n_ranks} of {ctx.world_size} ranks"
        summary = (
            f"{who}: {what} memory growing {slope:.2f} MB/step for {window_steps} steps "
            f"(+{growth_mb:,.0f} MB); {oom}"
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
            rank=rank,
            node=ctx.node[rank] if rank is not None else None,
            first_step=frame.step - window_steps,
        )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
