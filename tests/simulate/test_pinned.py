"""The named scenarios produce exactly the batches they produced before the benign behaviours and the
world were added (every new behaviour is off by default): digests of their batch streams, computed
at commit 59002c9 before any of that code existed.

One exception, a physics fix: a data straggler's factor used to stretch the whole measured data
interval, the evaluation that sits in it included, so in `straggler_10pct_data_16` rank 6's eval
after step 1000 took 44.6 s instead of 40.5 s (everyone's step 1001 4 s longer, later timestamps 4 s
later; nothing else differs, and the detectors find the same straggler at the same step)."""

from __future__ import annotations

import hashlib
import json
from itertools import islice

import pytest

from stepwatch_server.simulate import SCENARIOS, generate

# name -> (batches hashed: None = the whole stream, first 32 hex digits of the SHA-256)
PINNED: dict[str, tuple[int | None, str]] = {
    "clean_8": (None, "683a7a4f3d9a6e597178fc7d0d8804a5"),
    "nonfinite_act_8": (None, "e44967951f46d534d5d6f97d79be2e95"),
    "hang_slow_steps_16": (None, "98a9102b5b6f8597a4b2af64b5de5227"),
    "memory_leak_8": (None, "f0d867e5afe5f39ffa6486420d7d3c8d"),
    "loss_spike_8": (None, "a1d884d59723cb1a2f16e25f26af3e32"),
    "divergence_trend_16": (None, "59ad089f7c50841c787abbcf8ae006d1"),
    "straggler_10pct_data_16": (None, "1a38df7fc3a48bd9cf08c953763bd425"),  # 06b4702f... before the fix
    "hang_stuck_32": (None, "8579e7d4cac206967d955a5fd28c777e"),
    "hang_dead_256": (3000, "5e46ebc04999606f572e6e695c7a12c4"),
    "memory_leak_slow_128": (3000, "ee29bc577149e6bc216aef6506b50b6a"),
    "node_failure_64": (4000, "f0d25dcf72c16716f7ec5e9870f1297a"),
    "divergence_nan_64": (2000, "c19118bbbf75433ceb27137f9fb72095"),
    "clean_long_64": (3000, "8c6dafcf62e985a53f94cd9ec71b60ce"),
}


def digest(name: str, limit: int | None) -> str:
    h = hashlib.sha256()
    for b in islice(generate(SCENARIOS[name]), limit):
        h.update(json.dumps(b, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()[:32]


@pytest.mark.parametrize("name", sorted(PINNED))
def test_named_scenarios_send_the_same_batches_as_before(name: str) -> None:
    limit, expected = PINNED[name]
    assert digest(name, limit) == expected
