"""The field rules of docs/ingest.md (schema 1), checked on what the agent sends."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

RUN = re.compile(r"[A-Za-z0-9._:/@+\-]{1,200}")
SESSION = re.compile(r"[A-Za-z0-9_-]{8,64}")
NAME = re.compile(r"[A-Za-z0-9._:/@+\-\[\]]{1,200}")
HEX16 = re.compile(r"[0-9a-f]{16}")
NONFINITE = {"NaN", "Infinity", "-Infinity"}
EVENT_KINDS = {"nonfinite", "phase_start", "phase_end", "note", "session_end"}


def _int(v: Any, minimum: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _value(v: Any) -> bool:
    return v is None or v in NONFINITE or (isinstance(v, int | float) and not isinstance(v, bool))


def validate(batch: dict[str, Any]) -> None:
    """Raise AssertionError naming the field that breaks the documented rules."""
    assert batch["schema"] == 1, "schema"
    assert isinstance(batch["run"], str) and RUN.fullmatch(batch["run"]), "run"
    assert isinstance(batch["session"], str) and SESSION.fullmatch(batch["session"]), "session"
    assert _int(batch["seq"], 0), "seq"
    assert _int(batch["world_size"], 1) and _int(batch["rank"], 0), "rank/world_size"
    assert batch["rank"] < batch["world_size"], "rank < world_size"
    for name, minimum in (("local_rank", 0), ("replica_group", 0), ("shard", 0), ("num_shards", 1)):
        assert name not in batch or _int(batch[name], minimum), name
    assert "node" not in batch or (isinstance(batch["node"], str) and len(batch["node"]) <= 200), "node"
    agent = batch.get("agent", {})
    assert isinstance(agent.get("version", ""), str), "agent.version"
    assert all(_int(v, 0) for v in agent.get("counters", {}).values()), "agent.counters"
    steps = batch["steps"]
    assert all(_int(s, 0) for s in steps), "steps"
    assert all(a < b for a, b in itertools.pairwise(steps)), "steps strictly increasing"
    assert len(batch["timestamps"]) == len(steps), "timestamps"
    assert all(isinstance(t, int | float) for t in batch["timestamps"]), "timestamps"
    for name, values in batch.get("metrics", {}).items():
        assert NAME.fullmatch(name), f"metrics name {name}"
        assert len(values) == len(steps), f"metrics.{name} length"
        assert all(_value(v) for v in values), f"metrics.{name} values"
        if name == "mem.capacity_mb":
            assert all(v is None or (isinstance(v, float) and v > 0) for v in values), "mem.capacity_mb"
    n_values = len(steps) * len(batch.get("metrics", {}))
    if "tensors" in batch:
        t_steps = batch["tensors"]["steps"]
        assert set(t_steps) <= set(steps), "tensors.steps subset"
        for stat, per_name in batch["tensors"]["stats"].items():
            assert stat in {"amax", "grad_norm"}, f"tensors.stats.{stat}"
            for name, values in per_name.items():
                assert NAME.fullmatch(name), f"tensors name {name}"
                assert len(values) == len(t_steps), f"tensors.stats.{stat}.{name} length"
                assert all(_value(v) for v in values), f"tensors.stats.{stat}.{name} values"
                n_values += len(values)
    if "fingerprints" in batch:
        fp = batch["fingerprints"]
        assert set(fp["steps"]) <= set(steps) and len(fp["values"]) == len(fp["steps"]), "fingerprints"
        assert all(isinstance(v, str) and HEX16.fullmatch(v) for v in fp["values"]), "fingerprints.values"
    for event in batch.get("events", []):
        assert _int(event["step"], 0) and isinstance(event["ts"], int | float), "events step/ts"
        assert event["kind"] in EVENT_KINDS, "events.kind"
        assert isinstance(event["data"], dict) and len(json.dumps(event["data"])) <= 4096, "events.data"
    if "heartbeat" in batch:
        hb = batch["heartbeat"]
        assert isinstance(hb["ts"], int | float) and isinstance(hb["phase"], str), "heartbeat"
        assert hb["last_step"] is None or _int(hb["last_step"], 0), "heartbeat.last_step"
        for name in ("forwards", "nograd_forwards"):
            assert name not in hb or _int(hb[name], 0), f"heartbeat.{name}"
        assert hb.get("nograd_forwards", 0) <= hb.get("forwards", 0), "heartbeat.nograd_forwards <= forwards"
        stack = hb.get("stack", [])
        assert isinstance(stack, list) and len(stack) <= 16, "heartbeat.stack: at most 16 frames"
        assert all(isinstance(f, str) and 1 <= len(f) <= 200 for f in stack), "heartbeat.stack frames"
        assert not any(f.split(":")[0].split(".")[0] == "stepwatch" for f in stack), "heartbeat.stack: own"
    assert n_values <= 1_000_000, "at most 1,000,000 values"
