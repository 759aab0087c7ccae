"""The physics the detectors must respect (DESIGN.md), checked on the batches as a collector sees them."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from stepwatch_server.simulate import (
    Divergence,
    Fp8OverflowRisk,
    LossSpike,
    MemoryLeak,
    ReplicaDivergence,
    Scenario,
    SlowNode,
    Straggler,
    ThroughputDrop,
    generate,
)
from stepwatch_server.simulate.physics import CleanPhysics
from tests.simulate.helpers import Collected, collect

STEPS = 1200
MIXED = Scenario(
    "mixed",
    world_size=24,
    steps=STEPS,
    seed=5,
    eval_every=500,
    eval_s=15.0,
    faults=(
        Straggler(3, 400, factor=1.10),  # node 0
        SlowNode(2, 500, factor=1.3, slow_ranks=6),  # ranks 16..21
        MemoryLeak(9, 300, mb_per_step=4.0),
        ReplicaDivergence(13, 650),
        Fp8OverflowRisk("layers.3.attn.logits", 300, growth_per_step=0.006),
        LossSpike(900, magnitude=1.5, recovery_steps=30),
    ),
    plateaus_per_10k=40.0,
)


@cache
def trace(scn: Scenario) -> Collected:
    return collect(generate(scn), scn.world_size, scn.last_step)


def _rank_mean(arr: np.ndarray) -> np.ndarray:
    """Mean over ranks per step (row 0, before step 1, stays NaN; NaN values propagate)."""
    out = np.full(arr.shape[0], np.nan)
    out[1:] = arr[1:].mean(axis=1)
    return out


def _ratio_to_median(arr: np.ndarray) -> np.ndarray:
    return arr / np.median(arr, axis=1, keepdims=True)


def test_phases_add_up_and_step_time_is_equal_across_ranks() -> None:
    c = trace(MIXED)
    m = c.metrics
    total = m["time.data_ms"] + m["time.forward_ms"] + m["time.backward_ms"] + m["time.optimizer_ms"]
    np.testing.assert_allclose(total[1:], m["time.step_ms"][1:], atol=0.01)
    step = m["time.step_ms"][10:]
    spread = (step.max(axis=1) - step.min(axis=1)) / np.median(step, axis=1)
    assert np.median(spread) < 0.03 and spread.max() < 0.1
    # timestamps agree across ranks up to clock skew and optimizer noise
    assert np.nanmax(np.ptp(c.ts[1:], axis=1)) < 0.05


def test_straggler_has_longer_forward_and_shorter_backward() -> None:
    m = trace(MIXED).metrics
    fwd, bwd = _ratio_to_median(m["time.forward_ms"]), _ratio_to_median(m["time.backward_ms"])
    before, after = slice(20, 400), slice(400, 500)
    assert abs(np.median(fwd[before, 3]) - 1.0) < 0.03
    assert 1.07 < np.median(fwd[after, 3]) < 1.13
    assert np.median(bwd[after, 3]) < 0.95  # it waits less for the others
    # and its step time is the same as everyone's
    assert abs(np.median(_ratio_to_median(m["time.step_ms"])[after, 3]) - 1.0) < 0.01


def test_healthy_ranks_wait_for_the_slow_node_in_backward() -> None:
    m = trace(MIXED).metrics
    fwd, bwd = m["time.forward_ms"], m["time.backward_ms"]
    slow, healthy = list(range(16, 22)), [r for r in range(24) if r not in range(16, 24) and r != 3]
    before, after = slice(100, 390), slice(550, 890)
    assert np.median(fwd[after][:, slow]) / np.median(fwd[after][:, healthy]) > 1.25
    assert np.median(bwd[after][:, healthy]) > np.median(bwd[before][:, healthy]) * 1.1
    assert np.median(bwd[after][:, slow]) < np.median(bwd[after][:, healthy])
    assert np.median(m["time.forward_ms"][after][:, [22, 23]]) < np.median(fwd[after][:, slow]) / 1.2


def test_throughput_drop_slows_everyone_alike() -> None:
    scn = Scenario("tp", world_size=16, steps=600, seed=2, faults=(ThroughputDrop(300, factor=1.4),))
    m = trace(scn).metrics
    step = m["time.step_ms"]
    assert 1.3 < np.median(step[320:]) / np.median(step[50:290]) < 1.5
    fwd = _ratio_to_median(m["time.forward_ms"][320:])
    assert np.abs(np.median(fwd, axis=0) - 1.0).max() < 0.03


def test_clean_noise_has_gc_blips_but_no_persistent_outlier() -> None:
    scn = Scenario("gc", world_size=16, steps=1500, seed=9, gc_rate=1 / 100)
    m = trace(scn).metrics
    fwd = _ratio_to_median(m["time.forward_ms"][10:])
    assert (fwd > 1.5).sum() >= 50  # single slow steps are common...
    assert np.abs(np.median(fwd, axis=0) - 1.0).max() < 0.02  # ...but no rank is persistently slow
    assert m["time.forward_ms"][1].min() > 20_000  # step 1 compiles


def test_loss_curve_lr_schedule_and_spike() -> None:
    m = trace(MIXED).metrics
    loss, lr = m["loss"], m["lr"]
    glob = _rank_mean(loss)
    assert 9.0 < glob[1] < 12.5 and glob[800] < 4.5
    assert np.all(np.ptp(lr[1:], axis=1) == 0.0)  # identical across ranks
    assert lr[100, 0] < lr[200, 0] and lr[1100, 0] < lr[300, 0]  # warm-up, then decay
    assert np.std(loss[800] / glob[800]) > 0.01  # each rank sees different data
    baseline = np.median(glob[850:900])
    assert glob[900] / baseline > 1.4
    assert glob[935] / baseline < 1.1  # recovered
    g = m["grad_norm"][:, 0]
    assert g[899] > 3 * np.median(g[850:898])  # the update that caused it


@pytest.mark.parametrize("mode", ["spike-no-recover", "trend", "nonfinite"])
def test_divergence_does_not_recover(mode: str) -> None:
    scn = Scenario(
        "div", world_size=8, steps=700, seed=3, faults=(Divergence(500, mode=mode, rate_per_step=0.01),)
    )
    loss = _rank_mean(trace(scn).metrics["loss"])
    base = np.median(loss[450:500])
    if mode == "nonfinite":
        raw = trace(scn).metrics["loss"]
        assert np.isnan(raw[540:]).all() and np.isfinite(raw[1:540]).all()
        assert loss[535] > 1.3 * base
    else:
        assert np.all(loss[560:] > 1.3 * base)


def test_leak_is_a_slope_plateaus_are_steps_that_flatten() -> None:
    m = trace(MIXED).metrics
    alloc = m["mem.allocated_mb"]
    slope = np.median(np.diff(alloc[600:, 9]))  # robust to the plateaus this rank has too
    assert 3.5 < slope < 4.5
    others = [r for r in range(24) if r != 9]
    jumps = np.abs(np.diff(alloc[60:, others], axis=0)) > 50  # plateaus exist...
    assert jumps.sum() >= 5
    moving = np.abs(np.diff(alloc[60:, others], axis=0)) > 10
    assert moving.mean() < 0.05  # ...but memory is flat between them
    assert (np.diff(alloc[600:, 9]) > 0).mean() > 0.8  # while a leak rises step after step
    reserved, peak = m["mem.reserved_mb"], m["mem.peak_mb"]
    assert np.all(reserved[1:] >= peak[1:]) and np.all(peak[1:] > alloc[1:])
    assert np.all(np.diff(reserved[1:], axis=0) >= 0)  # the caching allocator keeps what it reserved


def test_fingerprints_identical_except_the_diverged_replica() -> None:
    fps = trace(MIXED).fingerprints
    assert sorted(fps) == list(range(100, STEPS + 1, 100))
    for step, by_rank in fps.items():
        assert len(by_rank) == 24
        values = {r: v for r, v in by_rank.items() if r != 13}
        assert len(set(values.values())) == 1
        assert (by_rank[13] == values[0]) == (step < 650)


def test_amax_drifts_slowly_and_the_fp8_fault_grows_past_e4m3() -> None:
    amax = trace(MIXED).amax
    clean = np.concatenate([v[10::10] for k, v in amax.items() if k != "layers.3.attn.logits"])
    assert np.nanmax(clean) < 150
    logits = np.full(STEPS + 1, np.nan)
    logits[10::10] = np.median(amax["layers.3.attn.logits"][10::10], axis=1)
    assert np.nanmax(logits[:300]) < 120 and logits[1200] > 448
    growth = np.log(logits[1100] / logits[700]) / 400
    assert 0.005 < growth < 0.007


def test_chunks_stream_in_bounded_memory() -> None:
    import tracemalloc

    scn = Scenario("mem", world_size=512, steps=2000, seed=1, plateaus_per_10k=4.0)
    physics = CleanPhysics(scn)
    tracemalloc.start()
    try:
        for index, (first, last) in enumerate(physics.chunk_ranges()):
            ch = physics.draw(index, first, last)
            physics.finish_memory(ch)
            physics.sync(ch)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # everything at once would be ~16 float64 (steps x ranks) arrays + amax: > 250 MB
    assert peak < 40 * 2**20, peak
