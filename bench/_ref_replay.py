"""Replay one scenario's batches through whatever `stepwatch_server` is first on PYTHONPATH.

Run by `bench/evaluate_ref.py` with an older checkout's `service/src` first on PYTHONPATH, so this
file imports only what every version has had: `ingest.validate.parse_batch` and
`detect.engine.DetectionEngine`. It reads JSON lines on stdin (the batches, in arrival order, as ingest
would hand them over), feeds each to a fresh engine exactly as `detect/evaluate.py` does (the replay's
wall clock is its event time), and at the end of input writes one JSON object on stdout:
{"collector": path of the stepwatch_server package used, "anomalies": [every anomaly as last seen]}.
A batch that the validation rejects is counted, not fatal (its message is kept).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import stepwatch_server
from stepwatch_server.detect.engine import DetectionEngine
from stepwatch_server.ingest.validate import parse_batch


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, int | float | str | bool) or v is None:
        return v
    return str(v)


def main() -> int:
    engine = DetectionEngine()
    seen: dict[int, Any] = {}
    event_now = 0.0
    rejected: list[str] = []
    for line in sys.stdin:
        doc = json.loads(line)
        try:
            batch = parse_batch(doc)
        except Exception as exc:  # a field this version does not know
            if len(rejected) < 5:
                rejected.append(f"{type(exc).__name__}: {exc}")
            continue
        if batch.steps.size:
            event_now = max(event_now, float(batch.timestamps[-1]))
        if batch.heartbeat is not None:
            event_now = max(event_now, batch.heartbeat.ts)
        for anomaly in engine.feed(batch, wall_now=event_now):
            seen.setdefault(anomaly.local_id, anomaly)
    for anomaly in engine.tick(wall_now=event_now):
        seen.setdefault(anomaly.local_id, anomaly)
    out = []
    for a in seen.values():
        module = a.evidence.get("module") if isinstance(a.evidence, dict) else None
        out.append({
            "kind": a.kind, "key": a.key, "rank": a.rank, "node": a.node, "status": a.status,
            "first_step": a.first_step, "last_step": a.last_step, "detected_step": a.detected_step,
            "detected_ts": a.detected_ts, "summary": a.summary,
            "module": module if isinstance(module, str) else None,
        })  # fmt: skip
    json.dump(
        {"collector": stepwatch_server.__file__, "anomalies": _jsonable(out), "rejected": rejected},
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
