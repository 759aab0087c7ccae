"""Every rank's stacks on demand, through the command channel, with real processes: 4 gloo ranks of a tiny
DDP model feed a real `stepwatch-server serve` on loopback; rank 2's data loader blocks inside
`slow_fetch()` while the 3 others wait for it in the gradient all-reduce. `POST .../commands` asks every
rank for its stacks; the agents get the command on the collector's answer to their next heartbeat (no
inbound connection), read every thread's stack on their sender thread and post it back. The command's view
must show rank 2 alone with `slow_fetch` on its training thread, and the 3 others in one group. Once the
hang opens, the detection asks for the stacks itself, and the anomaly links that command.
"""

from __future__ import annotations

import gzip
import json
import statistics
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from stepwatch_server.commands.store import KEPT_PER_RUN
from tests.conftest import require_module
from tests.e2e.conftest import Collector
from tests.e2e.test_detection_real import ranks

require_module("torch")
require_module("stepwatch")

pytestmark = pytest.mark.slow

FETCH_STEP = 15
DEADLINE_S = 200.0
WAIT_S = 90.0


def post_json(url: str, doc: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, json.dumps(doc).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.status, json.loads(answer.read())


def _ranks(collector: Collector, run: str) -> list[dict[str, Any]]:
    """The run's ranks; none before its first batch is stored (404)."""
    try:
        return list(collector.get(f"/api/v1/runs/{run}/ranks").get("ranks", []))
    except OSError:
        return []


def _stalled(collector: Collector, run: str) -> bool:
    """Every rank reported, and rank 2 stands at the step before the fetch while the others wait."""
    steps = {r["rank"]: r.get("last_step") for r in _ranks(collector, run)}
    return len(steps) == 4 and steps.get(2) == FETCH_STEP - 1


def test_stacks_name_the_rank_blocked_in_its_data_loader_and_group_the_waiting_ones(
    collector: Collector, tmp_path: Path
) -> None:
    run = f"stacks-{uuid.uuid4().hex[:8]}"
    with ranks(collector, tmp_path, run, "slow_fetch", 2, FETCH_STEP, steps=400, deadline_s=DEADLINE_S):
        end = time.monotonic() + WAIT_S
        while not _stalled(collector, run) and time.monotonic() < end:
            time.sleep(0.5)
        assert _stalled(collector, run), collector.get(f"/api/v1/runs/{run}/ranks")
        time.sleep(1.0)  # the others are in their all-reduce by now
        status, asked = post_json(f"{collector.url}/api/v1/runs/{run}/commands", {"kind": "stacks"})
        assert status == 202 and asked["ranks"] == 4
        view = _wait_settled(collector, run, asked["id"])
        # Then the hang opens (rank 2 stopped stepping while the others wait): the detection asks every rank
        # for its stacks itself, with the hang's id, so that the blamed rank's group comes first.
        hang: dict[str, Any] = {}
        end = time.monotonic() + WAIT_S
        while not hang.get("commands") and time.monotonic() < end:
            found = collector.get(f"/api/v1/runs/{run}/anomalies?kind=hang")["anomalies"]
            hang = found[0] if found else {}
            time.sleep(1.0)
        assert hang.get("commands"), hang
        at_hang = _wait_settled(collector, run, hang["commands"][0]["id"])
    assert [r["status"] for r in view["ranks"]] == ["done"] * 4, view["ranks"]
    groups = view["groups"]
    assert [g["ranks"] for g in groups] == [[2], [0, 1, 3]], [g["summary"] for g in groups]
    culprit = [f["function"] for f in groups[0]["frames"]]
    assert "slow_fetch" in culprit and "main" in culprit, culprit
    fetch = next(f for f in groups[0]["frames"] if f["function"] == "slow_fetch")
    assert fetch["own"] and fetch["file"].endswith("fault_ranks.py")
    waiting = [f["function"] for f in groups[1]["frames"]]
    assert "backward" in waiting and "slow_fetch" not in waiting, waiting
    assert "slow_fetch" in groups[0]["summary"] and groups[1]["summary"].startswith("3 ranks:")
    rank2 = view["results"]["2"]
    assert rank2["threads"][0]["training"] and rank2["threads"][0]["name"] == "MainThread"
    assert not any(t["name"].startswith("stepwatch") for t in rank2["threads"])
    assert rank2["nccl_trace"]["available"] is False  # gloo on CPU

    assert hang["rank"] == 2 and hang["commands"][0]["kind"] == "stacks"
    assert at_hang["requested_by"] == "detection" and at_hang["anomaly_id"] == hang["id"]
    assert at_hang["blamed_rank"] == 2 and [r["status"] for r in at_hang["ranks"]] == ["done"] * 4
    assert at_hang["groups"][0]["ranks"] == [2] and "slow_fetch" in at_hang["groups"][0]["summary"]


def _wait_settled(collector: Collector, run: str, cid: int, wait_s: float = 30.0) -> dict[str, Any]:
    end = time.monotonic() + wait_s
    while True:
        view: dict[str, Any] = collector.get(f"/api/v1/runs/{run}/commands/{cid}")
        if all(r["status"] != "waiting" for r in view["ranks"]) or time.monotonic() > end:
            return view
        time.sleep(0.2)


def test_a_rank_with_the_channel_off_refuses_and_a_rank_gone_reads_no_answer(
    collector: Collector, tmp_path: Path
) -> None:
    import torch

    import stepwatch

    run = f"refuse-{uuid.uuid4().hex[:8]}"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stepwatch.attach(
        model, optimizer, run=run, url=collector.url, commands=False, spool_dir=tmp_path / "spool",
        flush_interval_s=0.2, heartbeat_interval_s=0.2,
    )  # fmt: skip
    try:
        for _ in range(5):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        end = time.monotonic() + 20
        while not _ranks(collector, run) and time.monotonic() < end:
            time.sleep(0.2)
        _, asked = post_json(f"{collector.url}/api/v1/runs/{run}/commands", {"kind": "stacks", "rank": 0})
        view = _wait_settled(collector, run, asked["id"])
    finally:
        watch.close()
    assert view["ranks"][0]["status"] == "refused", view
    assert "commands=False" in view["ranks"][0]["message"]
    assert view["groups"] == [] and view["results"] == {}

    # The rank's agent has closed: nobody answers; once the command's time is up it reads "no answer".
    _, asked = post_json(
        f"{collector.url}/api/v1/runs/{run}/commands", {"kind": "stacks", "answer_within_s": 1}
    )
    assert collector.get(f"/api/v1/runs/{run}/commands/{asked['id']}")["ranks"][0]["status"] == "waiting"
    time.sleep(1.5)
    gone = collector.get(f"/api/v1/runs/{run}/commands/{asked['id']}")
    assert [r["status"] for r in gone["ranks"]] == ["no answer"]
    listed = collector.get(f"/api/v1/runs/{run}/commands")["commands"]
    assert [c["id"] for c in listed] == [asked["id"], asked["id"] - 1]

    # An anomaly the run does not have cannot be named as the one the evidence is for.
    with pytest.raises(urllib.error.HTTPError) as error:
        post_json(f"{collector.url}/api/v1/runs/{run}/commands", {"kind": "stacks", "anomaly_id": 999_999})
    with error.value:
        assert error.value.code == 404 and '"field":"anomaly_id"' in error.value.read().decode()

    # Bounded per run: its newest KEPT_PER_RUN commands stay, the oldest go with their results.
    for _ in range(KEPT_PER_RUN):
        post_json(f"{collector.url}/api/v1/runs/{run}/commands", {"kind": "stacks", "answer_within_s": 1})
    listed = collector.get(f"/api/v1/runs/{run}/commands")["commands"]
    assert len(listed) == KEPT_PER_RUN and min(c["id"] for c in listed) > asked["id"]
    with pytest.raises(urllib.error.HTTPError) as error:
        collector.get(f"/api/v1/runs/{run}/commands/{asked['id'] - 1}")  # the refused one, gone
    with error.value:
        assert error.value.code == 404


def test_commands_of_unknown_runs_and_kinds_are_refused_with_the_field_named(collector: Collector) -> None:
    for doc, status, field in (
        ({"kind": "stacks"}, 404, "run"),
        ({"kind": "core-dump"}, 422, "kind"),
    ):
        with pytest.raises(urllib.error.HTTPError) as error:
            post_json(f"{collector.url}/api/v1/runs/no-such-run/commands", doc)
        with error.value:
            assert error.value.code == status
            assert f'"field":"{field}"' in error.value.read().decode().replace(" ", "")
    with pytest.raises(urllib.error.HTTPError) as error:
        collector.get("/api/v1/runs/no-such-run/commands/123456")
    with error.value:
        assert error.value.code == 404


def test_a_straggler_gets_two_traces_and_the_difference_names_the_slow_operator(
    collector: Collector, tmp_path: Path
) -> None:
    """Rank 2 computes a `torch.cdist` (~20 ms) in its forward from step 30 on: once the straggler opens,
    the detection asks rank 2 and a peer for a 5-step profile; both traces are stored (valid Chrome-trace
    JSON, gzip) and the top operator by time difference is the cdist."""
    run = f"profile-{uuid.uuid4().hex[:8]}"
    with ranks(collector, tmp_path, run, "slow_op", 2, 30, steps=1500, deadline_s=DEADLINE_S):
        straggler: dict[str, Any] = {}
        end = time.monotonic() + 150
        while not straggler.get("commands") and time.monotonic() < end:
            found = _anomalies(collector, run, "straggler")
            straggler = found[0] if found else {}
            time.sleep(1.0)
        assert straggler.get("commands"), _anomalies(collector, run, None)
        view = _wait_settled(collector, run, straggler["commands"][0]["id"], wait_s=60)
    assert straggler["rank"] == 2 and view["kind"] == "profile" and view["args"] == {"steps": 5}
    assert view["targets"] == [0, 2] and [r["status"] for r in view["ranks"]] == ["done", "done"], view[
        "ranks"
    ]
    assert [t["rank"] for t in view["traces"]] == [0, 2]
    for trace in view["traces"]:
        with urllib.request.urlopen(collector.url + trace["url"], timeout=10) as answer:
            assert answer.headers["Content-Type"] == "application/gzip"
            doc = json.loads(gzip.decompress(answer.read()))
        assert doc["traceEvents"] and trace["bytes"] > 0
    comparison = view["comparison"]
    assert comparison["slow_rank"] == 2 and comparison["peer_rank"] == 0
    assert "cdist" in comparison["ops"][0]["name"], comparison["ops"][:5]
    assert comparison["ops"][0]["diff_us"] > 5_000  # ms per step
    # The cost of profiling, for the note: the traced steps against the rank's 20 steps before the command.
    asked_at = straggler["detected_step"]
    for rank in ("0", "2"):
        during = view["results"][rank]["step_ms"]
        series = collector.get(f"/api/v1/runs/{run}/series?metric=time.step_ms&rank={rank}&max_points=20000")
        steps, values = series["series"][0]["steps"], series["series"][0]["values"]
        before = [v for s, v in zip(steps, values, strict=True) if asked_at - 20 <= s < asked_at]
        print(
            f"profile cost, rank {rank}: step time median {statistics.median(before):.1f} ms over the 20 steps "
            f"before, {statistics.median(during):.1f} ms over the 5 traced steps"
        )


def _anomalies(collector: Collector, run: str, kind: str | None) -> list[dict[str, Any]]:
    try:
        query = f"?kind={kind}" if kind else ""
        return list(collector.get(f"/api/v1/runs/{run}/anomalies{query}")["anomalies"])
    except OSError:
        return []
