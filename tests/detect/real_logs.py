"""Real training logs (../shared/real-logs/*.normalized.csv) as a one-rank run of step frames.

The CSVs have `step,loss[,grad_norm][,step_time_ms][,...]`; steps may be sparse (every 5th). Each
row becomes a `StepFrame` with `loss`, `grad_norm` and `time.step_ms` (when the log has them), its
event time the cumulative step time (1 s per step when unknown), and the frames go straight to the
detectors (the aligner has nothing to align for one rank).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from stepwatch_server.detect import Anomaly, EngineSettings, StepFrame
from stepwatch_server.detect.context import RunContext
from stepwatch_server.detect.registry import DETECTORS
from tests.conftest import SHARED

REAL_LOGS = SHARED / "real-logs"
LLMC = REAL_LOGS / "modded-nanogpt_llmc-gpt2-124M_main.log.normalized.csv"
SCALEUP_1B = REAL_LOGS / "modded-nanogpt_ScaleUp1B_87bd51fd.log.normalized.csv"
DEEPSEEK = REAL_LOGS / "megatron_deepseekv3-proxy-release_golden_values_dev_dgx_h100.json.normalized.csv"
START_TS = 1_700_000_000.0
COLUMNS = {"loss": "loss", "grad_norm": "grad_norm", "step_time_ms": "time.step_ms"}


def _num(cell: str | None) -> float:
    try:
        return float(cell) if cell not in (None, "") else float("nan")
    except ValueError:
        return float("nan")


def csv_frames(path: Path, run: str = "real") -> Iterator[StepFrame]:
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
