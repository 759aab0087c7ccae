"""Two ranks' profiles compared: the operators whose time per step differs most between the slow rank (the
blamed one, else the first asked) and its peer, so that a straggler's trace is read from its difference."""

from __future__ import annotations

from typing import Any

TOP = 15


def _per_step(result: dict[str, Any] | None) -> dict[str, float]:
    """Operator -> self time (CPU + device) per profiled step, in microseconds."""
    result = result or {}
    steps = max(1, int(result.get("steps") or 1))
    totals: dict[str, float] = {}
    for op in result.get("top_ops") or []:
        if isinstance(op, dict) and isinstance(op.get("name"), str):
            spent = float(op.get("self_cpu_us") or 0) + float(op.get("self_device_us") or 0)
            totals[op["name"]] = totals.get(op["name"], 0.0) + spent / steps
    return totals


def compare(done: list[tuple[int, dict[str, Any] | None]], blamed: int | None) -> dict[str, Any] | None:
    """`{"slow_rank", "peer_rank", "ops": [{"name", "slow_us", "peer_us", "diff_us"}]}` (per step, the
    biggest difference first), or None with fewer than two profiles."""
    if len(done) < 2:
        return None
    by_rank = dict(done)
    slow = blamed if blamed in by_rank else done[0][0]
    peer = next(r for r, _ in done if r != slow)
    a, b = _per_step(by_rank[slow]), _per_step(by_rank[peer])
    rows: list[dict[str, Any]] = [
        {"name": name, "slow_us": round(a.get(name, 0.0), 1), "peer_us": round(b.get(name, 0.0), 1),
         "diff_us": round(a.get(name, 0.0) - b.get(name, 0.0), 1)}
        for name in set(a) | set(b)
    ]  # fmt: skip
    rows.sort(key=lambda r: -r["diff_us"])
    return {"slow_rank": slow, "peer_rank": peer, "ops": rows[:TOP]}
