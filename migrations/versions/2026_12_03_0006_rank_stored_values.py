"""How much each rank of a run stores: `ranks.stored_values`, the values, fingerprints and events written
for it (the `rows` of its ingest answers), kept by the rank UPDATE each stored batch already runs
(stepwatch_server/ingest/store.py), so a run's disk use is a sum over its ranks (README "Disk use and
deleting a run").

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 18:00:00.000000

The counts of the data already stored are the sums of its idempotency records' `rows`, one UPDATE.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('ranks') as batch:
        batch.add_column(sa.Column('stored_values', sa.BigInteger(), server_default=sa.text('0'), nullable=False))
    op.execute(
        'UPDATE ranks SET stored_values = (SELECT coalesce(sum(b.rows), 0) FROM batches b '
        'JOIN sessions s ON s.id = b.session_id WHERE s.run_id = ranks.run_id AND s.rank = ranks.rank)'
    )


def downgrade() -> None:
    with op.batch_alter_table('ranks') as batch:
        batch.drop_column('stored_values')
