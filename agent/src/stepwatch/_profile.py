"""A `profile` command (_commands.py): `torch.profiler` over K whole steps of the training loop.

The training thread starts the profiler at the end of a step (`Hooks._on_step_post`, when the sender left a
request in `Live.profile_request`) and stops it K steps later; everything else happens on the sender thread:
the Chrome trace is exported, gzipped and uploaded, and the operators' self times summarised. Cost on the
training thread: the profiler's start and stop (kineto's set-up, once each) and its per-op recording during
the K steps (tests/e2e/test_commands.py prints the step times before and during); the export's Python runs
on the sender thread and takes the GIL meanwhile.
"""

from __future__ import annotations

import gzip
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_TRACE_BYTES = 32 << 20  # gzipped: the collector's limit for one rank's file
TOP_OPS = 40


@dataclass
class Profiling:
    """A profile in progress (training thread): its command, the steps left, the profiler."""

    command_id: int
    steps: int
    profiler: Any
    left: int
    step_ms: list[float] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)


@dataclass
class Finished:
    """What the training thread hands the sender: a stopped profiler, or why there is none."""

    command_id: int
    steps: int
    profiler: Any = None
    step_ms: list[float] = field(default_factory=list)
    error: str | None = None


def start(command_id: int, steps: int, cuda: bool) -> Profiling | Finished:
    """Start tracing now (training thread), or the reason it cannot."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        return Finished(command_id, steps, error="a profiler is running already in this process")
    try:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        profiler = profile(activities=activities)
        profiler.start()
    except Exception as exc:
        return Finished(
            command_id, steps, error=f"torch.profiler did not start: {type(exc).__name__}: {exc}"[:500]
        )
    return Profiling(command_id, steps, profiler, steps)


def step_ended(profiling: Profiling) -> Finished | None:
    """One traced step ended (training thread): the finished profile after the last one."""
    now = time.perf_counter()
    profiling.step_ms.append((now - profiling.started) * 1e3)
    profiling.started = now
    profiling.left -= 1
    if profiling.left > 0:
        return None
    try:
        profiling.profiler.stop()
    except Exception as exc:
        return Finished(
            profiling.command_id, profiling.steps, error=f"torch.profiler did not stop: {exc}"[:500]
        )
    return Finished(profiling.command_id, profiling.steps, profiling.profiler, profiling.step_ms)


def summarise(done: Finished) -> tuple[dict[str, Any], bytes | None]:
    """(the result, the gzipped Chrome trace) of a finished profile (sender thread)."""
    ops: list[dict[str, Any]] = []
    for event in done.profiler.key_averages():
        device: Any = getattr(event, "self_device_time_total", None)
        if device is None:
            device = getattr(event, "self_cuda_time_total", 0.0)
        ops.append(
            {"name": str(event.key)[:200], "count": int(event.count),
             "self_cpu_us": round(float(event.self_cpu_time_total), 1), "self_device_us": round(float(device), 1)}
        )  # fmt: skip
    ops.sort(key=lambda o: -(o["self_cpu_us"] + o["self_device_us"]))
    fd, path = tempfile.mkstemp(prefix="stepwatch-trace-", suffix=".json")
    os.close(fd)
    try:
        done.profiler.export_chrome_trace(path)
        with open(path, "rb") as f:
            trace = gzip.compress(f.read(), compresslevel=6)
    finally:
        os.unlink(path)
    result: dict[str, Any] = {
        "steps": done.steps, "step_ms": [round(t, 3) for t in done.step_ms], "top_ops": ops[:TOP_OPS],
        "trace_bytes": len(trace),
    }  # fmt: skip
    if len(trace) > MAX_TRACE_BYTES:
        result["trace_dropped"] = f"{len(trace):,} bytes gzipped, over the {MAX_TRACE_BYTES:,} limit"
        return result, None
    return result, trace
