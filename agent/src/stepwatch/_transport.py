"""Polite HTTP: retries with exponential backoff and jitter, Retry-After, a deadline per batch."""

from __future__ import annotations

import enum
import http.client
import json
import random
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from ._guard import Counters

RETRY_STATUSES = frozenset({429, 502, 503, 504})
BACKOFF_BASE_S = 0.25
MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 300.0
MAX_ANSWER_BYTES = 64 * 1024


class Outcome(enum.Enum):
    SENT = "sent"  # 2xx: the collector has the batch
    REJECTED = "rejected"  # a 4xx (or 3xx): the batch is bad or unauthorised; never retried
    UNAVAILABLE = "unavailable"  # down, overloaded, timed out or a 5xx: keep the batch for later


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    status: int | None = None
    message: str = ""
    retry_after_s: float | None = None


def backoff_s(attempt: int) -> float:
    """Exponential backoff with jitter, so that many ranks do not retry in lock-step."""
    return min(MAX_BACKOFF_S, BACKOFF_BASE_S * 2**attempt) * random.uniform(0.5, 1.0)


def _retry_after(value: str | None) -> float | None:
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(value))) if value is not None else None
    except ValueError:  # an HTTP date: fall back to our own backoff
        return None


def _message(status: int, body: bytes) -> str:
    try:
        error = json.loads(body.decode("utf-8"))["error"]
        return f"{status} {error.get('field') or ''}: {error['message']}".replace(" :", ":")
    except Exception:
        return f"{status} {body[:300].decode('utf-8', 'replace').strip()}"


class Transport:
    """POSTs gzip JSON bodies to `{url}/api/v1/ingest` over one kept-alive connection (sender thread
    only). A connection the collector closed while idle is noticed on the next request, which is sent
    again at once on a new one; any other failure, a non-2xx answer or an answer that says it closes
    drops the connection."""

    def __init__(
        self, ingest_url: str, token: str | None, timeout_s: float, stop: threading.Event, counters: Counters
    ) -> None:
        parts = urlsplit(ingest_url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port
        self._path = parts.path
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

    def post_once(self, body: bytes, timeout_s: float) -> Result:
        timeout_s = max(0.05, timeout_s)
        for attempt in range(2):
            reused = self._conn is not None
            conn = self._connection(timeout_s)
            try:
                conn.request("POST", self._path, body=body, headers=self._headers)
                answer = conn.getresponse()
                data = answer.read(MAX_ANSWER_BYTES)
                status = answer.status
                if not 200 <= status < 300 or answer.will_close or not answer.isclosed():
                    self.close()  # a failure, a closing answer, or one longer than we read
                if 200 <= status < 300:
                    return Result(Outcome.SENT, status)
                if status in RETRY_STATUSES or status >= 500:
                    return Result(
                        Outcome.UNAVAILABLE,
                        status,
                        _message(status, data),
                        _retry_after(answer.getheader("Retry-After")),
                    )
                return Result(Outcome.REJECTED, status, _message(status, data))
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self.close()
                if reused and attempt == 0:  # the collector closed the idle connection: a new one
                    continue
                return Result(Outcome.UNAVAILABLE, None, f"{type(exc).__name__}: {exc}")
            except (OSError, http.client.HTTPException) as exc:  # refused, timeout, DNS, bad answer
                self.close()
                kind = "timed out" if isinstance(exc, socket.timeout | TimeoutError) else type(exc).__name__
                return Result(Outcome.UNAVAILABLE, None, f"{kind}: {exc}")
        raise AssertionError("unreachable")  # pragma: no cover

    def post(self, body: bytes, deadline: float, retry: bool = True, closing: bool = False) -> Result:
        """Send until acknowledged, rejected or the deadline. Backoff sleeps end early when `stop` is
        set, except while closing: then `deadline` is close()'s own and bounds every sleep."""
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            result = self.post_once(body, min(self.timeout_s, remaining))
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
