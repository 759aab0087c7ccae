"""`straggler`: one rank persistently slower than its peers in data wait or forward (compute) time.

Why it means trouble: synchronous training runs at the pace of its slowest rank. A rank with a
throttled GPU, a bad PCIe link, a starved data loader or a noisy neighbour makes every other rank wait
in the collective, on every step, for as long as it lasts: a 10% straggler among 512 ranks wastes the
waiting time of 511 GPUs.

The signal (shared with `slow_node`, computed once in `_slowness.RankSlowness`; its docstring has the
details): per step, each rank's `time.data_ms` and `time.forward_ms` over the median of its peers at
the same step; the mean of the (clipped) log ratio over the last 40 judged steps must be >= 1.05x,
>= 1.05x above the rank's own normal offset, 5 units of chance (per-step noise / sqrt(window), or
the ranks' spread when larger) above the other ranks, and cost the run >= 0.2% of the step, for 4
judged steps in a row. Backward and step time are never judged: in DDP the healthy ranks wait for
the straggler inside backward, so they would look guilty there. Steps inside marked pauses and just
after them, and the first steps of the run, are not judged. A 10% forward straggler is found in
~21-27 steps; a 10% data straggler (data time varies ~10% per step) in 21-75 (median 42).

Evidence: the phase, the ratio (median over the window of the rank's time / its peers' median), the
time lost as a fraction of the step, the rank's and its peers' median phase time, the steps it has
been slow. Severity: warning; critical from `critical_ratio` (a rank at 1.5x costs the run a third of
the phase). Resolves after 40 judged steps in a row below half of each bar. When `slow_node` runs and
most of the rank's node is slow, the node is reported instead (and an open straggler there is resolved
with a note saying so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

from stepwatch_server.detect.anomalies import Severity
from stepwatch_server.detect.base import Detector, DetectorSettings
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.detectors._slowness import (
    PHASE_METRICS,
    PHASES,
    SlownessSettings,
    run_slowness,
)
from stepwatch_server.detect.frames import StepFrame


@dataclass(frozen=True)
class StragglerSettings(SlownessSettings):
    """The shared slowness fields (see `_slowness.SlownessSettings`) plus the severity bar."""

    critical_ratio: float = 1.5  # the rank makes the whole run wait a third of the phase or more


class StragglerDetector(Detector):
    kind = "straggler"
    Settings = StragglerSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        super().__init__(ctx, settings)
        self.s = cast(StragglerSettings, settings)
        self.slowness = run_slowness(ctx, settings)

    def on_frame(self, frame: StepFrame) -> None:
        sl = self.slowness
        if not sl.update(frame):
            return
        book, kind = self.ctx.book, self.kind
        suppress = sl.node_reporting
        for a in book.open_of(kind):
            r = self.ctx.row_of(cast(int, a.rank))
            if r is None or not sl.slow[r]:
                book.resolve(kind, a.key, step=frame.step, ts=frame.ts)
            elif suppress and sl.node_slow_of(r):
                node = sl.node_names[int(sl.node_of[r])]
                note = f"node {node} is slow as a whole: reported as slow_node"
                book.resolve(kind, a.key, step=frame.step, ts=frame.ts, note=note)
        ranks = np.flatnonzero(sl.slow & sl.slow_now)  # updated while slow; left alone while clearing
        for r in ranks.tolist():
            if suppress and sl.node_slow_of(r):
                continue
            self._raise(frame, r)

    def _raise(self, frame: StepFrame, r: int) -> None:
        sl = self.slowness
        p = int(sl.phase[r])
        metric = frame.metrics.get(PHASE_METRICS[p])
        ratio = float(sl.window_ratio(p, r)[0])
        excess = float(sl.excess_frac(p, r)[0])
        since = int(sl.slow_since[r])
        steps = frame.step - since + 1
        mine = peers = float("nan")
        if metric is not None:
            mine = float(metric[r])
            others = np.delete(metric, r)
            others = others[np.isfinite(others)]
            peers = float(np.median(others)) if others.size else float("nan")
        summary = (
            f"{self.ctx.where(r)}: {PHASES[p]} {ratio:.2f}x the median of its peers for {steps} steps"
            + (f" (~{excess:.1%} of each step lost)" if np.isfinite(excess) else "")
        )
        evidence = {
            "phase": PHASES[p],
            "metric": PHASE_METRICS[p],
            "ratio": round(ratio, 4),
            "ratio_data": round(float(sl.window_ratio(0, r)[0]), 4),
            "ratio_forward": round(float(sl.window_ratio(1, r)[0]), 4),
            "step_fraction_lost": None if not np.isfinite(excess) else round(excess, 5),
            "phase_ms": None if not np.isfinite(mine) else round(mine, 3),
            "peers_median_ms": None if not np.isfinite(peers) else round(peers, 3),
            "slow_steps": steps,
            "window_steps": sl.s.window_steps,
            "min_ratio": sl.s.min_ratio,
        }
        severity: Severity = "critical" if ratio >= self.s.critical_ratio else "warning"
        self.ctx.book.raise_(
            self.kind,
            f"rank:{self.ctx.rank_of(r)}",
            step=frame.step,
            ts=frame.ts,
            severity=severity,
            summary=summary,
            evidence=evidence,
            rank=self.ctx.rank_of(r),
            node=self.ctx.node[r],
            first_step=since,
            first_ts=float(sl.slow_since_ts[r]),
        )
