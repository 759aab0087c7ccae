"""`stepwatch-server alerts test --channel NAME`: one test message, sent now, with the real transport.

It goes straight to the channel (not through the outbox: it needs no database and no running
collector), with the same rendering, signature and retries as real alerts, for at most
`TEST_DEADLINE_S`.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid

from stepwatch_server.alerts.config import AlertsConfig
from stepwatch_server.alerts.outbox import retry_delay_s
from stepwatch_server.alerts.render import Message, render
from stepwatch_server.alerts.transport import Result, post

TEST_DEADLINE_S = 30.0


def build_test_message(config: AlertsConfig, channel: str) -> Message:
    anomaly = {
        "id": 0,
        "run": "stepwatch-test",
        "kind": "straggler",
        "key": "rank:3",
        "status": "open",
        "severity": "info",
        "rank": 3,
        "node": "gpu-000",
        "first_step": 100,
        "last_step": 100,
        "detected_step": 100,
        "resolved_step": None,
        "summary": f"test message from stepwatch to channel {channel}: if you read this, alerts reach you",
        "evidence": {"phase": "forward", "ratio": 1.1},
    }
    key = f"swa_test_{uuid.uuid4().hex}"
    return Message(
        channel,
        "test",
        "stepwatch-test",
        "straggler",
        [anomaly],
        key,
        dt.datetime.now(dt.UTC),
        config.dashboard_url,
    )


def send_test(config: AlertsConfig, channel: str) -> Result:
    """Send the test message to `channel` (a KeyError when it is not configured), retrying as alerts do."""
    target = config.channels[channel]
    msg = build_test_message(config, channel)
    payload = render(target.type, msg)
    deadline = time.monotonic() + TEST_DEADLINE_S
    attempts = 0
    while True:
        attempts += 1
        result = post(target, payload, msg.idempotency_key, config.timeout_s)
        delay = retry_delay_s(attempts, config.max_backoff_s, result.retry_after_s)
        if result.ok or not result.retryable or time.monotonic() + delay > deadline:
            return result
        time.sleep(delay)
