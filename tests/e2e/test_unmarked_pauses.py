"""Pauses nobody marked with `watch.phase`, with real processes: 4 gloo ranks of a tiny DDP model, each with
`stepwatch.attach(...)`, feed a real `stepwatch-server serve` on loopback (SQLite), and the anomaly API must
show no `hang`:

- an unmarked no_grad eval of 60 s in a 4-rank run is not a hang: every rank runs forwards of the DDP model
  under `torch.no_grad()` for 60 s between two steps (its heartbeats' no-grad forward count advances);
- an unmarked checkpoint: rank 0 spends 40 s inside `torch.save` (its heartbeats' stack shows the save call)
  while the others wait for it in `dist.barrier()`.

Both stalls are far beyond the hang threshold (28 s: the steps take ~20 ms), and before the agent reported
what the training thread does, both were hangs. A rank that stops stepping is still a hang blaming it
(`test_detection_real.py`). Every detector runs with its defaults; each rank process exits by itself at a
deadline and the test kills what is left.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_module
from tests.e2e.conftest import Collector
from tests.e2e.test_detection_real import anomalies, detection_idle, ranks, wait_finished

require_module("torch")
require_module("stepwatch")

pytestmark = pytest.mark.slow

EVAL_S = 60.0
CHECKPOINT_S = 40.0
PAUSE_STEP = 30  # the pause comes after step 29, before step 30
STEPS = 60
DEADLINE_S = 300.0  # each rank exits by itself after this: startup, 60 short steps and the pause, with margin
WAIT_S = 280.0  # the longest the test waits for its ranks to finish


def _run_with_pause(
    collector: Collector, tmp_path: Path, fault: str, pause_s: float
) -> tuple[str, list[dict[str, Any]]]:
    run = f"{fault}-{uuid.uuid4().hex[:8]}"
    with ranks(
        collector,
        tmp_path,
        run,
        fault,
        fault_rank=0,
        fault_step=PAUSE_STEP,
        steps=STEPS,
        deadline_s=DEADLINE_S,
        pause_s=pause_s,
    ) as procs:
        wait_finished(procs, tmp_path, wait_s=WAIT_S)
    detection_idle(collector)
    return run, anomalies(collector, run)


def _data_ms_at_pause(collector: Collector, run: str) -> dict[int, float]:
    """Each rank's data time of the step after the pause: the pause sits in it, as the agent measures."""
    path = f"/api/v1/runs/{run}/series?metric=time.data_ms&from_step={PAUSE_STEP}&to_step={PAUSE_STEP}"
    series = collector.get(path)["series"]
    return {s["rank"]: s["values"][0] for s in series if s["steps"] == [PAUSE_STEP]}


def _assert_paused_and_no_hang(
    collector: Collector, run: str, found: list[dict[str, Any]], pause_s: float
) -> None:
    """Every rank's step after the pause holds the pause in its data time, and no `hang` was raised."""
    paused = _data_ms_at_pause(collector, run)
    assert sorted(paused) == [0, 1, 2, 3] and min(paused.values()) >= 0.95 * pause_s * 1000, paused
    listed = "\n".join(f"{a['kind']} {a['severity']} {a['status']}: {a['summary']}" for a in found) or "none"
    assert [a for a in found if a["kind"] == "hang"] == [], f"anomalies of the run:\n{listed}"


def test_an_unmarked_no_grad_eval_of_60_s_in_a_4_rank_run_is_not_a_hang(
    collector: Collector, tmp_path: Path
) -> None:
    run, found = _run_with_pause(collector, tmp_path, "eval", EVAL_S)
    steps = collector.get(f"/api/v1/runs/{run}/ranks")["ranks"]
    assert [r["last_step"] for r in steps] == [STEPS] * 4, steps
    _assert_paused_and_no_hang(collector, run, found, EVAL_S)


def test_an_unmarked_checkpoint_on_rank_0_while_the_others_wait_in_barrier_is_not_a_hang(
    collector: Collector, tmp_path: Path
) -> None:
    run, found = _run_with_pause(collector, tmp_path, "checkpoint", CHECKPOINT_S)
    _assert_paused_and_no_hang(collector, run, found, CHECKPOINT_S)
