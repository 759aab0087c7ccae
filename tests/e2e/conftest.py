"""End-to-end fixtures: a real `stepwatch-server serve` process on loopback, on SQLite or PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import POSTGRES_URL, port_open, require

SERVER_START_TIMEOUT_S = 60.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout_s: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


@dataclass
class Collector:
    """A `stepwatch-server serve` subprocess; `start()` waits for /healthz."""

    database_url: str
    port: int
    log_path: Path
    token: str | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Collector:
        cmd = [sys.executable, "-m", "stepwatch_server.cli", "serve", "--port", str(self.port)]
        cmd += ["--database-url", self.database_url]
        if self.token:
            cmd += ["--token", self.token]
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"collector exited: {self.log_path.read_text()[-3000:]}")
            try:
                get_json(f"{self.url}/healthz", timeout_s=1.0)
                return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.1)
        raise RuntimeError(f"collector did not answer /healthz: {self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def get(self, path: str) -> Any:
        return get_json(self.url + path)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database of each kind."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'stepwatch.db'}"
        return
    require(port_open("127.0.0.1", 5432), "PostgreSQL is not running on 127.0.0.1:5432")
    import psycopg

    admin = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
    name = f"stepwatch_e2e_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def collector(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Collector]:
    """One real collector on SQLite for the whole test module (its runs have distinct names)."""
    tmp = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    c = Collector(f"sqlite:///{tmp / 'stepwatch.db'}", free_port(), tmp / "collector.log").start()
    yield c
    c.stop()


@pytest.fixture
def collector_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[Collector] = []

    def make(database_url: str, port: int | None = None, start: bool = True) -> Collector:
        c = Collector(database_url, port or free_port(), tmp_path / f"collector-{len(started)}.log")
        started.append(c)
        return c.start() if start else c

    yield make
    for c in started:
        c.stop()


@pytest.fixture(autouse=True)
def _quiet_agent_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep tests independent of the developer's environment and spool directory."""
    for name in ("STEPWATCH_URL", "STEPWATCH_RUN", "STEPWATCH_TOKEN", "STEPWATCH_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    os.makedirs(tmp_path / "home", exist_ok=True)
