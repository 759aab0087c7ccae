"""Score the detectors on the simulator: the named scenario suite, or a split of the world.

    python -m stepwatch_server.detect.evaluate [--quick] [NAME ...] [--jobs N] [--json OUT]
    python -m stepwatch_server.detect.evaluate --world dev|heldout [--jobs N] [--json OUT]

Each scenario's batches go through the real validation (`parse_batch`) into a fresh engine, exactly
as ingest hands them over, without HTTP or storage (those are tested elsewhere); the anomalies are
matched against the scenario's ground-truth labels by `simulate.score` (its docstring has the rules,
and how the world's clean steps and false alarms are counted). `--world` prints, per kind, recall,
precision, false alarms per 10k clean steps and time to detect, then every false alarm (with the
benign behaviours near it) and every miss.
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
    KindScore,
    Label,
    Scenario,
    Score,
    Simulation,
    score_scenario,
)
from stepwatch_server.simulate import benign as benign_mod
from stepwatch_server.simulate.world import SPLITS
from stepwatch_server.simulate.world import split as world_split


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
        summary=anomaly.summary,
    )


def _run_one(sc: Scenario, settings: EngineSettings | None) -> tuple[Sequence[Label], list[Detection], float]:
    """One scenario (also the unit of work of a worker process with --jobs)."""
    started = time.monotonic()
    sim, anomalies = detect_scenario(sc, settings)
    return sim.labels, [as_detection(a) for a in anomalies], time.monotonic() - started


Result = tuple[Sequence[Label], list[Detection], float]  # labels (with onset times), detections, seconds


def evaluate(
    scenarios: Iterable[str | Scenario],
    settings: EngineSettings | None = None,
    progress: TextIO | None = sys.stderr,
    jobs: int = 1,
) -> tuple[Score, list[dict[str, Any]]]:
    """Score the scenarios (names of the suite, or Scenarios) on `jobs` processes; returns the score and
    one row per scenario."""
    scns = [SCENARIOS[s] if isinstance(s, str) else s for s in scenarios]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = {i: pool.submit(_run_one, scns[i], settings) for i in costliest_first(scns)}
            results: Iterable[Result] = (futures[i].result() for i in range(len(scns)))
            return score_results(scns, results, progress)
    return score_results(scns, (_run_one(sc, settings) for sc in scns), progress)


def costliest_first(scns: Sequence[Scenario]) -> list[int]:
    """Indices of `scns`, the costliest first (so that a pool does not end on one long run): about a
    batch per rank every 2 s of event time, and the per-step work of every detector."""

    def cost(sc: Scenario) -> float:
        return sc.world_size * sc.completed_steps * max(sc.step_ms / 2000.0, 0.05) + 20.0 * sc.completed_steps

    return sorted(range(len(scns)), key=lambda i: -cost(scns[i]))


def score_results(
    scns: Sequence[Scenario], results: Iterable[Result], progress: TextIO | None
) -> tuple[Score, list[dict[str, Any]]]:
    """Score detections (from this collector or another version's: bench/evaluate_ref.py)."""
    total = Score()
    rows: list[dict[str, Any]] = []
    for sc, (labels, dets, seconds) in zip(scns, results, strict=True):
        n_fa = len(total.false_alarm_rows)
        segments = [(seg.first, seg.last) for seg in sc.segments]
        score_scenario(total, sc.name, labels, dets, steps=sc.last_step, segments=segments)
        for row in total.false_alarm_rows[n_fa:]:
            row["near"] = near(sc, row)
        found = [f"{d.kind} {_key(d)} @{d.detected_at_step}" for d in dets]
        row = {
            "scenario": sc.name,
            "ranks": sc.world_size,
            "steps": sc.last_step,
            "completed_steps": sc.completed_steps,
            "labels": [lab.kind for lab in labels],
            "anomalies": found,
            "seconds": round(seconds, 1),
        }
        rows.append(row)
        if progress is not None:
            print(
                f"{sc.name:<36} {sc.world_size:>4} ranks {sc.last_step:>6} steps  {row['seconds']:>6}s  "
                f"labels={row['labels']} found={found[:6]}",
                file=progress,
                flush=True,
            )
    return total, rows


def _key(d: Detection) -> str:
    if d.rank is not None:
        return f"rank:{d.rank}"
    if d.node is not None:
        return f"node:{d.node}"
    return f"module:{d.module}" if d.module else "run"


NEAR_STEPS = 50


def near(sc: Scenario, fa: dict[str, Any]) -> list[str]:
    """The benign behaviours and faults of the run whose steps come within NEAR_STEPS of a false alarm's
    window: what a person reading it looks at first."""
    lo = int(fa["first_step"]) - NEAR_STEPS
    hi = max(int(fa["detected_step"]), int(fa["last_step"] or fa["detected_step"])) + NEAR_STEPS
    out = []
    for b in sc.benign:
        first, last = benign_mod.window(b, sc)
        if first <= hi and (last is None or last >= lo):
            out.append(benign_mod.describe(b))
    for lab in sc.labels:
        out.append(f"fault {lab.kind} rank={lab.rank} node={lab.node} from step {lab.first_step}")
    if sc.pause_after(int(fa["first_step"]) - 1) or any(sc.pause_after(s) for s in range(max(1, lo), hi)):
        marked = ",".join(sc.marked_pauses) or "none"
        out.append(f"pauses (eval every {sc.eval_every}, checkpoint every {sc.ckpt_every}; marked: {marked})")
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _ttd(ks: KindScore) -> tuple[str, str]:
    d = ks.as_dict()
    steps = "-" if d["ttd_steps"] is None else f"{d['ttd_steps']['median']:g} / {d['ttd_steps']['max']:g}"
    secs = "-" if d["ttd_s"] is None else f"{d['ttd_s']['median']:.1f} / {d['ttd_s']['max']:.1f}"
    return steps, secs


def world_table(total: Score) -> str:
    """Per kind and overall: labels, recall, precision, false alarms per 10k clean steps, time to detect."""
    lines = [
        "| kind | labels | recall | precision | false alarms / 10k clean steps | "
        "time to detect, steps (median / max) | seconds (median / max) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [*total.kinds.items(), ("all kinds", total.overall())]
    for kind, ks in rows:
        steps, secs = _ttd(ks)
        fa = total.false_alarms_per_10k_clean_steps(None if kind == "all kinds" else kind)
        name = f"**{kind}**" if kind == "all kinds" else f"`{kind}`"
        fa_s = "-" if fa is None else f"{fa:.1f} ({ks.fp})"
        lines.append(
            f"| {name} | {ks.labels} | {_pct(ks.recall)} | {_pct(ks.precision)} | {fa_s} | {steps} | {secs} |"
        )
    per10k = total.false_alarms_per_10k_clean_steps()
    lines.append("")
    lines.append(
        f"Clean steps (completed steps outside every label's window): {total.steps_outside_labels:,}; "
        f"false alarms: {total.overall().fp}"
        + ("" if per10k is None else f" ({per10k:.1f} per 10k clean steps)")
    )
    return "\n".join(lines)


def error_list(total: Score) -> str:
    """Every false alarm (with what was near it) and every miss, one line each."""
    lines = [f"False alarms ({len(total.false_alarm_rows)}):"]
    for fa in total.false_alarm_rows:
        near_s = "; ".join(fa.get("near") or []) or "nothing"
        lines.append(
            f"- {fa['scenario']} `{fa['kind']}` rank={fa['rank']} node={fa['node']} step={fa['first_step']} "
            f"(detected {fa['detected_step']}): {fa['summary']} [near: {near_s}]"
        )
    lines.append("")
    lines.append(f"Misses ({len(total.miss_rows)}):")
    for m in total.miss_rows:
        details = ", ".join(f"{k}={v}" for k, v in m["details"].items())
        lines.append(
            f"- {m['scenario']} `{m['kind']}` rank={m['rank']} node={m['node']} steps {m['first_step']}-"
            f"{m['last_step'] if m['last_step'] is not None else 'end'}: {details}"
        )
    return "\n".join(lines)


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
    parser.add_argument("--world", choices=SPLITS, help="score a split of the world instead of the suite")
    parser.add_argument("--json", type=Path, help="write the score and per-scenario rows here")
    parser.add_argument("--jobs", type=int, default=1, help="scenarios run in parallel processes (default 1)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    if args.world:
        if args.scenarios or args.quick:
            parser.error("--world scores a whole split: no scenario names, no --quick")
        started = time.monotonic()
        scns = list(world_split(args.world).values())
        total, rows = evaluate(scns, jobs=args.jobs)
        print(world_report(args.world, scns, total, time.monotonic() - started))
        if args.json:
            args.json.write_text(json.dumps({"score": total.as_dict(), "scenarios": rows}, indent=2))
        return 0
    unknown = [n for n in args.scenarios if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}; see `python -m stepwatch_server.simulate list`")
    names = args.scenarios or (list(QUICK) if args.quick else list(SCENARIOS))
    total, rows = evaluate(names, jobs=args.jobs)
    print(total.table())
    print()
    print(markdown_table(total))
    if args.json:
        args.json.write_text(json.dumps({"score": total.as_dict(), "scenarios": rows}, indent=2))
    return 0


def world_report(
    split_name: str, scns: Sequence[Scenario], total: Score, seconds: float, note: str = ""
) -> str:
    """The split's composition line, the table, and the lists of false alarms and misses."""
    rank_steps = sum(s.completed_steps * s.world_size for s in scns)
    head = (
        f"world split {split_name!r}: {len(scns)} runs, {sum(s.completed_steps for s in scns):,} steps, "
        f"{rank_steps:,} rank-steps, {sum(not s.faults for s in scns)} clean runs; scored in {seconds:.0f} s"
    )
    return "\n\n".join(x for x in (head, note, world_table(total), error_list(total)) if x)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
