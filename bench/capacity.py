"""The capacity table (issue 16): the largest world size that K ingest processes and M detection workers hold
with every batch acknowledged within 1 s (p99), the ranks sending at the agent's default cadence, open loop.

Per configuration (`--configs 1x1,2x2`) a fresh deployment as bench/fan_in.py makes (a PostgreSQL database and a
redis-server of the bench's own, `serve --bus` x K, `detect` x M, loopback). Then world sizes from `--start`,
each `--factor` times the last, each for `--seconds`: a new run whose rank r sends batch k (the agent's default
shape, bench/batch_rate.py) at r/W x 2 s + 2k s, to replica r mod K. A pool of `--senders` threads sends each
batch when it is due, not when the last answer came back (open loop), and its latency counts from when it was
due, so a send that waited for a free thread is late too (no coordinated omission). A level holds when every
batch was acknowledged, the p99 latency is <= `--p99-ms` and the bus's backlog is back to 0 within `--drain-s`
of the last answer. The p99 is over the steady state, each rank's batches after its first (one more round is
sent first: W new sessions within 2 s, as when a run starts); that first round's p99 is reported beside it. The
ramp stops at the first level that does not hold; the capacity is the last that held. The load generator runs
on the same machine as everything else: its CPU, the processes' and the whole machine's are reported.

    .venv/bin/python bench/capacity.py --factor 1.25                   # 1x1 and 2x2, ~6 min (bench/README.md)
    .venv/bin/python bench/capacity.py --configs 1x1 --start 512 --factor 1.25 --json capacity.json
    .venv/bin/python bench/capacity.py --configs 1x1 --start 496 --max-world 496 --seconds 30 --ref HEAD~3
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import _refs
import _servers
import batch_rate
import fan_in
from stepwatch_server.bus import streams

CADENCE_S = 2.0  # the agent's default flush interval up to 4,000 ranks
REQUEST_TIMEOUT_S = 30.0


def quantile_ms(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted seconds, in ms (nan when there are none)."""
    return ordered[int(q * (len(ordered) - 1))] * 1000 if ordered else float("nan")


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far, all cores (Linux /proc/stat): PostgreSQL and Redis too."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def server_buckets(urls: list[str]) -> dict[float, float]:
    """The replicas' `stepwatch_ingest_duration_seconds` histogram (receipt to answer), summed: {le: count}."""
    out: dict[float, float] = {}
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        for line in text.splitlines():
            if line.startswith("stepwatch_ingest_duration_seconds_bucket{"):
                le = float(line.split('le="')[1].split('"')[0])
                out[le] = out.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def bucket_p99_ms(before: dict[float, float], after: dict[float, float]) -> float:
    """The upper bound of the bucket that holds the 99th percentile of what was observed in between."""
    cumulative = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = cumulative[-1][1] if cumulative else 0.0
    for le, count in cumulative:
        if total and count >= 0.99 * total:
            return le * 1000
    return float("nan")


def send_open_loop(
    urls: list[str], plan: list[tuple[float, bool, int, bytes]], senders: int
) -> tuple[list[tuple[bool, float]], list[str]]:
    """Send each (due offset s, a rank's first?, replica, body) of `plan` (sorted by due) when due;
    ((a rank's first?, latency from due) for each batch, failures)."""
    lock = threading.Lock()
    latencies: list[tuple[bool, float]] = []
    failures: list[str] = []
    nxt = iter(plan)
    t0 = time.perf_counter() + 0.5  # every thread connected and waiting by then

    def sender() -> None:
        conns = batch_rate.connections(urls, REQUEST_TIMEOUT_S)
        headers = batch_rate.HEADERS
        try:
            while True:
                with lock:
                    item = next(nxt, None)
                if item is None:
                    return
                due, first, target, body = item
                wait = t0 + due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                failure = ""
                for attempt in range(2):  # once more on a fresh connection: the server closes idle ones
                    try:
                        conns[target].request("POST", "/api/v1/ingest", body=body, headers=headers)
                        answer = conns[target].getresponse()
                        data = answer.read()
                        ok = answer.status == 200 and bool(json.loads(data).get("accepted"))
                        failure = "" if ok else f"{answer.status}: {data[:200]!r}"
                        break
                    except (OSError, http.client.HTTPException) as exc:
                        conns[target].close()
                        failure = f"{type(exc).__name__}: {exc}" if attempt else ""
                took = time.perf_counter() - (t0 + due)
                with lock:
                    latencies.append((first, took))
                    if failure:
                        failures.append(failure)
        finally:
            for conn in conns:
                conn.close()

    threads = [threading.Thread(target=sender, daemon=True) for _ in range(senders)]
    last_due = plan[-1][0] if plan else 0.0
    _servers.timed_threads(threads, last_due + 2 * REQUEST_TIMEOUT_S + 5.0)
    return latencies, failures


def level(urls: list[str], pids: list[int], bus: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """One world size for `args.seconds` on a running deployment."""
    run = f"capacity-{world}-{uuid.uuid4().hex[:6]}"
    sessions = [uuid.uuid4().hex for _ in range(world)]
    per_rank = max(1, round(args.seconds / CADENCE_S))
    plan = sorted(
        (
            r / world * CADENCE_S + k * CADENCE_S,
            k == 0,
            r % len(urls),
            batch_rate.batch(run, sessions[r], r, world, k),
        )
        for k in range(per_rank + 1)
        for r in range(world)
    )
    cpu0 = {pid: batch_rate.cpu_s(pid) for pid in pids}
    hist0 = server_buckets(urls)
    own0 = os.times()
    busy0 = machine_busy_s()
    started = time.perf_counter()
    latencies, failures = send_open_loop(urls, plan, args.senders)
    wall = time.perf_counter() - started
    own = os.times()
    busy = machine_busy_s() - busy0
    server_p99_ms = bucket_p99_ms(hist0, server_buckets(urls))
    cpu = {pid: batch_rate.cpu_s(pid) - cpu0[pid] for pid in pids}
    client = streams.connect(bus)
    drained_at = time.monotonic()
    deadline = drained_at + args.drain_s
    while (left := fan_in.backlog(client)) and time.monotonic() < deadline:
        time.sleep(0.1)
    drain_s = time.monotonic() - drained_at
    client.close()
    lat = sorted(t for first, t in latencies if not first)  # steady state: each rank's session exists
    start = sorted(t for first, t in latencies if first)  # the round that starts W sessions within 2 s
    p99_ms = quantile_ms(lat, 0.99)
    holds = not failures and p99_ms <= args.p99_ms and not left
    return {
        "world": world,
        "batches": len(plan),
        "offered_per_s": world / CADENCE_S,
        "batches_per_s": len(latencies) / wall,
        "first_round_p99_ms": quantile_ms(start, 0.99),
        "p50_ms": quantile_ms(lat, 0.5),
        "p99_ms": p99_ms,
        "failures": len(failures),
        "failure_example": failures[0] if failures else None,
        "backlog_left": left,
        "drain_s": drain_s,
        "cpu_s": cpu,
        "generator_cpu_s": own.user + own.system - own0.user - own0.system,
        "wall_s": wall,
        "machine_cores": busy / wall,
        "server_p99_ms_at_most": server_p99_ms,
        "holds": holds,
    }


def ramp(ingest: int, workers: int, args: argparse.Namespace, source: Path | None = None) -> dict[str, Any]:
    levels: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        fan_in.deployment(ingest, workers, Path(tmp), source) as (serving, wpids, bus),
    ):
        urls = [u for u, _ in serving]
        ingest_pids = [p for _, p in serving]
        world = args.start
        while world <= args.max_world:
            out = level(urls, ingest_pids + wpids, bus, world, args)
            ingest_cpu = sum(out["cpu_s"][p] for p in ingest_pids) / out["wall_s"]
            worker_cpu = sum(out["cpu_s"][p] for p in wpids) / out["wall_s"]
            out["ingest_cores"], out["worker_cores"] = ingest_cpu, worker_cpu
            out["generator_cores"] = out["generator_cpu_s"] / out["wall_s"]
            levels.append(out)
            print(
                f"  {world:>6} ranks ({out['offered_per_s']:.0f} batches/s offered, {out['batches_per_s']:.0f} sent): "
                f"p50 {out['p50_ms']:.0f} ms, p99 {out['p99_ms']:.0f} ms (first round {out['first_round_p99_ms']:.0f}; "
                f"in the server <= {out['server_p99_ms_at_most']:.0f}), "
                f"{out['failures']} failed, backlog "
                f"{out['backlog_left']} after {out['drain_s']:.1f} s; CPU: ingest {ingest_cpu:.2f}, workers "
                f"{worker_cpu:.2f}, generator {out['generator_cores']:.2f}, machine {out['machine_cores']:.2f} of "
                f"{os.cpu_count()} cores -> "
                f"{'holds' if out['holds'] else 'does not hold'}"
                + (f" ({out['failure_example']})" if out["failure_example"] else ""),
                flush=True,
            )
            if not out["holds"]:
                break
            world = max(world + 8, round(world * args.factor / 8) * 8)
    held = [lv["world"] for lv in levels if lv["holds"]]
    return {"ingest": ingest, "workers": workers, "capacity": max(held, default=0), "levels": levels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="1x1,2x2", help="K ingest x M workers (default %(default)s)")
    p.add_argument("--start", type=int, default=256, help="first world size (default %(default)s)")
    p.add_argument(
        "--factor", type=float, default=1.5, help="each level's ranks / the last's (default %(default)s)"
    )
    p.add_argument("--max-world", type=int, default=8192, help="stop the ramp here (default %(default)s)")
    p.add_argument("--seconds", type=float, default=16.0, help="sending time per level (default %(default)s)")
    p.add_argument(
        "--p99-ms", type=float, default=1000.0, help="the bound a level must hold (default %(default)s)"
    )
    p.add_argument(
        "--drain-s", type=float, default=30.0, help="backlog back to 0 within (default %(default)s)"
    )
    p.add_argument("--senders", type=int, default=96, help="client threads (default %(default)s)")
    p.add_argument(
        "--ref",
        help="also ramp this commit's collector (a worktree, bench/_refs.py) after this tree's, per configuration",
    )
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()
    if args.factor <= 1.0 or args.start < 1:
        raise SystemExit("--factor must be > 1 and --start >= 1")
    results = []
    trees = [("this tree", None)] + ([(f"ref {args.ref}", _refs.worktree(args.ref))] if args.ref else [])
    for k, m in fan_in.parse_configs(args.configs):
        for label, source in trees:
            print(
                f"{label}: {k} ingest x {m} workers, from {args.start} ranks, {args.seconds:.0f} s a level ...",
                flush=True,
            )
            out = ramp(k, m, args, source) | {"tree": label}
            results.append(out)
            print(f"  capacity: {out['capacity']} ranks at p99 <= {args.p99_ms:.0f} ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
