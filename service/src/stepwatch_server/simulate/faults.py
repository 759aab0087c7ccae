"""One function per anomaly kind: what the fault does to a chunk of the trace, and its ground truth.

Effects run on a chunk's intrinsic values, before `CleanPhysics.sync()` equalises step times, so a
slow rank's delay reaches everyone else's backward wait through the physics, never by hand. A fault
only touches the chunk's steps inside its window, so chunks can be generated one after another.
`hang` has no effect function: the generator stops the run before the hang's step and the batcher
produces what a hung job sends (heartbeats from the waiting ranks, and from the culprit unless dead).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from stepwatch_server.simulate.physics import Chunk
from stepwatch_server.simulate.scenario import (
    Divergence,
    Fault,
    Fp8OverflowRisk,
    Hang,
    Label,
    LossSpike,
    MemoryLeak,
    NonFinite,
    ReplicaDivergence,
    Scenario,
    SlowNode,
    Straggler,
    ThroughputDrop,
    node_name,
)

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
MAX_GROWTH_EXPONENT = 60.0  # keeps runaway amax/loss finite in float64


def _since(ch: Chunk, first: int) -> np.ndarray:
    """Steps since `first` per row (negative before it), as float."""
    return (ch.steps - first).astype(np.float64)


def _end(start: int, duration: int | None) -> int | None:
    return None if duration is None else start + duration - 1


# -- effects -------------------------------------------------------------------------------------------


def loss_spike(f: LossSpike, ch: Chunk, scn: Scenario) -> None:
    """Global loss (all ranks) x magnitude at `step`, decaying to ~5% of the jump by `recovery_steps`;
    the grad norm spikes on the update that caused it."""
    k = _since(ch, f.step)
    tau = max(1.0, f.recovery_steps / 3.0)
    mult = np.where(k >= 0, 1.0 + (f.magnitude - 1.0) * np.exp(-np.maximum(k, 0.0) / tau), 1.0)
    ch.loss *= mult[:, None]
    lead = ch.steps == f.step - f.grad_lead_steps
    ch.grad_norm[lead] *= 3.0 + 4.0 * (f.magnitude - 1.0)
    ch.grad_norm[ch.steps == f.step] *= 1.0 + (f.magnitude - 1.0)


def divergence(f: Divergence, ch: Chunk, scn: Scenario) -> None:
    """The loss leaves its curve and does not come back."""
    k = _since(ch, f.step)
    on = k >= 0
    if f.mode == "spike-no-recover":
        ramp = np.clip((k + 1.0) / 3.0, 0.0, 1.0)
        mult = 1.0 + (f.magnitude - 1.0) * ramp + 0.0005 * np.maximum(k, 0.0)
        gmult = np.where(on, 2.5 + 0.002 * np.maximum(k, 0.0), 1.0)
    else:
        expo = np.minimum(f.rate_per_step * np.maximum(k, 0.0), MAX_GROWTH_EXPONENT)
        mult = np.exp(expo)
        gmult = np.exp(np.minimum(2.0 * expo, MAX_GROWTH_EXPONENT))
    ch.loss *= np.where(on, mult, 1.0)[:, None]
    ch.grad_norm *= gmult[:, None]
    if f.mode == "nonfinite":
        bad = ch.steps >= f.step + f.nan_after_steps
        if bad.any():
            # Parameters are NaN: every output, the loss and the gradients, on every rank, from now on.
            ch.loss[bad] = np.nan
            ch.grad_norm[bad] = np.nan
            ch.amax[bad] = np.nan
            ch.nf_loss[bad] = 1
            ch.nf_grads[bad] = 1
            ch.nf_act[bad] = 1
            first = f.step + f.nan_after_steps
            if ch.steps[0] <= first <= ch.steps[-1]:
                row = int(first - ch.steps[0])
                for r in range(scn.world_size):
                    data = {"module": scn.modules[0], "where": ["activations", "loss", "grads"]}
                    ch.events.append((row, r, "nonfinite", data))


def nonfinite(f: NonFinite, ch: Chunk, scn: Scenario) -> None:
    """NaN/Inf at `step` on the culprit ranks; NaN gradients reach everyone through the all-reduce."""
    rows = np.flatnonzero(ch.rows(f.step, f.step + f.steps - 1))
    if rows.size == 0:
        return
    culprits = np.array(sorted(set(f.ranks)), dtype=np.int64)
    where: list[str]
    if f.where == "grads":
        ch.grad_norm[rows] = np.inf
        ch.nf_grads[rows] = 1
        where = ["grads"]
    else:
        sub = np.ix_(rows, culprits)
        ch.loss[sub] = np.nan
        ch.nf_loss[sub] = 1
        ch.grad_norm[rows] = np.nan
        ch.nf_grads[rows] = 1
        where = ["loss", "grads"]
        if f.where == "activations":
            m = scn.modules.index(f.module)
            ch.amax[np.ix_(rows, culprits, np.arange(m, len(scn.modules)))] = np.nan
            ch.nf_act[sub] = 1
            where = ["activations", "loss", "grads"]
    row = int(rows[0])  # the agent reports the first step of a non-finite stretch only
    for r in range(scn.world_size):
        mine = r in f.ranks or f.where == "grads"
        module = f.module if mine and f.where == "activations" else None
        ch.events.append((row, r, "nonfinite", {"module": module, "where": where if mine else ["grads"]}))


def straggler(f: Straggler, ch: Chunk, scn: Scenario) -> None:
    """A slow loader (data) or a slow GPU (forward). The data factor applies to the rank's own data
    wait, not to a pause or storage blip measured in the same interval."""
    rows = ch.rows(f.start, _end(f.start, f.duration))
    if f.phase == "data":
        ch.data[rows, f.rank] += (f.factor - 1.0) * ch.own_data()[rows, f.rank] + f.extra_ms
        return
    ch.forward[rows, f.rank] *= f.factor
    ch.forward[rows, f.rank] += f.extra_ms


def slow_node(f: SlowNode, ch: Chunk, scn: Scenario) -> None:
    rows = ch.rows(f.start, _end(f.start, f.duration))
    ranks = np.array(_slow_node_ranks(f, scn), dtype=np.int64)
    # Ranks of one node are throttled together, not identically.
    spread = 1.0 + 0.02 * np.sin(np.arange(len(ranks)) * 1.7)
    ch.forward[np.ix_(rows, ranks)] *= f.factor * spread[None, :]


def memory_leak(f: MemoryLeak, ch: Chunk, scn: Scenario) -> None:
    k = _since(ch, f.start)
    if f.duration is not None:
        k = np.minimum(k, f.duration)
    grow = np.maximum(k + 1.0, 0.0) * f.mb_per_step
    if f.rank is None:  # the same code leaks on every rank, at rates a few percent apart
        rates = 1.0 + 0.03 * np.sin(np.arange(scn.world_size) * 1.3)
        ch.alloc += grow[:, None] * rates[None, :]
        ch.peak += grow[:, None] * rates[None, :]
        return
    ch.alloc[:, f.rank] += grow
    ch.peak[:, f.rank] += grow


def replica_divergence(f: ReplicaDivergence, ch: Chunk, scn: Scenario) -> None:
    if ch.steps[-1] >= f.step:
        # Fingerprints at steps >= f.step differ; the batcher salts only those rows.
        ch.fp_salt[f.rank] = f"diverged@{f.step}"


def fp8_overflow_risk(f: Fp8OverflowRisk, ch: Chunk, scn: Scenario) -> None:
    m = scn.modules.index(f.module)
    k = np.maximum(_since(ch, f.start), 0.0)
    ch.amax[:, :, m] *= np.exp(np.minimum(f.growth_per_step * k, MAX_GROWTH_EXPONENT))[:, None]


def throughput_drop(f: ThroughputDrop, ch: Chunk, scn: Scenario) -> None:
    rows = ch.rows(f.step, _end(f.step, f.duration))
    for arr in (ch.forward, ch.bwd, ch.opt):
        arr[rows] *= f.factor
    ch.tail[rows] *= f.factor
    ch.data[rows] += (f.factor - 1.0) * (ch.data[rows] - ch.pause_ms[rows, None])


def hang(f: Hang, ch: Chunk, scn: Scenario) -> None:
    """Nothing to change in the steps that were completed; see the module docstring."""


EFFECTS: dict[type, Callable[[Any, Chunk, Scenario], None]] = {
    LossSpike: loss_spike,
    Divergence: divergence,
    NonFinite: nonfinite,
    Straggler: straggler,
    SlowNode: slow_node,
    Hang: hang,
    MemoryLeak: memory_leak,
    ReplicaDivergence: replica_divergence,
    Fp8OverflowRisk: fp8_overflow_risk,
    ThroughputDrop: throughput_drop,
}


def apply(f: Fault, ch: Chunk, scn: Scenario) -> None:
    EFFECTS[type(f)](f, ch, scn)


# -- ground truth ----------------------------------------------------------------------------------


def _slow_node_ranks(f: SlowNode, scn: Scenario) -> tuple[int, ...]:
    ranks = scn.ranks_of_node(f.node)
    return ranks if f.slow_ranks is None else ranks[: f.slow_ranks]


def labels_for(f: Fault, scn: Scenario) -> list[Label]:
    """The labels a fault produces (a NaN divergence produces a `nonfinite` label as well)."""
    if isinstance(f, LossSpike):
        return [
            Label("loss_spike", None, None, f.step, f.step + f.recovery_steps,
                  {"magnitude": f.magnitude, "recovery_steps": f.recovery_steps})
        ]  # fmt: skip
    if isinstance(f, Divergence):
        out = [Label("divergence", None, None, f.step, None, {"mode": f.mode}, tolerated=("loss_spike",))]
        if f.mode == "nonfinite":
            first = f.step + f.nan_after_steps
            if first <= scn.last_step:
                out.append(
                    Label("nonfinite", None, None, first, None,
                          {"module": scn.modules[0], "where": ["activations", "loss", "grads"], "from": "divergence"},
                          tolerated=("divergence", "loss_spike"))
                )  # fmt: skip
        return out
    if isinstance(f, NonFinite):
        ranks = tuple(sorted(set(f.ranks)))
        rank = ranks[0] if f.where != "grads" else None
        return [
            Label("nonfinite", rank, scn.node_of(rank) if rank is not None else None, f.step,
                  f.step + f.steps - 1, {"module": f.module if f.where == "activations" else None,
                                         "where": f.where, "ranks": list(ranks)},
                  ranks=ranks if f.where != "grads" else (), tolerated=("loss_spike",))
        ]  # fmt: skip
    if isinstance(f, Straggler):
        return [
            Label("straggler", f.rank, scn.node_of(f.rank), f.start, _end(f.start, f.duration),
                  {"phase": f.phase, "factor": f.factor, **({"extra_ms": f.extra_ms} if f.extra_ms else {})},
                  tolerated=("throughput_drop",))
        ]  # fmt: skip
    if isinstance(f, SlowNode):
        ranks = _slow_node_ranks(f, scn)
        return [
            Label("slow_node", None, node_name(f.node), f.start, _end(f.start, f.duration),
                  {"factor": f.factor, "slow_ranks": list(ranks)}, ranks=ranks,
                  tolerated=("straggler", "throughput_drop"))
        ]  # fmt: skip
    if isinstance(f, Hang):
        return [
            Label("hang", f.rank, scn.node_of(f.rank), f.step, None,
                  {"mode": f.mode, "phase": f.phase if f.mode == "stuck" else None, "last_completed_step": f.step - 1})
        ]  # fmt: skip
    if isinstance(f, MemoryLeak):
        return [
            Label("memory_leak", f.rank, None if f.rank is None else scn.node_of(f.rank), f.start,
                  _end(f.start, f.duration), {"mb_per_step": f.mb_per_step, **({"ranks": "all"} if f.rank is None else {})})
        ]  # fmt: skip
    if isinstance(f, ReplicaDivergence):
        every = scn.fingerprint_every
        first_fp = -(-f.step // every) * every if every else None
        return [
            Label("replica_divergence", f.rank, scn.node_of(f.rank), f.step, None,
                  {"first_fingerprint_step": first_fp})
        ]  # fmt: skip
    if isinstance(f, Fp8OverflowRisk):
        m = scn.modules.index(f.module)
        return [
            Label("fp8_overflow_risk", None, None, f.start, None,
                  {"module": f.module, "module_index": m, "growth_per_step": f.growth_per_step,
                   "e4m3_max": E4M3_MAX, "e5m2_max": E5M2_MAX})
        ]  # fmt: skip
    if isinstance(f, ThroughputDrop):
        return [
            Label("throughput_drop", None, None, f.step, _end(f.step, f.duration), {"factor": f.factor})
        ]  # fmt: skip
    raise TypeError(f"unknown fault {f!r}")
