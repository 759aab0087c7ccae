"""Detection latency: from a batch being acknowledged to its anomalies being stored, at 512 ranks.

A 512-rank simulator scenario with faults (a 2x forward straggler from early on, which keeps its
anomaly updating, and a NaN in one layer on one rank later) is generated first, gzip-compressed, and
then sent over HTTP by concurrent senders (each owns a fixed set of ranks and sends their batches in
the simulator's arrival order, as the ranks' agents would) into a real `stepwatch-server serve` in a
child process, on SQLite and on PostgreSQL. The collector's detection worker measures, per batch,
the time from the ingest acknowledgement to the round that fed it having its anomalies stored; the
script reads the p50/p99 from `GET /api/v1/detection` once everything is processed, and checks that
the faults were found (`GET /api/v1/runs/{run}/anomalies`).

`--speed` paces the senders on the records' event time (`--speed 20`: twenty times faster than the
run itself; 0: as fast as the collector takes them, the default and the hardest case).

    .venv/bin/python bench/detection_latency.py                     # both backends, defaults
    .venv/bin/python bench/detection_latency.py --backends sqlite --steps 200 --senders 16
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import orjson

import _servers
from _servers import collector
from stepwatch_server.simulate import NonFinite, Scenario, Simulation, Straggler

TARGET_P99_MS = 1000.0
DETECTION_WAIT_S = 300.0


def scenario(world_size: int, steps: int) -> Scenario:
    nan_step = max(60, int(steps * 0.7))
    return Scenario(
        "bench_detection_latency",
        world_size,
        steps,
        seed=512,
        warmup_steps=20,
        faults=(
            Straggler(world_size - 212 if world_size > 212 else world_size - 1, 20, factor=2.0),
            NonFinite(nan_step, ranks=(world_size // 3,), module="layers.3.attn.qkv"),
        ),
    )


def generate(sc: Scenario) -> list[tuple[int, float, bytes]]:
    """(rank, event time of its last step, gzip body) in arrival order."""
    out = []
    for doc in Simulation(sc):
        ts = doc["timestamps"][-1] if doc.get("timestamps") else doc["heartbeat"]["ts"]
        out.append((int(doc["rank"]), float(ts), gzip.compress(orjson.dumps(doc), compresslevel=1)))
    return out


def _request(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None) -> Any:
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"} if body else {}
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    data = response.read()
    if response.status != 200:
        raise RuntimeError(f"{method} {path}: HTTP {response.status}: {data[:300]!r}")
    return json.loads(data)


def send_all(url: str, batches: list[tuple[int, float, bytes]], senders: int, speed: float) -> float:
    """Send with `senders` threads (rank r goes to sender r % senders); returns the seconds taken."""
    parsed = urllib.parse.urlsplit(url)
    t0_event = batches[0][1]
    errors: list[str] = []
    start = time.monotonic()

    def sender(k: int) -> None:
        conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=120)
        try:
            for rank, ts, body in batches:
                if rank % senders != k:
                    continue
                if speed > 0:
                    wait = (ts - t0_event) / speed - (time.monotonic() - start)
                    if wait > 0:
                        time.sleep(wait)
                _request(conn, "POST", "/api/v1/ingest", body)
        except Exception as exc:
            errors.append(f"sender {k}: {exc}")
        finally:
            conn.close()

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    return time.monotonic() - start


def wait_for_detection(conn: http.client.HTTPConnection) -> dict[str, Any]:
    deadline = time.monotonic() + DETECTION_WAIT_S
    while True:
        stats: dict[str, Any] = _request(conn, "GET", "/api/v1/detection")
        if stats["queue_depth"] == 0 and stats["processed"] + stats["dropped"] >= stats["submitted"]:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"detection did not catch up in {DETECTION_WAIT_S:.0f} s: {stats}")
        time.sleep(0.1)


def bench_backend(
    backend: str, sc: Scenario, batches: list[tuple[int, float, bytes]], args: argparse.Namespace
) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory() as tmp,
        _servers.database(backend, "detection-bench", Path(tmp)) as url,
        collector(url, log_path=Path(tmp) / "collector.log") as receiver,
    ):
        seconds = send_all(receiver.url, batches, args.senders, args.speed)
        parsed = urllib.parse.urlsplit(receiver.url)
        conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
        stats = wait_for_detection(conn)
        run = urllib.parse.quote(f"sim-{sc.name}")
        anomalies = _request(conn, "GET", f"/api/v1/runs/{run}/anomalies")["anomalies"]
        conn.close()
    lag = stats["lag_ms"]
    return {
        "backend": backend,
        "batches": len(batches),
        "send_s": round(seconds, 1),
        "batches_per_s": round(len(batches) / seconds),
        "processed": stats["processed"],
        "dropped": stats["dropped"],
        "errors": stats["errors"],
        "lag_samples": stats["lag_samples"],
        "p50_ms": lag["p50"],
        "p99_ms": lag["p99"],
        "max_ms": lag["max"],
        "found": sorted({(a["kind"], a["rank"]) for a in anomalies}, key=str),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--steps", type=int, default=150, help="steps of the run (default %(default)s)")
    parser.add_argument(
        "--senders", type=int, default=16, help="concurrent HTTP senders (default %(default)s)"
    )
    parser.add_argument("--speed", type=float, default=0.0, help="x event time; 0 = as fast as possible")
    parser.add_argument(
        "--backends", nargs="+", default=["sqlite", "postgres"], choices=["sqlite", "postgres"]
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    sc = scenario(args.ranks, args.steps)
    started = time.monotonic()
    batches = generate(sc)
    print(
        f"{sc.world_size} ranks x {sc.steps} steps: {len(batches)} batches generated in "
        f"{time.monotonic() - started:.1f} s; {args.senders} senders, speed {args.speed or 'max'}",
        flush=True,
    )
    results = []
    for backend in args.backends:
        r = bench_backend(backend, sc, batches, args)
        results.append(r)
        verdict = "ok" if r["p99_ms"] is not None and r["p99_ms"] < TARGET_P99_MS else "OVER TARGET"
        print(
            f"{backend:<9} {r['batches']} batches in {r['send_s']} s ({r['batches_per_s']}/s); "
            f"ack -> anomalies stored: p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, "
            f"max {r['max_ms']:.1f} ms over {r['lag_samples']} batches [{verdict}, target p99 < "
            f"{TARGET_P99_MS:.0f} ms]; dropped {r['dropped']}, errors {r['errors']}; found {r['found']}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["p99_ms"] is not None and r["p99_ms"] < TARGET_P99_MS for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
