"""Commands: evidence asked of a run's ranks (`commands`), each rank's answer (`command_results`) and the
files they uploaded (`command_artifacts`: profiler traces), stepwatch_server/commands/.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 08:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        'commands',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('kind', sa.String(length=32), nullable=False),
        sa.Column('targets', JSON_TYPE, nullable=True),
        sa.Column('ranks', sa.Integer(), nullable=False),
        sa.Column('args', JSON_TYPE, nullable=False),
        sa.Column('requested_by', sa.String(length=200), nullable=False),
        sa.Column('reason', sa.String(length=200), nullable=False),
        sa.Column('anomaly_id', sa.Integer(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_commands_run_id_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_commands')),
    )
    op.create_index('ix_commands_run_id_created_at', 'commands', ['run_id', 'created_at'], unique=False)
    op.create_table(
        'command_results',
        sa.Column('command_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('session', sa.String(length=64), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('message', sa.Text(), nullable=False),
        sa.Column('result', JSON_TYPE, nullable=True),
        sa.Column('received_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ['command_id'], ['commands.id'], name=op.f('fk_command_results_command_id_commands'), ondelete='CASCADE'
        ),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_command_results_run_id_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('command_id', 'rank', name=op.f('pk_command_results')),
    )


    op.create_table(
        'command_artifacts',
        sa.Column('command_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('size', sa.Integer(), nullable=False),
        sa.Column('data', sa.LargeBinary(), nullable=False),
        sa.Column('received_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ['command_id'], ['commands.id'], name=op.f('fk_command_artifacts_command_id_commands'), ondelete='CASCADE'
        ),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_command_artifacts_run_id_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('command_id', 'rank', name=op.f('pk_command_artifacts')),
    )


def downgrade() -> None:
    op.drop_table('command_artifacts')
    op.drop_table('command_results')
    op.drop_index('ix_commands_run_id_created_at', table_name='commands')
    op.drop_table('commands')
