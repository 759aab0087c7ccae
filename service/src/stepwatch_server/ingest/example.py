"""The complete example batch of docs/ingest.md (a test keeps the two identical).

Shown in the OpenAPI description of `POST /api/v1/ingest`.
"""

from __future__ import annotations

from typing import Any

EXAMPLE_BATCH: dict[str, Any] = {
    "schema": 1,
    "run": "llama-8b-sft",
    "session": "7f3c2a9e5b0d4c61a2e8f1d3b6c9a0e4",
    "seq": 0,
    "rank": 3,
    "local_rank": 3,
    "world_size": 8,
    "node": "gpu-12",
    "replica_group": 3,
    "shard": 0,
    "num_shards": 1,
    "agent": {"version": "0.1.0", "counters": {"dropped_buffer_full": 0, "spooled_batches": 0}},
    "steps": [1, 2, 3],
    "timestamps": [1764427200.1, 1764427200.21, 1764427200.33],
    "metrics": {
        "loss": [2.31, 2.29, "NaN"],
        "grad_norm": [1.9, 1.7, "Infinity"],
        "time.step_ms": [110.2, 108.9, 112.4],
        "nonfinite.loss": [0, 0, 1],
        "lr": [0.0003, 0.0003, None],
    },
    "tensors": {
        "steps": [1, 3],
        "stats": {
            "amax": {"layers.0.mlp.fc1": [12.5, "NaN"], "layers.0.mlp.fc2": [3.1, 3.4]},
            "grad_norm": {"layers.0.mlp.fc1.weight": [0.42, "Infinity"]},
        },
    },
    "fingerprints": {"steps": [3], "values": ["9c1f00d2aa13e4b7"]},
    "events": [
        {
            "step": 3,
            "ts": 1764427200.33,
            "kind": "nonfinite",
            "data": {"module": "layers.0.mlp.fc1", "where": ["activations", "loss", "grads"]},
        },
        {"step": 3, "ts": 1764427200.4, "kind": "phase_start", "data": {"phase": "eval"}},
        {"step": 3, "ts": 1764427260.02, "kind": "phase_end", "data": {"phase": "eval"}},
    ],
    "heartbeat": {
        "ts": 1764427261.0,
        "phase": "data",
        "last_step": 3,
        "forwards": 3,
        "nograd_forwards": 0,
        "stack": ["train:next_batch", "train:main", "__main__:<module>"],
    },
}
