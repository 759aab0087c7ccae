"""Blocks with rowids on SQLite: `blocks` becomes a table with rowids (its key a separate index), as
`rank_rollup_packs` and `step_rollup_packs` are. A WITHOUT ROWID row over ~1 KB keeps ~490 bytes in the
b-tree and the rest on overflow pages of its own, the last one part-filled: blocks of 4-6 KB took 1.3-1.5
times their bytes on disk, with rowids ~1.08 (stepwatch_server/storage/models.py `ValueBlock`). SQLite
cannot change a table's kind in place, so the blocks are copied into a new table by one INSERT ... SELECT
(no Python a row: the file's speed; the old table's pages are free for later writes, and `VACUUM` gives
them back). PostgreSQL has no such kind: nothing to do there. A downgrade copies them back.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-08 01:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0016'
down_revision: str | None = '0015'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = 'run_id, rank, bucket, incarnation, n_values, data, tail'
_NEW = '_blocks_0016'


def _rebuild(with_rowid: bool) -> None:
    """Copy `blocks` into a table of the same columns and key, with rowids or without, in key order."""
    if op.get_bind().dialect.name != 'sqlite':
        return
    op.create_table(
        _NEW,
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('bucket', sa.BigInteger(), nullable=False),
        sa.Column('incarnation', sa.Integer(), nullable=False),
        sa.Column('n_values', sa.Integer(), nullable=False),
        sa.Column('data', sa.LargeBinary(), nullable=False),
        sa.Column('tail', sa.LargeBinary(), nullable=True),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name='fk_blocks_run_id_runs', ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'rank', 'bucket', 'incarnation', name='pk_blocks'),
        sqlite_with_rowid=with_rowid,
    )
    op.execute(
        f'INSERT INTO {_NEW} ({_COLUMNS}) SELECT {_COLUMNS} FROM blocks ORDER BY run_id, rank, bucket, incarnation'
    )
    op.drop_table('blocks')
    op.rename_table(_NEW, 'blocks')


def upgrade() -> None:
    _rebuild(with_rowid=True)


def downgrade() -> None:
    _rebuild(with_rowid=False)
