"""The initial schema: runs, ranks, sessions, batches, series, points, steps, fingerprints, events.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 14:53:51.316243
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# JSON on SQLite, JSONB on PostgreSQL (as stepwatch_server.storage.models.JsonType)
JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('runs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('world_size', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs')),
    sa.UniqueConstraint('name', name=op.f('uq_runs_name'))
    )
    op.create_table('events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('step', sa.BigInteger(), nullable=False),
    sa.Column('incarnation', sa.Integer(), nullable=False),
    sa.Column('ts', sa.Double(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('data', JSON_TYPE, nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_events_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    op.create_index('ix_events_run_id_kind_step', 'events', ['run_id', 'kind', 'step'], unique=False)
    op.create_table('fingerprints',
    sa.Column('run_id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('rank', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('step', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('incarnation', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('replica_group', sa.Integer(), nullable=False),
    sa.Column('shard', sa.Integer(), nullable=False),
    sa.Column('value', sa.String(length=16), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_fingerprints_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'rank', 'step', 'incarnation', name=op.f('pk_fingerprints')),
    sqlite_with_rowid=False
    )
    op.create_table('ranks',
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('node', sa.String(length=200), nullable=True),
    sa.Column('local_rank', sa.Integer(), nullable=True),
    sa.Column('world_size', sa.Integer(), nullable=False),
    sa.Column('replica_group', sa.Integer(), nullable=False),
    sa.Column('shard', sa.Integer(), nullable=False),
    sa.Column('num_shards', sa.Integer(), nullable=False),
    sa.Column('incarnation', sa.Integer(), nullable=False),
    sa.Column('last_step', sa.BigInteger(), nullable=True),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('phase', sa.String(length=200), nullable=True),
    sa.Column('agent_version', sa.String(length=64), nullable=True),
    sa.Column('agent_counters', JSON_TYPE, nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_ranks_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'rank', name=op.f('pk_ranks'))
    )
    op.create_table('series',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('stat', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_series_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_series')),
    sa.UniqueConstraint('run_id', 'stat', 'name', name=op.f('uq_series_run_id_stat_name'))
    )
    op.create_table('sessions',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=False),
    sa.Column('incarnation', sa.Integer(), nullable=False),
    sa.Column('first_step', sa.BigInteger(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_sessions_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sessions')),
    sa.UniqueConstraint('run_id', 'rank', 'incarnation', name=op.f('uq_sessions_run_id_rank_incarnation'))
    )
    op.create_table('steps',
    sa.Column('run_id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('rank', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('step', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('incarnation', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('ts', sa.Double(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_steps_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'rank', 'step', 'incarnation', name=op.f('pk_steps')),
    sqlite_with_rowid=False
    )
    op.create_table('batches',
    sa.Column('session_id', sa.String(length=64), nullable=False),
    sa.Column('seq', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('received_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('rows', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_batches_session_id_sessions'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('session_id', 'seq', name=op.f('pk_batches'))
    )
    op.create_table('points',
    sa.Column('series_id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('rank', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('step', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('incarnation', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('value', sa.Double(), nullable=True),
    sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_points_series_id_series'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('series_id', 'rank', 'step', 'incarnation', name=op.f('pk_points')),
    sqlite_with_rowid=False
    )


def downgrade() -> None:
    op.drop_table('points')
    op.drop_table('batches')
    op.drop_table('steps')
    op.drop_table('sessions')
    op.drop_table('series')
    op.drop_table('ranks')
    op.drop_table('fingerprints')
    op.drop_index('ix_events_run_id_kind_step', table_name='events')
    op.drop_table('events')
    op.drop_table('runs')
