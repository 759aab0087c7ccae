"""The whole path: simulator batches over HTTP -> ingest -> detection worker -> database -> read API;
and `stepwatch-server demo --inject nonfinite` as a user runs it."""

from __future__ import annotations

import gzip
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson

from stepwatch_server.simulate import NonFinite, Scenario, Simulation
from tests.detect.service_helpers import wait_detected
from tests.service.conftest import Collector

DEMO_TIMEOUT_S = 180


def test_a_fault_sent_over_http_appears_in_the_api(start_collector: Callable[..., Collector]) -> None:
    collector = start_collector()
    sc = Scenario(
        "pipeline_nonfinite", 4, 260, seed=11, faults=(NonFinite(200, ranks=(2,), module="layers.7.mlp.fc1"),)
    )
    run = None
    for doc in Simulation(sc):
        run = doc["run"]
        body = gzip.compress(orjson.dumps(doc), compresslevel=1)
        response = collector.post(
            body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
        )
        assert response.status_code == 200, response.text
    assert run is not None
    stats = wait_detected(collector)
    assert stats["errors"] == 0 and stats["dropped"] == 0
    found = collector.get(f"/api/v1/runs/{run}/anomalies", kind="nonfinite")["anomalies"]
    assert [(a["rank"], a["first_step"]) for a in found] == [(2, 200)], found
    assert "layers.7.mlp.fc1" in found[0]["summary"] and found[0]["severity"] == "critical"
    across = collector.get("/api/v1/anomalies", kind="nonfinite")["anomalies"]
    assert [a["run"] for a in across] == [run]
    others = [
        a for a in collector.get(f"/api/v1/runs/{run}/anomalies")["anomalies"] if a["kind"] != "nonfinite"
    ]
    assert others == [] or all(a["kind"] == "divergence" for a in others), others


def test_demo_inject_nonfinite_prints_the_anomaly(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "stepwatch_server.cli", "demo", "--inject", "nonfinite", "--steps", "1240"]
    cmd += ["--exit-when-done", "--port", "0", "--database-url", f"sqlite:///{tmp_path / 'demo.db'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    found = [line for line in lines if line.strip().startswith("nonfinite ")]
    assert len(found) == 1, done.stdout
    assert "rank 5" in found[0] and "layers.3.attn.qkv" in found[0] and "step 1234" in found[0]
    assert any(line.strip().endswith("/health") for line in lines)
    assert any(
        "/api/v1/runs/inject-nonfinite-" in line and line.strip().endswith("/anomalies") for line in lines
    )


def test_demo_inject_rejects_an_unknown_kind() -> None:
    cmd = [sys.executable, "-m", "stepwatch_server.cli", "demo", "--inject", "oom"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "invalid choice: 'oom'" in done.stderr and "memory_leak" in done.stderr


def test_a_runs_detection_state_pickled_mid_run_goes_on_as_if_never_interrupted() -> None:
    """The bus's workers hand a stream over as a pickle of its engine's runs (bus/worker.py): the state
    restored in another engine must go on exactly as the one that was never stopped, anomalies included
    (and the anomalies restored take local ids of their new process)."""
    import pickle

    from stepwatch_server.detect import DetectionEngine
    from stepwatch_server.ingest.validate import parse_batch
    from stepwatch_server.simulate import Straggler

    sc = Scenario(
        "pickled", 16, 500, seed=3,
        faults=(Straggler(5, 50, factor=2.0), NonFinite(400, ranks=(9,), module="layers.7.mlp.fc1")),
    )  # fmt: skip
    batches = [parse_batch(doc) for doc in Simulation(sc)]
    whole, first, resumed = DetectionEngine(), DetectionEngine(), DetectionEngine()
    seen_whole: list[tuple[str, int | None, int, str, str]] = []
    seen_split: list[tuple[str, int | None, int, str, str]] = []
    half = len(batches) // 2
    for i, batch in enumerate(batches):
        now = float(batch.timestamps[-1]) if batch.steps.size else 0.0
        seen_whole += [(a.kind, a.rank, a.first_step, a.status, a.severity) for a in whole.feed(batch, now)]
        engine = first if i < half else resumed
        if i == half:
            resumed.runs = pickle.loads(pickle.dumps(first.runs, protocol=pickle.HIGHEST_PROTOCOL))
        seen_split += [(a.kind, a.rank, a.first_step, a.status, a.severity) for a in engine.feed(batch, now)]
    assert {k for k, *_ in seen_whole} >= {"straggler", "nonfinite"}
    assert seen_split == seen_whole
    restored = [a.local_id for rd in resumed.runs.values() for a in rd.ctx.book.open.values()]
    original = [a.local_id for rd in first.runs.values() for a in rd.ctx.book.open.values()]
    assert restored and not set(restored) & set(original)
