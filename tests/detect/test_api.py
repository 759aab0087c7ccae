"""The detection read API on a real collector: anomalies per run and across runs, filters, errors,
health verdicts, worker stats (SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from stepwatch_server.detect import AnomalyBook
from stepwatch_server.detect.store import save_anomalies
from stepwatch_server.storage import make_engine
from tests.detect.service_helpers import batch, session, wait_detected
from tests.service.conftest import Collector


@pytest.fixture
def seeded(start_collector: Callable[..., Collector]) -> Iterator[Collector]:
    """Two runs (4 ranks on nodes gpu-0/gpu-1; 2 ranks) and a hand-made set of anomalies."""
    collector = start_collector()
    for rank in range(4):
        doc = batch("train/a", session(), 0, rank, 4, [0, 1], node=f"gpu-{rank // 2}", loss=[1.0, 1.0])
        assert collector.post(doc).status_code == 200
    for rank in range(2):
        assert collector.post(batch("b", session(), 0, rank, 2, [0], loss=[1.0])).status_code == 200
    wait_detected(collector)
    a, b = AnomalyBook("train/a"), AnomalyBook("b")
    a.raise_("straggler", "rank:1", step=10, ts=1010.0, severity="critical", summary="rank 1 slow",
             evidence={"ratio": float("nan")}, rank=1, node="gpu-0")  # fmt: skip
    a.raise_("slow_node", "node:gpu-1", step=12, ts=1012.0, severity="warning", summary="gpu-1 slow",
             evidence={}, node="gpu-1")  # fmt: skip
    a.raise_("throughput_drop", "run", step=20, ts=1020.0, severity="info", summary="run slower", evidence={})
    a.raise_("loss_spike", "run", step=5, ts=1005.0, severity="warning", summary="spike", evidence={})
    a.resolve("loss_spike", "run", step=8, ts=1008.0)
    b.raise_("hang", "run", step=3, ts=1003.0, severity="critical", summary="b hangs", evidence={}, rank=0)
    engine = make_engine(collector.database_url)
    save_anomalies(engine, a.drain_changes() + b.drain_changes())
    engine.dispose()
    yield collector


def get(collector: Collector, path: str, code: int = 200, **params: Any) -> Any:
    response = collector.http.get(path, params=params)
    assert response.status_code == code, response.text
    return response.json()


def test_run_anomalies_and_filters(seeded: Collector) -> None:
    body = get(seeded, "/api/v1/runs/train/a/anomalies")
    assert body["run"] == "train/a"
    kinds = [a["kind"] for a in body["anomalies"]]
    assert kinds == ["throughput_drop", "slow_node", "straggler", "loss_spike"]  # most recent first
    straggler = body["anomalies"][2]
    # the profile the detection asked of the straggler and a peer when it opened (commands/at_verdicts.py)
    assert [c["kind"] for c in straggler.pop("commands")] == ["profile"]
    assert straggler | {"id": 0, "created_at": "", "updated_at": ""} == {
        "id": 0, "run": "train/a", "kind": "straggler", "key": "rank:1", "status": "open",
        "severity": "critical", "rank": 1, "node": "gpu-0", "first_step": 10, "last_step": 10,
        "detected_step": 10, "detected_ts": 1010.0, "first_ts": 1010.0, "last_ts": 1010.0,
        "resolved_step": None, "resolved_ts": None, "summary": "rank 1 slow", "evidence": {"ratio": "NaN"},
        "created_at": "", "updated_at": "",
    }  # fmt: skip
    assert straggler["created_at"].endswith("+00:00")
    open_ = get(seeded, "/api/v1/runs/train/a/anomalies", status="open")["anomalies"]
    assert sorted(a["kind"] for a in open_) == ["slow_node", "straggler", "throughput_drop"]
    resolved = get(seeded, "/api/v1/runs/train/a/anomalies", status="resolved")["anomalies"]
    assert [(a["kind"], a["resolved_step"]) for a in resolved] == [("loss_spike", 8)]
    assert [
        a["key"] for a in get(seeded, "/api/v1/runs/train/a/anomalies", kind="slow_node")["anomalies"]
    ] == ["node:gpu-1"]
    assert get(seeded, "/api/v1/runs/train/a/anomalies", kind="hang")["anomalies"] == []


def test_errors_name_the_value(seeded: Collector) -> None:
    err = get(seeded, "/api/v1/runs/nope/anomalies", 404)["error"]
    assert err["code"] == "not_found" and "nope" in err["message"]
    assert get(seeded, "/api/v1/runs/nope/health", 404)["error"]["field"] == "run"
    for path in ("/api/v1/runs/b/anomalies", "/api/v1/anomalies"):
        err = get(seeded, path, 422, status="opened")["error"]
        assert (err["field"], err["code"]) == ("status", "invalid_parameter")
        assert "'opened'" in err["message"] and "open" in err["message"]
        err = get(seeded, path, 422, kind="oom")["error"]
        assert err["field"] == "kind" and "'oom'" in err["message"] and "memory_leak" in err["message"]


def test_anomalies_across_runs(seeded: Collector) -> None:
    open_ = get(seeded, "/api/v1/anomalies", status="open")["anomalies"]
    assert sorted((a["run"], a["kind"]) for a in open_) == [
        ("b", "hang"), ("train/a", "slow_node"), ("train/a", "straggler"), ("train/a", "throughput_drop"),
    ]  # fmt: skip
    assert len(get(seeded, "/api/v1/anomalies")["anomalies"]) == 5
    assert [a["run"] for a in get(seeded, "/api/v1/anomalies", kind="hang")["anomalies"]] == ["b"]
    assert len(get(seeded, "/api/v1/anomalies", limit=2)["anomalies"]) == 2


def test_health_verdicts(seeded: Collector) -> None:
    h = get(seeded, "/api/v1/runs/train/a/health")
    assert (h["run"], h["verdict"], h["open"]) == ("train/a", "critical", 3)
    assert sorted(r["summary"] for r in h["reasons"]) == ["gpu-1 slow", "rank 1 slow", "run slower"]
    ranks = {r["rank"]: r for r in h["ranks"]}
    assert [(r, ranks[r]["node"], ranks[r]["verdict"]) for r in range(4)] == [
        (0, "gpu-0", "ok"), (1, "gpu-0", "critical"), (2, "gpu-1", "warning"), (3, "gpu-1", "warning"),
    ]  # fmt: skip
    assert [x["summary"] for x in ranks[1]["reasons"]] == ["rank 1 slow"]
    assert [x["summary"] for x in ranks[2]["reasons"]] == ["gpu-1 slow"]  # node-level: each of its ranks
    assert ranks[0]["reasons"] == []  # the run-level info anomaly is the run's, not a rank's

    b = get(seeded, "/api/v1/runs/b/health")
    assert b["verdict"] == "critical" and [r["verdict"] for r in b["ranks"]] == ["critical", "ok"]


def test_health_of_a_run_without_anomalies_and_info_only(start_collector: Callable[..., Collector]) -> None:
    collector = start_collector()
    assert collector.post(batch("quiet", session(), 0, 0, 1, [0], loss=[1.0])).status_code == 200
    h = get(collector, "/api/v1/runs/quiet/health")
    assert (h["verdict"], h["reasons"], [r["verdict"] for r in h["ranks"]]) == ("ok", [], ["ok"])
    book = AnomalyBook("quiet")
    book.raise_(
        "memory_leak", "rank:0", step=0, ts=1.0, severity="info", summary="creeping", evidence={}, rank=0
    )
    engine = make_engine(collector.database_url)
    save_anomalies(engine, book.drain_changes())
    engine.dispose()
    h = get(collector, "/api/v1/runs/quiet/health")
    assert h["verdict"] == "ok" and [r["summary"] for r in h["reasons"]] == ["creeping"]


def test_detection_stats_and_switch(start_collector: Callable[..., Collector]) -> None:
    on = start_collector()
    assert on.post(batch("s", session(), 0, 0, 1, [0, 1], loss=[1.0, 1.0])).status_code == 200
    stats = wait_detected(on)
    assert stats["enabled"] is True and stats["submitted"] == stats["processed"] == 1
    assert stats["dropped"] == 0 and stats["errors"] == 0 and stats["lag_samples"] == 1
    assert 0 <= stats["lag_ms"]["p50"] <= stats["lag_ms"]["p99"] < 5000
    doc = batch("s", session(), 0, 0, 1, [2], loss=[1.0])
    assert on.post(doc).status_code == 200
    assert on.post(doc).json()["duplicates"] == 1  # a duplicate is not fed again
    assert wait_detected(on)["submitted"] == 2

    off = start_collector(detection=False)
    assert off.get("/api/v1/detection") == {"enabled": False}
    assert off.post(batch("t", session(), 0, 0, 1, [0], loss=[1.0])).status_code == 200
    assert off.get("/api/v1/runs/t/anomalies")["anomalies"] == []
