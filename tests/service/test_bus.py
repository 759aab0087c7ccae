"""Several collectors and detection workers on one PostgreSQL and one Redis (`serve --bus`, `detect`): they
find what one process finds, and a worker or a replica killed, or Redis restarted, loses nothing.

Every process is a real `stepwatch-server` child process; Redis is a `redis-server` of the test's own (on a
free loopback port, so that it can be killed and restarted); the trace is the simulator's 64-rank run with a
straggler and a NaN, sent in its order over HTTP as the agents would, each rank to its replica.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from sqlalchemy import create_engine, func, select

from stepwatch_server.bus import streams
from stepwatch_server.simulate import NonFinite, Scenario, Simulation, Straggler
from stepwatch_server.storage.models import Anomaly as AnomalyRow
from stepwatch_server.storage.models import Run, StepRecord
from tests.alerts.helpers import config_text, nan_batch
from tests.alerts.receiver import Receiver
from tests.conftest import require
from tests.detect.helpers import detect_docs
from tests.service.conftest import Collector, fresh_database

pytestmark = pytest.mark.postgres

START_TIMEOUT_S = 60.0
CATCH_UP_TIMEOUT_S = 120.0
TAKE_OVER_S = 10.0  # the bound: a dead worker's streams are owned again within this


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A redis-server of the test's own, with an append-only file so that a restart keeps the streams."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        require(binary is not None, "redis-server is not installed (Debian: apt-get install redis-server)")
        assert binary is not None
        self.binary, self.directory, self.port = binary, directory, _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory)]
        cmd += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(Exception), streams.connect(self.url) as client:
                if client.ping():
                    return
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # SIGTERM: Redis writes its append-only file and exits
            self.process.wait(30)


class Process:
    """A `stepwatch-server` child process (its log in `log`)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        env.pop("STEPWATCH_TOKEN", None)
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "stepwatch_server.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        self.close()
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def close(self) -> None:
        """Close what the test holds open to it (nothing here)."""

    def stop(self) -> None:
        self.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


class Replica(Process):
    def __init__(self, database_url: str, bus: str, log: Path, extra: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        super().__init__(
            ["serve", "--port", str(self.port), "--database-url", database_url, "--bus", bus, *extra], log
        )
        self.conn: http.client.HTTPConnection | None = None
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.get("/healthz") is None:
            assert self.process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the collector did not start: {log.read_text()[-3000:]}"
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"} if body else {}
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                self.conn.request(method, path, body=body, headers=headers)
                answer = self.conn.getresponse()
                return answer.status, answer.read()
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("not reached")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def get(self, path: str) -> Any:
        try:
            status, data = self.request("GET", path)
        except (OSError, http.client.HTTPException):
            return None
        return orjson.loads(data) if status == 200 else None


def _send(docs: list[dict[str, Any]], replicas: list[Replica]) -> int:
    """Each batch to its rank's replica (rank mod the live ones), in the trace's order; a replica that does
    not answer is left for the next, as the agent fails over; 429/503 are retried. Returns how many
    answers were not 200."""
    refused = 0
    for doc in docs:
        body = gzip.compress(orjson.dumps(doc), compresslevel=1)
        live = [r for r in replicas if r.process.poll() is None]
        order = live[doc["rank"] % len(live) :] + live[: doc["rank"] % len(live)]
        for attempt in range(200):
            replica = order[attempt % len(order)]
            try:
                status, data = replica.request("POST", "/api/v1/ingest", body)
            except (OSError, http.client.HTTPException):
                continue
            if status == 200:
                assert orjson.loads(data)["accepted"], data
                break
            assert status in (429, 503), (status, data[:300])
            refused += 1
            time.sleep(0.2)
        else:
            raise AssertionError(f"batch {doc['run']} rank {doc['rank']} seq {doc['seq']} never acknowledged")
    return refused


def _caught_up(redis_url: str, replicas: list[Replica]) -> bool:
    """Nothing waits in a replica for Redis, and every stream's entries are delivered and acknowledged."""
    for replica in replicas:
        if replica.process.poll() is None:
            stats = replica.get("/api/v1/detection")
            if stats is None or stats["waiting"]:
                return False
    with streams.connect(redis_url) as client:
        for p in range(streams.PARTITIONS):
            key = streams.stream_key(p)
            if not client.exists(key):
                continue
            groups = client.xinfo_groups(key)
            if not groups:
                return bool(client.xlen(key) == 0)
            for group in groups:
                if group["pending"] or group.get("lag"):
                    return False
    return True


def _wait_caught_up(redis_url: str, replicas: list[Replica]) -> None:
    deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
    while not _caught_up(redis_url, replicas):
        assert time.monotonic() < deadline, "detection did not catch up with the bus"
        time.sleep(0.2)


def _found(database_url: str) -> list[tuple[str, int | None, int]]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(AnomalyRow.kind, AnomalyRow.rank, AnomalyRow.first_step)).all()
    finally:
        engine.dispose()
    return sorted((k, r, s) for k, r, s in rows)


def _step_rows(database_url: str, run: str) -> int:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            query = select(func.count()).select_from(StepRecord).join(Run, Run.id == StepRecord.run_id)
            return int(conn.execute(query.where(Run.name == run)).scalar_one())
    finally:
        engine.dispose()


def _trace() -> tuple[list[dict[str, Any]], list[tuple[str, int | None, int]]]:
    sc = Scenario(
        "bus_64", 64, 420, seed=5,
        faults=(Straggler(13, 60, factor=2.0), NonFinite(300, ranks=(41,), module="layers.7.mlp.fc1")),
    )  # fmt: skip
    docs = list(Simulation(sc))
    _, anomalies = detect_docs(docs)
    return docs, sorted((a.kind, a.rank, a.first_step) for a in anomalies)


@contextlib.contextmanager
def _deployment(
    tmp_path: Path,
    replicas: int,
    workers: int,
    extra: tuple[str, ...] = (),
    metrics_ports: tuple[int, ...] = (),
    worker_env: dict[str, str] | None = None,
) -> Iterator[tuple[str, RedisServer, list[Replica], list[Process]]]:
    """PostgreSQL, Redis, `replicas` x `serve --bus` and `workers` x `detect`, each with `extra` options
    (and worker i with `--metrics-port metrics_ports[i]` when given; the workers with `worker_env`)."""
    with fresh_database("postgres", tmp_path) as database_url:
        redis_server = RedisServer(tmp_path)
        redis_server.start()
        started: list[Process] = []
        try:
            serving = []
            for i in range(replicas):  # one at a time: the first applies the migrations
                serving.append(Replica(database_url, redis_server.url, tmp_path / f"serve-{i}.log", extra))
                started.append(serving[-1])
            detecting = [
                Process(
                    ["detect", "--bus", redis_server.url, "--database-url", database_url, *extra]
                    + (["--metrics-port", str(metrics_ports[i])] if metrics_ports else []),
                    tmp_path / f"detect-{i}.log",
                    worker_env,
                )
                for i in range(workers)
            ]
            started += detecting
            yield database_url, redis_server, serving, detecting
        finally:
            for process in started:
                process.stop()
            redis_server.stop()


def _owners(redis_url: str) -> dict[int, str | None]:
    with streams.connect(redis_url) as client:
        values = client.mget([streams.lease_key(p) for p in range(streams.PARTITIONS)])
    return {p: v.decode() if v else None for p, v in enumerate(values)}


def _all_owned_by(redis_url: str, pid: int) -> bool:
    return all(o is not None and o.split("-")[-2] == str(pid) for o in _owners(redis_url).values())


def test_two_replicas_and_two_workers_find_what_one_process_finds_with_a_worker_killed_mid_run(
    tmp_path: Path,
) -> None:
    docs, expected = _trace()
    assert {k for k, _, _ in expected} >= {"straggler", "nonfinite"}, expected
    with _deployment(tmp_path, replicas=2, workers=2) as (database_url, redis_server, replicas, workers):
        deadline = time.monotonic() + START_TIMEOUT_S
        while None in _owners(redis_server.url).values() or len(set(_owners(redis_server.url).values())) < 2:
            assert time.monotonic() < deadline, (
                f"the workers did not share the streams: {_owners(redis_server.url)}"
            )
            time.sleep(0.2)
        half = len(docs) // 2
        _send(docs[:half], replicas)
        run = str(docs[0]["run"])
        owner = _owners(redis_server.url)[streams.partition(run)]
        victim = next(w for w in workers if owner and owner.split("-")[-2] == str(w.pid))
        victim.kill()  # the worker that holds the run's detector state, mid-run
        killed_at = time.monotonic()
        survivor = next(w for w in workers if w is not victim)
        while not _all_owned_by(redis_server.url, survivor.pid):
            assert time.monotonic() - killed_at < TAKE_OVER_S, (
                f"the dead worker's streams were not taken over in {TAKE_OVER_S} s: {_owners(redis_server.url)}"
            )
            time.sleep(0.1)
        _send(docs[half:], replicas)
        _wait_caught_up(redis_server.url, replicas)
        found = _found(database_url)
    assert found == expected


def test_a_replica_killed_and_redis_restarted_mid_run_lose_no_batch_and_no_detection(tmp_path: Path) -> None:
    docs, expected = _trace()
    steps = {(int(d["rank"]), int(s)) for d in docs for s in d.get("steps", [])}
    with _deployment(tmp_path, replicas=2, workers=1) as (database_url, redis_server, replicas, _):
        third = len(docs) // 3
        _send(docs[:third], replicas)
        replicas[0].kill()  # its ranks fail over to the other replica
        _send(docs[third : third + third // 2], replicas)
        redis_server.stop()  # stopped cleanly: its append-only file keeps the streams
        refused = _send(docs[third + third // 2 : 2 * third], replicas)
        assert refused == 0  # ingest stores and answers 200 while Redis is away; the batches wait in it
        waiting = replicas[1].get("/api/v1/detection")
        assert waiting["bus_connected"] is False and waiting["waiting"] > 0, waiting
        redis_server.start()
        _send(docs[2 * third :], replicas)
        _wait_caught_up(redis_server.url, replicas)
        run = str(docs[0]["run"])
        assert _step_rows(database_url, run) == len(steps)  # every acknowledged step stored, once
        found = _found(database_url)
    assert found == expected


def _metric(text: str, series: str) -> float:
    """The value of one series in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in the metrics")


def _first_runs_event(url: str) -> list[str]:
    """The run names of the first `runs` event of the live feed at `url`."""
    with httpx.stream("GET", url, timeout=30.0) as response:
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and name == "runs":
                return sorted(r["name"] for r in orjson.loads(line[6:])["runs"])
    raise AssertionError("the stream ended before a runs event")


def test_alerts_go_once_and_the_live_feed_shows_every_run_behind_either_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas deliver one outbox (each claims rows with SKIP LOCKED) and the workers write it: every
    message reaches the receiver exactly once; the event stream of either replica lists the runs that
    were sent to the other (issue 16, item 6)."""
    receiver = Receiver().start()
    try:
        monkeypatch.setenv("SW_TEST_SLACK_URL", receiver.url("/slack"))
        monkeypatch.setenv("SW_TEST_HOOK_SECRET", "test-secret-0123456789")
        alerts = tmp_path / "alerts.yaml"
        alerts.write_text(config_text(receiver, window_s=0.2))
        runs = [f"bus-alerts-{i}" for i in range(6)]
        ports = (_free_port(), _free_port())
        with _deployment(
            tmp_path, replicas=2, workers=2, extra=("--alerts", str(alerts)), metrics_ports=ports
        ) as (_, redis_server, replicas, _):
            for i, run in enumerate(runs):
                status, data = replicas[i % 2].request(
                    "POST", "/api/v1/ingest", gzip.compress(orjson.dumps(nan_batch(run)))
                )
                assert status == 200, data
            _wait_caught_up(redis_server.url, replicas)
            receiver.wait_for(lambda: len(receiver.received) >= 2 * len(runs), 60.0, "12 messages")
            time.sleep(3.0)  # a second copy of any message would arrive within this
            deliveries = replicas[0].get("/api/v1/alerts?limit=1000")["deliveries"]
            for replica in replicas:
                assert _first_runs_event(f"http://127.0.0.1:{replica.port}/api/v1/stream") == runs
            # Each process's /metrics: the replicas added the 6 batches to the bus, the workers processed them.
            published = [
                _metric(
                    httpx.get(f"http://127.0.0.1:{r.port}/metrics").text,
                    "stepwatch_bus_published_batches_total",
                )
                for r in replicas
            ]
            processed = [
                _metric(
                    httpx.get(f"http://127.0.0.1:{port}/metrics").text,
                    'stepwatch_detect_batches_total{outcome="processed"}',
                )
                for port in ports
            ]
            assert published == [3.0, 3.0] and sum(processed) == len(runs), (published, processed)
    finally:
        receiver.stop()
    keys = Counter(r.key for r in receiver.received)
    assert len(keys) == 2 * len(runs) and set(keys.values()) == {1}, keys
    assert sorted(d["status"] for d in deliveries) == ["delivered"] * (2 * len(runs))
    assert {r.json["run"] for r in receiver.on("/hook")} == set(runs)


def test_a_worker_takes_its_streams_again_when_redis_lost_them(tmp_path: Path) -> None:
    """Redis lost the streams while the worker's leases stayed (the streams deleted, or a failover to a
    replica that never had them): XREADGROUP answers NOGROUP; the worker lets its streams go, takes them
    again afresh (creating the group) and detects what comes next."""
    from stepwatch_server.bus.worker import StreamDetection
    from stepwatch_server.ingest.store import BatchWriter
    from stepwatch_server.ingest.validate import parse_batch
    from stepwatch_server.storage import make_engine, upgrade

    redis_server = RedisServer(tmp_path)
    redis_server.start()
    engine = make_engine(f"sqlite:///{tmp_path / 'bus.db'}")
    upgrade(engine)
    client = streams.connect(redis_server.url)
    worker = StreamDetection(engine, client).start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(worker.owned) < streams.PARTITIONS:
            assert time.monotonic() < deadline, "the worker did not take the streams"
            time.sleep(0.05)
        # The streams (and with them their group) gone, the leases kept: as when someone deletes the
        # streams, or a failover to a replica that never had them.
        client.delete(*[streams.stream_key(p) for p in range(streams.PARTITIONS)])
        batch = parse_batch(nan_batch("after-the-flush"))
        BatchWriter(engine).write(batch)
        deadline = time.monotonic() + 2 * TAKE_OVER_S
        key = streams.stream_key(streams.partition(batch.run))
        while True:  # added once the streams are taken again (before, the entry would have no group)
            if client.exists(key) and client.xinfo_groups(key) and len(worker.owned) == streams.PARTITIONS:
                break
            assert time.monotonic() < deadline, "the worker did not take the streams again"
            time.sleep(0.05)
        client.xadd(key, streams.encode(batch, time.time()))  # type: ignore[arg-type]
        while not any(k == "nonfinite" for k, _, _ in _found(str(engine.url))):
            assert time.monotonic() < deadline, "the batch added after the flush was not detected"
            time.sleep(0.1)
    finally:
        worker.stop()
        client.close()
        engine.dispose()
        redis_server.stop()


def test_with_no_worker_on_the_bus_ingest_refuses_once_the_backlog_passes_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No `detect` running: entries pile up in the streams; past the bound (5 here, 200,000 by default) a
    batch stored now would wait without end, so ingest answers 429 naming why and stores nothing."""
    from stepwatch_server.bus import publisher

    monkeypatch.setattr(publisher, "MAX_STREAM_BACKLOG", 5)
    redis_server = RedisServer(tmp_path)
    redis_server.start()
    try:
        with fresh_database("sqlite", tmp_path) as url:
            collector = Collector(url, bus=redis_server.url)
            try:
                for i in range(8):
                    assert collector.post(nan_batch(f"unread-{i}")).status_code == 200
                deadline = time.monotonic() + 10.0
                while collector.get("/api/v1/detection")["stream_backlog"] < 8:
                    assert time.monotonic() < deadline, collector.get("/api/v1/detection")
                    time.sleep(0.1)
                before = collector.counts()
                refused = collector.post(nan_batch("one-too-many"))
                assert refused.status_code == 429 and refused.headers["Retry-After"] == "2"
                error = refused.json()["error"]
                assert (
                    error["code"] == "detection_behind"
                    and "wait in the bus for a detection worker" in error["message"]
                )
                assert collector.counts() == before
            finally:
                collector.close()
    finally:
        redis_server.stop()


def test_a_real_prometheus_scraping_a_replica_and_a_worker_fills_every_panel_of_the_scale_dashboard(
    tmp_path: Path,
) -> None:
    """dashboards/scale.json (README, "Running at scale"): each of its PromQL expressions returns data from a
    Prometheus that scrapes one `serve --bus` and one `detect --metrics-port`, as the compose stack's does."""
    from stepwatch_server.grafana.generate import REPO
    from stepwatch_server.grafana.panels import PROMETHEUS_TYPE, panel_queries
    from tests.metrics.prometheus import Prometheus
    from tests.metrics.sql import expand_promql

    port = _free_port()
    runs = [f"bus-scale-{i}" for i in range(4)]
    with _deployment(tmp_path, replicas=1, workers=1, metrics_ports=(port,)) as (
        _,
        redis_server,
        replicas,
        _,
    ):
        prometheus = Prometheus(tmp_path, [f"127.0.0.1:{replicas[0].port}", f"127.0.0.1:{port}"]).start()
        try:
            for run in runs:
                status, data = replicas[0].request(
                    "POST", "/api/v1/ingest", gzip.compress(orjson.dumps(nan_batch(run)))
                )
                assert status == 200, data
            _wait_caught_up(redis_server.url, replicas)
            prometheus.wait_for(f'stepwatch_detect_batches_total{{outcome="processed"}} == {len(runs)}', 60.0)
            prometheus.wait_for(f"stepwatch_bus_published_batches_total == {len(runs)}", 60.0)
            time.sleep(2.5)  # a few more scrapes: rate() needs two samples of each counter
            doc = orjson.loads((REPO / "dashboards" / "scale.json").read_bytes())
            queries = [(title, q) for title, kind, q in panel_queries(doc) if kind == PROMETHEUS_TYPE]
            assert queries
            empty = [(title, q) for title, q in queries if not prometheus.query(expand_promql(q, runs[0]))]
            assert not empty, f"scale.json: queries that returned nothing: {empty}"
            (workers,) = prometheus.query("count(stepwatch_detect_streams_owned)")
            (owned,) = prometheus.query("sum(stepwatch_detect_streams_owned)")
            assert float(workers["value"][1]) == 1 and float(owned["value"][1]) == streams.PARTITIONS
        finally:
            prometheus.stop()


def test_a_rank_that_stops_stepping_is_a_hang_the_bus_worker_finds(tmp_path: Path) -> None:
    """A hang is the absence of steps: the worker that owns the run's stream finds it from the heartbeats that
    keep arriving (the stuck rank's sender and the ranks waiting in the collective), as the single process does.
    A real 4-rank gloo run (tests/e2e/fault_ranks.py) whose rank 1 stops at step 20 feeds a replica on the bus;
    the worker opens one hang blaming rank 1, stuck (its sender still sends heartbeats). A run whose every rank
    goes silent: the next test."""
    from tests.e2e.test_detection_real import WAIT_S, ranks

    run = f"bus-hang-{os.getpid()}"
    with _deployment(tmp_path, replicas=1, workers=1) as (_, _, replicas, _):
        replica = replicas[0]
        hangs: list[dict[str, Any]] = []
        with ranks(replica, tmp_path, run, "stop", fault_rank=1, fault_step=20, steps=100_000):  # type: ignore[arg-type]
            deadline = time.monotonic() + WAIT_S
            while not hangs and time.monotonic() < deadline:
                found = (replica.get(f"/api/v1/runs/{run}/anomalies?limit=1000") or {}).get("anomalies", [])
                hangs = [a for a in found if a["kind"] == "hang"]
                time.sleep(0.25)
        assert len(hangs) == 1, hangs
        (hang,) = hangs
        assert hang["rank"] == 1 and hang["evidence"]["culprits"] == [1], hang
        assert hang["evidence"]["mode"] == "stuck", hang


def test_a_run_whose_every_rank_goes_silent_is_found_on_the_bus_workers_tick(tmp_path: Path) -> None:
    """Nothing arrives at all: no batch, so no stream entry, wakes the worker; its tick, with no entry
    waiting, must still let wall-clock time pass in the engine of every run it owns, and open the run's
    "silent" hang after `silent_after_s` (here 3 s, set as a user would with STEPWATCH_DETECTION); the next
    batch resolves it."""
    docs = list(Simulation(Scenario(f"bus-silent-{os.getpid()}", 4, 60, seed=2)))
    run = docs[0]["run"]
    overrides = {"STEPWATCH_DETECTION": orjson.dumps({"hang": {"silent_after_s": 3}}).decode()}
    with _deployment(tmp_path, replicas=1, workers=1, worker_env=overrides) as (_, redis, replicas, _):
        replica = replicas[0]
        _send(docs[:-1], replicas)  # the last batch is kept for later
        _wait_caught_up(redis.url, replicas)

        def silent() -> list[dict[str, Any]]:
            found = (replica.get(f"/api/v1/runs/{run}/anomalies?limit=1000") or {}).get("anomalies", [])
            return [a for a in found if a["kind"] == "hang" and "silent_s" in a["evidence"]]

        deadline = time.monotonic() + 30.0
        while not silent() and time.monotonic() < deadline:
            time.sleep(0.25)
        hangs = silent()
        assert len(hangs) == 1, hangs
        hang = hangs[0]
        assert hang["severity"] == "warning" and hang["status"] == "open", hang
        assert "run silent: nothing from any of its 4 ranks" in hang["summary"], hang
        assert hang["evidence"]["silent_s"] >= 3.0, hang
        _send(docs[-1:], replicas)
        deadline = time.monotonic() + 30.0
        while silent()[0]["status"] != "resolved" and time.monotonic() < deadline:
            time.sleep(0.25)
        assert silent()[0]["status"] == "resolved", silent()
