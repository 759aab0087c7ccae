"""Rollups: count/sum/min/max per (series, rank, bucket of 64 steps, incarnation) and per
(series, step, incarnation) over every rank (stepwatch_server/runs/rollups.py).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 18:50:00.000000

The rollups of the values already stored are computed here (one INSERT ... SELECT per kind of row);
`rollup_marks` holds per run the highest step rolled up (runs/rollup_worker.py keeps both up to date).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _stats() -> list[sa.Column[Any]]:
    return [
        sa.Column('n', sa.Integer(), nullable=False),
        sa.Column('total', sa.Double(), nullable=False),
        sa.Column('lo', sa.Double(), nullable=True),
        sa.Column('hi', sa.Double(), nullable=True),
        sa.Column('nonfinite', sa.Integer(), nullable=False),
    ]


def upgrade() -> None:
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
    op.create_table('step_rollups',
    sa.Column('series_id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('step', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('incarnation', sa.Integer(), autoincrement=False, nullable=False),
    *_stats(),
    sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_step_rollups_series_id_series'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('series_id', 'step', 'incarnation', name=op.f('pk_step_rollups')),
    sqlite_with_rowid=False
    )
    op.create_table('rollup_marks',
    sa.Column('run_id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('rolled_to', sa.BigInteger(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_rollup_marks_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_rollup_marks'))
    )
    finite = 'abs(value) < 1e308'  # false for NULL (SQLite's NaN), NaN and infinities on both backends
    stats = (
        f'sum(CASE WHEN {finite} THEN 1 ELSE 0 END), coalesce(sum(CASE WHEN {finite} THEN value END), 0), '
        f'min(CASE WHEN {finite} THEN value END), max(CASE WHEN {finite} THEN value END), '
        f'sum(CASE WHEN {finite} THEN 0 ELSE 1 END)'
    )
    columns = 'series_id, rank, bucket, incarnation, n, total, lo, hi, nonfinite'
    op.execute(
        f'INSERT INTO rollups ({columns}) SELECT series_id, rank, step / 64, incarnation, {stats} '
        'FROM points GROUP BY series_id, rank, step / 64, incarnation'
    )
    op.execute(
        f'INSERT INTO step_rollups (series_id, step, incarnation, n, total, lo, hi, nonfinite) '
        f'SELECT series_id, step, incarnation, {stats} FROM points GROUP BY series_id, step, incarnation'
    )
    op.execute(
        'INSERT INTO rollup_marks (run_id, rolled_to) SELECT series.run_id, max(points.step) '
        'FROM points JOIN series ON series.id = points.series_id GROUP BY series.run_id'
    )


def downgrade() -> None:
    op.drop_table('rollup_marks')
    op.drop_table('step_rollups')
    op.drop_table('rollups')
