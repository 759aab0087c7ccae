"""The loss detectors on a run resumed from an earlier checkpoint: the steps after the checkpoint run
again, from the loss the run had then, which is higher than where it had got to (final3: three runs
resumed ~500-1,000 steps back were critical divergences, "roll back to a checkpoint", on the roll-back
itself). The windows go back to what they held at the checkpoint's step."""

from __future__ import annotations

from stepwatch_server.simulate import LossSpike, Scenario
from stepwatch_server.simulate.benign import Resume
from tests.detect.helpers import run_scenario

KINDS = ("loss_spike", "divergence")
RESUMED = Scenario(
    "resumed_far_back", world_size=4, steps=2600, seed=7, ckpt_every=1000, ckpt_s=20.0,
    benign=(Resume(step=1980, checkpoint_step=1000, gap_s=120.0),),
)  # fmt: skip


def test_a_run_resumed_1000_steps_back_is_neither_a_spike_nor_a_divergence() -> None:
    _, anomalies = run_scenario(RESUMED, kinds=KINDS)
    assert anomalies == [], [a.summary for a in anomalies]


def test_a_spike_after_the_resume_is_found_on_the_baseline_of_the_checkpoint() -> None:
    sc = Scenario(
        "resumed_then_spike", world_size=4, steps=2600, seed=7, ckpt_every=1000, ckpt_s=20.0,
        benign=(Resume(step=1980, checkpoint_step=1000, gap_s=120.0),),
        faults=(LossSpike(2010, magnitude=2.0, recovery_steps=10),),
    )  # fmt: skip
    _, anomalies = run_scenario(sc, kinds=KINDS)
    assert [(a.kind, a.first_step) for a in anomalies] == [("loss_spike", 2010)], [
        a.summary for a in anomalies
    ]


def test_a_window_rewinds_to_what_it_held_at_the_checkpoints_step() -> None:
    from stepwatch_server.detect.detectors.loss_spike import RobustWindow

    w = RobustWindow(100, keep=1024)
    for step in range(1, 1501):
        w.push(float(step), step)
    assert w.values().tolist() == [float(s) for s in range(1401, 1501)]
    w.rewind(1000)
    assert w.full and w.ordered().tolist() == [float(s) for s in range(901, 1001)]
    w.rewind(100)  # further back than it keeps: what is left of the run before that step
    assert w.n == 0
    plain = RobustWindow(5)
    for step in range(1, 9):
        plain.push(float(step), step)
    plain.rewind(6)
    assert sorted(plain.values().tolist()) == [4.0, 5.0, 6.0]
