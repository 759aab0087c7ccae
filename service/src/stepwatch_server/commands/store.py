"""The commands' rows (`commands`, `command_results`, `command_artifacts`): asking, answering, reading."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import Connection, Table, delete, func, insert, select

from stepwatch_server.errors import NotFound
from stepwatch_server.ingest.store import insert_ignore
from stepwatch_server.storage.models import Anomaly, Command, CommandArtifact, CommandResult, Rank, Run

KINDS = ("stacks", "profile")
ANSWER_WITHIN_S = 60.0  # a rank that has not answered by then reads "no answer"
MAX_RESULT_BYTES = 2 << 20  # one rank's result, as JSON (README "Evidence at a verdict")
MAX_ARTIFACT_BYTES = 32 << 20  # one rank's file (a gzipped profiler trace)
KEPT_PER_RUN = 20  # a run keeps its newest commands and their results; asking another deletes the oldest


@dataclass(frozen=True, slots=True)
class Asked:
    """A command that some rank may still owe an answer to (pending.py)."""

    id: int
    run: str
    kind: str
    targets: frozenset[int] | None
    expires_at: dt.datetime
    args: dict[str, Any] = field(default_factory=dict)

    def wanted(self, rank: int) -> bool:
        return self.targets is None or rank in self.targets


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def ask(
    conn: Connection,
    run_id: int,
    kind: str,
    targets: Sequence[int] | None,
    args: dict[str, Any],
    requested_by: str,
    reason: str,
    anomaly_id: int | None = None,
    answer_within_s: float = ANSWER_WITHIN_S,
) -> int:
    """Store a command for the ranks `targets` or (None) every rank the run has; its id. The run's
    commands beyond its newest KEPT_PER_RUN go, with their results and files (bounded storage per run)."""
    if targets is None:
        ranks = int(conn.execute(select(func.count()).where(Rank.run_id == run_id)).scalar_one())
    else:
        targets = sorted(set(targets))
        ranks = len(targets)
    created = now()
    row = conn.execute(
        insert(Command)
        .values(
            run_id=run_id, kind=kind, targets=targets, ranks=ranks, args=args, requested_by=requested_by[:200],
            reason=reason[:200], anomaly_id=anomaly_id, created_at=created,
            expires_at=created + dt.timedelta(seconds=answer_within_s),
        )
        .returning(Command.id)
    )  # fmt: skip
    cid = int(row.scalar_one())
    newest = (
        select(Command.id).where(Command.run_id == run_id).order_by(Command.id.desc()).limit(KEPT_PER_RUN)
    )
    old_query = select(Command.id).where(
        Command.run_id == run_id, Command.id.not_in(newest.scalar_subquery())
    )
    old = [int(i) for i in conn.execute(old_query).scalars()]
    if old:
        for table in (CommandArtifact, CommandResult):
            conn.execute(delete(table).where(table.command_id.in_(old)))
        conn.execute(delete(Command).where(Command.id.in_(old)))
    return cid


def anomaly_of(conn: Connection, run_id: int, anomaly_id: int) -> bool:
    """Whether anomaly `anomaly_id` is one of run `run_id`'s."""
    found = conn.execute(select(Anomaly.id).where(Anomaly.id == anomaly_id, Anomaly.run_id == run_id))
    return found.first() is not None


def asked(row: Any, run: str) -> Asked:
    targets = frozenset(int(r) for r in row.targets) if row.targets is not None else None
    return Asked(int(row.id), run, row.kind, targets, row.expires_at, dict(row.args or {}))


def unexpired(conn: Connection) -> list[tuple[Asked, set[int]]]:
    """The commands not expired yet, each with the ranks that answered it (one query each table)."""
    rows = conn.execute(
        select(Command.__table__, Run.name.label("run_name"))
        .join(Run, Run.id == Command.run_id)
        .where(Command.expires_at > now())
    ).all()
    if not rows:
        return []
    answered: dict[int, set[int]] = {int(r.id): set() for r in rows}
    for cid, rank in conn.execute(
        select(CommandResult.command_id, CommandResult.rank).where(CommandResult.command_id.in_(answered))
    ):
        answered[int(cid)].add(int(rank))
    return [(asked(r, r.run_name), answered[int(r.id)]) for r in rows]


def find(conn: Connection, command_id: int, run: str) -> Any:
    """Command `command_id` of run `run` (its row), or 404 naming the command."""
    row = conn.execute(
        select(Command.__table__)
        .join(Run, Run.id == Command.run_id)
        .where(Command.id == command_id, Run.name == run)
    ).first()
    if row is None:
        raise NotFound(f"command {command_id} of run {run!r} not found", field="command_id")
    return row


def answer(
    conn: Connection,
    command: Any,
    rank: int,
    session: str,
    status: str,
    message: str,
    result: dict[str, Any] | None,
) -> bool:
    """Store one rank's answer; False when that rank had answered already (the first counts)."""
    inserted = conn.execute(
        insert_ignore(conn, cast(Table, CommandResult.__table__)).values(
            command_id=command.id, rank=rank, run_id=command.run_id, session=session, status=status,
            message=message, result=result, received_at=now(),
        )
    )  # fmt: skip
    return bool(inserted.rowcount)


def store_artifact(conn: Connection, command: Any, rank: int, data: bytes) -> bool:
    """Store one rank's file; False when that rank had sent one already (the first counts)."""
    inserted = conn.execute(
        insert_ignore(conn, cast(Table, CommandArtifact.__table__)).values(
            command_id=command.id, rank=rank, run_id=command.run_id, size=len(data), data=data,
            received_at=now(),
        )
    )  # fmt: skip
    return bool(inserted.rowcount)


def artifact(conn: Connection, command_id: int, rank: int) -> bytes | None:
    data = conn.execute(
        select(CommandArtifact.data).where(
            CommandArtifact.command_id == command_id, CommandArtifact.rank == rank
        )
    ).scalar()
    return None if data is None else bytes(data)


def artifact_sizes(conn: Connection, command_id: int) -> dict[int, int]:
    found = conn.execute(
        select(CommandArtifact.rank, CommandArtifact.size).where(CommandArtifact.command_id == command_id)
    )
    return {int(rank): int(size) for rank, size in found}


def results(conn: Connection, command_id: int) -> list[Any]:
    query = select(CommandResult.__table__).where(CommandResult.command_id == command_id)
    return list(conn.execute(query.order_by(CommandResult.rank)).all())


def run_ranks(conn: Connection, run_id: int) -> list[int]:
    query = select(Rank.rank).where(Rank.run_id == run_id).order_by(Rank.rank)
    return [int(r) for r in conn.execute(query).scalars()]


def listed(conn: Connection, run_id: int, limit: int = KEPT_PER_RUN) -> list[Any]:
    query = select(Command.__table__).where(Command.run_id == run_id)
    return list(conn.execute(query.order_by(Command.id.desc()).limit(limit)).all())
