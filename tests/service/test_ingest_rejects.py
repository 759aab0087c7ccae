"""Malformed batches: each gets a 4xx that names the field and the problem, and stores nothing."""

from __future__ import annotations

import gzip
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from stepwatch_server.errors import PayloadTooLarge
from stepwatch_server.ingest.body import gunzip_bounded
from stepwatch_server.settings import MAX_BATCH_BYTES
from tests.service.conftest import Collector, make_batch


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets (or with ... deletes) the value at a dotted path with [i] indices."""

    def mutate(batch: dict[str, Any]) -> None:
        target: Any = batch
        parts = path.replace("[", ".[").split(".")
        keys: list[Any] = [int(p[1:-1]) if p.startswith("[") else p for p in parts]
        for key in keys[:-1]:
            target = target[key]
        if value is ...:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value

    return mutate


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def _tensor(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(batch: dict[str, Any]) -> None:
        batch["tensors"]["stats"]["amax"][name] = value

    return mutate


# (id, mutation, status, field, words the message must contain)
CASES: list[tuple[str, Callable[[dict[str, Any]], None], int, str | None, str]] = [
    ("rank-string", _set("rank", "3"), 422, "rank", "expected an integer, got a string"),
    ("rank-negative", _set("rank", -1), 422, "rank", "must be >= 0"),
    ("rank-not-below-world", _set("rank", 8), 422, "rank", "must be < world_size (8)"),
    ("rank-bool", _set("rank", True), 422, "rank", "got a boolean"),
    ("seq-float", _set("seq", 1.5), 422, "seq", "expected an integer, got a number"),
    ("world-size-zero", _set("world_size", 0), 422, "world_size", "must be >= 1"),
    ("missing-session", _set("session", ...), 422, "session", "missing"),
    ("missing-steps", _set("steps", ...), 422, "steps", "missing"),
    ("missing-timestamps", _set("timestamps", ...), 422, "timestamps", "missing"),
    (
        "schema-unknown",
        _set("schema", 2),
        422,
        "schema",
        "unsupported version 2; this collector speaks schema 1",
    ),
    ("schema-missing", _set("schema", ...), 422, "schema", "missing"),
    ("unknown-field", _set("metric", {}), 422, "metric", "unknown field"),
    ("run-bad-chars", _set("run", "my run!"), 422, "run", "invalid run name"),
    ("run-only-dots", _set("run", ".."), 422, "run", "not only dots"),  # a path segment, not a run
    ("world-size-10M", _set("world_size", 10_000_000), 422, "world_size", "must be <= 131072"),
    # Each was a 500 (a datetime out of range, PostgreSQL refusing a NUL, orjson's depth limit).
    ("heartbeat-ts-1e18", _set("heartbeat.ts", 1e18), 422, "heartbeat.ts", "Unix seconds"),
    ("heartbeat-ts-minus-1e18", _set("heartbeat.ts", -1e18), 422, "heartbeat.ts", "Unix seconds"),
    ("heartbeat-ts-1e308", _set("heartbeat.ts", 1e308), 422, "heartbeat.ts", "Unix seconds"),
    ("heartbeat-ts-year-10000", _set("heartbeat.ts", 253_402_300_800.0), 422, "heartbeat.ts", "Unix seconds"),
    ("event-ts-year-0", _set("events[0].ts", -62_167_219_200.0), 422, "events[0].ts", "Unix seconds"),
    ("timestamp-year-10000", _set("timestamps[1]", 253_402_300_800.0), 422, "timestamps[1]", "Unix seconds"),
    ("node-nul", _set("node", "gpu\x0012"), 422, "node", "NUL"),
    ("heartbeat-phase-nul", _set("heartbeat.phase", "da\x00ta"), 422, "heartbeat.phase", "NUL"),
    ("agent-version-nul", _set("agent.version", "0.1\x00"), 422, "agent.version", "NUL"),
    ("event-data-nul", _set("events[1].data.phase", "ev\x00al"), 422, "events[1].data", "NUL"),
    ("event-data-deep", _set("events[0].data", _nested(100)), 422, "events[0].data", "nested"),
    ("session-short", _set("session", "abc"), 422, "session", "invalid session id"),
    ("metrics-not-object", _set("metrics", [1, 2, 3]), 422, "metrics", "expected an object, got an array"),
    (
        "value-string",
        _set("metrics.loss[1]", "high"),
        422,
        "metrics.loss[1]",
        'expected a number, "NaN", "Infinity", "-Infinity" or null, got the string',
    ),
    ("value-bool", _set("metrics.loss[0]", False), 422, "metrics.loss[0]", "got a boolean"),
    ("value-object", _set("metrics.lr[2]", {"v": 1}), 422, "metrics.lr[2]", "got an object"),
    ("value-lowercase-nan", _set("metrics.loss[2]", "nan"), 422, "metrics.loss[2]", "got the string 'nan'"),
    ("metric-not-array", _set("metrics.loss", 2.3), 422, "metrics.loss", "expected an array, got a number"),
    ("ragged-metric", _set("metrics.loss", [1.0, 2.0]), 422, "metrics.loss", "has 2 values but steps has 3"),
    ("ragged-timestamps", _set("timestamps", [1.0]), 422, "timestamps", "has 1 values but steps has 3"),
    (
        "ragged-tensor",
        _tensor("layers.0.mlp.fc2", [1.0]),
        422,
        "tensors.stats.amax.layers.0.mlp.fc2",
        "has 1 values but tensors.steps has 2",
    ),
    ("bad-metric-name", _set("metrics", {"bad name": [1, 2, 3]}), 422, "metrics.bad name", "invalid name"),
    ("steps-not-increasing", _set("steps", [1, 3, 2]), 422, "steps[2]", "strictly increasing: 2 follows 3"),
    ("steps-negative", _set("steps", [-1, 2, 3]), 422, "steps[0]", "between 0 and"),
    ("steps-bool", _set("steps", [1, True, 3]), 422, "steps[1]", "got a boolean"),
    ("timestamp-nan", _set("timestamps[1]", "NaN"), 422, "timestamps[1]", "finite"),
    (
        "tensor-steps-not-subset",
        _set("tensors.steps", [1, 4]),
        422,
        "tensors.steps[1]",
        "step 4 is not in the batch's steps",
    ),
    (
        "fingerprint-not-hex",
        _set("fingerprints.values", ["xyz"]),
        422,
        "fingerprints.values[0]",
        "16 hexadecimal digits",
    ),
    ("event-kind", _set("events[1].kind", "party"), 422, "events[1].kind", "expected one of"),
    ("event-step-missing", _set("events[0].step", ...), 422, "events[0].step", "missing"),
    ("heartbeat-ts-string", _set("heartbeat.ts", "now"), 422, "heartbeat.ts", "expected a number"),
    (
        "heartbeat-forwards-negative",
        _set("heartbeat.forwards", -1),
        422,
        "heartbeat.forwards",
        "must be >= 0",
    ),
    (
        "heartbeat-stack-string",
        _set("heartbeat.stack", "torch:save"),
        422,
        "heartbeat.stack",
        "expected an array",
    ),
    (
        "heartbeat-stack-frame",
        _set("heartbeat.stack", ["a:b", 3]),
        422,
        "heartbeat.stack[1]",
        "expected a string",
    ),
    (
        "heartbeat-stack-long",
        _set("heartbeat.stack", ["m:f"] * 17),
        422,
        "heartbeat.stack",
        "at most 16 frames",
    ),
    ("heartbeat-unknown", _set("heartbeat.where", "here"), 422, "heartbeat.where", "unknown field"),
    (
        "counter-negative",
        _set("agent.counters.spooled_batches", -2),
        422,
        "agent.counters.spooled_batches",
        "must be >= 0",
    ),
    ("shard-not-below", _set("shard", 1), 422, "shard", "must be < num_shards (1)"),
]


@pytest.mark.parametrize(
    ("mutate", "status", "field", "words"), [pytest.param(*case[1:], id=case[0]) for case in CASES]
)
def test_malformed_batch_is_rejected_and_nothing_stored(
    populated: Collector,
    mutate: Callable[[dict[str, Any]], None],
    status: int,
    field: str | None,
    words: str,
) -> None:
    batch = make_batch(run=f"bad-{uuid.uuid4().hex[:8]}")
    mutate(batch)
    before = populated.counts()
    response = populated.post(orjson.dumps(batch), headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field
    assert words in error["message"]
    assert error["message"].startswith(f"{field}: ")
    assert populated.counts() == before


RAW_CASES = [
    ("not-json", b'{"schema": 1, "run": ', {}, 400, "invalid_json", "not valid JSON"),
    ("not-utf8", b'{"schema": 1, "run": "caf\xe9"}', {}, 400, "invalid_encoding", "not valid UTF-8"),
    ("not-an-object", b"[1, 2, 3]", {}, 422, "invalid_field", "must be a JSON object"),
    ("empty", b"", {}, 400, "invalid_json", "not valid JSON"),
    ("bad-gzip", b"\x1f\x8b\x08garbage", {"Content-Encoding": "gzip"}, 400, "invalid_gzip", "not valid gzip"),
    (
        "truncated-gzip",
        gzip.compress(orjson.dumps(make_batch()))[:-12],
        {"Content-Encoding": "gzip"},
        400,
        "invalid_gzip",
        "truncated",
    ),
    ("brotli", b"{}", {"Content-Encoding": "br"}, 415, "unsupported_media_type", "'br' is not supported"),
    # A key given twice was taken with its last value (the run could be swapped after a glance at the first).
    (
        "duplicate-top-key",
        orjson.dumps(make_batch())[:-1] + b', "run": "other"}',
        {},
        422,
        "invalid_field",
        "'run' twice",
    ),
    (
        "duplicate-metric",
        orjson.dumps(make_batch()).replace(b'"metrics":{', b'"metrics":{"loss":[1.0,2.0,3.0],', 1),
        {},
        422,
        "invalid_field",
        "'loss' twice",
    ),
    (
        "duplicate-in-event-data",
        orjson.dumps(make_batch()).replace(
            b'"data":{"phase":"eval"}', b'"data":{"phase":"eval","phase":"x"}', 1
        ),
        {},
        422,
        "invalid_field",
        "'phase' twice",
    ),
    (
        "over-16MiB-after-gunzip",
        gzip.compress(b" " * (MAX_BATCH_BYTES + 1)),
        {"Content-Encoding": "gzip"},
        413,
        "too_large",
        "after decompression",
    ),
    (
        "gzip-bomb",
        gzip.compress(b"0" * (64 * 1024 * 1024), 9),
        {"Content-Encoding": "gzip"},
        413,
        "too_large",
        "after decompression",
    ),
]


@pytest.mark.parametrize(
    ("body", "headers", "status", "code", "words"),
    [pytest.param(*case[1:], id=case[0]) for case in RAW_CASES],
)
def test_undecodable_body_is_rejected_and_nothing_stored(
    populated: Collector,
    body: bytes,
    headers: dict[str, str],
    status: int,
    code: str,
    words: str,
) -> None:
    before = populated.counts()
    response = populated.post(body, headers={"Content-Type": "application/json", **headers})
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    assert words in response.json()["error"]["message"]
    assert populated.counts() == before


def test_too_many_values_is_413(populated: Collector) -> None:
    steps = list(range(200_001))
    batch = {
        "schema": 1,
        "run": "big",
        "session": uuid.uuid4().hex,
        "seq": 0,
        "rank": 0,
        "world_size": 1,
        "steps": steps,
        "timestamps": steps,
        "metrics": {"a": steps, "b": steps, "c": steps, "d": steps},
    }
    before = populated.counts()
    response = populated.post(orjson.dumps(batch))
    assert response.status_code == 413 and "more than 1000000 values" in response.json()["error"]["message"]
    assert populated.counts() == before


def test_wire_size_limit(start_collector: Callable[..., Collector]) -> None:
    collector = start_collector(max_batch_bytes=64 * 1024)
    batch = make_batch(metrics={"loss": [1.0, 2.0, 3.0]}, node="n" * 200)
    batch["events"] = [{"step": 1, "ts": 1.0, "kind": "note", "data": {"text": "x" * 4000}}] * 20
    body = orjson.dumps(batch)
    assert len(body) > 64 * 1024
    response = collector.post(body)
    assert response.status_code == 413 and "on the wire" in response.json()["error"]["message"]
    chunked = collector.http.post(
        "/api/v1/ingest", content=iter([body[i : i + 8192] for i in range(0, len(body), 8192)])
    )
    assert chunked.status_code == 413 and "on the wire" in chunked.json()["error"]["message"]
    response = collector.post(gzip.compress(body), headers={"Content-Encoding": "gzip"})
    assert response.status_code == 413 and "after decompression" in response.json()["error"]["message"]
    assert collector.counts()["points"] == 0


def test_gunzip_is_bounded_against_a_gigabyte_bomb() -> None:
    member = zlib.compress(b"\0" * (64 * 1024 * 1024), 9, wbits=31)  # one gzip member, ~64 KiB
    bomb = member * 16  # 1 GiB when inflated, ~1 MiB on the wire
    with pytest.raises(PayloadTooLarge):
        gunzip_bounded(bomb, MAX_BATCH_BYTES)
    assert gunzip_bounded(member * 2, 256 * 1024 * 1024) == b"\0" * (128 * 1024 * 1024)


def test_an_error_never_echoes_a_huge_input_back(populated: Collector) -> None:
    """A 1 MiB metric name came back whole inside the 422 (15 MiB in the report): the message and the
    field are cut to a bounded length that still names the field and the problem."""
    huge = "m" * (1 << 20) + " "  # invalid (a space): the name is echoed in the field path and message
    batch = make_batch(run=f"bad-{uuid.uuid4().hex[:8]}")
    batch["metrics"][huge] = batch["metrics"]["loss"]
    response = populated.post(orjson.dumps(batch), headers={"Content-Type": "application/json"})
    assert response.status_code == 422
    assert len(response.content) < 4_000
    error = response.json()["error"]
    assert error["field"].startswith("metrics.mmmm") and len(error["field"]) <= 300
    assert "characters" in error["message"] and len(error["message"]) <= 1_000


def test_a_string_of_escaped_quotes_cannot_stall_the_duplicate_key_check() -> None:
    """The keys of a body are counted by scanning each JSON string once: a pattern that looked for "a
    string followed by a colon" was tried again at every escaped quote of a string value, quadratic time
    with the GIL held (32 KB took 3.2 s; this 512 KB body would take minutes). Linear, it takes well under
    a second; the bound is generous on purpose (a stall, not a speed target)."""
    from stepwatch_server.ingest.body import decode_body

    raw = b'{"a":"' + b'\\"' * 262_144 + b'","b":1}'
    started = time.perf_counter()
    assert decode_body(raw, None, MAX_BATCH_BYTES) == {"a": '"' * 262_144, "b": 1}
    assert time.perf_counter() - started < 10.0


def test_a_key_given_twice_in_a_large_body_is_found_too() -> None:
    """Bodies are checked by counting keys as written and as kept; a duplicate anywhere in a large body
    is still refused, and a body whose counts differ for another reason (an object deep in an array) is
    parsed again and accepted."""
    from stepwatch_server.errors import InvalidBatch
    from stepwatch_server.ingest.body import decode_body

    column = [float(i) for i in range(5_000)]
    big = {"schema": 1, "metrics": {f"m{i}": column for i in range(4)}, "events": [{"data": {"a": 1}}]}
    raw = orjson.dumps(big)
    assert len(raw) > 64 * 1024
    assert decode_body(raw, None, MAX_BATCH_BYTES) == big
    twice = raw.replace(b'"metrics":{', b'"metrics":{"m3":[1.0],', 1)
    with pytest.raises(InvalidBatch, match="'m3' twice"):
        decode_body(twice, None, MAX_BATCH_BYTES)
    deep = raw.replace(b'"events":[', b'"events":[1,{"data":{"x":1,"x":2}},', 1)  # behind a number
    with pytest.raises(InvalidBatch, match="'x' twice"):
        decode_body(deep, None, MAX_BATCH_BYTES)
    odd = raw.replace(b'"events":[', b'"events":[1,{"data":{"x":1,"y":2}},', 1)  # counts differ, no duplicate
    assert decode_body(odd, None, MAX_BATCH_BYTES)["events"][1] == {"data": {"x": 1, "y": 2}}
    tricky = raw.replace(b'"schema":1', b'"schema":1,"s":"a\\":b\\":"', 1)  # '":' inside a string value
    # orjson parses it; the second parse (the object behind a number makes the counts differ) cannot
    deep = b'{"a":' + b"[" * 1_010 + b'1,{"x":1}' + b"]" * 1_010 + b"}"
    # ... at Python's default recursion limit, the collector's: torch's inductor, compiled by an earlier
    # test in this process (tests/agent/test_stacks.py), leaves it raised to 2,000.
    raised = sys.getrecursionlimit()
    sys.setrecursionlimit(1_000)
    try:
        with pytest.raises(InvalidBatch, match="too deeply"):
            decode_body(deep, None, MAX_BATCH_BYTES)
    finally:
        sys.setrecursionlimit(raised)
    assert decode_body(tricky, None, MAX_BATCH_BYTES)["s"] == 'a":b":'
