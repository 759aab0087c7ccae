"""The dashboard's read model and serving, against a real collector on SQLite and PostgreSQL: the runs
overview (verdict, step rate), the heatmap relative to the cross-rank median, amax as max over ranks,
the event stream (a new step arrives; the stream ends when the server stops), and the page that says
how to build the front end when it is missing."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stepwatch_server.runs import rank_rollups
from stepwatch_server.web import pages
from tests.detect.service_helpers import batch, session, wait_detected
from tests.service.conftest import Collector, listen_events

STREAM_WAIT_S = 20.0


def _run(collector: Collector, name: str, ranks: int, steps: int, slow_rank: int | None = None) -> None:
    """`ranks` ranks of `steps` steps, one step per second; `slow_rank` 1.3x slower in forward."""
    for rank in range(ranks):
        s = list(range(1, steps + 1))
        forward = [130.0 if rank == slow_rank else 100.0 + (rank % 3) for _ in s]
        amax = {f"layers.{i}": [float(rank + i + step % 5) for step in s] for i in range(2)}
        doc = batch(name, session(), 0, rank, ranks, s, **{"time.forward_ms": forward, "loss": [2.0] * steps})
        doc["tensors"] = {"steps": s, "stats": {"amax": amax}}
        response = collector.post(doc)
        assert response.status_code == 200, response.text


def test_overview_heatmap_and_amax(collector: Collector) -> None:
    _run(collector, "dash", ranks=8, steps=40, slow_rank=5)
    wait_detected(collector)
    collector.wait_rolled_up()  # ranks 2..7 may be late for steps the worker rolled up with ranks 0..1
    row = next(r for r in collector.get("/api/v1/dashboard/runs")["runs"] if r["name"] == "dash")
    assert row["world_size"] == 8 and row["last_step"] == 40 and row["ranks"] == 8
    assert row["step_rate"] == pytest.approx(1.0)  # the batches' timestamps: one step per second
    assert row["verdict"] in {"ok", "warning", "critical"} and row["open_anomalies"] >= 0

    heat = collector.get("/api/v1/runs/dash/heatmap", metric="time.forward_ms", buckets=4)
    assert heat["ranks"] == list(range(8)) and heat["steps"] == [1, 11, 21, 31] and heat["bucket_steps"] == 10
    assert all(v == pytest.approx(1.3 / 1.01, rel=0.02) for v in heat["values"][5])  # the slow rank's row
    assert all(0.95 < v < 1.05 for r in (0, 1, 2, 3, 4, 6, 7) for v in heat["values"][r])

    absolute = collector.get(
        "/api/v1/runs/dash/heatmap", metric="time.forward_ms", buckets=4, mode="absolute"
    )
    assert absolute["values"][5] == [130.0] * 4

    amax = collector.get("/api/v1/runs/dash/amax")
    assert amax["e4m3_max"] == 448.0
    by_name = {m["name"]: m for m in amax["modules"]}
    assert by_name["layers.1"]["values"][0] == 7 + 1 + 1  # max over ranks: rank 7, module 1, step 1
    assert by_name["layers.0"]["latest"] == 7 + 0 + 40 % 5
    grouped = collector.get("/api/v1/runs/dash/amax", max_points=4)  # 40 steps in groups of 20
    layer0 = next(m for m in grouped["modules"] if m["name"] == "layers.0")
    assert layer0["steps"] == [1, 21] and layer0["values"] == [7 + 0 + 4] * 2  # each group's peak
    assert layer0["latest"] == 7 + 0 + 40 % 5  # the last step's, not the last group's maximum


def test_a_run_whose_every_rank_closed_its_session_is_finished_with_its_duration(
    collector: Collector,
) -> None:
    """A finished run looked live ("117 steps/s" 16 minutes after it ended): once every rank's agent has
    said session_end after its last step, the overview says finished, and for how long it ran."""
    sessions = [session() for _ in range(2)]
    started = time.monotonic()
    for rank, sid in enumerate(sessions):
        doc = batch("done", sid, 0, rank, 2, list(range(1, 31)), loss=[2.0] * 30)
        assert collector.post(doc).status_code == 200

    def row() -> dict[str, Any]:
        return next(r for r in collector.get("/api/v1/dashboard/runs")["runs"] if r["name"] == "done")

    assert row()["finished"] is False and row()["duration_s"] is None
    end = {"step": 30, "ts": 1_764_427_231.0, "kind": "session_end", "data": {"reason": "close"}}
    first = batch("done", sessions[0], 1, 0, 2, [])
    assert collector.post({**first, "events": [end]}).status_code == 200
    assert row()["finished"] is False  # one rank of two: still running
    last = batch("done", sessions[1], 1, 1, 2, [])
    assert collector.post({**last, "events": [end]}).status_code == 200
    took = time.monotonic() - started
    done = row()
    assert done["finished"] is True and done["live"] is False
    assert 0 <= done["duration_s"] <= took + 1.0  # from its first batch to its last, on the collector's clock
    more = batch("done", sessions[0], 2, 0, 2, [31], loss=[2.0])  # a step after the end: running again
    assert collector.post(more).status_code == 200
    assert row()["finished"] is False


def test_amax_latest_says_nan_when_the_last_sample_was_nan(collector: Collector) -> None:
    """After a NaN the panel read "critical - overflows FP8" with no value: `latest` went out as null."""
    steps = [1, 2, 3]
    for rank, last in enumerate(["NaN", 5.0]):
        doc = batch("nan-amax", session(), 0, rank, 2, steps, loss=[2.0] * 3)
        doc["tensors"] = {"steps": steps, "stats": {"amax": {"fc": [1.0, 2.0, last], "ok": [1.0, 1.0, 1.0]}}}
        assert collector.post(doc).status_code == 200
    modules = {m["name"]: m for m in collector.get("/api/v1/runs/nan-amax/amax")["modules"]}
    assert modules["fc"]["latest"] == "NaN" and modules["ok"]["latest"] == 1.0


def test_amax_top_gives_the_modules_nearest_the_fp8_limit_in_the_range(collector: Collector) -> None:
    """A 70-layer model tracks ~500 modules: `top=K` gives the K with the highest amax (max over ranks and
    the range's steps), a module with a non-finite one first, so that the panel draws those, not 500
    lines. A spike in the run ranks its module for a range holding it and not for one before or after it; the
    run is long enough (600 steps) that the ranking reads whole buckets of the rank rollup levels."""
    steps = list(range(1, 601))
    level = {f"blocks.{i:02d}": 10.0 + i for i in range(12)}  # blocks.11 the highest, then .10, .09
    for rank in range(2):
        stats: dict[str, list[Any]] = {name: [v + rank for _ in steps] for name, v in level.items()}
        stats["blocks.03"] = [400.0 if (s == 300 and rank == 1) else 13.0 + rank for s in steps]  # one spike
        if rank == 1:
            stats["blocks.00"] = ["NaN" if s == 450 else 10.0 + rank for s in steps]  # as the agent sends it
        doc = batch("many-modules", session(), 0, rank, 2, steps, loss=[2.0] * 600)
        doc["tensors"] = {"steps": steps, "stats": {"amax": stats}}
        assert collector.post(doc).status_code == 200, rank
    collector.wait_rolled_up()
    every = collector.get("/api/v1/runs/many-modules/amax")
    assert every["tracked"] == 12 and len(every["modules"]) == 12  # no `top`: every module, as before
    top = collector.get("/api/v1/runs/many-modules/amax", top=3)
    assert top["tracked"] == 12
    assert [m["name"] for m in top["modules"]] == ["blocks.00", "blocks.03", "blocks.11"]
    by_name = {m["name"]: m for m in every["modules"]}
    for m in top["modules"]:  # the same curves as without `top`
        assert m == by_name[m["name"]], m["name"]
    highest = ["blocks.11", "blocks.10", "blocks.09"]
    after = collector.get("/api/v1/runs/many-modules/amax", top=3, from_step=451)  # after the spike and NaN
    assert [m["name"] for m in after["modules"]] == highest
    before = collector.get("/api/v1/runs/many-modules/amax", top=3, to_step=299)
    assert [m["name"] for m in before["modules"]] == highest
    spike = collector.get("/api/v1/runs/many-modules/amax", top=2, from_step=300, to_step=300)
    assert [m["name"] for m in spike["modules"]] == ["blocks.03", "blocks.11"]
    nan = collector.get("/api/v1/runs/many-modules/amax", top=1, from_step=129, to_step=511)  # whole buckets
    assert [m["name"] for m in nan["modules"]] == ["blocks.00"]
    assert collector.get("/api/v1/runs/many-modules/amax", top=50)["modules"] == every["modules"]
    refused = collector.http.get("/api/v1/runs/many-modules/amax", params={"top": 0})
    assert refused.status_code == 422 and "top" in refused.text


def _synchronous_run(
    collector: Collector, name: str, ranks: int, steps: int, slow_rank: int, from_step: int
) -> None:
    """DDP's physics: every rank starts its step together; `slow_rank`'s loader takes 45 ms instead of 5
    from `from_step`, and its peers wait for it in the buffer broadcast at the start of forward."""
    s = np.arange(1, steps + 1)
    data = {r: np.where((r == slow_rank) & (s >= from_step), 45.0, 5.0 + 0.1 * r) for r in range(ranks)}
    arrive = np.max(list(data.values()), axis=0)
    for rank in range(ranks):
        forward = arrive - data[rank] + 10.0  # the wait, then its own 10 ms
        metrics = {
            "time.data_ms": data[rank],
            "time.forward_ms": forward,
            "time.backward_ms": np.full(steps, 20.0),
        }
        metrics["time.optimizer_ms"] = np.full(steps, 2.0)
        metrics["time.step_ms"] = data[rank] + forward + 22.0
        doc = batch(
            name, session(), 0, rank, ranks, s.tolist(), **{k: v.tolist() for k, v in metrics.items()}
        )
        assert collector.post(doc).status_code == 200


def test_the_late_view_lights_the_slow_loader_not_the_ranks_that_wait_for_it(
    collector: Collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    _synchronous_run(collector, "late", ranks=4, steps=256, slow_rank=1, from_step=129)
    forward = collector.get("/api/v1/runs/late/heatmap", metric="time.forward_ms", buckets=4)
    assert forward["values"][0][3] > 4 * forward["values"][1][3]  # the old view blamed the victims
    late = collector.get("/api/v1/runs/late/heatmap", metric="time.late_ms", buckets=4)
    assert late["mode"] == "late" and late["ranks"] == [0, 1, 2, 3] and late["steps"] == [1, 65, 129, 193]
    values = np.array(late["values"])
    assert values[1, 2:] == pytest.approx(
        1 + 39.8 / 77.0, abs=1e-3
    )  # 45 - 5.2 ms (its peers median) late in a 77 ms step
    assert np.abs(values[[0, 2, 3], 2:] - 1).max() < 0.01  # the victims: on time
    assert np.abs(values[:, :2] - 1).max() < 0.01  # before: everyone
    assert late["median"][3] == pytest.approx(77.0)
    # Past the raw read budget the same cells come from the rank rollups (once the worker has them).
    monkeypatch.setattr(rank_rollups, "RAW_READ_BUDGET", 0)
    deadline = time.monotonic() + STREAM_WAIT_S
    while True:
        rolled = collector.get("/api/v1/runs/late/heatmap", metric="time.late_ms", buckets=5)
        if rolled["steps"] == [0, 64, 128, 192, 256] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert rolled["bucket_steps"] == 64 and rolled["steps"] == [0, 64, 128, 192, 256], rolled
    by_rollups = np.array(rolled["values"])
    assert by_rollups[1, 3] == pytest.approx(1 + 39.8 / 77.0, abs=1e-3)
    assert np.abs(by_rollups[[0, 2, 3], :] - 1).max() < 0.01


def test_heatmap_rejects_a_bad_mode_and_an_unknown_metric(collector: Collector) -> None:
    _run(collector, "dash2", ranks=2, steps=3)
    bad = collector.http.get("/api/v1/runs/dash2/heatmap", params={"metric": "loss", "mode": "mean"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "mode"
    missing = collector.http.get("/api/v1/runs/dash2/heatmap", params={"metric": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["field"] == "metric"
    underived = collector.http.get("/api/v1/runs/dash2/heatmap", params={"metric": "time.late_ms"})
    assert underived.status_code == 404 and "time.data_ms" in underived.json()["error"]["message"]


def test_stream_sends_new_steps_and_ends_when_the_server_stops(collector: Collector) -> None:
    name = f"live-{uuid.uuid4().hex[:6]}"
    events: list[dict[str, Any]] = []
    done = threading.Event()
    listener = threading.Thread(
        target=listen_events,
        args=(f"{collector.server.url}/api/v1/stream?run={name}", events, done),
        daemon=True,
    )
    listener.start()
    sid = session()
    collector.post(batch(name, sid, 0, 0, 1, [1, 2]))
    collector.post(batch(name, sid, 1, 0, 1, [3]))
    deadline = time.monotonic() + STREAM_WAIT_S
    seen: list[int] = []
    while time.monotonic() < deadline and 3 not in seen:
        seen = [r["last_step"] for e in list(events) for r in e["runs"] if r["name"] == name]
        time.sleep(0.05)
    assert 3 in seen, events
    assert all(r["name"] == name for e in events for r in e["runs"])  # ?run= filters
    collector.server.stop()
    assert not collector.server._thread.is_alive(), "an open event stream held the server's shutdown"
    assert done.wait(STREAM_WAIT_S)


def test_front_end_missing_says_how_to_build_it(
    collector: Collector, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(pages, "INDEX", tmp_path / "index.html")
    for path in ("/", "/run/some/run"):
        response = collector.http.get(path)
        assert response.status_code == 503 and "npm ci &amp;&amp; npm run build" in response.text
