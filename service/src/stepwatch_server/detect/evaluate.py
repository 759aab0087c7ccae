"""Score the detectors on the simulator's scenario suite: `stepwatch-server evaluate`.

Each scenario's batches go through the real validation (`parse_batch`) into a fresh engine, exactly
as ingest hands them over, without HTTP or storage (those are tested elsewhere); the anomalies are
matched against the scenario's ground-truth labels by `simulate.score` (its docstring has the rules).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from stepwatch_server.detect.anomalies import Anomaly
from stepwatch_server.detect.engine import DetectionEngine, EngineSettings
from stepwatch_server.ingest.validate import parse_batch
from stepwatch_server.simulate import (
    QUICK,
    SCENARIOS,
    Detection,
    Label,
    Scenario,
    Score,
    Simulation,
    score_scenario,
)


def detect_scenario(sc: Scenario, settings: EngineSettings | None = None) -> tuple[Simulation, list[Anomaly]]:
    """Every anomaly the engine raised on `sc` (as last seen), in the order first raised."""
    engine = DetectionEngine(settings)
    sim = Simulation(sc)
    seen: dict[int, Anomaly] = {}
    event_now = 0.0
    for doc in sim:
        batch = parse_batch(doc)
        if batch.steps.size:
            event_now = max(event_now, float(batch.timestamps[-1]))
        if batch.heartbeat is not None:
            event_now = max(event_now, batch.heartbeat.ts)
        # The replay's wall clock is its event time: nothing is ever "silent" in a replay.
        for anomaly in engine.feed(batch, wall_now=event_now):
            seen.setdefault(anomaly.local_id, anomaly)
    for anomaly in engine.tick(wall_now=event_now):
        seen.setdefault(anomaly.local_id, anomaly)
    return sim, list(seen.values())


def as_detection(anomaly: Anomaly) -> Detection:
    module = anomaly.evidence.get("module") if isinstance(anomaly.evidence, dict) else None
    return Detection(
        kind=anomaly.kind,
        first_step=anomaly.first_step,
        detected_at_step=anomaly.detected_step,
        rank=anomaly.rank,
        node=anomaly.node,
        last_step=anomaly.last_step if anomaly.status == "resolved" else None,
        detected_at_ts=anomaly.detected_ts,
        module=module if isinstance(module, str) else None,
    )


def _run_one(name: str, settings: EngineSettings | None) -> tuple[Sequence[Label], list[Anomaly], float]:
    """One scenario (also the unit of work of a worker process with --jobs)."""
    started = time.monotonic()
    sim, anomalies = detect_scenario(SCENARIOS[name], settings)
    return sim.labels, anomalies, time.monotonic() - started


def evaluate(
    names: Iterable[str],
    settings: EngineSettings | None = None,
    progress: TextIO | None = sys.stderr,
    jobs: int = 1,
) -> tuple[Score, list[dict[str, Any]]]:
    """Score the named scenarios (on `jobs` processes); returns the score and one row per scenario."""
    names = list(names)
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(_run_one, name, settings) for name in names]
            results: Iterable[tuple[Sequence[Label], list[Anomaly], float]] = (f.result() for f in futures)
            return _score(names, results, progress)
    return _score(names, (_run_one(name, settings) for name in names), progress)


def _score(
    names: list[str], results: Iterable[tuple[Sequence[Label], list[Anomaly], float]], progress: TextIO | None
) -> tuple[Score, list[dict[str, Any]]]:
    total = Score()
    rows: list[dict[str, Any]] = []
    for name, (labels, anomalies, seconds) in zip(names, results, strict=True):
        sc = SCENARIOS[name]
        score_scenario(total, name, labels, [as_detection(a) for a in anomalies], steps=sc.last_step)
        found = [f"{a.kind} {a.key} @{a.detected_step}" for a in anomalies]
        row = {
            "scenario": name,
            "ranks": sc.world_size,
            "steps": sc.last_step,
            "labels": [lab.kind for lab in labels],
            "anomalies": found,
            "seconds": round(seconds, 1),
        }
        rows.append(row)
        if progress is not None:
            print(
                f"{name:<36} {sc.world_size:>4} ranks {sc.last_step:>6} steps  {row['seconds']:>6}s  "
                f"labels={row['labels']} found={found[:6]}",
                file=progress,
                flush=True,
            )
    return total, rows


def markdown_table(total: Score) -> str:
    lines = [
        "| kind | labels | recall | precision | time to detect, steps (median / max) | seconds (max) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, ks in total.kinds.items():
        d = ks.as_dict()
        rec = "-" if ks.recall is None else f"{ks.recall:.0%}"
        prec = "-" if ks.precision is None else f"{ks.precision:.0%}"
        ttd = d["ttd_steps"]
        steps = "-" if ttd is None else f"{ttd['median']:g} / {ttd['max']:g}"
        secs = "-" if d["ttd_s"] is None else f"{d['ttd_s']['max']:.1f}"
        lines.append(f"| `{kind}` | {ks.labels} | {rec} | {prec} | {steps} | {secs} |")
    per10k = total.false_alarms_per_10k_steps
    lines.append("")
    lines.append(
        f"False alarms on clean scenarios: {total.clean_false_alarms} in {total.clean_steps:,} steps"
        + ("" if per10k is None else f" ({per10k:.2f} per 10k steps)")
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="stepwatch-server evaluate", description=__doc__)
    parser.add_argument("scenarios", nargs="*", help="scenario names (default: the whole suite)")
    parser.add_argument("--quick", action="store_true", help="the quick subset used by the tests")
    parser.add_argument("--json", type=Path, help="write the score and per-scenario rows here")
    parser.add_argument("--jobs", type=int, default=1, help="scenarios run in parallel processes (default 1)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.scenarios if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}; see `python -m stepwatch_server.simulate list`")
    names = args.scenarios or (list(QUICK) if args.quick else list(SCENARIOS))
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    total, rows = evaluate(names, jobs=args.jobs)
    print(total.table())
    print()
    print(markdown_table(total))
    if args.json:
        args.json.write_text(json.dumps({"score": total.as_dict(), "scenarios": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
