"""`hang`: a run that stops stepping, blamed on the rank that did not reach the collective."""

from __future__ import annotations

import numpy as np
import pytest

from stepwatch_server.detect import Anomaly, DetectionEngine, EngineSettings
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.simulate import Hang, Simulation
from tests.detect.hand_batches import BARRIER_STACK, EVAL_STACK, SAVE_STACK, START_TS, TRAIN_STACK, HandRun
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
    assert 28.0 <= waited <= _deadline_s(sim), waited


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


# -- unmarked pauses, stalls of every rank together, restarts (hand-built batches) --------------------
def _summaries(run: HandRun) -> list[str]:
    return [f"{a.kind}/{a.key} {a.severity} {a.status}: {a.summary}" for a in run.anomalies]


def test_an_unmarked_eval_on_every_rank_is_not_a_hang() -> None:
    run = HandRun()
    run.train(1, 100)
    run.wait(120.0, nograd_per_beat=10, stack=EVAL_STACK)  # no_grad forwards of the watched model
    run.train(101, 20)
    assert run.anomalies == [], _summaries(run)


def test_a_rank_whose_heartbeat_says_it_finished_a_step_after_the_eval_ends_the_stall() -> None:
    """The rank that ends its eval first completes the next step; its heartbeat says so before the step's
    record arrives (the agent sends records at its flush cadence), and its no-grad forwards stop. That is
    progress, not a rank that stopped evaluating while the others are stuck (CI saw this as a hang)."""
    run = HandRun()
    run.train(1, 100)
    run.wait(50.0, nograd_per_beat=10, stack=EVAL_STACK)
    run.ranks[0].last_step, run.ranks[0].forwards = 101, run.ranks[0].forwards + 1
    run.wait(
        15.0,
        phase={0: "forward"} | dict.fromkeys((1, 2, 3), "data"),
        stack={0: TRAIN_STACK} | dict.fromkeys((1, 2, 3), EVAL_STACK),
        nograd_per_beat=dict.fromkeys((1, 2, 3), 10),
        every_s=1.0,
    )
    run.train(101, 20)
    assert run.anomalies == [], _summaries(run)


def test_one_rank_waiting_27_s_for_data_is_not_a_hang_and_one_stuck_is_found_by_30_s() -> None:
    """A slow shard read holds rank 1 in its data loader while the others wait in their all-reduce: a
    stalled step of 27 s, under the max(30 s, 5 steps) deadline, completes; a rank stuck there is a hang
    within that deadline."""
    loader = ("torch.utils.data.dataloader:_BaseDataLoaderIter.__next__", "train:main")
    run = HandRun()
    run.train(1, 100)
    phases = {1: "data"} | dict.fromkeys((0, 2, 3), "backward")
    run.wait(27.0, phase=phases, stack={1: loader}, every_s=1.25)
    run.train(101, 20)
    assert run.anomalies == [], _summaries(run)
    stuck_at = run.now
    run.wait(40.0, phase=phases, stack={1: loader}, every_s=1.25)
    (hang,) = run.hangs()
    assert hang.rank == 1 and 28.0 < hang.detected_ts - stuck_at <= 30.0, hang.detected_ts - stuck_at


def test_an_eval_that_ended_and_then_hung_is_a_hang_again() -> None:
    """No-grad forwards that stopped advancing (`busy_recent_s`) excuse nothing any more."""
    run = HandRun()
    run.train(1, 100)
    run.wait(60.0, nograd_per_beat=10, stack=EVAL_STACK)
    eval_end = run.now
    run.wait(60.0, phase={2: "data"} | dict.fromkeys((0, 1, 3), "backward"))
    (hang,) = run.hangs()
    assert hang.rank == 2 and hang.evidence["mode"] == "stuck", hang.summary
    assert hang.evidence["culprit_activity"] is None
    assert 25.0 < hang.detected_ts - eval_end <= 25.0 + 15.0 + 10.0, hang.detected_ts - eval_end


@pytest.mark.parametrize("others", ["barrier", "next all-reduce"])
def test_an_unmarked_checkpoint_on_rank_0_while_the_others_wait_is_not_a_hang(others: str) -> None:
    run = HandRun()
    run.train(1, 100)
    if others == "barrier":  # the others wait for rank 0 in dist.barrier(), all in phase "data"
        stacks = {0: SAVE_STACK} | dict.fromkeys((1, 2, 3), BARRIER_STACK)
        run.wait(120.0, stack=stacks)
    else:  # they went on to the next step and wait in its gradient all-reduce (phase "backward")
        run.wait(120.0, phase=dict.fromkeys((1, 2, 3), "backward"), stack={0: SAVE_STACK})
    run.train(101, 20)
    assert run.anomalies == [], _summaries(run)


def test_the_seconds_between_a_checkpoint_and_the_next_steps_arriving_are_not_a_stop() -> None:
    """The heartbeats show the save ended before the records of the next steps arrive (the agent sends
    them at its flush cadence): a look at the stall in that gap still sees the checkpoint (`busy_recent_s`)."""
    run = HandRun()
    run.train(1, 100)
    run.wait(55.0, stack={0: SAVE_STACK} | dict.fromkeys((1, 2, 3), BARRIER_STACK))  # looked at after 30 s
    run.wait(4.0, phase="backward", every_s=1.0, steps_per_beat=1)  # training again; records on their way
    run.train(101, 8)
    assert run.anomalies == [], _summaries(run)


def test_an_unmarked_checkpoint_longer_than_max_pause_s_is_a_hang_blaming_the_saver() -> None:
    run = HandRun(max_pause_s=100.0)
    run.train(1, 100)
    stalled_from = run.now
    run.wait(300.0, stack={0: SAVE_STACK} | dict.fromkeys((1, 2, 3), BARRIER_STACK))
    (hang,) = run.hangs()
    assert hang.rank == 0 and hang.status == "open", _summaries(run)
    assert hang.evidence["blamed_by"] == "collective" and hang.evidence["mode"] == "stuck"
    assert hang.evidence["culprit_activity"] == "checkpoint"
    assert hang.evidence["culprit_stack"][:2] == list(SAVE_STACK[:2])
    assert hang.evidence["unmarked_pause_s"] > 100.0
    assert 100.0 < hang.detected_ts - stalled_from <= 100.0 + 25.0 + 10.0
    assert "checkpoint" in hang.summary and "max_pause_s" in hang.summary
    assert "torch.distributed.distributed_c10d:barrier" in hang.summary
    run.train(101, 4)
    assert run.hangs()[0].status == "resolved"


def test_every_rank_stalled_together_is_one_warning_never_critical_resolved_by_the_next_step() -> None:
    """Between steps (phase data, nobody in a collective) with an agent that says nothing about what
    its thread does, the likeliest cause is an unmarked eval or checkpoint: nothing for 10 minutes
    (`together_idle_s`), then a warning that says so. Every rank inside the step's collective (all in
    backward, nobody behind) is reported after the usual threshold, also only as a warning."""
    run = HandRun()
    run.train(1, 100)
    run.wait(590.0, activity=False)
    assert run.hangs() == [], _summaries(run)
    run.wait(60.0, activity=False)
    (hang,) = run.hangs()
    assert len(run.anomalies) == 1, _summaries(run)
    assert hang.severity == "warning" and hang.rank is None, hang.summary  # far beyond 3 x the 28 s threshold
    assert hang.evidence["mode"] == "together" and hang.evidence["blamed_by"] == "none"
    assert hang.summary.startswith("every rank (4) stalled together after step 100 for ")
    assert "none is behind or dead, heartbeats arrive (an unmarked pause?)" in hang.summary
    assert hang.status == "open"
    run.train(101, 4)
    assert hang.status == "resolved" and hang.evidence["resolution"] == "steps advance again"

    run = HandRun()
    run.train(1, 100)
    stalled_at = run.now
    run.wait(200.0, phase="backward", activity=False)
    (hang,) = run.hangs()
    assert hang.severity == "warning" and hang.evidence["mode"] == "together", hang.summary
    assert hang.detected_ts - stalled_at < 40.0  # the usual 28 s threshold, not 10 minutes


def test_a_rank_ahead_of_the_others_is_not_their_culprit() -> None:
    """An unmarked pause of an agent that reports no activity: the ranks sit between steps (phase data),
    and one that finished it first has gone on into forward, where it waits for them. Being ahead
    blames nobody: it is the whole run paused together (nothing for 10 minutes, then a warning)."""
    run = HandRun()
    run.train(1, 100)
    run.wait(300.0, phase={2: "forward"}, activity=False)
    assert run.hangs() == [], _summaries(run)
    run.wait(320.0, phase={2: "forward"}, activity=False)
    (hang,) = run.hangs()
    assert hang.rank is None and hang.evidence["mode"] == "together" and hang.severity == "warning"


def test_the_end_of_a_pause_of_every_rank_is_not_a_hang_on_the_ranks_whose_heartbeat_is_older() -> None:
    """An unmarked 90 s eval of an agent that reports no activity: every rank between steps, together.
    When it ends, the ranks whose heartbeat came after the end say `forward` (they went on and wait in
    the next step for the others), those whose last heartbeat came before it still say `data`: for a few
    seconds a minority reads as behind. That is the pause ending, not a hang; a rank that is still in
    `data` one threshold after the others went on is one, blamed."""
    run = HandRun(world_size=16, step_s=1.0)
    run.train(1, 100)
    run.wait(90.0, activity=False)
    went_on = dict.fromkeys(range(10), "forward")
    run.wait(10.0, phase=went_on, activity=False)
    assert run.hangs() == [], _summaries(run)
    run.train(101, 8)
    assert run.anomalies == [], _summaries(run)

    run = HandRun(world_size=16, step_s=1.0)
    run.train(1, 100)
    run.wait(90.0, activity=False)
    run.wait(40.0, phase=went_on, activity=False)  # ranks 10-15 never come back from the pause
    (hang,) = run.hangs()
    assert hang.evidence["blamed_by"] == "phase" and hang.rank == 10 and hang.evidence["n_culprits"] == 6


def test_a_stuck_culprit_is_still_blamed_and_a_dead_one_even_while_others_evaluate() -> None:
    run = HandRun()
    run.train(1, 100)
    waiters = dict.fromkeys((0, 1, 3), "backward")
    run.wait(60.0, phase={2: "data"} | waiters, stack={2: ("train:slow_fetch", "train:main")})
    (hang,) = run.hangs()
    assert hang.rank == 2 and hang.evidence["mode"] == "stuck" and hang.evidence["blamed_by"] == "phase"
    assert hang.evidence["culprit_stack"] == ["train:slow_fetch", "train:main"]
    assert "at train:slow_fetch" in hang.summary

    run = HandRun()
    run.train(1, 100)
    run.wait(60.0, nograd_per_beat=10, stack=EVAL_STACK, silent=(3,))  # rank 3 died: its heartbeats stop
    (hang,) = run.hangs()
    assert hang.rank == 3 and hang.evidence["mode"] == "dead" and hang.severity == "critical"


def test_a_restart_gap_is_not_a_hang() -> None:
    """A resumed run: every rank silent for 90 s, then new agent sessions that load the checkpoint for
    40 s (heartbeats only) and repeat steps 81-100 before going on."""
    run = HandRun()
    run.train(1, 100)
    run.now += 90.0
    run.restart()
    run.wait(40.0)
    run.train(81, 60)
    assert run.anomalies == [], _summaries(run)
    ctx = run.engine.runs[run.run].ctx
    assert ctx.restart_ts == pytest.approx(START_TS + 100.0 + 90.0 + 5.0)


def test_a_rank_that_does_not_come_back_after_a_restart_is_dead() -> None:
    run = HandRun()
    run.train(1, 100)
    run.now += 90.0
    run.restart()
    run.wait(400.0, silent=(1,))  # rank 1's new session never starts (startup_s: 300 s after a restart)
    (hang,) = run.hangs()
    assert hang.rank == 1 and hang.evidence["mode"] == "dead", hang.summary
