"""The validated form of an ingest batch (docs/ingest.md, schema 1) and the format's limits.

`validate.parse_batch()` turns a request body into a `Batch`; everything downstream (storage, and
later the bus and the detectors) sees only this form: numpy columns, no JSON.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMA_VERSIONS = (1,)
MAX_VALUES_PER_BATCH = 1_000_000
MAX_EVENT_DATA_BYTES = 4 * 1024
MAX_NODE_CHARS = 200
MAX_PHASE_CHARS = 200
MAX_STACK_FRAMES = 16  # heartbeat.stack: innermost frames of the training thread
MAX_FRAME_CHARS = 200  # ... each "module:function"
MAX_AGENT_VERSION_CHARS = 64
MAX_STEP = 2**62  # steps and counters must fit a signed 64-bit column with room to spare
EVENT_KINDS = frozenset({"nonfinite", "phase_start", "phase_end", "note", "session_end"})

MAX_WORLD_SIZE = 131_072  # ranks in one run (8x Llama 3's 16,384 GPUs); a batch declaring more: 422
# Distinct series per run, counted as the store counts them: each metric name, and each (statistic,
# module) pair of `tensors` (a module with amax and grad_norm is two). A dense LLM watched in full needs a
# few thousand (Llama 3 405B: 126 layers, ~1,100 parameters' grad norms and ~900 Linear modules' amax);
# 20,000 leaves room for a mixture of experts' modules and user metrics, and bounds what one run costs:
# its series dictionary in the writer's cache (a few MiB) and, on SQLite, the time one batch of new names
# holds the write lock. A batch that would take its run past it: 422 `too_many_series`.
MAX_SERIES_PER_RUN = 20_000
# Event time in Unix seconds: from 1970 to the last second a datetime holds (9999-12-31T23:59:59 UTC).
MIN_TS = 0.0
MAX_TS = 253_402_300_799.0
MAX_EVENT_DATA_DEPTH = 32  # objects and arrays inside one event's data
# Not only dots: "." and ".." name folders (a spool path, a URL path segment), not runs.
RUN_RE = re.compile(r"(?!\.+$)[A-Za-z0-9._:/@+\-]{1,200}")
SESSION_RE = re.compile(r"[A-Za-z0-9_\-]{8,64}")
NAME_RE = re.compile(r"[A-Za-z0-9._:/@+\-\[\]]{1,200}")
FINGERPRINT_RE = re.compile(r"[0-9a-fA-F]{16}")

TOP_LEVEL_FIELDS = frozenset(
    {
        "schema",
        "run",
        "session",
        "seq",
        "rank",
        "local_rank",
        "world_size",
        "node",
        "replica_group",
        "shard",
        "num_shards",
        "agent",
        "steps",
        "timestamps",
        "metrics",
        "tensors",
        "fingerprints",
        "events",
        "heartbeat",
    }
)


@dataclass(frozen=True, slots=True)
class Column:
    """One value per step of its steps array: float64 with NaN/±Inf, and which entries were sent.

    `present` is None when every entry carries a value (the common case); otherwise False marks a
    JSON null (not measured), which is not stored.
    """

    values: np.ndarray
    present: np.ndarray | None = None

    def count(self) -> int:
        return int(self.values.shape[0] if self.present is None else np.count_nonzero(self.present))


@dataclass(frozen=True, slots=True)
class BatchEvent:
    step: int
    ts: float
    kind: str
    data: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The rank is alive and where its training thread is (docs/ingest.md, `heartbeat`).

    `forwards` / `nograd_forwards` count the watched model's forward calls in this session (all, and
    those without autograd: evaluation, generation), so forwards that advance while no step completes
    tell an unmarked evaluation from a hang. `stack` is the training thread's Python stack, innermost
    frame first, as "module:function" (stepwatch's own frames left out): a save call or a collective.
    """

    ts: float
    phase: str | None
    last_step: int | None
    forwards: int | None = None
    nograd_forwards: int | None = None
    stack: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Batch:
    """One rank's records for some steps, validated."""

    run: str
    session: str
    seq: int
    rank: int
    world_size: int
    steps: np.ndarray  # int64, strictly increasing
    timestamps: np.ndarray  # float64 Unix seconds, one per step
    local_rank: int | None = None
    node: str | None = None
    replica_group: int = 0
    shard: int = 0
    num_shards: int = 1
    agent_version: str | None = None
    agent_counters: dict[str, int] | None = None
    metrics: dict[str, Column] = field(default_factory=dict)
    tensor_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tensors: dict[str, dict[str, Column]] = field(default_factory=dict)  # stat -> name -> column
    fingerprint_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    fingerprints: tuple[str, ...] = ()
    events: tuple[BatchEvent, ...] = ()
    heartbeat: Heartbeat | None = None
    _rows: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:  # counted once: the writer asks several times a batch
        n = sum(col.count() for col in self.metrics.values())
        n += sum(col.count() for cols in self.tensors.values() for col in cols.values())
        object.__setattr__(self, "_rows", n + len(self.fingerprints) + len(self.events))

    def value_rows(self) -> int:
        """How many rows storing this batch writes, as the ingest answer counts them."""
        return self._rows
