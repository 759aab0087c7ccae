"""Does the collector's memory stay bounded over many runs? (issue 14: ~0.2 MiB kept per run, never freed)

A real `stepwatch-server serve` runs in a child process on loopback (SQLite in a temporary file, or a fresh
PostgreSQL database dropped afterwards) and receives `--runs` short runs one after another, as a busy shared
collector does over weeks: each run has `--ranks` ranks sending `--batches` batches of the agent's default
shape (bench/batch_rate.py: 2 steps x 30 scalars, a heartbeat, amax every 10th step), then each rank's session_end event;
every 10th run is read the way a user opens it (run, health, ranks, anomalies, loss series, heatmap). The
collector's resident memory (VmRSS from /proc) is sampled every `--every` runs. Reported: RSS at each sample
and the growth per run between the first sample past the warm-up (`--warm` runs) and the last, which an
unbounded per-run cache shows as a straight line.

With `--ref REF` a second collector runs that commit's code (a detached worktree under /tmp, bench/_refs.py)
on its own database, and the runs are sent to both in turn, so both are measured side by side.

    .venv/bin/python bench/runs_memory.py                            # SQLite, 2,000 runs, ~3 min
    .venv/bin/python bench/runs_memory.py --backends sqlite,postgres --ref HEAD~5 --json memory.json
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import batch_rate

REQUEST_TIMEOUT_S = 60.0


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` in MiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class Client:
    """One keep-alive connection to a collector."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_S)

    def post(self, body: bytes, gzipped: bool = True) -> None:
        headers = {"Content-Type": "application/json"}
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        self.conn.request("POST", "/api/v1/ingest", body=body, headers=headers)
        answer = self.conn.getresponse()
        data = answer.read()
        if answer.status != 200 or not json.loads(data).get("accepted"):
            raise SystemExit(f"batch not acknowledged: {answer.status} {data[:300]!r}")

    def get(self, path: str) -> None:
        self.conn.request("GET", path)
        answer = self.conn.getresponse()
        data = answer.read()
        if answer.status != 200:
            raise SystemExit(f"GET {path}: {answer.status} {data[:300]!r}")

    def close(self) -> None:
        self.conn.close()


def finish_batch(run: str, session: str, rank: int, ranks: int, seq: int, step: int) -> bytes:
    doc: dict[str, Any] = {
        "schema": 1, "run": run, "session": session, "seq": seq, "rank": rank, "world_size": ranks,
        "steps": [], "timestamps": [], "metrics": {},
        "events": [{"step": step, "ts": 1.7e9 + step, "kind": "session_end", "data": {}}],
    }  # fmt: skip
    return gzip.compress(json.dumps(doc).encode(), compresslevel=1)


def one_run(client: Client, index: int, ranks: int, batches: int, read: bool) -> None:
    run = f"short-{index:05d}-{uuid.uuid4().hex[:6]}"
    sessions = [uuid.uuid4().hex for _ in range(ranks)]
    for seq in range(batches):
        for rank in range(ranks):
            client.post(batch_rate.batch(run, sessions[rank], rank, ranks, seq))
    for rank in range(ranks):
        client.post(finish_batch(run, sessions[rank], rank, ranks, batches, 2 * batches))
    if read:
        for path in (
            f"/api/v1/runs/{run}",
            f"/api/v1/runs/{run}/health",
            f"/api/v1/runs/{run}/ranks",
            f"/api/v1/runs/{run}/anomalies",
            f"/api/v1/runs/{run}/series?metric=loss&rank=all",
            f"/api/v1/runs/{run}/heatmap?metric=time.step_ms",
        ):
            client.get(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="sqlite", help="comma-separated (default %(default)s)")
    p.add_argument("--runs", type=int, default=2000, help="short runs sent (default %(default)s)")
    p.add_argument("--ranks", type=int, default=2, help="ranks per run (default %(default)s)")
    p.add_argument("--batches", type=int, default=5, help="batches per rank (default %(default)s)")
    p.add_argument(
        "--warm", type=int, default=400, help="runs before growth is measured (default %(default)s)"
    )
    p.add_argument("--every", type=int, default=200, help="runs between samples (default %(default)s)")
    p.add_argument("--ref", help="also measure this commit's collector, side by side")
    p.add_argument("--json", type=Path, help="write the results here too")
    args = p.parse_args()
    if args.warm >= args.runs:
        raise SystemExit(f"--warm ({args.warm}) must be below --runs ({args.runs})")
    results: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "backends": {}}
    for backend in args.backends.split(","):
        with (
            tempfile.TemporaryDirectory() as tmp,
            batch_rate.collectors(backend, args.ref, Path(tmp)) as found,
        ):
            clients = [(name, Client(url), pid) for name, url, pid in found]
            samples: dict[str, list[tuple[int, float]]] = {name: [] for name, _, _ in found}
            started = time.monotonic()
            for i in range(args.runs):
                for _, client, _ in clients:
                    one_run(client, i, args.ranks, args.batches, read=i % 10 == 0)
                done = i + 1
                if done % args.every == 0 or done == args.runs:
                    for name, _, pid in clients:
                        samples[name].append((done, rss_mib(pid)))
                    line = "  ".join(f"{n}: {s[-1][1]:.0f} MiB" for n, s in samples.items())
                    print(f"{backend}: {done} runs ({time.monotonic() - started:.0f} s)  {line}", flush=True)
            for _, client, _ in clients:
                client.close()
        out = {}
        for name, points in samples.items():
            after = [(n, r) for n, r in points if n >= args.warm]
            (n0, r0), (n1, r1) = after[0], after[-1]
            per_run_kib = (r1 - r0) * 1024 / (n1 - n0) if n1 > n0 else 0.0
            out[name] = {"samples": points, "growth_kib_per_run": per_run_kib}
            print(f"{backend} {name}: RSS {r0:.0f} MiB at run {n0} -> {r1:.0f} MiB at run {n1}: "
                  f"{per_run_kib:.1f} KiB a run")  # fmt: skip
        results["backends"][backend] = out
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
