"""What the training thread hands to the sender thread. Torch-free: the sender only reads host copies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Live:
    """State the sender reads for heartbeats and the training thread writes (plain attribute stores)."""

    phase: str = "data"
    last_step: int | None = None
    transfer_requested: bool = False


@dataclass(slots=True)
class StepRecord:
    """One finished step. Its device values are a segment of a chunk's host tensor, in this order:
    `hook_names` scalars, `log_names` scalars, (min, max) of each of `amax_names` (min > max: it did not run),
    one grad norm per `grad_names`, then 4 float 16-bit words of the fingerprint when `fingerprint`."""

    step: int
    ts: float
    host: dict[str, float | None]
    hook_names: tuple[str, ...] = ()
    log_names: tuple[str, ...] = ()
    amax_names: tuple[str, ...] = ()
    ship_amax: bool = False
    grad_names: tuple[str, ...] = ()
    fingerprint: bool = False
    loss_div: int = 1
    # (previous step end, [(forward start, forward end), ...], optimizer start, step end): CUDA events
    # read by the sender once the chunk's copy has completed; None on CPU (timings are in `host`).
    marks: tuple[Any, list[tuple[Any, Any]], Any, Any] | None = None
    parts: list[Any] = field(default_factory=list)  # device tensors until the transfer
    offset: int = 0
    length: int = 0


@dataclass(slots=True)
class Chunk:
    """Several steps' device values copied to host memory in one transfer."""

    records: list[StepRecord]
    values: Any = None  # a CPU tensor (pinned on CUDA), or None when no step had device values
    ready: Any = None  # a CUDA event that completes when `values` is filled; None on CPU

    def is_ready(self) -> bool:
        return self.ready is None or bool(self.ready.query())
