"""Host side: decode transferred chunks into rows and build ingest batches (docs/ingest.md, schema 1)."""

from __future__ import annotations

import gzip
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from ._records import Chunk, StepRecord

SCHEMA = 1
MAX_TENSOR_NAMES = 256  # per-parameter grad norms shipped per batch: the largest ones
GZIP_LEVEL = 5
MASK64 = 2**64 - 1
_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20 if hasattr(os, "sysconf") else 4096 / 2**20

Value = float | str | None
# Phase timings go out in milliseconds rounded to the microsecond (docs/ingest.md): the digits below are
# clock noise, and a rounded value is short in JSON and stored in ~2 bytes instead of ~7 (the collector's
# block codec keeps decimals as integers: issue 17).
TIME_DECIMALS = 3
TS_DECIMALS = 6  # step end times (Unix seconds) to the microsecond, for the same reason
TIMES = ("time.step_ms", "time.forward_ms", "time.backward_ms", "time.optimizer_ms", "time.data_ms")
_F32 = struct.Struct("<f")


def float32(x: float) -> float:
    """`x` rounded to the nearest float32 (as a device reduction would hold it); `x` itself beyond float32's
    range."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:
        return x


def num(v: float | None) -> Value:
    """A JSON value for a float: non-finite ones as the strings the ingest format names."""
    if v is None or math.isfinite(v):
        return v
    return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")


def mix64(x: int) -> int:
    """splitmix64's finaliser: spreads the device checksum over all 64 bits (deterministic, on the host)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


def rss_mb() -> float | None:
    """Resident memory of this process (sender thread only: it reads a file)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_MB
    except (OSError, ValueError, IndexError):
        try:
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux; peak elsewhere
        except Exception:
            return None


@dataclass(slots=True)
class Row:
    step: int
    ts: float
    metrics: dict[str, float | None]
    amax: dict[str, float | None] | None = None
    grads: dict[str, float] | None = None
    fingerprint: str | None = None


def _cuda_times(rec: StepRecord, m: dict[str, float | None]) -> None:
    prev_end, forwards, opt_start, end = rec.marks  # type: ignore[misc]
    m["time.step_ms"] = prev_end.elapsed_time(end)
    m["time.forward_ms"] = sum(s.elapsed_time(e) for s, e in forwards) if forwards else None
    m["time.backward_ms"] = forwards[-1][1].elapsed_time(opt_start) if forwards and opt_start else None
    m["time.optimizer_ms"] = opt_start.elapsed_time(end) if opt_start is not None else None


def _per_module(names: tuple[str, ...], calls: list[int], amax: list[float]) -> dict[str, float | None]:
    """max |x| of each module that ran, over its calls this step (NaN stays NaN)."""
    best: dict[int, float] = {}
    for slot, a in zip(calls, amax, strict=True):
        b = best.get(slot)
        if b is None or a > b or a != a:  # a NaN once stays: nothing compares greater than NaN
            best[slot] = a
    return {names[slot]: best[slot] for slot in sorted(best)}


class Decoder:
    """Chunks -> rows. Derives the non-finite flags from the device-side reductions and emits a
    `nonfinite` event on the first non-finite step (again after the values were finite once more).

    `capacity_mb` (read once at attach, `_capacity.py`) goes out as `mem.capacity_mb` beside the memory
    values it bounds, at their cadence: every step with the CUDA allocator's values, else with the host
    RSS on the last step of each chunk.
    """

    def __init__(self, capacity_mb: float | None = None) -> None:
        self._in_nonfinite = False
        self.capacity_mb = capacity_mb

    def decode(self, chunk: Chunk) -> tuple[list[Row], list[dict[str, Any]]]:
        # One host read per chunk; each step below takes slices of the Python list.
        values: list[float] = chunk.values.tolist() if chunk.values is not None else []
        rows, events = [], []
        capacity = self.capacity_mb
        for rec in chunk.records:
            m = rec.host  # the record's own dict: no copy
            if capacity is not None and "mem.allocated_mb" in m:
                m["mem.capacity_mb"] = capacity
            if rec.marks is not None:
                _cuda_times(rec, m)
            for key in TIMES:
                t = m.get(key)
                if t is not None:
                    m[key] = round(t, TIME_DECIMALS)
            k = rec.offset
            if rec.hook_names:
                m.update(zip(rec.hook_names, values[k : k + len(rec.hook_names)], strict=True))
                k += len(rec.hook_names)
                if rec.loss_div > 1 and m.get("loss") is not None:
                    m["loss"] = m["loss"] / rec.loss_div  # type: ignore[operator]
            gn = m.get("grad_norm")
            if gn is not None and "grad_sumsq" not in m:
                # This rank's (shard's) own sum of squares, before any override (the hook sends its own
                # when replicated parameters count 1/copies: _layout.py).
                # Rounded to float32, the precision of the norm it squares (stored in 4 bytes, not 8).
                m["grad_sumsq"] = float32(gn * gn)
            if rec.log_names:
                m.update(zip(rec.log_names, values[k : k + len(rec.log_names)], strict=True))
                k += len(rec.log_names)
            row = Row(rec.step, rec.ts, m)
            first_bad: str | None = None
            first_index = -1
            amax = []
            k = rec.voffset
            calls = rec.amax_calls
            if calls:
                amax = values[k : k + len(calls)]
                k += len(calls)
                # A finite total: every call's max is finite (the common case: no per-call work).
                if not math.isfinite(sum(amax)):
                    first_index = next(j for j, a in enumerate(amax) if not math.isfinite(a))
                    first_bad = rec.amax_names[
                        calls[first_index]
                    ]  # the first module to go non-finite, in call order
                if rec.ship_amax:
                    row.amax = _per_module(rec.amax_names, calls, amax)
                m["nonfinite.activations"] = int(first_bad is not None)
            else:
                m["nonfinite.activations"] = None
            loss, grad = m.get("loss"), m.get("grad_norm")
            m["nonfinite.loss"] = None if loss is None else int(not math.isfinite(loss))
            m["nonfinite.grads"] = None if grad is None else int(not math.isfinite(grad))
            if rec.grad_names:
                row.grads = dict(zip(rec.grad_names, values[k : k + len(rec.grad_names)], strict=True))
                k += len(rec.grad_names)
            if rec.fingerprint:
                w = [int(x) for x in values[k : k + 4]]
                row.fingerprint = f"{mix64(w[0] | w[1] << 16 | w[2] << 32 | w[3] << 48):016x}"
            where_bad = [w for w in ("activations", "loss", "grads") if m[f"nonfinite.{w}"]]
            if where_bad and not self._in_nonfinite:
                data: dict[str, Any] = {"module": first_bad, "where": where_bad}
                if first_bad is not None and rec.amax_exact:
                    data.update(_around(first_index, amax))
                if rec.ids:
                    data["ids"] = _bounded(rec.ids)
                events.append({"step": rec.step, "ts": rec.ts, "kind": "nonfinite", "data": data})
            self._in_nonfinite = bool(where_bad)
            rows.append(row)
        if rows:
            last = rows[-1].metrics
            last["mem.rss_mb"] = rss_mb()
            if capacity is not None:
                last.setdefault("mem.capacity_mb", capacity)
        return rows, events


MAX_IDS_CHARS = 3000  # watch.identify() values in one event, as JSON (the collector takes 4 KiB of data)


def _around(i: int, amax: list[float]) -> dict[str, Value]:
    """The first non-finite module's output max |x| and its input's: the call before it, in call order (a
    layer's input is the previous layer's output in a sequential stack; none for the first call)."""
    return {"output_amax": num(amax[i]), "input_amax": num(amax[i - 1]) if i > 0 else None}


def _bounded(ids: dict[str, Any]) -> dict[str, Any]:
    """watch.identify() values within MAX_IDS_CHARS of JSON: whole values in order, then the rest named."""
    out: dict[str, Any] = {}
    used = 0
    for name, value in ids.items():
        size = len(json.dumps(value)) + len(name) + 4
        if used + size > MAX_IDS_CHARS:
            out.setdefault("_dropped", []).append(name)
            continue
        out[name] = value
        used += size
    return out


def _top_names(rows: list[Row]) -> list[str]:
    best: dict[str, float] = {}
    for row in rows:
        for name, v in (row.grads or {}).items():
            score = math.inf if not math.isfinite(v) else v
            if score > best.get(name, -1.0):
                best[name] = score
    return sorted(best, key=lambda n: -best[n])[:MAX_TENSOR_NAMES]


def build(
    head: dict[str, Any],
    rows: list[Row],
    events: list[dict[str, Any]],
    heartbeat: dict[str, Any],
) -> dict[str, Any]:
    """A schema-1 batch: `head` holds schema, identity, session, seq and agent.

    Columns hold raw floats (NaN and infinities included); `encode` writes those as the strings the
    ingest format names.
    """
    batch = dict(head)
    batch["steps"] = [r.step for r in rows]
    batch["timestamps"] = [round(r.ts, TS_DECIMALS) for r in rows]
    names: dict[str, None] = {}
    metrics = [r.metrics for r in rows]
    for m in metrics:
        names.update(dict.fromkeys(m))
    batch["metrics"] = {n: [m.get(n) for m in metrics] for n in names}
    sampled = [r for r in rows if r.amax is not None or r.grads is not None]
    if sampled:
        stats: dict[str, dict[str, list[Value]]] = {}
        amax_names: dict[str, None] = {}
        for r in sampled:
            amax_names.update(dict.fromkeys(r.amax or ()))
        if amax_names:
            stats["amax"] = {n: [(r.amax or {}).get(n) for r in sampled] for n in amax_names}
        grad_names = _top_names(sampled)
        if grad_names:
            stats["grad_norm"] = {n: [(r.grads or {}).get(n) for r in sampled] for n in grad_names}
        batch["tensors"] = {"steps": [r.step for r in sampled], "stats": stats}
    fps = [r for r in rows if r.fingerprint is not None]
    if fps:
        batch["fingerprints"] = {"steps": [r.step for r in fps], "values": [r.fingerprint for r in fps]}
    if events:
        batch["events"] = events
    batch["heartbeat"] = heartbeat
    return batch


def _as_strings(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with every non-finite column value written as "NaN", "Infinity" or "-Infinity"."""
    out = dict(batch)
    out["metrics"] = {n: [num(v) for v in col] for n, col in batch.get("metrics", {}).items()}
    if "tensors" in batch:
        stats = batch["tensors"]["stats"]
        out["tensors"] = {
            "steps": batch["tensors"]["steps"],
            "stats": {s: {n: [num(v) for v in col] for n, col in cols.items()} for s, cols in stats.items()},
        }
    return out


def encode(batch: dict[str, Any]) -> bytes:
    """gzip-compressed JSON. Non-finite values must be strings: the first dump (C code, no per-value
    Python) writes them as bare NaN/Infinity tokens; only then is the batch converted and dumped again
    (a name containing "NaN" or "Infinity" takes that path too, harmlessly)."""
    text = json.dumps(batch, separators=(",", ":"))
    if "NaN" in text or "Infinity" in text:
        text = json.dumps(_as_strings(batch), allow_nan=False, separators=(",", ":"))
    return gzip.compress(text.encode("utf-8"), compresslevel=GZIP_LEVEL)
