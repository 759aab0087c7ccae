"""divergence: a spike that does not recover, a sustained climb, or the loss non-finite on most ranks
for good; the loss_spike that started it resolves saying so. Quiet on clean runs and real logs."""

from __future__ import annotations

import numpy as np

from stepwatch_server.detect import StepFrame
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.detectors.divergence import DivergenceDetector, DivergenceSettings
from stepwatch_server.simulate import LossSpike
from tests.conftest import require
from tests.detect.helpers import run_scenario, scenario
from tests.detect.real_logs import DEEPSEEK, LLMC, SCALEUP_1B, run_csv

KINDS = ("loss_spike", "divergence")


def _of(found: list, kind: str) -> list:
    return [a for a in found if a.kind == kind]


def test_spike_that_stays_becomes_a_divergence() -> None:
    _, found = run_scenario(scenario("divergence_spike_32", world_size=16, steps=2200), kinds=KINDS)
    (div,) = _of(found, "divergence")
    assert (div.first_step, div.severity, div.status) == (1800, "critical", "open")
    assert div.detected_step <= 1800 + 60 and div.evidence["modes"] == ["no_recovery"]
    assert "roll back to a checkpoint before step 1800" in div.summary
    (spike,) = _of(found, "loss_spike")  # the warning first, then resolved into the divergence
    assert spike.first_step == 1800 and spike.status == "resolved"
    assert spike.evidence["resolution"] == "did not recover: reported as a divergence"


def test_upward_trend() -> None:
    _, found = run_scenario(scenario("divergence_trend_16", steps=1800), kinds=KINDS)
    (div,) = _of(found, "divergence")
    assert 1500 <= div.first_step <= 1560 and div.detected_step <= 1500 + 120
    assert _of(found, "loss_spike") == []  # a creeping loss is not a sudden spike


def test_nan_on_every_rank_for_good() -> None:
    _, found = run_scenario(scenario("divergence_nan_64", world_size=16, steps=2700), kinds=KINDS)
    (div,) = _of(found, "divergence")
    assert div.detected_step <= 2540 + 3 and "nonfinite" in div.evidence["modes"]
    assert div.evidence["nonfinite_ranks"] == 16


def test_a_recovered_spike_and_a_single_nan_are_not_divergence() -> None:
    _, found = run_scenario(scenario("loss_spike_8"), kinds=KINDS)  # 1.6x at 1500, back in 30 steps
    assert [(a.kind, a.first_step, a.status) for a in found] == [("loss_spike", 1500, "resolved")]
    _, found = run_scenario(scenario("nonfinite_act_8"), kinds=KINDS)
    assert found == []


def test_a_large_spike_that_takes_60_steps_to_come_back_is_a_spike_not_a_divergence() -> None:
    """2.8x, decaying for 60 steps: still 1.05-1.1x its old level after 50 steps, but coming back."""
    sc = scenario("loss_spike_8", faults=(LossSpike(1500, magnitude=2.8, recovery_steps=60),))
    _, found = run_scenario(sc, kinds=KINDS)
    assert [(a.kind, a.first_step) for a in found] == [("loss_spike", 1500)], [a.summary for a in found]


def test_a_nan_loss_on_one_of_two_ranks_for_three_steps_is_not_a_divergence() -> None:
    """A bad sample on one rank of two (its gradients skipped): `nonfinite`'s, not "the parameters are
    gone", which would be every rank's loss."""
    ctx = RunContext("t", 2)
    det = DivergenceDetector(ctx, DivergenceSettings())
    for step in range(1, 400):
        bad = 200 <= step < 203
        loss = np.array([np.nan if bad else 3.0, 3.0])
        flags = np.array([1.0 if bad else 0.0, 0.0])
        det.on_frame(
            StepFrame("t", step, 1e9 + step, np.ones(2, dtype=bool), {"loss": loss, "nonfinite.loss": flags})
        )
    assert [a.summary for a in ctx.book.drain_changes()] == []


def _frame(step: int, loss: float) -> StepFrame:
    return StepFrame("t", step, 1e9 + step, np.ones(1, dtype=bool), {"loss": np.array([loss])})


def test_slow_climb_in_a_noisy_loss_is_a_trend() -> None:
    """0.1%/step under 5% noise: never 6 SDs above a rolling baseline soon, but the quarters climb."""
    ctx = RunContext("t", 1)
    det = DivergenceDetector(ctx, DivergenceSettings())
    rng = np.random.default_rng(7)
    for step in range(1, 1600):
        level = 3.0 * (1.0 + 0.001 * max(0, step - 1000))
        det.on_frame(_frame(step, level * float(np.exp(rng.normal(0.0, 0.05)))))
    div = ctx.book.get("divergence", "run")
    assert div is not None and div.first_step >= 600 and "trend" in div.evidence["modes"]
    assert div.evidence["trend_rise"] >= 0.15


def test_clean_runs_and_real_logs_are_quiet() -> None:
    for sc in (scenario("clean_long_8", steps=8000), scenario("clean_8")):
        _, found = run_scenario(sc, kinds=("divergence",))
        assert found == [], sc.name
    for path in (LLMC, DEEPSEEK, SCALEUP_1B):
        require(path.exists(), f"real log {path}")
        assert run_csv(path, ("divergence",)) == [], path.name
