"""Ingest end to end on both backends: storage, read-back, idempotency, incarnations, auth."""

from __future__ import annotations

import gzip
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text

from stepwatch_server.ingest.example import EXAMPLE_BATCH
from stepwatch_server.storage import make_engine
from tests.service.conftest import Collector, make_batch, steps_batch


def _series(c: Collector, run: str, metric: str, **params: Any) -> dict[int, tuple[list[int], list[Any]]]:
    body = c.get(f"/api/v1/runs/{run}/series", metric=metric, **params)
    assert body["metric"] == metric
    return {s["rank"]: (s["steps"], s["values"]) for s in body["series"]}


def test_valid_batch_is_stored_and_every_value_comes_back(collector: Collector) -> None:
    batch = make_batch()
    response = collector.post(batch)
    assert response.status_code == 200, response.text
    # 14 scalars (lr's null is not stored) + 6 tensor stats + 1 fingerprint + 3 events
    assert response.json() == {"accepted": True, "rows": 24, "duplicates": 0, "incarnation": 1}
    run, rank = batch["run"], batch["rank"]

    for metric, values in batch["metrics"].items():
        got = _series(collector, run, metric)
        present = [(s, v) for s, v in zip(batch["steps"], values, strict=True) if v is not None]
        assert got == {rank: ([s for s, _ in present], [v for _, v in present])}

    tensors = collector.get(f"/api/v1/runs/{run}/tensors", stat="amax")
    assert tensors["stat"] == "amax"
    assert {(s["name"], s["rank"]): (s["steps"], s["values"]) for s in tensors["series"]} == {
        ("layers.0.mlp.fc1", 3): ([1, 3], [12.5, "NaN"]),
        ("layers.0.mlp.fc2", 3): ([1, 3], [3.1, 3.4]),
    }
    one = collector.get(
        f"/api/v1/runs/{run}/tensors", stat="grad_norm", name="layers.0.mlp.fc1.weight", rank="3"
    )
    assert one["series"] == [
        {"name": "layers.0.mlp.fc1.weight", "rank": 3, "steps": [1, 3], "values": [0.42, "Infinity"]}
    ]

    steps = collector.get(f"/api/v1/runs/{run}/steps")
    assert steps["series"] == [{"rank": 3, "steps": [1, 2, 3], "timestamps": batch["timestamps"]}]
    fps = collector.get(f"/api/v1/runs/{run}/fingerprints")
    assert fps["series"] == [
        {"rank": 3, "replica_group": 3, "shard": 0, "steps": [3], "values": ["9c1f00d2aa13e4b7"]}
    ]
    events = collector.get(f"/api/v1/runs/{run}/events")["events"]
    assert [(e["step"], e["ts"], e["kind"], e["data"]) for e in events] == [
        (e["step"], e["ts"], e["kind"], e["data"]) for e in batch["events"]
    ]
    assert [e["kind"] for e in collector.get(f"/api/v1/runs/{run}/events", kind="phase_end")["events"]] == [
        "phase_end"
    ]

    detail = collector.get(f"/api/v1/runs/{run}")
    assert detail["name"] == run and detail["world_size"] == 8 and detail["last_step"] == 3
    assert detail["ranks"] == 1 and detail["restarts"] == []
    assert detail["metrics"] == sorted(batch["metrics"])
    assert detail["tensors"] == {
        "amax": ["layers.0.mlp.fc1", "layers.0.mlp.fc2"],
        "grad_norm": ["layers.0.mlp.fc1.weight"],
    }
    runs = collector.get("/api/v1/runs")["runs"]
    assert [(r["name"], r["ranks"], r["last_step"]) for r in runs] == [(run, 1, 3)]

    ranks = collector.get(f"/api/v1/runs/{run}/ranks")
    assert ranks["world_size"] == 8
    (state,) = ranks["ranks"]
    assert state["rank"] == 3 and state["node"] == "gpu-12" and state["local_rank"] == 3
    assert state["last_step"] == 3 and state["phase"] == "data" and state["incarnation"] == 1
    assert state["median_step_ms"] == pytest.approx(110.2)
    assert state["last_heartbeat_at"].startswith("2025-11-29T14:41:01")
    assert state["agent"] == {
        "version": "0.1.0",
        "counters": {"dropped_buffer_full": 0, "spooled_batches": 0},
    }


def test_gzip_body_is_accepted(collector: Collector) -> None:
    batch = make_batch()
    import orjson

    response = collector.post(
        gzip.compress(orjson.dumps(batch)),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["rows"] == 24


def test_same_batch_twice_is_stored_once(collector: Collector) -> None:
    batch = make_batch()
    first = collector.post(batch).json()
    after_first = collector.counts()
    second = collector.post(batch)
    assert second.status_code == 200
    assert second.json() == {"accepted": True, "rows": 0, "duplicates": first["rows"], "incarnation": 1}
    assert collector.counts() == after_first
    assert after_first["batches"] == 1 and after_first["points"] == 20


def test_resumed_run_is_a_new_incarnation_and_latest_values_win(collector: Collector) -> None:
    run = f"resume-{uuid.uuid4().hex[:6]}"
    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    steps_a = list(range(0, 151))
    r = collector.post(steps_batch(run, first, 0, steps_a, loss=[float(s) for s in steps_a]))
    assert r.json()["incarnation"] == 1
    steps_b = list(range(100, 201))
    r = collector.post(steps_batch(run, second, 0, steps_b, loss=[-float(s) for s in steps_b]))
    assert r.status_code == 200 and r.json()["incarnation"] == 2 and r.json()["duplicates"] == 0

    steps, values = _series(collector, run, "loss", max_points=20000)[0]
    assert steps == list(range(0, 201))
    assert values == [float(s) for s in range(100)] + [-float(s) for s in range(100, 201)]
    (restart,) = collector.get(f"/api/v1/runs/{run}")["restarts"]
    assert restart["rank"] == 0 and restart["incarnation"] == 2 and restart["first_step"] == 100
    assert restart["at"]
    (state,) = collector.get(f"/api/v1/runs/{run}/ranks")["ranks"]
    assert state["incarnation"] == 2 and state["last_step"] == 200
    # a late batch of the old session still lands in incarnation 1 and does not win
    r = collector.post(steps_batch(run, first, 1, [120], loss=[999.0]))
    assert r.json()["incarnation"] == 1
    steps, values = _series(collector, run, "loss", from_step=120, to_step=120)[0]
    assert (steps, values) == ([120], [-120.0])


def test_session_id_of_another_rank_is_rejected(collector: Collector) -> None:
    session = uuid.uuid4().hex
    assert (
        collector.post(steps_batch("r", session, 0, [1], rank=0, world_size=2, loss=[1.0])).status_code == 200
    )
    before = collector.counts()
    r = collector.post(steps_batch("r", session, 1, [1], rank=1, world_size=2, loss=[1.0]))
    assert r.status_code == 422 and r.json()["error"]["field"] == "session"
    assert collector.counts() == before


def test_nonfinite_values_round_trip(collector: Collector) -> None:
    run = "nonfinite"
    values = [1.5, "NaN", "Infinity", "-Infinity", None, -0.0, 1e308, 5e-324]
    steps = list(range(len(values)))
    assert collector.post(steps_batch(run, uuid.uuid4().hex, 0, steps, x=values)).status_code == 200
    got_steps, got = _series(collector, run, "x")[0]
    assert got_steps == [0, 1, 2, 3, 5, 6, 7]
    assert got[:4] == [1.5, "NaN", "Infinity", "-Infinity"]
    assert got[4] == 0.0 and got[5] == 1e308 and got[6] == 5e-324  # SQLite keeps no sign on zero


def test_token_required_when_set(start_collector: Callable[..., Collector]) -> None:
    collector = start_collector(token="s3cret")
    batch = make_batch()
    assert collector.post(batch).status_code == 401
    wrong = collector.post(batch, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "unauthorized"
    assert collector.counts()["points"] == 0
    ok = collector.post(batch, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["rows"] == 24


def test_heartbeat_only_batch_updates_rank(collector: Collector) -> None:
    batch = steps_batch("hb", uuid.uuid4().hex, 0, [])
    batch["heartbeat"] = {
        "ts": 1_764_427_300.0, "phase": "eval", "last_step": 41, "forwards": 90, "nograd_forwards": 49,
        "stack": ["torch.nn.modules.module:Module._call_impl", "train:evaluate", "__main__:<module>"],
    }  # fmt: skip
    r = collector.post(batch)
    assert r.status_code == 200 and r.json()["rows"] == 0
    (state,) = collector.get("/api/v1/runs/hb/ranks")["ranks"]
    assert state["phase"] == "eval" and state["last_step"] == 41


def test_mean_over_ranks_and_spike_survives_downsampling(collector: Collector) -> None:
    run = "spiky"
    steps = list(range(10_000))
    for rank in range(2):
        loss = [1.0 + rank] * len(steps)
        if rank == 1:
            loss[7_777] = 500.0
        r = collector.post(steps_batch(run, uuid.uuid4().hex, 0, steps, rank=rank, world_size=2, loss=loss))
        assert r.status_code == 200, r.text
    series = _series(collector, run, "loss", max_points=200)
    assert set(series) == {0, 1}
    steps_1, values_1 = series[1]
    assert len(steps_1) <= 200 and 500.0 in values_1 and 7_777 in steps_1
    assert steps_1 == sorted(steps_1)
    # The mean comes from the rollups. If the worker rolled up rank 0's steps before rank 1's batch
    # arrived, rank 1's is a late batch below the watermark: in the mean after the worker's next round.
    collector.wait_rolled_up()
    mean = collector.get(f"/api/v1/runs/{run}/series", metric="loss", rank="mean", max_points=200)["series"]
    assert mean[0]["rank"] == "mean" and 250.5 in mean[0]["values"] and 1.5 in mean[0]["values"]
    one = _series(collector, run, "loss", rank=0, max_points=100)
    assert list(one) == [0] and len(one[0][0]) <= 100


def test_read_api_errors(collector: Collector) -> None:
    r = collector.http.get("/api/v1/runs/nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    assert collector.http.get("/api/v1/runs/nope/series", params={"metric": "loss"}).status_code == 404
    collector.post(make_batch())
    run = EXAMPLE_BATCH["run"]
    r = collector.http.get(f"/api/v1/runs/{run}/series", params={"metric": "nope"})
    assert r.status_code == 404 and "available: grad_norm, loss" in r.json()["error"]["message"]
    r = collector.http.get(f"/api/v1/runs/{run}/series", params={"metric": "loss", "rank": "x"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "rank"
    r = collector.http.get(f"/api/v1/runs/{run}/series", params={"metric": "loss", "max_points": 10**6})
    assert r.status_code == 422 and r.json()["error"]["field"] == "max_points"


def test_run_names_with_slashes(collector: Collector) -> None:
    run = "team/llama@v2"
    assert collector.post(steps_batch(run, uuid.uuid4().hex, 0, [1, 2], loss=[1.0, 2.0])).status_code == 200
    assert collector.get(f"/api/v1/runs/{run}")["name"] == run
    assert _series(collector, run, "loss")[0] == ([1, 2], [1.0, 2.0])


def test_healthz(collector: Collector) -> None:
    body = collector.get("/healthz")
    assert body["status"] == "ok" and body["database"] in {"sqlite", "postgresql"}


def test_a_batch_taking_a_run_over_the_series_name_limit_is_422_and_stores_nothing(
    collector: Collector,
) -> None:
    """Names already stored for the run (by any rank) count with the batch's new ones; a batch that would
    pass MAX_SERIES_PER_RUN is refused whole, one that reaches it exactly is stored."""
    from stepwatch_server.ingest.schema import MAX_SERIES_PER_RUN

    run, rank0, rank1 = "wide-run", uuid.uuid4().hex, uuid.uuid4().hex
    names = [f"layers.{i}.stat" for i in range(MAX_SERIES_PER_RUN - 3)]
    first = steps_batch(run, rank0, 0, [1], world_size=2, **{n: [1.0] for n in names})
    assert collector.post(first).status_code == 200

    def second(new_metrics: int, new_amax: int) -> dict[str, Any]:
        # Two names the run has, and new ones: metrics and a tensor statistic (each its own series).
        metrics = {names[0]: [2.0], names[1]: [2.0]} | {f"new.{i}": [2.0] for i in range(new_metrics)}
        batch = steps_batch(run, rank1, 0, [1], rank=1, world_size=2, **metrics)
        batch["tensors"] = {"steps": [1], "stats": {"amax": {f"mod.{i}": [3.0] for i in range(new_amax)}}}
        return batch

    before = collector.counts()
    over = collector.post(second(new_metrics=2, new_amax=2))  # 4 new: one over the limit
    assert over.status_code == 422, over.text
    error = over.json()["error"]
    assert error["code"] == "too_many_series" and error["field"] == "metrics"
    assert f"{MAX_SERIES_PER_RUN:,}" in error["message"] and f"{MAX_SERIES_PER_RUN - 3:,}" in error["message"]
    assert collector.counts() == before

    at_limit = collector.post(second(new_metrics=2, new_amax=1))  # the same (session, seq), 3 new
    assert at_limit.status_code == 200, at_limit.text
    assert at_limit.json()["rows"] == 5
    assert collector.counts()["series"] == MAX_SERIES_PER_RUN
    assert collector.post(steps_batch("other-run", uuid.uuid4().hex, 0, [1], x=[1.0])).status_code == 200


def test_rank_state_moves_forward_only_and_a_late_batch_of_an_older_incarnation_changes_nothing(
    collector: Collector,
) -> None:
    """The rank row is one conditional UPDATE per batch (ingest/store.py `_rank_update`): last_step and
    the heartbeat only move forward, values a batch lacks are kept, a newer incarnation takes over."""
    run, old, new = f"state-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex, uuid.uuid4().hex

    def post(session: str, seq: int, steps: list[int], **fields: Any) -> None:
        doc = {
            **steps_batch(run, session, seq, steps, rank=1, world_size=4, loss=[1.0] * len(steps)),
            **fields,
        }
        assert collector.post(doc).status_code == 200

    stored_to: list[int] = []
    engine = make_engine(collector.database_url)

    def state() -> dict[str, Any]:
        (found,) = collector.get(f"/api/v1/runs/{run}/ranks")["ranks"]
        with engine.connect() as conn:
            query = "SELECT stored_to FROM ranks JOIN runs ON runs.id = ranks.run_id WHERE runs.name = :run"
            stored_to.append(conn.execute(text(query), {"run": run}).scalar_one())
        return dict(found)

    hb = {"ts": 1_764_427_300.0, "phase": "forward", "last_step": 20}
    post(old, 0, [10, 20], node="n1", heartbeat=hb, agent={"version": "1.0", "counters": {"sent": 2}})
    first = state()
    assert (first["incarnation"], first["last_step"], first["node"], first["phase"]) == (
        1,
        20,
        "n1",
        "forward",
    )
    post(old, 1, [5], heartbeat={**hb, "ts": hb["ts"] - 10, "phase": "data", "last_step": 5})  # out of order
    kept = state()
    assert (kept["last_step"], kept["phase"]) == (20, "forward")
    assert kept["last_heartbeat_at"] == first["last_heartbeat_at"]
    assert kept["agent"] == {"version": "1.0", "counters": {"sent": 2}}  # not in this batch: kept
    post(new, 0, [3], node="n2")  # a restart: a new incarnation from step 3
    restarted = state()
    assert (restarted["incarnation"], restarted["last_step"], restarted["node"]) == (2, 3, "n2")
    post(old, 2, [30], node="n1", heartbeat={**hb, "ts": hb["ts"] + 99, "phase": "backward"})  # late, old
    late = state()
    engine.dispose()
    assert {k: late[k] for k in ("incarnation", "last_step", "node", "phase")} == {
        k: restarted[k] for k in ("incarnation", "last_step", "node", "phase")
    }
    assert late["last_seen_at"] >= restarted["last_seen_at"]
    # The highest step stored, any incarnation: forward only (the restart's step 3 leaves it at 20, the old
    # incarnation's late step 30 moves it), what reads above the rollup watermark go by (rollups.stored_above).
    assert stored_to == [20, 20, 20, 30]


def test_while_detection_is_full_ingest_answers_429_and_stores_nothing_then_takes_it_again(
    collector: Collector,
) -> None:
    """Every slot of the detection queue taken (detection far behind): a batch stored now would never be
    detected, so ingest refuses it with 429 and Retry-After, and takes it once a slot is free."""
    worker = collector.server.app.state.detection
    run, session = f"behind-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    assert collector.post(steps_batch(run, session, 0, [1], loss=[1.0])).status_code == 200
    deadline = time.monotonic() + 10.0  # the first batch off the queue, or its slot frees one taken below
    while not worker.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.idle(), "the detection worker did not take the first batch within 10 s"
    held = 0
    while worker.reserve():  # what a backlog of 20,000 batches would hold
        held += 1
    try:
        before = collector.counts()
        refused = collector.post(steps_batch(run, session, 1, [2], loss=[0.5]))
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "2"
        assert refused.json()["error"]["code"] == "detection_behind"
        assert collector.counts() == before
    finally:
        for _ in range(held):
            worker.release()
    submitted = worker.submitted
    again = collector.post(steps_batch(run, session, 1, [2], loss=[0.5]))
    assert again.status_code == 200 and again.json()["rows"] == 1
    assert worker.submitted == submitted + 1 and worker.dropped == 0
