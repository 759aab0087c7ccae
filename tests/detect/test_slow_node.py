"""`slow_node`: most ranks of one node slow together, reported once for the node."""

from __future__ import annotations

from stepwatch_server.detect import EngineSettings
from stepwatch_server.detect.detectors._slowness import run_slowness_settings
from stepwatch_server.detect.detectors.slow_node import SlowNodeDetector, SlowNodeSettings
from stepwatch_server.detect.detectors.straggler import StragglerDetector, StragglerSettings
from stepwatch_server.detect.engine import RunDetection
from stepwatch_server.simulate import SlowNode, Straggler
from tests.detect.helpers import run_scenario, scenario

KINDS = ("straggler", "slow_node", "throughput_drop")


def test_seven_of_eight_slow_ranks_are_one_node_anomaly_and_no_stragglers() -> None:
    # The suite's slow_node_64 fault (node gpu-003 = ranks 24..31), earlier and on 32 ranks for speed.
    sc = scenario(
        "slow_node_64", world_size=32, steps=560, faults=(SlowNode(3, 480, factor=1.3, slow_ranks=7),)
    )
    sim, anomalies = run_scenario(sc, kinds=KINDS)
    assert [a.kind for a in anomalies] == ["slow_node"], [a.summary for a in anomalies]
    a = anomalies[0]
    (label,) = sim.labels
    assert a.key == "node:gpu-003" and a.node == "gpu-003" and a.rank is None
    assert 0 <= a.detected_step - label.first_step <= 50
    assert a.evidence["slow_ranks"] == list(range(24, 31)) and a.evidence["node_ranks"] == 8
    assert a.evidence["phase"] == "forward" and abs(a.evidence["ratio"] - 1.3) < 0.05
    assert a.summary.startswith("node gpu-003: 7 of its 8 ranks slow together in forward, 1.")


def test_a_recovered_node_resolves() -> None:
    sc = scenario(
        "slow_node_64", world_size=32, steps=1000, faults=(SlowNode(1, 500, factor=1.6, duration=300),)
    )
    _, anomalies = run_scenario(sc, kinds=KINDS)
    assert [a.kind for a in anomalies] == ["slow_node"], [a.summary for a in anomalies]
    a = anomalies[0]
    assert a.node == "gpu-001" and a.severity == "critical" and a.status == "resolved"
    assert a.resolved_step is not None and 800 <= a.resolved_step <= 950


def test_half_a_node_is_stragglers_not_a_slow_node() -> None:
    # 4 of 8 ranks is below the 75% that makes a node slow: each rank is reported, the node is not.
    sc = scenario(
        "slow_node_64", world_size=32, steps=600, faults=(SlowNode(1, 400, factor=1.4, slow_ranks=4),)
    )
    _, anomalies = run_scenario(sc, kinds=KINDS)
    assert sorted((a.kind, a.rank) for a in anomalies) == [("straggler", r) for r in range(8, 12)], [
        a.summary for a in anomalies
    ]


def test_without_slow_node_the_ranks_are_reported_one_by_one() -> None:
    sc = scenario("slow_node_64", world_size=32, steps=600, faults=(SlowNode(1, 400, factor=1.4),))
    _, anomalies = run_scenario(sc, kinds=("straggler",))
    assert sorted(a.rank for a in anomalies if a.rank is not None) == list(range(8, 16))


# straggler and slow_node with different windows: one computation of slowness still splits node from rank.
DIFFERENT_WINDOWS = {"straggler": {"window_steps": 20}, "slow_node": {"window_steps": 60, "confirm_steps": 6}}


def test_a_slow_node_is_one_slow_node_and_no_stragglers_whatever_each_detectors_window() -> None:
    sc = scenario("slow_node_64", world_size=32, steps=640, faults=(SlowNode(2, 480, factor=1.4),))
    _, anomalies = run_scenario(sc, kinds=KINDS, **DIFFERENT_WINDOWS)
    assert [(a.kind, a.key) for a in anomalies] == [("slow_node", "node:gpu-002")], [
        a.summary for a in anomalies
    ]


def test_one_slow_rank_is_a_straggler_only_whatever_each_detectors_window() -> None:
    sc = scenario("slow_node_64", world_size=32, steps=640, faults=(Straggler(19, 480, factor=1.4),))
    _, anomalies = run_scenario(sc, kinds=KINDS, **DIFFERENT_WINDOWS)
    assert [(a.kind, a.rank) for a in anomalies] == [("straggler", 19)], [a.summary for a in anomalies]


def test_the_run_has_one_slowness_from_both_detectors_overrides() -> None:
    overrides = {"straggler": {"window_steps": 20}, "slow_node": {"window_steps": 60, "node_fraction": 0.5}}
    chosen = {
        "straggler": StragglerSettings(window_steps=20),
        "slow_node": SlowNodeSettings(**overrides["slow_node"]),
    }
    shared, conflicts = run_slowness_settings(chosen, overrides)
    assert (shared.window_steps, shared.node_fraction) == (20, 0.5)  # each field from whoever set it
    assert conflicts == ["window_steps: slow_node 60, straggler 20 (used)"]
    rd = RunDetection("r", 16, EngineSettings(kinds=KINDS, overrides=overrides))
    trackers = {id(d.slowness) for d in rd.detectors if isinstance(d, StragglerDetector | SlowNodeDetector)}
    assert trackers == {id(rd.ctx.slowness)} and rd.ctx.slowness is not None
    assert rd.ctx.slowness.s == shared and rd.ctx.slowness.node_reporting
