"""The shapes of the detection API's answers, for the OpenAPI document (as runs/answers.py)."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel

from stepwatch_server.responses import Num

Verdict = Literal["ok", "warning", "critical"]


class AnomalyOut(BaseModel):
    id: int
    run: str
    kind: str
    key: str
    status: Literal["open", "resolved"]
    severity: str
    rank: int | None
    node: str | None
    first_step: int | None
    last_step: int | None
    detected_step: int | None
    detected_ts: Num
    first_ts: Num
    last_ts: Num
    resolved_step: int | None
    resolved_ts: Num
    summary: str
    evidence: dict[str, Any] | None
    created_at: dt.datetime
    updated_at: dt.datetime


class RunAnomaliesAnswer(BaseModel):
    run: str
    anomalies: list[AnomalyOut]


class AnomaliesAnswer(BaseModel):
    anomalies: list[AnomalyOut]


class Reason(BaseModel):
    id: int
    kind: str
    severity: str
    summary: str
    first_step: int | None


class RankHealth(BaseModel):
    rank: int
    node: str | None
    verdict: Verdict
    reasons: list[Reason]


class HealthAnswer(BaseModel):
    run: str
    verdict: Verdict
    reasons: list[Reason]
    open: int
    ranks: list[RankHealth]  # the ranks heard from
    ranks_missing: int  # declared (world size) but never heard from
    missing_ranges: list[list[int]]  # those ranks as [first, last] ranges (at most 16)


class DetectionAnswer(BaseModel):
    """The worker's counters (queue, throughput, drops, lag); `{"enabled": false}` when detection is off."""

    enabled: bool
