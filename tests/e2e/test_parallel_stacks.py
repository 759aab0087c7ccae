"""The agent inside real parallel stacks: gloo ranks of a tiny block under FSDP2, HSDP, tensor parallel
and TP x FSDP2 (`tests/e2e/parallel_ranks.py`), attached with plain `stepwatch.attach(model, optimizer)`
(no layout option), feeding a real `stepwatch-server serve` on loopback (SQLite).

Each stack must: raise no anomaly of any kind over 200 steps (before, every FSDP2 run raised a critical
`replica_divergence` at its first fingerprint: its shards were compared as if they were replicas); report
the layout it read from the device mesh; and give, at `series?metric=grad_norm&rank=global`, the model's
gradient norm as the test computed it from the full gradients, within 1e-4 relative on every step. A
replica whose shard is perturbed is found and blamed.

Every rank process exits by itself at a deadline, and every wait here is bounded.
"""

from __future__ import annotations

import json
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_module
from tests.e2e.conftest import Collector
from tests.e2e.test_detection_real import anomalies, detection_idle, logs, rank_processes, wait_finished

require_module("torch")
require_module("stepwatch")

STEPS = 200
RANK_DEADLINE_S = 150.0
WAIT_S = 140.0
ROLLUP_WAIT_S = 10.0


def run_stack(
    collector: Collector, tmp_path: Path, stack: str, world_size: int, steps: int = STEPS, **extra: int
) -> tuple[str, dict[int, float]]:
    """Train `steps` under `stack` on `world_size` gloo ranks; (run name, the test's own norm per step).

    A rank killed by a signal inside torch (a segfault in gloo/DTensor on CPU: seen once in ~60 CI runs
    of these tests, in a thread with no Python frame) gets one fresh run, its fault handler's stacks
    shown as a warning; a second crash, or any other failure, fails the test."""
    for attempt in range(2):
        run, out, tries = (
            f"{stack}-{uuid.uuid4().hex[:8]}",
            tmp_path / "norms.json",
            tmp_path / f"try-{attempt}",
        )
        tries.mkdir()
        args = [
            "--url",
            collector.url,
            "--run",
            run,
            "--stack",
            stack,
            "--steps",
            str(steps),
            "--out",
            str(out),
        ]
        args += ["--deadline-s", str(RANK_DEADLINE_S), "--spool-dir", str(tries / "spool")]
        for name, value in extra.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        with rank_processes("tests.e2e.parallel_ranks", world_size, args, tries) as procs:
            try:
                wait_finished(procs, tries, WAIT_S)
                break
            except AssertionError:
                codes = [p.poll() for p in procs]
                if attempt or not any(c is not None and c < 0 for c in codes):
                    raise
                # Shown in pytest's summary, not raised: filterwarnings=error made the warning the failure.
                with warnings.catch_warnings():
                    warnings.simplefilter("default")
                    warnings.warn(
                        f"{stack}: a rank died by a signal {codes}; one new run\n{logs(tries)}", stacklevel=1
                    )
    for log in tries.glob("rank-*.log"):  # the assertions below read the last run's logs
        (tmp_path / log.name).write_bytes(log.read_bytes())
    detection_idle(collector)
    norms = {int(k): float(v) for k, v in json.loads(out.read_text())["norms"].items()}
    return run, norms


def global_norms(collector: Collector, run: str) -> dict[int, float]:
    body: Any = collector.get(f"/api/v1/runs/{run}/series?metric=grad_norm&rank=global&max_points=2000")
    (series,) = body["series"]
    return dict(zip(series["steps"], series["values"], strict=True))


def layout(collector: Collector, run: str) -> list[tuple[int, int, int]]:
    ranks = collector.get(f"/api/v1/runs/{run}/ranks")["ranks"]
    return sorted((r["replica_group"], r["shard"], r["num_shards"]) for r in ranks)


def assert_global_norm_is_the_models(collector: Collector, run: str, norms: dict[int, float]) -> None:
    """Within ROLLUP_WAIT_S: the rollups lag ingest by about a round (runs/rollups.py), so a step whose
    last shard arrived after the worker's latest round still holds the other shards only."""
    deadline = time.monotonic() + ROLLUP_WAIT_S
    while True:
        stored = global_norms(collector, run)
        worst = max((abs(stored[s] - n) / n for s, n in norms.items() if s in stored), default=float("inf"))
        if (sorted(stored) == sorted(norms) and worst < 1e-4) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(stored) == sorted(norms), (len(stored), len(norms))
    assert worst < 1e-4, worst


@pytest.mark.parametrize(
    ("stack", "world_size", "expected"),
    [
        ("fsdp2", 2, [(0, 0, 2), (0, 1, 2)]),  # one replica of 2 shards
        ("hsdp", 4, [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]),  # 2 replicas x 2 shards
        ("tp", 2, [(0, 0, 2), (0, 1, 2)]),
        ("tp_fsdp", 4, [(0, 0, 4), (0, 1, 4), (0, 2, 4), (0, 3, 4)]),  # tp x dp shards, one replica
        # Replicate() DTensors (fc2's bias) counted once; the LayerNorm's Partial gradients left out, said once
        ("tp_sp", 2, [(0, 0, 2), (0, 1, 2)]),
    ],
)
def test_each_stack_raises_nothing_reads_its_layout_and_stores_the_models_grad_norm(
    collector: Collector, tmp_path: Path, stack: str, world_size: int, expected: list[tuple[int, int, int]]
) -> None:
    run, norms = run_stack(collector, tmp_path, stack, world_size)
    found = anomalies(collector, run)
    assert found == [], [(a["kind"], a["summary"]) for a in found]
    assert layout(collector, run) == expected
    assert_global_norm_is_the_models(collector, run, norms)
    if stack == "fsdp2":  # the rank shard norms stay available
        per_rank = collector.get(f"/api/v1/runs/{run}/series?metric=grad_norm&rank=all")["series"]
        assert sorted(s["rank"] for s in per_rank) == [0, 1]
    if stack == "tp_sp":
        assert (
            "2 parameters have Partial gradients (norm.weight, norm.bias)"
            in (tmp_path / "rank-0.log").read_text()
        )
    assert (
        "no two ranks hold the same parameters" in (tmp_path / "rank-0.log").read_text() or stack == "hsdp"
    ), logs(tmp_path)


def test_a_perturbed_hsdp_replica_is_found_and_blamed(collector: Collector, tmp_path: Path) -> None:
    """6 ranks, 3 replicas x 2 shards: rank 3 (replica 1, shard 1) drifts after step 50; its shard's other
    replicas (ranks 1 and 5) agree, so the majority names rank 3 at the next fingerprint (step 60)."""
    run, _ = run_stack(
        collector, tmp_path, "hsdp", 6, steps=100, perturb_rank=3, perturb_step=50, fingerprint_every=20
    )
    found = anomalies(collector, run)
    assert [(a["kind"], a["rank"]) for a in found] == [("replica_divergence", 3)], [
        a["summary"] for a in found
    ]
    (a,) = found
    assert a["severity"] == "critical" and a["first_step"] == 60 and a["evidence"]["shard"] == 1
