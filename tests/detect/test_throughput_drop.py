"""`throughput_drop`: the whole run's step time rising well above its own baseline."""

from __future__ import annotations

from stepwatch_server.simulate import ThroughputDrop
from tests.conftest import require
from tests.detect.helpers import run_scenario, scenario
from tests.detect.real_logs import DEEPSEEK, LLMC, SCALEUP_1B, run_csv

KINDS = ("straggler", "slow_node", "throughput_drop")


def test_a_run_forty_percent_slower_is_one_run_anomaly() -> None:
    sc = scenario("throughput_drop_64", world_size=16, steps=720, faults=(ThroughputDrop(600, factor=1.4),))
    sim, anomalies = run_scenario(sc, kinds=KINDS)
    assert [a.kind for a in anomalies] == ["throughput_drop"], [a.summary for a in anomalies]
    a = anomalies[0]
    (label,) = sim.labels
    assert a.key == "run" and a.rank is None and a.node is None and a.status == "open"
    # Half of the 20-step window, 5 in a row, and at least a minute of event time (~560 ms steps).
    assert 60.0 <= a.detected_ts - label.first_ts <= 60.0 + 25 * 0.6
    assert abs(a.first_step - label.first_step) <= 5
    assert abs(a.evidence["ratio"] - 1.4) < 0.08 and a.severity == "warning"
    assert a.summary.startswith("run step time 1.") and "its baseline" in a.summary


def test_a_temporary_drop_resolves() -> None:
    sc = scenario(
        "throughput_drop_64",
        world_size=16,
        steps=1000,
        faults=(ThroughputDrop(500, factor=1.3, duration=300),),
    )
    _, anomalies = run_scenario(sc, kinds=KINDS)
    assert [a.kind for a in anomalies] == ["throughput_drop"], [a.summary for a in anomalies]
    a = anomalies[0]
    assert a.status == "resolved" and a.resolved_step is not None and 800 <= a.resolved_step <= 850


def test_a_few_seconds_of_contention_are_not_a_drop() -> None:
    """Short steps (~10 ms, as in the CPU demo): a co-scheduled burst slows the run 2x for 300 steps,
    ~6 s; under `min_duration_s` (60 s) that is a blip. The same 2x for 4,000 steps (~80 s) is a drop."""
    for duration, expected in ((300, []), (4000, ["throughput_drop"])):
        sc = scenario(
            "throughput_drop_64",
            world_size=8,
            steps=3000 + duration + 500,
            step_ms=10.0,
            eval_every=0,
            faults=(ThroughputDrop(3000, factor=2.0, duration=duration),),
        )
        _, anomalies = run_scenario(sc, kinds=KINDS)
        assert [a.kind for a in anomalies] == expected, (duration, [a.summary for a in anomalies])


def test_quiet_through_checkpoints_evals_and_storage_blips() -> None:
    # 240 s checkpoints among 4 s steps; evals; a slow-storage blip every 400 steps.
    for name, changes in (
        ("clean_slow_steps_16", {"steps": 1100, "ckpt_every": 400}),
        # Some rank pauses for GC on most steps: the raw step time is bimodal, the pace is not.
        ("clean_noisy_256", {"world_size": 64, "steps": 600, "gc_rate": 1 / 60}),
    ):
        _, anomalies = run_scenario(scenario(name, **changes), kinds=KINDS)
        assert anomalies == [], (name, [a.summary for a in anomalies])


def test_real_logs_the_deepseek_slow_stretch_and_nothing_else() -> None:
    for path in (DEEPSEEK, SCALEUP_1B, LLMC):
        require(path.exists(), f"real log {path.name} (../shared/real-logs)")
    # Megatron DeepSeek-V3 proxy: ~12.0 s iterations, eight isolated ~8x iterations (benign), and
    # steps ~29930-30640 at ~16.9 s (a real 40% slowdown of the whole job).
    (a,) = run_csv(DEEPSEEK, kinds=KINDS)
    assert a.kind == "throughput_drop" and a.status == "resolved"
    assert 29900 <= a.first_step <= 29990 and a.detected_step <= 30050
    assert a.resolved_step is not None and 30640 <= a.resolved_step <= 30900
    assert a.evidence["peak_ratio"] > 1.35
    # modded-nanogpt 1.5B: ~1.7 s steps with slow iterations up to 2.3x: nothing.
    assert run_csv(SCALEUP_1B, kinds=KINDS) == []
