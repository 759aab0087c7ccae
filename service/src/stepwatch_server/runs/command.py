"""`stepwatch-server runs list` and `runs delete RUN`: the runs of a database and their disk use, and
deleting one (runs/deletion.py), straight on the database (no collector needs to run)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from stepwatch_server.runs import deletion, queries
from stepwatch_server.settings import DEFAULT_DATABASE_URL
from stepwatch_server.storage import make_engine, upgrade


def add_runs_command(sub: Any) -> None:
    runs = sub.add_parser("runs", help="list the runs of a database with their disk use, or delete one")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    listed = runs_sub.add_parser(
        "list", help="each run: ranks, last step, last seen, values stored, disk use"
    )
    delete = runs_sub.add_parser("delete", help="remove a run and every row of it")
    delete.add_argument("run", help="the run's name")
    delete.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    delete.add_argument(
        "--force", action="store_true", help="delete it even if it is live (a batch within the last 30 s)"
    )
    for parser in (listed, delete):
        parser.add_argument(
            "--database-url",
            default=None,
            help="SQLAlchemy URL; default $STEPWATCH_DATABASE_URL or sqlite:///./stepwatch.db",
        )


def _size(n: int) -> str:
    """Bytes in decimal units, as the runs page shows them (web/src/format.js fmtBytes)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000:
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def run_runs_command(args: argparse.Namespace) -> int:
    url = args.database_url or os.environ.get("STEPWATCH_DATABASE_URL") or DEFAULT_DATABASE_URL
    try:
        engine = make_engine(url)
    except ValueError as exc:
        print(f"stepwatch-server: {exc}", file=sys.stderr)
        return 2
    try:
        upgrade(engine)  # a database of an older collector: its schema first (as `serve` does)
        if args.runs_command == "list":
            return _list(engine)
        return _delete(engine, args)
    finally:
        engine.dispose()


def _list(engine: Any) -> int:
    with engine.connect() as conn:
        runs = queries.run_summaries(conn)
    if not runs:
        print("no runs")
        return 0
    width = max(len(r["name"]) for r in runs)
    print(
        f"{'run':<{width}}  {'ranks':>6}  {'last step':>10}  {'last seen (UTC)':<19}  {'values':>14}  {'disk (approx.)':>14}"
    )
    for r in runs:
        seen = r["last_seen_at"].strftime("%Y-%m-%d %H:%M:%S") if r["last_seen_at"] else "-"
        last = "-" if r["last_step"] is None else f"{r['last_step']:,}"
        print(
            f"{r['name']:<{width}}  {r['ranks']:>6}  {last:>10}  {seen:<19}  {r['stored_values']:>14,}  "
            f"{_size(r['stored_bytes']):>14}"
        )
    return 0


def _delete(engine: Any, args: argparse.Namespace) -> int:
    with engine.connect() as conn:
        found = deletion.find(conn, args.run)
        summary = queries.run_summaries(conn, found.id)[0] if found is not None else None
        ago = None if found is None else deletion.live_for(conn, found)
    if found is None or summary is None:
        print(
            f"stepwatch-server runs delete: run {args.run!r} not found (`runs list` lists them)",
            file=sys.stderr,
        )
        return 1
    if ago is not None and not args.force:
        print(
            f"stepwatch-server runs delete: run {found.name!r} is live (its last batch {ago:.0f} s ago): stop "
            "its training first, or add --force (its next batch would create it again)",
            file=sys.stderr,
        )
        return 2
    what = f"run {found.name!r}: {summary['ranks']} ranks, {summary['stored_values']:,} values stored"
    if not args.yes:
        if not sys.stdin.isatty():
            print(
                f"stepwatch-server runs delete: {what}; add --yes to delete it (no terminal to ask)",
                file=sys.stderr,
            )
            return 2
        if input(f"delete {what}? [y/N] ").strip().lower() not in {"y", "yes"}:
            print("nothing deleted")
            return 1
    started = said = time.monotonic()

    def progress(table: str, rows: int, done: bool) -> None:  # a line a table, and one a second meanwhile
        nonlocal said
        if done or time.monotonic() - said >= 1.0:
            print(f"  {table}: {rows:,} rows deleted ({time.monotonic() - started:.1f} s)", flush=True)
            said = time.monotonic()

    deleted = deletion.delete_run(engine, found, progress=progress)
    parts = ", ".join(f"{n:,} {table}" for table, n in deleted.items() if n)
    print(f"deleted run {found.name!r} in {time.monotonic() - started:.1f} s: {parts}")
    return 0
