"""Ingest throughput end to end (HTTP + gzip + parsing + validation + storage) in values per second,
beside the raw bulk-insert rate of the same value rows into the same database.

For each database (SQLite in a temporary file, PostgreSQL in a fresh database that is dropped
afterwards) a real `stepwatch-server serve` runs in a child process on loopback and applies its
migrations. Then, alternating, `--repeats` times:

- http: `--ranks` batches (one per rank, `--steps` steps x `--metrics` metrics each, plus amax of
  `--modules` modules on every 10th step), gzip JSON per docs/ingest.md, built before the clock
  starts, POSTed by `--senders` threads with keep-alive connections. Values/s = stored rows
  (from the answers) / wall time from the first request to the last answer.
- raw: the same number of value rows, prepared as dicts before the clock starts, written with the
  collector's own `insert_points()` (one executemany), one transaction per rank batch as ingest
  does, by the same number of threads, through the collector's own engine configuration.

The figure is the ratio of the medians, http / raw; "paired" is the median of the per-repeat
ratios (each repeat's two halves ran back to back, so it resists drift on a noisy machine). Every loop is bounded; all traffic is loopback.

    .venv/bin/python bench/ingest_throughput.py [--repeats 5] [--ranks 512] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import http.client
import json
import os
import platform
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
for _src in (REPO / "agent" / "src", REPO / "service" / "src"):
    if _src.is_dir() and str(_src) not in sys.path:
        sys.path.append(str(_src))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _servers  # noqa: E402

REQUEST_TIMEOUT_S = 120.0
AGENT_METRICS = [
    "loss", "grad_norm", "grad_sumsq", "lr", "time.data_ms", "time.forward_ms", "time.backward_ms",
    "time.optimizer_ms", "time.step_ms", "mem.allocated_mb", "mem.reserved_mb", "mem.peak_mb", "mem.rss_mb",
    "nonfinite.loss", "nonfinite.grads", "nonfinite.activations",
]  # fmt: skip
AMAX_EVERY = 10


def metric_names(n: int) -> list[str]:
    return (AGENT_METRICS + [f"user.metric_{i}" for i in range(max(0, n - len(AGENT_METRICS)))])[:n]


def make_batch(
    args: argparse.Namespace, run: str, rank: int, session: str, seq: int, rng: random.Random
) -> tuple[dict[str, Any], int]:
    """Batch `seq` of one rank's agent session, as the agent would send it, and its number of values."""
    first = args.first_step + seq * args.steps
    steps = list(range(first, first + args.steps))
    t0 = 1_764_427_200.0 + first
    metrics = {name: [rng.uniform(0.0, 10.0) for _ in steps] for name in metric_names(args.metrics)}
    tensor_steps = [s for s in steps if s % AMAX_EVERY == 0]
    amax = {f"layers.{i // 4}.{('qkv', 'proj', 'fc1', 'fc2')[i % 4]}": [rng.uniform(0, 50) for _ in tensor_steps]
            for i in range(args.modules)}  # fmt: skip
    batch = {
        "schema": 1,
        "run": run,
        "session": session,
        "seq": seq,
        "rank": rank,
        "local_rank": rank % 8,
        "world_size": args.ranks,
        "node": f"node-{rank // 8:04d}",
        "agent": {"version": "bench", "counters": {"dropped_buffer_full": 0}},
        "steps": steps,
        "timestamps": [t0 + 0.5 * i for i in range(len(steps))],
        "metrics": metrics,
        "tensors": {"steps": tensor_steps, "stats": {"amax": amax}},
        "heartbeat": {"ts": t0 + 0.5 * len(steps), "phase": "data", "last_step": steps[-1]},
    }
    return batch, len(steps) * len(metrics) + len(tensor_steps) * len(amax)


def build_bodies(
    args: argparse.Namespace, run: str, sessions: list[str], seq: int
) -> tuple[list[bytes], int]:
    """Batch `seq` of every rank: the next `--steps` steps of a running job."""
    rng = random.Random(seq)
    bodies, values = [], 0
    for rank in range(args.ranks):
        batch, n = make_batch(args, run, rank, sessions[rank], seq, rng)
        bodies.append(gzip.compress(json.dumps(batch, separators=(",", ":")).encode(), compresslevel=6))
        values += n
    return bodies, values


def send_all(url: str, bodies: list[bytes], senders: int) -> tuple[float, int, list[str]]:
    """POST every body once from `senders` threads; (seconds, stored rows, errors)."""
    parts = urlsplit(url)
    work: queue.Queue[bytes] = queue.Queue()
    for body in bodies:
        work.put(body)
    rows = [0] * senders
    errors: list[str] = []

    def sender(k: int) -> None:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        try:
            while True:
                try:
                    body = work.get_nowait()
                except queue.Empty:
                    return
                conn.request("POST", "/api/v1/ingest", body=body, headers=headers)
                response = conn.getresponse()
                answer = response.read()
                if response.status != 200:
                    errors.append(f"{response.status}: {answer[:300]!r}")
                    continue
                rows[k] += int(json.loads(answer)["rows"])
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()

    threads = [threading.Thread(target=sender, args=(k,), daemon=True) for k in range(senders)]
    return _servers.timed_threads(threads, REQUEST_TIMEOUT_S * len(bodies)), sum(rows), errors


def raw_rows(
    args: argparse.Namespace, series_ids: list[int], amax_ids: list[int], seq: int
) -> list[list[Any]]:
    """The value rows of `--ranks` batches, in the form `insert_points()` takes natively (tuples in
    POINT_COLUMNS order when the store defines them, else dicts), so that no conversion is timed."""
    from stepwatch_server.ingest import store

    columns = getattr(store, "POINT_COLUMNS", None)
    rng = random.Random(seq)
    first = args.first_step + seq * args.steps
    steps = list(range(first, first + args.steps))
    tensor_steps = [s for s in steps if s % AMAX_EVERY == 0]
    per_batch = []
    for rank in range(args.ranks):
        rows: list[Any] = [
            {"series_id": sid, "rank": rank, "step": s, "incarnation": 1, "value": rng.uniform(0.0, 10.0)}
            for sid in series_ids
            for s in steps
        ]
        rows += [
            {"series_id": sid, "rank": rank, "step": s, "incarnation": 1, "value": rng.uniform(0.0, 50.0)}
            for sid in amax_ids
            for s in tensor_steps
        ]
        if columns is not None:
            rows = [tuple(row[c] for c in columns) for row in rows]
        per_batch.append(rows)
    return per_batch


def insert_all(engine: Any, per_batch: list[list[Any]], threads_n: int) -> float:
    from stepwatch_server.ingest.store import insert_points
    from stepwatch_server.storage.engine import write_transaction

    work: queue.Queue[list[Any]] = queue.Queue()
    for rows in per_batch:
        work.put(rows)
    errors: list[str] = []

    def writer() -> None:
        try:
            while True:
                try:
                    rows = work.get_nowait()
                except queue.Empty:
                    return
                with write_transaction(engine) as conn:
                    insert_points(conn, rows)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=writer, daemon=True) for _ in range(threads_n)]
    elapsed = _servers.timed_threads(threads, REQUEST_TIMEOUT_S * len(per_batch))
    if errors:
        raise RuntimeError(f"raw insert failed: {errors[0]}")
    return elapsed


def make_series(engine: Any, run: str, args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """A run and its series dictionary for the raw inserts (the foreign keys need them)."""
    from sqlalchemy import select

    from stepwatch_server.storage.engine import write_transaction
    from stepwatch_server.storage.models import METRIC_STAT, Run, Series

    now = dt.datetime.now(dt.UTC)
    names = metric_names(args.metrics)
    modules = [f"module.{i}" for i in range(args.modules)]
    with write_transaction(engine) as conn:
        conn.execute(
            Run.__table__.insert(),  # type: ignore[attr-defined]
            {"name": run, "world_size": args.ranks, "created_at": now, "last_seen_at": now},
        )
        run_id = conn.execute(select(Run.id).where(Run.name == run)).scalar_one()
        conn.execute(
            Series.__table__.insert(),  # type: ignore[attr-defined]
            [{"run_id": run_id, "stat": METRIC_STAT, "name": n} for n in names]
            + [{"run_id": run_id, "stat": "amax", "name": n} for n in modules],
        )
        ids = {
            (stat, name): sid
            for stat, name, sid in conn.execute(
                select(Series.stat, Series.name, Series.id).where(Series.run_id == run_id)
            )
        }
    return [ids[(METRIC_STAT, n)] for n in names], [ids[("amax", n)] for n in modules]


def bench_backend(backend: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from stepwatch_server.storage.engine import make_engine

    out: dict[str, Any] = {"http_values_per_s": [], "raw_values_per_s": [], "errors": []}
    with (
        _servers.database(backend, "ingest-bench", tmp) as url,
        _servers.collector(url, log_path=tmp / f"collector-{backend}.log") as rx,
    ):
        print(f"[{backend}] collector at {rx.url}, database {url}", flush=True)
        engine = make_engine(url)
        try:
            # One job of --ranks ranks, one agent session per rank: round r is everyone's batch r
            # (the next --steps steps). Round 0 (first batches: runs, sessions, ranks, series are
            # created) is a warm-up and not counted; later rounds are the steady state.
            sessions = [uuid.uuid4().hex for _ in range(args.ranks)]
            series_ids, amax_ids = make_series(engine, "bench-raw", args)
            for r in range(args.warmup + args.repeats):
                # Build both workloads first; the clock runs only around the sending / inserting.
                bodies, expected = build_bodies(args, "bench-http", sessions, seq=r)
                per_batch = raw_rows(args, series_ids, amax_ids, seq=r)
                raw_values = sum(len(rows) for rows in per_batch)
                wire_mb = sum(len(b) for b in bodies) / 2**20

                elapsed, stored, errors = send_all(rx.url, bodies, args.senders)
                if errors:
                    out["errors"] += errors[:5]
                    print(f"[{backend}] {len(errors)} requests failed, first: {errors[0]}", flush=True)
                if stored != expected:
                    print(f"[{backend}] stored {stored} rows, expected {expected}", flush=True)
                http_rate = stored / elapsed
                raw_s = insert_all(engine, per_batch, args.senders)
                raw_rate = raw_values / raw_s
                if r >= args.warmup:
                    out["http_values_per_s"].append(http_rate)
                    out["raw_values_per_s"].append(raw_rate)
                label = "warm-up" if r < args.warmup else f"repeat {r + 1 - args.warmup}/{args.repeats}"
                print(
                    f"[{backend}] {label}: http {stored} values in {elapsed:.2f} s "
                    f"= {http_rate:,.0f}/s ({len(bodies)} batches, {wire_mb:.1f} MiB gzip); "
                    f"raw {raw_values} values in {raw_s:.2f} s = {raw_rate:,.0f}/s",
                    flush=True,
                )
        finally:
            engine.dispose()
    out["http_median"] = statistics.median(out["http_values_per_s"])
    out["raw_median"] = statistics.median(out["raw_values_per_s"])
    out["ratio"] = out["http_median"] / out["raw_median"]
    # Drift-resistant companion figure: each repeat's http and raw ran back to back.
    out["paired_ratio_median"] = statistics.median(
        h / r for h, r in zip(out["http_values_per_s"], out["raw_values_per_s"], strict=True)
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=5, help="alternating http/raw rounds (default %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="rounds not counted first (default %(default)s)"
    )
    parser.add_argument(
        "--ranks", type=int, default=512, help="batches per round, one per rank (default %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=50, help="steps per batch (default %(default)s)")
    parser.add_argument("--metrics", type=int, default=30, help="metrics per step (default %(default)s)")
    parser.add_argument(
        "--modules", type=int, default=16, help="amax modules, every 10th step (default %(default)s)"
    )
    parser.add_argument(
        "--senders", type=int, default=8, help="concurrent HTTP senders (default %(default)s)"
    )
    parser.add_argument("--first-step", type=int, default=1000, help=argparse.SUPPRESS)
    parser.add_argument(
        "--backends", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"]
    )
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON")
    args = parser.parse_args(argv)
    if min(args.repeats, args.ranks, args.steps, args.metrics, args.senders) < 1 or args.modules < 0:
        parser.error("--repeats, --ranks, --steps, --metrics and --senders must be >= 1")
    ok, why = _servers.collector_available()
    if not ok:
        print(
            f"ingest_throughput: the collector (stepwatch-server) is not importable: {why}", file=sys.stderr
        )
        return 2

    results: dict[str, Any] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stepwatch-ingest-bench-") as tmp:
        for backend in args.backends:
            try:
                results[backend] = bench_backend(backend, args, Path(tmp))
            except Exception as exc:
                results[backend] = {"failed": f"{type(exc).__name__}: {exc}"}
                print(f"[{backend}] FAILED: {results[backend]['failed']}", flush=True)
                log = Path(tmp) / f"collector-{backend}.log"
                if log.exists():
                    print(log.read_text(errors="replace")[-3000:])

    print()
    print(
        f"{'database':<12}{'http values/s':>16}{'raw values/s':>16}{'http/raw':>10}{'paired':>9}"
        f"   (medians of {args.repeats} repeats)"
    )
    for backend, r in results.items():
        if "failed" in r:
            print(f"{backend:<12} failed: {r['failed']}")
            continue
        print(
            f"{backend:<12}{r['http_median']:>16,.0f}{r['raw_median']:>16,.0f}{r['ratio']:>10.0%}"
            f"{r['paired_ratio_median']:>9.0%}"
        )
    print(f"target: http/raw >= 50%; measured in {time.perf_counter() - started:.0f} s")
    if args.json:
        out = {
            "results": results,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
            },
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all("failed" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
