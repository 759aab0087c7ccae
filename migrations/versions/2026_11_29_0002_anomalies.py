"""Anomalies found by the detectors: one row per (run, kind, key, first step), upserted.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 18:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# JSON on SQLite, JSONB on PostgreSQL (as stepwatch_server.storage.models.JsonType)
JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('anomalies',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('key', sa.String(length=200), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('severity', sa.String(length=16), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=True),
    sa.Column('node', sa.String(length=200), nullable=True),
    sa.Column('first_step', sa.BigInteger(), nullable=False),
    sa.Column('last_step', sa.BigInteger(), nullable=False),
    sa.Column('detected_step', sa.BigInteger(), nullable=False),
    sa.Column('detected_ts', sa.Double(), nullable=False),
    sa.Column('first_ts', sa.Double(), nullable=False),
    sa.Column('last_ts', sa.Double(), nullable=False),
    sa.Column('resolved_step', sa.BigInteger(), nullable=True),
    sa.Column('resolved_ts', sa.Double(), nullable=True),
    sa.Column('summary', sa.Text(), nullable=False),
    sa.Column('evidence', JSON_TYPE, nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_anomalies_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_anomalies')),
    sa.UniqueConstraint('run_id', 'kind', 'key', 'first_step', name=op.f('uq_anomalies_run_id_kind_key_first_step'))
    )
    op.create_index('ix_anomalies_run_id_status', 'anomalies', ['run_id', 'status'], unique=False)
    op.create_index('ix_anomalies_status', 'anomalies', ['status'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_anomalies_status', table_name='anomalies')
    op.drop_index('ix_anomalies_run_id_status', table_name='anomalies')
    op.drop_table('anomalies')
