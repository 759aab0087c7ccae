"""The shapes of the read API's answers, for the OpenAPI document (`responses={200: {"model": ...}}`).

The routes answer with orjson directly (responses.py); these models only document what they write, and
tests/service/test_openapi_conformance.py checks every answer against them. Objects stay open: a field
added later does not break a client that validates with these schemas.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, Field

from stepwatch_server.responses import Num


class RunSummary(BaseModel):
    name: str
    world_size: int
    created_at: dt.datetime
    last_seen_at: dt.datetime | None
    last_step: int | None
    ranks: int
    stored_values: int = Field(description="values, fingerprints and events stored for the run")
    stored_bytes: int = Field(
        description="an estimate: the database's size shared out over the runs by their stored values"
    )


class RunDeleted(BaseModel):
    run: str
    deleted: dict[str, int] = Field(description="rows removed, per table")
    seconds: float


class RunsAnswer(BaseModel):
    runs: list[RunSummary]


class Restart(BaseModel):
    rank: int
    incarnation: int
    first_step: int | None
    at: dt.datetime | None


class RunAnswer(RunSummary):
    metrics: list[str]
    tensors: dict[str, list[str]]
    restarts: list[Restart]
    raw_from_step: int | None = Field(
        description="where the raw per-rank data starts after retention deleted older steps (null: nothing was)"
    )
    compacted_to: int | None = Field(
        description="values up to this step may be stored in compressed blocks, the newer ones are rows (null: "
        "none is compacted yet); every value reads the same either way"
    )


class AgentInfo(BaseModel):
    version: str | None
    counters: dict[str, int]


class RankState(BaseModel):
    rank: int
    node: str | None
    local_rank: int | None
    world_size: int | None
    replica_group: int | None
    shard: int | None
    num_shards: int | None
    incarnation: int | None
    last_step: int | None
    last_seen_at: dt.datetime | None
    last_heartbeat_at: dt.datetime | None
    phase: str | None
    median_step_ms: float | None
    agent: AgentInfo


class RanksAnswer(BaseModel):
    run: str
    world_size: int
    ranks: list[RankState]


class Series(BaseModel):
    rank: int | Literal["mean", "global"]
    steps: list[int]
    values: list[Num]
    num_shards: int | None = None  # rank=global only


class SeriesAnswer(BaseModel):
    metric: str
    series: list[Series]


class NamedSeries(Series):
    name: str


class TensorsAnswer(BaseModel):
    stat: str
    series: list[NamedSeries]


class StepTimes(BaseModel):
    rank: int
    steps: list[int]
    timestamps: list[float | None]


class StepsAnswer(BaseModel):
    series: list[StepTimes]


class Fingerprints(BaseModel):
    rank: int
    replica_group: int | None
    shard: int | None
    steps: list[int]
    values: list[str]


class FingerprintsAnswer(BaseModel):
    series: list[Fingerprints]


class StoredEvent(BaseModel):
    rank: int
    step: int
    incarnation: int | None
    ts: float | None
    kind: str
    data: dict[str, Any] | None


class EventsAnswer(BaseModel):
    events: list[StoredEvent]
