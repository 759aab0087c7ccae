"""A structural checker for schema-1 batches (docs/ingest.md), written from the page, independent of the
collector's validator; and a small collector that turns a batch stream back into per-rank arrays."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

RUN_RE = re.compile(r"[A-Za-z0-9._:/@+\-]{1,200}")
SESSION_RE = re.compile(r"[A-Za-z0-9_\-]{8,64}")
NAME_RE = re.compile(r"[A-Za-z0-9._:/@+\-\[\]]{1,200}")
HEX16 = re.compile(r"[0-9a-f]{16}")
TOP = {
    "schema", "run", "session", "seq", "rank", "local_rank", "world_size", "node", "replica_group", "shard",
    "num_shards", "agent", "steps", "timestamps", "metrics", "tensors", "fingerprints", "events", "heartbeat",
}  # fmt: skip
REQUIRED = {"schema", "run", "session", "seq", "rank", "world_size", "steps", "timestamps"}
AGENT_METRICS = {
    "loss", "grad_norm", "lr", "time.data_ms", "time.forward_ms", "time.backward_ms", "time.optimizer_ms",
    "time.step_ms", "mem.allocated_mb", "mem.reserved_mb", "mem.peak_mb", "nonfinite.loss", "nonfinite.grads",
    "nonfinite.activations",
}  # fmt: skip
OPTIONAL_METRICS = {"mem.capacity_mb"}  # sent by the simulator only when the scenario reports a capacity
NONFINITE_STRINGS = {"NaN", "Infinity", "-Infinity"}
HEARTBEAT = {"ts", "phase", "last_step", "forwards", "nograd_forwards", "stack"}
MAX_STACK_FRAMES, MAX_FRAME_CHARS = 16, 200


def _int(v: Any, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _value(v: Any) -> bool:
    if v is None or v in NONFINITE_STRINGS:
        return True
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def check_batch(b: dict[str, Any]) -> None:
    """Assert every rule of docs/ingest.md that a single batch can break."""
    assert set(b) <= TOP, set(b) - TOP
    assert set(b) >= REQUIRED, REQUIRED - set(b)
    assert b["schema"] == 1
    assert RUN_RE.fullmatch(b["run"]) and SESSION_RE.fullmatch(b["session"])
    assert _int(b["seq"], 0) and _int(b["rank"], 0) and _int(b["world_size"], 1)
    assert b["rank"] < b["world_size"]
    assert _int(b["local_rank"], 0) and isinstance(b["node"], str) and len(b["node"]) <= 200
    assert _int(b["replica_group"], 0) and _int(b["shard"], 0) and _int(b["num_shards"], 1)
    assert isinstance(b["agent"]["version"], str) and all(_int(v, 0) for v in b["agent"]["counters"].values())
    steps, ts = b["steps"], b["timestamps"]
    assert all(_int(s, 0) for s in steps) and len(ts) == len(steps)
    assert all(a < c for a, c in itertools.pairwise(steps)), "steps strictly increasing"
    assert all(isinstance(t, float) and math.isfinite(t) for t in ts)
    n_values = 0
    for name, col in b.get("metrics", {}).items():
        assert NAME_RE.fullmatch(name) and name in AGENT_METRICS | OPTIONAL_METRICS, name
        assert len(col) == len(steps), name
        assert all(_value(v) for v in col), name
        n_values += len(col)
    if steps:
        assert AGENT_METRICS <= set(b["metrics"]) <= AGENT_METRICS | OPTIONAL_METRICS
    step_set = set(steps)
    if "tensors" in b:
        t = b["tensors"]
        assert set(t["steps"]) <= step_set and t["steps"] == sorted(set(t["steps"]))
        for stat, by_name in t["stats"].items():
            assert stat in {"amax", "grad_norm"}
            for name, col in by_name.items():
                assert NAME_RE.fullmatch(name) and len(col) == len(t["steps"])
                assert all(_value(v) for v in col)
                n_values += len(col)
    if "fingerprints" in b:
        fp = b["fingerprints"]
        assert set(fp["steps"]) <= step_set and len(fp["values"]) == len(fp["steps"])
        assert all(HEX16.fullmatch(v) for v in fp["values"])
    for e in b.get("events", []):
        assert set(e) == {"step", "ts", "kind", "data"}
        assert (
            _int(e["step"], 0)
            and isinstance(e["ts"], float)
            and e["kind"] in {"nonfinite", "phase_start", "phase_end", "note", "session_end"}
        )
        assert isinstance(e["data"], dict) and len(json.dumps(e["data"])) <= 4096
    hb = b["heartbeat"]
    assert set(hb) <= HEARTBEAT, set(hb) - HEARTBEAT
    assert isinstance(hb["ts"], float) and isinstance(hb["phase"], str)
    assert hb["last_step"] is None or _int(hb["last_step"], 0)
    for name in ("forwards", "nograd_forwards"):
        assert name not in hb or _int(hb[name], 0), name
    if "forwards" in hb and "nograd_forwards" in hb:
        assert hb["nograd_forwards"] <= hb["forwards"]  # no-grad forwards are forwards too
    if "stack" in hb:
        frames = hb["stack"]
        assert isinstance(frames, list) and len(frames) <= MAX_STACK_FRAMES
        assert all(isinstance(f, str) and 1 <= len(f) <= MAX_FRAME_CHARS for f in frames)
    assert n_values <= 1_000_000
    json.dumps(b, allow_nan=False)  # non-finite values must be strings


def _num(v: Any) -> float:
    if v is None:
        return math.nan
    if isinstance(v, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[v]
    return float(v)


@dataclass
class Collected:
    """A batch stream folded back into arrays: metrics[name] is (last_step + 1, world_size), NaN where absent."""

    world_size: int
    metrics: dict[str, np.ndarray] = field(default_factory=dict)
    ts: np.ndarray | None = None
    amax: dict[str, np.ndarray] = field(default_factory=dict)
    fingerprints: dict[int, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    events: dict[int, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    heartbeats: dict[int, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    sessions: dict[int, set[str]] = field(default_factory=lambda: defaultdict(set))
    last_step_received: dict[int, int] = field(default_factory=dict)

    def series(self, name: str) -> np.ndarray:
        return self.metrics[name]


def collect(batches: Iterable[dict[str, Any]], world_size: int, steps: int) -> Collected:
    c = Collected(world_size)
    shape = (steps + 1, world_size)
    c.ts = np.full(shape, np.nan)
    for b in batches:
        r = b["rank"]
        c.sessions[r].add(b["session"])
        c.heartbeats[r].append(b["heartbeat"])
        c.events[r].extend(b.get("events", []))
        if not b["steps"]:
            continue
        idx = np.array(b["steps"])
        c.last_step_received[r] = max(c.last_step_received.get(r, 0), int(idx[-1]))
        c.ts[idx, r] = b["timestamps"]
        for name, col in b["metrics"].items():
            arr = c.metrics.setdefault(name, np.full(shape, np.nan))
            arr[idx, r] = [_num(v) for v in col]
        if "tensors" in b:
            tidx = np.array(b["tensors"]["steps"])
            for name, col in b["tensors"]["stats"]["amax"].items():
                arr = c.amax.setdefault(name, np.full(shape, np.nan))
                arr[tidx, r] = [_num(v) for v in col]
        if "fingerprints" in b:
            for s, v in zip(b["fingerprints"]["steps"], b["fingerprints"]["values"], strict=True):
                c.fingerprints[s][r] = v
    return c
