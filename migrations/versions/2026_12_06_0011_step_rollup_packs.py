"""Step rollups of compacted steps packed: `step_rollup_packs`, one row per (series, 256-step bucket,
incarnation) holding each step's figures encoded (stepwatch_server/runs/step_packs.py). Compaction moves a
bucket's `step_rollups` rows there from now on; this moves the rows of the steps already compacted (each
run's steps up to its `compacted_to`), a window of buckets at a time. The downgrade turns every pack back
into rows.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from stepwatch_server.runs import step_packs
from stepwatch_server.runs.rollups import NO_LIMIT

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WINDOW_STEPS = 64 * step_packs.BUCKET_STEPS  # steps packed per statement group: ~16k step rollup rows a series


def upgrade() -> None:
    op.create_table(
        'step_rollup_packs',
        sa.Column('series_id', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('bucket', sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column('incarnation', sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('first_step', sa.BigInteger(), nullable=False),
        sa.Column('last_step', sa.BigInteger(), nullable=False),
        sa.Column('n_values', sa.BigInteger(), nullable=False),
        sa.Column('data', sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ['series_id'], ['series.id'], name=op.f('fk_step_rollup_packs_series_id_series'), ondelete='CASCADE'
        ),
        sa.PrimaryKeyConstraint('series_id', 'bucket', 'incarnation', name=op.f('pk_step_rollup_packs')),
    )  # with rowids on SQLite, as rank_rollup_packs (storage/models.py)
    conn = op.get_bind()
    runs = conn.execute(sa.text('SELECT id, compacted_to FROM runs WHERE compacted_to IS NOT NULL ORDER BY id')).all()
    for run_id, compacted_to in runs:
        ids = list(conn.execute(sa.text('SELECT id FROM series WHERE run_id = :run'), {'run': run_id}).scalars())
        low = conn.execute(
            sa.text('SELECT min(step) FROM step_rollups WHERE series_id IN (SELECT id FROM series WHERE run_id = :run)'),
            {'run': run_id},
        ).scalar()
        if not ids or low is None:
            continue
        start = int(low) // step_packs.BUCKET_STEPS * step_packs.BUCKET_STEPS
        for first in range(start, int(compacted_to) + 1, WINDOW_STEPS):
            step_packs.pack(conn, ids, first, min(first + WINDOW_STEPS - 1, int(compacted_to)))


def downgrade() -> None:
    conn = op.get_bind()
    series = conn.execute(sa.text('SELECT DISTINCT series_id FROM step_rollup_packs ORDER BY 1')).scalars().all()
    for sid in series:
        step_packs.unpack(conn, [int(sid)], 0, NO_LIMIT)
    op.drop_table('step_rollup_packs')
