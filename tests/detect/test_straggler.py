"""`straggler`: one rank persistently slower than its peers in data or forward time."""

from __future__ import annotations

import numpy as np

from stepwatch_server.detect import Anomaly, EngineSettings, StepFrame
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.registry import DETECTORS
from stepwatch_server.simulate import Straggler
from stepwatch_server.simulate.benign import NodeDataHiccup
from tests.detect.helpers import run_scenario, scenario

KINDS = ("straggler", "slow_node", "throughput_drop")
TTD_STEPS = 50  # the issue: a rank 10% slower is found within 50 steps


def _only(anomalies: list[Anomaly], kind: str) -> Anomaly:
    assert [a.kind for a in anomalies] == [kind], [a.summary for a in anomalies]
    return anomalies[0]


def test_ten_percent_slower_data_loader_is_found_within_50_steps() -> None:
    sim, anomalies = run_scenario(scenario("straggler_10pct_data_16", steps=1000), kinds=KINDS)
    a = _only(anomalies, "straggler")
    (label,) = sim.labels
    assert a.rank == 6 and a.node == "gpu-000" and a.key == "rank:6"
    assert 0 <= a.detected_step - label.first_step <= TTD_STEPS
    assert a.evidence["phase"] == "data" and 1.04 < a.evidence["ratio"] < 1.2
    assert a.summary.startswith("rank 6 on node gpu-000: data 1.")
    assert "the median of its peers for" in a.summary
    assert a.status == "open" and a.severity == "warning"


def test_ten_percent_slower_forward_is_found_within_50_steps() -> None:
    sc = scenario(
        "straggler_10pct_fwd_64", steps=480, faults=(Straggler(17, 400, factor=1.10),)
    )  # earlier: speed
    sim, anomalies = run_scenario(sc, kinds=KINDS)
    a = _only(anomalies, "straggler")
    (label,) = sim.labels
    assert a.rank == 17 and a.evidence["phase"] == "forward"
    assert 0 <= a.detected_step - label.first_step <= TTD_STEPS
    assert abs(a.evidence["ratio"] - 1.10) < 0.03
    assert a.evidence["step_fraction_lost"] > 0.01  # forward is ~30% of the step


def test_a_slow_spell_resolves_and_is_critical_when_large() -> None:
    # 1.6x forward for 300 steps, then normal again (a throttled GPU that recovers).
    sc = scenario(
        "straggler_10pct_data_16", steps=1100, faults=(Straggler(9, 600, factor=1.6, duration=300),)
    )
    _, anomalies = run_scenario(sc, kinds=("straggler",))
    a = _only(anomalies, "straggler")
    assert a.rank == 9 and a.severity == "critical" and a.evidence["phase"] == "forward"
    assert a.detected_step - 600 <= 30
    assert a.status == "resolved" and a.resolved_step is not None
    assert 900 <= a.resolved_step <= 900 + 150  # the window empties, then 40 quiet steps


def test_peers_waiting_in_backward_are_never_blamed() -> None:
    # A 2x straggler makes all 15 others wait ~120 ms per step inside backward: only rank 3 is slow.
    sc = scenario("straggler_10pct_data_16", steps=900, faults=(Straggler(3, 500, factor=2.0),))
    _, anomalies = run_scenario(sc, kinds=("straggler",))
    a = _only(anomalies, "straggler")
    assert a.rank == 3 and a.evidence["ratio"] > 1.8


def test_quiet_on_clean_runs_with_evals_gc_and_blips() -> None:
    for name, changes in (
        ("clean_8", {"steps": 2100}),
        ("clean_noisy_256", {"world_size": 32, "steps": 800}),
    ):
        _, anomalies = run_scenario(scenario(name, **changes), kinds=KINDS)
        assert anomalies == [], (name, [a.summary for a in anomalies])


def test_a_data_hiccup_of_20_steps_on_a_node_or_a_rank_is_not_a_straggler() -> None:
    """A node whose ranks wait 2-8x longer for data for 20 steps (a shared filesystem hiccup), and one
    rank's data wait several step times long for 10 steps: transient, and not the ranks' own pace."""
    hiccup = tuple(Straggler(r, 500, factor=2.0 + r, phase="data", duration=20) for r in range(8, 14))
    stall = (Straggler(3, 900, factor=60.0, phase="data", duration=10),)
    sc = scenario("straggler_10pct_data_16", steps=1300, faults=hiccup + stall)
    _, anomalies = run_scenario(sc, kinds=KINDS)
    assert anomalies == [], [a.summary for a in anomalies]


def test_every_rank_of_a_node_waiting_longer_for_data_for_8_to_17_steps_is_not_a_straggler() -> None:
    """Node data hiccups (the node's disk or page cache): every rank of the node 3-9x for 8-17 steps, on
    each of the four nodes of a 32-rank run in turn. Before, 2-7 of the node's ranks were reported one by
    one as ~1.1x data stragglers, and sometimes the node as slow, when the hiccup filled a third to a half
    of their window."""
    for seed in (0, 1, 2):
        hiccups = tuple(NodeDataHiccup(n, 300 + 150 * n, 8 + 3 * n, 3.0 + 2 * n) for n in range(4))
        sc = scenario("clean_8", world_size=32, steps=1000, seed=seed, benign=hiccups)
        _, anomalies = run_scenario(sc, kinds=KINDS)
        assert anomalies == [], (seed, [a.summary for a in anomalies])


def test_local_rank_0_doing_more_data_work_from_the_start_is_its_normal() -> None:
    extra = tuple(Straggler(r, 1, factor=1.9, phase="data") for r in (0, 8))  # local rank 0 of each node
    sc = scenario("straggler_10pct_data_16", steps=1500, faults=extra)
    _, anomalies = run_scenario(sc, kinds=KINDS)
    assert anomalies == [], [a.summary for a in anomalies]


def test_a_straggler_on_top_of_its_own_slower_normal_is_still_found() -> None:
    """Rank 0 does 1.5x its peers' data work from the start (learnt as its normal); from step 600 its
    loader is 3x slower still."""
    sc = scenario(
        "straggler_10pct_data_16", steps=800,
        faults=(Straggler(0, 1, factor=1.5, phase="data"), Straggler(0, 600, factor=3.0, phase="data")),
    )  # fmt: skip
    _, anomalies = run_scenario(sc, kinds=KINDS)
    a = _only(anomalies, "straggler")
    assert a.rank == 0 and a.evidence["phase"] == "data" and 600 <= a.detected_step <= 650


def test_small_runs_blame_the_rank_slower_before_the_collective() -> None:
    """2 and 3 ranks: the peers' median is one or two ranks and their spread is the straggler itself."""
    for world_size, rank in ((2, 1), (3, 0)):
        sc = scenario(
            "straggler_10pct_data_16", world_size=world_size, steps=600, step_ms=12.5,
            faults=(Straggler(rank, 1, factor=80.0, phase="data"),),
        )  # fmt: skip
        _, anomalies = run_scenario(sc, kinds=KINDS)
        a = _only(anomalies, "straggler")
        assert a.rank == rank and a.evidence["phase"] == "data" and a.detected_step <= 160, world_size
    sc = scenario("straggler_10pct_data_16", world_size=2, steps=700, faults=(Straggler(0, 400, factor=1.3),))
    _, anomalies = run_scenario(sc, kinds=KINDS)
    a = _only(anomalies, "straggler")
    assert a.rank == 0 and a.evidence["phase"] == "forward" and a.detected_step <= 450


def test_a_straggler_whose_peer_does_more_data_work_by_design_is_still_found() -> None:
    """2 ranks; rank 0 does 1.6x the data work from the start (local rank 0 decoding for its node), so
    rank 1's own normal is well below its peer's. From step 500 rank 1's loader is 8x slower: slower than
    its peer in absolute terms too, and that is what the run waits for."""
    sc = scenario(
        "straggler_10pct_data_16", world_size=2, steps=800,
        faults=(Straggler(0, 1, factor=1.6, phase="data"), Straggler(1, 500, factor=8.0, phase="data")),
    )  # fmt: skip
    _, anomalies = run_scenario(sc, kinds=KINDS)
    a = _only(anomalies, "straggler")
    assert a.rank == 1 and a.evidence["phase"] == "data" and 500 <= a.detected_step <= 560, a.detected_step


def test_peers_waiting_in_forward_for_a_slow_loader_are_not_blamed() -> None:
    """Where forward holds a collective (DDP's buffer broadcast), the healthy rank of a 2-rank run waits
    there for the one whose loader is slow: its forward is long, but the slow rank is the other."""
    ctx = RunContext("r", 2)
    settings = EngineSettings(kinds=KINDS)
    dets = [cls(ctx, settings.settings_for(cls)) for cls in DETECTORS if cls.kind in KINDS]
    rng = np.random.default_rng(0)
    seen: dict[int, Anomaly] = {}
    for step in range(1, 401):
        noise = rng.normal(1.0, 0.02, (3, 2))
        data = np.array([0.5, 41.0]) * noise[0]
        forward = np.array([8.0 + 40.5, 8.0]) * noise[1]  # rank 0 waits for rank 1 inside forward
        backward = np.array([12.0, 12.0]) * noise[2]
        metrics = {"time.data_ms": data, "time.forward_ms": forward, "time.backward_ms": backward,
                   "time.step_ms": np.full(2, 62.0)}  # fmt: skip
        ctx.record_step_time(62.0)
        frame = StepFrame("r", step, 1e9 + step * 0.062, np.ones(2, dtype=bool), metrics)
        for d in dets:
            d.on_frame(frame)
        for a in ctx.book.drain_changes():
            seen.setdefault(a.local_id, a)
    found = list(seen.values())
    a = _only(found, "straggler")
    assert a.rank == 1 and a.evidence["phase"] == "data"


def test_a_gpu_5_percent_slower_from_the_first_step_is_its_normal_and_one_25_percent_slower_is_not() -> None:
    """GPUs differ by a few percent for good: one 5% slower in forward than its peers from the first
    step is learnt as its normal before it is judged (on the world's blind splits such a rank was a
    straggler at step 39-71, for the rest of the run). One 25% slower from the start is still found."""
    sc = scenario("straggler_10pct_fwd_64", steps=600, faults=(Straggler(17, 1, factor=1.05),))
    _, anomalies = run_scenario(sc, kinds=KINDS)
    assert anomalies == [], [a.summary for a in anomalies]
    sc = scenario("straggler_10pct_fwd_64", steps=600, faults=(Straggler(17, 1, factor=1.25),))
    _, anomalies = run_scenario(sc, kinds=KINDS)
    a = _only(anomalies, "straggler")
    assert a.rank == 17 and a.evidence["phase"] == "forward" and a.detected_step <= 120, a.detected_step


def test_a_loader_far_slower_in_a_tiny_data_phase_is_found_by_the_time_it_costs() -> None:
    """final3-008: 3 ranks of 2.4 s steps whose healthy data wait is ~0.5 ms (0.02% of the step); from
    step 600 rank 1 waits 700 ms more, a 1,000x ratio that costs the run ~29% of every step. The clipped
    mean (at most 1.25x) times the phase's share put its cost at 0.005% of the step, under the 0.2% bar:
    it was never reported."""
    sc = scenario(
        "straggler_10pct_data_16", world_size=3, steps=800, step_ms=2400.0, data_share=0.0002,
        faults=(Straggler(1, 600, factor=1.0, phase="data", extra_ms=700.0),),
    )  # fmt: skip
    _, anomalies = run_scenario(sc, kinds=KINDS)
    a = _only(anomalies, "straggler")
    assert a.rank == 1 and a.evidence["phase"] == "data" and 600 <= a.detected_step <= 650, a.detected_step


def _data_frames(rank_factor, ranks: int = 128, steps: int = 800, sigma: float = 0.15, seed: int = 0):  # type: ignore[no-untyped-def]
    """Feed frames of `ranks` ranks whose data wait (2% of a 1 s step) varies `sigma` a step (lognormal)
    to a fresh straggler detector; `rank_factor(step)` multiplies each rank's data wait (an array)."""
    rng = np.random.default_rng(seed)
    ctx = RunContext("r", ranks)
    ctx.node[:] = [f"gpu-{r // 8:03d}" for r in range(ranks)]
    cls = next(d for d in DETECTORS if d.kind == "straggler")
    det = cls(ctx, cls.Settings())
    seen: dict[int, Anomaly] = {}
    for step in range(1, steps + 1):
        data = 20.0 * np.exp(rng.normal(0.0, sigma, ranks)) * rank_factor(step)
        fwd = 300.0 * np.exp(rng.normal(0.0, 0.02, ranks))
        metrics = {"time.data_ms": data, "time.forward_ms": fwd, "time.step_ms": np.full(ranks, 1000.0)}
        ctx.record_step_time(1000.0)
        det.on_frame(StepFrame("r", step, 1e9 + step, np.ones(ranks, dtype=bool), metrics))
        for a in ctx.book.drain_changes():
            seen.setdefault(a.local_id, a)
    return list(seen.values())


def test_a_normal_learnt_from_a_lucky_window_does_not_make_a_straggler_later() -> None:
    """final4-007: 128 ranks whose data wait varies ~15% a step. Each rank's own data offset used to be
    the median of the last 40-step window of the learning steps, which is off by ~3% at that noise, so
    one rank in 128 learnt ~0.90x; at its usual pace it then read 1.1x slower than its normal, and was
    a straggler 300 steps later. Here rank 5 (3% slower by nature) also had 12% faster data for the
    last 30 learning steps (a warm page cache). The offset is now the mean of the window's median over
    all learning steps: nothing is reported. A real 1.3x data straggler in the same run still is."""
    for seed in (1, 3, 5):
        factor = np.ones(128)
        factor[5] = 1.03

        def lucky(step: int, f: np.ndarray = factor) -> np.ndarray:
            out = f.copy()
            if 80 <= step <= 110:
                out[5] *= 0.88
            return out

        anomalies = _data_frames(lucky, seed=seed)
        assert anomalies == [], (seed, [a.summary for a in anomalies])

    def slow_from_400(step: int) -> np.ndarray:
        out = np.ones(128)
        out[77] = 1.3 if step >= 400 else 1.0
        return out

    a = _only(_data_frames(slow_from_400, seed=1), "straggler")
    assert a.rank == 77 and a.evidence["phase"] == "data" and 400 <= a.detected_step <= 460, a.detected_step
