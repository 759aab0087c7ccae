"""Rank rollups in levels: per (series, level, rank, bucket of 64 << level steps, incarnation), so a
heatmap of a long run reads one row per cell of the coarsest level that still gives it enough
columns, instead of grouping every 64-step bucket in SQL (stepwatch_server/runs/rollups.py).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 00:10:00.000000

The table `rollups` becomes `rank_rollups`: its rows are copied as level 0, and each coarser level is
summed from the one below it for the buckets wholly up to the run's watermark (as the rollup worker
keeps them), one INSERT ... SELECT per level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEVELS = 13  # runs/rollups.py at this revision: levels 0..12, buckets of 64 .. 262,144 steps
BUCKET_STEPS = 64
COLUMNS = 'series_id, level, rank, bucket, incarnation, n, total, lo, hi, nonfinite'
KEY = 'series_id, rank, bucket, incarnation'
STATS = 'n, total, lo, hi, nonfinite'


def _stats() -> list[sa.Column[Any]]:
    return [
        sa.Column('n', sa.Integer(), nullable=False),
        sa.Column('total', sa.Double(), nullable=False),
        sa.Column('lo', sa.Double(), nullable=True),
        sa.Column('hi', sa.Double(), nullable=True),
        sa.Column('nonfinite', sa.Integer(), nullable=False),
    ]


def upgrade() -> None:
    op.create_table('rank_rollups',
    sa.Column('series_id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('level', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('rank', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('bucket', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('incarnation', sa.Integer(), autoincrement=False, nullable=False),
    *_stats(),
    sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_rank_rollups_series_id_series'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('series_id', 'level', 'rank', 'bucket', 'incarnation', name=op.f('pk_rank_rollups')),
    sqlite_with_rowid=False
    )
    op.execute(f'INSERT INTO rank_rollups ({COLUMNS}) SELECT series_id, 0, rank, bucket, incarnation, {STATS} FROM rollups')
    for level in range(1, LEVELS):
        width = BUCKET_STEPS << level
        op.execute(
            f'INSERT INTO rank_rollups ({COLUMNS}) '
            f'SELECT r.series_id, {level}, r.rank, r.bucket / 2, r.incarnation, '
            'sum(r.n), sum(r.total), min(r.lo), max(r.hi), sum(r.nonfinite) FROM rank_rollups r '
            'JOIN series ON series.id = r.series_id JOIN rollup_marks m ON m.run_id = series.run_id '
            f'WHERE r.level = {level - 1} AND (r.bucket / 2 + 1) * {width} <= m.rolled_to + 1 '
            'GROUP BY r.series_id, r.rank, r.bucket / 2, r.incarnation'
        )
    op.drop_table('rollups')


def downgrade() -> None:
    op.create_table('rollups',
    sa.Column('series_id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('rank', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('bucket', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('incarnation', sa.Integer(), autoincrement=False, nullable=False),
    *_stats(),
    sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_rollups_series_id_series'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('series_id', 'rank', 'bucket', 'incarnation', name=op.f('pk_rollups')),
    sqlite_with_rowid=False
    )
    op.execute(f'INSERT INTO rollups ({KEY}, {STATS}) SELECT {KEY}, {STATS} FROM rank_rollups WHERE level = 0')
    op.drop_table('rank_rollups')
