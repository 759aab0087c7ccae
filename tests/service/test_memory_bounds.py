"""A collector that receives run after run for weeks keeps its memory bounded (issue 14, item 12): what
it holds per run is kept for the runs active most recently only, and a short run's detection state is
sized by what the run sent, not by the longest run it could have been."""

from __future__ import annotations

import gc
import gzip
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson

from stepwatch_server.detect.engine import MAX_RUNS, RunDetection
from stepwatch_server.ingest.store import MAX_CACHED_RUNS
from tests.service.conftest import Collector, fresh_database

RUNS = 2_000
SHORT_RUN_STATE_BYTES = 128 * 1024  # numpy state of a 2-rank, 2-step run: 65 KB here, 1.4 MB at 0bc1ef0
DETECTION_WAIT_S = 60.0


def _short_run(name: str, rank: int, seq: int) -> bytes:
    steps = [2 * seq + 1, 2 * seq + 2]
    doc = {
        "schema": 1, "run": name, "session": f"{name}-r{rank}", "seq": seq, "rank": rank, "world_size": 2,
        "steps": steps, "timestamps": [1.7e9 + s for s in steps],
        "metrics": {f"m{i}": [float(i), float(i) + 0.5] for i in range(30)}
        | {"loss": [2.0, 1.9], "time.step_ms": [100.0, 101.0]},
        "tensors": {"steps": [steps[-1]], "stats": {"amax": {f"layers.{k}": [1.0] for k in range(8)}}},
    }  # fmt: skip
    return gzip.compress(orjson.dumps(doc), compresslevel=1)


# Not a run's own: code, classes and modules (a function's globals reach the whole program), scalars.
_SHARED = (str, bytes, int, float, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)


def _arrays(root: object) -> Iterator[np.ndarray]:
    """Every numpy array reachable from `root` through containers and objects' attributes."""
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _SHARED):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            yield obj
            continue
        todo.extend(gc.get_referents(obj))


def _state_bytes(rd: RunDetection) -> int:
    own = [a for a in _arrays(rd) if a.base is None]  # views count once, with what they view
    return sum(a.nbytes for a in own)


def test_two_thousand_short_runs_keep_the_collectors_per_run_memory_bounded(tmp_path: Path) -> None:
    with fresh_database("sqlite", tmp_path) as url:
        collector = Collector(url)
        try:
            headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
            for i in range(RUNS):
                name = f"short-{i:04d}-{uuid.uuid4().hex[:4]}"
                for seq in range(5):
                    for rank in range(2):
                        if i >= 10 and seq > 0:
                            break  # the first runs are 10 steps long; the rest send a batch a rank
                        answer = collector.post(_short_run(name, rank, seq), headers=headers)
                        assert answer.status_code == 200, answer.text
            state = collector.server.app.state
            detection = state.detection
            deadline = time.monotonic() + DETECTION_WAIT_S
            while detection.processed < detection.submitted and time.monotonic() < deadline:
                time.sleep(0.1)
            assert detection.processed == detection.submitted
            runs = detection.engine.runs
            assert len(runs) == MAX_RUNS < RUNS  # the least recently active were let go
            assert len(state.writer.series_ids) == MAX_CACHED_RUNS
            # The state of the 10-step runs that are still kept is what they sent, not a 512-step ring
            # for 8 ranks per metric and 1,024 losses per window kept for a rewind.
            sizes = [_state_bytes(rd) for rd in list(runs.values())[-10:]]
            assert max(sizes) <= SHORT_RUN_STATE_BYTES, sizes
        finally:
            collector.close()
