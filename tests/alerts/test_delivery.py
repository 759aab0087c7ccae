"""Delivery against a real receiver: down for 30 s then up (everything arrives, once per idempotency
key), 429 + Retry-After honoured, a permanent error given up at once, the per-channel rate limit."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from stepwatch_server.alerts import load_config
from stepwatch_server.alerts.transport import redact
from tests.alerts.conftest import write_config
from tests.alerts.helpers import config_text, post_nan_runs, settled
from tests.alerts.receiver import Receiver
from tests.service.conftest import Collector

DOWN_S = 30.0


@pytest.mark.parametrize("backend", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_receiver_down_for_30_s_then_everything_arrives_once(
    start_collector: Callable[..., Collector], receiver: Receiver, secrets: dict[str, str], tmp_path: Path
) -> None:
    receiver.stop()
    down_at = time.monotonic()
    collector = start_collector(alerts=load_config(write_config(tmp_path, config_text(receiver))))
    runs = [f"down-{i}" for i in range(4)]
    post_nan_runs(collector.post, runs)  # 4 critical NaNs: each to the Slack and the webhook channel
    deadline = time.monotonic() + DOWN_S
    while True:  # every message composed and failed at least once while the receiver is down
        deliveries = collector.get("/api/v1/alerts")["deliveries"]
        assert collector.get("/api/v1/alerts")["worker"]["errors"] == 0
        if len(deliveries) == 8 and all(d["attempts"] >= 2 for d in deliveries):
            break
        assert time.monotonic() < deadline, deliveries
        time.sleep(0.2)
    assert {d["status"] for d in deliveries} == {"pending"}
    assert all("cannot connect" in d["last_error"] for d in deliveries), deliveries
    time.sleep(max(0.0, DOWN_S - (time.monotonic() - down_at)))
    receiver.start()  # same port

    log = settled(collector)["deliveries"]
    assert {d["status"] for d in log} == {"delivered"} and len(log) == 8
    keys = Counter(r.key for r in receiver.received)
    assert keys == Counter({d["idempotency_key"]: 1 for d in log})  # each message exactly once
    assert sorted(r.json["run"] for r in receiver.on("/hook")) == runs
    assert all(d["attempts"] >= 3 for d in log)  # retried with backoff (max 2 s) through the 30 s
    assert time.monotonic() - down_at < DOWN_S + 15  # failed attempts did not use up the rate limit


def webhook_only(receiver: Receiver, max_per_minute: int = 20) -> str:
    return f"""\
version: 1
grouping: {{window_s: 0}}
delivery: {{timeout_s: 2, deadline_s: 60, max_backoff_s: 1}}
channels:
  pager:
    type: webhook
    url: {receiver.url("/hook")}
    secret_env: SW_TEST_HOOK_SECRET
    max_per_minute: {max_per_minute}
routes:
  - channels: pager
"""


def test_429_retry_after_is_honoured_and_a_404_is_given_up(
    start_collector: Callable[..., Collector], receiver: Receiver, secrets: dict[str, str], tmp_path: Path
) -> None:
    collector = start_collector(alerts=load_config(write_config(tmp_path, webhook_only(receiver))))
    receiver.script = [(429, {"Retry-After": "3"})]
    post_nan_runs(collector.post, ["limited"])
    first = settled(collector)["deliveries"]
    assert [(d["status"], d["attempts"], d["last_status_code"]) for d in first] == [("delivered", 2, 200)]
    tries = receiver.on("/hook")
    assert [t.answered for t in tries] == [429, 200] and tries[0].key == tries[1].key
    assert tries[1].at - tries[0].at >= 3.0  # never earlier than Retry-After (backoff alone: <= 1 s)

    receiver.script = [(404, {})]
    post_nan_runs(collector.post, ["gone"])
    gone = next(d for d in settled(collector)["deliveries"] if d["run"] == "gone")
    assert (gone["status"], gone["attempts"], gone["last_status_code"]) == ("failed", 1, 404)
    assert gone["last_error"].startswith("HTTP 404")


def test_a_failure_keeps_no_secret_of_the_channel_url_where_the_api_shows_it(
    start_collector: Callable[..., Collector], receiver: Receiver, secrets: dict[str, str], tmp_path: Path
) -> None:
    """A receiver's error body that echoes the webhook's path and query (a Slack hook's path is its
    secret, `?api_key=` another) was stored as `last_error` and shown by `GET /api/v1/alerts`, which
    needs no token: only the status and its standard reason are kept now."""
    text = webhook_only(receiver).replace("/hook", "/services/T0/SECRETPATH?api_key=SECRETKEY")
    collector = start_collector(alerts=load_config(write_config(tmp_path, text)))
    receiver.echo = True
    receiver.script = [(403, {})]
    post_nan_runs(collector.post, ["leaky"])
    failed = next(d for d in settled(collector)["deliveries"] if d["run"] == "leaky")
    assert (failed["status"], failed["last_status_code"]) == ("failed", 403)
    assert failed["last_error"] == "HTTP 403 Forbidden"
    assert b"SECRETKEY" in receiver.received[0].path.encode()  # the receiver did see (and echo) it
    shown = collector.http.get("/api/v1/alerts").text
    assert "SECRET" not in shown


def test_messages_that_quote_the_channel_url_are_redacted() -> None:
    url = "https://hooks.slack.example/services/T0/SECRETPATH?api_key=SECRETKEY"
    for message in (
        f"bad channel url: unknown url type: {url!r}",
        "cannot connect: /services/T0/SECRETPATH?api_key=SECRETKEY refused",
        "GET /services/T0/SECRETPATH failed; api_key=SECRETKEY",
    ):
        assert "SECRET" not in redact(message, url), message
    assert redact("cannot connect: [Errno 111] Connection refused", url) == (
        "cannot connect: [Errno 111] Connection refused"
    )


def test_rate_limit_holds_back_what_exceeds_it(
    start_collector: Callable[..., Collector], receiver: Receiver, secrets: dict[str, str], tmp_path: Path
) -> None:
    config = load_config(write_config(tmp_path, webhook_only(receiver, max_per_minute=2)))
    collector = start_collector(alerts=config)
    post_nan_runs(collector.post, [f"flood-{i}" for i in range(5)])
    receiver.wait_for(lambda: len(receiver.received) >= 2, 20.0, "the first two messages")
    deadline = time.monotonic() + 20.0
    while True:
        body = collector.get("/api/v1/alerts")
        if len(body["deliveries"]) == 5 and body["worker"]["rate_limited"] >= 3:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.1)
    held = [d for d in body["deliveries"] if d["status"] == "pending"]
    assert len(held) == 3 and len(receiver.received) == 2
    now = dt.datetime.now(dt.UTC)
    assert all(dt.datetime.fromisoformat(d["next_attempt_at"]) > now + dt.timedelta(seconds=40) for d in held)
