"""The real-log report: every anomaly the detectors raise over each real log, in markdown.

    python -m tests.detect.real_logs [--context N] [NAME ...]

(from the repository root, with the project's environment). For each log: its steps, columns and
every anomaly (kind, severity, status, first / last / detected / resolved step, summary); with
`--context N`, the loss, grad norm and step time (and allocated memory for a memory leak) of the N rows
either side of each anomaly's first step, so that a person can give each anomaly a verdict. NAME
picks the logs whose name contains it (default: the whole corpus and the shared logs present).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from stepwatch_server.detect import Anomaly
from tests.detect.real_logs import ALL_KINDS, LogTable, all_logs, log_name, read_log, run_log

CONTEXT_COLUMNS = ("loss", "grad_norm", "step_time_ms")


def _cell(value: float, recorded: bool) -> str:
    if not recorded:
        return ""
    return "nan" if np.isnan(value) else f"{value:.6g}"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def report_log(path: Path, context: int = 0) -> tuple[str, list[Anomaly]]:
    """One log's section of the report, and its anomalies."""
    table = read_log(path)
    anomalies = run_log(path)
    segs = int(table.segments.max()) + 1
    lines = [
        f"## {table.name}",
        "",
        f"- steps: {table.steps.min()}..{table.steps.max()}, {len(table)} rows"
        + (f", {segs} segments" if segs > 1 else ""),
        f"- columns: {', '.join(table.columns)}",
        f"- anomalies: {len(anomalies)}",
        "",
    ]
    if anomalies:
        lines += [
            "| # | kind | severity | status | first | last | detected | resolved | summary |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for n, a in enumerate(anomalies, 1):
            resolved = "" if a.resolved_step is None else str(a.resolved_step)
            lines.append(
                f"| {n} | {a.kind} | {a.severity} | {a.status} | {a.first_step} | {a.last_step} | "
                f"{a.detected_step} | {resolved} | {_md(a.summary)} |"
            )
        lines.append("")
    if context > 0:
        ts = table.event_times()
        for n, a in enumerate(anomalies, 1):
            lines += _context(table, ts, n, a, context)
    return "\n".join(lines), anomalies


def _context(table: LogTable, ts: np.ndarray, n: int, a: Anomaly, context: int) -> list[str]:
    """The rows around the anomaly's first step (the last row at or before it)."""
    shown = [c for c in CONTEXT_COLUMNS if c in table.values]
    if a.kind == "memory_leak" and "mem_allocated_mb" in table.values:
        shown.append("mem_allocated_mb")
    seg = ["segment"] if table.segments.max() > 0 else []
    # The row detected at (its event time is the frame's), then back in its segment to the first
    # step: a detector may date first_ts at detection, and a resumed log repeats steps.
    detected = int(np.clip(np.searchsorted(ts, a.detected_ts - 1e-6), 0, len(table) - 1))
    rows = np.arange(len(table))
    before = (table.segments == table.segments[detected]) & (table.steps <= a.first_step) & (rows <= detected)
    at = int(rows[before][-1]) if before.any() else detected
    lines = [f"Context of #{n} ({a.kind}, first step {a.first_step}):", ""]
    lines.append("| step | " + " | ".join([*seg, *shown]) + " |")
    lines.append("|---" * (1 + len(seg) + len(shown)) + "|")
    for i in range(max(0, at - context), min(len(table), at + context + 1)):
        mark = " **<**" if i == at else ""
        cells = [str(table.segments[i])] * len(seg)
        cells += [_cell(table.values[c][i], bool(table.recorded[c][i])) for c in shown]
        lines.append(f"| {table.steps[i]}{mark} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def summary(results: list[tuple[str, int, list[Anomaly]]]) -> str:
    """One row per log: its rows and its anomalies by kind."""
    kinds = [k for k in ALL_KINDS if any(a.kind == k for _, _, found in results for a in found)]
    lines = ["## Summary", "", "| log | rows | " + " | ".join([*kinds, "all"]) + " |"]
    lines.append("|---" * (3 + len(kinds)) + "|")
    for name, rows, found in results:
        counts = [str(sum(a.kind == k for a in found)) for k in kinds]
        lines.append(f"| {name} | {rows} | " + " | ".join([*counts, str(len(found))]) + " |")
    return "\n".join([*lines, ""])


def select(names: Sequence[str]) -> list[Path]:
    """The logs whose name is one of `names` or contains one of them (all logs when empty)."""
    logs = all_logs()
    if not names:
        return logs
    chosen = [p for p in logs if any(n in log_name(p) for n in names)]
    missing = [n for n in names if not any(n in log_name(p) for p in logs)]
    if missing:
        raise SystemExit(f"no real log matches {', '.join(missing)}")
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Replay real training logs through the detectors.")
    parser.add_argument("names", nargs="*", help="log names, or parts of them (default: every log)")
    parser.add_argument("--context", type=int, default=0, help="rows shown around each anomaly's first step")
    args = parser.parse_args(argv)
    paths = select(args.names)
    print("# Real training logs through the detectors (default settings)\n")
    print(f"{len(paths)} logs; detectors: {', '.join(ALL_KINDS)}.\n")
    results = []
    for path in paths:
        text, found = report_log(path, args.context)
        print(text, flush=True)
        results.append((log_name(path), len(read_log(path)), found))
    print(summary(results))
    return 0
