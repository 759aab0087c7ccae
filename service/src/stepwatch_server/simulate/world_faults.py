"""The faults of the world (`world.py`): one drawing function per variant, each with its parameter
ranges, placed where its label is unambiguous.

A variant is a kind and a flavour (`("memory_leak", "every-rank")`). `needs()` says what the run
must look like for it (a hang is placed in a run whose pauses are not marked; a two-rank data
straggler needs the sub-millisecond data wait of a prefetching loader). Hangs and divergences end a
run's story, so a run has at most one of them and its other fault comes before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from stepwatch_server.simulate.scenario import (
    Divergence,
    Fault,
    Fp8OverflowRisk,
    Hang,
    LossSpike,
    MemoryLeak,
    NonFinite,
    ReplicaDivergence,
    Scenario,
    SlowNode,
    Straggler,
    ThroughputDrop,
)

Variant = tuple[str, str]
TERMINAL = ("hang", "divergence")
LOSS_WARMUP_STEPS = 100  # a loss judge needs ~100 steps with a loss first (docs/detection.md)
FIRST_FAULT_STEP = 200  # compilation, memory ramp-up and the fastest loss fall are behind


def log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


@dataclass
class Placement:
    """Where a run's faults may go: steps lo..hi (hi: the end of the run or a terminal fault)."""

    probe: Scenario  # the run's shape without faults or benign behaviours (pauses, nodes, steps)
    lo: int
    hi: int

    def start(self, rng: np.random.Generator, span: int, lo: int | None = None) -> int:
        """A first step that leaves `span` steps of the fault before hi (fewer if the run is short)."""
        a = max(self.lo, lo if lo is not None else FIRST_FAULT_STEP)
        b = max(a, self.hi - span)
        return int(rng.integers(a, b + 1))

    def duration(self, rng: np.random.Generator, start: int, shortest: int) -> int | None:
        """None (to the end) half of the time, else a duration that ends before hi."""
        room = self.hi - start
        if room <= shortest or rng.random() < 0.5:
            return None
        return int(rng.integers(shortest, room + 1))


def _rank(rng: np.random.Generator, scn: Scenario, lo: int = 0) -> int:
    return int(rng.integers(lo, scn.world_size))


def loss_spike(rng: np.random.Generator, flavour: str, p: Placement) -> Fault:
    if flavour == "early":  # 10-200 steps after a loss judge's warm-up
        step = int(rng.integers(LOSS_WARMUP_STEPS + 10, LOSS_WARMUP_STEPS + 201))
    else:
        step = p.start(rng, 80, lo=FIRST_FAULT_STEP + 100)
    return LossSpike(
        step,
        magnitude=round(log_uniform(rng, 1.3, 3.0), 3),
        recovery_steps=int(rng.integers(5, 61)),
        grad_lead_steps=int(rng.integers(1, 4)),
    )


def divergence(rng: np.random.Generator, flavour: str, p: Placement) -> Fault:
    mode = flavour if flavour != "any" else str(rng.choice(["spike-no-recover", "trend", "nonfinite"]))
    step = p.start(rng, 200, lo=400)
    if mode == "spike-no-recover":
        return Divergence(step, mode="spike-no-recover", magnitude=round(log_uniform(rng, 1.4, 3.0), 3))
    if mode == "trend":
        return Divergence(step, mode="trend", rate_per_step=round(log_uniform(rng, 0.002, 0.01), 5))
    return Divergence(
        step, mode="nonfinite", rate_per_step=round(log_uniform(rng, 0.004, 0.02), 5),
        nan_after_steps=int(rng.integers(20, 81)),
    )  # fmt: skip


def nonfinite(rng: np.random.Generator, flavour: str, p: Placement) -> Fault:
    scn = p.probe
    n = 1 if rng.random() < 0.8 or scn.world_size < 4 else int(rng.integers(2, 4))
    ranks = tuple(sorted(int(r) for r in rng.choice(scn.world_size, n, replace=False)))
    module = str(rng.choice(list(scn.modules)))
    steps = int(rng.integers(1, 6)) if flavour != "grads" else int(rng.integers(1, 3))
    where = flavour if flavour in ("activations", "loss", "grads") else "activations"
    return NonFinite(p.start(rng, 40), ranks=ranks, module=module, where=where, steps=steps)  # type: ignore[arg-type]


def straggler(rng: np.random.Generator, flavour: str, p: Placement) -> Fault:
    scn = p.probe
    start = p.start(rng, 300)
    if flavour.startswith("small"):  # a loader that does more work per batch on one of 2-3 ranks
        extra = max(5.0, float(rng.uniform(0.1, 0.5)) * scn.step_ms)
        duration = int(rng.integers(400, 1501)) if rng.random() < 0.5 else None
        if duration is not None and start + duration > p.hi:
            duration = None
        return Straggler(
            _rank(rng, scn, 1), start, factor=1.0, phase="data", duration=duration, extra_ms=round(extra, 2)
        )
    factor = round(log_uniform(rng, 1.1, 2.0), 3)
    rank, duration = _rank(rng, scn), p.duration(rng, start, 300)
    if flavour == "data":
        return Straggler(rank, start, factor=factor, phase="data", duration=duration)
    return Straggler(rank, start, factor=factor, phase="forward", duration=duration)


def slow_node(rng: np.random.Generator, flavour: str, p: Placement) -> Fault:
    scn = p.probe
    node = int(rng.integers(0, scn.num_nodes - (scn.world_size % scn.ranks_per_node != 0)))
    rpn = scn.ranks_per_node
    slow = int(rng.integers(math.ceil(0.75 * rpn), rpn + 1))
    start = p.start(rng, 300)
    return SlowNode(
        node, start, factor=round(log_uniform(rng, 1.2, 2.0), 3), slow_ranks=None if slow == rpn else slow,
        duration=p.duration(rng, start, 300),
    )  # fmt: skip


def hang(rng: np.random.Generator, flavour: str, p: Placement) -> Fault:
    scn = p.probe
    a = max(p.lo, int(0.6 * scn.steps), FIRST_FAULT_STEP + 100)
    for _ in range(200):
        step = int(rng.integers(a, max(a, scn.steps - 1) + 1))
        if all(scn.pause_after(step - k) is None for k in range(1, 5)):
            break
    rank = _rank(rng, scn)
    if flavour == "dead":
        return Hang(rank, step, mode="dead")
    return Hang(rank, step, mode="stuck", phase="data" if flavour == "stuck-data" else "forward")


def memory_leak(rng: np.random.Generator, flavour: str, p: Placement) -> Fault:
    scn = p.probe
    if flavour == "every-rank":
        return MemoryLeak(None, p.start(rng, 800), mb_per_step=round(float(rng.uniform(2.0, 4.0)), 3))
    if flavour == "big":  # late in the run: it ends before the device is full (the world sizes memory)
        start = int(rng.integers(max(p.lo, p.hi - 600), max(p.lo, p.hi - 150) + 1))
        return MemoryLeak(_rank(rng, scn), start, mb_per_step=round(float(rng.uniform(20.0, 60.0)), 2))
    if flavour == "slow-near-capacity":
        return MemoryLeak(
            _rank(rng, scn), p.start(rng, 1000), mb_per_step=round(float(rng.uniform(0.5, 2.0)), 3)
        )
    return MemoryLeak(_rank(rng, scn), p.start(rng, 800), mb_per_step=round(log_uniform(rng, 0.5, 4.0), 3))


def replica_divergence(rng: np.random.Generator, flavour: str, p: Placement) -> Fault:
    scn = p.probe
    return ReplicaDivergence(_rank(rng, scn), p.start(rng, 3 * scn.fingerprint_every))


def fp8_overflow_risk(rng: np.random.Generator, flavour: str, p: Placement) -> Fault:
    scn = p.probe
    module = str(rng.choice([m for m in scn.modules if "logits" in m or "lm_head" in m or "fc" in m]))
    return Fp8OverflowRisk(
        module, p.start(rng, 400), growth_per_step=round(log_uniform(rng, 0.003, 0.012), 5)
    )


def throughput_drop(rng: np.random.Generator, flavour: str, p: Placement) -> Fault:
    scn = p.probe
    start = p.start(rng, 300)
    shortest = max(150, math.ceil(180_000.0 / scn.step_ms))  # minutes, not a blip
    return ThroughputDrop(
        start, factor=round(log_uniform(rng, 1.25, 2.0), 3), duration=p.duration(rng, start, shortest)
    )


DRAW: dict[str, Callable[[np.random.Generator, str, Placement], Fault]] = {
    "loss_spike": loss_spike,
    "divergence": divergence,
    "nonfinite": nonfinite,
    "straggler": straggler,
    "slow_node": slow_node,
    "hang": hang,
    "memory_leak": memory_leak,
    "replica_divergence": replica_divergence,
    "fp8_overflow_risk": fp8_overflow_risk,
    "throughput_drop": throughput_drop,
}

# Every split holds each of these once: at least 4 labels of every kind, with the hard cases.
VARIANTS: tuple[Variant, ...] = (
    ("loss_spike", "early"), ("loss_spike", "early"), ("loss_spike", "any"), ("loss_spike", "any"),
    ("divergence", "spike-no-recover"), ("divergence", "trend"), ("divergence", "nonfinite"),
    ("divergence", "any"),
    ("nonfinite", "activations"), ("nonfinite", "activations"), ("nonfinite", "loss"), ("nonfinite", "grads"),
    ("straggler", "forward"), ("straggler", "data"), ("straggler", "small2"), ("straggler", "small3"),
    ("straggler", "forward"),
    ("slow_node", ""), ("slow_node", ""), ("slow_node", ""), ("slow_node", ""),
    ("hang", "stuck-data"), ("hang", "stuck-forward"), ("hang", "dead"), ("hang", "dead"),
    ("memory_leak", "among-drift"), ("memory_leak", "every-rank"), ("memory_leak", "big"),
    ("memory_leak", "slow-near-capacity"), ("memory_leak", "among-drift"),
    ("replica_divergence", ""), ("replica_divergence", ""), ("replica_divergence", ""),
    ("replica_divergence", ""),
    ("fp8_overflow_risk", ""), ("fp8_overflow_risk", ""), ("fp8_overflow_risk", ""), ("fp8_overflow_risk", ""),
    ("throughput_drop", ""), ("throughput_drop", ""), ("throughput_drop", ""), ("throughput_drop", ""),
)  # fmt: skip


def eligible(variant: Variant, world_size: int) -> bool:
    """Whether a run of `world_size` ranks can hold the variant at all."""
    kind, flavour = variant
    if flavour == "small2":
        return world_size == 2
    if flavour == "small3":
        return world_size == 3
    if kind == "slow_node":
        return world_size >= 32  # >= 3 nodes of 8 (4 of 4): a node is never half the run
    if kind == "replica_divergence":
        return world_size >= 3  # two replicas that differ cannot say which one diverged
    return True


def compatible(variants: list[Variant], new: Variant) -> bool:
    kinds = [k for k, _ in variants]
    if new[0] in kinds:
        return False
    return not (new[0] in TERMINAL and any(k in TERMINAL for k in kinds))


def needs(variant: Variant, kw: dict[str, Any], rng: np.random.Generator) -> None:
    """Adjust the run's shape (Scenario keyword arguments) for the variant."""
    kind, flavour = variant
    if kind == "hang":  # the hard case: pauses the user did not mark, in the same run
        kw["marked_pauses"] = ()
        if not kw.get("eval_every") and not kw.get("ckpt_every"):
            kw["eval_every"] = int(rng.integers(200, 801))
    if flavour.startswith("small"):  # a prefetching loader: healthy data waits are ~0.3-1 ms
        kw["data_share"] = min(0.02, float(rng.uniform(0.3, 1.0)) / kw["step_ms"])
    if flavour == "data":  # a loader that costs the step 2-8%: 1.1-2x of it is felt
        kw["data_share"] = float(rng.uniform(0.02, 0.08))
    if flavour == "slow-near-capacity":
        kw["agent_activity"] = True  # the newer agent, which reports the device's capacity


def draw(variant: Variant, rng: np.random.Generator, p: Placement) -> Fault:
    return DRAW[variant[0]](rng, variant[1], p)
