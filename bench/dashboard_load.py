"""How long the dashboard's run page takes to open on a big run: the API calls it makes, timed.

A run of `--steps` steps x `--ranks` ranks (issue 17's target: 100,000 x 512, to open in at most 1 s;
the first dashboard issue asked for under 2 s)
is written straight into a fresh database with the collector's own bulk insert (`insert_points`),
each chunk handed to the collector's own rollup worker (`RollupWorker`) as ingest hands it over:
every rank's loss, grad norm and sum of squares, lr, step/forward/data/backward/optimizer time and allocated
memory (`--memory-noise`) on every step (`METRICS`), the
amax of `--modules` modules every 10th step, and every step's end time (each rank's clock advanced by its step time), as the agent would send
them (`_as_sent`: float32-exact losses, norms and amax, whole bytes of memory, times to the
microsecond) (a straggler and a loss spike included, so the pictures have something to show). The page is
timed only once the worker has rolled everything up (`rollup_wait_s`: how long that took after
the last chunk was written) and the database's size over its values printed (bytes a value, indexes and
rollups included: issue 17). A real
`stepwatch-server serve` in a child process (it applies the migrations first) then answers the run
page's calls over loopback HTTP, in the page's two waves: first the run and the overview, then the
four curves (loss, lr and step time as the mean over ranks, the model's gradient norm as rank=global),
the anomalies, the two heatmaps ("who holds the run up", time.late_ms, the page's default view, and the
memory), the amax and the phase events, all at once, as the browser does (web/src/run.js; `page_calls`).
`--repeats` opens are timed; the figure is the median wall time of one open, and the median time of each
call is listed beside it, as the page opens and alone (each call on its own, one after
another, as often: the calls alone add up to the collector's work for one open).

    .venv/bin/python bench/dashboard_load.py                              # 100k x 512 on SQLite (long)
    .venv/bin/python bench/dashboard_load.py --steps 10000 --ranks 64 --backends sqlite,postgresql
    .venv/bin/python bench/dashboard_load.py --steps 20000 --ranks 256 --backends sqlite,postgresql --compact
    .venv/bin/python bench/dashboard_load.py --steps 10000 --ranks 512 --backends postgresql \
        --postgresql-database bench_10k_512            # kept: a second call measures the page again

`--sqlite-file` and `--postgresql-database` keep the run's database for later calls, which reuse it (the
write is the long part); without them each call writes a fresh one and drops it.

`--compact` then moves the run into compressed blocks (runs/compaction.py, timed), gives the deleted
rows' space back (VACUUM) and measures the disk use and the page again: the two layouts side by side.
That keeps the newest steps as rows, as while the run is heard from; then the rest is compacted too, as
a day after the run's last batch, and both are measured a third time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime as dt
import json
import re
import sqlite3
import statistics
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
for _src in (REPO / "agent" / "src", REPO / "service" / "src"):
    if _src.is_dir() and str(_src) not in sys.path:
        sys.path.append(str(_src))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _servers  # noqa: E402

RUN = "bench-dashboard"
TARGET_S = 1.0  # issue 17: the run page at 100k steps x 512 ranks in <= 1 s
REQUEST_TIMEOUT_S = 600.0
PROGRESS_EVERY_S = 30.0
AMAX_EVERY = 10
WRITE_STEPS = 2000  # steps per written chunk (one transaction per rank and chunk) ...
PACED_CHUNK_S = 2.0  # ... or, with --steps-per-s, the steps of this long (the agent's default flush interval)
# What the agent sends that the run page reads: its curves, the two gradient norms (`grad_norm` per shard,
# `grad_sumsq` for the model's norm, rank=global), the four phase times of the "who holds the run up" view
# (time.late_ms, derived from TIMELINE) and the memory heatmap's allocated memory; plus the forward time.
METRICS = (
    "loss",
    "grad_norm",
    "grad_sumsq",
    "lr",
    "time.step_ms",
    "time.forward_ms",
    "time.data_ms",
    "time.backward_ms",
    "time.optimizer_ms",
    "mem.allocated_mb",
)
MAX_POINTS = 1600  # as web/src/run.js asks
AMAX_TOP = 8  # the modules the amax panel draws (web/src/amax.js)
# The allocated memory as a real run's is (the Megatron log in ../shared/real-logs: flat within 4.1 MB
# over 47,680 steps, in multiples of 512 bytes, ~0.75 MB between two readings), not 2% noise (~600 MB).
ALLOCATOR_BYTES = 512
MEMORY_JITTER_MB = 0.75
BUCKETS = 240


def page_calls(run: str) -> tuple[list[str], list[str]]:
    """The run page's requests (web/src/run.js), in its two waves."""
    base = f"/api/v1/runs/{urllib.parse.quote(run)}"
    first = [base, "/api/v1/dashboard/runs"]
    curves = [("loss", "mean"), ("grad_norm", "global"), ("lr", "mean"), ("time.step_ms", "mean")]
    second = [f"{base}/series?metric={m}&rank={r}&max_points={MAX_POINTS}" for m, r in curves]
    second += [
        f"{base}/anomalies",
        f"{base}/heatmap?metric=time.late_ms&mode=median&buckets={BUCKETS}",  # the page's default view
        f"{base}/heatmap?metric=mem.allocated_mb&mode=absolute&buckets={BUCKETS}",
        f"{base}/amax?max_points={MAX_POINTS}&top={AMAX_TOP}",
        f"{base}/events?kind=phase_start&limit=10000",
    ]
    return first, second


def _as_sent(metric: str, v: np.ndarray) -> np.ndarray:
    """Values as the agent sends them: a float32 tensor's `.item()` (loss, gradient norm, amax), allocated
    bytes / 2**20 (memory), milliseconds rounded to the microsecond (times: agent/_batch.py), or a
    float64 as it comes (the learning rate)."""
    if metric in ("loss", "grad_norm", "grad_sumsq", "amax"):
        return v.astype(np.float32).astype(np.float64)
    if metric.startswith("mem."):
        return np.round(v * 2**20) / 2**20
    if metric.startswith("time."):
        return np.round(v, 3)
    return v


def write_run(
    database_url: str,
    steps: int,
    ranks: int,
    modules: int,
    steps_per_s: float | None = None,
    memory_noise: str = "real",
) -> dict[str, Any]:
    """The run's rows, written with the collector's bulk insert; returns counts and the time taken.
    `steps_per_s`: written at that pace, 2 s of steps at a time, as a live run's ranks send them (None:
    as fast as the database takes them)."""
    from sqlalchemy import insert, select

    from stepwatch_server.ingest.store import insert_points
    from stepwatch_server.runs.rollup_worker import RollupWorker
    from stepwatch_server.storage import make_engine, write_transaction
    from stepwatch_server.storage.models import Rank, RollupMark, Run, Series, StepRecord

    engine = make_engine(database_url)
    worker = RollupWorker(engine).start()
    now = dt.datetime.now(dt.UTC)
    started = time.perf_counter()
    points = 0
    with engine.begin() as conn:
        run_id = conn.execute(
            insert(Run).values(name=RUN, world_size=ranks, created_at=now, last_seen_at=now).returning(Run.id)
        ).scalar_one()
        conn.execute(
            insert(Rank),
            [
                dict(run_id=run_id, rank=r, node=f"gpu-{r // 8:03d}", local_rank=r % 8, world_size=ranks,
                     replica_group=r, shard=0, num_shards=1, incarnation=1, last_step=steps, stored_to=steps,
                     last_seen_at=now)
                for r in range(ranks)
            ],
        )  # fmt: skip
        names = [("", m) for m in METRICS] + [("amax", f"layers.{i}.mlp.fc1") for i in range(modules)]
        ids = {
            name: conn.execute(
                insert(Series).values(run_id=run_id, stat=stat, name=name).returning(Series.id)
            ).scalar_one()
            for stat, name in names
        }
    rng = np.random.default_rng(0)
    # Each rank's clock: a step ends its step time after the one before (so the stored end times are as
    # irregular as a real run's, not a straight line the codec would find too easy).
    clock = np.full(ranks, 1_764_427_200.0)
    chunk = WRITE_STEPS if steps_per_s is None else max(1, round(steps_per_s * PACED_CHUNK_S))
    shown = time.perf_counter()
    for lo in range(1, steps + 1, chunk):
        s = np.arange(lo, min(steps, lo + chunk - 1) + 1, dtype=np.int64)
        n = s.shape[0]
        norm = 1.0 + 4.0 / np.sqrt(s)
        base = {
            "loss": 2.0 + 8.0 / np.sqrt(s) + np.where((s >= steps // 2) & (s < steps // 2 + 30), 3.0, 0.0),
            "grad_norm": norm,
            "grad_sumsq": norm**2,
            "lr": np.full(n, 3e-4),
            "time.step_ms": np.full(n, 400.0),
            "time.forward_ms": np.full(n, 120.0),
            "time.data_ms": np.full(n, 15.0),
            "time.backward_ms": np.full(n, 240.0),
            "time.optimizer_ms": np.full(n, 25.0),
            "mem.allocated_mb": 30_000.0 + 0.01 * s,
        }
        amax_steps = s[s % AMAX_EVERY == 0]
        for r in range(ranks):  # one transaction per rank, queued on the write lock as ingest's are
            rows: list[tuple[int, int, int, int, float]] = []
            for metric, values in base.items():
                noise = rng.standard_normal(n) if metric != "lr" else None
                if noise is None:
                    v = values
                elif metric == "mem.allocated_mb" and memory_noise == "real":
                    granules = np.round((values + MEMORY_JITTER_MB * noise) * 2**20 / ALLOCATOR_BYTES)
                    v = granules * ALLOCATOR_BYTES / 2**20
                else:
                    v = values * (1.0 + 0.02 * noise)
                if metric == "time.forward_ms" and r == ranks // 3:
                    v = v * np.where(s >= steps // 4, 1.3, 1.0)  # the straggler
                v = _as_sent(metric, v)
                if metric == "time.step_ms":
                    ends = clock[r] + np.cumsum(v) / 1000.0
                    clock[r] = ends[-1]
                rows.extend(zip([ids[metric]] * n, [r] * n, s.tolist(), [1] * n, v.tolist(), strict=True))
            for i in range(modules):
                v = _as_sent("amax", (10.0 + i) * (1.0 + 0.05 * rng.standard_normal(amax_steps.shape[0])))
                k = amax_steps.shape[0]
                sid = ids[f"layers.{i}.mlp.fc1"]
                rows.extend(zip([sid] * k, [r] * k, amax_steps.tolist(), [1] * k, v.tolist(), strict=True))
            with write_transaction(engine) as conn:  # the rows were built outside: the lock is held to write
                insert_points(conn, rows)
                points += len(rows)
                conn.execute(
                    insert(StepRecord),
                    [
                        {"run_id": run_id, "rank": r, "step": int(x), "incarnation": 1, "ts": t}
                        for x, t in zip(s.tolist(), np.round(ends, 6).tolist(), strict=True)
                    ],
                )
        worker.submit(run_id, lo, int(s[-1]))
        if steps_per_s is not None and s[-1] < steps:  # the next chunk is sent when its steps have run
            time.sleep(max(0.0, started + int(s[-1]) / steps_per_s - time.perf_counter()))
        if steps_per_s is None or time.perf_counter() - shown > PROGRESS_EVERY_S or s[-1] == steps:
            shown = time.perf_counter()
            with engine.connect() as conn:
                mark = conn.execute(select(RollupMark.rolled_to).where(RollupMark.run_id == run_id)).scalar()
            print(
                f"  written steps {lo}-{int(s[-1])} ({points:,} values, {shown - started:.0f} s;"
                f" rolled up to step {mark if mark is not None else '-'})",
                flush=True,
            )
    write_s = time.perf_counter() - started
    # The worker rolls up while the writes go on, and catches up after them: wait for it, showing its
    # watermark, for as long as it keeps moving (a stalled worker fails the benchmark).
    mark_sql = select(RollupMark.rolled_to).where(RollupMark.run_id == run_id)
    last_mark, last_move = -1, time.perf_counter()
    while not worker.wait_idle(PROGRESS_EVERY_S):
        with engine.connect() as conn:
            mark = conn.execute(mark_sql).scalar() or -1
        now = time.perf_counter()
        if mark > last_mark:
            last_mark, last_move = mark, now
        elif now - last_move > REQUEST_TIMEOUT_S:
            raise RuntimeError(f"the rollup worker stalled at step {mark} for {REQUEST_TIMEOUT_S:.0f} s")
        print(
            f"  rollups at step {mark:,} of {steps:,} ({now - started - write_s:.0f} s after the last write)",
            flush=True,
        )
    rollup_wait_s = time.perf_counter() - started - write_s
    worker.stop()
    engine.dispose()
    print(f"  rolled up {rollup_wait_s:.1f} s after the last write", flush=True)
    return {
        "points": points,
        "write_s": write_s,
        "rollup_wait_s": rollup_wait_s,
        # The worker's pace over the whole run: it starts with the first chunk and ends with the last.
        "rollup_values_per_s": points / (write_s + rollup_wait_s),
    }


def _get(url: str) -> tuple[float, int]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_S) as response:
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}")
    return time.perf_counter() - started, len(body)


def open_page(base: str, pool: concurrent.futures.ThreadPoolExecutor) -> tuple[float, dict[str, float], int]:
    """One open of the run page: (wall seconds, seconds per call, bytes)."""
    first, second = page_calls(RUN)
    started = time.perf_counter()
    per_call: dict[str, float] = {}
    size = 0
    for wave in (first, second):
        for path, (seconds, n) in zip(wave, pool.map(lambda p: _get(base + p), wave), strict=True):
            per_call[path] = seconds
            size += n
    return time.perf_counter() - started, per_call, size


def written_before(database_url: str) -> dict[str, Any] | None:
    """The size of the run a kept database (--sqlite-file) already holds, or None. Its steps are those
    rolled up (the watermark), so a write that was interrupted does not pass for a whole run."""
    from sqlalchemy import select

    from stepwatch_server.storage import make_engine
    from stepwatch_server.storage.models import RollupMark, Run

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                select(Run.world_size, RollupMark.rolled_to)
                .outerjoin(RollupMark, RollupMark.run_id == Run.id)
                .where(Run.name == RUN)
            ).first()
    finally:
        engine.dispose()
    return None if row is None else {"ranks": row[0], "steps": row[1] or 0, "reused": True}


def migrate(database_url: str) -> float:
    """Apply the migrations to a kept database, printing how long they took (0005 sums the rollup
    levels of a run written before it)."""
    from stepwatch_server.storage import make_engine, upgrade

    engine = make_engine(database_url)
    started = time.perf_counter()
    try:
        upgrade(engine)
    finally:
        engine.dispose()
    seconds = time.perf_counter() - started
    print(f"  migrations applied in {seconds:.1f} s", flush=True)
    return seconds


def kept_database(backend: str, args: argparse.Namespace) -> str | None:
    """The URL of the database `--sqlite-file` or `--postgresql-database` keeps for `backend` (a PostgreSQL
    one created if absent), or None: a fresh one, dropped after."""
    if backend == "sqlite" and args.sqlite_file is not None:
        return f"sqlite:///{args.sqlite_file.resolve()}"
    if backend == "postgresql" and args.postgresql_database is not None:
        name = args.postgresql_database
        if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", name):
            raise SystemExit(
                f"--postgresql-database: {name!r} is not a plain name (a-z, 0-9, _); pass e.g. bench_10k"
            )
        return _servers.postgresql_database(name, keep_existing=True)
    return None


def bench(backend: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    kept_url = kept_database(backend, args)
    kept = kept_url is not None
    place = contextlib.nullcontext(kept_url) if kept else _servers.database(backend, "dashboard", tmp)
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(place)
        migrated_s = migrate(url) if kept else None  # a kept file written by an older schema: timed here
        # It applies the migrations (none left); compaction is this benchmark's to run (`--compact`).
        server = stack.enter_context(
            _servers.collector(url, options=["--compact-after-steps", "0"], log_path=args.server_log)
        )
        before = written_before(url) if kept else None
        if before is not None:
            if (before["steps"], before["ranks"]) != (args.steps, args.ranks):
                raise SystemExit(
                    f"{url} holds {before['steps']:,} rolled-up steps x {before['ranks']} ranks, "
                    f"not {args.steps:,} x {args.ranks}: pass those sizes, or delete it (an interrupted write)"
                )
            print(f"{backend}: reusing {url} ({args.steps:,} steps x {args.ranks} ranks)", flush=True)
            written: dict[str, Any] = {**before, "migrate_s": migrated_s}
        else:
            print(f"{backend}: writing {args.steps:,} steps x {args.ranks} ranks", flush=True)
            written = write_run(
                url, args.steps, args.ranks, args.modules, args.steps_per_s, args.memory_noise
            )
        written.update(disk_use(url, vacuum=args.compact))  # --compact: both layouts measured vacuumed
        result = measure(backend, args, server, written)
        if args.compact:
            compacted = compact(url)
            compacted.update(disk_use(url, vacuum=True))
            result["compacted"] = measure(backend, args, server, {**written, **compacted, "reused": True})
            silent = compact(url, silent=True)
            silent.update(disk_use(url, vacuum=True))
            result["compacted_silent"] = measure(backend, args, server, {**written, **silent, "reused": True})
        return result


def compact(url: str, silent: bool = False) -> dict[str, Any]:
    """Every step of the run moved into blocks (runs/compaction.py, with the smallest setting: all but the
    newest MIN_COMPACT_AFTER_STEPS steps), timed. `silent`: the rest too, as a day after the run's last
    batch (the worker told that a run is silent at once, instead of waiting the day)."""
    from stepwatch_server.runs.compaction import IDLE_S, CompactionWorker
    from stepwatch_server.settings import MIN_COMPACT_AFTER_STEPS
    from stepwatch_server.storage import make_engine

    engine = make_engine(url)
    try:
        worker = CompactionWorker(
            engine, after_steps=MIN_COMPACT_AFTER_STEPS, idle_s=0.0 if silent else IDLE_S
        )
        started = time.perf_counter()
        moved = worker.compact_once()
        seconds = time.perf_counter() - started
    finally:
        engine.dispose()
    print(
        f"  compacted {moved:,} values into {worker.stats()['blocks_written']:,} blocks in {seconds:.1f} s "
        f"({moved / max(seconds, 1e-9):,.0f} values/s)",
        flush=True,
    )
    return {
        "compact_s": seconds,
        "compacted_values": moved,
        "compact_values_per_s": moved / max(seconds, 1e-9),
    }


_TABLES = (  # this run's, in its schema
    "points, blocks, rank_rollup_packs, step_rollups, step_rollup_packs, steps, series, runs, ranks"
)


_PG_TABLES_SQL = (  # PostgreSQL: the schema's tables with their indexes and TOAST, without the empty catalog
    "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
    "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = current_schema() AND c.relkind = 'r'"
)


_SQLITE_PER_TABLE = (  # each table with its indexes (SQLite's autoindexes and ours are named after it)
    "SELECT coalesce(m.tbl_name, d.name), sum(d.pgsize) FROM dbstat d "
    "LEFT JOIN sqlite_schema m ON m.name = d.name GROUP BY 1"
)
_PG_PER_TABLE = (
    "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c "
    "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = current_schema() AND c.relkind = 'r'"
)


def disk_use(url: str, vacuum: bool = False) -> dict[str, Any]:
    """The database's size on disk over the values it holds, as rows and in blocks (issue 17: indexes and
    rollups included); with `vacuum`, after giving deleted rows' space back (SQLite VACUUM, PostgreSQL
    VACUUM FULL: a live database reuses that space for its next writes instead)."""
    from sqlalchemy import func, select, text

    from stepwatch_server.storage import make_engine
    from stepwatch_server.storage.disk import database_bytes
    from stepwatch_server.storage.models import Point, ValueBlock

    engine = make_engine(url)
    try:
        if vacuum and engine.dialect.name == "sqlite":
            with contextlib.closing(sqlite3.connect(str(engine.url.database), isolation_level=None)) as raw:
                raw.execute("VACUUM")
                raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # else the WAL keeps the rewritten pages' size
        elif vacuum:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text(f"VACUUM FULL {_TABLES}"))
        with engine.connect() as conn:
            size = database_bytes(conn)
            tables = (
                int(conn.execute(text(_PG_TABLES_SQL)).scalar_one())
                if engine.dialect.name == "postgresql"
                else size
            )
            rows = int(conn.execute(select(func.count()).select_from(Point)).scalar_one())
            held = int(conn.execute(select(func.coalesce(func.sum(ValueBlock.n_values), 0))).scalar_one())
            per_table = dict(
                conn.execute(
                    text(_SQLITE_PER_TABLE if engine.dialect.name == "sqlite" else _PG_PER_TABLE)
                ).all()
            )
    finally:
        engine.dispose()
    values = rows + held
    print(
        f"  the database takes {size:,} bytes for {values:,} values ({rows:,} rows, {held:,} in blocks): "
        f"{size / max(1, values):.2f} bytes a value; its tables and indexes {tables / max(1, values):.2f}",
        flush=True,
    )
    biggest = sorted(per_table.items(), key=lambda kv: -kv[1])[:6]
    print(
        "  by table (bytes a value): " + ", ".join(f"{t} {b / max(1, values):.2f}" for t, b in biggest),
        flush=True,
    )
    return {
        "per_table_bytes": per_table,
        "table_bytes_per_value": tables / max(1, values),
        "database_bytes": size,
        "values_stored": values,
        "values_in_blocks": held,
        "bytes_per_value": size / max(1, values),
    }


def measure(backend: str, args: argparse.Namespace, server: Any, written: dict[str, Any]) -> dict[str, Any]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        opens = [open_page(server.url, pool) for _ in range(args.repeats)]
    walls = [o[0] for o in opens]
    calls = {path: statistics.median(o[1][path] for o in opens) for path in opens[0][1]}
    # Each call again on its own, one after another: what it costs the collector without the page's other
    # calls beside it (they share one process, and its GIL, as the page opens).
    alone = {
        path: statistics.median(_get(server.url + path)[0] for _ in range(args.repeats)) for path in calls
    }
    result = {
        "backend": backend,
        "steps": args.steps,
        "ranks": args.ranks,
        "modules": args.modules,
        **written,
        "open_s_median": statistics.median(walls),
        "open_s_all": walls,
        "bytes": opens[-1][2],
        "calls_s_median": calls,
        "calls_alone_s_median": alone,
    }
    print(
        f"{backend}: run page open median {result['open_s_median']:.3f} s over {args.repeats} "
        f"(target <= {TARGET_S:.0f} s: {'met' if result['open_s_median'] <= TARGET_S else 'MISSED'}), "
        f"{result['bytes'] / 1e6:.2f} MB"
        + (
            ""
            if written.get("reused")
            else f"; written in {written['write_s']:.0f} s, rolled up {written['rollup_wait_s']:.0f} s "
            f"later ({written['rollup_values_per_s']:,.0f} values/s)"
        ),
        flush=True,
    )
    print(
        f"    as the page opens / alone (the calls alone add up to {sum(alone.values()):.3f} s):", flush=True
    )
    for path, seconds in sorted(calls.items(), key=lambda kv: -kv[1]):
        print(f"    {seconds:8.3f} / {alone[path]:.3f} s  {path}", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=512)
    parser.add_argument("--modules", type=int, default=6, help="amax series (every 10th step)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="sqlite", help="comma-separated: sqlite,postgresql")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--server-log", type=Path, default=None, help="the collector's log goes here")
    parser.add_argument(
        "--compact",
        action="store_true",
        help="then compact the run (runs/compaction.py) and measure the disk use and the page again, side by side",
    )
    parser.add_argument(
        "--steps-per-s",
        type=float,
        default=None,
        help="write the run at this pace (2 s of steps at a time, as ranks send them), to measure the rollup lag"
        " of a live run; default: as fast as the database takes the rows",
    )
    parser.add_argument(
        "--memory-noise",
        choices=("real", "2pct"),
        default="real",
        help="the allocated memory: 'real' (a real run's: flat within a few MB, in 512-byte granules) or '2pct' "
        "(2%% noise on each step, as every other metric; what this benchmark wrote before 2026-12-06)",
    )
    parser.add_argument(
        "--sqlite-file",
        type=Path,
        default=None,
        help="SQLite: write the run into this file and keep it; a file that holds it already is reused",
    )
    parser.add_argument(
        "--postgresql-database",
        default=None,
        help="PostgreSQL: write the run into this database (created if absent) and keep it; one that holds it "
        "already is reused (DROP DATABASE it when done)",
    )
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="stepwatch-dashboard-bench-") as tmp:
        for backend in args.backends.split(","):
            results.append(bench(backend.strip(), args, Path(tmp)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
