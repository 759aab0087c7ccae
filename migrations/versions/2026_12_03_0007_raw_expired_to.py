"""Retention of raw per-rank data: `runs.raw_expired_to`, the last step whose values, step times and
fingerprints were deleted by retention (stepwatch_server/runs/expiry.py); reads of the steps up to it
come from the rollups. NULL: nothing expired.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 18:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('raw_expired_to', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('raw_expired_to')
