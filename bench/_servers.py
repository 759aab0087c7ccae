"""Receivers for the benchmarks: a real collector in a child process, or a stdlib stub.

Both run in a separate process so that their CPU time never holds the benchmark's GIL: on a real
cluster the collector is on another machine. Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0

# The stub receiver: answers 200 with a plausible ingest reply to every POST, reads the whole body.
_STUB_SOURCE = r"""
import gzip, http.server, itertools, os, sys
SAVE = sys.argv[2] if len(sys.argv) > 2 else None
NUMBERS = itertools.count()
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def _reply(self, body=b'{"accepted": true, "rows": 0, "duplicates": 0, "incarnation": 1}'):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if SAVE:  # each body as sent (gzip undone), one file each, written whole before it is named
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            path = os.path.join(SAVE, f"{next(NUMBERS):06d}.json")
            with open(path + ".tmp", "wb") as f:
                f.write(body)
            os.replace(path + ".tmp", path)
        self._reply()
    def do_GET(self):
        self._reply(b'{"status": "ok"}')
    def log_message(self, *args):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H)
srv.daemon_threads = True
srv.serve_forever()
"""


@dataclass
class Receiver:
    kind: str  # "stepwatch-server" or "stub (stdlib HTTP, answers 200)"
    url: str
    process: subprocess.Popen[bytes]


def collector_available() -> tuple[bool, str]:
    """Whether the real collector can be imported here, and why not."""
    try:
        importlib.import_module("stepwatch_server.cli")
        importlib.import_module("stepwatch_server.serving")
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(url: str, process: subprocess.Popen[bytes], path: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"the receiver exited with {process.returncode} before it answered {url}{path}"
            )
        try:
            with urllib.request.urlopen(url + path, timeout=2.0) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the receiver did not answer {url}{path} within {STARTUP_TIMEOUT_S:.0f} s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)


def child_env(source: Path | None = None) -> dict[str, str]:
    """The environment of a collector child process: with `source`, that tree's code comes first."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if source is not None:
        paths = [str(source / "service" / "src"), str(source / "agent" / "src")]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("STEPWATCH_TOKEN", None)
    return env


def imported_from(source: Path | None = None) -> str:
    """Where a child process started with `child_env(source)` imports the collector from."""
    code = "import stepwatch_server; print(stepwatch_server.__file__)"
    done = subprocess.run([sys.executable, "-c", code], env=child_env(source), capture_output=True, text=True)
    return done.stdout.strip() or done.stderr.strip()[-300:]


@contextlib.contextmanager
def collector(
    database_url: str,
    *,
    log_path: Path | None = None,
    source: Path | None = None,
    options: Sequence[str] = (),
) -> Iterator[Receiver]:
    """`stepwatch-server serve` on a free loopback port, in a child process; with `source` (a checkout's
    root, e.g. an older commit's `git archive`), that tree's collector instead of the importable one;
    `options`: more of `serve`'s options."""
    port = free_port()
    env = child_env(source)
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    cmd = [sys.executable, "-m", "stepwatch_server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--database-url", database_url, *options]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, process, "/healthz")
        yield Receiver("stepwatch-server", url, process)
    finally:
        _stop(process)
        if log_path:
            log.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def stub(save_dir: Path | None = None) -> Iterator[Receiver]:
    """A stdlib HTTP server that answers 200 to everything, in a child process; with `save_dir`, each
    POST body is saved there (`NNNNNN.json`, decompressed)."""
    port = free_port()
    save = [str(save_dir)] if save_dir is not None else []
    process = subprocess.Popen([sys.executable, "-c", _STUB_SOURCE, str(port), *save])
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, process, "/healthz")
        yield Receiver("stub (stdlib HTTP server answering 200)", url, process)
    finally:
        _stop(process)


PG_ADMIN_DSN = os.environ.get("STEPWATCH_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
PG_URL = os.environ.get("STEPWATCH_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/{db}")


def postgresql_database(db: str, *, keep_existing: bool = False) -> str:
    """Create the PostgreSQL database `db` (a plain name; with `keep_existing`, one that exists is kept as it
    is) and give its URL."""
    import psycopg

    with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=10) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (db,)).fetchone() is not None
        if not (exists and keep_existing):
            admin.execute(f'CREATE DATABASE "{db}"')
    return PG_URL.format(db=db)


@contextlib.contextmanager
def database(backend: str, name: str, tmp: Path) -> Iterator[str]:
    """A fresh database for one benchmark: an SQLite file in `tmp`, or a PostgreSQL database dropped after."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp / (name + '.db')}"
        return
    import psycopg

    db = f"stepwatch_{name.replace('-', '_')}_{os.getpid()}_{int(time.time())}"
    url = postgresql_database(db)
    try:
        yield url
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=10) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def timed_threads(threads: list[threading.Thread], timeout_s: float) -> float:
    """Start `threads`, wait for each (at most `timeout_s` apiece); the wall seconds from the first start."""
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return time.perf_counter() - started
