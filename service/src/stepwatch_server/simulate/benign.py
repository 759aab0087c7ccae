"""Benign behaviours of real runs that look like faults to a careless detector, and what each does to
a chunk of the trace. None of them is a fault: they produce no label.

Like faults, the effects act on a chunk's intrinsic values before `CleanPhysics.sync()`, so a node's
slow data loading reaches every rank's backward wait through the physics, never by hand. Each effect
is a pure function of the step numbers and of its own parameters; where it needs randomness (how much
each rank of an every-rank drift rises) it draws from its own stream, keyed by the behaviour's own
value, so adding a behaviour to a scenario never changes the rest of its trace. A new agent session
(after a `Resume`) restarts the process: memory behaviours that had begun start again from zero.

`Resume` and the unmarked pauses (`Scenario.marked_pauses`) change the shape of the batch stream
rather than values; `simulation.py` and `batches.py` carry them out.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

if TYPE_CHECKING:
    from stepwatch_server.simulate.physics import Chunk
    from stepwatch_server.simulate.scenario import Scenario

STREAM_BENIGN = 4
RANK_SPREAD = 0.15  # an every-rank behaviour is not identical on every rank (+-15%, lognormal sigma)


@dataclass(frozen=True)
class MemoryDrift:
    """Allocated memory rises from `start` with slope `mb_per_step`, slowing as it goes, towards a total
    rise of `total_mb`: total * (1 - exp(-(t - start) / tau)), tau = total / slope (a cache that fills,
    fragmentation settling). `ranks` None: every rank (each rises a little differently)."""

    kind: ClassVar[str] = "memory_drift"
    start: int
    mb_per_step: float
    total_mb: float
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class EvalMemoryStep:
    """At the session's first len(mb) evaluations (marked or not), allocated memory steps up by mb[i]
    and stays (the allocator keeps what the evaluation's different shapes needed)."""

    kind: ClassVar[str] = "eval_memory_step"
    mb: tuple[float, ...]


@dataclass(frozen=True)
class MemorySawtooth:
    """`ranks` (rank 0, or every node's local rank 0) hold on to `mb` more over each `period` steps,
    rising linearly, then let it go at once (a metrics or logging buffer flushed every period)."""

    kind: ClassVar[str] = "memory_sawtooth"
    ranks: tuple[int, ...]
    mb: float
    period: int
    start: int = 1


@dataclass(frozen=True)
class Congestion:
    """The fabric is congested: the exposed collective (the all-reduce tail, so every rank's backward
    wait and step time) is `factor` x longer for `steps` steps from `step`."""

    kind: ClassVar[str] = "congestion"
    step: int
    steps: int
    factor: float


@dataclass(frozen=True)
class NodeDataHiccup:
    """Every rank of node `node` (an index) waits `factor` x longer for data for `steps` steps (the
    node's local disk or page cache, a shared-filesystem stall seen from one host)."""

    kind: ClassVar[str] = "node_data_hiccup"
    node: int
    step: int
    steps: int
    factor: float


@dataclass(frozen=True)
class DataStall:
    """One rank's data wait grows by `step_times` x the median step for `steps` steps (a slow shard
    read, a loader worker restarted)."""

    kind: ClassVar[str] = "data_stall"
    rank: int
    step: int
    steps: int
    step_times: float


@dataclass(frozen=True)
class LossBump:
    """The global loss is `factor` x higher for `steps` steps from `step`, and the grad norm does not
    move (a run of harder batches from one data source)."""

    kind: ClassVar[str] = "loss_bump"
    step: int
    steps: int
    factor: float


@dataclass(frozen=True)
class ExtraDataWork:
    """Local rank 0 of every node (`who` "local0") or rank 0 alone ("rank0") does `factor` x the data
    work of its peers for the whole run (it also reads the shared index, logs, or feeds the others)."""

    kind: ClassVar[str] = "extra_data_work"
    factor: float
    who: Literal["local0", "rank0"] = "local0"


@dataclass(frozen=True)
class Resume:
    """The job is killed after completing step `step` (every sender stops with it: no heartbeats, the
    steps a rank had not sent yet are lost); `gap_s` later every rank starts a new agent session that
    resumes from the checkpoint of step `checkpoint_step`, so steps checkpoint_step+1.. are run again
    with new values (a new incarnation), the first of them compiling again, memory ramping up again."""

    kind: ClassVar[str] = "resume"
    step: int
    checkpoint_step: int
    gap_s: float


Benign = (
    MemoryDrift
    | EvalMemoryStep
    | MemorySawtooth
    | Congestion
    | NodeDataHiccup
    | DataStall
    | LossBump
    | ExtraDataWork
    | Resume
)


def rank_spread(b: Benign, scn: Scenario, n: int) -> np.ndarray:
    """n per-rank multipliers around 1, from the behaviour's own stream (the same on every chunk)."""
    key = zlib.crc32(repr(b).encode())
    rng = np.random.default_rng([scn.seed, STREAM_BENIGN, key])
    return np.exp(rng.normal(0.0, RANK_SPREAD, n))


def _rows(ch: Chunk, first: int, steps: int) -> np.ndarray:
    return ch.rows(first, first + steps - 1)


# -- effects -------------------------------------------------------------------------------------------


def memory_drift(b: MemoryDrift, ch: Chunk, scn: Scenario) -> None:
    ranks = np.arange(scn.world_size) if b.ranks is None else np.array(b.ranks, dtype=np.int64)
    spread = rank_spread(b, scn, ranks.shape[0]) if ranks.shape[0] > 1 else np.ones(1)
    total = b.total_mb * spread
    tau = total / (b.mb_per_step * spread[::-1])  # slope and size vary independently
    t = np.maximum((ch.steps - max(b.start, ch.session_first)).astype(np.float64) + 1.0, 0.0)
    rise = total[None, :] * (1.0 - np.exp(-t[:, None] / tau[None, :]))
    ch.alloc[:, ranks] += rise
    ch.peak[:, ranks] += rise


def eval_steps(scn: Scenario, first: int, count: int) -> list[int]:
    """The first `count` steps from `first` on that are followed by an evaluation."""
    out: list[int] = []
    if not scn.eval_every or count <= 0:
        return out
    s = -(-first // scn.eval_every) * scn.eval_every
    while s < scn.last_step and len(out) < count:
        if scn.pause_after(s) == "eval":
            out.append(s)
        s += scn.eval_every
    return out


def eval_memory_step(b: EvalMemoryStep, ch: Chunk, scn: Scenario) -> None:
    spread = rank_spread(b, scn, scn.world_size) ** 0.2  # the same shapes everywhere: small spread
    for step, mb in zip(eval_steps(scn, ch.session_first, len(b.mb)), b.mb, strict=False):
        after = ch.steps > step
        if after.any():
            ch.alloc[after] += mb * spread
            ch.peak[after] += mb * spread


def memory_sawtooth(b: MemorySawtooth, ch: Chunk, scn: Scenario) -> None:
    ranks = np.array(b.ranks, dtype=np.int64)
    t = (ch.steps - max(b.start, ch.session_first)).astype(np.float64)
    level = np.where(t >= 0, np.mod(t, b.period) / b.period * b.mb, 0.0)
    ch.alloc[:, ranks] += level[:, None]
    ch.peak[:, ranks] += level[:, None]


def congestion(b: Congestion, ch: Chunk, scn: Scenario) -> None:
    ch.tail[_rows(ch, b.step, b.steps)] *= b.factor


def node_data_hiccup(b: NodeDataHiccup, ch: Chunk, scn: Scenario) -> None:
    rows = np.flatnonzero(_rows(ch, b.step, b.steps))
    if rows.size == 0:
        return
    ranks = np.array(scn.ranks_of_node(b.node), dtype=np.int64)
    sub = np.ix_(rows, ranks)
    ch.data[sub] += (b.factor - 1.0) * ch.own_data()[sub]


def data_stall(b: DataStall, ch: Chunk, scn: Scenario) -> None:
    rows = _rows(ch, b.step, b.steps)
    if ch.rank_stall_ms is None:
        ch.rank_stall_ms = np.zeros(ch.data.shape)
    ch.rank_stall_ms[rows, b.rank] += b.step_times * scn.step_ms  # not the loader's: own_data() leaves it out
    ch.data[rows, b.rank] += b.step_times * scn.step_ms


def loss_bump(b: LossBump, ch: Chunk, scn: Scenario) -> None:
    ch.loss[_rows(ch, b.step, b.steps)] *= b.factor


def extra_data_work_ranks(b: ExtraDataWork, scn: Scenario) -> tuple[int, ...]:
    if b.who == "rank0":
        return (0,)
    return tuple(range(0, scn.world_size, scn.ranks_per_node))


def extra_data_work(b: ExtraDataWork, ch: Chunk, scn: Scenario) -> None:
    ranks = np.array(extra_data_work_ranks(b, scn), dtype=np.int64)
    ch.data[:, ranks] += (b.factor - 1.0) * ch.own_data()[:, ranks]


def resume(b: Resume, ch: Chunk, scn: Scenario) -> None:
    """Nothing to change in a chunk: the simulation splits the run into sessions (see the docstring)."""


EFFECTS: dict[type, Callable[[Any, Chunk, Scenario], None]] = {
    MemoryDrift: memory_drift,
    EvalMemoryStep: eval_memory_step,
    MemorySawtooth: memory_sawtooth,
    Congestion: congestion,
    NodeDataHiccup: node_data_hiccup,
    DataStall: data_stall,
    LossBump: loss_bump,
    ExtraDataWork: extra_data_work,
    Resume: resume,
}


def apply(b: Benign, ch: Chunk, scn: Scenario) -> None:
    EFFECTS[type(b)](b, ch, scn)


def window(b: Benign, scn: Scenario) -> tuple[int, int | None]:
    """The steps a behaviour touches (last None: to the end of the run), for reading false alarms."""
    if isinstance(b, MemoryDrift):
        return b.start, None
    if isinstance(b, EvalMemoryStep):
        steps = eval_steps(scn, 1, len(b.mb))
        return (steps[0] + 1, None) if steps else (scn.steps, scn.steps)
    if isinstance(b, MemorySawtooth):
        return b.start, None
    if isinstance(b, Congestion | NodeDataHiccup | DataStall | LossBump):
        return b.step, b.step + b.steps - 1
    if isinstance(b, ExtraDataWork):
        return 1, None
    if isinstance(b, Resume):
        return b.checkpoint_step + 1, b.step + 1
    raise TypeError(f"unknown benign behaviour {b!r}")


def describe(b: Benign) -> str:
    """One line for a person reading a false alarm."""
    if isinstance(b, MemoryDrift):
        who = "every rank" if b.ranks is None else f"ranks {list(b.ranks)[:6]}"
        return f"memory drift on {who} from {b.start}: {b.mb_per_step:.2f} MB/step levelling off at +{b.total_mb:.0f} MB"
    if isinstance(b, EvalMemoryStep):
        return f"memory steps up at the first evals: {[round(x) for x in b.mb]} MB"
    if isinstance(b, MemorySawtooth):
        return (
            f"memory sawtooth on ranks {list(b.ranks)[:6]}: +{b.mb:.0f} MB over {b.period} steps, then back"
        )
    if isinstance(b, Congestion):
        return f"congestion {b.step}-{b.step + b.steps - 1}: collective {b.factor:.2f}x"
    if isinstance(b, NodeDataHiccup):
        return f"node {b.node} data hiccup {b.step}-{b.step + b.steps - 1}: data {b.factor:.1f}x"
    if isinstance(b, DataStall):
        return f"rank {b.rank} data stall {b.step}-{b.step + b.steps - 1}: +{b.step_times:.1f} step times"
    if isinstance(b, LossBump):
        return f"loss bump {b.step}-{b.step + b.steps - 1}: {b.factor:.3f}x, no grad-norm move"
    if isinstance(b, ExtraDataWork):
        return f"{'local rank 0 of every node' if b.who == 'local0' else 'rank 0'} does {b.factor:.2f}x the data work"
    if isinstance(b, Resume):
        return f"killed after step {b.step}, resumed {b.gap_s:.0f} s later from the checkpoint of step {b.checkpoint_step}"
    raise TypeError(f"unknown benign behaviour {b!r}")
