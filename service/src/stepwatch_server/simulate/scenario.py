"""What a simulated run is: its shape (ranks, steps, timing, noise), its injected faults, its benign
behaviours (`benign.py`), and the ground truth the detectors are scored against.

A `Scenario` is plain, frozen data. Everything random is derived from `seed`, so one scenario always
produces the same trace, and the same seed with and without a fault produces the same clean baseline
(faults draw from their own random streams). Labels are derived from the faults alone, so they are
known before a single batch is generated; `Simulation.labels` adds the event time of each onset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Literal, NamedTuple

from stepwatch_server.simulate.benign import Benign, LossBump, Resume

DEFAULT_MODULES = (
    "layers.0.attn.qkv",
    "layers.0.mlp.fc2",
    "layers.3.attn.qkv",
    "layers.3.attn.logits",
    "layers.7.mlp.fc1",
    "lm_head",
)
DEFAULT_START_TS = 1764427200.0  # 2025-11-29 14:40 UTC: a fixed epoch keeps traces reproducible


@dataclass(frozen=True)
class Label:
    """Ground truth for one injected fault.

    `rank`/`node` is the entity a detector must blame (None: the whole run). `ranks` widens the rank
    that is accepted (e.g. every rank of a slow node, every rank that produced a NaN). `last_step` is
    None when the fault lasts to the end of the run. `tolerated` lists other kinds whose detections in
    this window are physically implied (a 2x straggler does slow the whole run) and therefore count
    neither as hits nor as false alarms. `first_ts` is the event time of the onset (the end of the
    fault's first step; for a hang, the end of the last step anyone completed); it is known only once
    the trace is generated.
    """

    kind: str
    rank: int | None
    node: str | None
    first_step: int
    last_step: int | None
    details: Mapping[str, Any] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()
    tolerated: tuple[str, ...] = ()
    first_ts: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "rank": self.rank,
            "node": self.node,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "ranks": list(self.ranks),
            "tolerated": list(self.tolerated),
            "first_ts": self.first_ts,
            "details": dict(self.details),
        }


# -- faults: one frozen dataclass per kind; their effects live in faults.py ---------------------------


@dataclass(frozen=True)
class LossSpike:
    """The global loss jumps by `magnitude` (x) at `step` and decays back within `recovery_steps`;
    the grad norm spikes `grad_lead_steps` before (the update that caused it)."""

    kind: ClassVar[str] = "loss_spike"
    step: int
    magnitude: float = 1.6
    recovery_steps: int = 30
    grad_lead_steps: int = 1


@dataclass(frozen=True)
class Divergence:
    """The loss leaves its curve for good: a spike that never recovers, an exponential upward trend,
    or a trend that ends in NaN on every rank `nan_after_steps` later (parameters went non-finite)."""

    kind: ClassVar[str] = "divergence"
    step: int
    mode: Literal["spike-no-recover", "trend", "nonfinite"] = "trend"
    magnitude: float = 1.8  # spike-no-recover: the new level (x)
    rate_per_step: float = 0.004  # trend / nonfinite: exponential growth of the loss
    nan_after_steps: int = 40  # nonfinite: steps from onset to NaN


@dataclass(frozen=True)
class NonFinite:
    """NaN/Inf on `ranks` at `step` for `steps` steps (the step is then skipped, as a grad scaler or a
    skip-nonfinite guard does). `where`: activations (the first bad module is `module`; the loss is
    NaN too), loss (bad sample), grads (an overflow in backward). The all-reduce spreads NaN gradients
    to every rank, so every rank reports non-finite grads; only the culprits report loss/activations."""

    kind: ClassVar[str] = "nonfinite"
    step: int
    ranks: tuple[int, ...] = (0,)
    module: str = "layers.3.attn.qkv"
    where: Literal["activations", "loss", "grads"] = "activations"
    steps: int = 1


@dataclass(frozen=True)
class Straggler:
    """One rank's `phase` time is `factor` x longer, plus `extra_ms` (a loader that does more work per
    batch), from `start` for `duration` steps (None: to the end)."""

    kind: ClassVar[str] = "straggler"
    rank: int
    start: int
    factor: float = 1.10
    phase: Literal["data", "forward"] = "forward"
    duration: int | None = None
    extra_ms: float = 0.0


@dataclass(frozen=True)
class SlowNode:
    """`slow_ranks` ranks of node `node` (an index) run their forward `factor` x slower together
    (thermal throttling, a bad NVLink/PCIe switch, a noisy neighbour)."""

    kind: ClassVar[str] = "slow_node"
    node: int
    start: int
    factor: float = 1.3
    slow_ranks: int | None = None  # None: every rank of the node
    duration: int | None = None


@dataclass(frozen=True)
class Hang:
    """`rank` never finishes step `step`: it is stuck in `phase` (its sender thread keeps sending
    heartbeats) or dead (heartbeats stop; the steps it had not yet sent are lost). Everyone else
    finishes forward and blocks in the backward all-reduce. The run produces no step >= `step`."""

    kind: ClassVar[str] = "hang"
    rank: int
    step: int
    mode: Literal["stuck", "dead"] = "stuck"
    phase: Literal["data", "forward"] = "data"


@dataclass(frozen=True)
class MemoryLeak:
    """Allocated memory on `rank` grows by `mb_per_step` from `start` (a list that keeps tensors).
    `rank` None: the training code itself leaks, on every rank (within a few percent): one run-level
    label."""

    kind: ClassVar[str] = "memory_leak"
    rank: int | None
    start: int
    mb_per_step: float = 4.0
    duration: int | None = None


@dataclass(frozen=True)
class ReplicaDivergence:
    """From `step` on, `rank`'s parameters differ from its replicas' (SDC, a non-deterministic
    kernel, a missed all-reduce); its loss looks normal, only its fingerprint tells."""

    kind: ClassVar[str] = "replica_divergence"
    rank: int
    step: int


@dataclass(frozen=True)
class Fp8OverflowRisk:
    """The amax of `module` grows by `growth_per_step` (exponential rate) from `start` on every rank,
    as attention logits do before a run blows up; it crosses E4M3's 448 some hundreds of steps later."""

    kind: ClassVar[str] = "fp8_overflow_risk"
    module: str
    start: int
    growth_per_step: float = 0.004


@dataclass(frozen=True)
class ThroughputDrop:
    """Every rank's compute (and the collective) is `factor` x slower from `step` for `duration` steps
    (power capping, a slow shared filesystem, a co-scheduled job): the whole run slows, no rank stands out."""

    kind: ClassVar[str] = "throughput_drop"
    step: int
    factor: float = 1.4
    duration: int | None = None


Fault = (
    LossSpike
    | Divergence
    | NonFinite
    | Straggler
    | SlowNode
    | Hang
    | MemoryLeak
    | ReplicaDivergence
    | Fp8OverflowRisk
    | ThroughputDrop
)


def node_name(node: int) -> str:
    return f"gpu-{node:03d}"


PAUSE_KINDS = ("eval", "checkpoint")


class Segment(NamedTuple):
    """One agent session of every rank: steps first..last; `kill` is the resume that ends it (None:
    the run ends or hangs)."""

    first: int
    last: int
    incarnation: int
    kill: Resume | None


@dataclass(frozen=True)
class Scenario:
    """One simulated synchronous data-parallel run (DDP: replica_group = rank, one shard).

    Times are per step at the median rank; noise levels are multiplied by `noise`. Rates are per rank
    per step (`gc_rate`), per step (`global_blip_rate`, `grad_spike_rate`) or per rank per 10k steps
    (`plateaus_per_10k`). `eval_every`/`ckpt_every` = 0 disables those pauses.

    The fields after `chunk_steps` are off (or the physics' constants) by default, so that scenarios
    written before them produce the same batches: `benign` behaviours; `marked_pauses`, the pause
    kinds the user wrapped in `watch.phase` (the others send no phase events); `agent_activity`,
    heartbeats that carry `forwards`, `nograd_forwards` and `stack` (`grad_accum` forwards per step,
    `eval_forwards_per_s` during evaluations, checkpoints saved by `ckpt_savers`, the user's code in
    module `user_module`); `capacity_mb`, the device's memory, sent as `mem.capacity_mb` (None: not
    reported); `base_alloc_mb`, `act_peak_mb`, `data_share`: the run's memory level, activation
    memory and the data wait's share of the step (None: the physics' defaults); `memory_every`, the
    steps between the agent's reads of the allocator's memory (the GPU agent reads it once per transfer
    of 8 steps: `mem.*` on every 8th step and on the last step of each batch, null between).
    """

    name: str
    world_size: int
    steps: int
    seed: int = 0
    faults: tuple[Fault, ...] = ()
    description: str = ""
    run: str | None = None
    ranks_per_node: int = 8
    step_ms: float = 400.0
    warmup_steps: int = 200
    peak_lr: float = 3e-4
    noise: float = 1.0
    eval_every: int = 0
    eval_s: float = 40.0
    ckpt_every: int = 0
    ckpt_s: float = 90.0
    compile_s: float = 25.0  # step 1 includes torch.compile / autotuning on every rank
    gc_rate: float = 1 / 800
    global_blip_rate: float = 1 / 2500
    grad_spike_rate: float = 1 / 2000
    plateaus_per_10k: float = 1.0
    modules: tuple[str, ...] = DEFAULT_MODULES
    amax_every: int = 10
    fingerprint_every: int = 100
    start_ts: float = DEFAULT_START_TS
    flush_interval_s: float = 2.0
    heartbeat_interval_s: float = 5.0
    hang_observe_s: float = 120.0
    chunk_steps: int = 50
    benign: tuple[Benign, ...] = ()
    marked_pauses: tuple[str, ...] = PAUSE_KINDS
    agent_activity: bool = False
    grad_accum: int = 1
    eval_forwards_per_s: float = 20.0
    ckpt_savers: Literal["rank0", "all"] = "all"
    user_module: str = "train"
    capacity_mb: float | None = None
    base_alloc_mb: float | None = None
    act_peak_mb: float | None = None
    data_share: float | None = None
    memory_every: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.steps < 1 or self.ranks_per_node < 1 or self.chunk_steps < 1:
            raise ValueError(f"{self.name}: world_size, steps, ranks_per_node and chunk_steps must be >= 1")
        if self.memory_every < 1:
            raise ValueError(f"{self.name}: memory_every must be >= 1, got {self.memory_every}")
        if self.grad_accum < 1 or not set(self.marked_pauses) <= set(PAUSE_KINDS):
            raise ValueError(f"{self.name}: grad_accum must be >= 1, marked_pauses a subset of {PAUSE_KINDS}")
        if self.data_share is not None and not 0.0 < self.data_share < 0.5:
            raise ValueError(f"{self.name}: data_share must be in (0, 0.5)")
        hangs = [f for f in self.faults if isinstance(f, Hang)]
        if len(hangs) > 1:
            raise ValueError(f"{self.name}: at most one hang (a hung run makes no further progress)")
        for f in self.faults:
            for attr in ("rank",):
                r = getattr(f, attr, None)
                if r is not None and not 0 <= r < self.world_size:
                    raise ValueError(f"{self.name}: {f.kind} rank {r} outside 0..{self.world_size - 1}")
            if isinstance(f, NonFinite) and any(not 0 <= r < self.world_size for r in f.ranks):
                raise ValueError(f"{self.name}: nonfinite ranks {f.ranks} outside the run")
            if isinstance(f, SlowNode) and not 0 <= f.node < self.num_nodes:
                raise ValueError(f"{self.name}: slow_node node {f.node} outside 0..{self.num_nodes - 1}")
            if isinstance(f, Fp8OverflowRisk) and f.module not in self.modules:
                raise ValueError(f"{self.name}: fp8 module {f.module!r} is not tracked ({self.modules})")
            if isinstance(f, NonFinite) and f.module not in self.modules:
                raise ValueError(f"{self.name}: nonfinite module {f.module!r} is not tracked")
            first = fault_first_step(f)
            if not 1 <= first <= self.steps:
                raise ValueError(f"{self.name}: {f.kind} starts at step {first}, outside 1..{self.steps}")
            if hangs and f is not hangs[0] and first >= hangs[0].step:
                raise ValueError(
                    f"{self.name}: {f.kind} at step {first} is after the hang at {hangs[0].step}"
                )
        self._check_benign()

    def _check_benign(self) -> None:
        """Benign behaviours inside the run, resumes that make sense, and no fault placed where a
        benign behaviour would make its label ambiguous."""
        from stepwatch_server.simulate.benign import window

        for b in self.benign:
            ranks = [*(getattr(b, "ranks", None) or ()), getattr(b, "rank", 0)]
            if any(not 0 <= r < self.world_size for r in ranks):
                raise ValueError(f"{self.name}: {b.kind} ranks {ranks} outside the run")
            node = getattr(b, "node", 0)
            if not 0 <= node < self.num_nodes:
                raise ValueError(f"{self.name}: {b.kind} node {node} outside 0..{self.num_nodes - 1}")
            first, _ = window(b, self)
            if not 1 <= first <= self.steps:
                raise ValueError(f"{self.name}: {b.kind} starts at step {first}, outside 1..{self.steps}")
        resumes = self.resumes
        prev: Resume | None = None
        for r in resumes:
            if not 1 <= r.checkpoint_step < r.step < self.last_step:
                raise ValueError(
                    f"{self.name}: a resume needs 1 <= checkpoint_step < step < the last step, got {r}"
                )
            if self.pause_after(r.checkpoint_step) != "checkpoint":
                raise ValueError(
                    f"{self.name}: resume from step {r.checkpoint_step}, which saved no checkpoint"
                )
            if r.gap_s <= 0:
                raise ValueError(f"{self.name}: a resume's gap must be positive")
            if prev is not None and not (prev.step < r.step and prev.checkpoint_step < r.checkpoint_step):
                raise ValueError(f"{self.name}: resumes must follow each other ({prev}, {r})")
            prev = r
        for f in self.faults:
            first = fault_first_step(f)
            if resumes and first <= resumes[-1].step + 1:
                raise ValueError(
                    f"{self.name}: {f.kind} at step {first} is not after the last resume (killed after "
                    f"step {resumes[-1].step}): which incarnation it belongs to would be ambiguous"
                )
            every = [e for e in (self.eval_every, self.ckpt_every) if e]
            if isinstance(f, Hang) and any((f.step - 1) % e == 0 for e in every):
                raise ValueError(f"{self.name}: a hang at step {f.step} would sit inside a pause")
            if isinstance(f, LossSpike | Divergence):
                for b in self.benign:
                    if isinstance(b, LossBump) and b.step - 5 <= first <= b.step + b.steps + 5:
                        raise ValueError(f"{self.name}: {f.kind} at step {first} inside a loss bump {b}")

    @property
    def run_name(self) -> str:
        return self.run or f"sim-{self.name}"

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    @property
    def last_step(self) -> int:
        """The last step any rank completes (a hang stops the run before its step)."""
        for f in self.faults:
            if isinstance(f, Hang):
                return f.step - 1
        return self.steps

    @property
    def hang(self) -> Hang | None:
        return next((f for f in self.faults if isinstance(f, Hang)), None)

    @property
    def resumes(self) -> tuple[Resume, ...]:
        return tuple(sorted((b for b in self.benign if isinstance(b, Resume)), key=lambda r: r.step))

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The agent sessions the run goes through (one unless it is resumed)."""
        out, first = [], 1
        for i, r in enumerate(self.resumes):
            out.append(Segment(first, r.step, i, r))
            first = r.checkpoint_step + 1
        out.append(Segment(first, self.last_step, len(out), None))
        return tuple(out)

    @property
    def completed_steps(self) -> int:
        """Steps completed, counting the steps a resume runs again once more each time."""
        return sum(seg.last - seg.first + 1 for seg in self.segments)

    def pause_marked(self, kind: str | None) -> bool:
        return kind is not None and kind in self.marked_pauses

    def pause_after(self, step: int) -> str | None:
        """The known pause ("checkpoint" or "eval") that follows `step`, if any."""
        if step < 1 or step >= self.last_step:
            return None
        if self.ckpt_every and step % self.ckpt_every == 0:
            return "checkpoint"
        if self.eval_every and step % self.eval_every == 0:
            return "eval"
        return None

    def node_of(self, rank: int) -> str:
        return node_name(rank // self.ranks_per_node)

    def ranks_of_node(self, node: int) -> tuple[int, ...]:
        lo = node * self.ranks_per_node
        return tuple(range(lo, min(lo + self.ranks_per_node, self.world_size)))

    @cached_property
    def labels(self) -> tuple[Label, ...]:
        """Ground truth (without onset timestamps; see `Simulation.labels`)."""
        from stepwatch_server.simulate.faults import labels_for

        return tuple(lab for f in self.faults for lab in labels_for(f, self))

    @property
    def clean(self) -> bool:
        return not self.faults

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for `python -m stepwatch_server.simulate describe`."""
        return {
            "name": self.name,
            "description": self.description,
            "run": self.run_name,
            "world_size": self.world_size,
            "nodes": self.num_nodes,
            "steps": self.steps,
            "last_step": self.last_step,
            "seed": self.seed,
            "step_ms": self.step_ms,
            "eval_every": self.eval_every,
            "ckpt_every": self.ckpt_every,
            "marked_pauses": list(self.marked_pauses),
            "agent_activity": self.agent_activity,
            "capacity_mb": self.capacity_mb,
            "memory_every": self.memory_every,
            "faults": [{"kind": f.kind, **_fields(f)} for f in self.faults],
            "benign": [{"kind": b.kind, **_fields(b)} for b in self.benign],
            "labels": [lab.as_dict() for lab in self.labels],
        }


def _fields(obj: Any) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(obj).items()}


def fault_first_step(f: Fault) -> int:
    """The first step a fault affects (its label's `first_step`)."""
    if isinstance(f, Straggler | SlowNode | MemoryLeak | Fp8OverflowRisk):
        return f.start
    return f.step
