"""Fan-in with the bus: K ingest processes (`serve --bus`) and M detection workers (`detect`) on one PostgreSQL
and one Redis, fed the agent's default batches over real HTTP (issue 16).

Per configuration (`--configs 1x2,2x2`: K ingest x M workers) a fresh PostgreSQL database and a redis-server of
the bench's own (loopback, free port) are started with the processes. One run of `--ranks` ranks sends batches
of the agent's default shape (bench/batch_rate.py: 2 steps x 30 scalars, a heartbeat, amax every 10th step;
gzip JSON, built before the clock starts), rank r to replica r mod K as the agent's multi-URL does: a warm-up
round of every rank's first batch, then `--batches-per-rank` more per rank from `--senders` threads on
keep-alive connections, as fast as the answers come back (a closed loop: what the processes hold, with the
load generator on the same cores). Reported per configuration: batches/s and values/s; the answers' p50/p99;
the ingest processes' CPU per batch and so the batches one ingest core takes per second and the ranks it holds
at the agent's cadence (a batch per rank every 2 s); the workers' CPU per batch; the bus's backlog sampled
every 0.5 s (entries not yet processed: it must come back to 0) and how long after the last answer detection
caught up; the workers' own p99 lag from the ingest answer to the anomalies stored; RSS of every process.

    .venv/bin/python bench/fan_in.py                                   # 1x2 and 2x2, 512 ranks, ~2 min
    .venv/bin/python bench/fan_in.py --configs 1x1,2x2 --ranks 1024 --json fan_in.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

import _servers
import batch_rate
from stepwatch_server.bus import streams

CATCH_UP_TIMEOUT_S = 300.0
VALUES_PER_BATCH = 2 * batch_rate.SCALARS + 2  # scalars of 2 steps and their timestamps (amax aside)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server)")
    port = _servers.free_port()
    cmd = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(tmp),
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(redis.RedisError), streams.connect(url) as client:
                if client.ping():
                    break
            if time.monotonic() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        process.wait(30)


@contextlib.contextmanager
def deployment(
    ingest: int, workers: int, tmp: Path, source: Path | None = None
) -> Iterator[tuple[list[tuple[str, int]], list[int], str]]:
    """(url, pid) of each ingest process, the workers' pids, the bus URL; with `source` (a checkout, as
    bench/_refs.py makes) that tree's collector code runs."""
    with contextlib.ExitStack() as stack:
        db = stack.enter_context(_servers.database("postgres", f"fan_in_{uuid.uuid4().hex[:6]}", tmp))
        bus = stack.enter_context(redis_server(tmp))
        serving = []
        for i in range(ingest):  # one at a time: the first applies the migrations
            port = _servers.free_port()
            cmd = [sys.executable, "-m", "stepwatch_server.cli", "serve", "--port", str(port)]
            cmd += ["--database-url", db, "--bus", bus]
            log = stack.enter_context(open(tmp / f"serve-{i}.log", "wb"))
            process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=_servers.child_env(source)
            )
            stack.callback(_servers._stop, process)
            url = f"http://127.0.0.1:{port}"
            _servers._wait_healthy(url, process, "/healthz")
            serving.append((url, process.pid))
        pids = []
        for i in range(workers):
            cmd = [sys.executable, "-m", "stepwatch_server.cli", "detect", "--bus", bus, "--database-url", db]
            log = stack.enter_context(open(tmp / f"detect-{i}.log", "wb"))
            process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=_servers.child_env(source)
            )
            stack.callback(_servers._stop, process)
            pids.append(process.pid)
        yield serving, pids, bus


def backlog(client: Any) -> int:
    """Entries of every stream not yet delivered to a worker or delivered and not acknowledged."""
    total = 0
    for p in range(streams.PARTITIONS):
        key = streams.stream_key(p)
        groups = client.xinfo_groups(key) if client.exists(key) else []
        if not groups and client.exists(key):
            total += int(client.xlen(key))
        for group in groups:
            total += int(group.get("lag") or 0) + int(group.get("pending") or 0)
    return total


def send(urls: list[str], bodies: list[tuple[int, bytes]], senders: int) -> tuple[float, list[float]]:
    """POST every (rank, body) to replica rank mod K from `senders` threads; (wall seconds, latencies)."""
    route = [rank % len(urls) for rank, _ in bodies]
    return batch_rate.send_all(urls, [body for _, body in bodies], senders, route)


def measure(ingest: int, workers: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, deployment(ingest, workers, Path(tmp)) as (serving, pids, bus):
        client = streams.connect(bus)
        urls = [u for u, _ in serving]
        run = f"fan-in-{uuid.uuid4().hex[:6]}"
        sessions = [uuid.uuid4().hex for _ in range(args.ranks)]
        warm = [(r, batch_rate.batch(run, sessions[r], r, args.ranks, 0)) for r in range(args.ranks)]
        send(urls, warm, args.senders)
        bodies = [
            (r, batch_rate.batch(run, sessions[r], r, args.ranks, k))
            for k in range(1, args.batches_per_rank + 1)
            for r in range(args.ranks)
        ]
        deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
        while backlog(client) and time.monotonic() < deadline:  # the warm-up detected first
            time.sleep(0.2)
        cpu0 = {pid: batch_rate.cpu_s(pid) for pid in [p for _, p in serving] + pids}
        samples: list[tuple[float, int]] = []
        stop = threading.Event()
        started = time.monotonic()

        def sample() -> None:
            with streams.connect(bus) as own:
                while not stop.is_set():
                    samples.append((time.monotonic() - started, backlog(own)))
                    stop.wait(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        wall, latencies = send(urls, bodies, args.senders)
        sent_at = time.monotonic()
        while backlog(client) and time.monotonic() < deadline:
            time.sleep(0.05)
        caught_up_s = time.monotonic() - sent_at
        stop.set()
        sampler.join()
        cpu = {pid: batch_rate.cpu_s(pid) - cpu0[pid] for pid in cpu0}
        rss = {pid: rss_mib(pid) for pid in cpu0}
        time.sleep(1.5)  # the workers' counters in Redis are refreshed every second
        alive = client.zrange(streams.WORKERS_KEY, 0, -1)
        stats = [
            json.loads(v) for v in client.mget([streams.worker_stats_key(w.decode()) for w in alive]) if v
        ]
        client.close()
    n = len(bodies)
    ingest_cpu = sum(cpu[p] for _, p in serving)
    worker_cpu = sum(cpu[p] for p in pids)
    lat = sorted(latencies)
    per_core = n / ingest_cpu if ingest_cpu else float("nan")
    return {
        "ingest": ingest,
        "workers": workers,
        "batches": n,
        "batches_per_s": n / wall,
        "values_per_s": n * VALUES_PER_BATCH / wall,
        "p50_ms": statistics.median(lat) * 1000,
        "p99_ms": lat[int(0.99 * (len(lat) - 1))] * 1000,
        "ingest_cpu_ms_per_batch": ingest_cpu / n * 1000,
        "batches_per_ingest_core_s": per_core,
        "ranks_per_ingest_core": per_core * 2.0,  # the agent's default: a batch per rank every ~2 s
        "worker_cpu_ms_per_batch": worker_cpu / n * 1000,
        "caught_up_after_s": caught_up_s,
        "backlog_max": max((b for _, b in samples), default=0),
        "backlog_samples": samples,
        "worker_lag_p99_ms": max((s["lag_ms"]["p99"] or 0.0 for s in stats), default=None),
        "rss_mib": {"ingest": [rss[p] for _, p in serving], "workers": [rss[p] for p in pids]},
    }


def parse_configs(text: str) -> list[tuple[int, int]]:
    """`--configs`: comma-separated KxM (K ingest processes x M detection workers, each >= 1)."""
    out = []
    for config in text.split(","):
        k, _, m = config.partition("x")
        if not (k.isdigit() and m.isdigit() and int(k) >= 1 and int(m) >= 1):
            raise SystemExit(f"--configs: expected KxM such as 2x2, got {config!r}")
        out.append((int(k), int(m)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs", default="1x2,2x2", help="K ingest x M workers, comma-separated (default %(default)s)"
    )
    p.add_argument("--ranks", type=int, default=512, help="ranks of the run (default %(default)s)")
    p.add_argument(
        "--batches-per-rank", type=int, default=6, help="measured batches per rank (default %(default)s)"
    )
    p.add_argument("--senders", type=int, default=32, help="client threads (default %(default)s)")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()
    results = []
    for k, m in parse_configs(args.configs):
        print(f"{k} ingest x {m} workers, {args.ranks} ranks ...", flush=True)
        out = measure(k, m, args)
        results.append(out)
        print(
            f"  {out['batches_per_s']:.0f} batches/s ({out['values_per_s']:,.0f} values/s), "
            f"p50 {out['p50_ms']:.0f} ms, p99 {out['p99_ms']:.0f} ms; ingest CPU {out['ingest_cpu_ms_per_batch']:.2f} "
            f"ms/batch = {out['batches_per_ingest_core_s']:.0f} batches per core-s ({out['ranks_per_ingest_core']:.0f} "
            f"ranks per ingest core at 1 batch / 2 s); workers {out['worker_cpu_ms_per_batch']:.2f} ms/batch; "
            f"backlog max {out['backlog_max']}, caught up {out['caught_up_after_s']:.1f} s after the last answer; "
            f"worker lag p99 {out['worker_lag_p99_ms']} ms; RSS {out['rss_mib']}",
            flush=True,
        )
    if len(results) >= 2:
        a, b = results[0], results[-1]
        print(f"scaling {b['ingest']}x{b['workers']} / {a['ingest']}x{a['workers']}: "
              f"{b['batches_per_s'] / a['batches_per_s']:.2f}x batches/s")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
