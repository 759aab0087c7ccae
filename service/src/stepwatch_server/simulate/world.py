"""The world the detectors are scored on: seeds turned into randomised runs, in three disjoint splits.

    from stepwatch_server.simulate.world import DEV, HELDOUT, build, split
    scenarios = split("dev")        # name -> Scenario: dev-000 .. dev-039
    build(DEV[7])                   # the same seed always gives the same scenario (and trace)

A split is 40 runs with a fixed mix of world sizes (2 to 512 ranks, a quarter of them <= 4), so that
each split stays near 4 million rank-steps (and the largest runs' steps are shorter, so that no run
holds more than ~2 million batches). The split's plan keeps a third of its runs clean (every
third in order of size) and deals each of `world_faults.VARIANTS` (every fault kind at least 4 times,
with the hard cases) to one of the others, one or two a run. Everything else comes from the run's own seed: its shape
(steps, step time, noise, warm-up, pauses and whether they are marked, the agent's version), a random
subset of the benign behaviours (`benign.py`) with random parameters, its faults' parameters and
places, and its memory (device, level, headroom). `DEV` is the development set; `HELDOUT` was scored
blind once (docs/detection.md) and then looked into, so it is a second development set now; `FINAL`
is the blind one, scored only at the end of a change, never tuned on. Nothing here reads a detector's settings: the ranges come from what real runs do.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from stepwatch_server.simulate import world_benign, world_faults
from stepwatch_server.simulate.benign import (
    Benign,
    EvalMemoryStep,
    MemoryDrift,
    MemorySawtooth,
)
from stepwatch_server.simulate.scenario import (
    Fault,
    MemoryLeak,
    Scenario,
    fault_first_step,
)
from stepwatch_server.simulate.world_faults import Placement, Variant, log_uniform

SPLITS = ("dev", "heldout", "final", "final2", "final3", "final4", "final5")
RUNS_PER_SPLIT = 40
AGENT_STEPS_PER_TRANSFER = 8  # the agent's device values of this many steps share one copy to the host
CLEAN_RUNS = 13
# World sizes of a split's runs: a quarter <= 4 ranks, one of 512.
WORLD_SIZES = {2: 3, 3: 3, 4: 4, 8: 7, 16: 6, 32: 8, 64: 4, 128: 3, 256: 1, 512: 1}
MIN_STEPS, MAX_STEPS = 1500, 6000
MAX_RANK_STEPS = 256_000  # a run's steps x ranks (at least MIN_STEPS steps)
MAX_RANK_SECONDS = 1_000_000.0  # a run's ranks x its steps' event time (about 2 batches a rank-second)
STREAM_SHAPE, STREAM_BENIGN, STREAM_FAULTS, STREAM_MEMORY = 11, 12, 13, 14
DEVICES_MIB = (40_536.0, 81_251.0, 81_559.0, 143_771.0)  # A100 40GB, A100 80GB, H100 80GB, H200
MEMORY_MARGIN_MB = 5_000.0  # what is left free on a device (beyond fragmentation) in most runs
FRAGMENTATION_MB = 2_400.0  # the most the simulated caching allocator reserves beyond the peak
MIN_BASE_MB = 4_000.0  # parameters, gradients and optimizer state of the smallest model
USER_MODULES = ("train", "pretrain", "finetune", "trainer.loop", "main")


@dataclass(frozen=True)
class RunPlan:
    """One run of a split: its name, seed, world size and the fault variants dealt to it."""

    name: str
    seed: int
    world_size: int
    variants: tuple[Variant, ...] = ()


def seed_of(split_name: str, index: int) -> int:
    return zlib.crc32(f"stepwatch-world:{split_name}:{index}".encode())


@cache
def plan(split_name: str) -> tuple[RunPlan, ...]:
    """The split's runs (deterministic: the split's name seeds the deal)."""
    if split_name not in SPLITS:
        raise ValueError(f"unknown split {split_name!r}: {SPLITS}")
    rng = np.random.default_rng(zlib.crc32(f"stepwatch-world-plan:{split_name}".encode()))
    sizes = [ws for ws, n in WORLD_SIZES.items() for _ in range(n)]
    rng.shuffle(sizes)
    # The clean runs: every third run in order of size (random offset), so that faults and clean runs
    # both span every size.
    by_size = sorted(range(len(sizes)), key=lambda i: (sizes[i], i))
    offset = int(rng.integers(0, 3))
    clean = set(by_size[offset::3][:CLEAN_RUNS])
    dealt: list[list[Variant]] = [[] for _ in sizes]
    order = sorted(world_faults.VARIANTS, key=lambda v: sum(world_faults.eligible(v, ws) for ws in sizes))
    for variant in order:  # the most particular first, to the runs with fewest faults
        ok = [
            i for i, ws in enumerate(sizes)
            if i not in clean and world_faults.eligible(variant, ws) and len(dealt[i]) < 2
            and world_faults.compatible(dealt[i], variant)
        ]  # fmt: skip
        if not ok:
            raise RuntimeError(f"split {split_name}: no run can take {variant}")
        fewest = min(len(dealt[i]) for i in ok)
        dealt[int(rng.choice([i for i in ok if len(dealt[i]) == fewest]))].append(variant)
    return tuple(
        RunPlan(f"{split_name}-{i:03d}", seed_of(split_name, i), ws, tuple(d))
        for i, (ws, d) in enumerate(zip(sizes, dealt, strict=True))
    )


DEV: tuple[RunPlan, ...] = plan("dev")
HELDOUT: tuple[RunPlan, ...] = plan("heldout")
FINAL: tuple[RunPlan, ...] = plan("final")
FINAL2: tuple[RunPlan, ...] = plan("final2")
FINAL3: tuple[RunPlan, ...] = plan("final3")
FINAL4: tuple[RunPlan, ...] = plan("final4")
FINAL5: tuple[RunPlan, ...] = plan("final5")


@cache
def split(split_name: str) -> dict[str, Scenario]:
    """name -> Scenario for every run of the split."""
    return {p.name: build(p) for p in plan(split_name)}


def _shape(rng: np.random.Generator, world_size: int, max_steps: int | None) -> dict[str, Any]:
    """Scenario keyword arguments of the run's shape (no faults, no benign behaviours yet)."""
    cap = min(MAX_STEPS, max(MIN_STEPS, MAX_RANK_STEPS // world_size))
    steps = round(log_uniform(rng, MIN_STEPS, cap)) if cap > MIN_STEPS else MIN_STEPS
    if max_steps is not None:
        steps = min(steps, max_steps)
    # A rank sends a batch every ~2 s whatever its step time: the run's rank-seconds are what scoring it
    # costs, so the largest runs step in at most MAX_RANK_SECONDS / (ranks x steps).
    step_ms = round(
        log_uniform(rng, 80.0, max(160.0, min(6000.0, MAX_RANK_SECONDS * 1000.0 / (world_size * steps)))), 1
    )
    kw: dict[str, Any] = {
        "steps": steps,
        "ranks_per_node": 8 if rng.random() < 0.7 else 4,
        "step_ms": step_ms,
        "noise": round(float(rng.uniform(0.6, 2.0)), 3),
        "warmup_steps": int(min(steps // 3, round(log_uniform(rng, 50, 2000)))),
        "peak_lr": float(f"{log_uniform(rng, 1e-4, 1e-3):.2e}"),
        "compile_s": round(log_uniform(rng, 3.0, 90.0), 1),
        "gc_rate": 1.0 / log_uniform(rng, 150, 3000),
        "global_blip_rate": 1.0 / log_uniform(rng, 400, 6000),
        "grad_spike_rate": 1.0 / log_uniform(rng, 300, 6000),
        "plateaus_per_10k": round(float(rng.uniform(0.0, 6.0)), 2),
        "data_share": round(log_uniform(rng, 0.005, 0.08), 4),
        "fingerprint_every": int(rng.choice([50, 100, 100, 200])),
        "amax_every": int(rng.choice([5, 10, 10, 20])),
        "eval_every": int(rng.integers(200, 1501)) if rng.random() < 0.7 else 0,
        "eval_s": round(log_uniform(rng, 10.0, 300.0), 1),
        "ckpt_every": int(rng.integers(250, 3001)) if rng.random() < 0.7 else 0,
        "ckpt_s": round(log_uniform(rng, 15.0, 600.0), 1),
        "eval_forwards_per_s": round(float(rng.uniform(5.0, 50.0)), 1),
        "ckpt_savers": "rank0" if rng.random() < 0.5 else "all",
        "grad_accum": int(rng.choice([1, 1, 1, 2, 4, 8])),
        "user_module": str(rng.choice(USER_MODULES)),
        "agent_activity": bool(rng.random() < 0.8),  # the newer agent; older ones send neither
    }
    marked = rng.random()
    kw["marked_pauses"] = (
        ("eval", "checkpoint")
        if marked < 0.5
        else ()
        if marked < 0.85
        else (str(rng.choice(["eval", "checkpoint"])),)
    )
    return kw


def _probe(p: RunPlan, kw: dict[str, Any]) -> Scenario:
    return Scenario(p.name, p.world_size, seed=p.seed, **kw)


def _memory(
    rng: np.random.Generator,
    kw: dict[str, Any],
    benign: list[Benign],
    faults: list[Fault],
    variants: tuple[Variant, ...],
) -> None:
    """The device, the run's memory level and headroom (kw updated).

    Every benign rise and the leak must fit on the device: a run that ran out of memory would have
    crashed, which is not what these runs are about (a device too small for them is swapped for the
    next larger one). A slow leak is placed on ranks near capacity: the device would be full some
    1.3-4x the leak's steps after its start."""
    steps = kw["steps"]
    devices = DEVICES_MIB if ("memory_leak", "big") not in variants else DEVICES_MIB[1:]
    weights = np.array([0.15, 0.2, 0.45, 0.2])[-len(devices) :]
    pick = int(rng.choice(len(devices), p=weights / weights.sum()))
    act_share, level = float(rng.uniform(0.06, 0.2)), float(rng.uniform(0.3, 0.9))
    near = float(rng.uniform(1.3, 4.0))
    items = sum(1.5 * b.total_mb for b in benign if isinstance(b, MemoryDrift))
    items += sum(1.2 * sum(b.mb) for b in benign if isinstance(b, EvalMemoryStep))
    items += sum(b.mb for b in benign if isinstance(b, MemorySawtooth))
    items += 450.0 * (kw["plateaus_per_10k"] * steps / 10_000 + 2)  # allocator plateaus
    leak = next((f for f in faults if isinstance(f, MemoryLeak)), None)
    growth = 0.0 if leak is None else 1.05 * leak.mb_per_step * (steps - leak.start)
    for capacity in devices[pick:]:
        act = capacity * act_share
        if ("memory_leak", "slow-near-capacity") in variants:  # only fragmentation to spare
            base = capacity - act - items - FRAGMENTATION_MB - growth * near
        else:
            base = min(capacity * level - act, capacity - act - items - MEMORY_MARGIN_MB - growth)
        if base >= MIN_BASE_MB:
            break
    kw["base_alloc_mb"] = round(max(MIN_BASE_MB, base), 1)
    kw["act_peak_mb"] = round(act, 1)
    kw["capacity_mb"] = capacity if kw["agent_activity"] else None
    # The newer agent reads a GPU's allocator once per transfer (stepwatch._hooks.STEPS_PER_TRANSFER),
    # the older one on every step.
    kw["memory_every"] = AGENT_STEPS_PER_TRANSFER if kw["agent_activity"] else 1


def build(p: RunPlan, max_steps: int | None = None) -> Scenario:
    """The run of plan `p` (max_steps: a shorter run of the same draw, for tests)."""
    shape_rng, benign_rng, fault_rng, memory_rng = (
        np.random.default_rng([p.seed, s])
        for s in (STREAM_SHAPE, STREAM_BENIGN, STREAM_FAULTS, STREAM_MEMORY)
    )
    kw = _shape(shape_rng, p.world_size, max_steps)
    for v in p.variants:
        world_faults.needs(v, kw, fault_rng)
    probe = _probe(p, kw)
    benign = world_benign.draw(benign_rng, probe, want_drift=("memory_leak", "among-drift") in p.variants)
    resume = None if ("loss_spike", "early") in p.variants else world_benign.resume(benign_rng, probe)
    if resume is not None and benign_rng.random() < 0.25:
        resume = None  # most runs with checkpoints are never resumed
    lo = world_faults.FIRST_FAULT_STEP if resume is None else resume.step + 50
    faults: list[Fault] = []
    ordered = sorted(p.variants, key=lambda v: v[0] not in world_faults.TERMINAL)  # the terminal one first
    hi = probe.steps
    for v in ordered:
        f = world_faults.draw(v, fault_rng, Placement(probe, lo, hi))
        faults.append(f)
        if v[0] in world_faults.TERMINAL:
            hi = fault_first_step(f) - 100
    benign = [b for b in benign if not world_benign.conflicts(b, faults)]
    if resume is not None:
        benign.append(resume)
    _memory(memory_rng, kw, benign, faults, p.variants)
    faults.sort(key=fault_first_step)
    kinds = ",".join(f.kind for f in faults) or "clean"
    desc = (
        f"world run: {p.world_size} ranks x {kw['steps']} steps of {kw['step_ms']:.0f} ms; {kinds}; "
        f"benign: {','.join(sorted({b.kind for b in benign})) or 'none'}; "
        f"pauses marked: {','.join(kw['marked_pauses']) or 'none'}"
    )
    return Scenario(
        p.name, p.world_size, seed=p.seed, faults=tuple(faults), benign=tuple(benign), description=desc, **kw
    )


def composition(scenarios: dict[str, Scenario]) -> dict[str, Any]:
    """What a split holds: runs, ranks, steps, rank-steps, labels per kind, benign behaviours."""
    labels: dict[str, int] = {}
    benign: dict[str, int] = {}
    for scn in scenarios.values():
        for lab in scn.labels:
            labels[lab.kind] = labels.get(lab.kind, 0) + 1
        for kind in {b.kind for b in scn.benign}:
            benign[kind] = benign.get(kind, 0) + 1

    def count(pred: Any) -> int:
        return sum(1 for s in scenarios.values() if pred(s))

    return {
        "runs": len(scenarios),
        "clean_runs": count(lambda s: not s.faults),
        "ranks": sorted(s.world_size for s in scenarios.values()),
        "steps": sum(s.completed_steps for s in scenarios.values()),
        "rank_steps": sum(s.completed_steps * s.world_size for s in scenarios.values()),
        "labels": labels,
        "benign_runs": benign,
        "unmarked_pause_runs": count(
            lambda s: (
                (s.eval_every and "eval" not in s.marked_pauses)
                or (s.ckpt_every and "checkpoint" not in s.marked_pauses)
            )
        ),
        "agent_activity_runs": count(lambda s: s.agent_activity),
        "capacity_reported_runs": count(lambda s: s.capacity_mb is not None),
        "resumed_runs": count(lambda s: bool(s.resumes)),
        "step_ms": [min(s.step_ms for s in scenarios.values()), max(s.step_ms for s in scenarios.values())],
    }
