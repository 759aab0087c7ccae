"""A run that declares the largest world size allowed but sends from only a few ranks costs what those
ranks sent, not what it declared.

A real `stepwatch-server serve` process on SQLite gets small batches from ranks 0-3 and rank 131,071 of
a run declaring 131,072 ranks, with step timings, memory, a loss, a sampled amax and a heartbeat (the
inputs the detectors, the health answer, the heatmaps and /metrics size their structures from). Then
every read that shows ranks is asked for: each answer is small and quick, and the collector's resident
memory (VmRSS of the child process) grows by little. Sized by the declared world size, the detection
state alone is ~1 GiB (the aligner's rings, 512 steps x 131,072 ranks per metric) and the health answer
lists 131,072 ranks.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tests.detect.service_helpers import T0
from tests.e2e.conftest import Collector, free_port

WORLD = 131_072  # ingest/validate.py MAX_WORLD_SIZE: the largest a batch may declare
SENDING = [0, 1, 2, 3, WORLD - 1]
STEPS = 40
MAX_ANSWER_BYTES = 100_000
MAX_ANSWER_S = 5.0
MAX_RSS_GROWTH_MIB = 50.0
DETECTION_WAIT_S = 60.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError(f"no VmRSS for pid {pid}")


def fetch(url: str) -> tuple[bytes, float]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as response:
        assert response.status == 200
        body = response.read()
    return body, time.perf_counter() - start


def post(url: str, doc: dict[str, Any]) -> None:
    request = urllib.request.Request(
        f"{url}/api/v1/ingest", data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200, response.read()


def rank_batch(run: str, rank: int, steps: list[int]) -> dict[str, Any]:
    slow = 1.5 if rank == WORLD - 1 else 1.0
    return {
        "schema": 1,
        "run": run,
        "session": uuid.uuid4().hex,
        "seq": 0,
        "rank": rank,
        "world_size": WORLD,
        "node": f"node-{rank // 2}",
        "steps": steps,
        "timestamps": [T0 + s for s in steps],
        "metrics": {
            "loss": [2.0 - 0.01 * s for s in steps],
            "time.data_ms": [10.0 * slow for _ in steps],
            "time.forward_ms": [30.0 * slow for _ in steps],
            "time.backward_ms": [50.0 for _ in steps],
            "time.step_ms": [100.0 for _ in steps],
            "mem.allocated_mb": [1000.0 + s for s in steps],
        },
        "tensors": {"steps": steps[::10], "stats": {"amax": {"layers.0.mlp": [3.0 for _ in steps[::10]]}}},
        "heartbeat": {"ts": T0 + steps[-1] + 0.5, "phase": "data", "last_step": steps[-1]},
    }


def test_a_declared_world_size_costs_only_the_ranks_that_sent(tmp_path: Path) -> None:
    collector = Collector(f"sqlite:///{tmp_path / 'stepwatch.db'}", free_port(), tmp_path / "c.log").start()
    try:
        assert collector.process is not None
        pid = collector.process.pid
        warm = f"warm-{uuid.uuid4().hex[:6]}"
        post(collector.url, rank_batch(warm, 0, [1, 2, 3]) | {"world_size": 1})  # imports, pools, caches
        fetch(f"{collector.url}/api/v1/runs/{warm}/health")
        fetch(f"{collector.url}/metrics")
        before = rss_mib(pid)
        run = f"declared-{uuid.uuid4().hex[:6]}"
        for rank in SENDING:
            post(collector.url, rank_batch(run, rank, list(range(1, STEPS + 1))))
        deadline = time.monotonic() + DETECTION_WAIT_S
        while True:
            stats = collector.get("/api/v1/detection")
            if stats["processed"] + stats["dropped"] >= stats["submitted"] and stats["queue_depth"] == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
        reads = {
            "health": f"/api/v1/runs/{run}/health",
            "ranks": f"/api/v1/runs/{run}/ranks",
            "run": f"/api/v1/runs/{run}",
            "series": f"/api/v1/runs/{run}/series?metric=time.forward_ms&rank=all",
            "mean": f"/api/v1/runs/{run}/series?metric=time.forward_ms&rank=mean",
            "heatmap": f"/api/v1/runs/{run}/heatmap?metric=time.forward_ms",
            "memory heatmap": f"/api/v1/runs/{run}/heatmap?metric=mem.allocated_mb&mode=absolute",
            "amax": f"/api/v1/runs/{run}/amax",
            "anomalies": f"/api/v1/runs/{run}/anomalies",
            "metrics": "/metrics",
        }
        answers, costs = {}, {}
        for name, path in reads.items():
            body, seconds = fetch(collector.url + path)
            answers[name], costs[name] = body, (len(body), round(seconds, 2))
        grown = rss_mib(pid) - before
        too_big = {k: c for k, c in costs.items() if c[0] >= MAX_ANSWER_BYTES or c[1] >= MAX_ANSWER_S}
        assert not too_big, f"(bytes, seconds) over the bars: {too_big}; RSS grew by {grown:.0f} MiB"
        assert grown < MAX_RSS_GROWTH_MIB, f"collector RSS grew by {grown:.0f} MiB; {costs}"

        health = json.loads(answers["health"])
        assert [r["rank"] for r in health["ranks"]] == SENDING  # the ranks heard from, not 131,072 rows
        assert health["ranks_missing"] == WORLD - len(SENDING)
        assert b'stepwatch_run_world_size{run="%s"} 131072.0' % run.encode() in answers["metrics"]
        heatmap = json.loads(answers["heatmap"])
        assert heatmap["ranks"] == SENDING
    finally:
        collector.stop()
