"""How many of the agent's small batches one collector process acknowledges per second, and how long each
waits for its answer (issue 16: at the agent's default cadence the cost is per request, not per value).

A real `stepwatch-server serve` runs in a child process on loopback (SQLite in a temporary file, or a fresh
PostgreSQL database dropped afterwards). The workload is one run of `--ranks` ranks, each batch of the
agent's default shape: 2 steps x 30 scalars (the agent's metric names first) and a heartbeat, with amax of 8
modules on every 10th step, gzip JSON as the agent sends it, built before the clock starts. A warm-up round
sends every rank's first batch (run, sessions, ranks and names are created); then each round sends
`--batches-per-rank` more per rank from `--senders` threads on keep-alive connections, as fast as the
answers come back (a closed loop: what the collector holds, not an open-loop arrival rate). Reported per
round: batches/s (acknowledged / wall time), the answers' latency p50 and p99, and the collector process's
own CPU time per batch (all its threads, from /proc: the rollup and detection workers included), whose
inverse is the batches one core of it takes per second whatever the load generator, which shares the
machine's cores, costs; per collector the medians over rounds.

With `--ref REF` a second collector runs that commit's code (a detached worktree under /tmp,
bench/_refs.py) on its own database, and the rounds alternate between the two, so both are measured
side by side under the same load on the machine.

    .venv/bin/python bench/batch_rate.py                                   # SQLite and PostgreSQL, ~1 min
    .venv/bin/python bench/batch_rate.py --ref HEAD~3 --rounds 5 --json rate.json
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import _refs
import _servers
from ingest_throughput import AGENT_METRICS  # the agent's metric names

SCALARS = 30
MODULES = 8
AMAX_EVERY = 10
REQUEST_TIMEOUT_S = 60.0


def _names() -> list[str]:
    return AGENT_METRICS + [f"user.metric_{i}" for i in range(SCALARS - len(AGENT_METRICS))]


def batch(run: str, session: str, rank: int, ranks: int, seq: int) -> bytes:
    """Batch `seq` of `rank`: steps 2*seq+1 and 2*seq+2, as the agent's default cadence sends them."""
    steps = [2 * seq + 1, 2 * seq + 2]
    doc: dict[str, Any] = {
        "schema": 1, "run": run, "session": session, "seq": seq, "rank": rank, "world_size": ranks,
        "node": f"node-{rank // 8}", "local_rank": rank % 8, "steps": steps,
        "timestamps": [1.7e9 + s for s in steps],
        "metrics": {name: [random.random() for _ in steps] for name in _names()},
        "heartbeat": {"ts": 1.7e9 + steps[-1], "phase": "data", "last_step": steps[-1]},
    }  # fmt: skip
    sampled = [s for s in steps if s % AMAX_EVERY == 0]
    if sampled:
        amax = {f"layers.{m}.mlp": [random.random() for _ in sampled] for m in range(MODULES)}
        doc["tensors"] = {"steps": sampled, "stats": {"amax": amax}}
    return gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), compresslevel=1)


HEADERS = {"Content-Type": "application/json", "Content-Encoding": "gzip"}  # a gzipped ingest batch


def connections(urls: list[str], timeout_s: float = REQUEST_TIMEOUT_S) -> list[http.client.HTTPConnection]:
    """One keep-alive connection to each collector URL (a sender thread's own)."""
    out = []
    for url in urls:
        parts = urlsplit(url)
        out.append(http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s))
    return out


def send_all(
    url: str | list[str], bodies: list[bytes], senders: int, route: list[int] | None = None
) -> tuple[float, list[float]]:
    """POST every body from `senders` threads (keep-alive); (wall seconds, each answer's latency). With
    several collector URLs, body i goes to `url[route[i]]` (the agent's rank-to-collector choice)."""
    urls = [url] if isinstance(url, str) else url
    targets = route or [0] * len(bodies)
    queue = iter(zip(targets, bodies, strict=True))
    lock = threading.Lock()
    latencies: list[float] = []
    failures: list[str] = []

    def sender() -> None:
        conns = connections(urls)
        headers = HEADERS
        try:
            while True:
                with lock:
                    item = next(queue, None)
                if item is None:
                    return
                target, body = item
                conn = conns[target]
                start = time.perf_counter()
                conn.request("POST", "/api/v1/ingest", body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                took = time.perf_counter() - start
                with lock:
                    if answer.status != 200 or not json.loads(data).get("accepted"):
                        failures.append(f"{answer.status}: {data[:200]!r}")
                    latencies.append(took)
        finally:
            for conn in conns:
                conn.close()

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(senders)]
    wall = _servers.timed_threads(threads, REQUEST_TIMEOUT_S * len(bodies))
    if failures:
        raise SystemExit(f"{len(failures)} batches not acknowledged, e.g. {failures[0]}")
    return wall, latencies


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Target:
    """One collector under test and its run's next batches."""

    def __init__(self, name: str, url: str, pid: int, ranks: int) -> None:
        self.name, self.url, self.pid, self.ranks = name, url, pid, ranks
        self.run = f"rate-{uuid.uuid4().hex[:8]}"
        self.sessions = [uuid.uuid4().hex for _ in range(ranks)]
        self.seq = 0
        self.rounds: list[dict[str, float]] = []

    def bodies(self, per_rank: int) -> list[bytes]:
        out = [
            batch(self.run, self.sessions[r], r, self.ranks, self.seq + k)
            for k in range(per_rank)
            for r in range(self.ranks)
        ]
        self.seq += per_rank
        return out


@contextlib.contextmanager
def collectors(backend: str, ref: str | None, tmp: Path) -> Iterator[list[tuple[str, str, int]]]:
    """(name, url, pid) of this tree's collector and, with `ref`, that commit's, each on its own database."""
    with contextlib.ExitStack() as stack:
        found = []
        for name, source in [("this tree", None)] + ([(ref, _refs.worktree(ref))] if ref else []):
            label = name if source is None else f"ref {name}"
            db = stack.enter_context(
                _servers.database(backend, f"rate_{len(found)}_{uuid.uuid4().hex[:6]}", tmp)
            )
            log = tmp / f"collector-{len(found)}.log"
            served = stack.enter_context(_servers.collector(db, log_path=log, source=source))
            found.append((label, served.url, served.process.pid))
        yield found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="sqlite,postgres", help="comma-separated (default %(default)s)")
    p.add_argument("--ranks", type=int, default=256, help="ranks of the run (default %(default)s)")
    p.add_argument("--batches-per-rank", type=int, default=4, help="per round (default %(default)s)")
    p.add_argument("--senders", type=int, default=32, help="client threads (default %(default)s)")
    p.add_argument(
        "--rounds", type=int, default=3, help="measured rounds per collector (default %(default)s)"
    )
    p.add_argument("--ref", default=None, help="also run this commit's collector, alternating rounds")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON")
    a = p.parse_args()
    results: dict[str, Any] = {"args": vars(a) | {"json": str(a.json) if a.json else None}, "backends": {}}
    for backend in a.backends.split(","):
        with tempfile.TemporaryDirectory() as tmpdir, collectors(backend, a.ref, Path(tmpdir)) as found:
            targets = [Target(name, url, pid, a.ranks) for name, url, pid in found]
            for t in targets:  # warm-up: every rank's first batch creates its session, rank and names
                send_all(t.url, t.bodies(1), a.senders)
            for r in range(a.rounds):
                for t in targets[r % len(targets) :] + targets[: r % len(targets)]:  # who goes first rotates
                    bodies = t.bodies(a.batches_per_rank)
                    cpu_before = cpu_s(t.pid)
                    wall, lat = send_all(t.url, bodies, a.senders)
                    cpu_ms = 1e3 * (cpu_s(t.pid) - cpu_before) / len(bodies)
                    lat.sort()
                    row = {
                        "batches_per_s": len(bodies) / wall,
                        "p50_ms": 1e3 * lat[len(lat) // 2],
                        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
                        "cpu_ms_per_batch": cpu_ms,
                        "batches_per_core_s": 1e3 / cpu_ms if cpu_ms > 0 else float("inf"),
                    }
                    t.rounds.append(row)
                    print(
                        f"{backend:8s} {t.name:12s} round {r + 1}: {row['batches_per_s']:7.0f} batches/s, "
                        f"p50 {row['p50_ms']:6.1f} ms, p99 {row['p99_ms']:6.1f} ms, "
                        f"collector CPU {cpu_ms:.2f} ms a batch ({row['batches_per_core_s']:.0f} per core-second)",
                        flush=True,
                    )
            summary = {}
            for t in targets:
                med = {k: statistics.median(x[k] for x in t.rounds) for k in t.rounds[0]}
                summary[t.name] = {"median": med, "rounds": t.rounds}
                print(
                    f"{backend:8s} {t.name:12s} median: {med['batches_per_s']:7.0f} batches/s, "
                    f"p50 {med['p50_ms']:6.1f} ms, p99 {med['p99_ms']:6.1f} ms, "
                    f"collector CPU {med['cpu_ms_per_batch']:.2f} ms a batch ({med['batches_per_core_s']:.0f} per core-second)"
                )
            if len(targets) == 2:
                ratio = (
                    summary[targets[0].name]["median"]["batches_per_s"]
                    / summary[targets[1].name]["median"]["batches_per_s"]
                )
                summary["ratio"] = ratio
                print(f"{backend:8s} this tree / {targets[1].name}: {ratio:.2f}x batches/s")
            results["backends"][backend] = summary
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
