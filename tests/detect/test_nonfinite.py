"""nonfinite: NaN/Inf found on the step itself, blamed on the rank(s) whose loss/activations went bad
(not on every rank whose gradients the all-reduce poisoned), naming the first module."""

from __future__ import annotations

import dataclasses

import numpy as np

from stepwatch_server.detect import Anomaly, StepFrame
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.detectors.nonfinite import NonFiniteDetector
from stepwatch_server.simulate import SCENARIOS, Simulation
from stepwatch_server.simulate.scenario import NonFinite
from stepwatch_server.simulate.score import Score, score_scenario
from tests.detect.helpers import run_scenario, scenario

KINDS = ("nonfinite",)


def _score(sim: Simulation, anomalies: list) -> Score:
    dets = [{**a.as_dict(), "detected_at_step": a.detected_step} for a in anomalies]
    return score_scenario(Score(), sim.scenario.name, sim.labels, dets, steps=sim.scenario.last_step)


def test_nan_in_one_layer_names_rank_and_module_on_the_step() -> None:
    sim, found = run_scenario(scenario("nonfinite_act_8"), kinds=KINDS)
    assert len(found) == 1
    a = found[0]
    assert (a.kind, a.rank, a.detected_step, a.severity) == ("nonfinite", 5, 1234, "critical")
    assert a.evidence["module"] == "layers.3.attn.qkv"
    assert a.evidence["grads_ranks"] == 8  # the all-reduce spread it; the blame stays on rank 5
    assert "rank 5" in a.summary and "layers.3.attn.qkv" in a.summary
    assert a.status == "resolved"
    ks = _score(sim, found).kinds["nonfinite"]
    assert ks.recall == 1.0 and ks.precision == 1.0 and ks.ttd_steps == [0]


def test_bad_sample_blames_its_rank_only() -> None:
    _, found = run_scenario(scenario("nonfinite_loss_64", steps=1000), kinds=KINDS)
    assert [(a.rank, a.detected_step) for a in found] == [(40, 777)]
    assert found[0].evidence["where"] == ["loss", "grads"]


def test_two_culprits_then_a_gradient_overflow_everywhere() -> None:
    sc = dataclasses.replace(
        SCENARIOS["nonfinite_multi_128"], world_size=16, steps=1100,
        faults=(NonFinite(600, ranks=(3, 11), module="lm_head"), NonFinite(900, where="grads")),
    )  # fmt: skip
    sim, found = run_scenario(sc, kinds=KINDS)
    culprits = sorted((a.rank, a.detected_step, a.evidence["module"]) for a in found if a.rank is not None)
    assert culprits == [(3, 600, "lm_head"), (11, 600, "lm_head")]
    run_wide = [a for a in found if a.rank is None]
    assert [(a.detected_step, a.evidence["where"]) for a in run_wide] == [(900, ["grads"])]
    assert run_wide[0].severity == "warning"  # one overflow step with a finite loss: AMP's routine skip
    s = _score(sim, found).kinds["nonfinite"]
    assert s.recall == 1.0 and s.fp == 0 and max(s.ttd_steps) == 0


def test_parameters_gone_is_one_run_wide_anomaly_that_stays_open() -> None:
    sim, found = run_scenario(scenario("divergence_nan_64", world_size=16, steps=2700), kinds=KINDS)
    assert len(found) == 1
    a = found[0]
    assert (a.rank, a.detected_step, a.status, a.severity) == (None, 2540, "open", "critical")
    assert a.evidence["module"] == "layers.0.attn.qkv"  # from the first step's event, kept while open
    assert "since step 2540" in a.summary
    assert _score(sim, found).kinds["nonfinite"].recall == 1.0


def test_clean_run_is_quiet() -> None:
    _, found = run_scenario(scenario("clean_8"), kinds=KINDS)
    assert found == []


def _scaler_run(skipped_steps: set[int], steps: int = 80, ranks: int = 4) -> list[Anomaly]:
    """A run whose grad scaler skipped `skipped_steps`: gradients Inf on every rank (after the
    all-reduce), the loss finite, `optimizer.skipped` = 1 (what the agent records for such a step)."""
    ctx = RunContext("r", ranks)
    det = NonFiniteDetector(ctx, NonFiniteDetector.Settings())
    seen: dict[int, Anomaly] = {}
    for step in range(1, steps + 1):
        skip = step in skipped_steps
        metrics = {
            "loss": np.full(ranks, 2.0),
            "grad_norm": np.full(ranks, np.inf if skip else 1.0),
            "nonfinite.loss": np.zeros(ranks),
            "nonfinite.activations": np.zeros(ranks),
            "nonfinite.grads": np.full(ranks, 1.0 if skip else 0.0),
        }
        if skip:
            metrics["optimizer.skipped"] = np.ones(ranks)
        det.on_frame(StepFrame("r", step, 1e9 + step, np.ones(ranks, dtype=bool), metrics))
        for a in ctx.book.drain_changes():
            seen.setdefault(a.local_id, a)
    return list(seen.values())


def test_a_step_the_grad_scaler_skips_now_and_then_is_no_anomaly() -> None:
    """fp16 dynamic loss scaling overflows by design now and then (the scale grows until it does): a skipped
    step with a finite loss is routine, not a NaN to look into (before: a warning each time)."""
    assert _scaler_run({10, 40, 41}) == []


def test_skips_in_a_row_are_a_collapsing_loss_scale_not_a_critical_nan() -> None:
    (a,) = _scaler_run(set(range(30, 36)))
    assert a.severity == "warning" and a.key == "run" and a.first_step == 32
    assert "loss scale" in a.summary and "skipped" in a.summary, a.summary
    assert a.evidence["skipped_steps"] >= 3


def test_a_snapshot_pickled_before_the_first_step_context_existed_still_detects() -> None:
    """The bus's snapshots (bus/worker.py) pickle the detectors; one stored by a worker of the previous
    version has no `_contexts`, and the detector restored from it must go on (and keep contexts anew)."""
    import pickle

    detector = NonFiniteDetector.__new__(NonFiniteDetector)
    detector.__dict__.update({"_modules": {}, "_steps": {}})
    restored = pickle.loads(pickle.dumps(detector))
    assert restored._contexts == {} and restored._modules == {}
