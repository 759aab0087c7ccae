"""`slow_node`: most ranks of one node slower than their peers together, reported once for the node.

Why it means trouble: ranks that share a host share its power and cooling, PCIe/NVLink switches, CPU,
page cache and network card. When most of them slow down together the cause is the node (thermal or
power throttling, a degraded switch, a noisy neighbour on the host, a failing NIC), not the ranks,
and the fix is to drain or replace the node; eight straggler alerts would hide that.

The signal is the straggler signal, computed once per run in `_slowness.RankSlowness` (both detectors
read it, so they cannot disagree): a rank is slow-now when its data or forward time, over the
window, is persistently above its peers' median. A node is slow when at least `node_fraction` (75%)
of its ranks, and at least two, are slow-now for `confirm_steps` (4) judged steps in a row: 6 of 8,
so that one healthy or mildly affected GPU does not hide a throttled host, while two independent
stragglers that happen to share a node stay two stragglers. It clears after `clear_steps` (40) judged
steps in a row with fewer than half of its ranks still slow. While the node is slow, `straggler`
opens nothing for its ranks (and resolves any it had opened, with a note).

Evidence: the slow ranks of the node and their count out of the node's, the dominant phase, the
median ratio of the slow ranks and the range, the fraction of the step the run loses. Severity:
warning; critical when the median ratio reaches `critical_ratio`. Key "node:<name>", rank None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

from stepwatch_server.detect.anomalies import Severity
from stepwatch_server.detect.base import Detector, DetectorSettings
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.detectors._slowness import PHASES, SlownessSettings, run_slowness
from stepwatch_server.detect.frames import StepFrame


@dataclass(frozen=True)
class SlowNodeSettings(SlownessSettings):
    """The shared slowness fields (see `_slowness.SlownessSettings`) plus the severity bar."""

    critical_ratio: float = 1.5  # the node makes the whole run wait a third of the phase or more


class SlowNodeDetector(Detector):
    kind = "slow_node"
    Settings = SlowNodeSettings

    def __init__(self, ctx: RunContext, settings: DetectorSettings) -> None:
        super().__init__(ctx, settings)
        self.s = cast(SlowNodeSettings, settings)
        self.slowness = run_slowness(ctx, settings, node_reporting=True)  # straggler leaves nodes to it

    def on_frame(self, frame: StepFrame) -> None:
        sl = self.slowness
        if not sl.update(frame):
            return
        book, kind = self.ctx.book, self.kind
        slow = set(np.flatnonzero(sl.node_slow).tolist())
        for a in book.open_of(kind):
            name = a.key.removeprefix("node:")
            if name not in sl.node_names or sl.node_names.index(name) not in slow:
                book.resolve(kind, a.key, step=frame.step, ts=frame.ts)
        for n in sorted(slow):
            if sl.node_slow_now[n] or not book.is_open(kind, f"node:{sl.node_names[n]}"):
                self._raise(frame, n)  # updated while slow; left alone while clearing

    def _raise(self, frame: StepFrame, n: int) -> None:
        sl = self.slowness
        name = sl.node_names[n]
        members = np.flatnonzero(sl.node_of == n)
        culprits = members[sl.slow_now[members] | sl.slow[members]]
        if culprits.size == 0:
            culprits = members
        phase = int(np.bincount(sl.phase[culprits], minlength=len(PHASES)).argmax())
        ratios = sl.window_ratio(phase, culprits)
        ratio = float(np.median(ratios))
        excess = sl.excess_frac(phase, culprits)
        lost = float(np.nanmax(excess)) if np.isfinite(excess).any() else float("nan")
        since = int(sl.node_since[n])
        steps = frame.step - since + 1
        summary = (
            f"node {name}: {culprits.size} of its {members.size} ranks slow together in {PHASES[phase]}, "
            f"{ratio:.2f}x the median of their peers for {steps} steps"
        )
        evidence = {
            "node": name,
            "phase": PHASES[phase],
            "slow_ranks": self.ctx.ranks[culprits].tolist(),
            "node_ranks": int(members.size),
            "ratio": round(ratio, 4),
            "ratio_min": round(float(ratios.min()), 4),
            "ratio_max": round(float(ratios.max()), 4),
            "step_fraction_lost": None if not np.isfinite(lost) else round(lost, 5),
            "slow_steps": steps,
            "node_fraction": sl.s.node_fraction,
        }
        severity: Severity = "critical" if ratio >= self.s.critical_ratio else "warning"
        self.ctx.book.raise_(
            self.kind,
            f"node:{name}",
            step=frame.step,
            ts=frame.ts,
            severity=severity,
            summary=summary,
            evidence=evidence,
            node=name,
            first_step=since,
            first_ts=float(sl.node_since_ts[n]),
        )
