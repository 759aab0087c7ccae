"""`memory_leak`: a sustained slope of memory that does not slow and threatens the run, not the
allocator's step-ups, a drift that levels off or a sawtooth."""

from __future__ import annotations

import csv

import numpy as np

from stepwatch_server.detect import Anomaly, StepFrame
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.detectors.memory_leak import MemoryLeakDetector
from stepwatch_server.simulate import MemoryLeak, world
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
    # 512 MB of steady growth are needed (benign drift and allocator steps stay below): ~630 steps at 1 MB/step.
    assert [(a.rank, a.detected_step <= 2200) for a in anomalies] == [(20, True)]


def test_quiet_on_plateaus_and_warm_up() -> None:
    _, anomalies = run_scenario(scenario("clean_long_8", steps=5000), kinds=KINDS)
    assert anomalies == []


def _frames(alloc: np.ndarray, capacity_mb: float | None = None, step_ms: float = 1000.0):  # type: ignore[no-untyped-def]
    for i, row in enumerate(alloc):
        metrics = {"mem.allocated_mb": row, "time.step_ms": np.full(row.shape, step_ms)}
        if capacity_mb is not None:
            metrics["mem.capacity_mb"] = np.full(row.shape, capacity_mb)
        yield StepFrame("r", i + 1, 1e9 + i, np.ones(row.shape[0], dtype=bool), metrics)


H100_MB = 81_559.0


def _run(
    alloc: np.ndarray,
    capacity_mb: float | None = H100_MB,
    step_ms: float = 500.0,
    ranks_per_node: int = 0,
    steps: np.ndarray | None = None,
) -> tuple[RunContext, list[Anomaly]]:
    """Feed (steps, ranks) allocated MB to a fresh detector; every anomaly raised, as last seen. Row i is
    step i + 1, or `steps[i]` (a resumed run goes back), at event time i x step_ms."""
    ctx = RunContext("r", alloc.shape[1])
    if ranks_per_node:
        ctx.node[:] = [f"gpu-{r // ranks_per_node:03d}" for r in range(alloc.shape[1])]
    det = MemoryLeakDetector(ctx, MemoryLeakDetector.Settings())
    seen: dict[int, Anomaly] = {}
    for i, row in enumerate(alloc):
        metrics = {"mem.allocated_mb": row, "time.step_ms": np.full(row.shape, step_ms)}
        if capacity_mb is not None:
            metrics["mem.capacity_mb"] = np.full(row.shape, capacity_mb)
        ctx.record_step_time(step_ms)
        step = i + 1 if steps is None else int(steps[i])
        det.on_frame(
            StepFrame("r", step, 1e9 + i * step_ms / 1000, np.ones(row.shape[0], dtype=bool), metrics)
        )
        for a in ctx.book.drain_changes():
            seen.setdefault(a.local_id, a)
    return ctx, list(seen.values())


def _base(steps: int, ranks: int, level_mb: float = 33_000.0, seed: int = 0) -> np.ndarray:
    """Flat memory with the allocator's per-step noise of a few MB."""
    rng = np.random.default_rng(seed)
    return level_mb + rng.normal(0.0, 2.0, (steps, ranks)).round()


def test_plateauing_drift_on_a_large_allocation_is_not_a_leak() -> None:
    """0.3 MB/step for 400 steps on a 33 GB rank, then flat (+120 MB), and the same slope slowing
    as it goes (+85 MB): neither would come near the device's 80 GB within the horizon."""
    t = np.arange(1, 3001, dtype=np.float64)
    alloc = _base(3000, 4)
    alloc[:, 1] += 0.3 * np.clip(t - 500, 0, 400)  # linear for 400 steps, then flat
    alloc[:, 2] += 85.0 * -np.expm1(-np.maximum(t - 500, 0) * 0.3 / 85.0)  # slows as it goes
    _, anomalies = _run(alloc)
    assert anomalies == []


def test_a_40_mb_per_step_leak_is_found_within_100_steps() -> None:
    alloc = _base(1200, 8, level_mb=30_000.0)
    onset = 800
    alloc[onset - 1 :, 5] += 40.0 * np.arange(1, 1200 - onset + 2)
    _, anomalies = _run(alloc)
    (a,) = anomalies
    assert a.rank == 5 and a.severity == "critical"
    assert onset <= a.detected_step <= onset + 100
    assert 39.0 < a.evidence["mb_per_step"] < 41.0
    assert a.evidence["seconds_to_oom"] < 3600 and "out of memory in ~" in a.summary


def test_allocator_steps_and_a_sawtooth_are_not_leaks() -> None:
    """Step-ups of a few hundred MB reached in 1-40 steps (the allocator, an evaluation's buffers),
    and rank 0 collecting 600 MB over 300 steps and letting it go, again and again."""
    t = np.arange(1, 4001, dtype=np.float64)
    alloc = _base(4000, 4)
    for rank, (at, size, ramp) in enumerate([(900, 350.0, 1), (1500, 800.0, 40), (2600, 250.0, 20)], start=1):
        alloc[:, rank] += size * np.clip((t - at) / ramp, 0.0, 1.0)
    alloc[:, 0] += 2.0 * ((t - 1) % 300)  # the sawtooth
    _, anomalies = _run(alloc)
    assert anomalies == []


def test_every_rank_leaking_is_one_run_level_anomaly_beside_a_faster_one() -> None:
    """A leak in the training code (every rank, 3 MB/step) is reported once for the run; a rank
    that leaks 10x faster on top of it is its own anomaly, not hidden by the run-level one. It is found
    within 150 steps: for its first ~40 it rises as an allocator step-up does (800 MB in 40 steps),
    which a rank of a run-level leak must not be reported for (the test below)."""
    alloc = _base(2000, 16, level_mb=60_000.0)
    t = np.arange(1, 2001, dtype=np.float64)
    alloc += 3.0 * np.clip(t - 1000, 0, None)[:, None]
    alloc[:, 9] += 27.0 * np.clip(t - 1500, 0, None)
    _, anomalies = _run(alloc)
    by_key = {a.key: a for a in anomalies}
    assert set(by_key) == {"run", "rank:9"}
    run = by_key["run"]
    assert run.rank is None and run.evidence["n_ranks"] == 16 and 2.9 < run.evidence["mb_per_step"] < 3.1
    assert 1000 <= run.detected_step <= 1400
    assert 1500 <= by_key["rank:9"].detected_step <= 1650


def test_ranks_that_join_an_open_run_level_leak_one_by_one_raise_nothing_more() -> None:
    """A leak in the training code seen by 64 ranks at slightly different paces and starts (1.5-3
    MB/step for 800 steps, starting over 600 steps): the ranks cross the bar one by one. Once the run-level anomaly is
    open, a rank that crosses later is part of it, not an anomaly of its own, whatever the count of
    ranks leaking at that moment (before, each dip of the count below the run-level bar let the next
    ranks open their own: 18 rank-level alarms beside the run-level one on a 512-rank run); those
    raised before it formed resolve into it."""
    steps, ranks = 2200, 64
    rng = np.random.default_rng(3)
    alloc = _base(steps, ranks, level_mb=60_000.0)
    t = np.arange(1, steps + 1, dtype=np.float64)[:, None]
    start = 600 + rng.integers(0, 600, ranks)
    alloc += rng.uniform(1.5, 3.0, ranks) * np.clip(t - start, 0, 800)
    _, anomalies = _run(alloc)
    run = [a for a in anomalies if a.key == "run"]
    assert len(run) == 1, [a.summary for a in anomalies]
    later = [a for a in anomalies if a.key != "run" and a.detected_step > run[0].detected_step]
    assert later == [], [a.summary for a in later]
    assert len(anomalies) <= 1 + 8  # at most max_rank_anomalies before the run-level one
    # Those raised before it formed resolve into it: one alarm stays open for one leak.
    before = [a for a in anomalies if a.key != "run"]
    assert all(a.status == "resolved" and a.evidence.get("resolution") == "part of run" for a in before), [
        (a.key, a.status, a.evidence.get("resolution")) for a in before
    ]


def test_a_sawtooth_with_an_allocator_step_under_it_is_not_a_leak() -> None:
    """heldout-014 (128 ranks, 118 ms steps): every node's local rank 0 collects and drops 1.2 GB every
    73 steps, and on rank 64 an allocator plateau lifts memory by 1.5 GB mid-rise. The sawtooth's rising
    phases make every part grow step to step, and its phase at a window's ends plus the step make a net
    rise of +0.5-1.6 GB with new highs: four alarms on ranks 40 and 64, before the troughs were judged."""
    sc = world.split("heldout")["heldout-014"]
    _, anomalies = run_scenario(sc, kinds=KINDS)
    assert anomalies == [], [a.summary for a in anomalies]


def test_a_slow_leak_is_judged_by_its_threat() -> None:
    """1 MB/step on a rank 10 GB below capacity runs out in ~3 h at 1 s a step: a leak. The same
    slope with 50 GB free (~14 h) is past the 12 h horizon: not yet."""
    alloc = _base(2500, 3, level_mb=30_000.0)
    alloc[:, 1] = _base(2500, 1, level_mb=71_500.0)[:, 0]
    t = np.arange(1, 2501, dtype=np.float64)
    alloc[:, [0, 1]] += 1.0 * np.clip(t - 1000, 0, None)[:, None]
    _, anomalies = _run(alloc, step_ms=1000.0)
    (a,) = anomalies
    assert a.rank == 1 and a.detected_step <= 1700
    assert 2.0 * 3600 < a.evidence["seconds_to_oom"] < 3.5 * 3600 and a.severity == "warning"


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


def test_a_fast_sawtooth_climbing_back_to_its_old_peak_is_not_a_leak() -> None:
    """Rank 0 collects 2.6 GB over 200 steps (13 MB/step: on its rise, it looks like a leak that
    exhausts the device within minutes) and lets it go, again and again. Its first rise cannot be told
    from a leak; every later one only climbs back to the peak it held before."""
    t = np.arange(1, 3001, dtype=np.float64)
    alloc = _base(3000, 4)
    alloc[:, 0] += 13.0 * ((t - 1) % 200)
    _, anomalies = _run(alloc)
    assert all(a.rank == 0 and a.first_step < 200 for a in anomalies), [
        (a.rank, a.first_step) for a in anomalies
    ]
    assert len(anomalies) <= 1


def test_the_same_local_rank_leaking_on_every_node_is_one_anomaly_naming_them() -> None:
    """Local rank 0 of each node (ranks 0 and 8 of 2 nodes of 8) growing at one pace is one code path
    (the node's logging or decoding rank): one anomaly for the local rank, not one per node. Two ranks
    that are not the same local rank are two leaks."""
    steps = np.arange(1500)[:, None]
    alloc = _base(1500, 16)
    alloc[:, [0, 8]] += np.clip(steps - 600, 0, None) * 8.0
    _, anomalies = _run(alloc, ranks_per_node=8)
    (a,) = anomalies
    assert a.key == "local_rank:0" and a.rank is None and a.evidence["ranks"] == [0, 8], a.summary
    assert a.evidence["local_rank"] == 0 and a.evidence["n_ranks"] == 2
    assert a.summary.startswith("local rank 0 of 2 nodes (ranks 0, 8): allocated memory growing 8.00 MB/step")

    alloc = _base(1500, 16)
    alloc[:, [0, 9]] += np.clip(steps - 600, 0, None) * 8.0
    _, anomalies = _run(alloc, ranks_per_node=8)
    assert sorted(a.key for a in anomalies) == ["rank:0", "rank:9"]


def test_allocator_steps_stacked_on_a_sawtooth_climb_are_not_a_leak_and_a_leak_beside_one_is() -> None:
    """final2-013: rank 0 collects 375 MB over 195 steps and lets it go, again and again, and two
    allocator step-ups (+1.1 GB at once, +0.75 GB over 40 steps) land on it within 350 steps. Every part
    of a 310-step window grows block to block (the climb) and the troughs rise (the steps): +885 MB, a
    leak by every bar but one. Its continuous rise, the growths without the step-ups, is the sawtooth's,
    which its drops cancel. A 1.5 MB/step leak under the same sawtooth and steps is still found."""
    t = np.arange(1, 2001, dtype=np.float64)
    saw = 375.0 * ((t - 1) % 195) / 195
    steps = 1100.0 * (t >= 430) + 750.0 * np.clip((t - 750) / 40, 0.0, 1.0)
    alloc = _base(2000, 4, level_mb=70_000.0)
    alloc[:, 0] += saw + steps
    _, anomalies = _run(alloc, step_ms=1280.0)
    assert anomalies == [], [a.summary for a in anomalies]

    alloc[:, 0] += 1.5 * np.clip(t - 300, 0, None)
    _, anomalies = _run(alloc, step_ms=1280.0)
    assert anomalies and {a.rank for a in anomalies} == {0}, [a.summary for a in anomalies]
    assert anomalies[0].detected_step < 1300


def test_overlapping_plateauing_drifts_on_every_rank_are_not_a_leak() -> None:
    """final3-039: every rank drifts three times, each drift levelling off as the next starts (+110 MB at
    0.9 MB/step from step 465, +550 MB at 0.05 MB/step from 545, +530 MB at 1.4 MB/step from 815; each
    rank's sizes and paces drawn 15% apart), on 71 GB of an 80 GB device. Over 1,270 steps the sum rises
    slowly, then fast, then slowly: its first and last parts alike (~0.3 MB/step), the middle ~0.7. Each
    rank read as a leak one after another (9 anomalies here). The pace long past its peak is a drift
    levelling off. A steady 1 MB/step leak on one rank on top of it is still found."""
    t = np.arange(1, 2552, dtype=np.float64)
    rng = np.random.default_rng(3)
    alloc = _base(2551, 16, level_mb=71_000.0)
    for start, pace, total in ((815, 1.401, 528.6), (545, 0.053, 550.7), (465, 0.889, 109.8)):
        size = total * np.exp(rng.normal(0.0, 0.15, 16))
        tau = size / (pace * np.exp(rng.normal(0.0, 0.15, 16)))
        alloc += size * -np.expm1(-np.maximum(t[:, None] - start, 0.0) / tau)
    _, anomalies = _run(alloc, step_ms=489.0)
    assert anomalies == [], [a.summary for a in anomalies]

    alloc[:, 6] += 1.0 * np.clip(t - 1200, 0.0, None)
    _, anomalies = _run(alloc, step_ms=489.0)
    assert [a.key for a in anomalies] == ["rank:6"], [a.summary for a in anomalies]


def test_a_sawtooth_that_starts_again_after_a_resume_is_not_a_leak() -> None:
    """final4-023: rank 0 collects 1.6 GB over 467 steps and lets it go, again and again. The job is
    killed after step 2200 and resumed from the checkpoint at step 1000: the new processes allocate
    everything again and the sawtooth starts over, and the history of block means starts again with
    the new session. Its first tooth after the resume read as a leak (it had no earlier peak to climb
    back to). What the rank was seen to let go before is kept across the resume. The first tooth of
    the run, before any drop, still reads as one (the known limit). A 3 MB/step leak that starts after
    the resume on rank 2 is still found."""
    first = np.arange(1, 2201)
    second = np.arange(1001, 3201)
    steps = np.concatenate([first, second])
    in_session = np.concatenate([first, second - 1000]).astype(np.float64)
    alloc = _base(steps.size, 4, level_mb=60_000.0)
    alloc *= (0.7 + 0.3 * np.minimum(1.0, in_session / 40.0))[:, None]  # a new process ramps up again
    alloc[:, 0] += 1616.0 * ((in_session - 1) % 467) / 467
    _, anomalies = _run(alloc, step_ms=595.0, steps=steps)
    assert [(a.key, a.first_step < 467) for a in anomalies] == [("rank:0", True)], [
        (a.summary, a.detected_step) for a in anomalies
    ]

    after = np.concatenate([np.zeros(first.size), np.clip(second - 1300.0, 0.0, None)])
    alloc[:, 2] += 3.0 * after
    _, anomalies = _run(alloc, step_ms=595.0, steps=steps)
    assert [a.key for a in anomalies] == ["rank:0", "rank:2"], [a.summary for a in anomalies]


def test_an_evaluation_step_inside_a_leaks_window_does_not_delay_it() -> None:
    """final4-026: a 1.5 MB/step leak on a rank whose memory also steps up 490 MB at an evaluation inside
    the leak's windows. The step is not the leak's pace, so the part that holds it is not the pace the
    last part must keep up with: the leak is found within a few blocks of when it is without the step
    (490 steps later when the step counted)."""
    t = np.arange(1, 4001, dtype=np.float64)
    alloc = _base(4000, 4, level_mb=70_000.0)
    alloc[:, 1] += 1.5 * np.clip(t - 1000, 0.0, None)
    _, plain = _run(alloc, step_ms=4312.0)
    alloc[:, 1] += 490.0 * np.clip((t - 1400) / 5, 0.0, 1.0)
    _, stepped = _run(alloc, step_ms=4312.0)
    assert [a.key for a in plain] == [a.key for a in stepped] == ["rank:1"]
    assert stepped[0].detected_step <= plain[0].detected_step + 100, (
        plain[0].detected_step,
        stepped[0].detected_step,
    )


def test_allocator_steps_on_ranks_of_a_run_level_leak_are_not_second_leaks() -> None:
    """final3-003: every rank of the run leaks ~3.8 MB/step, and the caching allocator steps some of them up
    by 800 MB over 40 steps later on. Each step made its rank's latest pace look 2x the run's, a second,
    faster leak of its own: 11 more anomalies beside the run-level one. The pace a rank is compared at is
    its continuous growth, step-ups cut down."""
    t = np.arange(1, 2001, dtype=np.float64)
    alloc = _base(2000, 16, level_mb=20_000.0)
    alloc += 3.8 * np.clip(t - 600, 0.0, None)[:, None]
    for rank, at in ((3, 1000), (7, 1150), (11, 1300), (14, 1450)):
        alloc[:, rank] += 800.0 * np.clip((t - at) / 40, 0.0, 1.0)
    _, anomalies = _run(alloc, capacity_mb=None)
    assert [a.key for a in anomalies] == ["run"], [a.summary for a in anomalies]


def test_every_rank_drifting_three_times_in_a_world_run_is_not_a_leak() -> None:
    """The world's final3-039 itself (64 ranks of an 80 GB device 71 GB full, three drifts on every rank,
    each rank's drawn 15% apart; a NaN divergence ends it): its ranks' latest parts still rose at just
    over half the pace of their fastest when the drifts were levelling off, and 7 anomalies opened. A
    leak keeps its pace within a few percent (block means average the noise away): the continuous pace of
    the last part must be 70% of the fastest's."""
    sc = world.split("final3")["final3-039"]
    _, anomalies = run_scenario(sc, kinds=KINDS)
    assert anomalies == [], [a.summary for a in anomalies]


def test_a_leak_under_a_sawtooth_is_one_anomaly_that_stays_open() -> None:
    """dev-027: a rank collects 357 MB over 294 steps and lets it go, again and again, and leaks 2 MB/step
    from step 737. A part of a window that holds one of the sawtooth's drops rises slower than one that
    does not; that was read as the leak slowing down, so the anomaly resolved and was raised again 300
    steps later. The drops, like the step-ups, are no part of the pace compared."""
    t = np.arange(1, 1914, dtype=np.float64)
    alloc = _base(1913, 8, level_mb=37_000.0)
    alloc[:, 4] += 357.0 * ((t - 34) % 294) / 294 * (t >= 34) + 2.0 * np.clip(t - 737, 0.0, None)
    _, anomalies = _run(alloc, capacity_mb=None, step_ms=216.0)
    assert [(a.key, a.status) for a in anomalies] == [("rank:4", "open")], [
        (a.summary, a.status, a.detected_step) for a in anomalies
    ]
