"""The shapes of the dashboard API's answers, for the OpenAPI document (as runs/answers.py)."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel

from stepwatch_server.detect.answers import Verdict
from stepwatch_server.responses import Num
from stepwatch_server.runs.answers import RunSummary


class DashboardRun(RunSummary):
    verdict: Verdict
    open_anomalies: int
    anomalies: int
    anomalies_updated_at: dt.datetime | None
    step_rate: float | None
    live: bool  # heard from in the last 30 s and not finished
    finished: bool  # every rank's agent closed its session after its last step
    duration_s: float | None  # finished runs: from the first batch to the last, on the collector's clock


class DashboardRunsAnswer(BaseModel):
    runs: list[DashboardRun]


class HeatmapAnswer(BaseModel):
    metric: str
    mode: str
    ranks: list[int]
    steps: list[int]
    bucket_steps: int
    values: list[list[float | None]]  # ranks x buckets; null where a rank has no value in a bucket
    median: list[float | None]
    # metric=time.late_ms from the raw points only: each cell's standard error (its per-step lateness)
    noise: list[list[float | None]] | None = None


class ModuleAmax(BaseModel):
    name: str
    steps: list[int]
    values: list[Num]
    latest: Num  # the last sampled step's maximum over ranks ("NaN" after a NaN)


class AmaxAnswer(BaseModel):
    e4m3_max: float
    e5m2_max: float
    tracked: int  # the run's modules with an amax series; `modules` holds `top` of them when asked
    modules: list[ModuleAmax]
