"""Rank rollups packed: `rank_rollup_packs`, one row per (series, level, bucket, incarnation) holding every
rank's figures encoded (stepwatch_server/runs/rank_packs.py), replaces `rank_rollups` (a row per rank,
~40 bytes on SQLite and ~136 on PostgreSQL each). The rows are moved here, one series and level at a
time, and the old table dropped; a rank rollup row is ~1/30 of the values it sums (bench/README.md
"Storage"), so this takes seconds where the compaction of the values themselves takes minutes.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06 06:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import sqlalchemy as sa
from alembic import op

from stepwatch_server.runs import rank_packs
from stepwatch_server.runs.queries import fetch_columns

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = 'series_id, rank, bucket, incarnation, n, total, lo, hi, nonfinite'


def _stats() -> list[sa.Column[Any]]:
    return [
        sa.Column('n', sa.Integer(), nullable=False),
        sa.Column('total', sa.Double(), nullable=False),
        sa.Column('lo', sa.Double(), nullable=True),
        sa.Column('hi', sa.Double(), nullable=True),
        sa.Column('nonfinite', sa.Integer(), nullable=False),
    ]


def upgrade() -> None:
    op.create_table(
        'rank_rollup_packs',
        sa.Column('series_id', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('level', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('bucket', sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column('incarnation', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('ranks', sa.Integer(), nullable=False),
        sa.Column('data', sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ['series_id'], ['series.id'], name=op.f('fk_rank_rollup_packs_series_id_series'), ondelete='CASCADE'
        ),
        sa.PrimaryKeyConstraint('series_id', 'level', 'bucket', 'incarnation', name=op.f('pk_rank_rollup_packs')),
    )  # with rowids on SQLite: a pack of ~1-4 KB stays in the table's pages (storage/models.py)
    conn = op.get_bind()
    parts = conn.execute(sa.text('SELECT DISTINCT series_id, level FROM rank_rollups ORDER BY 1, 2')).all()
    for sid, level in parts:
        cols = fetch_columns(
            conn,
            sa.text(f'SELECT {COLUMNS} FROM rank_rollups WHERE series_id = :sid AND level = :level'),
            rank_packs.INTEGERS,
            {'sid': sid, 'level': level},
        )
        _write_whole(conn, int(level), cols)
    op.drop_table('rank_rollups')


def _write_whole(conn: sa.Connection, level: int, cols: list[np.ndarray]) -> None:
    """The packs of `cols` at `level`, each whole, as this revision's table holds them (0013 adds parts)."""
    rows = rank_packs.rows(level, cols, parts=False)
    if rows:
        conn.execute(
            sa.text(
                'INSERT INTO rank_rollup_packs (series_id, level, bucket, incarnation, ranks, data) '
                'VALUES (:series_id, :level, :bucket, :incarnation, :ranks, :data)'
            ).bindparams(sa.bindparam('data', type_=sa.LargeBinary())),
            rows,
        )


def downgrade() -> None:
    op.create_table(
        'rank_rollups',
        sa.Column('series_id', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('level', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('rank', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('bucket', sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column('incarnation', sa.Integer(), autoincrement=False, nullable=False),
        *_stats(),
        sa.ForeignKeyConstraint(
            ['series_id'], ['series.id'], name=op.f('fk_rank_rollups_series_id_series'), ondelete='CASCADE'
        ),
        sa.PrimaryKeyConstraint(
            'series_id', 'level', 'rank', 'bucket', 'incarnation', name=op.f('pk_rank_rollups')
        ),
        sqlite_with_rowid=False,
    )
    conn = op.get_bind()
    insert = sa.text(
        f'INSERT INTO rank_rollups (level, {COLUMNS}) '
        'VALUES (:level, :series_id, :rank, :bucket, :incarnation, :n, :total, :lo, :hi, :nonfinite)'
    )
    levels = conn.execute(sa.text('SELECT DISTINCT series_id, level FROM rank_rollup_packs ORDER BY 1, 2')).all()
    for sid, level in levels:
        found = conn.execute(
            sa.text(
                'SELECT series_id, bucket, incarnation, data FROM rank_rollup_packs '
                'WHERE series_id = :sid AND level = :level'
            ),
            {'sid': sid, 'level': level},
        ).all()
        cols = rank_packs.unpack(found)
        rows = [
            dict(zip(COLUMNS.split(', '), row, strict=True)) | {'level': level}
            for row in zip(*(c.tolist() for c in cols), strict=True)
        ]
        for row in rows:
            for name in ('lo', 'hi'):
                row[name] = None if np.isnan(row[name]) else row[name]
        if rows:
            conn.execute(insert, rows)
    op.drop_table('rank_rollup_packs')
