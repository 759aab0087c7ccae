"""Compact storage of older values: `blocks`, one compressed block of a rank's values of every series
over one 256-step bucket (stepwatch_server/storage/codec.py, runs/compaction.py), and `runs.compacted_to`:
no block holds a step above it. NULL: the run has no block. Existing rows are moved by the
compaction worker in the background, not by this migration (a big database would hold the upgrade for
hours).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 21:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'blocks',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('bucket', sa.BigInteger(), nullable=False),
        sa.Column('incarnation', sa.Integer(), nullable=False),
        sa.Column('n_values', sa.Integer(), nullable=False),
        sa.Column('data', sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_blocks_run_id_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'rank', 'bucket', 'incarnation', name=op.f('pk_blocks')),
        sqlite_with_rowid=False,
    )
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('compacted_to', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('compacted_to')
    op.drop_table('blocks')
