"""Alerts: routed anomaly transitions (alert_events) and the delivery outbox (alert_deliveries).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

# JSON on SQLite, JSONB on PostgreSQL (as stepwatch_server.storage.models.JsonType)
JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('alert_deliveries',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('idempotency_key', sa.String(length=64), nullable=False),
    sa.Column('channel', sa.String(length=100), nullable=False),
    sa.Column('event', sa.String(length=16), nullable=False),
    sa.Column('run', sa.String(length=200), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('severity', sa.String(length=16), nullable=False),
    sa.Column('title', sa.Text(), nullable=False),
    sa.Column('anomaly_ids', JSON_TYPE, nullable=False),
    sa.Column('payload', JSON_TYPE, nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deadline_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_attempt_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_status_code', sa.Integer(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alert_deliveries')),
    sa.UniqueConstraint('idempotency_key', name=op.f('uq_alert_deliveries_idempotency_key'))
    )
    op.create_index('ix_alert_deliveries_status_next_attempt_at', 'alert_deliveries', ['status', 'next_attempt_at'], unique=False)
    op.create_table('alert_events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('anomaly_id', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('channel', sa.String(length=100), nullable=False),
    sa.Column('event', sa.String(length=16), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('key', sa.String(length=200), nullable=False),
    sa.Column('severity', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.String(length=200), nullable=True),
    sa.Column('delivery_id', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['anomaly_id'], ['anomalies.id'], name=op.f('fk_alert_events_anomaly_id_anomalies'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['delivery_id'], ['alert_deliveries.id'], name=op.f('fk_alert_events_delivery_id_alert_deliveries'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_alert_events_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alert_events'))
    )
    op.create_index('ix_alert_events_anomaly_id', 'alert_events', ['anomaly_id'], unique=False)
    op.create_index('ix_alert_events_cooldown', 'alert_events', ['channel', 'run_id', 'kind', 'key', 'created_at'], unique=False)
    op.create_index('ix_alert_events_status_id', 'alert_events', ['status', 'id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_alert_events_status_id', table_name='alert_events')
    op.drop_index('ix_alert_events_cooldown', table_name='alert_events')
    op.drop_index('ix_alert_events_anomaly_id', table_name='alert_events')
    op.drop_table('alert_events')
    op.drop_index('ix_alert_deliveries_status_next_attempt_at', table_name='alert_deliveries')
    op.drop_table('alert_deliveries')
