"""Anomalies and their lifecycle: open -> (updated) -> resolved.

A detector raises an anomaly under a key (kind, subject) on every step its condition holds, and
resolves it when the condition has cleared. The book keeps one open anomaly per key, so a condition
that lasts a thousand steps is one anomaly updated a thousand times, not a thousand anomalies, and
remembers which anomalies changed since the last `drain_changes()` so storage writes only those.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

Severity = Literal["info", "warning", "critical"]
Status = Literal["open", "resolved"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "critical")
KINDS = (
    "loss_spike",
    "divergence",
    "nonfinite",
    "straggler",
    "slow_node",
    "hang",
    "memory_leak",
    "replica_divergence",
    "fp8_overflow_risk",
    "throughput_drop",
)
MAX_RESOLVED_KEPT = 1000  # resolved anomalies kept in memory per run (all of them are in the database)

_ids = itertools.count(1)


@dataclass(slots=True)
class Anomaly:
    """One problem in one run: what, where, since when, how bad, and the numbers that say so."""

    run: str
    kind: str
    key: str  # the subject within its kind: "rank:37", "node:gpu-12", "module:lm_head", "run"
    severity: Severity
    summary: str
    rank: int | None
    node: str | None
    first_step: int
    last_step: int
    first_ts: float  # event time (the records' timestamps), Unix seconds
    last_ts: float
    detected_step: int  # the step being processed when it was first raised
    detected_ts: float  # event time when it was first raised
    evidence: dict[str, Any] = field(default_factory=dict)
    status: Status = "open"
    resolved_step: int | None = None
    resolved_ts: float | None = None
    local_id: int = field(default_factory=lambda: next(_ids))  # identity until storage gives an id

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled (the bus's snapshots, bus/worker.py) without its local id: restored in another
        process, it takes one of that process, so it never collides with one made there."""
        return (_restored, tuple(getattr(self, f.name) for f in fields(self) if f.name != "local_id"))

    def as_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "kind": self.kind,
            "key": self.key,
            "status": self.status,
            "severity": self.severity,
            "summary": self.summary,
            "rank": self.rank,
            "node": self.node,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "detected_step": self.detected_step,
            "detected_ts": self.detected_ts,
            "first_ts": self.first_ts,
            "last_ts": self.last_ts,
            "resolved_step": self.resolved_step,
            "resolved_ts": self.resolved_ts,
            "evidence": self.evidence,
        }


def _restored(*values: Any) -> Anomaly:
    return Anomaly(*values)


class AnomalyBook:
    """The anomalies of one run, keyed by (kind, key); records what changed for storage."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.open: dict[tuple[str, str], Anomaly] = {}
        self.resolved: list[Anomaly] = []
        self._changed: dict[int, Anomaly] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled: the changes not yet drained are keyed by their anomalies' new local ids."""
        self.__dict__.update(state)
        self._changed = {a.local_id: a for a in self._changed.values()}

    def raise_(
        self,
        kind: str,
        key: str,
        *,
        step: int,
        ts: float,
        severity: Severity,
        summary: str,
        evidence: dict[str, Any],
        rank: int | None = None,
        node: str | None = None,
        first_step: int | None = None,
        first_ts: float | None = None,
    ) -> Anomaly:
        """Open the anomaly for (kind, key), or update the open one (severity only goes up)."""
        anomaly = self.open.get((kind, key))
        if anomaly is None:
            anomaly = Anomaly(
                run=self.run,
                kind=kind,
                key=key,
                severity=severity,
                summary=summary,
                rank=rank,
                node=node,
                first_step=step if first_step is None else first_step,
                last_step=step,
                first_ts=ts if first_ts is None else first_ts,
                last_ts=ts,
                detected_step=step,
                detected_ts=ts,
                evidence=evidence,
            )
            self.open[(kind, key)] = anomaly
        else:
            if SEVERITIES.index(severity) > SEVERITIES.index(anomaly.severity):
                anomaly.severity = severity
            anomaly.summary, anomaly.evidence = summary, evidence
            anomaly.last_step, anomaly.last_ts = max(anomaly.last_step, step), max(anomaly.last_ts, ts)
        self._changed[anomaly.local_id] = anomaly
        return anomaly

    def adopt(self, anomalies: Iterable[Anomaly]) -> None:
        """Take over open anomalies stored by an earlier process (not marked as changed): a raise
        of the same (kind, key) then updates them and a resolve closes them, instead of duplicating."""
        for anomaly in anomalies:
            if anomaly.status == "open":
                self.open.setdefault((anomaly.kind, anomaly.key), anomaly)

    def is_open(self, kind: str, key: str) -> bool:
        return (kind, key) in self.open

    def get(self, kind: str, key: str) -> Anomaly | None:
        return self.open.get((kind, key))

    def resolve(
        self, kind: str, key: str, *, step: int, ts: float, note: str | None = None
    ) -> Anomaly | None:
        anomaly = self.open.pop((kind, key), None)
        if anomaly is None:
            return None
        anomaly.status, anomaly.resolved_step, anomaly.resolved_ts = "resolved", step, ts
        if note:
            anomaly.evidence = {**anomaly.evidence, "resolution": note}
        self.resolved.append(anomaly)
        del self.resolved[:-MAX_RESOLVED_KEPT]
        self._changed[anomaly.local_id] = anomaly
        return anomaly

    def open_of(self, kind: str) -> list[Anomaly]:
        return [a for (k, _), a in self.open.items() if k == kind]

    def drain_changes(self) -> list[Anomaly]:
        changed = list(self._changed.values())
        self._changed.clear()
        return changed
