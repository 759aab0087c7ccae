"""A real HTTP receiver on 127.0.0.1 for alert tests: records every POST, can be taken down and
brought back on the same port, can answer with scripted statuses (429 + Retry-After, 503) or slowly.
Webhook signatures are checked here the way docs/alerts.md tells receivers to check them."""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_SIGNATURE_AGE_S = 300


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() when it arrived
    answered: int

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def key(self) -> str:
        return self.headers.get("idempotency-key", "")


def verify_signature(secret: bytes, body: bytes, header: str, now: float | None = None) -> bool:
    """docs/alerts.md's receiver check: HMAC-SHA256 over f"{t}.{body}", and a fresh timestamp."""
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    if "t" not in fields or "v1" not in fields or not fields["t"].isdigit():
        return False
    if abs((time.time() if now is None else now) - int(fields["t"])) > MAX_SIGNATURE_AGE_S:
        return False
    expected = hmac.new(secret, fields["t"].encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, fields["v1"])


class _Server(http.server.ThreadingHTTPServer):
    allow_reuse_address = True  # back up on the same port right after going down

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a sender that went away mid-answer (killed collector) is part of the tests


@dataclass
class Receiver:
    """`url(path)` for a channel; `received` in arrival order; `script` answers the next requests."""

    port: int = 0
    delay_s: float = 0.0
    received: list[Received] = field(default_factory=list)
    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    echo: bool = False  # answer bodies quote the request's path and query, as many receivers' errors do
    _server: http.server.ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Receiver:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver._lock:
                    status, headers = receiver.script.pop(0) if receiver.script else (200, {})
                    receiver.received.append(
                        Received(
                            self.path,
                            {k.lower(): v for k, v in self.headers.items()},
                            body,
                            time.monotonic(),
                            status,
                        )
                    )
                if receiver.delay_s:  # recorded on arrival: a sender killed meanwhile never hears the answer
                    time.sleep(receiver.delay_s)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                answer = f"no such hook: {self.path}".encode() if receiver.echo else b"ok"
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = _Server(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def stop(self) -> None:
        """Down: the port refuses connections until `start()` again."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def on(self, path: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.path == path]

    def wait_for(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, (
                f"timed out after {timeout_s} s waiting for {what}: {self.received}"
            )
            time.sleep(0.05)
