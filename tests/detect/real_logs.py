"""Real public training logs as one-rank runs, replayed through the detectors.

Two kinds of file: the corpus in `tests/data/real-logs/*.csv.gz` (see its SOURCES.md; written by its
normalize.py) and the three plain CSVs in ../shared/real-logs (`*.normalized.csv`, read by older
tests through `csv_frames`/`run_csv`). Both have `step[,segment],loss[,grad_norm][,step_time_ms]
[,...]`; an empty cell is a value the source did not record, `nan` one it recorded as nan.

`run_log` replays a log the way the collector would see it live: each row becomes a `StepFrame`
(only the values recorded that step) at an event time that adds up the step times (see
`LogTable.event_times`), and the run context learns of each step as from a batch. Before each row
that records a step time, a heartbeat arrives that step time after the previous record (what the
agent's sender thread sends while a long step runs), so the hang detector sees that step's
duration as a stall. Detectors run with their default settings and are called directly: an
exception propagates instead of switching the detector off as the engine does.

Report: `python -m tests.detect.real_logs [--context N] [NAME ...]` (tests/detect/real_log_report.py).
"""

from __future__ import annotations

import csv
import gzip
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stepwatch_server.detect import Anomaly, EngineSettings, StepFrame
from stepwatch_server.detect.base import Detector
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.registry import DETECTORS
from stepwatch_server.ingest.schema import Batch, Heartbeat
from tests.conftest import REPO, SHARED

CORPUS = REPO / "tests" / "data" / "real-logs"
REAL_LOGS = SHARED / "real-logs"
LLMC = REAL_LOGS / "modded-nanogpt_llmc-gpt2-124M_main.log.normalized.csv"
SCALEUP_1B = REAL_LOGS / "modded-nanogpt_ScaleUp1B_87bd51fd.log.normalized.csv"
DEEPSEEK = REAL_LOGS / "megatron_deepseekv3-proxy-release_golden_values_dev_dgx_h100.json.normalized.csv"
SHARED_LOGS = (LLMC, SCALEUP_1B, DEEPSEEK)
START_TS = 1_700_000_000.0
UNKNOWN_STEP_S = 1.0  # event time a step takes when the log has no step time
ALL_KINDS = tuple(cls.kind for cls in DETECTORS)
COLUMNS = {"loss": "loss", "grad_norm": "grad_norm", "step_time_ms": "time.step_ms"}  # csv_frames'
# Log column -> (frame metric, scale). The shared Megatron file has bytes; the corpus has MB.
METRICS = {
    "loss": ("loss", 1.0),
    "grad_norm": ("grad_norm", 1.0),
    "step_time_ms": ("time.step_ms", 1.0),
    "lr": ("lr", 1.0),
    "mem_allocated_mb": ("mem.allocated_mb", 1.0),
    "mem_allocated_bytes": ("mem.allocated_mb", 1.0 / 2**20),
    "mem_peak_mb": ("mem.peak_mb", 1.0),
}


# -- the corpus ----------------------------------------------------------------------------------
def corpus_logs() -> list[Path]:
    """The corpus files, by name."""
    return sorted(CORPUS.glob("*.csv.gz"))


def all_logs() -> list[Path]:
    """The corpus and those of the shared plain CSVs that are present (they live outside the repo)."""
    return corpus_logs() + [p for p in SHARED_LOGS if p.exists()]


def log_name(path: Path) -> str:
    return path.name.removesuffix(".gz").removesuffix(".csv").removesuffix(".normalized")


@dataclass(frozen=True)
class LogTable:
    """One log's columns as arrays: `values` NaN where not recorded or nan, `recorded` which cells
    held a value (the literal nan included)."""

    name: str
    columns: list[str]  # the data columns in file order (not step, segment)
    steps: np.ndarray  # int64
    segments: np.ndarray  # int64, all 0 without a segment column
    values: dict[str, np.ndarray]
    recorded: dict[str, np.ndarray]

    def __len__(self) -> int:
        return int(self.steps.shape[0])

    def event_times(self) -> np.ndarray:
        """End-of-step event time of each row: the sum of the rows' step times (`own_step_s`), each
        times its step gap (a log of every k-th step stands for k steps a row)."""
        gap = np.diff(self.steps, prepend=self.steps[:1] - 1)
        gap[1:][np.diff(self.segments) != 0] = 1  # a new segment: the first step after the restart
        gap = np.maximum(gap, 1)
        return START_TS + np.cumsum(self.own_step_s() * gap)

    def own_step_s(self) -> np.ndarray:
        """Each row's step time in seconds: its own; else the next one the log gives (Megatron logs
        the mean iteration time of the interval that ends at the logged step); after the last one,
        that; `UNKNOWN_STEP_S` when the log gives none."""
        step_ms = self.values.get("step_time_ms")
        known = np.zeros(len(self), dtype=bool) if step_ms is None else np.isfinite(step_ms)
        if step_ms is None or not known.any():
            return np.full(len(self), UNKNOWN_STEP_S)
        n = len(self)
        idx = np.where(known, np.arange(n), n)
        nxt = np.minimum.accumulate(idx[::-1])[::-1]  # the next known row (n: none after)
        last = int(np.flatnonzero(known)[-1])
        return step_ms[np.where(nxt < n, nxt, last)] / 1000.0


def read_log(path: Path) -> LogTable:
    """A `.csv.gz` of the corpus or a shared plain `.csv`."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        rows = list(reader)
    index = {name: i for i, name in enumerate(header)}
    columns = [c for c in header if c not in ("step", "segment")]
    cells = {c: [row[index[c]] for row in rows] for c in columns}
    values = {
        c: np.array([float(v) if v else np.nan for v in col], dtype=np.float64) for c, col in cells.items()
    }
    recorded = {c: np.array([v != "" for v in col], dtype=bool) for c, col in cells.items()}
    steps = np.array([int(row[index["step"]]) for row in rows], dtype=np.int64)
    if "segment" in index:
        segments = np.array([int(row[index["segment"]]) for row in rows], dtype=np.int64)
    else:
        segments = np.zeros(len(rows), dtype=np.int64)
    return LogTable(log_name(path), columns, steps, segments, values, recorded)


def log_frames(table: LogTable, run: str = "real") -> Iterator[StepFrame]:
    """One frame per row, with the recorded values of the mapped columns only."""
    ts = table.event_times()
    mapped = [(c, *METRICS[c]) for c in table.columns if c in METRICS]
    present = np.ones(1, dtype=bool)
    for i in range(len(table)):
        metrics = {
            name: np.array([table.values[c][i] * scale]) for c, name, scale in mapped if table.recorded[c][i]
        }
        yield StepFrame(run=run, step=int(table.steps[i]), ts=float(ts[i]), present=present, metrics=metrics)


# -- replay --------------------------------------------------------------------------------------
def _batch(run: str, seq: int, step: int | None, ts: float, heartbeat: Heartbeat | None = None) -> Batch:
    steps = np.array([] if step is None else [step], dtype=np.int64)
    stamps = np.array([] if step is None else [ts], dtype=np.float64)
    return Batch(run, "replay", seq, 0, 1, steps, stamps, heartbeat=heartbeat)


def run_log(
    path: Path,
    kinds: Sequence[str] = ALL_KINDS,
    heartbeats: bool = True,
    **overrides: dict[str, object],
) -> list[Anomaly]:
    """Every anomaly of `kinds` the detectors raise over the log, as last seen, in order first raised.

    A detector's exception propagates (the engine would log it and switch the detector off)."""
    table = read_log(path)
    run = "real"
    settings = EngineSettings(kinds=tuple(kinds), overrides=dict(overrides))
    ctx = RunContext(run, 1)
    detectors = [cls(ctx, settings.settings_for(cls)) for cls in DETECTORS if cls.kind in kinds]
    tickers = [d for d in detectors if type(d).on_tick is not Detector.on_tick]
    own_s = table.own_step_s()
    seen: dict[int, Anomaly] = {}
    prev: StepFrame | None = None
    for i, frame in enumerate(log_frames(table, run)):
        if heartbeats and prev is not None and "time.step_ms" in frame.metrics and own_s[i] > 0:
            # The sender thread while this step runs, one step time after the previous record.
            hb_ts = min(prev.ts + float(own_s[i]), frame.ts)
            ctx.update(_batch(run, 2 * i, None, hb_ts, Heartbeat(hb_ts, None, prev.step)), hb_ts)
            for detector in tickers:
                detector.on_tick(ctx.event_now(), hb_ts)
        ctx.update(_batch(run, 2 * i + 1, frame.step, frame.ts), frame.ts)
        step_ms = frame.metrics.get("time.step_ms")
        if step_ms is not None:
            ctx.record_step_time(float(step_ms[0]))
        for detector in detectors:
            detector.on_frame(frame)
        for detector in tickers:
            detector.on_tick(ctx.event_now(), frame.ts)
        for anomaly in ctx.book.drain_changes():
            seen[anomaly.local_id] = anomaly
        prev = frame
    return list(seen.values())


# -- the shared plain CSVs, as the older tests read them -------------------------------------------
def _num(cell: str | None) -> float:
    try:
        return float(cell) if cell not in (None, "") else float("nan")
    except ValueError:
        return float("nan")


def csv_frames(path: Path, run: str = "real") -> Iterator[StepFrame]:
    """Frames of a shared plain CSV: loss, grad norm and step time, NaN where empty, 1 s per row
    when the step time is unknown (whatever the step gap). `log_frames` is the corpus's reader."""
    ts = START_TS
    with path.open(newline="") as fh:
        for row in csv.DictReader(fh):
            metrics = {name: np.array([_num(row.get(col))]) for col, name in COLUMNS.items() if col in row}
            step_ms = metrics.get("time.step_ms", np.array([np.nan]))[0]
            ts += step_ms / 1000.0 if np.isfinite(step_ms) else 1.0
            yield StepFrame(
                run=run, step=int(row["step"]), ts=ts, present=np.ones(1, dtype=bool), metrics=metrics
            )


def run_csv(path: Path, kinds: tuple[str, ...], **overrides: dict[str, object]) -> list[Anomaly]:
    """Every anomaly of `kinds` the detectors raise over the log, as last seen, in order first raised."""
    settings = EngineSettings(kinds=kinds, overrides=dict(overrides))
    ctx = RunContext("real", 1)
    detectors = [cls(ctx, settings.settings_for(cls)) for cls in DETECTORS if cls.kind in kinds]
    seen: dict[int, Anomaly] = {}
    for frame in csv_frames(path):
        for detector in detectors:
            detector.on_frame(frame)
        for anomaly in ctx.book.drain_changes():
            seen.setdefault(anomaly.local_id, anomaly)
    return list(seen.values())


if __name__ == "__main__":  # the report lives beside this module
    from tests.detect.real_log_report import main

    sys.exit(main())
