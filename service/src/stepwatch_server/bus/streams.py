"""The bus's layout in Redis: the streams a batch goes to, their consumer group, the leases and snapshots.

A batch goes to stream `stepwatch:batches:{p}` with `p = crc32(run) mod PARTITIONS`, so that every batch of
a run goes to one stream and one worker, in the order it was stored. `PARTITIONS` is fixed per deployment:
the first process to use a Redis records it (`stepwatch:partitions`) and every later one checks it, since
another count would send a run's batches to another stream than its state. A stream's entry holds the
validated batch as a pickle, which only our processes write and read: Redis must not be writable by anyone
else (README, "Running at scale").
"""

from __future__ import annotations

import pickle
import zlib
from typing import Any

import redis

from stepwatch_server.ingest.schema import Batch

PARTITIONS = 16  # streams (and the most detection workers that share the work)
GROUP = "detect"  # the consumer group of every stream
CONNECT_TIMEOUT_S = 2.0
SOCKET_TIMEOUT_S = 5.0
_PARTITIONS_KEY = "stepwatch:partitions"


def partition(run: str) -> int:
    return zlib.crc32(run.encode()) % PARTITIONS


def stream_key(p: int) -> str:
    return f"stepwatch:batches:{p}"


def lease_key(p: int) -> str:
    return f"stepwatch:lease:{p}"


def snapshot_key(p: int) -> str:
    return f"stepwatch:snapshot:{p}"


WORKERS_KEY = "stepwatch:workers"  # sorted set: worker id -> last time it said it was alive


def worker_stats_key(worker_id: str) -> str:
    """A worker's counters (JSON), refreshed every second with its leases, gone when it is."""
    return f"stepwatch:worker:{worker_id}"


def connect(url: str) -> redis.Redis:
    """A client for `url` (redis://host:port/db); raises ValueError naming the fix for a bad URL."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"bus: expected a redis:// URL (e.g. redis://127.0.0.1:6379/0), got {url!r}")
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        health_check_interval=10,
    )


def check_partitions(client: redis.Redis) -> int:
    """Record PARTITIONS in Redis, or check it against the one recorded (raises RuntimeError); the count."""
    client.set(_PARTITIONS_KEY, PARTITIONS, nx=True)
    recorded = int(client.get(_PARTITIONS_KEY) or PARTITIONS)
    if recorded != PARTITIONS:
        raise RuntimeError(
            f"bus: this Redis was set up with {recorded} partitions and this process uses {PARTITIONS}; "
            "every process of a deployment must use the same count (or start on an empty Redis)"
        )
    return recorded


def encode(batch: Batch, ack_ts: float, run_id: int | None = None, new_run: bool = False) -> dict[str, bytes]:
    fields = {"b": pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL), "t": repr(ack_ts).encode()}
    if run_id is not None:
        fields["r"] = str(run_id).encode()
    if new_run:
        fields["n"] = b"1"
    return fields


def decode(fields: dict[Any, Any]) -> tuple[Batch, float, int | None, bool]:
    """(the batch, the wall time its ingest answered, the run's id in the database, whether the batch
    created the run) of a stream entry (an entry written before the last two were added has neither)."""
    batch = pickle.loads(fields[b"b"])  # written by our ingest processes only (module docstring)
    run_id = fields.get(b"r")
    return batch, float(fields[b"t"]), None if run_id is None else int(run_id), b"n" in fields
