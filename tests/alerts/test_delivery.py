"""Delivery against a real receiver: down for 30 s then up (everything arrives, once per idempotency
key), 429 + Retry-After honoured, a permanent error given up at once, the per-channel rate limit."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stepwatch_server.alerts import load_config
from stepwatch_server.alerts.transport import redact
from tests.alerts.conftest import write_config
from tests.alerts.helpers import config_text, post_nan_runs, settled
from tests.alerts.receiver import Receiver
from tests.detect.service_helpers import batch, session
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
    while True:  # every message composed; each channel's first failed at least twice, the rest wait
        deliveries = collector.get("/api/v1/alerts")["deliveries"]
        assert collector.get("/api/v1/alerts")["worker"]["errors"] == 0
        firsts = {
            min((d["id"] for d in deliveries if d["channel"] == c), default=0) for c in ("team", "pager")
        }
        if len(deliveries) == 8 and all(d["attempts"] >= 2 for d in deliveries if d["id"] in firsts):
            break
        assert time.monotonic() < deadline, deliveries
        time.sleep(0.2)
    assert {d["status"] for d in deliveries} == {"pending"}
    tried = [d for d in deliveries if d["id"] in firsts]
    assert all("cannot connect" in d["last_error"] for d in tried), deliveries
    assert all(d["attempts"] == 0 for d in deliveries if d["id"] not in firsts), deliveries  # in order
    time.sleep(max(0.0, DOWN_S - (time.monotonic() - down_at)))
    receiver.start()  # same port

    log = settled(collector)["deliveries"]
    assert {d["status"] for d in log} == {"delivered"} and len(log) == 8
    keys = Counter(r.key for r in receiver.received)
    assert keys == Counter({d["idempotency_key"]: 1 for d in log})  # each message exactly once
    assert sorted(r.json["run"] for r in receiver.on("/hook")) == runs
    for channel, path in (("team", "/slack"), ("pager", "/hook")):  # each channel in the order written
        written = [
            d["idempotency_key"] for d in sorted(log, key=lambda d: d["id"]) if d["channel"] == channel
        ]
        assert [r.key for r in receiver.on(path)] == written
    assert all(d["attempts"] >= 3 for d in log if d["id"] in firsts)  # retried with backoff (max 2 s)
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
        held = [d for d in body["deliveries"] if d["status"] == "pending"]
        if len(body["deliveries"]) == 5 and any(d["next_attempt_at"] != d["created_at"] for d in held):
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.1)
    assert len(held) == 3 and len(receiver.received) == 2 and body["worker"]["rate_limited"] >= 1
    # The oldest held message waits for the limit to free up, and the others wait behind it.
    first = min(held, key=lambda d: d["id"])
    now = dt.datetime.now(dt.UTC)
    assert dt.datetime.fromisoformat(first["next_attempt_at"]) > now + dt.timedelta(seconds=40)
    assert all(d["attempts"] == 0 for d in held)


def _nan_then_clean(collector: Collector, run: str, after_first: Callable[[], None]) -> None:
    """A run-wide NaN (an open), then 30 clean steps (its resolve, after the detector's 20)."""
    sid = session()
    loss: list[Any] = [2.0] * 10
    loss[4] = "Infinity"
    assert collector.post(batch(run, sid, 0, 0, 1, list(range(1, 11)), loss=loss)).status_code == 200
    after_first()
    clean = batch(run, sid, 1, 0, 1, list(range(11, 41)), loss=[2.0] * 30)
    assert collector.post(clean).status_code == 200


def test_a_resolve_waits_for_its_open_while_the_open_waits_out_a_retry(
    start_collector: Callable[..., Collector], receiver: Receiver, secrets: dict[str, str], tmp_path: Path
) -> None:
    """The receiver fails the open once (503, Retry-After 3 s) and the resolve is composed meanwhile, due
    at once. A claim that took any due row sent the resolve first; only a channel's oldest pending
    message may go, so the channel waits for the open's retry."""
    collector = start_collector(alerts=load_config(write_config(tmp_path, webhook_only(receiver))))
    receiver.script = [(503, {"Retry-After": "3"})]
    _nan_then_clean(
        collector,
        "flaky",
        lambda: receiver.wait_for(lambda: len(receiver.received) >= 1, 20.0, "the open's first attempt"),
    )
    log = {d["event"]: d for d in settled(collector)["deliveries"]}
    assert sorted(log) == ["open", "resolve"] and {d["status"] for d in log.values()} == {"delivered"}
    # The case at issue: the resolve was written (and due) before the open's retry went out.
    assert log["resolve"]["created_at"] < log["open"]["delivered_at"]
    hooks = receiver.on("/hook")
    assert [(h.json["event"], h.answered) for h in hooks] == [("open", 503), ("open", 200), ("resolve", 200)]


def test_a_channel_waiting_out_a_retry_does_not_hold_back_another_channel(
    start_collector: Callable[..., Collector], receiver: Receiver, secrets: dict[str, str], tmp_path: Path
) -> None:
    """`pager` answers 503 with Retry-After 20 s: its messages wait, `other` (another receiver) gets its
    open and its resolve meanwhile."""
    other = Receiver().start()
    try:
        text = webhook_only(receiver).replace(
            "routes:",
            f"  other:\n    type: webhook\n    url: {other.url('/other')}\n"
            "    secret_env: SW_TEST_HOOK_SECRET\nroutes:",
        )
        text = text.replace("channels: pager", "channels: [pager, other]")
        collector = start_collector(alerts=load_config(write_config(tmp_path, text)))
        receiver.script = [(503, {"Retry-After": "20"})]
        _nan_then_clean(
            collector,
            "stuck",
            lambda: receiver.wait_for(lambda: bool(receiver.received), 20.0, "pager's open"),
        )
        other.wait_for(lambda: len(other.received) >= 2, 15.0, "other's open and resolve")
        assert [r.json["event"] for r in other.received] == ["open", "resolve"]
        assert [(r.json["event"], r.answered) for r in receiver.on("/hook")] == [("open", 503)]
    finally:
        other.stop()
