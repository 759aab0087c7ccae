"""The batch stream follows docs/ingest.md and arrives the way a collector would receive it."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import defaultdict
from typing import Any

import pytest

from stepwatch_server.simulate import SCENARIOS, Scenario, Simulation, generate
from stepwatch_server.simulate.scenario import Hang, NonFinite
from tests.conftest import require_module
from tests.simulate.helpers import check_batch

SMALL = Scenario(
    "small",
    world_size=12,  # a partial second node
    steps=700,
    seed=7,
    eval_every=300,
    eval_s=20.0,
    ckpt_every=600,
    ckpt_s=15.0,
    faults=(NonFinite(450, ranks=(10,)),),
)


def _stream(scn: Scenario) -> list[dict[str, Any]]:
    return list(generate(scn))


@pytest.fixture(scope="module")
def small() -> list[dict[str, Any]]:
    return _stream(SMALL)


def test_every_batch_passes_the_structural_check(small: list[dict[str, Any]]) -> None:
    for b in small:
        check_batch(b)


@pytest.mark.parametrize("name", ["hang_slow_steps_16", "nonfinite_act_8"])
def test_suite_batches_pass_the_structural_check(name: str) -> None:
    for b in generate(SCENARIOS[name]):
        check_batch(b)


def test_collector_validator_accepts_the_batches(small: list[dict[str, Any]]) -> None:
    validate = require_module("stepwatch_server.ingest.validate")
    for b in small[::7] + [b for b in small if b.get("events")]:
        parsed = validate.parse_batch(json.loads(json.dumps(b)))
        assert parsed.rank == b["rank"] and len(parsed.steps) == len(b["steps"])


def test_identity_sessions_and_sequence(small: list[dict[str, Any]]) -> None:
    sessions: dict[int, set[str]] = defaultdict(set)
    seqs: dict[int, list[int]] = defaultdict(list)
    for b in small:
        r = b["rank"]
        sessions[r].add(b["session"])
        seqs[r].append(b["seq"])
        assert b["node"] == f"gpu-{r // 8:03d}" and b["local_rank"] == r % 8
        assert b["world_size"] == 12 and b["replica_group"] == r and b["shard"] == 0 and b["num_shards"] == 1
        assert b["run"] == "sim-small"
    assert sorted(sessions) == list(range(12))
    assert all(len(s) == 1 for s in sessions.values())
    assert len({next(iter(s)) for s in sessions.values()}) == 12
    for r, s in seqs.items():
        assert s == list(range(len(s))), r


def test_arrival_order_interleaves_ranks_by_send_time(small: list[dict[str, Any]]) -> None:
    sent = [b["heartbeat"]["ts"] for b in small]
    assert sent == sorted(sent)
    first_twenty = {b["rank"] for b in small[:40]}
    assert len(first_twenty) > 6  # interleaved, not rank by rank
    for b in small:
        if b["steps"]:
            assert b["timestamps"][-1] <= b["heartbeat"]["ts"]  # a step is sent after it ended


def test_each_step_is_sent_exactly_once_per_rank(small: list[dict[str, Any]]) -> None:
    got: dict[int, list[int]] = defaultdict(list)
    for b in small:
        got[b["rank"]].extend(b["steps"])
    for r in range(12):
        assert got[r] == list(range(1, 701)), r


def test_metric_names_nonfinite_strings_amax_and_fingerprint_cadence(small: list[dict[str, Any]]) -> None:
    amax_steps: set[int] = set()
    fp_steps: set[int] = set()
    nan_seen = False
    for b in small:
        if not b["steps"]:
            continue
        m = b["metrics"]
        assert len(set(m["lr"])) <= len(b["steps"])
        if 450 in b["steps"]:
            i = b["steps"].index(450)
            assert m["grad_norm"][i] == "NaN" and m["nonfinite.grads"][i] == 1
            if b["rank"] == 10:
                nan_seen = m["loss"][i] == "NaN" and m["nonfinite.activations"][i] == 1
                assert 450 in b["tensors"]["steps"]  # a bad amax is shipped off-cadence
        if "tensors" in b:
            amax_steps.update(b["tensors"]["steps"])
        if "fingerprints" in b:
            fp_steps.update(b["fingerprints"]["steps"])
    assert nan_seen
    assert amax_steps == set(range(10, 701, 10)) | {450}
    assert fp_steps == set(range(100, 701, 100))


def test_pauses_are_marked_and_heartbeats_continue_through_them(small: list[dict[str, Any]]) -> None:
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for b in small:
        by_rank[b["rank"]].append(b)
    for r in (0, 11):
        events = [e for b in by_rank[r] for e in b.get("events", []) if e["kind"].startswith("phase")]
        assert [(e["kind"], e["step"], e["data"]["phase"]) for e in events] == [
            ("phase_start", 300, "eval"),
            ("phase_end", 300, "eval"),
            ("phase_start", 600, "checkpoint"),
            ("phase_end", 600, "checkpoint"),
        ]
        start, end = events[0]["ts"], events[1]["ts"]
        assert 17.0 < end - start < 23.0
        during = [b for b in by_rank[r] if start < b["heartbeat"]["ts"] < end]
        assert all(b["heartbeat"]["phase"] == "eval" for b in during)
        during = [b for b in during if b["heartbeat"]["ts"] > start + 1.0]  # after the hand-over of step 300
        assert len(during) >= 3 and all(b["heartbeat"]["phase"] == "eval" for b in during)
        assert all(not b["steps"] for b in during)  # heartbeat-only
        gaps = [y["heartbeat"]["ts"] - x["heartbeat"]["ts"] for x, y in itertools.pairwise(during)]
        assert all(g < 7.0 for g in gaps)


def test_hang_heartbeats_keep_coming_from_waiting_ranks() -> None:
    scn = Scenario(
        "hang", world_size=8, steps=400, seed=3, faults=(Hang(2, 300, mode="stuck", phase="forward"),)
    )
    batches = _stream(scn)
    after: dict[int, list[dict[str, Any]]] = defaultdict(list)
    last_end = max(t for b in batches for t in b["timestamps"])
    for b in batches:
        assert not b["steps"] or b["steps"][-1] <= 299
        if b["heartbeat"]["ts"] > last_end + 10:
            after[b["rank"]].append(b["heartbeat"])
    assert sorted(after) == list(range(8))
    for r, hbs in after.items():
        assert {hb["last_step"] for hb in hbs} == {299}
        assert {hb["phase"] for hb in hbs} == ({"forward"} if r == 2 else {"backward"})
        assert hbs[-1]["ts"] > last_end + scn.hang_observe_s - 10


def test_dead_rank_stops_and_loses_its_unsent_steps() -> None:
    scn = Scenario("dead", world_size=8, steps=400, seed=4, faults=(Hang(5, 300, mode="dead"),))
    sim = Simulation(scn)
    batches = list(sim)
    last = {r: max((s for b in batches if b["rank"] == r for s in b["steps"]), default=0) for r in range(8)}
    assert all(last[r] == 299 for r in range(8) if r != 5)
    assert last[5] < 299  # it died holding a few completed steps it had not sent yet
    dead_last_hb = max(b["heartbeat"]["ts"] for b in batches if b["rank"] == 5)
    live_last_hb = min(
        max(b["heartbeat"]["ts"] for b in batches if b["rank"] == r) for r in range(8) if r != 5
    )
    hang_label = next(lab for lab in sim.labels if lab.kind == "hang")
    assert hang_label.first_ts is not None and dead_last_hb < hang_label.first_ts + 2.0
    assert live_last_hb > hang_label.first_ts + 100


def test_deterministic_from_seed() -> None:
    scn = SCENARIOS["nonfinite_act_8"]

    def digest(s: Scenario) -> str:
        h = hashlib.sha256()
        for b in generate(s):
            h.update(json.dumps(b, sort_keys=True).encode())
        return h.hexdigest()

    short = Scenario("det", world_size=8, steps=400, seed=11, faults=(NonFinite(200, ranks=(1,)),))
    assert digest(short) == digest(short)
    other = Scenario("det", world_size=8, steps=400, seed=12, faults=(NonFinite(200, ranks=(1,)),))
    assert digest(short) != digest(other)
    assert scn.labels == SCENARIOS["nonfinite_act_8"].labels


def test_batches_are_released_as_they_become_due() -> None:
    scn = Scenario("wide", world_size=256, steps=150, seed=8, step_ms=200.0, compile_s=1.0)
    sim = Simulation(scn)
    n = sum(1 for _ in sim)
    assert n == sim.batches_sent > 256 * 6
    assert sim.max_pending <= 2 * scn.world_size  # held back across chunks: about one per rank, never the run
