"""Shared by the alert tests: configurations, feeding runs to a collector, waiting for deliveries."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stepwatch_server.simulate import Scenario, Simulation
from tests.alerts.receiver import Receiver
from tests.detect.service_helpers import batch, session
from tests.service.conftest import Collector

DELIVERY_WAIT_S = 60.0
SECRET = b"test-secret-0123456789"


def config_text(
    receiver: Receiver, *, window_s: float = 0.5, cooldown_s: float = 600, extra: str = ""
) -> str:
    """Two channels on `receiver`: Slack at /slack (warnings and worse), a signed webhook at /hook
    (critical nonfinite and hang only)."""
    return f"""\
version: 1
dashboard_url: http://dashboard.test:8000
grouping: {{window_s: {window_s}, cooldown_s: {cooldown_s}}}
delivery: {{timeout_s: 2, deadline_s: 300, max_backoff_s: 2}}
channels:
  team:
    type: slack
    url_env: SW_TEST_SLACK_URL
  pager:
    type: webhook
    url: {receiver.url("/hook")}
    secret_env: SW_TEST_HOOK_SECRET
{extra}routes:
  - match: {{min_severity: warning}}
    channels: [team]
  - match: {{kind: [nonfinite, hang], severity: critical}}
    channels: [pager]
"""


def feed(collector: Collector, scenario: Scenario) -> None:
    for doc in Simulation(scenario):
        response = collector.post(doc)
        assert response.status_code == 200, response.text


def settled(collector: Collector) -> dict[str, Any]:
    """GET /api/v1/alerts once detection is done and no delivery or event is pending any more."""
    deadline = time.monotonic() + DELIVERY_WAIT_S
    while True:
        detection = collector.get("/api/v1/detection")
        body: dict[str, Any] = collector.get("/api/v1/alerts", limit=1000)
        detected = detection["processed"] + detection["dropped"] >= detection["submitted"]
        idle = detection["queue_depth"] == 0 and detection["anomalies_unsaved"] == 0
        pending = body["pending_events"] or any(d["status"] == "pending" for d in body["deliveries"])
        assert body["worker"]["errors"] == 0, body
        if detected and idle and not pending and not body["worker"]["in_flight"]:
            return body
        assert time.monotonic() < deadline, f"alerts did not settle: {body}"
        time.sleep(0.1)


def nan_batch(run: str, steps: int = 10, bad_step: int = 5) -> dict[str, Any]:
    """One rank's batch whose loss is Inf at `bad_step`: a critical run-wide `nonfinite` in `run`."""
    loss: list[Any] = [2.0] * steps
    loss[bad_step - 1] = "Infinity"
    return batch(run, session(), 0, 0, 1, list(range(1, steps + 1)), loss=loss)


def post_nan_runs(post: Callable[[dict[str, Any]], Any], runs: list[str]) -> None:
    for run in runs:
        response = post(nan_batch(run))
        assert response.status_code == 200, response.text
