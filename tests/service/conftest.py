"""Fixtures for the collector's tests: fresh databases on both backends and a real server.

Every storage-facing test runs against SQLite (a file in tmp_path) and PostgreSQL (a fresh schema
per test in the `test` database, dropped afterwards; skipped outside CI when the server is absent).
The server is a real uvicorn on 127.0.0.1, port 0, in a background thread.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Connection, Engine, create_engine, func, insert, select, text

from stepwatch_server.ingest.example import EXAMPLE_BATCH
from stepwatch_server.serving import BackgroundServer
from stepwatch_server.settings import Settings
from stepwatch_server.storage import make_engine, upgrade
from stepwatch_server.storage.models import ALL_TABLES, Run, Series
from tests.conftest import POSTGRES_URL, port_open, require, require_module

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@contextlib.contextmanager
def fresh_database(backend: str, directory: Path) -> Iterator[str]:
    """The URL of an empty database, removed afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{directory / 'stepwatch.db'}"
        return
    require(port_open("127.0.0.1", 5432), "PostgreSQL is not running on 127.0.0.1:5432")
    schema = f"sw_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        separator = "&" if "?" in POSTGRES_URL else "?"
        yield f"{POSTGRES_URL}{separator}options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


ROLLUP_WAIT_S = 30.0  # the bound on the rollup worker catching up (a round takes 0.5-3 s)
ASYNC_TABLES = ("anomalies", "rank_rollup_packs", "step_rollups", "rollup_marks")


def table_counts(url: str) -> dict[str, int]:
    """Rows in every table ingest writes: the 'database unchanged' check. `anomalies` and the rollup
    tables are left out: the detection and rollup workers write them asynchronously, after the
    answer (and on their own timers)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return {
                t.name: int(conn.execute(select(func.count()).select_from(t)).scalar_one())
                for t in ALL_TABLES
                if t.name not in ASYNC_TABLES
            }
    finally:
        engine.dispose()


class Collector:
    """A running collector and an HTTP client for it."""

    def __init__(self, url: str, **settings: Any) -> None:
        self.database_url = url
        self.settings = Settings(database_url=url, **settings)
        self.server = BackgroundServer(self.settings).start()
        self.http = httpx.Client(base_url=self.server.url, timeout=30.0)

    def post(self, batch: dict[str, Any] | bytes, **kwargs: Any) -> httpx.Response:
        if isinstance(batch, bytes):
            return self.http.post("/api/v1/ingest", content=batch, **kwargs)
        return self.http.post("/api/v1/ingest", json=batch, **kwargs)

    def get(self, path: str, **params: Any) -> Any:
        response = self.http.get(path, params=params)
        assert response.status_code == 200, response.text
        return response.json()

    def counts(self) -> dict[str, int]:
        return table_counts(self.database_url)

    def wait_rolled_up(self, timeout_s: float = ROLLUP_WAIT_S) -> None:
        """Wait until the rollup worker has rolled up every batch acknowledged so far (it is handed each
        batch's steps before the answer): a late batch for steps below the watermark reaches the
        rollup-backed views (means, amax) only with the worker's next round (README "Reads while the
        worker lags")."""
        assert self.server.app.state.rollups.wait_idle(timeout_s), "the rollup worker did not catch up"

    def close(self) -> None:
        self.http.close()
        self.server.stop()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database_url(backend: str, tmp_path: Path) -> Iterator[str]:
    with fresh_database(backend, tmp_path) as url:
        yield url


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """An engine on a fresh database with the migrations applied."""
    engine = make_engine(database_url)
    upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def start_collector(database_url: str) -> Iterator[Callable[..., Collector]]:
    started: list[Collector] = []

    def start(**settings: Any) -> Collector:
        collector = Collector(database_url, **settings)
        started.append(collector)
        return collector

    yield start
    for collector in started:
        collector.close()


@pytest.fixture
def collector(start_collector: Callable[..., Collector]) -> Collector:
    return start_collector()


@pytest.fixture(scope="module", params=BACKENDS)
def populated(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Collector]:
    """One collector per backend for a whole module, already holding the docs' example batch (so that
    "unchanged" is not trivially true, and the run's routes have a run to answer about)."""
    with fresh_database(str(request.param), tmp_path_factory.mktemp("db")) as url:
        collector = Collector(url)
        try:
            assert collector.post(make_batch()).status_code == 200
            yield collector
        finally:
            collector.close()


def generated(max_examples: int) -> Any:
    """Hypothesis settings for a test against a real collector: a bounded number of examples, the same
    ones on every run (derandomized: CI stays reproducible), no deadline (the machine is shared)."""
    hypothesis = require_module("hypothesis")
    return hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
    )


STREAM_WAIT_S = 20.0


def listen_events(
    url: str, events: list[dict[str, Any]], done: threading.Event, headers: dict[str, str] | None = None
) -> None:
    """Collect the `runs` events of the stream at `url` into `events` until it ends (then set `done`)."""
    try:
        with httpx.stream("GET", url, headers=headers, timeout=STREAM_WAIT_S) as response:
            name = None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: ") and name == "runs":
                    events.append(json.loads(line[6:]))
    except httpx.HTTPError:
        pass
    finally:
        done.set()


def make_batch(**overrides: Any) -> dict[str, Any]:
    """The docs/ingest.md example with fresh session id, overridden fields (None removes one)."""
    batch = copy.deepcopy(EXAMPLE_BATCH)
    batch["session"] = uuid.uuid4().hex
    for key, value in overrides.items():
        if value is None:
            batch.pop(key, None)
        else:
            batch[key] = value
    return batch


def steps_batch(
    run: str,
    session: str,
    seq: int,
    steps: list[int],
    rank: int = 0,
    world_size: int = 1,
    **metrics: list[Any],
) -> dict[str, Any]:
    """A minimal batch with the given steps and metrics."""
    return {
        "schema": 1,
        "run": run,
        "session": session,
        "seq": seq,
        "rank": rank,
        "world_size": world_size,
        "steps": steps,
        "timestamps": [1_764_427_200.0 + s for s in steps],
        "metrics": metrics,
    }


def two_series(conn: Connection) -> list[int]:
    """A run of 300 ranks with two series, "loss" and "grad_norm": their ids."""
    now = dt.datetime.now(dt.UTC)
    run_id = conn.execute(
        insert(Run).values(name="packs", world_size=300, created_at=now, last_seen_at=now).returning(Run.id)
    ).scalar_one()
    return [
        conn.execute(
            insert(Series).values(run_id=run_id, stat="", name=name).returning(Series.id)
        ).scalar_one()
        for name in ("loss", "grad_norm")
    ]
