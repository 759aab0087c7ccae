"""`memory_leak`: a sustained slope of allocated memory, not the allocator's step-ups."""

from __future__ import annotations

import csv

import numpy as np

from stepwatch_server.detect import StepFrame
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.detectors.memory_leak import MemoryLeakDetector
from stepwatch_server.simulate import MemoryLeak
from tests.conftest import require
from tests.detect.helpers import run_scenario, scenario
from tests.detect.real_logs import DEEPSEEK

KINDS = ("memory_leak",)


def test_leak_is_found_with_its_slope() -> None:
    _, anomalies = run_scenario(scenario("memory_leak_8", steps=1500), kinds=KINDS)
    (a,) = anomalies
    assert a.rank == 3 and a.node == "gpu-000"
    assert 3.8 < a.evidence["mb_per_step"] < 4.2
    assert 1000 <= a.detected_step <= 1400
    assert "capacity unknown" in a.summary


def test_slow_leak_among_frequent_plateaus() -> None:
    sc = scenario(
        "memory_leak_slow_128", world_size=32, steps=2200, faults=(MemoryLeak(20, 1500, mb_per_step=1.0),)
    )
    _, anomalies = run_scenario(sc, kinds=KINDS)
    assert [(a.rank, a.detected_step <= 2000) for a in anomalies] == [(20, True)]


def test_quiet_on_plateaus_and_warm_up() -> None:
    _, anomalies = run_scenario(scenario("clean_long_8", steps=5000), kinds=KINDS)
    assert anomalies == []


def _frames(alloc: np.ndarray, capacity_mb: float | None = None, step_ms: float = 1000.0):  # type: ignore[no-untyped-def]
    for i, row in enumerate(alloc):
        metrics = {"mem.allocated_mb": row, "time.step_ms": np.full(row.shape, step_ms)}
        if capacity_mb is not None:
            metrics["mem.capacity_mb"] = np.full(row.shape, capacity_mb)
        yield StepFrame("r", i + 1, 1e9 + i, np.ones(row.shape[0], dtype=bool), metrics)


def test_projection_to_out_of_memory_and_resolution() -> None:
    steps = np.arange(1, 1001, dtype=np.float64)
    alloc = np.stack([np.full_like(steps, 70_000.0), 70_000.0 + 2.0 * np.minimum(steps, 600)], axis=1)
    ctx = RunContext("r", 2)
    det = MemoryLeakDetector(ctx, MemoryLeakDetector.Settings())
    for frame in _frames(alloc, capacity_mb=81_920.0):
        ctx.record_step_time(1000.0)
        det.on_frame(frame)
        if frame.step == 500:
            (a,) = ctx.book.open.values()
            assert a.rank == 1 and a.evidence["capacity_mb"] == 81_920.0
            expected = (81_920.0 - 71_000.0) / 2.0  # (capacity - current) / slope, roughly
            assert abs(a.evidence["steps_to_oom"] - expected) < 0.05 * expected
            assert a.evidence["seconds_to_oom"] == a.evidence["steps_to_oom"] * 1.0
            assert "out of memory in ~" in a.summary
    assert not ctx.book.open and ctx.book.resolved[-1].rank == 1  # the growth stopped at step 600


def test_quiet_on_real_megatron_memory() -> None:
    require(DEEPSEEK.exists(), f"{DEEPSEEK} (real Megatron log) is missing")
    with DEEPSEEK.open(newline="") as fh:
        rows = [
            (int(r["step"]), float(r["mem_allocated_bytes"]))
            for r in csv.DictReader(fh)
            if r["mem_allocated_bytes"]
        ]
    ctx = RunContext("real", 1)
    det = MemoryLeakDetector(ctx, MemoryLeakDetector.Settings())
    for step, mem_bytes in rows:
        det.on_frame(StepFrame("real", step, float(step), np.ones(1, dtype=bool),
                               {"mem.allocated_mb": np.array([mem_bytes / 2**20])}))  # fmt: skip
    assert len(rows) > 9000 and not ctx.book.open and not ctx.book.resolved


def test_host_rss_sent_once_per_batch_is_judged_per_sample() -> None:
    """A CPU run reports `mem.rss_mb` only on the last step of each batch (every ~2 s, here every 23
    steps): the window is the rank's last reported samples, and the growth is per step between them."""
    ctx = RunContext("cpu", 4)
    det = MemoryLeakDetector(ctx, MemoryLeakDetector.Settings())
    rng = np.random.default_rng(0)
    for step in range(1, 1501):
        rss = np.full(4, np.nan)
        if step % 23 == 0:  # one sample per batch, flat within +-2 MB on the healthy ranks
            rss = 900.0 + rng.uniform(-2, 2, 4)
            rss[2] += 1.0 * max(0, step - 300)  # rank 2 keeps 1 MB a step from step 300 on
        det.on_frame(StepFrame("cpu", step, 1e9 + step, np.ones(4, dtype=bool), {"mem.rss_mb": rss}))
    (a,) = ctx.book.open.values()
    assert (a.rank, a.evidence["metric"]) == (2, "mem.rss_mb")
    assert 0.9 < a.evidence["mb_per_step"] < 1.1
    assert a.detected_step < 300 + 34 * 23  # 33 samples after the onset, not 33 blocks of 10 steps
    assert not ctx.book.resolved
