"""The benign behaviours of a world run (`world.py`): a random subset of `benign.py`'s, with random
parameters, a resume where the run has room for one, and which of them would blur a fault's onset.

The ranges are what real runs do (docs/detection.md, "The world the detectors are scored on"); nothing
here reads a detector's settings.
"""

from __future__ import annotations

import numpy as np

from stepwatch_server.simulate.benign import (
    Benign,
    Congestion,
    DataStall,
    EvalMemoryStep,
    ExtraDataWork,
    LossBump,
    MemoryDrift,
    MemorySawtooth,
    NodeDataHiccup,
    Resume,
)
from stepwatch_server.simulate.scenario import (
    Divergence,
    Fault,
    Hang,
    LossSpike,
    Scenario,
    ThroughputDrop,
    fault_first_step,
)
from stepwatch_server.simulate.world_faults import log_uniform

STALL_MAX_S = 20.0
HANG_DEADLINE_S = 30.0  # the project's hang deadline is max(30 s, 5 steps)


def draw(rng: np.random.Generator, scn: Scenario, want_drift: bool) -> list[Benign]:
    """A random subset of the benign behaviours, with random parameters (no resume)."""
    ws, steps = scn.world_size, scn.steps
    out: list[Benign] = []

    def some_ranks() -> tuple[int, ...] | None:
        u = rng.random()
        if u < 0.4 or ws == 1:
            return (int(rng.integers(0, ws)),)
        if u < 0.7 and ws > 2:
            n = int(rng.integers(2, max(3, min(16, ws // 2) + 1)))
            return tuple(sorted(int(r) for r in rng.choice(ws, n, replace=False)))
        return None

    if want_drift or rng.random() < 0.5:
        for _ in range(int(rng.integers(1, 4))):
            out.append(MemoryDrift(
                int(rng.integers(50, int(0.8 * steps))), round(log_uniform(rng, 0.05, 1.5), 3),
                round(log_uniform(rng, 20.0, 600.0), 1), some_ranks(),
            ))  # fmt: skip
    if scn.eval_every and rng.random() < 0.5:
        k = int(rng.integers(1, 4))
        out.append(EvalMemoryStep(tuple(round(log_uniform(rng, 50.0, 800.0), 1) for _ in range(k))))
    if rng.random() < 0.3:
        who = (0,) if rng.random() < 0.5 else tuple(range(0, ws, scn.ranks_per_node))
        period = round(log_uniform(rng, 50, 800))
        out.append(
            MemorySawtooth(
                who, round(log_uniform(rng, 100.0, 3000.0), 1), period, int(rng.integers(1, period + 1))
            )
        )
    if rng.random() < 0.5:
        for _ in range(1 + int(rng.poisson(steps / 1500))):
            n = int(rng.integers(5, 81))
            out.append(
                Congestion(int(rng.integers(20, steps - n)), n, round(float(rng.uniform(1.2, 3.0)), 3))
            )
    if rng.random() < 0.4:
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(3, 21))
            out.append(NodeDataHiccup(
                int(rng.integers(0, scn.num_nodes)), int(rng.integers(20, steps - n)), n,
                round(log_uniform(rng, 2.0, 20.0), 2),
            ))  # fmt: skip
    if rng.random() < 0.5:
        stalls: list[DataStall] = []
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(1, 11))
            # A rank stopped for longer than a hang's deadline (max(30 s, 5 steps)) would be a hang: a
            # benign stall, with its step and a GC pause (3 steps), stays under it, and under 20 s.
            deadline_ms = max(HANG_DEADLINE_S * 1000.0, 5 * scn.step_ms)
            most_ms = min(STALL_MAX_S * 1000.0, deadline_ms - 3 * scn.step_ms)
            times = min(float(rng.uniform(0.5, 10.0)), most_ms / scn.step_ms)
            stall = DataStall(int(rng.integers(0, ws)), int(rng.integers(20, steps - n)), n, round(times, 2))
            # Two stalls of one rank on the same steps add up (2 x 20 s is past the deadline): one that
            # overlaps an earlier one of its rank is left out, the draws made all the same.
            if all(
                b.rank != stall.rank or stall.step >= b.step + b.steps or stall.step + stall.steps <= b.step
                for b in stalls
            ):
                stalls.append(stall)
        out.extend(stalls)
    if rng.random() < 0.5:
        bumps: list[LossBump] = []
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(1, 16))
            bump = LossBump(int(rng.integers(20, steps - n)), n, round(float(rng.uniform(1.03, 1.18)), 4))
            # Two bumps on the same steps multiply (1.08 x 1.18 = 1.27x): past the benign range, so a
            # bump that overlaps an earlier one (or follows it within 5 steps) is left out. The draws are
            # made all the same, so the rest of the run does not change.
            if all(bump.step > b.step + b.steps + 5 or bump.step + bump.steps + 5 < b.step for b in bumps):
                bumps.append(bump)
        out.extend(bumps)
    if rng.random() < 0.3:
        out.append(
            ExtraDataWork(round(float(rng.uniform(1.1, 1.6)), 3), "local0" if rng.random() < 0.6 else "rank0")
        )
    return out


def resume(rng: np.random.Generator, scn: Scenario) -> Resume | None:
    """Killed after a step between the first checkpoint and ~60% of the run, resumed from the last
    checkpoint before it."""
    if not scn.ckpt_every or 2 * scn.ckpt_every >= scn.steps:
        return None
    for _ in range(20):
        kill = int(rng.integers(scn.ckpt_every + 1, max(scn.ckpt_every + 2, int(0.6 * scn.steps))))
        ckpt = [s for s in range(scn.ckpt_every, kill, scn.ckpt_every) if scn.pause_after(s) == "checkpoint"]
        if ckpt and kill - ckpt[-1] <= 2000:
            return Resume(kill, ckpt[-1], round(log_uniform(rng, 30.0, 900.0), 1))
    return None


def conflicts(b: Benign, faults: list[Fault]) -> bool:
    """A benign behaviour that would make a fault's label ambiguous (it is dropped): a loss bump at a
    loss spike's or divergence's onset, a stall or congestion at a hang's step, congestion at the
    start of a throughput drop."""
    for f in faults:
        first = fault_first_step(f)
        loss = isinstance(b, LossBump) and isinstance(f, LossSpike | Divergence)
        stall = isinstance(f, Hang) and isinstance(b, Congestion | NodeDataHiccup | DataStall)
        drop = isinstance(f, ThroughputDrop) and isinstance(b, Congestion)
        margin = 20 if drop else 10
        if (loss or stall or drop) and b.step - margin <= first <= b.step + b.steps + margin:  # type: ignore[union-attr]
            return True
    return False
