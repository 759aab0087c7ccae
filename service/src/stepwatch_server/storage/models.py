"""The schema, as typed SQLAlchemy 2 models. Alembic (migrations/) is the only way it changes.

Volume drives the shape: a 512-rank run at one step per second sends ~15,000 scalars per second, so
a value is one narrow row in `points` keyed by a small integer `series_id` (a per-run dictionary of
metric and tensor-statistic names in `series`), and a step's timestamp is stored once per step in
`steps`, not once per value. Per-step times are Unix seconds (double precision) because they are
event times copied from the batch and are compared and subtracted, never displayed as such;
bookkeeping times are timezone-aware UTC datetimes.

NaN: PostgreSQL stores it; SQLite turns a bound NaN into NULL, so a NULL `points.value` means NaN.
A value that was not measured at a step (null in the batch) is simply not stored.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

METRIC_STAT = ""  # `series.stat` of a per-step metric; tensor statistics use their stat name ("amax", ...)


class UtcDateTime(TypeDecorator[dt.datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite keeps no zone, so it is put back)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(dt.UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


JsonType = JSON().with_variant(JSONB(), "postgresql")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {dt.datetime: UtcDateTime(), dict[str, Any]: JsonType}


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    world_size: Mapped[int]
    created_at: Mapped[dt.datetime]
    last_seen_at: Mapped[dt.datetime]
    # The last step whose raw per-rank data retention deleted (runs/expiry.py); None: all of it is kept.
    raw_expired_to: Mapped[int | None] = mapped_column(BigInteger)
    # No block (runs/compaction.py) holds a step above this one; None: the run has no block.
    compacted_to: Mapped[int | None] = mapped_column(BigInteger)


class Rank(Base):
    """The latest known state of one rank of a run (identity, progress, heartbeat, agent counters)."""

    __tablename__ = "ranks"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    node: Mapped[str | None] = mapped_column(String(200))
    local_rank: Mapped[int | None]
    world_size: Mapped[int]
    replica_group: Mapped[int]
    shard: Mapped[int]
    num_shards: Mapped[int]
    incarnation: Mapped[int]
    last_step: Mapped[int | None] = mapped_column(BigInteger)
    # The highest step of any batch stored for the rank, every incarnation's (ingest moves it forward only; NULL
    # where not known): no value of the rank lies above it, so a read above the rollup watermark asks the raw
    # values only where some rank's is above the watermark (runs/rollups.py `stored_above`).
    stored_to: Mapped[int | None] = mapped_column(BigInteger)
    last_seen_at: Mapped[dt.datetime]
    last_heartbeat_at: Mapped[dt.datetime | None]
    phase: Mapped[str | None] = mapped_column(String(200))
    agent_version: Mapped[str | None] = mapped_column(String(64))
    agent_counters: Mapped[dict[str, Any] | None]
    # Values, fingerprints and events stored for the rank (the `rows` of its ingest answers): its disk use.
    stored_values: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))


class AgentSession(Base):
    """One agent session (process lifetime) of one rank: its incarnation of the steps it sends."""

    __tablename__ = "sessions"
    __table_args__ = (UniqueConstraint("run_id", "rank", "incarnation"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int]
    incarnation: Mapped[int]
    first_step: Mapped[int | None] = mapped_column(BigInteger)
    started_at: Mapped[dt.datetime]


class IngestedBatch(Base):
    """The idempotency record: `(session, seq)` of every stored batch, written with its rows."""

    __tablename__ = "batches"

    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    received_at: Mapped[dt.datetime]
    rows: Mapped[int]


class Series(Base):
    """Per-run dictionary of value names: a metric (stat '') or a tensor statistic of a module."""

    __tablename__ = "series"
    __table_args__ = (UniqueConstraint("run_id", "stat", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    stat: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(200))


class Point(Base):
    """One value: the bulk of the database. NULL value = NaN (see the module docstring)."""

    __tablename__ = "points"
    __table_args__ = ({"sqlite_with_rowid": False},)

    series_id: Mapped[int] = mapped_column(
        ForeignKey("series.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    rank: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    incarnation: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    value: Mapped[float | None] = mapped_column(Double)


class ValueBlock(Base):
    """The values of one rank and incarnation over one bucket of BLOCK_STEPS (256) steps, every series of the
    run, compressed (storage/codec.py): the compact form `points` rows take once a run has moved on
    (runs/compaction.py). `n_values`: how many values it holds.

    The block's bytes are `data` followed by `tail` (NULL: none). SQLite keeps them all in `data`. PostgreSQL
    gets the largest whole number of TOAST chunks in `tail` (stored out of line uncompressed, four chunks to
    a page) and the rest in `data` (kept in the row): a block stored whole left a part-filled last chunk that
    cost ~30% more pages than its bytes (storage/blocks.py `insert_rows`, `DATA`).

    A table with rowids on SQLite (the key is a separate index), as `rank_rollup_packs`: a WITHOUT ROWID row
    over ~1 KB keeps ~490 bytes in the b-tree and the rest on overflow pages of its own, the last one
    part-filled, so blocks of 4-6 KB took 1.3-1.5 times their bytes; with rowids a row's overflow pages are
    whole and a row of up to ~4 KB stays in the table's pages (1.08 times at 4-6 KB)."""

    __tablename__ = "blocks"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    rank: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    incarnation: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    n_values: Mapped[int]
    data: Mapped[bytes] = mapped_column(LargeBinary)
    tail: Mapped[bytes | None] = mapped_column(LargeBinary)


class RollupStats:
    """The figures of a rollup row: count, sum, min and max of the finite values, count of the others."""

    n: Mapped[int]
    total: Mapped[float] = mapped_column(Double)
    lo: Mapped[float | None] = mapped_column(Double)
    hi: Mapped[float | None] = mapped_column(Double)
    nonfinite: Mapped[int]


class RankRollupPack(Base):
    """Per (series, level, bucket, incarnation): every rank's count, sum, min, max of the finite values and
    count of non-finite ones over its steps in the bucket, which is `64 << level` steps wide, in one pack
    (`data`: runs/rank_packs.py; `ranks`: how many ranks it holds), or in a few parts of consecutive ranks
    (`part` 0, 1, ...) where one would take more than a third of a SQLite page. A row per rank took ~40
    bytes on SQLite and ~136 on PostgreSQL, more than the compacted values themselves (runs/rollups.py).
    `hi` and `nonfinite`: the highest maximum of its ranks (NULL where none had a finite value) and their
    non-finite values, so that a ranking of modules by their amax reads them without decoding a pack.

    A table with rowids on SQLite (the key is a separate index): its rows stay in the table's pages up to
    ~4 KB, where a WITHOUT ROWID row over ~1 KB (a pack of ~100 ranks) kept ~490 bytes in the b-tree and
    the rest on an overflow page of its own, 3.4 times the packs' size on disk."""

    __tablename__ = "rank_rollup_packs"

    series_id: Mapped[int] = mapped_column(
        ForeignKey("series.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    level: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    incarnation: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    part: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    ranks: Mapped[int]
    data: Mapped[bytes] = mapped_column(LargeBinary)
    hi: Mapped[float | None] = mapped_column(Double)
    nonfinite: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))


class StepRollup(RollupStats, Base):
    """Per (series, step, incarnation), over every rank: count, sum, min, max of the finite values
    and the count of non-finite ones (runs/rollups.py)."""

    __tablename__ = "step_rollups"
    __table_args__ = ({"sqlite_with_rowid": False},)

    series_id: Mapped[int] = mapped_column(
        ForeignKey("series.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    incarnation: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)


class StepRollupPack(Base):
    """The step rollups of one series and incarnation over one compacted bucket of BLOCK_STEPS (256) steps, in
    one row (`data`: runs/step_packs.py): compaction moves `step_rollups` rows here with the values. A row per
    step took ~50 bytes on SQLite and ~125 on PostgreSQL. `first_step`, `last_step` and `n_values` (the values
    it sums, finite or not) let a range's extent be counted without decoding. Rowids on SQLite, as
    `rank_rollup_packs` (a pack is ~3 KB)."""

    __tablename__ = "step_rollup_packs"

    series_id: Mapped[int] = mapped_column(
        ForeignKey("series.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    bucket: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    incarnation: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    n_values: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class RollupMark(Base):
    """Per run: the highest step whose values the rollups hold (runs/rollup_worker.py). Reads take
    rollups up to it and the raw points above it."""

    __tablename__ = "rollup_marks"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    rolled_to: Mapped[int] = mapped_column(BigInteger)


class StepRecord(Base):
    """When a rank finished a step (event time, Unix seconds), once per step and incarnation."""

    __tablename__ = "steps"
    __table_args__ = ({"sqlite_with_rowid": False},)

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    rank: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    incarnation: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    ts: Mapped[float] = mapped_column(Double)


class Fingerprint(Base):
    """A parameter fingerprint; replicas holding the same shard must agree on it."""

    __tablename__ = "fingerprints"
    __table_args__ = ({"sqlite_with_rowid": False},)

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    rank: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    incarnation: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    replica_group: Mapped[int]
    shard: Mapped[int]
    value: Mapped[str] = mapped_column(String(16))


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_id_kind_step", "run_id", "kind", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int]
    step: Mapped[int] = mapped_column(BigInteger)
    incarnation: Mapped[int]
    ts: Mapped[float] = mapped_column(Double)
    kind: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]]


class Anomaly(Base):
    """A detected problem of a run, one row per (run, kind, key, first step), upserted as it evolves.

    The detection engine holds the open ones in memory and rewrites the row when one is updated or
    resolved (detect/store.py); at start the open rows are handed back to the engine, so a restarted
    collector continues them instead of opening duplicates. `first_ts`/`last_ts`/`detected_ts`/
    `resolved_ts` are event times (Unix seconds, from the records), `created_at`/`updated_at` bookkeeping times.
    `evidence` holds plain JSON (non-finite numbers as the strings "NaN", "Infinity", "-Infinity").
    """

    __tablename__ = "anomalies"
    __table_args__ = (
        UniqueConstraint("run_id", "kind", "key", "first_step"),
        Index("ix_anomalies_run_id_status", "run_id", "status"),
        Index("ix_anomalies_status", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    key: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))  # open | resolved
    severity: Mapped[str] = mapped_column(String(16))  # info | warning | critical
    rank: Mapped[int | None]
    node: Mapped[str | None] = mapped_column(String(200))
    first_step: Mapped[int] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    detected_step: Mapped[int] = mapped_column(BigInteger)
    detected_ts: Mapped[float] = mapped_column(Double)
    first_ts: Mapped[float] = mapped_column(Double)
    last_ts: Mapped[float] = mapped_column(Double)
    resolved_step: Mapped[int | None] = mapped_column(BigInteger)
    resolved_ts: Mapped[float | None] = mapped_column(Double)
    summary: Mapped[str] = mapped_column(Text)
    evidence: Mapped[dict[str, Any]]
    created_at: Mapped[dt.datetime]
    updated_at: Mapped[dt.datetime]


class Command(Base):
    """Evidence asked of a run's ranks (stepwatch_server/commands/): the collector puts it on its answers
    to their batches and heartbeats until each rank posted a result (`command_results`) or `expires_at`
    passed (then that rank's status reads "no answer"). `targets`: the ranks asked, or None for every rank
    of the run (`ranks` of them when asked); `args`: the kind's arguments (a profile's `steps`).
    `requested_by`: the token's name, or "detection" for one asked at a verdict (`anomaly_id`)."""

    __tablename__ = "commands"
    __table_args__ = (Index("ix_commands_run_id_created_at", "run_id", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    targets: Mapped[list[int] | None] = mapped_column(JsonType)
    ranks: Mapped[int]
    args: Mapped[dict[str, Any]]
    requested_by: Mapped[str] = mapped_column(String(200))
    reason: Mapped[str] = mapped_column(String(200))
    anomaly_id: Mapped[int | None]
    created_at: Mapped[dt.datetime]
    expires_at: Mapped[dt.datetime]


class CommandResult(Base):
    """One rank's answer to a command: `done` with its `result` (JSON), or `refused` / `failed` with a
    `message`. The first answer of a rank counts."""

    __tablename__ = "command_results"

    command_id: Mapped[int] = mapped_column(
        ForeignKey("commands.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    rank: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    session: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    result: Mapped[dict[str, Any] | None]
    received_at: Mapped[dt.datetime]


class CommandArtifact(Base):
    """A file a rank uploaded for a command (a profile's Chrome trace, gzip), at most one per rank."""

    __tablename__ = "command_artifacts"

    command_id: Mapped[int] = mapped_column(
        ForeignKey("commands.id", ondelete="CASCADE"), primary_key=True, autoincrement=False
    )
    rank: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    size: Mapped[int]  # bytes
    data: Mapped[bytes] = mapped_column(LargeBinary)
    received_at: Mapped[dt.datetime]


class AlertEvent(Base):
    """One anomaly transition (open, escalate, resolve) routed to one alert channel (alerts/outbox.py).

    Written in the transaction that stores the anomaly, so a crash loses none. `status`: pending
    (waiting for its group window), grouped (part of the delivery `delivery_id`), suppressed (cooldown,
    or a resolve whose open was never sent; `reason` says which).
    """

    __tablename__ = "alert_events"
    __table_args__ = (
        Index("ix_alert_events_status_id", "status", "id"),
        Index("ix_alert_events_cooldown", "channel", "run_id", "kind", "key", "created_at"),
        Index("ix_alert_events_anomaly_id", "anomaly_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    anomaly_id: Mapped[int] = mapped_column(ForeignKey("anomalies.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    channel: Mapped[str] = mapped_column(String(100))
    event: Mapped[str] = mapped_column(String(16))  # open | escalate | resolve
    kind: Mapped[str] = mapped_column(String(32))
    key: Mapped[str] = mapped_column(String(200))
    severity: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))  # pending | grouped | suppressed
    reason: Mapped[str | None] = mapped_column(String(200))
    delivery_id: Mapped[int | None] = mapped_column(ForeignKey("alert_deliveries.id", ondelete="SET NULL"))
    created_at: Mapped[dt.datetime]


class AlertDelivery(Base):
    """One message to one channel (a group of events), with its delivery state: the durable outbox.

    `payload` is the rendered JSON body (no secrets: URLs and signing keys come from the configuration
    at send time). `next_attempt_at` is when it is due; a claimed row's is pushed out by a lease, so a
    row whose sender died is sent again once the lease runs out. `status`: pending | delivered |
    failed (gave up: a permanent error, or the deadline `deadline_at` passed).
    """

    __tablename__ = "alert_deliveries"
    __table_args__ = (
        UniqueConstraint("idempotency_key"),
        Index("ix_alert_deliveries_status_next_attempt_at", "status", "next_attempt_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    idempotency_key: Mapped[str] = mapped_column(String(64))
    channel: Mapped[str] = mapped_column(String(100))
    event: Mapped[str] = mapped_column(String(16))  # open | escalate | resolve
    run: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    severity: Mapped[str] = mapped_column(String(16))
    title: Mapped[str] = mapped_column(Text)
    anomaly_ids: Mapped[list[int]] = mapped_column(JsonType)
    payload: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int]
    created_at: Mapped[dt.datetime]
    next_attempt_at: Mapped[dt.datetime]
    deadline_at: Mapped[dt.datetime]
    last_attempt_at: Mapped[dt.datetime | None]
    delivered_at: Mapped[dt.datetime | None]
    last_status_code: Mapped[int | None]
    last_error: Mapped[str | None] = mapped_column(Text)


ALL_TABLES = tuple(Base.metadata.sorted_tables)
