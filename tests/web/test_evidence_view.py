"""The evidence at a verdict on the dashboard (issue 18), from real runs to a real browser.

Two real 4-rank gloo DDP runs of `tests/e2e/fault_ranks.py` feed a real collector (`stepwatch-server serve`):
rank 2 blocks in its data loader's `slow_fetch()` (a hang: the detection asks every rank for its stacks), and
rank 2 computes a slow `torch.cdist` in its forward (a straggler: the detection asks rank 2 and a peer for a
profile). Once the agents answered, Chromium (playwright-core, web/tests/evidence.mjs) opens each run's page
with nothing but loopback reachable, opens the anomaly's evidence and reports what it shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwatch_server.web.pages import INDEX
from tests.conftest import require_module
from tests.e2e.conftest import Collector, free_port
from tests.e2e.test_commands import DEADLINE_S, FETCH_STEP, _anomalies, _wait_settled
from tests.e2e.test_detection_real import ranks
from tests.web.browser import CHROMIUM, SCREENSHOTS, WEB, require_browser

require_module("torch")

pytestmark = pytest.mark.slow

SCRIPT = WEB / "tests" / "evidence.mjs"
BROWSER_TIMEOUT_S = 100.0


def _answered(collector: Collector, run: str, kind: str, tmp: Path, fault: str, fault_step: int) -> None:
    """Run the fault until its anomaly opened and the ranks asked answered (the ranks are killed then)."""
    tmp.mkdir()
    with ranks(collector, tmp, run, fault, 2, fault_step, steps=1500, deadline_s=DEADLINE_S):
        found: dict[str, Any] = {}
        end = time.monotonic() + 150
        while not found.get("commands") and time.monotonic() < end:
            anomalies = _anomalies(collector, run, kind)
            found = anomalies[0] if anomalies else {}
            time.sleep(1.0)
        assert found.get("commands"), _anomalies(collector, run, None)
        view = _wait_settled(collector, run, found["commands"][0]["id"], wait_s=60)
        assert all(r["status"] == "done" for r in view["ranks"]), view["ranks"]


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_browser(INDEX)
    tmp = tmp_path_factory.mktemp("evidence-view")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    collector = Collector(f"sqlite:///{tmp / 'stepwatch.db'}", free_port(), tmp / "collector.log").start()
    hung, slow = f"hung-{uuid.uuid4().hex[:6]}", f"slow-op-{uuid.uuid4().hex[:6]}"
    try:
        _answered(collector, hung, "hang", tmp / "hung", "slow_fetch", FETCH_STEP)
        _answered(collector, slow, "straggler", tmp / "slow", "slow_op", 30)
        env = {
            **os.environ,
            "STEPWATCH_URL": collector.url,
            "RUNS": f"stacks={hung}=hang,traces={slow}=straggler",
            "CHROMIUM": CHROMIUM,
            "SCREENSHOTS": str(SCREENSHOTS),
        }
        done = subprocess.run(
            ["node", str(SCRIPT)], cwd=WEB, env=env, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S
        )
        assert done.returncode == 0, f"evidence.mjs failed ({done.returncode}): {done.stderr[-3000:]}"
        yield json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        collector.stop()


def test_the_hang_shows_the_blocked_rank_first_with_its_own_frames(seen: dict[str, Any]) -> None:
    stacks = seen["runs"]["stacks"]
    assert stacks["title"] == "Stacks of every rank" and stacks["status"] == "done: ranks 0, 1, 2, 3"
    assert [g["ranks"] for g in stacks["groups"]] == ["2", "0,1,3"]
    assert "slow_fetch" in stacks["groups"][0]["summary"] and stacks["groups"][0]["summary"].startswith(
        "1 rank:"
    )
    assert stacks["groups"][0]["own"][:2] == ["slow_fetch", "main"]  # the project's frames, highlighted
    assert stacks["groups"][1]["summary"].startswith("3 ranks:") and "main" in stacks["groups"][1]["own"]


def test_the_straggler_links_both_traces_and_names_the_slow_operator(seen: dict[str, Any]) -> None:
    traces = seen["runs"]["traces"]
    assert traces["title"] == "Profiler traces" and traces["status"] == "done: ranks 0, 2"
    assert [t["text"].split(" (")[0] for t in traces["traces"]] == ["rank 0 trace", "rank 2 trace"]
    assert all(t["status"] == 200 and t["type"] == "application/gzip" for t in traces["traces"])
    assert "cdist" in traces["ops"][0][0] and float(traces["ops"][0][3]) > 5  # ms per step, slow rank 2


def test_the_button_asks_every_rank_for_its_stacks_now(seen: dict[str, Any]) -> None:
    """The hang's ranks were stopped once they had answered: the new command waits on all 4 of them."""
    asked = seen["runs"]["stacks"]["asked"]
    assert asked["title"].startswith("Stacks of every rank (asked ")
    assert asked["status"] == "waiting: ranks 0, 1, 2, 3"


def test_no_page_error_and_no_request_leaves_loopback(seen: dict[str, Any]) -> None:
    assert seen["pageErrors"] == [] and seen["consoleErrors"] == [] and seen["blocked"] == []
    for label in ("stacks", "traces"):
        assert (SCREENSHOTS / f"evidence-{label}.png").stat().st_size > 10_000
