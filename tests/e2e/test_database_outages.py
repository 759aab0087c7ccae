"""The database goes away under a running collector: it answers 503 with Retry-After, says so on /healthz,
the agent keeps its batches, and everything is stored once the database is back, without a restart.

Real parts only: a `stepwatch-server serve` process; SQLite on a small tmpfs that really fills up (ENOSPC);
a PostgreSQL cluster of the test's own (initdb on a free port), really stopped and started again, so that the
shared server other tests use is never touched.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require, require_module
from tests.e2e.conftest import Collector, free_port
from tests.e2e.test_training_e2e import FAST, series, tiny_model, train, wait_for_steps

torch = require_module("torch")
stepwatch = require_module("stepwatch")

SHUTDOWN_DEADLINE_S = 20.0  # SIGTERM to exit, the workers' stop deadlines included (README, "The collector")


def post(url: str, batch: dict[str, Any], timeout_s: float = 30.0) -> tuple[int, dict[str, str], Any]:
    """POST a batch as the agent does (gzip JSON); the status, headers (lower-case) and JSON body."""
    body = gzip.compress(json.dumps(batch).encode())
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    request = urllib.request.Request(f"{url}/api/v1/ingest", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return (
                response.status,
                {k.lower(): v for k, v in response.headers.items()},
                json.loads(response.read()),
            )
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, json.loads(exc.read())


def healthz(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wide_batch(run: str, session: str, seq: int, first_step: int, steps: int = 100) -> dict[str, Any]:
    """`steps` steps of 20 metrics: about 2,000 rows, enough to need new pages in a nearly full file."""
    numbers = list(range(first_step, first_step + steps))
    return {
        "schema": 1, "run": run, "session": session, "seq": seq, "rank": 0, "world_size": 1,
        "steps": numbers, "timestamps": [1_764_427_200.0 + s for s in numbers],
        "metrics": {f"m{i}": [float(s) for s in numbers] for i in range(20)},
    }  # fmt: skip


def fill(directory: Path) -> Path:
    """Fill the filesystem under `directory` to the last byte; the file to delete to free it."""
    filler = directory / "filler"
    chunk = b"\0" * 65536
    with filler.open("wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                if len(chunk) == 1:
                    return filler
                chunk = chunk[: len(chunk) // 2]


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A real 8 MiB filesystem (tmpfs) that can fill up; needs root (CI runs as root)."""
    mountpoint = Path(tempfile.mkdtemp(prefix="stepwatch-small-disk-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mountpoint)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        mountpoint.rmdir()
    require(mounted.returncode == 0, f"cannot mount a small tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        mountpoint.rmdir()


def test_a_full_disk_answers_503_says_so_on_healthz_and_recovers_without_a_restart(
    small_disk: Path, tmp_path: Path
) -> None:
    collector = Collector(f"sqlite:///{small_disk / 'stepwatch.db'}", free_port(), tmp_path / "c.log").start()
    session = uuid.uuid4().hex
    try:
        status, _, answer = post(collector.url, wide_batch("full", session, 0, 1))
        assert status == 200 and answer["accepted"] is True
        filler = fill(small_disk)

        statuses = []
        for seq in range(1, 30):  # bounded: a write that fits in free pages of the file may still pass
            status, headers, answer = post(collector.url, wide_batch("full", session, seq, 1 + 100 * seq))
            statuses.append(status)
            if status != 200:
                break
        assert status == 503, statuses
        assert answer["error"]["code"] == "unavailable" and "nothing was stored" in answer["error"]["message"]
        assert int(headers["retry-after"]) > 0
        failed_seq = seq
        code, health = healthz(collector.url)
        assert code == 503, health
        assert "full" in health["error"]["message"], health

        filler.unlink()  # space again: the same batch is stored, with no restart
        status, _, answer = post(collector.url, wide_batch("full", session, failed_seq, 1 + 100 * failed_seq))
        assert status == 200 and answer["rows"] == 2_000, answer
        assert healthz(collector.url) == (200, {"status": "ok", "database": "sqlite"})
        stored = series(collector, "full", "m0")
        assert sorted(stored) == list(range(1, 101 + 100 * failed_seq)), "a step is missing or extra"
    finally:
        collector.stop()


def test_sigterm_stops_the_collector_within_its_deadline_while_the_disk_is_full(
    small_disk: Path, tmp_path: Path
) -> None:
    collector = Collector(f"sqlite:///{small_disk / 'stepwatch.db'}", free_port(), tmp_path / "c.log").start()
    fill(small_disk)
    stop = threading.Event()
    answers: list[int] = []

    def keep_posting() -> None:  # an agent that keeps trying, bounded
        session = uuid.uuid4().hex
        for seq in range(2_000):
            if stop.is_set():
                return
            with contextlib.suppress(OSError):
                answers.append(post(collector.url, wide_batch("full", session, seq, 1 + 100 * seq), 5.0)[0])

    poster = threading.Thread(target=keep_posting, daemon=True)
    poster.start()
    try:
        deadline = time.monotonic() + 30
        while 503 not in answers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 503 in answers, answers
        assert collector.process is not None
        sent = time.monotonic()
        collector.process.send_signal(signal.SIGTERM)
        try:
            collector.process.wait(SHUTDOWN_DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the collector was still running {SHUTDOWN_DEADLINE_S} s after SIGTERM")
        print(f"\nexited {time.monotonic() - sent:.2f} s after SIGTERM")
    finally:
        stop.set()
        poster.join(10)
        collector.stop()


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own: initdb in a temporary folder, on a free loopback port."""

    def __init__(self) -> None:
        binaries = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        initdb = shutil.which("initdb") or (str(binaries[-1]) if binaries else None)
        require(initdb is not None, "PostgreSQL's initdb is not installed (Debian: postgresql)")
        assert initdb is not None
        self.bin = Path(initdb).parent
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="stepwatch-pg-"))
        # PostgreSQL refuses to run as root: run it as the `postgres` user then.
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.directory, "postgres")
        self.data = self.directory / "data"
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self.as_user, str(self.bin / tool), *args], capture_output=True, text=True)
        assert done.returncode == 0, f"{tool}: {done.stdout[-2000:]} {done.stderr[-2000:]}"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            "pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.directory / "log"), "-w", "start"
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        with contextlib.suppress(AssertionError):
            self.stop("immediate")
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    cluster = PrivatePostgres()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.remove()


@pytest.mark.postgres
def test_postgresql_stopped_mid_run_503_then_every_step_arrives(
    private_postgres: PrivatePostgres, tmp_path: Path
) -> None:
    collector = Collector(private_postgres.url, free_port(), tmp_path / "c.log").start()
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # timeout_s=0.5: a failing batch is spooled within about 1.5 s; the spool is replayed once it answers.
    watch = stepwatch.attach(
        model, optimizer, run="pg-outage", url=collector.url, spool_dir=str(tmp_path / "spool"),
        timeout_s=0.5, **FAST,
    )  # fmt: skip
    try:
        train(watch, model, optimizer, steps=100)
        # A known pause hands every finished step over; without one the last few wait in the agent for the
        # next step (it moves them off the device 8 at a time, or every flush_interval_s / 2 of steps).
        with watch.phase("check"):
            wait_for_steps(collector, "pg-outage", 100)
        assert sorted(series(collector, "pg-outage", "loss")) == list(range(1, 101))

        private_postgres.stop()
        status, headers, answer = post(collector.url, wide_batch("probe", uuid.uuid4().hex, 0, 1))
        assert status == 503 and answer["error"]["code"] == "unavailable", answer
        assert int(headers["retry-after"]) > 0
        code, health = healthz(collector.url)
        assert code == 503 and health["error"]["code"] == "unavailable", health
        for _ in range(100):  # steps 101-200 while the database is gone: the agent keeps them
            train(watch, model, optimizer, steps=1)
            time.sleep(0.02)
        deadline = time.monotonic() + 20
        while watch.stats()["spooled_batches"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert watch.stats()["spooled_batches"] >= 1, watch.stats()

        private_postgres.start()
        train(watch, model, optimizer, steps=100)  # 201-300, with the database back
        watch.close(timeout_s=30)
        stats = watch.stats()
        assert stats["replayed_batches"] >= 1 and stats["quarantined_batches"] == 0, stats
        assert healthz(collector.url)[0] == 200
        assert sorted(series(collector, "pg-outage", "loss")) == list(range(1, 301)), "a step was lost"
    finally:
        watch.close(timeout_s=1)
        collector.stop()


@pytest.mark.postgres
def test_a_postgresql_restart_between_two_batches_costs_the_second_no_503(
    private_postgres: PrivatePostgres, tmp_path: Path
) -> None:
    """The collector pings no pooled connection before using it (a round trip per transaction): the
    connection the restart killed fails the next write, which is written again at once on a new one, so
    the agent sees no error. Every value once, and /healthz stays 200."""
    collector = Collector(private_postgres.url, free_port(), tmp_path / "c.log").start()
    session = uuid.uuid4().hex
    try:
        for seq in range(3):  # warm the pool: several connections opened before the restart
            status, _, answer = post(collector.url, wide_batch("restart", session, seq, 100 * seq, steps=100))
            assert status == 200 and answer["rows"] == 2_000, answer
        private_postgres.stop()
        private_postgres.start()
        status, _, answer = post(collector.url, wide_batch("restart", session, 3, 300, steps=100))
        assert status == 200 and answer["rows"] == 2_000, answer
        status, _, answer = post(collector.url, wide_batch("restart", session, 3, 300, steps=100))
        assert status == 200 and answer["duplicates"] == 2_000, answer  # sent again: stored once
        assert healthz(collector.url)[0] == 200
        assert sorted(series(collector, "restart", "m7")) == list(range(400))
    finally:
        collector.stop()
