"""Blocks split where PostgreSQL stores them out of line: `blocks.tail` holds a block's whole TOAST chunks
(stored out of line, uncompressed: the bytes are zstd's already), `blocks.data` the rest, kept in the row
(stepwatch_server/storage/blocks.py `insert_rows`). Blocks written before keep all their bytes in `data`
(`tail` NULL) and read the same; SQLite keeps every block whole.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 19:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0012'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('blocks', sa.Column('tail', sa.LargeBinary(), nullable=True))
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('ALTER TABLE blocks ALTER COLUMN tail SET STORAGE EXTERNAL')
        op.execute('ALTER TABLE blocks ALTER COLUMN data SET STORAGE MAIN')


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('UPDATE blocks SET data = data || tail, tail = NULL WHERE tail IS NOT NULL')
        op.execute('ALTER TABLE blocks ALTER COLUMN data SET STORAGE EXTENDED')
    with op.batch_alter_table('blocks') as batch:
        batch.drop_column('tail')
