"""The Hugging Face Trainer with `StepwatchCallback()` (README "In a trainer"), for real: 2 processes of
`tests/e2e/trainer_ranks.py` (a tiny Llama from a config, DDP over gloo started by accelerate from the
launcher's environment, gradient accumulation 2, an evaluation every 10 steps) feed a real
`stepwatch-server serve` on loopback (SQLite).

A clean run must store every optimizer step once per rank with the loss the Trainer computes (the mean over
ranks equals the Trainer's own logged loss), the learning rate it logs, a grad norm and every phase timing;
each evaluation marked as a pause (a `phase_start` "evaluate" event on every rank, and the evaluation's time
kept out of the next step's data wait); and no anomaly. A NaN injected into one layer of one rank is a
`nonfinite` naming that rank, that step and that layer (the later all-rank one, once the Trainer has applied
the NaN gradients, blames no rank).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_module
from tests.e2e.accelerate_ranks import EVAL_STEPS as ACCELERATE_EVAL_STEPS
from tests.e2e.conftest import Collector
from tests.e2e.lightning_ranks import NAN_MODULE as LIGHTNING_NAN_MODULE
from tests.e2e.lightning_ranks import VAL_EVERY as LIGHTNING_VAL_EVERY
from tests.e2e.test_detection_real import anomalies, detection_idle, rank_processes, wait_finished
from tests.e2e.trainer_ranks import EVAL_STEPS, NAN_MODULE

require_module("torch")
require_module("transformers")
require_module("lightning")
require_module("stepwatch")

WORLD_SIZE = 2
DEADLINE_S = 200.0  # each rank exits by itself after this
WAIT_S = 180.0
EVAL_SLEEP_S = 0.15  # per eval batch: 16 items / 4 per batch / 2 ranks = 2 batches a rank, >= 0.3 s an eval


def launch(collector: Collector, tmp_path: Path, module: str, steps: int, **extra: float) -> str:
    """Run `module`'s ranks to their end against the collector; the run's name."""
    run = f"{module.rsplit('.', 1)[-1]}-{uuid.uuid4().hex[:8]}"
    args = ["--url", collector.url, "--run", run, "--steps", str(steps), "--deadline-s", str(DEADLINE_S)]
    args += ["--out", str(tmp_path), "--spool-dir", str(tmp_path / "spool")]
    for name, value in extra.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    with rank_processes(module, WORLD_SIZE, args, tmp_path) as procs:
        wait_finished(procs, tmp_path, WAIT_S)
    detection_idle(collector)
    return run


def train(collector: Collector, tmp_path: Path, steps: int, **extra: float) -> str:
    return launch(collector, tmp_path, "tests.e2e.trainer_ranks", steps, **extra)


def fit(collector: Collector, tmp_path: Path, steps: int, **extra: float) -> str:
    return launch(collector, tmp_path, "tests.e2e.lightning_ranks", steps, **extra)


def assert_the_nan_names(collector: Collector, run: str, rank: int, step: int, module: str) -> None:
    """The first non-finite finding blames `rank` at `step` in `module`; any later one (every rank, once
    the NaN gradients were applied) blames no rank."""
    found = [a for a in anomalies(collector, run) if a["kind"] == "nonfinite"]
    first = min(a["first_step"] for a in found)
    culprit = [a for a in found if a["first_step"] == first]
    assert len(culprit) == 1, found
    nan = culprit[0]
    assert (nan["rank"], nan["first_step"], nan["severity"]) == (rank, step, "critical"), nan
    assert nan["evidence"]["module"] == module, nan
    assert all(a["rank"] is None and a["first_step"] > step for a in found if a is not nan), found


def assert_pauses_and_nothing_else(
    collector: Collector, run: str, phase: str, every_n: int, steps: int
) -> None:
    """A pause `phase` marked on both ranks after every `every_n`-th step, none of it in the next step's data
    wait (each takes >= 2 x EVAL_SLEEP_S), and no anomaly at all."""
    events = collector.get(f"/api/v1/runs/{run}/events?kind=phase_start&limit=1000")["events"]
    marked = sorted((e["rank"], e["step"]) for e in events if e["data"]["phase"] == phase)
    marks = list(range(every_n, steps + 1, every_n))
    assert marked == [(rank, s) for rank in (0, 1) for s in marks], events
    data = series(collector, run, "time.data_ms")
    after = [s + 1 for s in marks if s < steps]
    assert all(data[rank][s] < 1000 * EVAL_SLEEP_S for rank in (0, 1) for s in after), data
    found = anomalies(collector, run)
    assert found == [], "\n".join(f"{a['kind']} rank {a['rank']}: {a['summary']}" for a in found)


def assert_each_step_holds_its_own_values(collector: Collector, run: str, tmp_path: Path, steps: int) -> None:
    """Every optimizer step once per rank with its timings, and the loss and grad norm the rank script read
    itself (DIR/rank-R.json) at that step."""
    every = list(range(1, steps + 1))
    for metric in ("loss", "grad_norm", "lr", "time.forward_ms", "time.backward_ms", "time.optimizer_ms"):
        values = series(collector, run, metric)
        assert {rank: sorted(v) for rank, v in values.items()} == {0: every, 1: every}, metric
    loss, norms = series(collector, run, "loss"), series(collector, run, "grad_norm")
    for rank in (0, 1):
        seen = {int(k): v for k, v in json.loads((tmp_path / f"rank-{rank}.json").read_text()).items()}
        assert sorted(seen) == every
        assert [loss[rank][s] for s in every] == pytest.approx([seen[s]["loss"] for s in every], rel=1e-5)
        norm = [seen[s]["grad_norm"] for s in every]
        assert [norms[rank][s] for s in every] == pytest.approx(norm, rel=1e-5)


def series(collector: Collector, run: str, metric: str) -> dict[int, dict[int, float]]:
    """rank -> step -> value."""
    body = collector.get(f"/api/v1/runs/{run}/series?metric={metric}&rank=all&max_points=20000")
    return {s["rank"]: dict(zip(s["steps"], s["values"], strict=True)) for s in body["series"]}


def test_a_trainer_run_is_recorded_step_by_step_with_the_trainers_loss_and_its_evaluations_as_pauses(
    collector: Collector, tmp_path: Path
) -> None:
    steps = 30
    run = train(collector, tmp_path, steps, eval_sleep_s=EVAL_SLEEP_S)
    every = list(range(1, steps + 1))

    loss = series(collector, run, "loss")
    assert {rank: sorted(by_step) for rank, by_step in loss.items()} == {0: every, 1: every}
    history: list[dict[str, Any]] = json.loads((tmp_path / "log_history.json").read_text())
    logged = {h["step"]: h for h in history if "loss" in h}
    assert sorted(logged) == every
    for step in every:  # the Trainer logs the mean over ranks of what each rank adds up
        mean = (loss[0][step] + loss[1][step]) / 2
        assert mean == pytest.approx(logged[step]["loss"], rel=1e-4), (step, mean, logged[step])
    lr = series(collector, run, "lr")
    for step in every:
        assert lr[0][step] == pytest.approx(logged[step]["learning_rate"], rel=1e-6), step
    for metric in ("grad_norm", "time.forward_ms", "time.backward_ms", "time.optimizer_ms", "time.step_ms"):
        values = series(collector, run, metric)
        assert {rank: sorted(v) for rank, v in values.items()} == {0: every, 1: every}, metric
    # The Trainer clips to 1.0 after measuring: its logged norm is the one before clipping, ours after.
    norms = series(collector, run, "grad_norm")
    assert all(0 < norms[0][s] <= 1.0 + 1e-4 for s in every), norms[0]

    assert_pauses_and_nothing_else(collector, run, "evaluate", EVAL_STEPS, steps)


def test_a_nan_in_one_layer_of_one_rank_under_the_trainer_is_nonfinite_naming_rank_step_and_layer(
    collector: Collector, tmp_path: Path
) -> None:
    run = train(collector, tmp_path, steps=16, nan_rank=1, nan_step=12)
    assert_the_nan_names(collector, run, rank=1, step=12, module=NAN_MODULE)


def test_a_lightning_fit_is_recorded_step_by_step_with_each_steps_own_loss_and_grad_norm(
    collector: Collector, tmp_path: Path
) -> None:
    steps = 30
    run = fit(collector, tmp_path, steps, val_sleep_s=EVAL_SLEEP_S)
    assert_each_step_holds_its_own_values(collector, run, tmp_path, steps)
    assert_pauses_and_nothing_else(collector, run, "validate", LIGHTNING_VAL_EVERY, steps)


def test_a_nan_in_one_layer_of_one_rank_under_lightning_is_nonfinite_naming_rank_step_and_layer(
    collector: Collector, tmp_path: Path
) -> None:
    run = fit(collector, tmp_path, steps=16, nan_rank=1, nan_step=12)
    assert_the_nan_names(collector, run, rank=1, step=12, module=LIGHTNING_NAN_MODULE)


def test_an_accelerate_loop_with_attach_after_prepare_is_recorded_once_per_optimizer_step(
    collector: Collector, tmp_path: Path
) -> None:
    """The prepared optimizer steps on every micro-batch and accelerate skips the real step between them: the
    agent watches the torch optimizer inside the wrapper (before, `attach()` raised on the wrapper)."""
    steps = 30
    run = launch(collector, tmp_path, "tests.e2e.accelerate_ranks", steps, eval_sleep_s=EVAL_SLEEP_S)
    assert_each_step_holds_its_own_values(collector, run, tmp_path, steps)
    assert_pauses_and_nothing_else(collector, run, "evaluate", ACCELERATE_EVAL_STEPS, steps)
    # accelerator.log runs on the main process only: its tracker gave rank 0's agent the numbers
    # accelerator.log runs on the main process only: its tracker gave rank 0's agent the numbers. A marked
    # pause hands the step before it over, so a value logged after the evaluation joins the next step; the
    # one after the last step has no step to join (not stored: a known limit, README "In a trainer").
    logged = series(collector, run, "eval_loss")
    assert {rank: sorted(v) for rank, v in logged.items()} == {0: [11, 21]}, logged


def test_a_nan_in_one_layer_of_one_rank_under_accelerate_is_nonfinite_naming_rank_step_and_layer(
    collector: Collector, tmp_path: Path
) -> None:
    run = launch(collector, tmp_path, "tests.e2e.accelerate_ranks", 16, nan_rank=1, nan_step=12)
    # attached to the prepared (DDP) model: its modules' names, as named_modules() gives them
    assert_the_nan_names(collector, run, rank=1, step=12, module=f"module.{NAN_MODULE}")
