"""What the training thread hands to the sender thread. Torch-free: the sender only reads host copies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Live:
    """State the sender reads for heartbeats and the training thread writes (plain attribute stores).

    `forwards` / `nograd_forwards` count the root model's forward calls in this session (all, and those
    with autograd off: `torch.no_grad()`, `inference_mode`), also inside a marked pause: forwards that
    advance while no step completes are an evaluation, not a hang (docs/ingest.md, `heartbeat`). A
    recompute of the root module under activation checkpointing runs with autograd on: it adds to
    `forwards`, never to `nograd_forwards`.
    """

    phase: str = "data"
    last_step: int | None = None
    transfer_requested: bool = False
    forwards: int = 0
    nograd_forwards: int = 0
    # A `profile` command (_commands.py): (command id, steps) asked by the sender; the training thread's
    # hooks trace that many whole steps (_profile.py) and leave the finished profiler in `profile_done`.
    profile_request: tuple[int, int] | None = None
    profile_done: Any = None


@dataclass(slots=True)
class StepRecord:
    """One finished step.

    Its device values live in the host copy of a chunk (`Chunk.values`), in two places:
    - from `offset`: one scalar per `hook_names`, one per `log_names`;
    - from `voffset`: one max |x| per item of `amax_calls` (a tracked module's call this step, in call
      order, by its index in `amax_names`; non-finite when the output had a non-finite element; shipped
      per module, the max over its calls, when `ship_amax`, and else only that finiteness is read: a big
      CPU output's value is its sum there), then one grad norm per `grad_names`,
      then 4 float 16-bit words of the fingerprint when `fingerprint`.
    Until the transfer, `scalars` holds the 0-dim device tensors of the first part and `vectors` the
    1-dim ones of the second (few steps have any).
    """

    step: int
    ts: float
    host: dict[str, float | None]
    hook_names: tuple[str, ...] = ()
    log_names: tuple[str, ...] = ()
    amax_names: tuple[str, ...] = ()
    amax_calls: list[int] = field(default_factory=list)
    ship_amax: bool = False
    amax_exact: bool = False  # every value of the first part is a max |x| (also where not shipped: CUDA)
    ids: dict[str, Any] | None = None  # watch.identify(): sent only with the first non-finite step
    grad_names: tuple[str, ...] = ()
    fingerprint: bool = False
    loss_div: int = 1
    # (previous step end, [(forward start, forward end), ...], optimizer start, step end): CUDA events
    # read by the sender once the chunk's copy has completed; None on CPU (timings are in `host`).
    marks: tuple[Any, list[tuple[Any, Any]], Any, Any] | None = None
    scalars: list[Any] = field(default_factory=list)  # 0-dim device tensors until the transfer
    vectors: list[Any] = field(default_factory=list)  # 1-dim device tensors until the transfer
    offset: int = 0
    voffset: int = 0


@dataclass(slots=True)
class Chunk:
    """Several steps' device values copied to host memory in one transfer."""

    records: list[StepRecord]
    values: Any = None  # a CPU tensor (pinned on CUDA), or None when no step had device values
    ready: Any = None  # a CUDA event that completes when `values` is filled; None on CPU

    def is_ready(self) -> bool:
        return self.ready is None or bool(self.ready.query())
