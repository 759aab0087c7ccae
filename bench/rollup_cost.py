"""What the rollup worker costs on a live run: its CPU per million values and its lag after the last write.

A run of `--ranks` ranks x `--series` series at `--steps-per-s` steps a second, written for `--seconds` as
ingest writes it: each rank's batch of `--batch-s` seconds of steps (the agent's cadence: 2 s) in a
transaction of its own (the collector's bulk insert, `insert_points`), its step range handed to a
`RollupWorker` right after the commit, the ranks' batches spread evenly over each interval. Each
measurement is one child process on a fresh database with a tree's code first on its path
(bench/_servers.child_env); with `--ref REF` that commit's worker (a worktree under /tmp, bench/_refs.py)
alternates with this tree's, `--rounds` each.

Reported per database and tree (medians over rounds): the CPU seconds per million values written of the
rollup worker (SQLite: its thread, /proc/self/task/TID/stat, SQLite's own work included; PostgreSQL: every
postgres process of the server minus what the same writes cost with no worker, measured in the same
child first, so the rollup statements' work in the server is what is counted) and the seconds from the
last write until the worker has rolled up everything, its next round forced at once (`wait_idle`; the
collector's worker takes a run's range half a second after its last batch, `QUIET_S`). Writes that fall
behind the pace are said.

    .venv/bin/python bench/rollup_cost.py [--ranks 256] [--series 30] [--seconds 64] [--ref REF] [--rounds 2]
        [--backends sqlite,postgresql] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _refs
import _servers

CATCH_UP_S = 300.0  # the bound on waiting for the worker after the last write
TICK_S = os.sysconf("SC_CLK_TCK")


def _ticks(path: str) -> int:
    """utime + stime of a /proc stat file, in clock ticks (the name in parentheses may hold spaces)."""
    fields = Path(path).read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def _postgres_ticks() -> int:
    """The CPU ticks of every postgres process on the machine (the server and its backends)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() in ("postgres", "postmaster"):
                total += _ticks(f"/proc/{pid}/stat")
        except OSError:
            continue  # gone meanwhile
    return total


def _write(
    engine: Any, run_id: int, ids: list[int], args: argparse.Namespace, first_step: int, worker: Any
) -> dict[str, float]:
    """`args.seconds` of the run from `first_step` at its pace; each rank batch handed to `worker` (None:
    none). The writing thread's CPU, the server's (PostgreSQL) and how far the writes fell behind."""
    from stepwatch_server.ingest.store import insert_points

    per_batch = max(1, round(args.steps_per_s * args.batch_s))
    batches = max(1, round(args.seconds / args.batch_s))
    gap = args.batch_s / args.ranks
    cpu0, pg0, start = time.thread_time(), _postgres_ticks(), time.monotonic()
    behind = 0.0
    for b in range(batches):
        lo = first_step + b * per_batch
        steps = range(lo, lo + per_batch)
        for rank in range(args.ranks):
            due = start + b * args.batch_s + rank * gap
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            else:
                behind = max(behind, -wait)
            rows = [
                (sid, rank, s, 1, 1.0 + 0.001 * s + 0.01 * rank + 1e-4 * k)
                for s in steps
                for k, sid in enumerate(ids)
            ]
            with engine.begin() as conn:
                insert_points(conn, rows)
            if worker is not None:
                worker.submit(run_id, lo, lo + per_batch - 1)
    return {
        "writer_cpu_s": time.thread_time() - cpu0,
        "server_cpu_s": (_postgres_ticks() - pg0) / TICK_S,
        "behind_s": behind,
        "values": float(batches * per_batch * args.ranks * len(ids)),
    }


def child(args: argparse.Namespace) -> None:
    """One measurement (in a child process, the tree's code first on its path): JSON on stdout."""
    from sqlalchemy import insert, select

    from stepwatch_server.runs.rollup_worker import RollupWorker
    from stepwatch_server.storage import make_engine, upgrade
    from stepwatch_server.storage.models import Run, Series

    engine = make_engine(args.url)
    upgrade(engine)
    now = dt.datetime.now(dt.UTC)
    runs = {}
    with engine.begin() as conn:
        for name in ("no-worker", "worker"):
            run_id = conn.execute(
                insert(Run)
                .values(name=name, world_size=args.ranks, created_at=now, last_seen_at=now)
                .returning(Run.id)
            ).scalar_one()
            conn.execute(
                insert(Series), [{"run_id": run_id, "stat": "", "name": f"m{i}"} for i in range(args.series)]
            )
            ids = list(
                conn.execute(select(Series.id).where(Series.run_id == run_id).order_by(Series.id)).scalars()
            )
            runs[name] = (run_id, ids)
    out: dict[str, Any] = {"imported_from": _servers.imported_from(None)}
    if engine.dialect.name == "postgresql":  # the writes alone: the server's CPU without the worker
        out["without"] = _write(engine, *runs["no-worker"], args, 0, None)
    worker = RollupWorker(engine).start()
    try:
        thread = worker._thread
        assert thread is not None and thread.native_id is not None
        stat = f"/proc/self/task/{thread.native_id}/stat"
        ticks0 = _ticks(stat)
        pg0 = _postgres_ticks()
        written = _write(engine, *runs["worker"], args, 0, worker)
        last_write = time.monotonic()
        idle = worker.wait_idle(CATCH_UP_S)
        out["lag_s"] = time.monotonic() - last_write if idle else None
        out["worker_thread_cpu_s"] = (_ticks(stat) - ticks0) / TICK_S
        out["server_cpu_s"] = (_postgres_ticks() - pg0) / TICK_S
        out["with"] = written
    finally:
        worker.stop()
    print(json.dumps(out))


def measure(
    backend: str, source: Path | None, args: argparse.Namespace, tmp: Path, tag: str
) -> dict[str, Any]:
    with _servers.database(backend, f"rollcost_{tag}", tmp) as url:
        cmd = [sys.executable, __file__, "--child", "--url", url, "--ranks", str(args.ranks), "--series",
               str(args.series), "--seconds", str(args.seconds), "--steps-per-s", str(args.steps_per_s),
               "--batch-s", str(args.batch_s)]  # fmt: skip
        done = subprocess.run(
            cmd, env=_servers.child_env(source), capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise SystemExit(f"child failed ({backend}, {tag}):\n{done.stderr[-3000:]}")
        got = json.loads(done.stdout.strip().splitlines()[-1])
    per_m = 1e6 / got["with"]["values"]
    if backend == "sqlite":
        cpu = got["worker_thread_cpu_s"]
    else:  # the server's CPU with the worker over what the same writes cost without it
        cpu = got["server_cpu_s"] - got["without"]["server_cpu_s"] + got["worker_thread_cpu_s"]
    return {
        "cpu_s_per_m": cpu * per_m,
        "lag_s": got["lag_s"],
        "behind_s": got["with"]["behind_s"],
        "raw": got,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--series", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=64.0)
    parser.add_argument("--steps-per-s", type=float, default=1.0)
    parser.add_argument("--batch-s", type=float, default=2.0, help="seconds of steps a rank's batch holds")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ref", help="also measure this commit's rollup worker, alternating")
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    trees: list[tuple[str, Path | None]] = [("this tree", None)]
    if args.ref:
        trees.append((f"ref {args.ref}", _refs.worktree(args.ref)))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            for r in range(args.rounds):
                for label, source in (
                    trees[r % len(trees) :] + trees[: r % len(trees)]
                ):  # the first one rotates
                    got = measure(
                        backend, source, args, Path(tmp), f"{backend}_{r}_{len(trees)}_{label.split()[0]}"
                    )
                    results.setdefault(backend, {}).setdefault(label, []).append(got)
                    lag = "not caught up" if got["lag_s"] is None else f"{got['lag_s']:.1f} s"
                    print(
                        f"{backend:10s} {label:14s} round {r + 1}: rollups {got['cpu_s_per_m']:.2f} CPU s per M values, "
                        f"lag after the last write {lag}, writes behind their pace by up to {got['behind_s']:.2f} s",
                        flush=True,
                    )
    print(
        "\n| database | tree | rollups' CPU s per million values (median) | lag after the last write (median) |"
    )
    print("|---|---|---:|---:|")
    for backend, by_tree in results.items():
        for label, rounds in by_tree.items():
            lags = [g["lag_s"] for g in rounds if g["lag_s"] is not None]
            lag = f"{statistics.median(lags):.1f} s" if len(lags) == len(rounds) else "not caught up"
            cpu = statistics.median(g["cpu_s_per_m"] for g in rounds)
            print(f"| {backend} | {label} | {cpu:.2f} | {lag} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
