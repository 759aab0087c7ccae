"""Score detections against ground truth: per-kind precision, recall and time-to-detect, and false
alarms per 10k steps on clean runs.

Matching rules (a detection d matches a label l when all hold):
1. Same kind: d.kind == l.kind.
2. Overlapping window: d's window [d.first_step, d.last_step or d.detected_at_step] overlaps l's
   window widened to [l.first_step - EARLY_SLACK_STEPS, (l.last_step or +inf) + LATE_SLACK_STEPS]
   (a detector may date a spike from the grad-norm blow-up a step before, or resolve a little late),
   and d was raised no earlier than the widened start (d.detected_at_step >= l.first_step - slack).
3. Right blamed entity: a label with a rank requires d.rank in (l.rank, *l.ranks); a label with a node
   (slow_node) requires d.node == l.node, or d.rank among the node's slow ranks when d.node is absent;
   a run-level label (no rank, no node) accepts any blame. For fp8_overflow_risk, a detection that
   names a module must name the label's module.
A label is recalled when at least one detection matches it; its time-to-detect is the smallest
d.detected_at_step - l.first_step (and d.detected_at_ts - l.first_ts in seconds, when both are
known) over its matches, floored at 0. A detection that matches some label is a true positive (a
second detection of the same label counts as a duplicate, not a false alarm). A detection that does
not match but would match, by rules 2-3, a label that lists its kind in `tolerated` (a 2x straggler
really does slow the whole run) is ignored. Every other detection is a false positive.
Precision per kind = TP / (TP + FP) over that kind's detections; recall = recalled / labels.
False alarms per 10k steps = FP on clean scenarios x 10,000 / their completed steps (the named suite's
figure). The world's figure counts every false positive, in clean and faulty runs alike, against the
*clean steps*: the steps every run completed (a step a resume runs again counts again) outside every
label's window, widened by the slacks of rule 2 (an open-ended label to the end of the run).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepwatch_server.detect.anomalies import KINDS
from stepwatch_server.simulate.scenario import Label

EARLY_SLACK_STEPS = 5
LATE_SLACK_STEPS = 50


@dataclass(frozen=True)
class Detection:
    """What a detector reported (the fields a scorer needs; more are ignored)."""

    kind: str
    first_step: int
    detected_at_step: int
    rank: int | None = None
    node: str | None = None
    last_step: int | None = None
    detected_at_ts: float | None = None
    module: str | None = None
    summary: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Detection:
        first = d.get("first_step", d.get("step"))
        at = d.get("detected_at_step", first)
        if first is None or at is None:
            raise ValueError(f"detection needs first_step or detected_at_step: {dict(d)!r}")
        evidence = d.get("evidence") or {}
        module = d.get("module") or (evidence.get("module") if isinstance(evidence, Mapping) else None)
        return cls(
            kind=str(d["kind"]), first_step=int(first), detected_at_step=int(at),
            rank=None if d.get("rank") is None else int(d["rank"]), node=d.get("node"),
            last_step=None if d.get("last_step") is None else int(d["last_step"]),
            detected_at_ts=None if d.get("detected_at_ts") is None else float(d["detected_at_ts"]),
            module=module, summary=d.get("summary"),
        )  # fmt: skip


def _window_ok(d: Detection, lab: Label) -> bool:
    lo = lab.first_step - EARLY_SLACK_STEPS
    hi = math.inf if lab.last_step is None else lab.last_step + LATE_SLACK_STEPS
    d_hi = d.last_step if d.last_step is not None else max(d.detected_at_step, d.first_step)
    return d.first_step <= hi and d_hi >= lo and d.detected_at_step >= lo


def _entity_ok(d: Detection, lab: Label) -> bool:
    if lab.node is not None and lab.rank is None:
        return d.node == lab.node or (d.node is None and d.rank is not None and d.rank in lab.ranks)
    if lab.rank is not None:
        return d.rank is not None and (d.rank == lab.rank or d.rank in lab.ranks)
    if lab.kind == "fp8_overflow_risk" and d.module is not None:
        return d.module == lab.details.get("module")
    return True


def matches(d: Detection, lab: Label) -> bool:
    """Rules 1-3 of the module docstring."""
    return d.kind == lab.kind and _window_ok(d, lab) and _entity_ok(d, lab)


def _tolerated(d: Detection, lab: Label) -> bool:
    if d.kind not in lab.tolerated or not _window_ok(d, lab):
        return False
    if lab.rank is None and lab.node is None:
        return True
    # An implied detection may blame the label's entity or any rank it covers.
    return d.rank is None or d.rank == lab.rank or d.rank in lab.ranks or d.node == lab.node


@dataclass
class KindScore:
    labels: int = 0
    recalled: int = 0
    tp: int = 0
    fp: int = 0
    duplicates: int = 0
    tolerated: int = 0
    ttd_steps: list[int] = field(default_factory=list)
    ttd_s: list[float] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)  # "scenario: label" for each missed label

    @property
    def precision(self) -> float | None:
        n = self.tp + self.fp
        return None if n == 0 else self.tp / n

    @property
    def recall(self) -> float | None:
        return None if self.labels == 0 else self.recalled / self.labels

    def as_dict(self) -> dict[str, Any]:
        def stats(xs: Sequence[float]) -> dict[str, float] | None:
            if not xs:
                return None
            return {"median": statistics.median(xs), "max": max(xs), "mean": statistics.fmean(xs)}

        return {
            "labels": self.labels, "recalled": self.recalled, "recall": self.recall, "tp": self.tp,
            "fp": self.fp, "precision": self.precision, "duplicates": self.duplicates,
            "tolerated": self.tolerated, "ttd_steps": stats(self.ttd_steps), "ttd_s": stats(self.ttd_s),
            "missed": list(self.missed),
        }  # fmt: skip


@dataclass
class Score:
    kinds: dict[str, KindScore] = field(default_factory=lambda: {k: KindScore() for k in KINDS})
    clean_steps: int = 0
    clean_false_alarms: int = 0
    false_alarms: list[str] = field(default_factory=list)  # "scenario: kind rank step"
    steps_outside_labels: int = 0  # the world's clean steps (module docstring)
    false_alarm_rows: list[dict[str, Any]] = field(default_factory=list)  # every false positive
    miss_rows: list[dict[str, Any]] = field(default_factory=list)  # every missed label

    @property
    def false_alarms_per_10k_steps(self) -> float | None:
        """False alarms on clean scenarios per 10,000 completed steps (None without clean scenarios)."""
        return None if self.clean_steps == 0 else self.clean_false_alarms * 10_000 / self.clean_steps

    def false_alarms_per_10k_clean_steps(self, kind: str | None = None) -> float | None:
        """Every false positive (of `kind`, or of all kinds) per 10,000 steps outside every label's window."""
        if self.steps_outside_labels == 0:
            return None
        fp = sum(ks.fp for k, ks in self.kinds.items() if kind is None or k == kind)
        return fp * 10_000 / self.steps_outside_labels

    def overall(self) -> KindScore:
        """All kinds together, as one KindScore."""
        out = KindScore()
        for ks in self.kinds.values():
            out.labels += ks.labels
            out.recalled += ks.recalled
            out.tp += ks.tp
            out.fp += ks.fp
            out.duplicates += ks.duplicates
            out.tolerated += ks.tolerated
            out.ttd_steps += ks.ttd_steps
            out.ttd_s += ks.ttd_s
            out.missed += ks.missed
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "kinds": {
                k: {
                    **v.as_dict(),
                    "false_alarms_per_10k_clean_steps": self.false_alarms_per_10k_clean_steps(k),
                }
                for k, v in self.kinds.items()
            },
            "overall": {**self.overall().as_dict(), "missed": None},
            "clean_steps": self.clean_steps,
            "clean_false_alarms": self.clean_false_alarms,
            "false_alarms_per_10k_steps": self.false_alarms_per_10k_steps,
            "false_alarms": list(self.false_alarms),
            "steps_outside_labels": self.steps_outside_labels,
            "false_alarms_per_10k_clean_steps": self.false_alarms_per_10k_clean_steps(),
            "false_alarm_rows": list(self.false_alarm_rows),
            "miss_rows": list(self.miss_rows),
        }

    def table(self) -> str:
        """A plain-text report, one line per kind."""
        lines = [
            f"{'kind':<20} {'labels':>6} {'recall':>7} {'prec':>6} {'tp':>4} {'fp':>4} {'ttd_steps':>10} {'ttd_s':>8}"
        ]
        for kind, ks in self.kinds.items():
            rec = "-" if ks.recall is None else f"{ks.recall:.0%}"
            prec = "-" if ks.precision is None else f"{ks.precision:.0%}"
            steps = "-" if not ks.ttd_steps else f"{statistics.median(ks.ttd_steps):g}/{max(ks.ttd_steps)}"
            secs = "-" if not ks.ttd_s else f"{max(ks.ttd_s):.1f}"
            lines.append(
                f"{kind:<20} {ks.labels:>6} {rec:>7} {prec:>6} {ks.tp:>4} {ks.fp:>4} {steps:>10} {secs:>8}"
            )
        fa = self.false_alarms_per_10k_steps
        lines.append(f"false alarms per 10k steps on clean runs: {'-' if fa is None else f'{fa:.2f}'}")
        return "\n".join(lines)


def _kind(score: Score, kind: str) -> KindScore:
    return score.kinds.setdefault(kind, KindScore())


def steps_outside(labels: Sequence[Label], segments: Sequence[tuple[int, int]]) -> int:
    """Steps of `segments` ([first, last] ranges a run completed) outside every label's widened window."""
    total = 0
    for first, last in segments:
        inside = 0
        cover: list[tuple[int, int]] = []
        for lab in labels:
            lo = max(first, lab.first_step - EARLY_SLACK_STEPS)
            hi = last if lab.last_step is None else min(last, lab.last_step + LATE_SLACK_STEPS)
            if lo <= hi:
                cover.append((lo, hi))
        end = first - 1
        for lo, hi in sorted(cover):
            lo = max(lo, end + 1)
            if hi >= lo:
                inside += hi - lo + 1
                end = hi
        total += last - first + 1 - inside
    return total


def score_scenario(
    score: Score,
    name: str,
    labels: Sequence[Label],
    detections: Iterable[Detection | Mapping[str, Any]],
    *,
    steps: int,
    segments: Sequence[tuple[int, int]] | None = None,
) -> Score:
    """Add one scenario's outcome to `score` (returned for chaining). `steps`: steps it completed;
    `segments`: the [first, last] step ranges of its sessions, when a resume repeated some (default
    [(1, steps)])."""
    dets = [d if isinstance(d, Detection) else Detection.from_dict(d) for d in detections]
    matched_labels: set[int] = set()
    score.steps_outside_labels += steps_outside(labels, segments or [(1, steps)])
    for lab_i, lab in enumerate(labels):
        ks = _kind(score, lab.kind)
        ks.labels += 1
        hits = [d for d in dets if matches(d, lab)]
        if not hits:
            ks.missed.append(f"{name}: {lab.kind} rank={lab.rank} node={lab.node} step={lab.first_step}")
            score.miss_rows.append(
                {"scenario": name, "kind": lab.kind, "rank": lab.rank, "node": lab.node,
                 "first_step": lab.first_step, "last_step": lab.last_step, "details": dict(lab.details)}
            )  # fmt: skip
            continue
        matched_labels.add(lab_i)
        ks.recalled += 1
        ks.ttd_steps.append(max(0, min(d.detected_at_step for d in hits) - lab.first_step))
        secs = [
            d.detected_at_ts - lab.first_ts
            for d in hits
            if d.detected_at_ts is not None and lab.first_ts is not None
        ]
        if secs:
            ks.ttd_s.append(max(0.0, min(secs)))
    seen: set[int] = set()
    for d in dets:
        ks = _kind(score, d.kind)
        owners = [i for i, lab in enumerate(labels) if matches(d, lab)]
        if owners:
            if all(i in seen for i in owners):
                ks.duplicates += 1
            ks.tp += 1
            seen.update(owners)
        elif any(_tolerated(d, lab) for lab in labels):
            ks.tolerated += 1
        else:
            ks.fp += 1
            score.false_alarms.append(f"{name}: {d.kind} rank={d.rank} node={d.node} step={d.first_step}")
            score.false_alarm_rows.append(
                {"scenario": name, "kind": d.kind, "rank": d.rank, "node": d.node, "first_step": d.first_step,
                 "detected_step": d.detected_at_step, "last_step": d.last_step, "summary": d.summary,
                 "clean_run": not labels}
            )  # fmt: skip
            if not labels:
                score.clean_false_alarms += 1
    if not labels:
        score.clean_steps += steps
    return score


def score(
    results: Iterable[tuple[str, Sequence[Label], Iterable[Detection | Mapping[str, Any]], int]],
) -> Score:
    """Score many scenarios: each item is (name, labels, detections, completed steps)."""
    total = Score()
    for name, labels, dets, steps in results:
        score_scenario(total, name, labels, dets, steps=steps)
    return total
