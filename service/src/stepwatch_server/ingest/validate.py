"""Strict validation of a parsed batch into a `Batch`.

Every problem raises `InvalidBatch` (422) whose message starts with the field path
(`metrics.loss[3]: ...`). Per-value work is vectorised: an array's element types are checked with
one `set(map(type, ...))` and converted by numpy; only arrays that hold null or the non-finite
strings take the slower per-element path.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import orjson

from stepwatch_server.errors import InvalidBatch, PayloadTooLarge
from stepwatch_server.ingest.schema import (
    EVENT_KINDS,
    FINGERPRINT_RE,
    MAX_AGENT_VERSION_CHARS,
    MAX_EVENT_DATA_BYTES,
    MAX_EVENT_DATA_DEPTH,
    MAX_FRAME_CHARS,
    MAX_NODE_CHARS,
    MAX_PHASE_CHARS,
    MAX_STACK_FRAMES,
    MAX_STEP,
    MAX_TS,
    MAX_VALUES_PER_BATCH,
    MAX_WORLD_SIZE,
    MIN_TS,
    NAME_RE,
    RUN_RE,
    SCHEMA_VERSIONS,
    SESSION_RE,
    TOP_LEVEL_FIELDS,
    Batch,
    BatchEvent,
    Column,
    Heartbeat,
)

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_VALUE_EXPECTED = 'expected a number, "NaN", "Infinity", "-Infinity" or null'
_NUMBER_TYPES = frozenset({int, float})
_EMPTY_STEPS = np.zeros(0, dtype=np.int64)


def json_type(value: Any) -> str:
    """How a value reads in JSON terms, for messages."""
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)


def _fail(path: str, problem: str) -> InvalidBatch:
    return InvalidBatch(f"{path}: {problem}", field=path)


def _object(value: Any, path: str, allowed: frozenset[str] | None = None) -> dict[str, Any]:
    if type(value) is not dict:
        raise _fail(path, f"expected an object, got {json_type(value)}")
    if allowed is not None:
        for key in value:
            if key not in allowed:
                raise _fail(
                    f"{path}.{key}" if path else key, f"unknown field (known: {', '.join(sorted(allowed))})"
                )
    return value


def _int(value: Any, path: str, minimum: int, maximum: int = MAX_STEP) -> int:
    if type(value) is not int:
        raise _fail(path, f"expected an integer, got {json_type(value)}")
    if value < minimum:
        raise _fail(path, f"must be >= {minimum}, got {value}")
    if value > maximum:
        raise _fail(path, f"must be <= {maximum}, got {value}")
    return value


def _number(value: Any, path: str) -> float:
    if type(value) not in _NUMBER_TYPES:
        raise _fail(path, f"expected a number, got {json_type(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise _fail(path, f"must be a finite number, got {value}")
    return result


def _ts(value: Any, path: str) -> float:
    result = _number(value, path)
    if not MIN_TS <= result <= MAX_TS:
        raise _fail(
            path, f"expected Unix seconds between {MIN_TS:.0f} (1970) and {MAX_TS:.0f} (9999), got {value}"
        )
    return result


def _string(value: Any, path: str, max_chars: int) -> str:
    if type(value) is not str:
        raise _fail(path, f"expected a string, got {json_type(value)}")
    if not value or len(value) > max_chars:
        raise _fail(path, f"must be 1-{max_chars} characters, got {len(value)}")
    if "\x00" in value:
        raise _fail(path, f"must not contain a NUL character (U+0000), at index {value.index(chr(0))}")
    return value


def _depth(value: Any, limit: int) -> int:
    """How deep objects and arrays nest in `value`, counted up to `limit + 1` (no deeper walk)."""
    deepest, level = 0, [value]
    while level and deepest <= limit:
        level = [
            v
            for item in level
            for v in (item.values() if type(item) is dict else item if type(item) is list else ())
            if type(v) in (dict, list)
        ]
        deepest += 1
    return deepest


def _name(value: str, path: str) -> str:
    if NAME_RE.fullmatch(value) is None:
        raise _fail(path, f"invalid name {value!r}: use 1-200 characters of A-Za-z0-9._:/@+-[]")
    return value


def _array(value: Any, path: str) -> list[Any]:
    if type(value) is not list:
        raise _fail(path, f"expected an array, got {json_type(value)}")
    return value


def _step_array(value: Any, path: str) -> np.ndarray:
    """Strictly increasing integers in [0, MAX_STEP]."""
    items = _array(value, path)
    if not items:
        return _EMPTY_STEPS
    if set(map(type, items)) != {int}:
        for i, item in enumerate(items):
            if type(item) is not int:
                raise _fail(f"{path}[{i}]", f"expected an integer, got {json_type(item)}")
    try:
        steps = np.array(items, dtype=np.int64)
    except OverflowError:
        steps = None
    if steps is None or int(steps.max()) > MAX_STEP or int(steps.min()) < 0:
        for i, item in enumerate(items):
            if not 0 <= item <= MAX_STEP:
                raise _fail(f"{path}[{i}]", f"must be between 0 and {MAX_STEP}, got {item}")
    assert steps is not None
    bad = np.flatnonzero(np.diff(steps) <= 0)
    if bad.size:
        i = int(bad[0]) + 1
        raise _fail(f"{path}[{i}]", f"must be strictly increasing: {items[i]} follows {items[i - 1]}")
    return steps


def _subset(sub: np.ndarray, steps: np.ndarray, path: str) -> None:
    missing = np.flatnonzero(~np.isin(sub, steps))
    if missing.size:
        i = int(missing[0])
        raise _fail(f"{path}[{i}]", f"step {int(sub[i])} is not in the batch's steps")


def _length(items: list[Any], path: str, expected: int, of: str) -> None:
    if len(items) != expected:
        raise _fail(path, f"has {len(items)} values but {of} has {expected}; they must be the same length")


def _value_column(value: Any, path: str, expected: int, of: str) -> Column:
    """Numbers, the non-finite strings and null, one per step."""
    items = _array(value, path)
    _length(items, path, expected, of)
    types = set(map(type, items))
    if types <= _NUMBER_TYPES:
        try:
            return Column(np.array(items, dtype=np.float64))
        except OverflowError:
            pass  # an integer beyond float range; the slow path names it
    values = np.empty(len(items), dtype=np.float64)
    present = np.ones(len(items), dtype=bool)
    for i, item in enumerate(items):
        kind = type(item)
        if kind is float or kind is int:
            try:
                values[i] = item
            except OverflowError:
                raise _fail(f"{path}[{i}]", f"{item} is too large for a 64-bit float") from None
        elif item is None:
            values[i] = math.nan
            present[i] = False
        elif kind is str:
            nonfinite = _NONFINITE.get(item)
            if nonfinite is None:
                raise _fail(f"{path}[{i}]", f"{_VALUE_EXPECTED}, got the string {item[:40]!r}")
            values[i] = nonfinite
        else:
            raise _fail(f"{path}[{i}]", f"{_VALUE_EXPECTED}, got {json_type(item)}")
    return Column(values, None if present.all() else present)


class _Budget:
    """Counts values as they are validated; over the batch limit -> 413 before more work."""

    def __init__(self) -> None:
        self.used = 0

    def take(self, n: int) -> None:
        self.used += n
        if self.used > MAX_VALUES_PER_BATCH:
            raise PayloadTooLarge(
                f"the batch carries more than {MAX_VALUES_PER_BATCH} values; send fewer steps per batch",
                code="too_many_values",
                field="body",
            )


def _columns(raw: dict[str, Any], path: str, expected: int, of: str) -> dict[str, Column]:
    """Named value columns of `expected` values each. The common case (every column an array of numbers
    of the right length) becomes one 2-D array in one call, each column a row of it; anything else
    goes column by column (`_value_column`), which names what is wrong."""
    names = [_name(name, f"{path}.{name}") for name in raw]
    cols = list(raw.values())
    whole = cols and all(type(c) is list and len(c) == expected for c in cols)
    if whole and set(map(type, itertools.chain.from_iterable(cols))) <= _NUMBER_TYPES:
        try:
            table = np.array(cols, dtype=np.float64).reshape(len(cols), expected)
        except OverflowError:
            pass  # an integer beyond float range; the column path names it
        else:
            return {name: Column(row) for name, row in zip(names, table, strict=True)}
    return {
        name: _value_column(col, f"{path}.{name}", expected, of)
        for name, col in zip(names, cols, strict=True)
    }


def _metrics(value: Any, steps: np.ndarray, budget: _Budget) -> dict[str, Column]:
    raw = _object(value, "metrics")
    budget.take(len(raw) * steps.shape[0])
    return _columns(raw, "metrics", steps.shape[0], "steps")


def _tensors(
    value: Any, steps: np.ndarray, budget: _Budget
) -> tuple[np.ndarray, dict[str, dict[str, Column]]]:
    raw = _object(value, "tensors", frozenset({"steps", "stats"}))
    if "steps" not in raw:
        raise _fail("tensors.steps", "missing (required when tensors is present)")
    tsteps = _step_array(raw["steps"], "tensors.steps")
    _subset(tsteps, steps, "tensors.steps")
    n = tsteps.shape[0]
    stats: dict[str, dict[str, Column]] = {}
    for stat, by_name in _object(raw.get("stats", {}), "tensors.stats").items():
        _name(stat, f"tensors.stats.{stat}")
        names = _object(by_name, f"tensors.stats.{stat}")
        budget.take(len(names) * n)
        stats[stat] = _columns(names, f"tensors.stats.{stat}", n, "tensors.steps")
    return tsteps, stats


def _fingerprints(value: Any, steps: np.ndarray, budget: _Budget) -> tuple[np.ndarray, tuple[str, ...]]:
    raw = _object(value, "fingerprints", frozenset({"steps", "values"}))
    for key in ("steps", "values"):
        if key not in raw:
            raise _fail(f"fingerprints.{key}", "missing (required when fingerprints is present)")
    fsteps = _step_array(raw["steps"], "fingerprints.steps")
    _subset(fsteps, steps, "fingerprints.steps")
    values = _array(raw["values"], "fingerprints.values")
    _length(values, "fingerprints.values", fsteps.shape[0], "fingerprints.steps")
    budget.take(len(values))
    for i, fp in enumerate(values):
        if type(fp) is not str or FINGERPRINT_RE.fullmatch(fp) is None:
            shown = repr(fp[:40]) if type(fp) is str else json_type(fp)
            raise _fail(f"fingerprints.values[{i}]", f"expected 16 hexadecimal digits, got {shown}")
    return fsteps, tuple(fp.lower() for fp in values)


_EVENT_FIELDS = frozenset({"step", "ts", "kind", "data"})


def _events(value: Any, budget: _Budget) -> tuple[BatchEvent, ...]:
    items = _array(value, "events")
    budget.take(len(items))
    events = []
    for i, item in enumerate(items):
        path = f"events[{i}]"
        raw = _object(item, path, _EVENT_FIELDS)
        for key in ("step", "ts", "kind"):
            if key not in raw:
                raise _fail(f"{path}.{key}", "missing")
        kind = raw["kind"]
        if type(kind) is not str or kind not in EVENT_KINDS:
            shown = repr(kind[:40]) if type(kind) is str else json_type(kind)
            raise _fail(f"{path}.kind", f"expected one of {', '.join(sorted(EVENT_KINDS))}, got {shown}")
        data = _object(raw.get("data", {}), f"{path}.data")
        if _depth(data, MAX_EVENT_DATA_DEPTH) > MAX_EVENT_DATA_DEPTH:
            raise _fail(
                f"{path}.data", f"objects and arrays nested deeper than {MAX_EVENT_DATA_DEPTH} levels"
            )
        encoded = orjson.dumps(data)
        if len(encoded) > MAX_EVENT_DATA_BYTES:
            raise _fail(
                f"{path}.data", f"is {len(encoded)} bytes as JSON; the limit is {MAX_EVENT_DATA_BYTES}"
            )
        if b"\\u0000" in encoded:  # a NUL in a key or a string: PostgreSQL's text and JSONB refuse it
            raise _fail(f"{path}.data", "must not contain a NUL character (U+0000) in any key or string")
        events.append(
            BatchEvent(
                step=_int(raw["step"], f"{path}.step", 0),
                ts=_ts(raw["ts"], f"{path}.ts"),
                kind=kind,
                data=data,
            )
        )
    return tuple(events)


_HEARTBEAT_FIELDS = frozenset({"ts", "phase", "last_step", "forwards", "nograd_forwards", "stack"})


def _heartbeat(value: Any) -> Heartbeat:
    raw = _object(value, "heartbeat", _HEARTBEAT_FIELDS)
    if "ts" not in raw:
        raise _fail("heartbeat.ts", "missing")
    phase = raw.get("phase")
    last_step = raw.get("last_step")
    forwards, nograd = raw.get("forwards"), raw.get("nograd_forwards")
    return Heartbeat(
        ts=_ts(raw["ts"], "heartbeat.ts"),
        phase=None if phase is None else _string(phase, "heartbeat.phase", MAX_PHASE_CHARS),
        last_step=None if last_step is None else _int(last_step, "heartbeat.last_step", 0),
        forwards=None if forwards is None else _int(forwards, "heartbeat.forwards", 0),
        nograd_forwards=None if nograd is None else _int(nograd, "heartbeat.nograd_forwards", 0),
        stack=_stack(raw.get("stack")),
    )


def _stack(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if type(value) is not list:
        raise _fail("heartbeat.stack", f"expected an array of strings, got {json_type(value)}")
    if len(value) > MAX_STACK_FRAMES:
        raise _fail("heartbeat.stack", f"at most {MAX_STACK_FRAMES} frames, got {len(value)}")
    return tuple(_string(v, f"heartbeat.stack[{i}]", MAX_FRAME_CHARS) for i, v in enumerate(value))


def _agent(value: Any) -> tuple[str | None, dict[str, int] | None]:
    raw = _object(value, "agent", frozenset({"version", "counters"}))
    version = raw.get("version")
    if version is not None:
        version = _string(version, "agent.version", MAX_AGENT_VERSION_CHARS)
    counters = None
    if raw.get("counters") is not None:
        counters = {}
        for name, count in _object(raw["counters"], "agent.counters").items():
            path = f"agent.counters.{name}"
            counters[_name(name, path)] = _int(count, path, 0)
    return version, counters


def _optional_int(doc: dict[str, Any], key: str, minimum: int, default: int | None) -> int | None:
    value = doc.get(key)
    return default if value is None else _int(value, key, minimum)


def parse_batch(doc: Any) -> Batch:
    """Validate a parsed JSON document as a schema-1 batch; raises InvalidBatch naming the field."""
    if type(doc) is not dict:
        raise InvalidBatch(f"the body must be a JSON object (a batch), got {json_type(doc)}", field=None)
    if "schema" not in doc:
        raise _fail("schema", f"missing; this collector speaks schema {', '.join(map(str, SCHEMA_VERSIONS))}")
    if type(doc["schema"]) is not int or doc["schema"] not in SCHEMA_VERSIONS:
        raise InvalidBatch(
            f"schema: unsupported version {doc['schema']!r}; this collector speaks schema "
            f"{', '.join(map(str, SCHEMA_VERSIONS))}",
            field="schema",
            code="unsupported_schema",
        )
    _object(doc, "", TOP_LEVEL_FIELDS)
    for key in ("run", "session", "seq", "rank", "world_size", "steps", "timestamps"):
        if key not in doc:
            raise _fail(key, "missing (required)")

    run = _string(doc["run"], "run", 200)
    if RUN_RE.fullmatch(run) is None:
        raise _fail(
            "run", f"invalid run name {run!r}: use 1-200 characters of A-Za-z0-9._:/@+-, not only dots"
        )
    session = _string(doc["session"], "session", 64)
    if SESSION_RE.fullmatch(session) is None:
        raise _fail("session", f"invalid session id {session!r}: use 8-64 characters of A-Za-z0-9_-")
    seq = _int(doc["seq"], "seq", 0)
    world_size = _int(doc["world_size"], "world_size", 1, MAX_WORLD_SIZE)
    rank = _int(doc["rank"], "rank", 0, MAX_WORLD_SIZE - 1)
    if rank >= world_size:
        raise _fail("rank", f"must be < world_size ({world_size}), got {rank}")
    local_rank = _optional_int(doc, "local_rank", 0, None)
    node = None if doc.get("node") is None else _string(doc["node"], "node", MAX_NODE_CHARS)
    replica_group = _optional_int(doc, "replica_group", 0, rank)
    shard = _optional_int(doc, "shard", 0, 0)
    num_shards = _optional_int(doc, "num_shards", 1, 1)
    assert replica_group is not None and shard is not None and num_shards is not None
    if shard >= num_shards:
        raise _fail("shard", f"must be < num_shards ({num_shards}), got {shard}")
    agent_version, agent_counters = (None, None) if doc.get("agent") is None else _agent(doc["agent"])

    budget = _Budget()
    steps = _step_array(doc["steps"], "steps")
    budget.take(steps.shape[0])
    ts_items = _array(doc["timestamps"], "timestamps")
    _length(ts_items, "timestamps", steps.shape[0], "steps")
    timestamps = _value_column(ts_items, "timestamps", steps.shape[0], "steps").values
    bad = np.flatnonzero(~((timestamps >= MIN_TS) & (timestamps <= MAX_TS)))  # NaN fails both
    if bad.size:
        raise _fail(
            f"timestamps[{int(bad[0])}]",
            f"expected a finite number of Unix seconds between {MIN_TS:.0f} (1970) and {MAX_TS:.0f} (9999), "
            f"got {timestamps[bad[0]]}",
        )

    metrics = {} if doc.get("metrics") is None else _metrics(doc["metrics"], steps, budget)
    tensor_steps: np.ndarray = _EMPTY_STEPS
    tensors: dict[str, dict[str, Column]] = {}
    if doc.get("tensors") is not None:
        tensor_steps, tensors = _tensors(doc["tensors"], steps, budget)
    fingerprint_steps: np.ndarray = _EMPTY_STEPS
    fingerprints: tuple[str, ...] = ()
    if doc.get("fingerprints") is not None:
        fingerprint_steps, fingerprints = _fingerprints(doc["fingerprints"], steps, budget)
    events = () if doc.get("events") is None else _events(doc["events"], budget)
    heartbeat = None if doc.get("heartbeat") is None else _heartbeat(doc["heartbeat"])

    return Batch(
        run=run,
        session=session,
        seq=seq,
        rank=rank,
        world_size=world_size,
        steps=steps,
        timestamps=timestamps,
        local_rank=local_rank,
        node=node,
        replica_group=replica_group,
        shard=shard,
        num_shards=num_shards,
        agent_version=agent_version,
        agent_counters=agent_counters,
        metrics=metrics,
        tensor_steps=tensor_steps,
        tensors=tensors,
        fingerprint_steps=fingerprint_steps,
        fingerprints=fingerprints,
        events=events,
        heartbeat=heartbeat,
    )
