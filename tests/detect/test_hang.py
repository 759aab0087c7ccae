"""`hang`: a run that stops stepping, blamed on the rank that did not reach the collective."""

from __future__ import annotations

import numpy as np

from stepwatch_server.detect import Anomaly, DetectionEngine, EngineSettings
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.simulate import Hang, Simulation
from tests.detect.helpers import run_scenario, scenario

KINDS = ("hang",)


def _deadline_s(sim: Simulation) -> float:
    """The issue's time-to-detect: max(30 s, 5x the median step time)."""
    step_s = float(np.nanmedian(np.diff(sim.step_ts[1:])))
    return max(30.0, 5.0 * step_s)


def _one_hang(name: str, **changes: object) -> tuple[Simulation, Anomaly]:
    sim, anomalies = run_scenario(scenario(name, **changes), kinds=KINDS)
    hangs = [a for a in anomalies if a.kind == "hang"]
    assert len(hangs) == 1, [a.summary for a in anomalies]
    return sim, hangs[0]


def test_stuck_rank_is_blamed_within_the_deadline() -> None:
    sim, a = _one_hang("hang_stuck_32", steps=500, faults=(Hang(9, 400, mode="stuck", phase="data"),))
    (label,) = sim.labels
    assert a.rank == 9 and a.node == "gpu-001"
    assert a.evidence["mode"] == "stuck" and a.evidence["culprit_phase"] == "data"
    assert a.evidence["majority_phase"] == "backward"
    assert label.first_ts is not None and 0 < a.detected_ts - label.first_ts <= _deadline_s(sim)
    assert "stuck" in a.summary and "rank 9" in a.summary


def test_dead_rank_is_blamed_and_called_dead() -> None:
    sim, a = _one_hang("hang_dead_256", world_size=64, steps=400, faults=(Hang(50, 300, mode="dead"),))
    (label,) = sim.labels
    assert a.rank == 50 and a.evidence["mode"] == "dead" and a.severity == "critical"
    assert label.first_ts is not None and a.detected_ts - label.first_ts <= _deadline_s(sim)
    assert a.evidence["heartbeat_lag_s"] > 15


def test_slow_steps_wait_for_the_floor_not_for_five_steps() -> None:
    sim, a = _one_hang("hang_slow_steps_16")
    (label,) = sim.labels
    assert a.rank == 3 and a.evidence["mode"] == "stuck" and label.first_ts is not None
    waited = a.detected_ts - label.first_ts
    assert 25.0 <= waited <= _deadline_s(sim), waited


def test_quiet_through_evals_checkpoints_and_slow_steps() -> None:
    # A 240 s checkpoint among 4 s steps (with storage blips of up to 5 steps), and a 40 s eval.
    for name, changes in (
        ("clean_slow_steps_16", {"steps": 420, "ckpt_every": 300}),
        ("clean_8", {"steps": 1100}),
    ):
        _, anomalies = run_scenario(scenario(name, **changes), kinds=KINDS)
        assert anomalies == [], (name, [a.summary for a in anomalies])


def test_silence_is_the_one_wall_clock_case() -> None:
    engine = DetectionEngine(EngineSettings(kinds=KINDS))
    docs = iter(Simulation(scenario("clean_8", steps=200)))
    wall = 1_000.0
    for _, doc in zip(range(40), docs, strict=False):
        engine.feed(parse_batch(doc), wall_now=wall)
    assert engine.tick(wall_now=wall + 200.0) == []
    (silent,) = engine.tick(wall_now=wall + 400.0)
    assert silent.kind == "hang" and silent.key == "silent" and silent.rank is None
    assert "nothing from any of its 8 ranks since" in silent.summary
    changed = engine.feed(parse_batch(next(docs)), wall_now=wall + 401.0)
    assert [(a.key, a.status) for a in changed] == [("silent", "resolved")]


def test_a_run_whose_ranks_all_closed_is_finished_not_silent() -> None:
    """The agent's close() sends a session_end event; once every rank has, silence is not a hang."""
    engine = DetectionEngine(EngineSettings(kinds=KINDS))
    sc = scenario("clean_8", steps=200)
    docs = list(Simulation(sc))
    wall = 1_000.0
    for doc in docs:
        engine.feed(parse_batch(doc), wall_now=wall)
    last_by_rank = {doc["rank"]: doc for doc in docs if doc["steps"]}
    for rank, doc in sorted(last_by_rank.items()):
        assert engine.tick(wall_now=wall) == []
        end = {"step": doc["steps"][-1], "ts": doc["timestamps"][-1], "kind": "session_end", "data": {}}
        closing = {**doc, "seq": doc["seq"] + 10_000, "steps": [], "timestamps": [], "metrics": {},
                   "tensors": {"steps": [], "stats": {}}, "fingerprints": {"steps": [], "values": []},
                   "events": [end]}  # fmt: skip
        closing.pop("heartbeat", None)
        engine.feed(parse_batch(closing), wall_now=wall)
        if rank < sc.world_size - 1:  # not every rank closed yet: silence would still be reported
            assert engine.runs[docs[0]["run"]].ctx.finished() is False
    assert engine.runs[docs[0]["run"]].ctx.finished() is True
    assert engine.tick(wall_now=wall + 10_000.0) == []
