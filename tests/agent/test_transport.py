"""A slow, failing or absent collector never hurts the run; spooled batches come back in order."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import stepwatch
from stepwatch._guard import Counters
from stepwatch._transport import Outcome, Transport

from .conftest import Receiver, free_port, make_model, train
from .contract import validate


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def test_receiver_answering_500_does_not_hurt_training(receiver: Receiver, fast: dict[str, Any]) -> None:
    receiver.respond = lambda batch, headers: (500, {}, {"detail": "boom"})
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="five-hundred", url=receiver.url, **fast)
    losses = train(model, opt, 40)
    watch.close(timeout_s=1)
    stats = watch.stats()
    assert len(losses) == 40
    assert stats["send_failures"] >= 1 and stats["spooled_batches"] >= 1 and stats["sent_batches"] == 0
    assert stats["retries"] == 0  # a 500 is not hammered; the batch waits in the spool
    assert list((fast["spool_dir"] / "five-hundred" / "rank-0").glob("*.json.gz"))


def test_receiver_that_times_out_does_not_hurt_training(receiver: Receiver, fast: dict[str, Any]) -> None:
    receiver.respond = lambda batch, headers: "hang"
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="hang", url=receiver.url, **dict(fast, timeout_s=0.2))
    start = time.monotonic()
    train(model, opt, 150, between=lambda _: time.sleep(0.005))
    elapsed = time.monotonic() - start
    watch.close(timeout_s=0.5)
    stats = watch.stats()
    assert elapsed < 5
    assert stats["retries"] >= 1 and stats["send_failures"] >= 1 and stats["spooled_batches"] >= 1


def test_refused_connection_does_not_hurt_training(fast: dict[str, Any]) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="refused", url=f"http://127.0.0.1:{free_port()}", **fast)
    train(model, opt, 40, between=lambda _: time.sleep(0.005))
    watch.close(timeout_s=0.5)
    stats = watch.stats()
    assert stats["send_failures"] >= 1 and stats["spooled_batches"] >= 1 and stats["heartbeat_failures"] >= 1
    assert stats["sent_batches"] == 0 and stats["internal_errors"] == 0


def test_collector_down_then_up_every_step_arrives_in_order(fast: dict[str, Any]) -> None:
    port = free_port()
    model, opt = make_model()
    opts = dict(fast, timeout_s=0.1)  # a short per-batch deadline: batches go to the spool quickly
    watch = stepwatch.attach(model, opt, run="down-up", url=f"http://127.0.0.1:{port}", **opts)
    times: dict[str, list[float]] = {"down": [], "up": []}
    state = {"phase": "down", "t": time.perf_counter()}
    receiver = Receiver(port)

    def between(step: int) -> None:
        now = time.perf_counter()
        times[state["phase"]].append(now - state["t"])  # type: ignore[arg-type]
        state["t"] = now
        time.sleep(0.004)
        if step == 150:
            receiver.start()
            state["phase"] = "up"

    try:
        train(model, opt, 300, between=between)
        assert watch.stats()["spooled_batches"] >= 1
        watch.close(timeout_s=5)
        data = receiver.data_batches()
        for batch in data:
            validate(batch)
        assert receiver.steps() == list(range(1, 301))  # all of them, in order, once
        assert [b["seq"] for b in data] == sorted(b["seq"] for b in data)
        assert watch.stats()["replayed_batches"] >= 1
        assert not list((fast["spool_dir"] / "down-up" / "rank-0").glob("*.json.gz"))
        print(
            f"median loop time down {_median(times['down']) * 1e3:.2f} ms, up {_median(times['up']) * 1e3:.2f} ms"
        )
        assert _median(times["down"]) < 3 * _median(times["up"]) + 0.005
    finally:
        receiver.stop()


def test_a_new_session_replays_the_spool_of_an_earlier_one(fast: dict[str, Any]) -> None:
    port = free_port()
    model, opt = make_model()
    first = stepwatch.attach(model, opt, run="resume", url=f"http://127.0.0.1:{port}", **fast)
    train(model, opt, 30)
    first.close(timeout_s=0.5)
    spooled = sorted((fast["spool_dir"] / "resume" / "rank-0").glob("*.json.gz"))
    assert spooled and first.stats()["sent_batches"] == 0

    receiver = Receiver(port).start()
    try:
        second = stepwatch.attach(model, opt, run="resume", url=receiver.url, **fast)
        assert receiver.wait_for(lambda: first.session in {b["session"] for b in receiver.accepted()}, 5)
        train(model, opt, 5)
        second.close(timeout_s=5)
        data = receiver.data_batches()
        sessions = [b["session"] for b in data]
        assert sessions.index(second.session) > max(i for i, s in enumerate(sessions) if s == first.session)
        assert [s for b in data if b["session"] == first.session for s in b["steps"]] == list(range(1, 31))
        assert [s for b in data if b["session"] == second.session for s in b["steps"]] == [1, 2, 3, 4, 5]
        assert second.stats()["replayed_batches"] == len(spooled)
        assert not any(p.exists() for p in spooled)
    finally:
        receiver.stop()


def test_429_retry_after_is_honoured(receiver: Receiver, fast: dict[str, Any]) -> None:
    seen: list[int] = []

    def respond(batch: dict[str, Any], headers: dict[str, str]) -> Any:
        if batch["steps"] and not seen:
            seen.append(batch["seq"])
            return (429, {"Retry-After": "1"}, {"error": {"message": "slow down"}})
        return None

    receiver.respond = respond
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="polite", url=receiver.url, **dict(fast, timeout_s=1.0))
    train(model, opt, 10)
    with watch.phase("idle"):  # a known pause hands the finished steps to the sender
        assert receiver.wait_for(lambda: len(receiver.steps()) == 10, 10)
    watch.close(timeout_s=5)
    first = [r for r in receiver.requests if r["batch"]["steps"] and r["batch"]["seq"] == seen[0]]
    assert [r["status"] for r in first] == [429, 200]
    assert first[1]["t"] - first[0]["t"] >= 0.95
    assert watch.stats()["retries"] == 1
    assert receiver.steps() == list(range(1, 11))


def test_4xx_is_counted_logged_once_never_retried_and_kept_aside(
    receiver: Receiver, fast: dict[str, Any], stepwatch_log: Any
) -> None:
    error = {"error": {"code": "invalid", "field": "metrics.loss[3]", "message": "expected a number"}}
    receiver.respond = lambda batch, headers: (422, {}, error) if batch["steps"] else None
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="rejected", url=receiver.url, token="s3cret", **fast)
    for _ in range(3):
        train(model, opt, 10)
        time.sleep(0.15)
    watch.close(timeout_s=2)
    stats = watch.stats()
    keys = [(r["batch"]["session"], r["batch"]["seq"]) for r in receiver.requests if r["batch"]["steps"]]
    assert len(keys) == len(set(keys)) >= 2  # each batch tried once
    assert stats["rejected_batches"] == len(keys) and stats["retries"] == 0 and stats["spooled_batches"] == 0
    assert stats["quarantined_batches"] == len(keys) == len(_quarantined(fast, "rejected"))  # kept on disk
    assert all(r["headers"]["authorization"] == "Bearer s3cret" for r in receiver.requests)
    rejected = [r.getMessage() for r in stepwatch_log.records if "rejected" in r.getMessage()]
    assert len(rejected) == 1 and "metrics.loss[3]: expected a number" in rejected[0]


def test_the_quarantine_keeps_the_newest_batches_only(receiver: Receiver, fast: dict[str, Any]) -> None:
    """A collector refusing every batch cannot fill the disk: every refused batch is counted, and the
    quarantine keeps the newest QUARANTINE_FILES of them, each beside its reason, the older ones deleted."""
    from stepwatch._spool import QUARANTINE_FILES

    receiver.respond = lambda batch, headers: (
        (422, {}, {"error": {"message": "no"}}) if batch["steps"] else None
    )
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="quarantine-cap", url=receiver.url, **fast)
    for _ in range(QUARANTINE_FILES + 12):  # about one batch a round (flush every 0.05 s)
        train(model, opt, 2)
        time.sleep(0.07)
    watch.close(timeout_s=5)
    sent = sorted(
        (r["batch"]["seq"], tuple(r["batch"]["steps"])) for r in receiver.requests if r["batch"]["steps"]
    )
    assert len(sent) > QUARANTINE_FILES
    assert watch.stats()["quarantined_batches"] == len(sent)
    files = _quarantined(fast, "quarantine-cap")
    assert len(files) == QUARANTINE_FILES
    assert all(f.with_name(f.name + ".reason.txt").exists() for f in files)
    assert len(list(files[0].parent.glob("*.reason.txt"))) == QUARANTINE_FILES  # none left behind
    kept = sorted(tuple(json.loads(gzip.decompress(f.read_bytes()))["steps"]) for f in files)
    assert kept == sorted(steps for _, steps in sent[-QUARANTINE_FILES:])  # the newest


def test_close_returns_within_its_deadline_when_the_receiver_hangs(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="deadline", url=receiver.url, **dict(fast, timeout_s=5.0))
    train(model, opt, 20)
    receiver.respond = lambda batch, headers: "hang"
    train(model, opt, 20)
    time.sleep(0.2)  # the sender is now stuck in a request to the hanging receiver
    start = time.monotonic()
    watch.close(timeout_s=1.0)
    assert time.monotonic() - start < 1.0 + 0.5


def test_spool_stays_within_its_bound(fast: dict[str, Any], tmp_path: Path) -> None:
    model, opt = make_model(width=64)
    opts = dict(fast, max_spool_mb=0.002, amax_every=1)  # ~2 KB: a couple of batches at most
    watch = stepwatch.attach(model, opt, run="bounded", url=f"http://127.0.0.1:{free_port()}", **opts)
    train(model, opt, 100, between=lambda _: time.sleep(0.003))
    watch.close(timeout_s=0.5)
    directory = fast["spool_dir"] / "bounded" / "rank-0"
    assert sum(p.stat().st_size for p in directory.glob("*.json.gz")) <= 0.002 * 2**20
    assert watch.stats()["dropped_spool_full"] >= 1
    assert not [p for p in directory.iterdir() if p.name.startswith(".")]  # no temporary files left
    assert os.access(directory, os.W_OK)


class _KeepAlive:
    """An HTTP/1.1 server on loopback that keeps connections open, counts them, and can drop them all
    (as a collector closes idle ones)."""

    def __init__(self) -> None:
        owner = self
        self.connections = 0
        self.requests = 0
        self.sockets: list[Any] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                owner.connections += 1
                owner.sockets.append(self.connection)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                owner.requests += 1
                body = b'{"accepted": true}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/ingest"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})
        self.thread.start()

    def drop_connections(self) -> None:
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.sockets.clear()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def test_batches_share_one_kept_alive_connection_and_survive_the_collector_closing_it() -> None:
    server = _KeepAlive()
    transport = Transport(server.url, None, 2.0, threading.Event(), Counters())
    try:
        results = [transport.post_once(b"x" * 100, 2.0).outcome for _ in range(20)]
        assert results == [Outcome.SENT] * 20 and server.requests == 20
        assert server.connections == 1 and transport.connections == 1  # one TCP handshake, not 20
        server.drop_connections()  # the collector closes the idle connection
        time.sleep(0.1)
        assert transport.post_once(b"y", 2.0).outcome is Outcome.SENT  # sent again on a new one
        assert server.requests == 21 and transport.connections == 2
    finally:
        transport.close()
        server.stop()


def _quarantined(fast: dict[str, Any], run: str) -> list[Path]:
    return sorted((fast["spool_dir"] / run / "rank-0" / "quarantine").glob("*.json.gz"))


@pytest.mark.parametrize(
    "answer", [b"not json", b'{"accepted": false}', b"{}"], ids=["garbage", "accepted-false", "empty-object"]
)
def test_a_2xx_without_the_acknowledgement_is_not_a_delivery(
    receiver: Receiver, fast: dict[str, Any], stepwatch_log: Any, answer: bytes
) -> None:
    """Only `{"accepted": true}` counts as delivered; any other 2xx keeps the batch in the spool, is said
    once, and everything arrives once a collector acknowledges."""
    receiver.respond = lambda batch, headers: (200, {}, answer)
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="no-ack", url=receiver.url, **fast)
    train(model, opt, 30)
    with watch.phase("idle"):  # a known pause hands the finished steps to the sender
        assert receiver.wait_for(lambda: watch.stats()["spooled_batches"] >= 1, 10)
        assert watch.stats()["sent_batches"] == 0
        receiver.respond = lambda batch, headers: None
        assert receiver.wait_for(lambda: receiver.steps() == list(range(1, 31)), 15)
    watch.close(timeout_s=5)
    said = [r.getMessage() for r in stepwatch_log.records if "acknowledgement" in r.getMessage()]
    assert len(said) == 1 and "spool" in said[0]
    assert watch.stats()["quarantined_batches"] == 0


def test_a_redirect_keeps_the_batches_and_is_said_once(
    receiver: Receiver, fast: dict[str, Any], stepwatch_log: Any
) -> None:
    """A 301 dropped every batch; now the batches wait in the spool, the redirect is said once with its
    target, and they arrive when the collector answers at that URL again."""
    target = "http://collector.example:8000/api/v1/ingest"
    receiver.respond = lambda batch, headers: (301, {"Location": target}, {})
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="moved", url=receiver.url, **fast)
    train(model, opt, 30)
    with watch.phase("idle"):
        assert receiver.wait_for(lambda: watch.stats()["spooled_batches"] >= 1, 10)
        receiver.respond = lambda batch, headers: None
        assert receiver.wait_for(lambda: receiver.steps() == list(range(1, 31)), 15)
    watch.close(timeout_s=5)
    said = [r.getMessage() for r in stepwatch_log.records if "redirect" in r.getMessage()]
    assert len(said) == 1 and target in said[0] and "301" in said[0]
    assert watch.stats()["rejected_batches"] == 0


@pytest.mark.parametrize(
    ("status", "fix"),
    [(404, "base address"), (405, "base address"), (401, "STEPWATCH_TOKEN"), (403, "STEPWATCH_TOKEN")],
)
def test_a_wrong_url_or_token_keeps_every_batch_says_the_fix_once_and_all_arrive_once_fixed(
    receiver: Receiver, fast: dict[str, Any], stepwatch_log: Any, status: int, fix: str
) -> None:
    """A 404 from a wrong URL (or a 401/403 for the token) refuses every batch alike: not the batch's fault,
    so nothing is set aside or dropped; the batches wait in the spool and arrive once the set-up is right."""
    error = {"error": {"code": "x", "field": None, "message": "refused"}}
    receiver.respond = lambda batch, headers: (status, {}, error)
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run=f"set-up-{status}", url=receiver.url, **fast)
    train(model, opt, 30)
    with watch.phase("idle"):
        assert receiver.wait_for(lambda: watch.stats()["spooled_batches"] >= 1, 10)
        receiver.respond = lambda batch, headers: None  # the set-up is fixed
        assert receiver.wait_for(lambda: receiver.steps() == list(range(1, 31)), 15)
    watch.close(timeout_s=5)
    stats = watch.stats()
    assert stats["rejected_batches"] == 0 and stats["quarantined_batches"] == 0 and stats["retries"] == 0
    said = [r for r in stepwatch_log.records if str(status) in r.getMessage() and fix in r.getMessage()]
    assert len(said) == 1 and said[0].levelno >= logging.WARNING, [
        r.getMessage() for r in stepwatch_log.records
    ]


def test_a_batch_that_always_gets_a_500_is_set_aside_and_the_rest_arrive(
    receiver: Receiver, fast: dict[str, Any], stepwatch_log: Any
) -> None:
    """One poisoned batch (the collector answers it 500 every time) used to block every batch behind it
    for good; it is quarantined on disk after MAX_ANSWERED_FAILURES answers and the others go on."""
    from stepwatch._sender import MAX_ANSWERED_FAILURES

    poisoned: list[int] = []

    def respond(batch: dict[str, Any], headers: dict[str, str]) -> Any:
        if batch["steps"] and (not poisoned or batch["steps"][0] == poisoned[0]):
            poisoned[:1] = [batch["steps"][0]]
            return (500, {}, {"error": {"message": "a server bug"}})
        return None

    receiver.respond = respond
    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="poison", url=receiver.url, **fast)
    train(model, opt, 60, between=lambda _: time.sleep(0.01))
    with watch.phase("idle"):
        receiver.wait_for(lambda: watch.stats()["quarantined_batches"] == 1, 20)
    watch.close(timeout_s=5)
    stats = watch.stats()
    assert stats["quarantined_batches"] == 1
    files = _quarantined(fast, "poison")
    assert len(files) == 1
    reason = files[0].with_name(files[0].name + ".reason.txt").read_text()
    assert reason.startswith("500") and "a server bug" in reason
    set_aside = set(json.loads(gzip.decompress(files[0].read_bytes()))["steps"])
    assert poisoned[0] in set_aside
    assert sorted(set(receiver.steps()) | set_aside) == list(range(1, 61))  # every other step arrived
    tries = [r for r in receiver.requests if r["batch"]["steps"] and r["batch"]["steps"][0] == poisoned[0]]
    assert len(tries) == 1 + MAX_ANSWERED_FAILURES  # sent once, then tried again from the spool
    assert any("set aside" in r.getMessage() for r in stepwatch_log.records)


def test_a_collector_answering_a_byte_at_a_time_cannot_hold_the_sender(
    receiver: Receiver, fast: dict[str, Any]
) -> None:
    """Every request has a total deadline (`timeout_s`): a collector that drips its answer keeps each
    read alive, but the batch is given up on by the deadline and spooled, and training never waits."""
    receiver.respond = lambda batch, headers: "drip"
    transport = Transport(receiver.url + "/api/v1/ingest", None, 0.5, threading.Event(), Counters())
    start = time.monotonic()
    result = transport.post_once(gzip.compress(b'{"steps": []}'), 0.5)
    assert time.monotonic() - start < 0.5 + 0.5
    assert result.outcome is Outcome.UNAVAILABLE and "timed out" in result.message

    model, opt = make_model()
    watch = stepwatch.attach(model, opt, run="drip", url=receiver.url, **dict(fast, timeout_s=0.5))
    start = time.monotonic()
    train(model, opt, 100, between=lambda _: time.sleep(0.005))
    assert time.monotonic() - start < 5
    assert receiver.wait_for(lambda: watch.stats()["spooled_batches"] >= 1, 10)
    watch.close(timeout_s=1.0)
    assert watch.stats()["sent_batches"] == 0


def test_ranks_spread_over_several_collectors_and_fail_over_to_the_next(fast: dict[str, Any]) -> None:
    """url lists two collectors: rank r starts on the (r mod 2)-th; a rank whose collector cannot be
    reached moves to the next, and its batches arrive there."""
    first, second = Receiver().start(), Receiver().start()
    try:
        both = f"{first.url},{second.url}"
        body = gzip.compress(json.dumps({"steps": []}).encode())
        for rank, expected in ((0, first), (1, second), (2, first)):
            transport = Transport(
                [u + "/api/v1/ingest" for u in both.split(",")],
                None,
                2.0,
                threading.Event(),
                Counters(),
                rank,
            )
            assert transport.url == expected.url + "/api/v1/ingest"
            assert transport.post_once(body, 2.0).outcome is Outcome.SENT
        dead = f"http://127.0.0.1:{free_port()}"
        model, opt = make_model()
        watch = stepwatch.attach(model, opt, run="failover", url=f"{dead},{second.url}", **fast)
        train(model, opt, 20, between=lambda _: time.sleep(0.005))
        watch.close(timeout_s=5)
        stats = watch.stats()
        assert stats["failovers"] >= 1 and stats["sent_batches"] >= 1 and stats["dropped_unsent"] == 0
        steps = sorted(s for b in second.data_batches() if b["run"] == "failover" for s in b["steps"])
        assert steps == list(range(1, 21))  # every step, on the collector that was up
    finally:
        first.stop()
        second.stop()
