"""Polite HTTP: retries with exponential backoff and jitter, Retry-After, a deadline per batch."""

from __future__ import annotations

import contextlib
import enum
import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ._guard import Counters

RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})
# Answers that refuse every batch alike: the token (401, 403) or the URL (404, 405) is wrong, not the batch.
# The batches wait in the spool for the set-up to be fixed; nothing is set aside.
SET_UP_STATUSES = frozenset({401, 403, 404, 405})
BACKOFF_BASE_S = 0.25
MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 300.0
MAX_ANSWER_BYTES = 64 * 1024


class Outcome(enum.Enum):
    SENT = "sent"  # 2xx with the documented acknowledgement: the collector has the batch
    REJECTED = "rejected"  # a 4xx about the batch (400, 413, 415, 422, ...): never retried, set aside
    # Down, overloaded, timed out, a 5xx, a redirect, a 2xx that is no acknowledgement, or a wrong token or
    # URL (SET_UP_STATUSES): keep the batch.
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    status: int | None = None
    message: str = ""
    retry_after_s: float | None = None
    location: str | None = None  # where a redirect points
    answer: dict[str, Any] | None = None  # the acknowledgement (SENT): commands for this rank ride on it

    @property
    def server_error(self) -> bool:
        """A 5xx other than "try later" (502-504): the collector failed on this batch, and sending the
        same batch again may never work (a redirect or a missing acknowledgement is the set-up's fault,
        not the batch's: those batches wait in the spool)."""
        return self.status is not None and self.status >= 500 and self.status not in RETRY_STATUSES


def _acknowledged(body: bytes) -> dict[str, Any] | None:
    """The documented acknowledgement (docs/ingest.md), a JSON object with `"accepted": true`; else None."""
    try:
        answer = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return answer if isinstance(answer, dict) and answer.get("accepted") is True else None


def backoff_s(attempt: int) -> float:
    """Exponential backoff with jitter, so that many ranks do not retry in lock-step."""
    return min(MAX_BACKOFF_S, BACKOFF_BASE_S * 2**attempt) * random.uniform(0.5, 1.0)


def _retry_after(value: str | None) -> float | None:
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(value))) if value is not None else None
    except ValueError:  # an HTTP date: fall back to our own backoff
        return None


def _shut(conn: http.client.HTTPConnection, sent_on: list[socket.socket]) -> None:
    """The request's deadline passed: end the blocked connect, send or read (from the watchdog's
    thread). An answer that closes the connection has been handed the socket (`conn.sock` is None
    then): the socket the request went out on is the one to shut."""
    sock = sent_on[0] if sent_on else conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _excerpt(body: bytes) -> str:
    return repr(body[:80].decode("utf-8", "replace")) + ("..." if len(body) > 80 else "")


def _message(status: int, body: bytes) -> str:
    try:
        error = json.loads(body.decode("utf-8"))["error"]
        return f"{status} {error.get('field') or ''}: {error['message']}".replace(" :", ":")
    except Exception:
        return f"{status} {body[:300].decode('utf-8', 'replace').strip()}"


FAILOVER_STATUSES = frozenset({502, 503, 504})  # with no answer at all: try the next collector URL


class Transport:
    """POSTs gzip JSON bodies to `{url}/api/v1/ingest` over one kept-alive connection (sender thread
    only). A connection the collector closed while idle is noticed on the next request, which is sent
    again at once on a new one; any other failure, a non-2xx answer or an answer that says it closes
    drops the connection.

    With several ingest URLs (replicas of one deployment) rank r starts on the (r mod n)-th, which
    spreads the ranks without a load balancer, and moves to the next one after an attempt that got no
    answer or a 502/503/504; it stays where it is while that one answers."""

    def __init__(
        self,
        ingest_urls: str | Sequence[str],
        token: str | None,
        timeout_s: float,
        stop: threading.Event,
        counters: Counters,
        rank: int = 0,
    ) -> None:
        self._urls = (ingest_urls,) if isinstance(ingest_urls, str) else tuple(ingest_urls)
        self._index = rank % len(self._urls)
        self._use(self._index)
        self._headers = {
            "Content-Type": "application/json",
            "Content-Encoding": "gzip",
            "User-Agent": "stepwatch-agent",
        }
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self.timeout_s = timeout_s
        self._stop = stop
        self._counters = counters
        self._conn: http.client.HTTPConnection | None = None
        self.connections = 0  # opened so far (tests/agent/test_transport.py)

    @property
    def url(self) -> str:
        """The ingest URL requests go to now."""
        return self._urls[self._index]

    def _use(self, index: int) -> None:
        parts = urlsplit(self._urls[index])
        self._index = index
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port
        self._path = parts.path
        self._api = parts.path.removesuffix("/ingest")  # the API's root, for the other endpoints

    def _fail_over(self) -> None:
        """The next URL, for the next attempt (a no-op with one)."""
        if len(self._urls) > 1:
            self.close()
            self._use((self._index + 1) % len(self._urls))
            self._counters.add("failovers")

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = self._conn = cls(self._host, self._port, timeout=timeout_s)
            self.connections += 1
        else:
            conn.timeout = timeout_s
            if conn.sock is not None:
                conn.sock.settimeout(timeout_s)
        return conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def post_once(self, body: bytes, timeout_s: float, endpoint: str | None = None) -> Result:
        """One request (two when a kept-alive connection turns out closed), over within `timeout_s` in
        all: a socket timeout bounds each read, and a watchdog shuts the socket down at the deadline,
        so that a collector answering a byte at a time cannot hold the sender. No answer, or a
        502/503/504: the next attempt goes to the next URL. `endpoint`: a path under the API's root
        (`/api/v1`) instead of ingest."""
        result = self._post_once(body, timeout_s, endpoint)
        if result.outcome is Outcome.UNAVAILABLE and (
            result.status is None or result.status in FAILOVER_STATUSES
        ):
            self._fail_over()
        return result

    def _post_once(self, body: bytes, timeout_s: float, endpoint: str | None = None) -> Result:
        timeout_s = max(0.05, timeout_s)
        end = time.monotonic() + timeout_s
        for attempt in range(2):
            reused = self._conn is not None
            conn = self._connection(max(0.05, end - time.monotonic()))
            sent_on: list[socket.socket] = []  # the socket the answer comes on (getresponse may let go of it)
            watchdog = threading.Timer(max(0.0, end - time.monotonic()), _shut, (conn, sent_on))
            watchdog.daemon = True
            watchdog.start()
            try:
                path = self._path if endpoint is None else f"{self._api}/{endpoint}"
                conn.request("POST", path, body=body, headers=self._headers)
                if conn.sock is not None:
                    sent_on.append(conn.sock)
                answer = conn.getresponse()
                data = answer.read(MAX_ANSWER_BYTES)
                if time.monotonic() >= end:  # cut short by the watchdog: whatever came is not the answer
                    self.close()
                    return Result(
                        Outcome.UNAVAILABLE, None, f"timed out: no whole answer within {timeout_s:.1f} s"
                    )
                status = answer.status
                ack = _acknowledged(data) if 200 <= status < 300 else None
                if ack is None or answer.will_close or not answer.isclosed():
                    self.close()  # a failure, a closing answer, or one longer than we read
                if ack is not None:
                    return Result(Outcome.SENT, status, answer=ack)
                if 200 <= status < 300:
                    return Result(
                        Outcome.UNAVAILABLE, status, f"{status} but no acknowledgement: {_excerpt(data)}"
                    )
                if 300 <= status < 400:
                    where = answer.getheader("Location")
                    return Result(Outcome.UNAVAILABLE, status, f"{status} redirect to {where}", None, where)
                if status in RETRY_STATUSES or status >= 500 or status in SET_UP_STATUSES:
                    return Result(
                        Outcome.UNAVAILABLE,
                        status,
                        _message(status, data),
                        _retry_after(answer.getheader("Retry-After")),
                    )
                return Result(Outcome.REJECTED, status, _message(status, data))
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self.close()
                if reused and attempt == 0 and time.monotonic() < end:  # closed while idle: a new one
                    continue
                return Result(Outcome.UNAVAILABLE, None, f"{type(exc).__name__}: {exc}")
            except (OSError, http.client.HTTPException) as exc:  # refused, timeout, DNS, bad answer
                self.close()
                late = time.monotonic() >= end
                kind = (
                    "timed out"
                    if late or isinstance(exc, socket.timeout | TimeoutError)
                    else type(exc).__name__
                )
                return Result(Outcome.UNAVAILABLE, None, f"{kind}: {exc}")
            finally:
                watchdog.cancel()
        raise AssertionError("unreachable")  # pragma: no cover

    def post(
        self,
        body: bytes,
        deadline: float,
        retry: bool = True,
        closing: bool = False,
        endpoint: str | None = None,
    ) -> Result:
        """Send until acknowledged, rejected or the deadline. Backoff sleeps end early when `stop` is
        set, except while closing: then `deadline` is close()'s own and bounds every sleep."""
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            result = self.post_once(body, min(self.timeout_s, remaining), endpoint)
            if result.outcome is not Outcome.UNAVAILABLE or not retry:
                return result
            # 500 and other unexpected 5xx: a server bug is not fixed by hammering; keep the batch.
            retryable = result.status is None or result.status in RETRY_STATUSES
            wait = result.retry_after_s if result.retry_after_s is not None else backoff_s(attempt)
            if not retryable or (self._stop.is_set() and not closing) or time.monotonic() + wait >= deadline:
                return result
            self._counters.add("retries")
            if closing:
                time.sleep(wait)
            elif self._stop.wait(wait):
                return result
            attempt += 1
