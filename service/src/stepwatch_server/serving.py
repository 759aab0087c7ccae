"""Running the collector's HTTP server: in the foreground (`serve`) or on a background thread (demo, tests)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import uvicorn

from stepwatch_server.app import create_app
from stepwatch_server.settings import Settings

log = logging.getLogger("stepwatch_server")
STARTUP_TIMEOUT_S = 60.0
# At SIGTERM, requests in flight get this long to finish (one stuck on a database that hangs must not hold
# the stop); then the lifespan stops the workers, each within its own deadline of 5 s (README, "The collector").
GRACEFUL_SHUTDOWN_S = 5


def _config(settings: Settings, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        create_app(settings), host=host, port=port, log_level="warning", access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )  # fmt: skip


class _Server(uvicorn.Server):
    """uvicorn's server, which tells the app when shutdown begins (`app.state.stopping`): uvicorn waits
    for open responses to finish before the lifespan ends, so endless ones (the dashboard's event
    stream) must learn of it to end."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        stopping = getattr(getattr(self.config.app, "state", None), "stopping", None)
        if stopping is not None:
            stopping.set()
        await super().shutdown(sockets)


def serve_forever(settings: Settings, *, host: str, port: int) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM)."""
    log.info("stepwatch collector on http://%s:%d (database %s)", host, port, settings.redacted_database_url)
    _Server(_config(settings, host, port)).run()


class BackgroundServer:
    """A real uvicorn server on a thread: `start()` returns once it accepts connections."""

    def __init__(self, settings: Settings, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _Server(_config(settings, host, port))
        self._thread = threading.Thread(target=self._server.run, name="stepwatch-server", daemon=True)
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def app(self) -> Any:
        """The FastAPI app being served (its `state` holds the writer and the workers)."""
        return self._server.config.app

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the collector did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        sockets = [s for server in self._server.servers for s in server.sockets]
        self.port = int(sockets[0].getsockname()[1])
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
