"""Does one wide batch starve other runs' ingest? The latency of a small run's batches while another
run writes batches of many series names, on one collector.

A real `stepwatch-server serve` runs in a child process on loopback (SQLite in a temporary file, the
embedded default, where writers queue for the one write lock; or PostgreSQL). Each round:

- small: one client POSTs a one-step batch of 16 metrics for run `small` every `--interval-ms`
  (sequentially: a slow answer delays the next one) from before the wide writer starts until after it
  is done; each answer's latency is recorded. Only the requests sent while the wide writer was busy
  count.
- wide: another client POSTs `--wide-batches` batches of `--names` metric names x `--wide-steps` steps to
  a fresh run: the first creates the run's series, the others only add values.

With `--compare SRC` (the root of another checkout, e.g. `git archive <commit> | tar -x -C SRC`) a
second collector runs that tree's code on its own database, and the rounds alternate between the two,
so that both figures are measured side by side under the same load on the machine. Before and after
each round the collector is let to finish the previous one's detection and rollups. Reported per
collector: the small run's latency (p50, p99, max) and the wide batches' own latencies.

    .venv/bin/python bench/wide_batch_fairness.py                                     # ~1 min
    .venv/bin/python bench/wide_batch_fairness.py --compare /tmp/before --rounds 3   # before/after
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import http.client
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import _servers

REPO = Path(__file__).resolve().parent.parent
REQUEST_TIMEOUT_S = 120.0
SMALL_METRICS = 16
IDLE_S = 2.0  # after detection caught up: the rollup worker's round
SETTLE_S = 0.5  # small batches before the wide writer starts and after it ends (not counted)


def _body(doc: dict[str, Any]) -> bytes:
    return gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), compresslevel=1)


def _batch(run: str, session: str, seq: int, steps: list[int], metrics: dict[str, list[float]]) -> bytes:
    return _body(
        {
            "schema": 1,
            "run": run,
            "session": session,
            "seq": seq,
            "rank": 0,
            "world_size": 1,
            "steps": steps,
            "timestamps": [1_764_427_200.0 + s for s in steps],
            "metrics": metrics,
        }
    )


def wide_bodies(run: str, names: int, steps: int, batches: int) -> list[bytes]:
    rng = random.Random(names)
    session = uuid.uuid4().hex
    out = []
    for seq in range(batches):
        step_list = list(range(seq * steps, (seq + 1) * steps))
        metrics = {f"wide.layers.{i}.stat": [rng.uniform(0, 9) for _ in step_list] for i in range(names)}
        out.append(_batch(run, session, seq, step_list, metrics))
    return out


class Client:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)

    def post(self, body: bytes, refused_ok: bool = False) -> tuple[float, int]:
        """POST one gzip batch; (latency in seconds, status). Raises unless the answer is 200, or a 4xx
        with `refused_ok` (a collector that caps names per run refuses the widest batches)."""
        started = time.perf_counter()
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        self.conn.request("POST", "/api/v1/ingest", body=body, headers=headers)
        response = self.conn.getresponse()
        answer = response.read()
        elapsed = time.perf_counter() - started
        if response.status != 200 and not (refused_ok and 400 <= response.status < 500):
            raise RuntimeError(f"{response.status}: {answer[:300]!r}")
        return elapsed, response.status

    def close(self) -> None:
        self.conn.close()


def one_round(url: str, args: argparse.Namespace, r: int) -> tuple[list[float], list[tuple[float, int]]]:
    """(small latencies while the wide writer was busy, (wide latency, status) each), seconds."""
    bodies = wide_bodies(f"wide-{r}-{uuid.uuid4().hex[:6]}", args.names, args.wide_steps, args.wide_batches)
    wide_busy = threading.Event()
    stop = threading.Event()
    small: list[float] = []
    errors: list[str] = []

    def small_sender() -> None:
        client = Client(url)
        session = uuid.uuid4().hex
        try:
            seq = 0
            while not stop.is_set():
                step = r * 1_000_000 + seq
                metrics = {f"m{i}": [float(seq)] for i in range(SMALL_METRICS)}
                counted = wide_busy.is_set()
                latency, _ = client.post(_batch(f"small-{r}", session, seq, [step], metrics))
                if counted or wide_busy.is_set():
                    small.append(latency)
                seq += 1
                stop.wait(args.interval_ms / 1000.0)
        except Exception as exc:
            errors.append(f"small: {type(exc).__name__}: {exc}")
        finally:
            client.close()

    thread = threading.Thread(target=small_sender, daemon=True)
    thread.start()
    time.sleep(SETTLE_S)
    wide: list[tuple[float, int]] = []
    client = Client(url)
    wide_busy.set()
    try:
        for body in bodies:
            wide.append(client.post(body, refused_ok=True))
    finally:
        wide_busy.clear()
        client.close()
        time.sleep(SETTLE_S)
        stop.set()
        thread.join(REQUEST_TIMEOUT_S)
    if errors:
        raise RuntimeError(errors[0])
    return small, wide


def settle(url: str) -> None:
    """Wait until the collector has digested the last round (detection done, then IDLE_S for the rollups)
    so that one round's background work does not land on the next one's figures."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/api/v1/detection", timeout=10.0) as response:
            d = json.loads(response.read())
        if d["queue_depth"] == 0 and d["processed"] + d["dropped"] >= d["submitted"]:
            break
        time.sleep(0.2)
    time.sleep(IDLE_S)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(small: list[float], wide_answers: list[tuple[float, int]]) -> dict[str, float]:
    wide = [w for w, _ in wide_answers]
    return {
        "small_n": len(small),
        "small_p50_ms": 1000 * statistics.median(small),
        "small_p99_ms": 1000 * _pct(small, 0.99),
        "small_max_ms": 1000 * max(small),
        "wide_p50_ms": 1000 * statistics.median(wide),
        "wide_max_ms": 1000 * max(wide),
        "wide_refused": sum(status != 200 for _, status in wide_answers),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--names", type=int, default=20_000, help="series names of the wide run")
    parser.add_argument("--wide-steps", type=int, default=5, help="steps per wide batch (default 5)")
    parser.add_argument("--wide-batches", type=int, default=3, help="wide batches per round (default 3)")
    parser.add_argument("--interval-ms", type=float, default=50.0, help="small batch every (default 50)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per collector (default 3)")
    parser.add_argument("--backend", default="sqlite", choices=["sqlite", "postgresql"])
    parser.add_argument("--compare", type=Path, default=None, metavar="SRC", help="another checkout's root")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the results as JSON")
    args = parser.parse_args(argv)
    if min(args.names, args.wide_steps, args.wide_batches, args.rounds) < 1:
        parser.error("--names, --wide-steps, --wide-batches and --rounds must be >= 1")

    variants = {"this tree": REPO}  # this checkout's code, whatever the environment would import
    if args.compare is not None:
        variants[f"compare ({args.compare})"] = args.compare.resolve()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="stepwatch-wide-bench-") as tmp_name:
        tmp = Path(tmp_name)
        with contextlib.ExitStack() as stack:
            urls = {}
            for k, (label, source) in enumerate(variants.items()):
                print(f"[{label}] collector code: {_servers.imported_from(source)}", flush=True)
                db = stack.enter_context(_servers.database(args.backend, f"wide-{k}", tmp))
                rx = stack.enter_context(
                    _servers.collector(db, log_path=tmp / f"collector-{k}.log", source=source)
                )
                urls[label] = rx.url
            collected: dict[str, tuple[list[float], list[tuple[float, int]]]] = {
                v: ([], []) for v in variants
            }
            for r in range(args.rounds):
                order = list(variants) if r % 2 == 0 else list(reversed(variants))
                for label in order:
                    settle(urls[label])
                    small, wide = one_round(urls[label], args, r)
                    settle(urls[label])
                    collected[label][0].extend(small)
                    collected[label][1].extend(wide)
                    s = summary(small, wide)
                    print(
                        f"round {r + 1}/{args.rounds} [{label}]: small p50 {s['small_p50_ms']:.0f} ms, "
                        f"p99 {s['small_p99_ms']:.0f} ms, max {s['small_max_ms']:.0f} ms "
                        f"({s['small_n']:.0f} batches); wide "
                        + ", ".join(
                            f"{1000 * w:.0f} ms" + ("" if st == 200 else f" ({st})") for w, st in wide
                        ),
                        flush=True,
                    )
    print(
        f"\n{args.backend}: wide run {args.names:,} names x {args.wide_steps} steps x {args.wide_batches} "
        f"batches; small run 1 step x {SMALL_METRICS} metrics every {args.interval_ms:.0f} ms"
    )
    print("collector | small p50 | small p99 | small max | n | wide p50 | wide max | wide refused")
    for label, (small, wide) in collected.items():
        s = summary(small, wide)
        results[label] = s
        print(
            f"{label} | {s['small_p50_ms']:.0f} ms | {s['small_p99_ms']:.0f} ms | {s['small_max_ms']:.0f} ms "
            f"| {s['small_n']:.0f} | {s['wide_p50_ms']:.0f} ms | {s['wide_max_ms']:.0f} ms | {s['wide_refused']:.0f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"compare": str(args.compare)}, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
