"""How small does the block codec (storage/codec.py) keep the agent's values, by block size, next to the
bytes a value takes in today's one-row-per-value layout, and how fast does it encode and decode? (issue 17)

The values are a real agent's: by default the collector's own demo (`stepwatch-server demo`: 4 gloo ranks
training on CPU, the agent attached) is run into a fresh SQLite file; `--database-url` reads another
stepwatch database instead. Each (rank, incarnation) is cut into blocks of K consecutive steps holding
every series, as a chunk layout would store them; the figure is the encoded bytes over the values.

    .venv/bin/python bench/block_codec.py                       # the demo: 4 ranks x 800 steps (~40 s)
    .venv/bin/python bench/block_codec.py --database-url sqlite:///./stepwatch.db --sizes 64,256
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sqlalchemy import func, select

from stepwatch_server.storage import make_engine
from stepwatch_server.storage.codec import Block, decode, encode
from stepwatch_server.storage.disk import database_bytes
from stepwatch_server.storage.models import Point, Series

ROOT = Path(__file__).resolve().parents[1]


def _demo_database(directory: Path, steps: int) -> str:
    url = f"sqlite:///{directory / 'demo.db'}"
    command = [
        str(ROOT / ".venv/bin/stepwatch-server"), "demo", "--exit-when-done", "--steps", str(steps),
        "--port", "0", "--database-url", url,
    ]  # fmt: skip
    print(f"running the demo ({steps} steps x 4 ranks) into {url} ...", flush=True)
    subprocess.run(
        command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    return url


def _blocks(points: np.ndarray, values: np.ndarray, size: int) -> list[Block]:
    """points: [k, 4] (series, rank, step, incarnation) sorted by rank, incarnation, step; one Block per
    K consecutive steps of each (rank, incarnation), holding every series present there."""
    out = []
    keys = points[:, 1] * (1 << 20) + points[:, 3]
    for key in np.unique(keys):
        sel = keys == key
        p, v = points[sel], values[sel]
        steps = np.unique(p[:, 2])
        for lo in range(0, steps.size, size):
            st = steps[lo : lo + size]
            inside = (p[:, 2] >= st[0]) & (p[:, 2] <= st[-1])
            ids = np.unique(p[inside, 0])
            block_values = np.zeros((ids.size, st.size))
            present = np.zeros_like(block_values, dtype=bool)
            r, c = np.searchsorted(ids, p[inside, 0]), np.searchsorted(st, p[inside, 2])
            block_values[r, c], present[r, c] = v[inside], True
            out.append(Block(st, ids, block_values, present))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--database-url", default=None, help="read this stepwatch database instead of a demo's"
    )
    parser.add_argument("--steps", type=int, default=800, help="demo steps per rank (default %(default)s)")
    parser.add_argument("--sizes", default="2,8,64,256", help="block sizes in steps (default %(default)s)")
    parser.add_argument(
        "--per-series",
        type=int,
        default=None,
        metavar="K",
        help="also each series alone in blocks of K steps: its bytes a value (a block's 9-byte zstd header left out)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        url = args.database_url or _demo_database(Path(tmp), args.steps)
        engine = make_engine(url)
        with engine.connect() as conn:
            size_on_disk = database_bytes(conn)
            rows = conn.execute(
                select(Point.series_id, Point.rank, Point.step, Point.incarnation, Point.value).order_by(
                    Point.rank, Point.incarnation, Point.step
                )
            ).all()
            series = int(conn.execute(select(func.count()).select_from(Series)).scalar_one())
            names = {
                int(i): f"{stat}:{name}" if stat else name
                for i, stat, name in conn.execute(select(Series.id, Series.stat, Series.name))
            }
        engine.dispose()
    if not rows:
        print("no values in the database", file=sys.stderr)
        return 1
    points = np.array([r[:4] for r in rows], dtype=np.int64)
    values = np.array([np.nan if r[4] is None else r[4] for r in rows], dtype=np.float64)
    n = values.size
    print(f"{n:,} values of {series} series; the database takes {size_on_disk:,} bytes: "
          f"{size_on_disk / n:.1f} bytes a value in today's layout (indexes and rollups included)")  # fmt: skip
    print(f"{'block (steps)':>14} {'bytes/value':>12} {'encode values/s':>16} {'decode values/s':>16}")
    for size in sizes:
        blocks = _blocks(points, values, size)
        started = time.perf_counter()
        encoded = [encode(b) for b in blocks]
        enc_s = time.perf_counter() - started
        started = time.perf_counter()
        for data in encoded:
            decode(data)
        dec_s = time.perf_counter() - started
        total = sum(len(d) for d in encoded)
        print(f"{size:>14} {total / n:>12.2f} {n / enc_s:>16,.0f} {n / dec_s:>16,.0f}")
    if args.per_series:
        costs: dict[int, list[int]] = {}
        for block in _blocks(points, values, args.per_series):
            for k, sid in enumerate(block.series.tolist()):
                alone = Block(
                    block.steps, block.series[k : k + 1], block.values[k : k + 1], block.present[k : k + 1]
                )
                cost = costs.setdefault(sid, [0, 0])
                cost[0] += len(encode(alone)) - 9
                cost[1] += int(block.present[k].sum())
        print(f"each series alone, blocks of {args.per_series} steps: bytes a value")
        for sid, (size_b, count) in sorted(costs.items(), key=lambda kv: -kv[1][0] / kv[1][1]):
            print(f"  {names.get(sid, sid)!s:40} {size_b / count:6.2f}  ({count:,} values)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
